"""The attention variants of 2026's models, exact in all four modes against stock ``generate`` (issue 28, part A).

Families (:mod:`variant_models`): Gemma 4 (per-layer head sizes), Gemma 4 and Gemma 3n with KV-shared layers, MLA
(DeepSeek V3, V2, Kimi), attention sinks (gpt-oss, Granite SWA, Granite MoE SWA, Flint), Llama 4's chunked attention.
Each is compared with stock ``generate`` on the same weights (eager attention, ``DynamicCache``): fp32 greedy tokens
identical and every step's logits within 1e-4, in

1. ``PagedCache`` with the model's own attention and with ``attn_implementation="paged"``: a left-padded batch whose
   generation crosses the sliding window and the attention chunk (8) and block boundaries;
2. ``enable()`` with paged attention: a prompt, then a longer one served from the first one's prefix, then both in a
   left-padded batch;
3. the ``Engine``: prompts sharing a prefix (prefix hits), prefill chunked by a small token budget.

Every case ends with no block held and the pool's bookkeeping consistent.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from models import FIRST_TOKEN, VOCAB
from paged_checks import assert_same_generation, batch, dynamic, generate, release_and_check, spy_paged_attention
from variant_models import VARIANTS, variant_model

from pagedcore.adapters.transformers import Engine, PagedCache, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LEN, NEW_TOKENS = 12, 20
PADS = [0, 3, 9]  # 9 > the window and the chunk: a row whose padding outlasts both
ENABLE_DEFAULTS = {"num_blocks": 128, "block_size": 4}


@functools.cache
def reference_model(family: str) -> torch.nn.Module:
    return variant_model(family)


@functools.cache
def paged_model(family: str) -> torch.nn.Module:
    return variant_model(family, attn_implementation="paged")


@functools.cache
def reference_batch(family: str) -> object:
    model = reference_model(family)
    ids, mask = batch(PADS, PROMPT_LEN, seed=1)
    return generate(
        model, dynamic(model), input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False
    )


def reference_one(family: str, prompt: list[int], max_new_tokens: int) -> object:
    model = reference_model(family)
    return generate(
        model, dynamic(model), input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False
    )


@pytest.mark.parametrize("mode", ["compatible", "paged"])
@pytest.mark.parametrize("family", VARIANTS)
def test_paged_cache_matches_stock_generate(family, mode, monkeypatch):
    model = reference_model(family) if mode == "compatible" else paged_model(family)
    ids, mask = batch(PADS, PROMPT_LEN, seed=1)
    cache = PagedCache(model, num_blocks=64, block_size=4)
    calls = spy_paged_attention(monkeypatch)  # after the construction-time probe, whose private pool it would count

    out = generate(model, cache, input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)

    assert_same_generation(out, reference_batch(family))
    assert (calls[0] > 0) == (mode == "paged")  # the paged mode read the pool, the compatible one gathered
    stored = PROMPT_LEN + NEW_TOKENS - 1
    assert cache.row_padding() == PADS and cache.row_tokens() == [stored - pad for pad in PADS]
    release_and_check(cache)


@pytest.mark.parametrize("family", VARIANTS)
def test_enable_serves_prefix_hits_exactly(family, enabled):
    model = paged_model(family)
    pool = enabled(model)
    rng = random.Random(3)
    first = [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(14)]
    second = first + [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(7)]
    for prompt in (first, second):
        got = generate(model, None, input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
        assert_same_generation(got, reference_one(family, prompt, 10))
    # The second prompt reused the first one's keys and values: its 3 full blocks at least (a group that gave back a
    # window's or a finished chunk's blocks registered the prompt's full blocks before, not its partly filled one).
    assert pool.num_hit_tokens >= 12
    ids, mask = batch(PADS, PROMPT_LEN, seed=1)  # and a left-padded batch
    got = generate(model, None, input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert_same_generation(got, reference_batch(family))


def workload(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(12)]
    tails = [[rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(n)] for n in (3, 17, 9, 1, 21)]
    return [prefix + tails[0], prefix + tails[1], tails[2], prefix + tails[3], tails[4]]


@pytest.mark.parametrize("family", VARIANTS)
def test_engine_with_chunked_prefill_matches_stock_generate(family):
    model = reference_model(family)
    prompts = workload(4)
    params = SamplingParams(max_new_tokens=12, return_logits=True)
    with Engine(model, num_blocks=128, block_size=4, max_num_batched_tokens=10, max_num_seqs=3) as engine:
        outputs = engine.generate(prompts, params, use_tqdm=False)
        stats = engine.stats()
        assert engine.pool.kv.num_used_blocks == 0
        engine.pool.check_invariants()
    assert stats.prefix_hit_tokens > 0
    for prompt, out in zip(prompts, outputs):
        assert out.error is None, out.error
        want = reference_one(family, prompt, 12)
        assert out.token_ids == want.sequences[0, len(prompt) :].tolist()
        for got, expected in zip(out.samples[0].logits, want.logits):
            torch.testing.assert_close(got, expected[0].float(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["gemma4_shared", "deepseek_v3", "gpt_oss", "llama4"])
def test_engine_preemption_recomputes_exactly(family):
    """A pool of 24 blocks for 8 requests: some are preempted and recomputed (their chunks and latents again)."""
    model = reference_model(family)
    rng = random.Random(1)
    prefix = [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(12)]
    prompts = [prefix * (i % 2) + [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(3 + 2 * i)] for i in range(8)]
    with Engine(model, num_blocks=24, block_size=4, max_num_batched_tokens=64, max_num_seqs=8) as engine:
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=12), use_tqdm=False)
        assert engine.stats().num_preemptions > 0
        assert engine.pool.kv.num_used_blocks == 0
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == reference_one(family, prompt, 12).sequences[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", ["gemma4_shared", "deepseek_v3", "gpt_oss", "llama4"])
@pytest.mark.parametrize("options", [{"prompt_lookup_num_tokens": 2}, {"num_beams": 3, "num_return_sequences": 2}])
def test_beams_and_prompt_lookup_with_paged_attention(family, options):
    """Beam search (rows reordered, forked: shared blocks) and prompt-lookup decoding (draft tokens cropped)."""
    rng = random.Random(2)
    prompt = [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(12)]
    ids = torch.tensor([prompt + prompt[:5]])  # a repeat for prompt lookup to find
    model = reference_model(family)
    want = model.generate(ids, max_new_tokens=10, do_sample=False, cache=dynamic(model), **options)
    cache = PagedCache(paged_model(family), num_blocks=128, block_size=4)
    got = paged_model(family).generate(ids, max_new_tokens=10, do_sample=False, cache=cache, **options)
    assert got.tolist() == want.tolist()
    release_and_check(cache)
