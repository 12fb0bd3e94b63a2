"""KVPool: the block bookkeeping of a whole model, one group per attention kind.

Layers that attend the same way share block ids: one group for full-attention layers and one per distinct sliding
window (Gemma2/3, Mistral with a window). Each group has its own :class:`~pagedcore.block_manager.BlockManager` and
:class:`~pagedcore.prefix_trie.PrefixTrie`, so a sliding group can release blocks that fell out of its window while
the full-attention group keeps them; its :class:`~pagedcore.attention_kinds.AttentionKind` owns the rules.

The pool is also the one place that answers whether blocks can be had (vLLM's ``KVCacheManager`` plays this part):
:meth:`KVPool.worst_case` (how many a request needs at worst: :mod:`pagedcore.capacity`), :meth:`KVPool.shortfalls`
(can they be had now), :meth:`KVPool.capacity_shortfalls` (could they ever be), and :meth:`KVPool.reserve`, which holds
them back for one holder (a :class:`~pagedcore.capacity.Reservation`) so that nobody else can take them. The
scheduler, ``enable()`` and ``PagedCache`` ask it. Tensors live in the framework adapter; this module is plain Python.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pagedcore.attention_kinds import AttentionKind, attention_kind
from pagedcore.block_manager import BlockManager
from pagedcore.capacity import Demand, Ledger, Reservation, blocks_to_allocate
from pagedcore.errors import ConfigError, OutOfBlocksError
from pagedcore.eviction import EvictionPolicy
from pagedcore.prefix_trie import PrefixTrie
from pagedcore.validation import integer

if TYPE_CHECKING:
    from pagedcore.kv_tiers import KVTiers

__all__ = ["Claimant", "KVGroup", "KVPool", "PoolMatch", "Shortfall"]


class Claimant(Protocol):
    """A holder whose needs change as it runs (the scheduler): before the pool grants a reservation to someone else
    it asks each claimant to bring its own reservation up to date (see :meth:`KVPool.add_claimant`).

    Example:
        >>> class Growing:
        ...     def __init__(self, pool):
        ...         self.reservation, self.needs = pool.reserve([0]), [0]
        ...     def refresh_reservation(self):
        ...         self.reservation.resize(self.needs)
        >>> pool = KVPool(num_blocks=8, block_size=4)
        >>> holder = Growing(pool)
        >>> pool.add_claimant(holder)
        >>> holder.needs = [6]                  # it needs more now; the pool asks before granting others
        >>> pool.reserve([2]).remaining, holder.reservation.remaining
        ((2,), (6,))
    """

    def refresh_reservation(self) -> None:
        """Resize the claimant's reservation to what it needs now."""


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
        num_tokens: tokens of the prompt covered in every group, to the token (the shortest group's match): it may end
            inside the chain's last block, whose leading positions are then reused and the block copied before a
            write into it (see :class:`~pagedcore.prefix_trie.PrefixTrie`).
        block_ids: per group, the chain covering those tokens (``ceil(num_tokens / block_size)`` blocks, not
            retained yet).

    Example:
        >>> pool = KVPool(num_blocks=4, block_size=2)
        >>> pool.match([1, 2, 3])
        PoolMatch(num_tokens=0, block_ids=([],))
    """

    num_tokens: int
    block_ids: tuple[list[int], ...]

    def head(self, num_tokens: int, block_size: int) -> tuple[list[int], ...]:
        """Per group, the blocks that serve the first ``num_tokens`` tokens of the match (what a holder attaching
        that many tokens reads).

        Example:
            >>> PoolMatch(num_tokens=7, block_ids=([4, 5],)).head(3, block_size=4)
            ([4],)
        """
        count = -(-num_tokens // block_size)
        return tuple(ids[:count] for ids in self.block_ids)


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
                before_evict=_bind_evicting(self, index),
            )
            groups.append(KVGroup(index, kind, bm, PrefixTrie(bm)))
        self._groups = tuple(groups)
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._ledger = Ledger(len(groups))
        self._claimants: list[weakref.ref[Claimant]] = []
        self._epoch = 0  # bumped by reset_prefix_cache: blocks filled before it never enter the prefix caches
        self._tiers: KVTiers | None = None  # stores below the pool (kv_tiers): evicted blocks go down, loads come up

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
    def worst_case(self, *demands: Demand) -> tuple[int, ...]:
        """Per group, the most blocks these requests (or batch rows) allocate before they end, over all of them:
        the one answer to "how many blocks does this need" (:func:`~pagedcore.capacity.blocks_to_allocate`).

        Example:
            >>> pool = KVPool(num_blocks=64, block_size=4, sliding_windows=(None, 8))
            >>> pool.worst_case(Demand(num_prompt_tokens=90, max_new_tokens=11, chunk=6))   # 100 stored positions
            (25, 4)
            >>> pool.worst_case(Demand(5, 4), Demand(5, 4, num_copies=3, share_prompt=True))   # 2 + (1 + 3 * 1)
            (6, 6)
        """
        bs = self._block_size
        return tuple(sum(blocks_to_allocate(g.kind, d, bs) for d in demands) for g in self._groups)

    def available_blocks(self, group: int, reservation: Reservation | None = None) -> int:
        """Blocks of ``group`` the holder of ``reservation`` (None: a holder without one) can have now: free and
        evictable ones, less what other holders reserved (its own reservation counts as its own). May be negative
        for a holder without a reservation only inside a bookkeeping call that is about to undo itself.

        Example:
            >>> pool = KVPool(num_blocks=8, block_size=4)
            >>> mine = pool.reserve([3])
            >>> pool.available_blocks(0), pool.available_blocks(0, mine)
            (5, 8)
        """
        available = self._groups[group].block_manager.num_available_blocks
        if len(self._ledger):
            available -= self._ledger.reserved(group, reservation)
        return available

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks held back by live reservations and not drawn yet, summed over groups."""
        return sum(self._ledger.reserved(g.index) for g in self._groups)

    def has_reservations(self, excluding: Reservation | None = None) -> bool:
        """Whether a live reservation other than ``excluding`` holds blocks."""
        return self._ledger.others(excluding)

    def reserve(self, needs: Sequence[int]) -> Reservation:
        """Hold back ``needs[g]`` blocks in every group for one holder (see :class:`~pagedcore.capacity.Reservation`).

        The claimants (:meth:`add_claimant`) first bring their own reservations up to date, so a new reservation
        never takes what they need. All or nothing: raises :class:`~pagedcore.errors.OutOfBlocksError` naming the
        group, and changes nothing, when some group cannot spare its share.

        Example:
            >>> pool = KVPool(num_blocks=8, block_size=4)
            >>> first = pool.reserve([6])
            >>> pool.reserve([3])
            Traceback (most recent call last):
            ...
            pagedcore.errors.OutOfBlocksError: reserve: KV group 0 cannot spare 3 blocks: 2 of its 8 are available ...
            >>> first.release(); pool.reserve([3]).remaining
            (3,)
        """
        if len(needs) != len(self._groups):
            raise ConfigError(f"reserve: {len(needs)} counts for {len(self._groups)} KV groups")
        wanted = [integer("reserve: blocks", n, minimum=0, error=ConfigError) for n in needs]
        self._refresh_claimants()
        for short in self.shortfalls(wanted):
            bm = self._groups[short.group].block_manager
            raise OutOfBlocksError(
                f"reserve: KV group {short.group} cannot spare {short.needed} blocks: {max(short.available, 0)} of "
                f"its {self._num_blocks} are available ({bm.num_used_blocks} in use, "
                f"{self._ledger.reserved(short.group)} reserved by other holders)",
                requested=short.needed,
                available=max(short.available, 0),
            )
        return Reservation(self, self._ledger, wanted)

    def add_claimant(self, claimant: Claimant) -> None:
        """Ask ``claimant.refresh_reservation()`` before every reservation granted to another holder (held weakly).

        The scheduler is one: its running sequences keep what they may still need before an ``enable()``d call can
        reserve blocks."""
        self._claimants = [ref for ref in self._claimants if ref() is not None]
        self._claimants.append(weakref.ref(claimant))

    def shortfalls(
        self, needs: Sequence[int], *, reserve: int = 0, reservation: Reservation | None = None
    ) -> list[Shortfall]:
        """The groups that cannot hand out ``needs[g]`` more blocks now to the holder of ``reservation`` (None: a
        holder without one) while keeping ``reserve`` blocks free (a group that needs none is never short). Blocks
        other holders reserved are not available. Empty: the blocks can be had. No side effects.

        Example:
            >>> pool = KVPool(num_blocks=4, block_size=2)
            >>> pool.shortfalls([4]), pool.shortfalls([4], reserve=1)
            ([], [Shortfall(group=0, needed=5, available=4)])
            >>> held = pool.reserve([1])
            >>> pool.shortfalls([4]), pool.shortfalls([4], reservation=held)
            ([Shortfall(group=0, needed=4, available=3)], [])
        """
        short = []
        reserved = len(self._ledger)
        for group, need in zip(self._groups, needs):
            if need:
                available = group.block_manager.num_available_blocks
                if reserved:
                    available -= self._ledger.reserved(group.index, reservation)
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

    def _refresh_claimants(self) -> None:
        for ref in list(self._claimants):
            claimant = ref()
            if claimant is not None:
                claimant.refresh_reservation()

    # ------------------------------------------------------------------ prefix cache
    def match(self, token_ids: Sequence[int], namespace: Hashable = None) -> PoolMatch:
        """The longest prefix of ``token_ids`` cached in every group, to the token. No side effects.

        Example:
            >>> from pagedcore.block_tables import BlockTables
            >>> pool = KVPool(num_blocks=8, block_size=4)
            >>> turn = BlockTables(pool)
            >>> _ = turn.append(6)                        # a finished turn: 6 positions computed
            >>> turn.cache_partial_block([1, 2, 3, 4, 5, 6], 6); turn.release()
            >>> pool.match([1, 2, 3, 4, 5, 6, 7, 8])     # the next turn continues it inside its second block
            PoolMatch(num_tokens=6, block_ids=([0, 1],))
        """
        matches = [g.trie.match(token_ids, namespace) for g in self._groups]
        num_tokens = min(m.num_tokens for m in matches)
        count = -(-num_tokens // self._block_size)
        return PoolMatch(num_tokens, tuple(m.block_ids[:count] for m in matches))

    @property
    def tiers(self) -> KVTiers | None:
        """The stores below the pool (:class:`~pagedcore.kv_tiers.KVTiers`), or None."""
        return self._tiers

    def attach_tiers(self, tiers: KVTiers | None) -> None:
        """Write the blocks this pool evicts into ``tiers`` and let :meth:`load_prefix` load from them (None:
        detach). See :mod:`pagedcore.kv_tiers`."""
        self._tiers = tiers

    def load_prefix(self, token_ids: Sequence[int], namespace: Hashable = None) -> int:
        """Before matching a prompt for its prefill: load the blocks that follow its pool match from the tiers
        below the pool into free or evictable blocks (never blocks other holders reserved), cached like any other,
        so that :meth:`match` finds them. Returns the tokens loaded (0 without tiers). Hold the lock every holder
        takes."""
        if self._tiers is None:
            return 0
        return self._tiers.load(self, token_ids, namespace)

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
        """Raise ``AssertionError`` on inconsistent bookkeeping in any group, or reservations the pool cannot back."""
        for group in self._groups:
            group.block_manager.check_invariants()
            group.trie.check_invariants()
            reserved, available = self._ledger.reserved(group.index), group.block_manager.num_available_blocks
            assert reserved <= available, f"group {group.index}: {reserved} blocks reserved, {available} available"
        for reservation in self._ledger:
            assert not reservation.released and all(
                0 <= left <= size for left, size in zip(reservation.remaining, reservation.size)
            ), f"{reservation} is not consistent"

    def __repr__(self) -> str:
        reserved = f", reserved={self.num_reserved_blocks}" if len(self._ledger) else ""
        return (
            f"KVPool(groups={len(self._groups)}, num_blocks={self._num_blocks}, block_size={self._block_size}, "
            f"used={self.num_used_blocks}, cached={self.num_cached_blocks}{reserved})"
        )


def _bind_evicting(pool: KVPool, index: int) -> Callable[[int], None]:
    ref = weakref.ref(pool)

    def evicting(block_id: int) -> None:
        target = ref()
        tiers = None if target is None else target.tiers
        if target is not None and tiers is not None:
            tiers.evicting(index, block_id, target.groups[index].trie)

    return evicting


def _bind_group(on_evict: Callable[[int, list[int]], None], index: int) -> Callable[[list[int]], None]:
    def listener(block_ids: list[int]) -> None:
        on_evict(index, block_ids)

    return listener
