"""PagedCache against DynamicCache across generate() features, on Llama and on Mistral with a sliding window.

Every comparison runs the same tiny model twice, once per cache, and asserts identical tokens and fp32 logits
within 1e-4; both the stock attention (sdpa) and ``attn_implementation="paged"`` are covered. Every test releases
its caches and checks that the pool holds no block and passes its invariant checks.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from models import FIRST_TOKEN, PAD, VOCAB, WINDOW, tiny_model, tiny_tokenizer
from paged_checks import (
    assert_close_where,
    assert_same_generation,
    batch,
    dynamic,
    generate,
    group_used,
    release_and_check,
    sliding_bound,
    spy_paged_attention,
)
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer
from transformers.generation.streamers import BaseStreamer

from pagedcore import InvalidBlockError, OutOfBlocksError, PagedCoreError, PoolMismatchError
from pagedcore.adapters.transformers import PagedCache, PagedKVPool

MODES = ["sdpa", "paged"]
LLAMA_AND_SLIDING = ["llama", "mistral"]  # mistral: every layer slides over a window of WINDOW tokens


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def model_for(family: str, mode: str, seed: int = 0, layers: int = 2) -> torch.nn.Module:
    return tiny_model(family, attn_implementation=mode, seed=seed, num_hidden_layers=layers)


def paged(model, block_size: int = 4, num_blocks: int = 128) -> PagedCache:
    return PagedCache(model, num_blocks=num_blocks, block_size=block_size)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as generate() makes them from a left-padded mask."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


# ------------------------------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", LLAMA_AND_SLIDING)
def test_seeded_sampling_matches(family, mode):
    model = model_for(family, mode)
    ids, mask = batch([0, 5], 10, seed=2)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 16, "do_sample": True, "seed": 11}
    cache = paged(model)
    got = generate(model, cache, **kwargs)
    assert_same_generation(got, generate(model, dynamic(model), **kwargs))
    assert got.sequences[:, 10:].unique().numel() > 4  # really sampled something varied
    release_and_check(cache)


@pytest.mark.parametrize("mode", MODES)
def test_sampling_with_num_return_sequences(mode):
    model = model_for("llama", mode)
    ids, mask = batch([0, 4], 9, seed=3)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 14, "do_sample": True, "seed": 5}
    cache = paged(model)
    got = generate(model, cache, num_return_sequences=3, **kwargs)
    want = generate(model, dynamic(model), num_return_sequences=3, **kwargs)
    assert_same_generation(got, want)
    assert got.sequences.shape[0] == 6
    assert cache.row_padding() == [0, 0, 0, 4, 4, 4]
    assert len({tuple(s) for s in got.sequences[:3, 9:].tolist()}) > 1  # the three samples of a prompt differ
    release_and_check(cache)


# ---------------------------------------------------------------------------------------------------- beam search
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", LLAMA_AND_SLIDING)
def test_beam_search_matches_and_shares_blocks(family, mode):
    model = model_for(family, mode)
    ids, mask = batch([0, 3], 9, seed=4)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 15, "do_sample": False}
    kwargs |= {"num_beams": 3, "num_return_sequences": 2, "output_scores": True}
    cache = paged(model)
    reorders: list[tuple[int, int]] = []  # (free blocks before, after) of every reorder_cache
    original = cache.reorder_cache

    def spying_reorder(beam_idx):
        before = cache.pool.kv.groups[0].block_manager.num_free_blocks
        original(beam_idx)
        reorders.append((before, cache.pool.kv.groups[0].block_manager.num_free_blocks))

    cache.reorder_cache = spying_reorder
    got = generate(model, cache, **kwargs)
    want = generate(model, dynamic(model), **kwargs)

    assert_same_generation(got, want)
    torch.testing.assert_close(got.sequences_scores, want.sequences_scores, atol=1e-4, rtol=0)
    assert reorders, "beam search never reordered the cache"
    assert all(after >= before for before, after in reorders), "reorder_cache allocated blocks"
    # Beams share their common history: more block references are held than distinct blocks are in use.
    assert cache.memory_stats().blocks > cache.pool.kv.num_used_blocks
    release_and_check(cache)


@pytest.mark.parametrize("mode", MODES)
def test_reorder_cache_shares_blocks_then_copies_on_write(mode):
    model = model_for("llama", mode)
    ids, mask = batch([0, 2, 5], 10, seed=5)
    cache, ref = paged(model), dynamic(model)
    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=cache)
    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=ref)
    bm = cache.pool.kv.groups[0].block_manager
    used_before = bm.num_used_blocks
    row2_blocks = -(-(10 - 5) // 4)

    beam_idx = torch.tensor([0, 0, 1])
    cache.reorder_cache(beam_idx)
    ref.reorder_cache(beam_idx)

    assert bm.num_used_blocks == used_before - row2_blocks  # old row 2 went back, nothing was allocated
    assert cache.memory_stats().blocks == 3 + 3 + 2  # new rows 0 and 1 both reference old row 0's three blocks
    assert cache.row_tokens() == [10, 10, 8] and cache.row_padding() == [0, 0, 2]
    new_mask = torch.cat([mask[beam_idx], torch.ones(3, 3, dtype=mask.dtype)], 1)
    new_ids = torch.randint(FIRST_TOKEN, VOCAB, (3, 3), generator=torch.Generator().manual_seed(6))
    step = {"input_ids": new_ids, "attention_mask": new_mask, "position_ids": positions(new_mask)[:, -3:]}
    assert_close_where(model(**step, cache=cache).logits, model(**step, cache=ref).logits, torch.ones(3, 3))
    # Rows 0 and 1 (13 tokens, 4 blocks each) still share their two full blocks; the partly filled third one was
    # copied on the first write; row 2 grew to 11 tokens (3 blocks).
    assert cache.memory_stats().blocks == 4 + 4 + 3
    assert bm.num_used_blocks == 2 + 2 * 2 + 3
    release_and_check(cache)


# ------------------------------------------------------------------------------- assisted and prompt-lookup decoding
def _spy_crops(cache: PagedCache) -> list[int]:
    crops: list[int] = []
    original = cache.crop

    def spying_crop(tokens_to_remove):
        crops.append(tokens_to_remove)
        original(tokens_to_remove)

    cache.crop = spying_crop
    return crops


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", LLAMA_AND_SLIDING)
def test_assisted_decoding_matches(family, mode):
    model = model_for(family, mode)
    assistant = model_for(family, mode, seed=1, layers=1)  # another tiny model: many drafts get rejected
    ids, mask = batch([0], 10, seed=7)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 24, "do_sample": False}
    cache = paged(model)
    crops = _spy_crops(cache)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers warns about its own generation_config handling
        got = generate(model, cache, assistant_model=assistant, **kwargs)
        want = generate(model, dynamic(model), assistant_model=assistant, **kwargs)
    assert_same_generation(got, want)
    assert any(n < 0 for n in crops), "no draft token was rejected: crop was not exercised"
    stored = 10 + 24 - 1
    assert cache.get_seq_length() == stored and cache.row_tokens() == [stored]
    for window, used in group_used(cache):
        # Sliding blocks that left the window are given back at every crop, even while past recording is on.
        assert used <= (sliding_bound(WINDOW, 4) if window else -(-stored // 4))
    release_and_check(cache)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", LLAMA_AND_SLIDING)
def test_prompt_lookup_decoding_matches(family, mode):
    model = model_for(family, mode)
    pattern = torch.tensor([[11, 12, 13, 14, 15]])
    ids = torch.cat([pattern, pattern, pattern[:, :3]], 1)  # repeated n-grams: lookup proposes candidates
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "max_new_tokens": 20, "do_sample": False}
    cache = paged(model)
    crops = _spy_crops(cache)
    got = generate(model, cache, prompt_lookup_num_tokens=3, **kwargs)
    assert_same_generation(got, generate(model, dynamic(model), prompt_lookup_num_tokens=3, **kwargs))
    assert crops, "prompt lookup never cropped the cache"
    assert cache.get_seq_length() == ids.shape[1] + 20 - 1
    release_and_check(cache)


# ----------------------------------------------------------------------------------------- streaming and stopping
class CollectingStreamer(BaseStreamer):
    def __init__(self) -> None:
        self.chunks: list[list[int]] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append(value.flatten().tolist())

    def end(self) -> None:
        self.ended = True


@pytest.mark.parametrize("mode", MODES)
def test_streamer_sees_the_same_tokens(mode):
    model = model_for("llama", mode)
    ids, _ = batch([0], 7, seed=8)
    streamed = []
    outputs = []
    for cache in (paged(model), dynamic(model)):
        streamer = CollectingStreamer()
        outputs.append(
            model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, cache=cache, streamer=streamer)
        )
        assert streamer.ended
        streamed.append(streamer.chunks)
        if isinstance(cache, PagedCache):
            release_and_check(cache)
    assert outputs[0].tolist() == outputs[1].tolist()
    assert streamed[0] == streamed[1]
    assert streamed[0][0] == ids[0].tolist()  # the prompt first, then one token per step
    assert [token for chunk in streamed[0][1:] for token in chunk] == outputs[0][0, 7:].tolist()


@pytest.mark.parametrize("mode", MODES)
def test_text_streamer_prints_the_same_text(mode, capsys):
    model = model_for("llama", mode)
    tokenizer = tiny_tokenizer()
    prompt = tokenizer("t5 t17 t42 t99 t7", return_tensors="pt")
    printed = []
    outputs = []
    for cache in (paged(model), dynamic(model)):
        streamer = TextStreamer(tokenizer, skip_prompt=True)
        outputs.append(model.generate(**prompt, max_new_tokens=12, do_sample=False, cache=cache, streamer=streamer))
        printed.append(capsys.readouterr().out)
        if isinstance(cache, PagedCache):
            release_and_check(cache)
    assert outputs[0].tolist() == outputs[1].tolist()
    assert printed[0] == printed[1]
    assert prompt["input_ids"].tolist() == [[5, 17, 42, 99, 7]]
    assert printed[0].strip() == tokenizer.decode(outputs[0][0, 5:])


@pytest.mark.parametrize("mode", MODES)
def test_eos_stops_rows_and_generation(mode):
    model = model_for("llama", mode)
    ids, mask = batch([0, 4], 9, seed=9)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 12, "do_sample": False}
    free_run = model.generate(cache=dynamic(model), **kwargs)
    eos = int(free_run[0, 9 + 3])  # row 0 produces it at step 3
    assert eos not in free_run[1, 9:].tolist()
    kwargs |= {"eos_token_id": eos, "pad_token_id": PAD}
    cache = paged(model)
    got = generate(model, cache, **kwargs)
    assert_same_generation(got, generate(model, dynamic(model), **kwargs))
    assert got.sequences[0, 9 + 4 :].eq(PAD).all()  # row 0 finished; row 1 ran on
    release_and_check(cache)

    # A single row that meets its eos ends the whole generation early.
    single = {**kwargs, "input_ids": ids[:1], "attention_mask": mask[:1]}
    cache = paged(model)
    got = generate(model, cache, **single)
    assert_same_generation(got, generate(model, dynamic(model), **single))
    assert got.sequences.shape[1] == 9 + 4
    assert cache.get_seq_length() == 9 + 3
    release_and_check(cache)


class StopAtLength(StoppingCriteria):
    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


@pytest.mark.parametrize("mode", MODES)
def test_custom_stopping_criteria(mode):
    model = model_for("llama", mode)
    ids, mask = batch([0, 2], 8, seed=10)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 30, "do_sample": False}
    cache = paged(model)
    got = generate(model, cache, stopping_criteria=StoppingCriteriaList([StopAtLength(15)]), **kwargs)
    want = generate(model, dynamic(model), stopping_criteria=StoppingCriteriaList([StopAtLength(15)]), **kwargs)
    assert_same_generation(got, want)
    assert got.sequences.shape[1] == 15
    assert cache.row_tokens() == [14, 12]
    release_and_check(cache)


# ------------------------------------------------------------------------------------ reusing and passing the cache
@pytest.mark.parametrize("follow_up_pads", [[0, 0], [2, 0]], ids=["aligned", "left_padded"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", LLAMA_AND_SLIDING)
def test_conversation_continues_with_the_returned_cache(family, mode, follow_up_pads):
    """Turn two passes the whole history plus new tokens; a shorter new message is left-padded, which puts
    padding in the middle of the mask (the cache then stores every position and attends densely)."""
    model = model_for(family, mode)
    ids, mask = batch([0, 3], 9, seed=12)
    follow_up, follow_up_mask = batch(follow_up_pads, 5, seed=13)

    def converse(cache):
        first = generate(model, cache, input_ids=ids, attention_mask=mask, max_new_tokens=7, do_sample=False)
        history = torch.cat([first.sequences, follow_up], 1)
        history_mask = torch.cat([mask, torch.ones(2, 7, dtype=mask.dtype), follow_up_mask], 1)
        second = generate(
            model, first.cache, input_ids=history, attention_mask=history_mask, max_new_tokens=12, do_sample=False
        )
        return first, second

    cache = paged(model)
    got = converse(cache)
    want = converse(dynamic(model))
    for g, w in zip(got, want):
        assert_same_generation(g, w)
    assert got[0].cache is cache and got[1].cache is cache
    stored = 9 + 7 + 5 + 12 - 1
    assert cache.get_seq_length() == stored
    assert cache.row_padding() == [0, 3] and cache.row_tokens() == [stored, stored - 3]
    release_and_check(cache)


@pytest.mark.parametrize("mode", MODES)
def test_reset_cache_and_shared_pool(mode):
    model = model_for("mistral", mode)
    ids, mask = batch([0, 3], 9, seed=24)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 10, "do_sample": False}
    cache = paged(model)
    first = generate(model, cache, **kwargs)
    cache.reset()  # empty again, and usable for another batch
    assert cache.pool.kv.num_used_blocks == 0 and cache.get_seq_length() == 0
    other_ids, other_mask = batch([1, 0, 4], 11, seed=25)
    other = {**kwargs, "input_ids": other_ids, "attention_mask": other_mask}
    assert_same_generation(generate(model, cache, **other), generate(model, dynamic(model), **other))
    second = PagedCache(model, pool=cache.pool)  # a second cache on the same pool, while the first holds blocks
    assert_same_generation(generate(model, second, **kwargs), first)
    release_and_check(cache, second)


@pytest.mark.parametrize("mode", MODES)
def test_past_key_values_argument(mode):
    model = model_for("llama", mode)
    ids, mask = batch([0, 3], 9, seed=14)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 10, "do_sample": False}
    kwargs |= {"return_dict_in_generate": True, "output_logits": True}
    cache = paged(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated in favour of cache=
        got = model.generate(past_key_values=cache, **kwargs)
        want = model.generate(past_key_values=dynamic(model), **kwargs)
    assert_same_generation(got, want)
    assert got.cache is cache
    assert cache.get_seq_length() == 9 + 10 - 1
    release_and_check(cache)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", LLAMA_AND_SLIDING)
def test_forward_in_chunks_with_padding(family, mode, monkeypatch):
    """model(...) directly: multi-token queries on a warm cache, across blocks and the window."""
    model = model_for(family, mode)
    ids, mask = batch([0, 3, 6], 20, seed=15)
    cache, ref = paged(model), dynamic(model)
    calls = spy_paged_attention(monkeypatch)
    for start, end in [(0, 7), (7, 8), (8, 14), (14, 15), (15, 20)]:
        step = {
            "input_ids": ids[:, start:end],
            "attention_mask": mask[:, :end],
            "position_ids": positions(mask[:, :end])[:, start:end],
        }
        assert_close_where(model(**step, cache=cache).logits, model(**step, cache=ref).logits, mask[:, start:end])
    assert cache.row_tokens() == [20, 17, 14] and cache.row_padding() == [0, 3, 6]
    assert (calls[0] > 0) == (mode == "paged")
    release_and_check(cache)


@pytest.mark.parametrize("mode", MODES)
def test_forward_without_position_ids_on_a_padded_batch(mode):
    """The model makes arange positions, so the cache cannot see the padding: it must still honour the mask.

    (Before the fix the paged attention attended to the padding the mask hides.)
    """
    model = model_for("llama", mode)
    ids, mask = batch([0, 3], 9, seed=16)
    cache, ref = paged(model), dynamic(model)
    got = model(input_ids=ids, attention_mask=mask, cache=cache).logits
    want = model(input_ids=ids, attention_mask=mask, cache=ref).logits
    assert_close_where(got, want, mask)
    more = torch.randint(FIRST_TOKEN, VOCAB, (2, 2), generator=torch.Generator().manual_seed(17))
    full_mask = torch.cat([mask, torch.ones(2, 2, dtype=mask.dtype)], 1)
    got = model(input_ids=more, attention_mask=full_mask, cache=cache).logits
    want = model(input_ids=more, attention_mask=full_mask, cache=ref).logits
    assert_close_where(got, want, torch.ones(2, 2))
    release_and_check(cache)


# ------------------------------------------------------------------------------------------- crop and batch changes
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", LLAMA_AND_SLIDING)
def test_crop_then_continue(family, mode):
    model = model_for(family, mode)
    ids, mask = batch([0, 3], 22, seed=18)
    cache, ref = paged(model), dynamic(model)
    # Past the window a sliding cache can only be cropped while recording its past (as assisted decoding does).
    cache.activate_past_recording()
    ref.activate_past_recording()

    def forward(start: int, end: int) -> None:
        step = {
            "input_ids": ids[:, start:end],
            "attention_mask": mask[:, :end],
            "position_ids": positions(mask[:, :end])[:, start:end],
        }
        assert_close_where(model(**step, cache=cache).logits, model(**step, cache=ref).logits, mask[:, start:end])

    forward(0, 18)
    for c in (cache, ref):
        c.crop(-5)
    assert cache.get_seq_length() == ref.get_seq_length() == 13
    assert cache.row_tokens() == [13, 10]
    for window, used in group_used(cache):
        if window is not None:  # the crop gave back what left the window although the past was being recorded
            assert used <= 2 * sliding_bound(window, 4)
        else:
            assert used == 4 + 3
    forward(13, 22)
    with pytest.raises(ValueError, match="positive"):
        cache.crop(1)
    release_and_check(cache)


def test_crop_past_a_dropped_window_raises_and_changes_nothing():
    model = model_for("mistral", "sdpa")
    ids, mask = batch([10, 0], 14, seed=26)
    cache, ref = paged(model), dynamic(model)
    for c in (cache, ref):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache=c)
    before = (cache.get_seq_length(), cache.row_tokens(), cache.row_padding(), cache.memory_stats())
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        ref.crop(-5)  # DynamicCache refuses too
    # Row 0 alone could be cropped; row 1 needs keys that left its window. Nothing may change (it used to crop
    # row 0 and then raise, leaving rows shorter than the cache).
    with pytest.raises(InvalidBlockError, match="activate_past_recording"):
        cache.crop(-5)
    assert (cache.get_seq_length(), cache.row_tokens(), cache.row_padding(), cache.memory_stats()) == before
    release_and_check(cache)


@pytest.mark.parametrize("mode", MODES)
def test_batch_repeat_interleave_and_select_indices(mode):
    model = model_for("llama", mode)
    ids, mask = batch([0, 3], 14, seed=19)
    cache, ref = paged(model), dynamic(model)
    step = {"input_ids": ids, "attention_mask": mask, "position_ids": positions(mask)}
    model(**step, cache=cache)
    model(**step, cache=ref)
    used = cache.pool.kv.num_used_blocks
    refs = cache.memory_stats().blocks

    for c in (cache, ref):
        c.batch_repeat_interleave(2)
    assert cache.batch_size == 4
    assert cache.row_tokens() == [14, 14, 11, 11] and cache.row_padding() == [0, 0, 3, 3]
    assert cache.pool.kv.num_used_blocks == used and cache.memory_stats().blocks == 2 * refs  # shared, not copied

    new = torch.randint(FIRST_TOKEN, VOCAB, (4, 3), generator=torch.Generator().manual_seed(20))
    mask4 = torch.cat([mask.repeat_interleave(2, 0), torch.ones(4, 3, dtype=mask.dtype)], 1)
    step = {"input_ids": new, "attention_mask": mask4, "position_ids": positions(mask4)[:, -3:]}
    assert_close_where(model(**step, cache=cache).logits, model(**step, cache=ref).logits, torch.ones(4, 3))

    keep = torch.tensor([3, 0])
    for c in (cache, ref):
        c.batch_select_indices(keep)
    assert cache.row_tokens() == [14, 17] and cache.row_padding() == [3, 0]
    new = torch.randint(FIRST_TOKEN, VOCAB, (2, 2), generator=torch.Generator().manual_seed(21))
    mask2 = torch.cat([mask4[keep], torch.ones(2, 2, dtype=mask.dtype)], 1)
    step = {"input_ids": new, "attention_mask": mask2, "position_ids": positions(mask2)[:, -2:]}
    assert_close_where(model(**step, cache=cache).logits, model(**step, cache=ref).logits, torch.ones(2, 2))
    with pytest.raises(IndexError):
        cache.batch_select_indices(torch.tensor([5]))
    release_and_check(cache)


# ---------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("mode", MODES)
def test_pool_too_small_for_the_prompt_raises_out_of_blocks(mode):
    model = model_for("llama", mode)
    ids, mask = batch([0, 2], 12, seed=22)
    cache = paged(model, num_blocks=3)  # the prompt alone needs 3 + 3 blocks of 4
    with pytest.raises(OutOfBlocksError, match="larger pool"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, cache=cache)
    release_and_check(cache)


@pytest.mark.parametrize("mode", MODES)
def test_pool_too_small_for_the_generation_raises_out_of_blocks(mode):
    model = model_for("llama", mode)
    ids, mask = batch([0, 2], 12, seed=22)
    cache = paged(model, num_blocks=7)  # the prompt takes 6 blocks; 4 rows' worth of new tokens do not fit
    with pytest.raises(OutOfBlocksError) as info:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, cache=cache)
    assert info.value.requested > info.value.available
    release_and_check(cache)
    # The pool is intact and serves a new cache.
    fresh = PagedCache(model, pool=cache.pool)
    model.generate(input_ids=ids[:1], max_new_tokens=3, do_sample=False, cache=fresh)
    release_and_check(fresh)


def test_pool_of_another_model_raises_pool_mismatch():
    model = model_for("llama", "sdpa")
    for other in (tiny_model("gpt_neox"), tiny_model("llama", num_hidden_layers=3), tiny_model("mistral")):
        pool = PagedKVPool(other, num_blocks=16)
        with pytest.raises(PoolMismatchError, match="cannot serve"):
            PagedCache(model, pool=pool)
        assert pool.kv.num_used_blocks == 0
        pool.check_invariants()


@pytest.mark.parametrize("mode", MODES)
def test_released_cache_raises(mode):
    model = model_for("llama", mode)
    ids, mask = batch([0, 2], 6, seed=23)
    cache = paged(model)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, cache=cache)
    release_and_check(cache)
    with pytest.raises(InvalidBlockError, match="released"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, cache=cache)
    with pytest.raises(PagedCoreError, match="released"):
        model(input_ids=ids, attention_mask=mask, cache=cache)
    for use in (lambda: cache.crop(-1), lambda: cache.reorder_cache(torch.tensor([0, 0]))):
        with pytest.raises(InvalidBlockError, match="released"):
            use()
    assert cache.pool.kv.num_used_blocks == 0
