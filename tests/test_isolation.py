"""Tenant isolation: namespaces never share blocks (also after eviction and re-insertion), and matching compares
token content, so two different prompts never share a block (tuple-hash collisions: tests/test_prefix_trie.py)."""

from __future__ import annotations

import random

import torch
from models import FIRST_TOKEN, VOCAB, tiny_model
from transformers import DynamicCache

from pagedcore.adapters.transformers import Engine, PagedKVPool, SamplingParams


def cached_blocks_by_namespace(pool: PagedKVPool, prompts: dict[str, list[list[int]]]) -> dict[str, set[int]]:
    """Every block a namespace's prompts can hit, per namespace (read through the public match API)."""
    out: dict[str, set[int]] = {}
    for namespace, items in prompts.items():
        blocks: set[int] = set()
        for prompt in items:
            for group_blocks in pool.kv.match(prompt, namespace).block_ids:
                blocks.update(group_blocks)
        out[namespace] = blocks
    return out


def test_namespaces_never_share_blocks_through_eviction_and_reinsertion():
    model = tiny_model("llama")
    rng = random.Random(0)
    shared_text = [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(24)]
    prompts = {
        ns: [shared_text + [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(4)] for _ in range(6)]
        for ns in ("tenant-a", "tenant-b")
    }
    with Engine(model, num_blocks=24, block_size=4, max_num_seqs=4) as engine:
        for round_ in range(4):  # the small pool evicts; later rounds re-insert the same prefixes
            for namespace in ("tenant-a", "tenant-b"):
                outs = engine.generate(
                    prompts[namespace], SamplingParams(max_new_tokens=4), namespace=namespace, use_tqdm=False
                )
                assert all(o.error is None for o in outs)
                if round_ == 0 and namespace == "tenant-b":
                    # tenant-a cached the very same text a moment ago: tenant-b's first request must not hit it.
                    assert outs[0].metrics.num_cached_tokens == 0
                owned = cached_blocks_by_namespace(engine.pool, prompts)
                assert not owned["tenant-a"] & owned["tenant-b"], "a block is reachable from two namespaces"
        assert engine.stats().prefix_hit_tokens > 0  # within a namespace, sharing works
        assert engine.pool.kv.groups[0].block_manager.num_evicted > 0  # and the pool did evict
        assert engine.pool.kv.num_used_blocks == 0


def test_different_prompts_share_blocks_only_where_their_tokens_are_equal():
    model = tiny_model("llama")
    pool = PagedKVPool(model, num_blocks=64, block_size=4)
    rng = random.Random(1)
    # Prompts that differ only after a common part, and prompts that differ everywhere.
    common = [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(8)]
    prompts = [common + [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(9)] for _ in range(4)]
    prompts += [[rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(17)] for _ in range(4)]
    with Engine(model, pool=pool, max_num_seqs=8) as engine:
        for _ in range(2):
            outs = engine.generate(prompts, SamplingParams(max_new_tokens=5), use_tqdm=False)
            for prompt, out in zip(prompts, outs):
                want = model.generate(
                    torch.tensor([prompt]), max_new_tokens=5, do_sample=False, cache=DynamicCache(config=model.config)
                )[0, len(prompt) :].tolist()
                assert out.token_ids == want
    # Which blocks could each prompt hit? Blocks may be shared only where the tokens are equal.
    for i, a in enumerate(prompts):
        for b in prompts[i + 1 :]:
            ma, mb = pool.kv.match(a).block_ids[0], pool.kv.match(b).block_ids[0]
            same = 0
            while same < min(len(ma), len(mb)) and a[: (same + 1) * 4] == b[: (same + 1) * 4]:
                same += 1
            assert ma[:same] == mb[:same]  # equal content: the same cached block
            assert not set(ma[same:]) & set(mb[same:]), "different content shares a block"
    assert pool.hit_rate > 0
