"""PagedCache against DynamicCache on every supported model family, in a stock attention mode and in "paged".

Each case generates greedily on the same tiny model with both caches and asserts identical tokens and fp32 per-step
logits within 1e-4, for a plain batch and a left-padded batch (pad lengths differ per row, one longer than the
sliding window), with block sizes 4 and 16; prompt + generation (31 positions) crosses the sliding window (8) and
block boundaries. It then checks the memory the cache holds and that releasing it leaves the pool empty.
"""

from __future__ import annotations

import functools

import pytest
import torch
from models import (
    FAMILIES,
    NO_KWARGS_FAMILIES,
    NO_PAGED_ATTENTION,
    SLIDING_FAMILIES,
    WINDOW,
    compatible_attn,
    tiny_model,
)
from paged_checks import (
    assert_same_generation,
    batch,
    dynamic,
    generate,
    group_used,
    release_and_check,
    sliding_bound,
    spy_paged_attention,
)
from transformers import AutoConfig, AutoModelForCausalLM

from pagedcore import UnsupportedModelError
from pagedcore.adapters.transformers import PagedCache, PagedKVPool

PROMPT_LEN = 12
NEW_TOKENS = 20
BATCHES = {"plain": [0, 0, 0], "left_padded": [0, 3, 9]}  # 9 > WINDOW: a row whose padding outlasts the window
# (family, mode): every family in a stock attention mode, and in "paged" where its attention can be swapped.
CASES = [(f, m) for f in FAMILIES for m in ("compatible", "paged") if not (m == "paged" and f in NO_PAGED_ATTENTION)]


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def model_for(family: str, mode: str) -> torch.nn.Module:
    return tiny_model(family, attn_implementation=compatible_attn(family) if mode == "compatible" else mode)


@functools.cache
def reference(family: str, mode: str, batch_kind: str) -> object:
    model = model_for(family, mode)
    ids, mask = batch(BATCHES[batch_kind], PROMPT_LEN, seed=1)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": NEW_TOKENS, "do_sample": False}
    return generate(model, dynamic(model), **kwargs)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("batch_kind", list(BATCHES))
@pytest.mark.parametrize(("family", "mode"), CASES)
def test_greedy_matches_dynamic_cache(family, mode, batch_kind, block_size, monkeypatch):
    model = model_for(family, mode)
    pads = BATCHES[batch_kind]
    ids, mask = batch(pads, PROMPT_LEN, seed=1)
    calls = spy_paged_attention(monkeypatch)
    cache = PagedCache(model, num_blocks=64, block_size=block_size)

    out = generate(model, cache, input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)

    assert_same_generation(out, reference(family, mode, batch_kind))
    assert out.cache is cache
    stored = PROMPT_LEN + NEW_TOKENS - 1  # rectangular positions; the last token is never fed back
    assert cache.get_seq_length() == stored
    if mode == "paged":
        # The paged path really read the pool, except for a model whose update lacks kwargs (dense fallback).
        assert (calls[0] == 0) if family in NO_KWARGS_FAMILIES else (calls[0] > 0)
    # Left padding is not stored, also for the models whose update gets no position_ids (GPT-NeoX, Falcon, Bloom,
    # GPT-Neo, CTRL): the model's forward pre-hook tells the cache each forward's attention mask.
    real = [stored - pad for pad in pads]
    assert cache.row_padding() == pads
    assert cache.row_tokens() == real
    stats = cache.memory_stats()
    assert (stats.rows, stats.tokens, stats.padding_tokens) == (len(pads), sum(real), sum(pads))
    for window, used in group_used(cache):
        if window is None:
            # No block is shared in greedy search, so the sum being the per-row minimum means every row holds
            # exactly ceil(real tokens / block size) blocks.
            assert used == sum(-(-n // block_size) for n in real)
        else:
            # Blocks that left the window went back: each row keeps about window / block_size + 1.
            assert window == WINDOW
            assert used <= len(pads) * sliding_bound(WINDOW, block_size)
            assert used < sum(-(-n // block_size) for n in real)
    assert (family in SLIDING_FAMILIES) == any(w is not None for w, _ in group_used(cache))
    release_and_check(cache)


def test_every_family_is_covered():
    expected = {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt_neox", "gpt2", "opt"}
    no_kwargs = {"falcon", "bloom", "gpt_neo", "ctrl"}  # with GPT-NeoX: update gets no position_ids
    assert expected | {"mixtral", "qwen3_moe"} | no_kwargs == set(FAMILIES)
    assert no_kwargs | {"gpt_neox"} == NO_KWARGS_FAMILIES


# ---------------------------------------------------------------------------------------------- unsupported models
def _bidirectional_gemma3():
    config = AutoConfig.for_model(
        "gemma3_text", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_bidirectional_attention=True,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    ("build", "model_type", "why"),
    # T5 and BART were refused here: their decoder is paged now (test_encoder_decoder.py)
    [(_bidirectional_gemma3, "gemma3_text", "bidirectionally")],
)
def test_unsupported_model_raises_naming_its_type(build, model_type, why):
    model = build()
    with pytest.raises(UnsupportedModelError, match=f"'{model_type}'.*{why}"):
        PagedCache(model, num_blocks=8)
    with pytest.raises(UnsupportedModelError, match=f"'{model_type}'"):
        PagedKVPool(model.config, num_blocks=8)
    pool = PagedKVPool(model_for("llama", "compatible"), num_blocks=8)
    with pytest.raises(UnsupportedModelError, match=f"'{model_type}'"):
        PagedCache(model, pool=pool)
    assert pool.kv.num_used_blocks == 0
    pool.check_invariants()


@pytest.mark.parametrize("batch_kind", ["plain", "left_padded"])
def test_paged_mode_of_a_model_that_attends_in_its_own_code_matches_eager(batch_kind):
    """Bloom never calls the attention interface: it adds the mask to its scores. With ``attn_implementation="paged"``
    it used to get sdpa's boolean mask (added as 0 / 1: every future and padding position seen), so its tokens
    differed from eager Bloom's, with any cache; the reference of the test above shared the fault."""
    ids, mask = batch(BATCHES[batch_kind], PROMPT_LEN, seed=1)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": NEW_TOKENS, "do_sample": False}
    eager = tiny_model("bloom", attn_implementation="eager")
    want = generate(eager, dynamic(eager), **kwargs)
    paged = tiny_model("bloom", attn_implementation="paged")
    cache = PagedCache(paged, num_blocks=64, block_size=4)
    assert_same_generation(generate(paged, dynamic(paged), **kwargs), want)
    assert_same_generation(generate(paged, cache, **kwargs), want)
    release_and_check(cache)
