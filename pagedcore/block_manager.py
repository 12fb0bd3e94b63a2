"""The BlockManager: the one owner of KV blocks and their reference counts.

Each block is in exactly one state, derived from two facts the manager owns — its reference count and whether
the prefix cache indexes its content:

=========  ==========  ========  ==========================================================
state      ref count   cached    where it lives
=========  ==========  ========  ==========================================================
free       0           no        the free heap, or at/above the high-water mark (never used)
evictable  0           yes       the eviction policy's queue; ``allocate`` evicts from here
in use     >= 1        either    held by ``ref count`` sequences (or other holders)
=========  ==========  ========  ==========================================================

Host memory grows with the blocks actually used, not with ``num_blocks``: ids at or above the high-water mark have
never been handed out and have no state at all (a pool of 10**9 blocks is built in microseconds). Below it a block
costs a list slot for its reference count (8 bytes; small ints are shared), a 1-byte cached flag and, while it is
free, a slot on the free heap. Lists, not ``array('i')``: every allocate / retain / release reads and writes these
per block, and an array boxes and unboxes each access (measured 2-3x slower per block). ``allocate`` takes the
lowest free ids first (a heap of the freed ones, then never-used ids in increasing order), so small workloads stay in
a compact, low region of the pool and a sequence alone gets one run of consecutive ids, its growth included, however
its blocks were freed before (a prefix-cache reset frees each chain root first): the torch backend reads such a
sequence's keys as one view of the pool instead of gathering them at every layer of every step. Until December 2026
it took the most recently freed first (a stack), which after a reset handed a sequence its blocks in decreasing
order.

Every command validates all of its ids before it changes anything, so a call that raises leaves the manager as it
was. That holds for the eviction policy too (a plugin's code): ``allocate`` takes victims one by one until they
free enough blocks (a victim's unheld descendants in the prefix cache leave with it: :meth:`CacheIndex.subtree`), and
checks each (an evictable block, named once) before it evicts any, so it takes none it does not evict and the
others keep their places in the policy's order; a ``pop()`` that raises or names another id is a
:class:`~pagedcore.errors.PluginError` naming the policy, its victims given back. Nothing outside this module
reads or writes its fields: holders go through ``allocate`` / ``retain`` / ``release`` / ``free`` / ``append_slot``,
the prefix cache through ``mark_cached`` / ``uncache`` and the :class:`CacheIndex` callback (the design note
"BlockManager.release()", made safe).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from heapq import heappop, heappush
from typing import ClassVar, Protocol, runtime_checkable

from pagedcore.errors import (
    ConfigError,
    DoubleReleaseError,
    InvalidBlockError,
    OutOfBlocksError,
    PluginError,
    SharedBlockError,
)
from pagedcore.eviction import EvictionPolicy, LRUEvictionPolicy
from pagedcore.validation import as_integer, integer

logger = logging.getLogger(__name__)

__all__ = ["BlockManager", "CacheIndex", "SlotAppend", "blocks_to_grow"]


@runtime_checkable
class CacheIndex(Protocol):
    """What the BlockManager needs from a prefix cache (implemented by :class:`~pagedcore.prefix_trie.PrefixTrie`).

    Example:
        >>> from pagedcore.prefix_trie import PrefixTrie
        >>> bm = BlockManager(num_blocks=2, block_size=1)
        >>> trie = PrefixTrie(bm)          # attaches itself: bm.attach_cache(trie)
        >>> isinstance(trie, CacheIndex)
        True
    """

    def drop_block(self, block_id: int) -> list[int]:
        """Forget ``block_id`` because it is being evicted.

        Returns every block id that leaves the cache with it: ``block_id`` itself first, then any descendants that
        can no longer be reached once their ancestor is gone.
        """
        ...

    def subtree(self, block_id: int, skip: Container[int] = ()) -> list[int]:
        """What :meth:`drop_block` would return for ``block_id`` now, changing nothing (the manager counts what a
        victim frees before it evicts anything), less any descendant in ``skip`` and everything below it."""
        ...


@dataclass(slots=True)
class SlotAppend:
    """What :meth:`BlockManager.append_slot` did to a block table.

    Attributes:
        block_ids: the sequence's new block table (replace the old one with it).
        new_block_ids: blocks allocated by this call (copy-on-write destinations included).
        copies: ``(source, destination)`` block copies to perform before writing the new tokens.

    Example:
        >>> BlockManager(num_blocks=4, block_size=2).append_slot([], num_tokens=0, num_new_tokens=3)
        SlotAppend(block_ids=[0, 1], new_block_ids=[0, 1], copies=[])
    """

    block_ids: list[int]
    new_block_ids: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks_to_grow(num_tokens: int, num_new_tokens: int, block_size: int, *, copy: bool) -> int:
    """Blocks a table holding ``num_tokens`` positions allocates for ``num_new_tokens`` more: the blocks after its
    last one, plus a private copy of its partly filled last block when ``copy`` (that block is shared or cached, so
    writing into it would change what another holder reads: copy-on-write).

    The one rule of how a table grows: :meth:`BlockManager.append_slot` applies it with ``copy`` decided from the
    block's reference count, the worst case of a request (:mod:`pagedcore.capacity`) with ``copy`` assumed.

    Example:
        >>> blocks_to_grow(6, 3, 4, copy=False), blocks_to_grow(6, 3, 4, copy=True), blocks_to_grow(8, 3, 4, copy=True)
        (1, 2, 1)
    """
    grow = _cdiv(num_tokens + num_new_tokens, block_size) - _cdiv(num_tokens, block_size)
    return grow + int(copy and num_new_tokens > 0 and num_tokens % block_size != 0)


class BlockManager:
    """Ref-counted KV blocks with a free pool and an evictable pool of cached blocks.

    Args:
        num_blocks: blocks in the pool (1 .. :attr:`MAX_NUM_BLOCKS`). Costs nothing until blocks are used.
        block_size: tokens per block (> 0).
        eviction_policy: orders evictable blocks; LRU by default.
        on_evict: called with the ids evicted by one ``allocate`` call, after the call has finished its work.
            Exceptions it raises are logged and swallowed: an observer must never corrupt the pool.
        before_evict: called with each victim while the prefix cache still indexes it (a tier below the pool
            writes its content down: :mod:`pagedcore.kv_tiers`); must not change the manager. Exceptions are logged
            and swallowed.

    Example:
        >>> bm = BlockManager(num_blocks=4, block_size=16)
        >>> a = bm.allocate(2)
        >>> bm.retain(a)              # a second holder (e.g. a forked sequence)
        >>> bm.ref_count(a[0])
        2
        >>> bm.release(a)             # the fork is done
        >>> bm.free(a)                # the owner is done; ref count was 1
        >>> bm.num_free_blocks
        4
    """

    MAX_NUM_BLOCKS: ClassVar[int] = 2**31 - 1
    """Largest pool: block tables reach attention kernels as int32, with the pad block at id ``num_blocks``. No host
    could hold the keys and values of more blocks anyway (even at one token of one tiny layer per block)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        eviction_policy: EvictionPolicy | None = None,
        on_evict: Callable[[list[int]], None] | None = None,
        before_evict: Callable[[int], None] | None = None,
    ) -> None:
        num_blocks = integer("num_blocks", num_blocks, minimum=1, error=ConfigError, expected="a positive integer")
        if num_blocks > self.MAX_NUM_BLOCKS:
            raise ConfigError(
                f"num_blocks {num_blocks} is over the limit of {self.MAX_NUM_BLOCKS} (2**31 - 1): block ids reach "
                "attention kernels as int32; no host could hold the keys and values of that many blocks"
            )
        block_size = integer("block_size", block_size, minimum=1, error=ConfigError, expected="a positive integer")
        self._num_blocks = num_blocks
        self._block_size = block_size
        # Per-block state exists only below the high-water mark: blocks at or above it were never handed out.
        self._hwm = 0
        self._ref: list[int] = []  # reference count of blocks [0, hwm)
        self._cached = bytearray()  # 1 where the prefix cache indexes the block; blocks [0, hwm)
        self._fills: list[int] = []  # times allocate handed out each block [0, hwm) (new contents each time)
        self._num_cached = 0
        self._free: list[int] = []  # a heap (heapq) of freed blocks below the high-water mark: the lowest first
        self._policy: EvictionPolicy = eviction_policy if eviction_policy is not None else LRUEvictionPolicy()
        if len(self._policy) != 0:
            raise ConfigError("the eviction policy must start empty")
        self._index: CacheIndex | None = None
        self._on_evict = on_evict
        self._before_evict = before_evict
        self._num_evicted = 0

    # ------------------------------------------------------------------ queries (no side effects)
    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self._num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks that hold nothing (neither referenced nor cached)."""
        return len(self._free) + self._num_blocks - self._hwm

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks that no holder references: reusable after eviction."""
        return len(self._policy)

    @property
    def num_available_blocks(self) -> int:
        """Blocks ``allocate`` can hand out now: free plus evictable."""
        return len(self._free) + self._num_blocks - self._hwm + len(self._policy)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with a reference count of at least 1."""
        return self._hwm - len(self._free) - len(self._policy)

    @property
    def num_touched_blocks(self) -> int:
        """Blocks ever handed out: ids ``0 .. n-1`` (the high-water mark). ``allocate`` reuses freed blocks first, so
        the memory behind a pool's blocks is written only this far from its start."""
        return self._hwm

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the prefix cache indexes (in use or evictable)."""
        return self._num_cached

    @property
    def num_evicted(self) -> int:
        """Blocks evicted from the prefix cache since this manager was created."""
        return self._num_evicted

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (0.0 - 1.0); evictable cached blocks count as unused."""
        return self.num_used_blocks / self._num_blocks

    @property
    def eviction_policy(self) -> EvictionPolicy:
        """The policy ordering evictable blocks."""
        return self._policy

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``allocate(num_blocks)`` would succeed now."""
        return 0 <= num_blocks <= self.num_available_blocks

    def ref_count(self, block_id: int) -> int:
        """Holders of ``block_id`` (0 for free and evictable blocks)."""
        (block_id,) = self._validate((block_id,), "ref_count")
        return self._ref[block_id] if block_id < self._hwm else 0

    def fill_counts(self) -> list[int]:
        """Per block, how many times :meth:`allocate` handed it out (0: never): each time its holder writes new
        keys and values into it, so a block whose count did not change since a moment still holds what it held
        then (an audit of stale prefix hits compares them: :class:`pagedcore.stale_hits.StaleHitAudit`).

        Example:
            >>> bm = BlockManager(num_blocks=3, block_size=4)
            >>> a = bm.allocate(2); bm.free(a); _ = bm.allocate(1)   # block 0 again: the lowest free id
            >>> bm.fill_counts()
            [2, 1, 0]
        """
        return self._fills + [0] * (self._num_blocks - self._hwm)

    def fill_count(self, block_id: int) -> int:
        """How many times :meth:`allocate` handed ``block_id`` out (see :meth:`fill_counts`)."""
        (block_id,) = self._validate((block_id,), "fill_count")
        return self._fills[block_id] if block_id < self._hwm else 0

    def is_cached(self, block_id: int) -> bool:
        """Whether the prefix cache indexes ``block_id``."""
        (block_id,) = self._validate((block_id,), "is_cached")
        return block_id < self._hwm and bool(self._cached[block_id])

    def check_ids(self, block_ids: Iterable[object], op: str) -> list[int]:
        """``block_ids`` as ``int`` s, validated as every command validates its ids (integers, not bools, in range,
        each named once), else :class:`InvalidBlockError` naming ``op``. No side effects: for a caller (the prefix
        cache) that checks all of a call's ids before it changes anything."""
        return self._validate(block_ids, op)  # type: ignore[arg-type]  # _validate checks each element's type

    def blocks_needed(self, block_ids: Sequence[int], num_tokens: int, num_new_tokens: int) -> int:
        """Blocks :meth:`append_slot` would allocate for these arguments (copy-on-write included)."""
        last = self._check_table(block_ids, num_tokens, num_new_tokens, "blocks_needed")
        return self._blocks_needed(last, num_tokens, num_new_tokens)

    # ------------------------------------------------------------------ commands for holders
    def allocate(self, num_blocks: int) -> list[int]:
        """Hand out ``num_blocks`` blocks at reference count 1, evicting unreferenced cached blocks if needed.

        All or nothing: raises :class:`OutOfBlocksError` and changes nothing when fewer can be had.
        """
        if type(num_blocks) is not int or num_blocks < 0:
            num_blocks = integer("allocate: num_blocks", num_blocks, minimum=0, error=InvalidBlockError)
        free, untouched = self._free, self._num_blocks - self._hwm
        if num_blocks > len(free) + untouched + len(self._policy):
            available = self.num_available_blocks
            raise OutOfBlocksError(
                f"allocate: {num_blocks} blocks requested but only {available} can be had "
                f"({self.num_free_blocks} free + {len(self._policy)} evictable of {self._num_blocks})",
                requested=num_blocks,
                available=available,
            )
        if num_blocks == 0:
            return []
        evicted: list[int] = []
        if len(free) + untouched < num_blocks:
            self._evict(self._take_victims(num_blocks - len(free) - untouched), evicted)
        # The lowest freed ids, then never-used ids (all higher), in increasing order: one run where the pool has one.
        reused = min(num_blocks, len(free))
        if reused:
            if reused == len(free):
                ids = sorted(free)
                free.clear()
            else:
                ids = [heappop(free) for _ in range(reused)]
            ref, fills = self._ref, self._fills
            for block_id in ids:
                ref[block_id] = 1
                fills[block_id] += 1
        else:
            ids = []
        fresh = num_blocks - reused
        if fresh:
            start = self._hwm
            self._hwm = start + fresh
            ids.extend(range(start, start + fresh))
            self._ref += [1] * fresh
            self._fills += [1] * fresh
            self._cached += bytes(fresh)
        if evicted:
            self._num_evicted += len(evicted)
            self._notify_evicted(evicted)
        return ids

    def retain(self, block_ids: Iterable[int]) -> None:
        """Add a holder to each block. A cached block at reference count 0 is revived out of the evictable pool."""
        ids = self._validate(block_ids, "retain")
        ref, cached = self._ref, self._cached
        if self._any_unused(ids):
            bad = [b for b in ids if b >= self._hwm or (ref[b] == 0 and not cached[b])]
        else:
            bad = [b for b in ids if ref[b] == 0 and not cached[b]]
        if bad:
            raise InvalidBlockError(f"retain: blocks {bad} are free (not allocated, not cached); allocate them first")
        policy = self._policy
        for block_id in ids:
            if ref[block_id] == 0:
                policy.remove(block_id)
            ref[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block. At 0 a block becomes evictable if cached, else free.

        Pass a sequence's blocks tail first so that eviction later takes chains from their leaves.
        Releasing a block that is already at 0 raises :class:`DoubleReleaseError` (and changes nothing).
        """
        ids = self._validate(block_ids, "release")
        bad = self._unheld(ids)
        if bad:
            raise DoubleReleaseError(f"release: blocks {bad} have reference count 0 (released twice?)")
        self._drop_refs(ids)

    def free(self, block_ids: Iterable[int]) -> None:
        """Give back blocks that the caller holds alone (reference count exactly 1).

        A block still referenced by another holder raises :class:`SharedBlockError` instead of being recycled; a
        block the prefix cache indexes becomes evictable (its content stays reusable) rather than free.
        """
        ids = self._validate(block_ids, "free")
        ref = self._ref
        unheld = self._unheld(ids)
        if unheld:
            raise DoubleReleaseError(f"free: blocks {unheld} have reference count 0 (freed twice?)")
        shared = [(b, ref[b]) for b in ids if ref[b] != 1]
        if shared:
            listing = ", ".join(f"{b} (ref {r})" for b, r in shared)
            raise SharedBlockError(f"free: blocks {listing} are shared; use release() to drop one reference")
        self._drop_refs(ids)

    def fork(self, block_ids: Sequence[int]) -> list[int]:
        """Add a holder to every block of a table and return a copy of it, for a forked sequence."""
        ids = self._validate(block_ids, "fork")
        bad = self._unheld(ids)
        if bad:
            raise InvalidBlockError(f"fork: blocks {bad} are not in use")
        self.retain(ids)
        return ids

    def append_slot(self, block_ids: Sequence[int], num_tokens: int, num_new_tokens: int = 1) -> SlotAppend:
        """Make room in a block table for ``num_new_tokens`` more tokens.

        Args:
            block_ids: the sequence's table; the caller holds one reference on each block.
            num_tokens: tokens already stored in the table (``len(block_ids) == ceil(num_tokens / block_size)``).
            num_new_tokens: tokens about to be written after them.

        Returns:
            The new table, the blocks allocated, and the ``(source, destination)`` copies to perform before writing:
            when the partly filled last block is shared or cached, writing into it would change what another
            holder (or the prefix cache) reads, so it is replaced by a private copy (copy-on-write).

        Raises :class:`OutOfBlocksError` and changes nothing when the blocks cannot be had. Only the ids this
        call acts on are validated (the table's length and its last block), so a decode step costs O(1), not
        O(table length).

        Example:
            >>> bm = BlockManager(num_blocks=8, block_size=4)
            >>> table = bm.allocate(1)                 # holds tokens 0..2
            >>> forked = bm.fork(table)                # another sequence shares the block
            >>> out = bm.append_slot(table, num_tokens=3, num_new_tokens=2)
            >>> out.copies                             # private copy of the shared block, then one more block
            [(0, 1)]
            >>> out.block_ids
            [1, 2]
        """
        last = self._check_table(block_ids, num_tokens, num_new_tokens, "append_slot")
        table = list(block_ids)
        needed = self._blocks_needed(last, num_tokens, num_new_tokens)
        if needed == 0:
            return SlotAppend(block_ids=table)
        new_ids = self.allocate(needed)  # raises (changing nothing) when short
        copies: list[tuple[int, int]] = []
        cursor = 0
        if self._needs_copy(last, num_tokens, num_new_tokens):
            source, destination = table[-1], new_ids[0]
            copies.append((source, destination))
            table[-1] = destination
            self._drop_refs([source])
            cursor = 1
        table.extend(new_ids[cursor:])
        return SlotAppend(block_ids=table, new_block_ids=new_ids, copies=copies)

    # ------------------------------------------------------------------ commands for the prefix cache
    def attach_cache(self, index: CacheIndex) -> None:
        """Register the prefix cache that indexes this manager's blocks (one per manager)."""
        if self._index is not None and self._index is not index:
            raise ConfigError("attach_cache: this BlockManager already serves another prefix cache")
        self._index = index

    def mark_cached(self, block_ids: Iterable[int]) -> None:
        """Record that the prefix cache now indexes these blocks (each in use and not yet cached)."""
        ids = self._validate(block_ids, "mark_cached")
        if self._index is None:
            raise ConfigError("mark_cached: no prefix cache is attached (attach_cache first)")
        bad = [b for b in ids if b >= self._hwm or self._ref[b] == 0 or self._cached[b]]
        if bad:
            raise InvalidBlockError(f"mark_cached: blocks {bad} are not in use, or are cached already")
        for block_id in ids:
            self._cached[block_id] = 1
        self._num_cached += len(ids)

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Record that the prefix cache forgot these blocks; unreferenced ones become free at once."""
        ids = self._validate(block_ids, "uncache")
        bad = [b for b in ids if b >= self._hwm or not self._cached[b]]
        if bad:
            raise InvalidBlockError(f"uncache: blocks {bad} are not cached")
        self._uncache(ids)

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping is inconsistent. For tests and debugging; O(blocks used)."""
        n, hwm = self._num_blocks, self._hwm
        assert 0 <= hwm <= n, f"high-water mark {hwm} outside [0, {n}]"
        assert len(self._ref) == len(self._cached) == len(self._fills) == hwm, "per-block state does not end at the hwm"
        free = set(self._free)
        assert len(free) == len(self._free), "a block appears twice on the free heap"
        assert all(0 <= b < hwm for b in free), "a never-used block is on the free heap"
        heap = self._free
        assert all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap))), "the free heap is out of order"
        in_use = 0
        for block_id in range(hwm):
            r, c = self._ref[block_id], self._cached[block_id]
            in_free, in_policy = block_id in free, block_id in self._policy
            assert r >= 0, f"block {block_id} has negative ref count {r}"
            if r > 0:
                in_use += 1
                assert not in_free and not in_policy, f"block {block_id} is referenced but free/evictable"
            elif c:
                assert in_policy and not in_free, f"cached block {block_id} at ref 0 is not evictable"
            else:
                assert in_free and not in_policy, f"unreferenced uncached block {block_id} is not free"
        assert self._cached.count(1) == self._num_cached, "cached count disagrees with the cached flags"
        total = len(self._free) + (n - hwm) + len(self._policy) + in_use
        assert total == n, f"free + evictable + in use = {total} != {n}"

    def __repr__(self) -> str:
        return (
            f"BlockManager(num_blocks={self._num_blocks}, block_size={self._block_size}, "
            f"free={self.num_free_blocks}, evictable={len(self._policy)}, used={self.num_used_blocks})"
        )

    # ------------------------------------------------------------------ internals
    def _validate(self, block_ids: Iterable[int], op: str) -> list[int]:
        ids = list(block_ids)
        n = self._num_blocks
        if len(ids) == 1 and type(ids[0]) is int and 0 <= ids[0] < n:  # one block a step (a growing sequence's)
            return ids
        for i, block_id in enumerate(ids):
            if type(block_id) is not int:
                number = as_integer(block_id)
                if number is None:
                    raise InvalidBlockError(f"{op}: block id {block_id!r} is not an integer")
                block_id = ids[i] = number
            if not 0 <= block_id < n:
                raise InvalidBlockError(f"{op}: block id {block_id} is out of range [0, {n})")
        if len(set(ids)) != len(ids):
            seen: set[int] = set()
            dups = sorted({b for b in ids if b in seen or seen.add(b)})  # type: ignore[func-returns-value]
            raise InvalidBlockError(f"{op}: block ids {dups} appear more than once in one call")
        return ids

    def _any_unused(self, ids: list[int]) -> bool:
        """Whether an id is at or above the high-water mark (never used: ref count 0, not cached, no state)."""
        return bool(ids) and max(ids) >= self._hwm

    def _unheld(self, ids: list[int]) -> list[int]:
        """The ids whose reference count is 0."""
        ref = self._ref
        if self._any_unused(ids):
            return [b for b in ids if b >= self._hwm or ref[b] == 0]
        return [b for b in ids if ref[b] == 0]

    def _check_table(self, ids: Sequence[int], num_tokens: int, num_new_tokens: int, op: str) -> int | None:
        """Validate a table's length and its last block (the only one a growth step acts on); return that block."""
        if type(num_tokens) is not int or type(num_new_tokens) is not int or num_tokens < 0 or num_new_tokens < 0:
            # The fast path above only lets plain ints through; the rule is validation.integer's (no float, no bool).
            num_tokens = integer(f"{op}: num_tokens", num_tokens, minimum=0, error=InvalidBlockError)
            num_new_tokens = integer(f"{op}: num_new_tokens", num_new_tokens, minimum=0, error=InvalidBlockError)
        expected = _cdiv(num_tokens, self._block_size)
        if len(ids) != expected:
            raise InvalidBlockError(
                f"{op}: a table holding {num_tokens} tokens needs {expected} blocks of {self._block_size}, "
                f"got {len(ids)}"
            )
        if not ids:
            return None
        last = ids[-1]
        if type(last) is not int or not 0 <= last < self._num_blocks:
            (last,) = self._validate([last], op)  # coerces or raises with the standard message
        if last >= self._hwm or self._ref[last] == 0:
            raise InvalidBlockError(f"{op}: block {last} (the table's last) is not held by anyone")
        return last

    def _needs_copy(self, last: int | None, num_tokens: int, num_new_tokens: int) -> bool:
        """Whether writing after ``num_tokens`` copies the last block first: it is partly filled and shared/cached."""
        if last is None or num_new_tokens == 0 or num_tokens % self._block_size == 0:
            return False
        return self._ref[last] > 1 or bool(self._cached[last])

    def _blocks_needed(self, last: int | None, num_tokens: int, num_new_tokens: int) -> int:
        # The table holds ceil(num_tokens / block_size) blocks (checked by _check_table): blocks_to_grow's rule.
        copy = self._needs_copy(last, num_tokens, num_new_tokens)
        return blocks_to_grow(num_tokens, num_new_tokens, self._block_size, copy=copy)

    def _drop_refs(self, ids: list[int]) -> None:
        ref, cached, policy, free = self._ref, self._cached, self._policy, self._free
        for block_id in ids:
            r = ref[block_id] - 1
            ref[block_id] = r
            if r == 0:
                if cached[block_id]:
                    policy.add(block_id)
                else:
                    heappush(free, block_id)

    def _uncache(self, ids: list[int]) -> None:
        ref, cached, policy, free = self._ref, self._cached, self._policy, self._free
        self._num_cached -= len(ids)
        for block_id in ids:
            cached[block_id] = 0
            if ref[block_id] == 0:
                policy.remove(block_id)
                heappush(free, block_id)

    def _take_victims(self, needed: int) -> list[int]:
        """Victims from the eviction policy, one by one, until evicting them frees ``needed`` blocks (each its own
        and its unheld descendants'), each checked before anything changes (an evictable block: cached, held by
        nobody, named once): no victim is taken that is not evicted, so the others keep their places. A ``pop()``
        that raises or names any other id: what was taken goes back to the policy and :class:`PluginError` names the
        policy, the manager as it was (a policy is a plugin's code, never trusted with the pool)."""
        policy, index = self._policy, self._index
        victims: list[int] = []
        taken: set[int] = set()
        freeing: set[int] = set()  # the blocks the victims taken so far free
        while len(freeing) < needed:
            try:
                victim = policy.pop()
            except Exception as exc:
                self._restore_policy(victims)
                raise PluginError(f"{self._policy_label()}: pop() raised {type(exc).__name__}: {exc}") from exc
            problem = self._victim_problem(victim, taken)
            if problem is not None:
                self._restore_policy(victims)
                raise PluginError(f"{self._policy_label()}: pop() returned {victim!r}, {problem}")
            victims.append(victim)
            taken.add(victim)
            if victim in freeing:
                continue  # it leaves with an ancestor taken before it
            # What evicting it frees: itself and its descendants in the prefix cache that nobody holds, less those
            # counted already (a counted block's descendants were counted with it: a chain taken leaf first costs
            # one step per victim).
            below = [victim] if index is None else index.subtree(victim, freeing)
            if len(below) == 1:
                freeing.add(victim)
            else:
                ref = self._ref
                freeing.update(block_id for block_id in below if ref[block_id] == 0)
        return victims

    def _victim_problem(self, victim: object, taken: set[int]) -> str | None:
        """Why ``victim`` (a policy's ``pop()``) is not a block to evict now, or None."""
        if type(victim) is not int:
            return "not a block id (an int)"
        if not 0 <= victim < self._hwm:
            return f"not a block of this pool that was ever handed out (ids below {self._hwm})"
        if self._ref[victim]:
            return f"a block in use ({self._ref[victim]} holder(s))"
        if not self._cached[victim]:
            return "a free block (not cached, never added to the policy)"
        if victim in taken:
            return "a block it already returned in this allocation"
        if victim in self._policy:
            return "a block it still holds (pop() must forget its victim)"
        return None

    def _policy_label(self) -> str:
        kind = type(self._policy)
        return f"eviction policy {getattr(self._policy, 'name', None)!r} ({kind.__module__}.{kind.__qualname__})"

    def _restore_policy(self, victims: list[int]) -> None:
        """Give the policy back every evictable block it no longer holds: the victims taken (in the order taken),
        then any a faulty ``pop()`` dropped without returning it. O(blocks used); only after a policy failed."""
        ref, cached, policy = self._ref, self._cached, self._policy
        try:
            for block_id in victims:
                policy.add(block_id)
            for block_id in range(self._hwm):
                if ref[block_id] == 0 and cached[block_id] and block_id not in policy:
                    policy.add(block_id)
        except Exception:
            logger.exception("pagedcore: %s failed while its victims were given back", self._policy_label())

    def _evict(self, victims: list[int], evicted: list[int]) -> None:
        """Evict ``victims`` in order (:meth:`_take_victims` took just the ones needed)."""
        taken = set(victims)
        for victim in victims:
            if self._cached[victim]:  # else it left the cache with an ancestor evicted before it
                self._evict_one(victim, taken, evicted)

    def _evict_one(self, victim: int, taken: set[int], evicted: list[int]) -> None:
        if self._before_evict is not None and self._index is not None:
            try:
                self._before_evict(victim)
            except Exception:  # a tier must never corrupt or block the pool
                logger.exception("pagedcore: before_evict listener failed; the pool is unaffected")
        self._cached[victim] = 0
        self._num_cached -= 1
        heappush(self._free, victim)
        evicted.append(victim)
        if self._index is None:
            return
        dropped = self._index.drop_block(victim)
        if len(dropped) == 1 and dropped[0] == victim:
            return  # a leaf (the usual LRU victim)
        if not dropped or dropped[0] != victim:
            raise AssertionError(f"the prefix cache did not drop evicted block {victim} first")
        ref, cached, policy, free = self._ref, self._cached, self._policy, self._free
        self._num_cached -= len(dropped) - 1
        for block_id in dropped[1:]:
            cached[block_id] = 0
            if ref[block_id] == 0:
                if block_id not in taken:  # a victim taken for this call is out of the policy already
                    policy.remove(block_id)
                heappush(free, block_id)
                evicted.append(block_id)

    def _notify_evicted(self, evicted: list[int]) -> None:
        if self._on_evict is None:
            return
        try:
            self._on_evict(list(evicted))
        except Exception:  # an observer must never corrupt or block the pool
            logger.exception("pagedcore: on_evict listener failed; the pool is unaffected")
