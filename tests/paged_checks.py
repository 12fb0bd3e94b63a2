"""Helpers shared by the PagedCache-versus-DynamicCache tests: inputs, comparisons, spies and the release check."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from models import FIRST_TOKEN, PAD, VOCAB
from transformers import DynamicCache

from pagedcore.adapters.transformers import PagedCache, PagedKVPool

ATOL = 1e-4  # fp32 logits: PagedCache against DynamicCache on the same model


def batch(pads: Sequence[int], length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of ``len(pads)`` rows of ``length`` positions, row ``r`` left-padded by
    ``pads[r]`` positions (pad id, mask 0) and random real tokens after them."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_TOKEN, VOCAB, (len(pads), length), generator=generator)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        ids[row, :pad] = PAD
        mask[row, :pad] = 0
    return ids, mask


def dynamic(model: Any) -> DynamicCache:
    """The reference cache."""
    return DynamicCache(config=model.config)


def generate(model: Any, cache: Any, *, seed: int | None = None, **kwargs: Any) -> Any:
    """``model.generate(..., cache=cache)`` returning a dict with logits (``torch.manual_seed(seed)`` first)."""
    if seed is not None:
        torch.manual_seed(seed)
    kwargs.setdefault("return_dict_in_generate", True)
    kwargs.setdefault("output_logits", True)
    return model.generate(cache=cache, **kwargs)


def assert_same_generation(got: Any, want: Any, atol: float = ATOL) -> None:
    """Identical tokens and per-step logits within ``atol``."""
    assert got.sequences.tolist() == want.sequences.tolist()
    assert len(got.logits) == len(want.logits)
    for step, (g, w) in enumerate(zip(got.logits, want.logits)):
        torch.testing.assert_close(g.float(), w.float(), atol=atol, rtol=0, msg=lambda m, s=step: f"step {s}: {m}")


def assert_close_where(got: torch.Tensor, want: torch.Tensor, where: torch.Tensor, atol: float = ATOL) -> None:
    """Logits ``(batch, q, vocab)`` agree at the query positions where ``where`` (``(batch, q)``) is true."""
    torch.testing.assert_close(got[where.bool()], want[where.bool()], atol=atol, rtol=0)


def release_and_check(*caches: PagedCache) -> None:
    """Release the caches; their pools must then hold no block and pass their invariant checks."""
    for cache in caches:
        cache.release()
    for pool in {id(c.pool): c.pool for c in caches}.values():
        assert pool.kv.num_used_blocks == 0, f"blocks leaked: {pool!r}"
        pool.check_invariants()


def group_used(cache: PagedCache) -> list[tuple[int | None, int]]:
    """``(sliding_window, blocks in use)`` of every KV group of the cache's pool."""
    return [(g.sliding_window, g.block_manager.num_used_blocks) for g in cache.pool.kv.groups]


def sliding_bound(window: int, block_size: int) -> int:
    """Most blocks a row should hold in a sliding group: its window, one partly filled block on each side."""
    return -(-window // block_size) + 1


def spy_paged_attention(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A one-item list counting the layer calls that attended over the pool (the paged path asks the pool for its
    backend each time; the dense fallback does not)."""
    calls = [0]
    original = PagedKVPool.attention_backend

    def counting(self: PagedKVPool, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PagedKVPool, "attention_backend", counting)
    return calls
