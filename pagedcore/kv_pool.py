"""KVPool: the block bookkeeping of a whole model, one group per attention kind.

Layers that attend the same way share block ids: one group for full-attention layers, one per distinct sliding
window (Gemma2/3, Mistral with a window), one per attention chunk (Llama 4); the framework adapter also gives layers
of other head sizes their own group (Gemma 4's global layers). Each group has its own
:class:`~pagedcore.block_manager.BlockManager` and :class:`~pagedcore.prefix_trie.PrefixTrie`, so a sliding group can
release blocks that fell out of its window while the full-attention group keeps them; its
:class:`~pagedcore.attention_kinds.AttentionKind` owns the rules.

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
from typing import Any, Protocol

from pagedcore.attention_kinds import AttentionKind, attention_kind
from pagedcore.block_keys import namespace_key, namespace_scope
from pagedcore.block_manager import BlockManager
from pagedcore.capacity import Demand, Ledger, Reservation, blocks_to_allocate, max_new_tokens, slots_to_allocate
from pagedcore.errors import ConfigError, OutOfBlocksError
from pagedcore.eviction import EvictionPolicy
from pagedcore.namespace_scopes import NamespaceScopes
from pagedcore.prefix_trie import PrefixTrie
from pagedcore.state_slots import StateSlots
from pagedcore.table_rows import TableRows
from pagedcore.validation import integer

__all__ = ["Claimant", "KVGroup", "KVPool", "PoolMatch", "Shortfall", "Tiers"]


class Tiers(Protocol):
    """What the pool asks of the tiers below it (:class:`~pagedcore.kv_tiers.KVTiers` answers; the pool knows no
    more of them, so the core's modules import each other one way only).

    Example:
        >>> sorted(name for name in vars(Tiers) if not name.startswith("_"))
        ['evicting', 'evicting_snapshot', 'load', 'stats']
    """

    def evicting(self, group: int, block_id: int, trie: PrefixTrie) -> None:
        """``block_id`` of ``group``, cached in ``trie``, is about to be evicted (write its content down)."""
        ...

    def evicting_snapshot(self, slot: int, block_id: int, offset: int, trie: PrefixTrie) -> None:
        """The state snapshot in ``slot``, filed in ``block_id`` of ``trie`` after ``offset`` of its tokens, is about
        to be evicted (or its block is): write it down."""
        ...

    def load(self, pool: KVPool, token_ids: Sequence[int], namespace: Hashable) -> int:
        """Continue ``token_ids``' match into the stores; returns the prompt tokens loaded."""
        ...

    def stats(self) -> Any:
        """The tiers' counters (:class:`~pagedcore.kv_tiers.TierStats`)."""
        ...


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
        kind: how its layers attend (:class:`~pagedcore.attention_kinds.FullAttention`, ``SlidingWindow`` or
            ``ChunkedAttention``).
        block_manager: the group's blocks.
        trie: the group's prefix cache.
        rows: its sequences' block tables as rows of one buffer, padded with the pool's ``num_blocks``
            (:mod:`pagedcore.table_rows`).

    Example:
        >>> group = KVPool(num_blocks=4, block_size=2, sliding_windows=(None, 8)).groups[1]
        >>> group.index, group.kind, group.sliding_window, group.block_manager.num_blocks
        (1, SlidingWindow(window=8), 8, 4)
    """

    index: int
    kind: AttentionKind
    block_manager: BlockManager
    trie: PrefixTrie
    rows: TableRows

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
        state_slot: in a pool with recurrent-state slots, the snapshot of the state after exactly ``num_tokens``
            tokens (None when ``num_tokens`` is 0: the state starts empty); not retained yet.
        prefix_tokens: tokens of the prompt whose keys and values every group caches, to the token; more than
            ``num_tokens`` in a pool with state slots when no snapshot lies that deep (where the prompt leaves a
            cached prefix: a snapshot there would let later prompts resume it).

    Example:
        >>> pool = KVPool(num_blocks=4, block_size=2)
        >>> pool.match([1, 2, 3])
        PoolMatch(num_tokens=0, block_ids=([],), state_slot=None, prefix_tokens=0)
    """

    num_tokens: int
    block_ids: tuple[list[int], ...]
    state_slot: int | None = None
    prefix_tokens: int = 0

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
        sliding_windows: one entry per group: None for full attention, the window in tokens, or the group's
            :class:`~pagedcore.attention_kinds.AttentionKind` (``ChunkedAttention(8192)``, say).
        eviction_policy: builds a policy per group (called once per group); LRU by default.
        on_evict: ``on_evict(group_index, block_ids)`` after blocks were evicted from a group's cache.
        state_slots: recurrent-state slots for a model with recurrent layers (:mod:`pagedcore.state_slots`; 0: none).
            They are one more resource of the pool, index :attr:`state_resource` in every ``needs`` vector
            (:meth:`worst_case`, :meth:`reserve`, :meth:`shortfalls`).
        snapshot_interval: with state slots, a growing sequence snapshots its state every this many blocks.
        resumes_chunks: with state slots, whether the model continues a cached state over a forward of several
            tokens (else only one token at a time: Jamba; :attr:`~pagedcore.state_slots.StateSlots.resumes_chunks`).

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
        sliding_windows: Sequence[int | AttentionKind | None] = (None,),
        *,
        eviction_policy: Callable[[], EvictionPolicy] | None = None,
        on_evict: Callable[[int, list[int]], None] | None = None,
        state_slots: int = 0,
        snapshot_interval: int = 1,
        resumes_chunks: bool = True,
    ) -> None:
        kinds = [attention_kind(window) for window in sliding_windows]  # ConfigError for a bad window or chunk
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
            groups.append(KVGroup(index, kind, bm, PrefixTrie(bm), TableRows(num_blocks)))
        self._groups = tuple(groups)
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._states: StateSlots | None = None
        self._anchor = next((g.index for g in groups if not g.kind.is_sliding), 0)
        if integer("state_slots", state_slots, minimum=0, error=ConfigError):
            policy = eviction_policy() if eviction_policy is not None else None
            self._states = StateSlots(
                state_slots,
                interval=snapshot_interval,
                eviction_policy=policy,
                before_evict=_bind_state_evicting(self),
                resumes_chunks=resumes_chunks,
            )
            # A snapshot is filed beside its block in the anchor group's trie and leaves with it.
            groups[self._anchor].trie.watch_drops(self._states.forget_blocks)
        self._ledger = Ledger(self.num_resources)
        self._claimants: list[weakref.ref[Claimant]] = []
        self._epoch = 0  # bumped by reset_prefix_cache: blocks filled before it never enter the prefix caches
        self._scopes = NamespaceScopes()  # adapter versions closed (or reopened) since: see close_scope
        self._tiers: Tiers | None = None  # stores below the pool (kv_tiers): evicted blocks go down, loads come up

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        """The pool's groups."""
        return self._groups

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def states(self) -> StateSlots | None:
        """The recurrent-state slots (:mod:`pagedcore.state_slots`), or None for a pool of attention layers only."""
        return self._states

    @property
    def anchor(self) -> int:
        """The KV group whose trie blocks state snapshots are filed under (the first full-attention group)."""
        return self._anchor

    @property
    def num_resources(self) -> int:
        """Entries of a ``needs`` vector: one per KV group, and one for the state slots when the pool has them."""
        return len(self._groups) + (self._states is not None)

    @property
    def state_resource(self) -> int | None:
        """The index of the state slots in a ``needs`` vector (after the groups), or None without them."""
        return len(self._groups) if self._states is not None else None

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
    def stamp(self) -> tuple[int, int]:
        """What a :class:`~pagedcore.block_tables.BlockTables` records when it starts filling: the :attr:`epoch` and
        the scopes' clock (:meth:`close_scope`); :meth:`may_register` compares them."""
        return (self._epoch, self._scopes.clock)

    def may_register(self, stamp: tuple[int, int], namespace: Hashable) -> bool:
        """Whether blocks that started filling at ``stamp`` may enter the prefix caches in ``namespace``: not after a
        :meth:`reset_prefix_cache`, nor in a closed adapter scope or one reopened since (:meth:`close_scope`)."""
        return stamp[0] == self._epoch and self._scopes.may_register(stamp[1], namespace)

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
        needs = [sum(blocks_to_allocate(g.kind, d, bs) for d in demands) for g in self._groups]
        if self._states is not None:
            spacing = self._states.interval * bs
            needs.append(sum(slots_to_allocate(d, spacing) for d in demands))
        return tuple(needs)

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
        available = self._supply(group)
        if len(self._ledger):
            available -= self._ledger.reserved(group, reservation)
        return available

    def _supply(self, resource: int) -> int:
        """Free plus evictable units of a resource (a group's blocks, or the state slots)."""
        if resource == len(self._groups):
            assert self._states is not None
            return self._states.num_available
        return self._groups[resource].block_manager.num_available_blocks

    def _padded(self, needs: Sequence[int], caller: str) -> list[int]:
        """``needs`` with one entry per resource (the state slots' 0 when only the groups' are given)."""
        if len(needs) not in (len(self._groups), self.num_resources):
            raise ConfigError(f"{caller}: {len(needs)} counts for {len(self._groups)} KV groups")
        return list(needs) + [0] * (self.num_resources - len(needs))

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks held back by live reservations and not drawn yet, summed over groups."""
        return sum(self._ledger.reserved(g.index) for g in self._groups)

    @property
    def num_reserved_slots(self) -> int:
        """State slots held back by live reservations and not drawn yet."""
        index = self.state_resource
        return 0 if index is None else self._ledger.reserved(index)

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
        wanted = [integer("reserve: blocks", n, minimum=0, error=ConfigError) for n in self._padded(needs, "reserve")]
        self._refresh_claimants()
        for short in self.shortfalls(wanted):
            raise OutOfBlocksError(
                f"reserve: {self._describe_short(short)}, {self._ledger.reserved(short.group)} reserved by other "
                "holders)",
                requested=short.needed,
                available=max(short.available, 0),
            )
        return Reservation(self, self._ledger, wanted)

    def _describe_short(self, short: Shortfall) -> str:
        available = max(short.available, 0)
        if short.group == len(self._groups):
            assert self._states is not None
            return (
                f"the recurrent-state slots cannot spare {short.needed}: {available} of {self._states.num_slots} are "
                f"available ({self._states.num_used} in use"
            )
        bm = self._groups[short.group].block_manager
        return (
            f"KV group {short.group} cannot spare {short.needed} blocks: {available} of its {self._num_blocks} are "
            f"available ({bm.num_used_blocks} in use"
        )

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
        for index, need in enumerate(needs[: self.num_resources]):
            if need:
                available = self._supply(index)
                if reserved:
                    available -= self._ledger.reserved(index, reservation)
                extra = reserve if index < len(self._groups) else 0
                if need + extra > available:
                    short.append(Shortfall(index, need + extra, available))
        return short

    def max_new_tokens(self, num_prompt_tokens: int, *, chunk: int | None = None) -> int | None:
        """The most new tokens one sequence with a prompt of ``num_prompt_tokens`` tokens can ever be given in this
        pool (its worst case within every group's blocks; :func:`~pagedcore.capacity.max_new_tokens`): 0 when not
        even one fits, None when any number does. A query, one exact answer.

        Example:
            >>> pool = KVPool(num_blocks=8, block_size=4, sliding_windows=(None, 8))
            >>> pool.max_new_tokens(10, chunk=16), pool.capacity_shortfalls(pool.worst_case(Demand(10, 23, chunk=16)))
            (23, [])
        """
        rooms = [
            max_new_tokens(g.kind, num_prompt_tokens, self._block_size, self._num_blocks, chunk=chunk)
            for g in self._groups
        ]
        bounded = [room for room in rooms if room is not None]
        return min(bounded) if bounded else None

    def capacity_shortfalls(self, needs: Sequence[int]) -> list[Shortfall]:
        """The groups with fewer than ``needs[g]`` blocks in all: what could never be had, however many are freed.

        Example:
            >>> KVPool(num_blocks=4, block_size=2).capacity_shortfalls([4])
            []
        """
        short = [Shortfall(g.index, n, self._num_blocks) for g, n in zip(self._groups, needs) if n > self._num_blocks]
        states, index = self._states, self.state_resource
        if states is not None and index is not None and len(needs) > index and needs[index] > states.num_slots:
            short.append(Shortfall(index, needs[index], states.num_slots))
        return short

    def _refresh_claimants(self) -> None:
        for ref in list(self._claimants):
            claimant = ref()
            if claimant is not None:
                claimant.refresh_reservation()

    # ------------------------------------------------------------------ prefix cache
    def match(
        self, token_ids: Sequence[int], namespace: Hashable = None, *, max_tokens: int | None = None
    ) -> PoolMatch:
        """The longest prefix of ``token_ids`` (at most ``max_tokens`` of them) cached in every group, to the token.
        In a pool with state slots, the deepest point of that prefix where a state snapshot was filed: every layer
        kind then has what it needs (keys and values before it, the recurrent state at it). No side effects.

        Example:
            >>> from pagedcore.block_tables import BlockTables
            >>> pool = KVPool(num_blocks=8, block_size=4)
            >>> turn = BlockTables(pool)
            >>> _ = turn.append(6)                        # a finished turn: 6 positions computed
            >>> turn.cache_partial_block([1, 2, 3, 4, 5, 6], 6); turn.release()
            >>> pool.match([1, 2, 3, 4, 5, 6, 7, 8])     # the next turn continues it inside its second block
            PoolMatch(num_tokens=6, block_ids=([0, 1],), state_slot=None, prefix_tokens=6)
            >>> pool.match([1, 2, 3, 4, 5, 6, 7, 8], max_tokens=5).num_tokens
            5
        """
        limit = len(token_ids) if max_tokens is None else max(0, min(max_tokens, len(token_ids)))
        if self._scopes.is_closed(namespace):
            limit = 0  # a closed adapter version: nothing of it is served
        matches = [g.trie.match(token_ids[:limit], namespace) for g in self._groups]
        prefix = num_tokens = min(m.num_tokens for m in matches)
        slot = None
        if self._states is not None:
            num_tokens, slot = self._deepest_snapshot(matches[self._anchor].block_ids, num_tokens)
        count = -(-num_tokens // self._block_size)
        return PoolMatch(num_tokens, tuple(m.block_ids[:count] for m in matches), slot, prefix)

    def _deepest_snapshot(self, chain: Sequence[int], num_tokens: int) -> tuple[int, int | None]:
        """The deepest snapshot filed along the anchor group's ``chain`` within its first ``num_tokens`` tokens:
        ``(its position, the snapshot)``, or ``(0, None)``."""
        assert self._states is not None
        trie, bs = self._groups[self._anchor].trie, self._block_size
        for i in range(min(len(chain), -(-num_tokens // bs)) - 1, -1, -1):
            found = self._states.deepest(chain[i], min(num_tokens - i * bs, trie.block_tokens(chain[i])))
            if found is not None:
                return i * bs + found[0], found[1]
        return 0, None

    @property
    def tiers(self) -> Tiers | None:
        """The stores below the pool (:class:`~pagedcore.kv_tiers.KVTiers`), or None."""
        return self._tiers

    def attach_tiers(self, tiers: Tiers | None) -> None:
        """Write the blocks this pool evicts into ``tiers`` and let :meth:`load_prefix` load from them (None:
        detach). See :mod:`pagedcore.kv_tiers`."""
        self._tiers = tiers

    def load_prefix(self, token_ids: Sequence[int], namespace: Hashable = None) -> int:
        """Before matching a prompt for its prefill: load the blocks that follow its pool match from the tiers
        below the pool into free or evictable blocks (never blocks other holders reserved), cached like any other,
        so that :meth:`match` finds them. Returns the tokens loaded (0 without tiers). Hold the lock every holder
        takes. Raises :class:`~pagedcore.errors.ConfigError` for a namespace that names nothing (as :meth:`match`)."""
        if self._tiers is None:
            return 0
        namespace_key(namespace)  # the identity the trie and the stores share; raises before a store is read
        if self._scopes.is_closed(namespace):
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

    def close_scope(self, scope: Hashable) -> int:
        """An adapter version's weights changed (``scope``: its :func:`~pagedcore.block_keys.namespace_scope`): forget
        the cached prefixes of every namespace of it, and from now on match and register nothing in them, for
        sequences already running or still waiting with that version alike (:mod:`pagedcore.namespace_scopes`). The
        base model's prefixes and other adapters' stay. Returns the blocks forgotten.

        Example:
            >>> from pagedcore.block_keys import AdapterNamespace
            >>> from pagedcore.block_tables import BlockTables
            >>> pool = KVPool(num_blocks=8, block_size=2)
            >>> tuned = AdapterNamespace(None, "sql", "v1")
            >>> for ns in (None, tuned):
            ...     seq = BlockTables(pool); _ = seq.append(4)
            ...     seq.cache_full_blocks([1, 2, 3, 4], 4, ns); seq.release()
            >>> pool.close_scope(("adapter", "sql", "v1")), pool.match([1, 2, 3, 4], tuned).num_tokens
            (2, 0)
            >>> pool.match([1, 2, 3, 4]).num_tokens                       # the base model's prefix stays
            4
        """
        self._scopes.close(scope)
        stale = [ns for g in self._groups for ns in g.trie.namespaces() if namespace_scope(ns) == scope]
        return self.clear_prefix_cache(*dict.fromkeys(stale)) if stale else 0

    def open_scope(self, scope: Hashable) -> bool:
        """The weights are the version ``scope`` names again (closed by :meth:`close_scope`): its namespaces may be
        matched and registered again, by sequences that start filling from now on. False when it was not closed."""
        return self._scopes.open(scope)

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
        """Raise ``AssertionError`` on inconsistent bookkeeping in any group or the state slots, or reservations
        the pool cannot back."""
        for group in self._groups:
            group.block_manager.check_invariants()
            group.trie.check_invariants()
        if self._states is not None:
            self._states.check_invariants()
            trie = self._groups[self._anchor].trie
            for block, offset, slot in self._states.snapshots():
                assert offset <= trie.block_tokens(block), f"snapshot {slot} filed past block {block}'s cached tokens"
        for index in range(self.num_resources):
            reserved, available = self._ledger.reserved(index), self._supply(index)
            assert reserved <= available, f"resource {index}: {reserved} reserved, {available} available"
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
            trie = target.groups[index].trie
            tiers.evicting(index, block_id, trie)
            states = target.states
            slot = None if states is None or index != target.anchor else states.snapshot_of(block_id, trie.block_size)
            if slot is not None:  # the snapshot at the block's end leaves with it: down it goes too
                tiers.evicting_snapshot(slot, block_id, trie.block_size, trie)

    return evicting


def _bind_state_evicting(pool: KVPool) -> Callable[[int, int, int], None]:
    ref = weakref.ref(pool)

    def evicting(slot: int, block_id: int, offset: int) -> None:
        target = ref()
        tiers = None if target is None else target.tiers
        if target is not None and tiers is not None:
            tiers.evicting_snapshot(slot, block_id, offset, target.groups[target.anchor].trie)

    return evicting


def _bind_group(on_evict: Callable[[int, list[int]], None], index: int) -> Callable[[list[int]], None]:
    def listener(block_ids: list[int]) -> None:
        on_evict(index, block_ids)

    return listener
