"""KVPool: the block bookkeeping of a whole model, one group per attention kind.

Layers that attend the same way share block ids: one group for full-attention layers and one per distinct sliding
window (Gemma2/3, Mistral with a window). Each group has its own :class:`~pagedcore.block_manager.BlockManager` and
:class:`~pagedcore.prefix_trie.PrefixTrie`, so a sliding group can release blocks that fell out of its window while
the full-attention group keeps them; its :class:`~pagedcore.attention_kinds.AttentionKind` owns the rules.

The pool is also the one place that answers whether blocks can be had (vLLM's ``KVCacheManager`` plays this part):
:meth:`KVPool.max_blocks` (how many one sequence needs at worst), :meth:`KVPool.shortfalls` (can they be had now)
and :meth:`KVPool.capacity_shortfalls` (could they ever be). The scheduler, ``enable()`` and ``PagedCache`` ask it.
Tensors live in the framework adapter; this module is plain Python.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from pagedcore.attention_kinds import AttentionKind, attention_kind
from pagedcore.block_manager import BlockManager
from pagedcore.errors import ConfigError
from pagedcore.eviction import EvictionPolicy
from pagedcore.prefix_trie import PrefixTrie

__all__ = ["KVGroup", "KVPool", "PoolMatch", "Shortfall"]


@dataclass(frozen=True)
class KVGroup:
    """One group of layers sharing block ids.

    Attributes:
        index: position in ``KVPool.groups``.
        kind: how its layers attend (:class:`~pagedcore.attention_kinds.FullAttention` or ``SlidingWindow``).
        block_manager: the group's blocks.
        trie: the group's prefix cache.

    Example:
        >>> group = KVPool(num_blocks=4, block_size=2, sliding_windows=(None, 8)).groups[1]
        >>> group.index, group.kind, group.sliding_window, group.block_manager.num_blocks
        (1, SlidingWindow(window=8), 8, 4)
    """

    index: int
    kind: AttentionKind
    block_manager: BlockManager
    trie: PrefixTrie

    @property
    def sliding_window(self) -> int | None:
        """The kind's window in tokens (a query at ``p`` sees keys ``> p - window``); None for full attention."""
        return self.kind.sliding_window


@dataclass(frozen=True)
class Shortfall:
    """A KV group that cannot supply the blocks asked of it.

    Attributes:
        group: the group's index.
        needed: blocks asked for (plus the reserve kept free, when one was asked).
        available: blocks it can hand out now, or its whole capacity (:meth:`KVPool.capacity_shortfalls`).

    Example:
        >>> KVPool(num_blocks=4, block_size=2).capacity_shortfalls([5])
        [Shortfall(group=0, needed=5, available=4)]
    """

    group: int
    needed: int
    available: int


@dataclass(frozen=True)
class PoolMatch:
    """A prefix hit usable by every group.

    Attributes:
        num_tokens: tokens of the prompt covered in every group (a multiple of the block size).
        block_ids: per group, the chain covering those tokens (not retained yet).

    Example:
        >>> pool = KVPool(num_blocks=4, block_size=2)
        >>> pool.match([1, 2, 3])
        PoolMatch(num_tokens=0, block_ids=([],))
    """

    num_tokens: int
    block_ids: tuple[list[int], ...]


class KVPool:
    """Block managers and prefix tries for every KV group of a model.

    Args:
        num_blocks: blocks per group.
        block_size: tokens per block, the same in every group.
        sliding_windows: one entry per group: None for full attention, else the window in tokens.
        eviction_policy: builds a policy per group (called once per group); LRU by default.
        on_evict: ``on_evict(group_index, block_ids)`` after blocks were evicted from a group's cache.

    Example:
        >>> pool = KVPool(num_blocks=16, block_size=4, sliding_windows=(None, 8))
        >>> [g.sliding_window for g in pool.groups]
        [None, 8]
        >>> pool.match([1, 2, 3, 4, 5]).num_tokens
        0
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        sliding_windows: Sequence[int | None] = (None,),
        *,
        eviction_policy: Callable[[], EvictionPolicy] | None = None,
        on_evict: Callable[[int, list[int]], None] | None = None,
    ) -> None:
        kinds = [attention_kind(window) for window in sliding_windows]  # ConfigError for a bad window
        if not kinds:
            raise ConfigError("sliding_windows: a pool needs at least one group")
        groups = []
        for index, kind in enumerate(kinds):
            listener = None if on_evict is None else _bind_group(on_evict, index)
            bm = BlockManager(
                num_blocks,
                block_size,
                eviction_policy=eviction_policy() if eviction_policy is not None else None,
                on_evict=listener,
            )
            groups.append(KVGroup(index, kind, bm, PrefixTrie(bm)))
        self._groups = tuple(groups)
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._epoch = 0  # bumped by reset_prefix_cache: blocks filled before it never enter the prefix caches

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        """The pool's groups."""
        return self._groups

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def num_blocks(self) -> int:
        """Blocks per group."""
        return self._num_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks in use, summed over groups."""
        return sum(g.block_manager.num_used_blocks for g in self._groups)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks indexed by the prefix caches, summed over groups."""
        return sum(g.trie.num_cached_blocks for g in self._groups)

    @property
    def epoch(self) -> int:
        """How many times :meth:`reset_prefix_cache` declared the cached keys and values stale. A
        :class:`~pagedcore.block_tables.BlockTables` filled in an earlier epoch never registers its blocks."""
        return self._epoch

    @property
    def usage(self) -> float:
        """Highest fraction of blocks in use over the groups."""
        return max(g.block_manager.usage for g in self._groups)

    @property
    def num_query_tokens(self) -> int:
        """Prompt tokens looked up (see :meth:`record`; every group's trie counts the same)."""
        return self._groups[0].trie.num_query_tokens

    @property
    def num_hit_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (see :meth:`record`)."""
        return self._groups[0].trie.num_hit_tokens

    @property
    def hit_rate(self) -> float:
        """``num_hit_tokens / num_query_tokens``."""
        return self._groups[0].trie.hit_rate

    # ------------------------------------------------------------------ capacity and admission
    def max_blocks(self, num_tokens: int, *, chunk: int | None = None, start: int = 0) -> tuple[int, ...]:
        """Per group, the most blocks one sequence holds at once while its positions ``start .. num_tokens - 1``
        get slots in steps of at most ``chunk`` positions (see :meth:`AttentionKind.max_blocks`).

        Example:
            >>> KVPool(num_blocks=64, block_size=4, sliding_windows=(None, 8)).max_blocks(100, chunk=6)
            (25, 4)
        """
        bs = self._block_size
        return tuple(g.kind.max_blocks(num_tokens, bs, chunk=chunk, start=start) for g in self._groups)

    def shortfalls(self, needs: Sequence[int], *, reserve: int = 0) -> list[Shortfall]:
        """The groups that cannot hand out ``needs[g]`` more blocks now while keeping ``reserve`` blocks free (a
        group that needs none is never short). Empty: the blocks can be had. No side effects.

        Example:
            >>> pool = KVPool(num_blocks=4, block_size=2)
            >>> pool.shortfalls([4]), pool.shortfalls([4], reserve=1)
            ([], [Shortfall(group=0, needed=5, available=4)])
        """
        short = []
        for group, need in zip(self._groups, needs):
            if need:
                available = group.block_manager.num_available_blocks
                if need + reserve > available:
                    short.append(Shortfall(group.index, need + reserve, available))
        return short

    def capacity_shortfalls(self, needs: Sequence[int]) -> list[Shortfall]:
        """The groups with fewer than ``needs[g]`` blocks in all: what could never be had, however many are freed.

        Example:
            >>> KVPool(num_blocks=4, block_size=2).capacity_shortfalls([4])
            []
        """
        return [Shortfall(g.index, n, self._num_blocks) for g, n in zip(self._groups, needs) if n > self._num_blocks]

    # ------------------------------------------------------------------ prefix cache
    def match(self, token_ids: Sequence[int], namespace: Hashable = None) -> PoolMatch:
        """The longest prefix of ``token_ids`` cached in every group. No side effects."""
        matches = [g.trie.match(token_ids, namespace) for g in self._groups]
        num_blocks = min(len(m.block_ids) for m in matches)
        return PoolMatch(num_blocks * self._block_size, tuple(m.block_ids[:num_blocks] for m in matches))

    def record(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup that was acted on, in every group's trie (a hit is one for all groups)."""
        for group in self._groups:
            group.trie.record(num_query_tokens, num_hit_tokens)

    def clear_prefix_cache(self, *namespaces: Hashable) -> int:
        """Forget cached prefixes: of the given namespaces, or of all of them when none is given.

        Blocks in use stay allocated (they just stop being shareable). Returns how many blocks were forgotten.
        """
        if not namespaces:
            return sum(g.trie.clear() for g in self._groups)
        return sum(g.trie.clear_namespace(ns) for g in self._groups for ns in namespaces)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix because the keys and values were computed by a model that has changed since
        (its weights were updated): unlike :meth:`clear_prefix_cache`, blocks held now stay their holders' but are
        never registered later, as no prefix computed before the reset may be served after it. Returns how many
        blocks were forgotten.

        Example:
            >>> from pagedcore.block_tables import BlockTables
            >>> pool = KVPool(num_blocks=4, block_size=2)
            >>> seq = BlockTables(pool)
            >>> _ = seq.append(4)
            >>> seq.cache_full_blocks([5, 6, 7, 8], 4)
            >>> pool.reset_prefix_cache(), pool.epoch
            (2, 1)
            >>> seq.cache_full_blocks([5, 6, 7, 8], 4)   # filled before the reset: not registered again
            >>> pool.num_cached_blocks
            0
        """
        self._epoch += 1
        return self.clear_prefix_cache()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` on inconsistent bookkeeping in any group."""
        for group in self._groups:
            group.block_manager.check_invariants()
            group.trie.check_invariants()

    def __repr__(self) -> str:
        return (
            f"KVPool(groups={len(self._groups)}, num_blocks={self._num_blocks}, block_size={self._block_size}, "
            f"used={self.num_used_blocks}, cached={self.num_cached_blocks})"
        )


def _bind_group(on_evict: Callable[[int, list[int]], None], index: int) -> Callable[[list[int]], None]:
    def listener(block_ids: list[int]) -> None:
        on_evict(index, block_ids)

    return listener
