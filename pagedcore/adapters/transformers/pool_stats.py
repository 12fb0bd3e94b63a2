"""MemoryStats: what a pool's KV memory (and its recurrent-state slots) hold, in bytes."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MemoryStats"]


@dataclass(frozen=True)
class MemoryStats:
    """KV memory of a pool, in bytes.

    Attributes:
        capacity_bytes: what the pool can hold (all blocks of all layers): the ceiling its memory grows to.
        allocated_bytes: layer tensors created so far (they are created lazily, at their layer's first keys). On the
            CPU this is address space, not memory: see ``reserved_bytes``.
        used_bytes: blocks held by running sequences or caches (real tokens rounded up to whole blocks).
        cached_bytes: blocks kept only by the prefix cache (reusable, evicted when room is needed).
        used_blocks: block references held, summed over KV groups.
        num_blocks: blocks per KV group.
        block_size: tokens per block.
        store_bytes: per store below the pool (``kv_store=``), the bytes it holds now; empty without stores.
        bytes_per_token: what one token's keys and values (or MLA latents) take over all layers that store their own.
        expanded_bytes_per_token: what one token would take if every attention layer stored its own per-head keys
            and values: MLA's latents and KV-shared layers (which store none) are the difference (see
            :attr:`savings`).
        reserved_bytes: memory the pool has taken so far. On the CPU the layer tensors are backed by memory that the
            operating system commits page by page as blocks are first written, so this is the blocks written so far
            (every block ever handed out: they are handed out from the start of the pool, freed ones first); it
            grows with the tokens stored, up to ``capacity_bytes``, and stays there (blocks freed or cached keep
            their pages; after a :meth:`~.pool.PagedKVPool.sleep`, the blocks written before it too: an upper bound). On
            other devices each layer's tensors are allocated whole at its first keys
            (``allocated_bytes``).
        state_slots / snapshots: a model with recurrent-state layers: its state slots, and how many of them hold
            snapshots filed in the prefix cache (0 for a model of attention layers only).
        state_capacity_bytes / state_used_bytes / state_cached_bytes: the states' bytes: all slots, the slots held
            (live states and snapshots in use), the snapshots only the prefix cache keeps (0 while unknown).

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama_config
        >>> config = tiny_llama_config()
        >>> import torch
        >>> from pagedcore.adapters.transformers import PagedKVPool
        >>> stats = PagedKVPool(config, num_blocks=8, block_size=4, dtype=torch.float32).memory_stats()
        >>> stats.capacity_bytes, stats.used_bytes, stats.reserved_bytes
        (16384, 0, 0)
    """

    capacity_bytes: int
    allocated_bytes: int
    used_bytes: int
    cached_bytes: int
    used_blocks: int
    num_blocks: int
    block_size: int
    store_bytes: dict[str, int] = field(default_factory=dict)
    bytes_per_token: int = 0
    expanded_bytes_per_token: int = 0
    reserved_bytes: int = 0
    state_slots: int = 0
    snapshots: int = 0
    state_capacity_bytes: int = 0
    state_used_bytes: int = 0
    state_cached_bytes: int = 0

    @property
    def savings(self) -> float:
        """The fraction of per-token KV memory MLA's latents and KV sharing save against every attention layer
        storing its own per-head keys and values (0.0 for a model without either).

        Example:
            >>> MemoryStats(0, 0, 0, 0, 0, 8, 16, bytes_per_token=576, expanded_bytes_per_token=40960).savings
            0.9859375
        """
        if not self.expanded_bytes_per_token:
            return 0.0
        return 1.0 - self.bytes_per_token / self.expanded_bytes_per_token
