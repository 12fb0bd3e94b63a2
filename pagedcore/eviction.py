"""Eviction policies: which unreferenced cached block to reuse first.

A policy only orders block ids; the :class:`~pagedcore.block_manager.BlockManager` decides when a block enters or
leaves the evictable set and what eviction means. Policies are chosen through the ``pagedcore_eviction_policy``
plugin hook, so a plugin can ship its own.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, runtime_checkable


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders the evictable blocks. Every method must be O(1) (or close to it) per block.

    Example:
        >>> policy = LRUEvictionPolicy()
        >>> policy.add(3); policy.add(5); policy.add(4)
        >>> policy.remove(5)
        >>> policy.pop()
        3
    """

    name: str

    def add(self, block_id: int) -> None:
        """``block_id`` became evictable (its last holder released it just now)."""

    def remove(self, block_id: int) -> None:
        """``block_id`` is no longer evictable (revived by a prefix hit, or dropped from the cache)."""

    def pop(self) -> int:
        """Choose a victim, forget it and return it. Only called when ``len(self) > 0``."""

    def __len__(self) -> int: ...

    def __contains__(self, block_id: object) -> bool: ...


class LRUEvictionPolicy:
    """Least recently released first.

    Leaves go first in practice: a sequence releases its blocks tail first, and a parent block is always released
    no earlier than its children, so a chain is evicted from its end towards the root.

    Example:
        >>> lru = LRUEvictionPolicy()
        >>> for block_id in (7, 8, 9):
        ...     lru.add(block_id)
        >>> lru.remove(7)      # revived by a prefix hit
        >>> lru.add(7)         # released again: now the most recent
        >>> [lru.pop() for _ in range(3)]
        [8, 9, 7]
    """

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def add(self, block_id: int) -> None:
        self._order[block_id] = None
        self._order.move_to_end(block_id)

    def remove(self, block_id: int) -> None:
        del self._order[block_id]

    def pop(self) -> int:
        block_id, _ = self._order.popitem(last=False)
        return block_id

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._order

    def __repr__(self) -> str:
        return f"LRUEvictionPolicy(evictable={len(self._order)})"
