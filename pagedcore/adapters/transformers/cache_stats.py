"""What one :class:`~pagedcore.adapters.transformers.PagedCache` holds: :class:`CacheMemoryStats`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CacheMemoryStats"]


@dataclass(frozen=True)
class CacheMemoryStats:
    """KV memory held by one cache.

    Attributes:
        rows: batch rows.
        tokens: real tokens stored, summed over rows (padding excluded).
        padding_tokens: left-padding positions that are not stored.
        blocks: block references held, summed over rows and KV groups.
        held_bytes: bytes of the blocks held (what the cache keeps from other users of the pool).
        token_bytes: bytes the stored tokens themselves need (``held_bytes`` minus partly filled blocks).
        state_slots: recurrent-state slots held (a model with state layers: one per row, and its pending snapshots).
        state_bytes: bytes of those slots.

    Example:
        A left-padded batch of a 3-token and a 5-token prompt, 2 new tokens each: the padding is not stored.

        >>> import torch
        >>> from pagedcore.adapters.transformers import PagedCache
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> model = tiny_llama()
        >>> ids = torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 9]])
        >>> mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
        >>> cache = PagedCache(model, num_blocks=16, block_size=4)
        >>> _ = model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0, cache=cache)
        >>> stats = cache.memory_stats()
        >>> stats.rows, stats.tokens, stats.padding_tokens, stats.blocks   # rows of 4 and 6 tokens: 1 + 2 blocks
        (2, 10, 2, 3)
        >>> stats.held_bytes, stats.token_bytes
        (6144, 5120)
    """

    rows: int
    tokens: int
    padding_tokens: int
    blocks: int
    held_bytes: int
    token_bytes: int
    state_slots: int = 0
    state_bytes: int = 0
