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
    calls = spy_paged_attention(monkeypatch)
    cache = PagedCache(model, num_blocks=64, block_size=4)

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
