"""PagedCache on every hybrid family (recurrent-state layers beside attention), against stock ``generate``.

Each family is built tiny with its real layer pattern (:mod:`hybrid_models`) and generates with a ``PagedCache`` and
with transformers' own cache on the same weights, in a stock attention mode and with ``attn_implementation="paged"``:
greedy tokens identical and fp32 logits within 1e-4, for a plain and a left-padded batch (a recurrent state sees no
padding, as in stock, whose layers zero the padding's inputs); then beams, ``num_return_sequences`` with seeded
sampling, a streamer and a stopping criterion, continuing with the returned cache, and assisted decoding (stock's
answer: LFM2's conv-only cache can be cropped, every other family is refused by ``generate`` itself). Every case
checks what the cache holds (real tokens in blocks, one state slot per row) and that releasing it leaves the pool
empty.

MiniMax is compared with its stock model on a cache that fixes two stock faults (``FixedMiniMaxCache``): transformers
5.24's ``MiniMaxCache`` answers mask sizes and the sequence length from layer 0, a linear-attention layer that holds
no keys (so a left-padded batch's decode steps see the padding's keys, and a continued cache is fed its whole prompt
again), and never reorders its linear-attention states for beam search. ``PagedCache`` does what the fixed cache does.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hybrid_models import HYBRID_FAMILIES, NO_ATTENTION, TOKEN_BY_TOKEN, hybrid_config, hybrid_model
from paged_checks import assert_same_generation, batch, generate, spy_paged_attention
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin
from transformers.generation.streamers import BaseStreamer
from transformers.models.minimax.modeling_minimax import MiniMaxCache

from pagedcore import ConfigError, InvalidBlockError, UnsupportedModelError
from pagedcore.adapters.transformers import Engine, PagedCache, PagedKVPool
from pagedcore.adapters.transformers.state_spec import StateSpec

pytestmark = pytest.mark.usefixtures("one_thread")

BATCHES = {"plain": [0, 0], "left_padded": [0, 3]}
# transformers 5.25 counts a linear-attention layer's positions (so generate slices a returned cache's input for every
# model) and rolls recurrent states back through their history (so assisted decoding runs on every hybrid family).
COUNTS_LINEAR = hasattr(LinearAttentionCacheLayerMixin, "increase_count")
CASES = [(f, m) for f in HYBRID_FAMILIES for m in ("stock", "paged") if not (m == "paged" and f in NO_ATTENTION)]
NEW = 6


class FixedMiniMaxCache(MiniMaxCache):
    """Stock's MiniMax cache with its sizes read from its first attention layer and its states reordered for beams."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return Cache.get_seq_length(self, 1) if len(self.layers) > 1 else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return Cache.get_mask_sizes(self, query_length, 1) if len(self.layers) > 1 else (query_length, 0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.linear_cache = [s if isinstance(s, list) else s.index_select(0, beam_idx) for s in self.linear_cache]


@functools.cache
def model_for(family: str, mode: str) -> torch.nn.Module:
    return hybrid_model(family, attn_implementation=None if mode == "stock" else "paged")


def reference_cache(family: str, model: torch.nn.Module) -> Cache:
    return FixedMiniMaxCache() if family == "minimax" else DynamicCache(config=model.config)


def reference(family: str, **kwargs) -> object:
    model = model_for(family, "stock")
    return generate(model, reference_cache(family, model), **kwargs)


def check_released(cache: PagedCache) -> None:
    cache.release()
    pool = cache.pool
    assert pool.kv.num_used_blocks == 0 and pool.kv.states.num_used == 0, "blocks or state slots leaked"
    pool.check_invariants()


@pytest.mark.parametrize("batch_kind", list(BATCHES))
@pytest.mark.parametrize(("family", "mode"), CASES)
def test_greedy_matches_stock(family, mode, batch_kind, monkeypatch):
    pads = BATCHES[batch_kind]
    ids, mask = batch(pads, 10, seed=1)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": NEW, "do_sample": False}
    calls = spy_paged_attention(monkeypatch)
    model = model_for(family, mode)
    cache = PagedCache(model, num_blocks=64, block_size=4)

    out = generate(model, cache, **kwargs)

    assert_same_generation(out, reference(family, **kwargs))
    assert (calls[0] > 0) == (mode == "paged")  # the paged path read the pool
    real = [10 + NEW - 1 - pad for pad in pads]
    assert cache.row_tokens() == real and cache.row_padding() == pads
    stats = cache.memory_stats()
    assert stats.blocks == len(cache.pool.kv.groups) * sum(-(-n // 4) for n in real)  # padding is not stored
    assert stats.state_slots == len(pads) and stats.state_bytes == len(pads) * cache.pool.states.slot_nbytes()
    check_released(cache)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_beams_samples_streamer_and_stopping(family):
    model = model_for(family, "stock")
    ids, mask = batch(BATCHES["left_padded"], 9, seed=2)
    base = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 5}
    for extra in ({"num_beams": 3, "do_sample": False}, {"num_return_sequences": 2, "do_sample": True, "top_k": 20}):
        cache = PagedCache(model, num_blocks=64, block_size=4)
        assert_same_generation(
            generate(model, cache, seed=5, **base, **extra), reference(family, seed=5, **base, **extra)
        )
        check_released(cache)
    seen: list[list[int]] = []
    stop = StoppingCriteriaList([StopAtLength(12)])
    cache = PagedCache(model, num_blocks=64, block_size=4)
    got = generate(model, cache, streamer=Streamer(seen), stopping_criteria=stop, **base, do_sample=False)
    want = reference(family, stopping_criteria=stop, **base, do_sample=False)
    assert_same_generation(got, want)
    assert got.sequences.shape[1] == 12 and torch.equal(
        torch.cat([torch.tensor(s) for s in seen[1:]], 1), got.sequences[:, 9:]
    )
    check_released(cache)


@pytest.mark.parametrize("family", ["qwen3_5", "falcon_h1", "zamba2"])
def test_paged_attention_with_beams_and_samples(family, monkeypatch):
    model = model_for(family, "paged")
    ids, mask = batch(BATCHES["left_padded"], 9, seed=7)
    base = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 5}
    calls = spy_paged_attention(monkeypatch)
    for extra in ({"num_beams": 2, "do_sample": False}, {"num_return_sequences": 2, "do_sample": True, "top_p": 0.9}):
        cache = PagedCache(model, num_blocks=64, block_size=4)
        assert_same_generation(
            generate(model, cache, seed=3, **base, **extra), reference(family, seed=3, **base, **extra)
        )
        check_released(cache)
    assert calls[0] > 0


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_continuing_with_the_returned_cache(family):
    model = model_for(family, "stock")
    ids, _ = batch([0], 9, seed=4)
    cache = PagedCache(model, num_blocks=64, block_size=4)
    first = generate(model, cache, input_ids=ids, max_new_tokens=4, do_sample=False)
    stock_first = reference(family, input_ids=ids, max_new_tokens=4, do_sample=False)
    follow = torch.tensor([[7, 8, 9]])
    # Before transformers 5.25 a model without attention layers continued from the new tokens only (stock generate
    # never sliced its input); since, every model is given the whole sequence, as with attention layers.
    whole = family not in NO_ATTENTION or COUNTS_LINEAR
    more = torch.cat([first.sequences, follow], 1) if whole else follow
    got = generate(model, first.cache, input_ids=more, max_new_tokens=4, do_sample=False)
    want = generate(model, stock_first.cache, input_ids=more, max_new_tokens=4, do_sample=False)
    assert_same_generation(got, want)
    check_released(cache)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_assisted_decoding_does_what_stock_does(family):
    model = model_for(family, "stock")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
    kwargs = {"input_ids": ids, "max_new_tokens": 8, "do_sample": False, "prompt_lookup_num_tokens": 3}
    cache = PagedCache(model, num_blocks=64, block_size=4)
    if family == "lfm2" or (COUNTS_LINEAR and family != "minimax"):
        # Conv states are cropped back through the recorded inputs; recurrent states (transformers 5.25 on) through
        # their recorded values, as stock's layers do.
        assert_same_generation(generate(model, cache, **kwargs), reference(family, **kwargs))
    else:  # stock refuses (before 5.25; MiniMax's cache still): so does generate with ours, with the same words
        with pytest.raises(ValueError) as stock:
            reference(family, **kwargs)
        with pytest.raises(ValueError) as ours:
            generate(model, cache, **kwargs)
        assert str(ours.value) == str(stock.value)
    check_released(cache)


def _cropped(model, prompt, more, **recording):
    """Ours and stock's caches after the same prompt, ``more`` tokens on it and ``crop(-2)``, past recording on."""
    ours, stock = PagedCache(model, num_blocks=32, block_size=4), DynamicCache(config=model.config)
    start = prompt.shape[1]
    for cache in (ours, stock):
        cache.activate_past_recording(**recording)
        model(prompt, cache=cache)
        model(more, cache=cache, position_ids=torch.arange(start, start + more.shape[1])[None])
        cache.crop(-2)
    return ours, stock


def _continue_alike(model, ours, stock, token, position):
    """The next step's logits on both caches agree (a state put back wrong would move them)."""
    step, positions = torch.tensor([[token]]), torch.tensor([[position]])
    got = model(step, cache=ours, position_ids=positions).logits
    want = model(step, cache=stock, position_ids=positions).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    check_released(ours)


def test_crop_of_conv_states_then_continue():
    """LFM2: crop puts every conv state back by the recorded inputs, as transformers' layers do."""
    model = model_for("lfm2", "stock")
    ids, _ = batch([0], 8, seed=3)
    ours, stock = _cropped(model, ids, torch.tensor([[9, 10, 11]]))
    for layer in (0, 2):
        assert torch.equal(ours.layers[layer].conv_states[0], stock.layers[layer].conv_states[0])
    _continue_alike(model, ours, stock, 12, 9)


@pytest.mark.skipif(not COUNTS_LINEAR, reason="transformers before 5.25 keeps no recurrent state history")
def test_crop_of_recurrent_states_then_continue():
    """Qwen3.5: crop puts each recurrent state back to its value before the removed tokens (the intermediate states
    a recording forward hands over), and the conv states by their inputs, as transformers' layers do."""
    model = model_for("qwen3_5", "stock")
    prompt, more = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[10, 11, 12]])
    ours, stock = _cropped(model, prompt, more, recurrent_states_to_keep=3)
    assert ours.is_croppable
    layer = 0  # a linear-attention layer
    torch.testing.assert_close(ours.layers[layer].recurrent_states[0], stock.layers[layer].recurrent_states[0])
    torch.testing.assert_close(ours.layers[layer].conv_states[0], stock.layers[layer].conv_states[0])
    _continue_alike(model, ours, stock, 13, 6)


@pytest.mark.skipif(not COUNTS_LINEAR, reason="transformers before 5.25 keeps no recurrent state history")
def test_a_crop_past_the_recorded_states_is_refused():
    model = model_for("qwen3_5", "stock")
    cache = PagedCache(model, num_blocks=32, block_size=4)
    cache.activate_past_recording(recurrent_states_to_keep=2)
    model(torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13]]), cache=cache)  # recorded: the state before, the last but one
    before = cache.layers[0].recurrent_states[0].clone(), cache.layers[0].conv_states[0].clone()
    with pytest.raises(InvalidBlockError, match="recorded for 2"):
        cache.crop(-3)
    with pytest.raises(InvalidBlockError, match="conv state recorded 9 inputs"):
        cache.crop(-6)  # fewer inputs than the convolution reads would be left
    assert cache.get_seq_length() == 9  # refused crops change nothing
    assert torch.equal(cache.layers[0].recurrent_states[0], before[0])
    assert torch.equal(cache.layers[0].conv_states[0], before[1])
    cache.crop(-2)
    assert cache.get_seq_length() == 7
    check_released(cache)


def test_a_recurrent_state_without_intermediate_states_cannot_be_cropped():
    """MiniMax's layers hand over no intermediate states (its own cache cannot be cropped either)."""
    model = model_for("minimax", "stock")
    cache = PagedCache(model, num_blocks=32, block_size=4)
    cache.activate_past_recording()
    model(torch.tensor([[5, 6, 7, 8, 9]]), cache=cache)
    assert not cache.is_croppable  # what generate asks before it refuses assisted decoding
    with pytest.raises(ValueError, match="cannot be rolled back"):
        cache.crop(-1)
    assert cache.get_seq_length() == 5
    check_released(cache)


def test_forks_share_a_state_slot_until_they_write():
    model = model_for("qwen3_5", "stock")
    cache = PagedCache(model, num_blocks=64, block_size=4)
    model(torch.tensor([[5, 6, 7, 8, 9, 10]]), cache=cache)
    states = cache.pool.kv.states
    cache.batch_repeat_interleave(3)
    assert states.num_used == 1 and cache.memory_stats().state_slots == 3  # one slot, three holders
    twin = cache.fork()
    assert states.num_used == 1
    model(torch.tensor([[11]] * 3), cache=cache, position_ids=torch.tensor([[6]] * 3))
    assert states.num_used == 1 + 3  # each row wrote: its own copy; the fork keeps the first
    torch.testing.assert_close(twin.layers[0].recurrent_states[0][0], twin.layers[0].recurrent_states[0][2])
    twin.release()
    check_released(cache)


def test_state_layers_match_stock_after_the_same_calls():
    model = model_for("falcon_h1", "stock")
    ids, mask = batch([0, 2], 7, seed=6)
    ours, stock = PagedCache(model, num_blocks=32, block_size=4), DynamicCache(config=model.config)
    for cache in (ours, stock):
        model(ids, attention_mask=mask, cache=cache)
    for mine, theirs in zip(ours.layers, stock.layers):
        torch.testing.assert_close(mine.conv_states[0], theirs.conv_states[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(mine.recurrent_states[0], theirs.recurrent_states[0], atol=1e-6, rtol=0)
        assert all(mine.has_previous_state.values())
    assert ours.has_previous_state() and ours.get_seq_length() == 7
    check_released(ours)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_families_chunk_rule_is_their_code(family):
    """``StateSpec.resumes_chunks`` says whether a forward of several tokens on a cached state continues from it;
    checked against each family's modeling code (two pieces against one forward: equal within float rounding, or
    far apart when the second piece drops the state)."""
    model = model_for(family, "stock")
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(ids).logits[0, -1]
        cache = reference_cache(family, model)
        model(ids[:, :8], cache=cache)
        pieces = model(ids[:, 8:], cache=cache, position_ids=torch.arange(8, 12)[None]).logits[0, -1]
    resumes = StateSpec.from_config(model.config).resumes_chunks
    assert resumes == (family not in TOKEN_BY_TOKEN)
    gap = (pieces - whole).abs().max().item()
    assert gap < 1e-3 if resumes else gap > 1e-1


def test_an_unknown_layer_type_is_refused_naming_it():
    config = hybrid_config("qwen3_5")
    config.layer_types = ["linear_attention", "mystery_mixer", "linear_attention", "full_attention"]
    with pytest.raises(UnsupportedModelError, match=r"'qwen3_5_text', layer 1 is 'mystery_mixer'"):
        PagedKVPool(config, num_blocks=8)


def test_a_cache_for_state_layers_needs_the_model_itself():
    pool = PagedKVPool(hybrid_config("qwen3_5"), num_blocks=8, state_slots=2)
    with pytest.raises(ConfigError, match="needs the model itself"):
        PagedCache(pool=pool)
    with pytest.raises(ConfigError, match="needs the model itself"):
        PagedCache(hybrid_config("qwen3_5"), num_blocks=8)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_engine_serves_every_family_as_stock(family):
    """Every family in the fourth mode too (tests/test_hybrid_engine.py tests the Engine in depth)."""
    model = model_for(family, "stock")
    ids, _ = batch([0], 9, seed=8)
    want = reference(family, input_ids=ids, max_new_tokens=NEW, do_sample=False)
    with Engine(model, num_blocks=32, block_size=4, state_slots=8) as engine:
        (out,) = engine.generate([ids[0].tolist()], max_new_tokens=NEW, do_sample=False, use_tqdm=False)
        assert engine.pool.kv.states.num_used == 0
    assert out.token_ids == want.sequences[0, 9:].tolist()


def test_a_pool_sized_by_memory_splits_it_between_blocks_and_state_slots():
    model = model_for("qwen3_5", "stock")
    pool = PagedKVPool(model, memory_budget=1 << 20, block_size=4)
    stats = pool.memory_stats()
    assert stats.state_slots == (1 << 19) // pool.states.slot_nbytes()
    assert stats.capacity_bytes + stats.state_capacity_bytes <= 1 << 20
    assert stats.capacity_bytes >= (1 << 19) - pool.block_bytes(0)
    mamba = PagedKVPool(model_for("mamba2", "stock"), memory_budget=1 << 20, block_size=4)
    assert mamba.memory_stats().state_slots == (1 << 20) // mamba.states.slot_nbytes()  # no attention: all to states


def test_a_config_only_pool_reads_its_state_sizes_off_a_meta_model():
    pool = PagedKVPool(hybrid_config("qwen3_5"), memory_budget=1 << 20, block_size=4, dtype=torch.float32)
    model = model_for("qwen3_5", "stock")
    cache = PagedCache(model, num_blocks=16, block_size=4, state_slots=2)
    model(torch.tensor([[5, 6, 7]]), cache=cache)  # this pool learns its sizes from the first states stored
    assert pool.states.slot_nbytes() == cache.pool.states.slot_nbytes() > 0
    check_released(cache)


class StopAtLength(StoppingCriteria):
    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


class Streamer(BaseStreamer):
    def __init__(self, seen: list[list[int]]) -> None:
        self.seen = seen

    def put(self, value: torch.Tensor) -> None:
        self.seen.append(value.reshape(-1, 1).tolist() if value.dim() == 1 else value.tolist())

    def end(self) -> None:
        pass
