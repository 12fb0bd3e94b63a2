"""BlockTables: one sequence's block table in every group of a :class:`~pagedcore.kv_pool.KVPool`.

It is the only holder-side code: it attaches prefix hits, grows tables (with copy-on-write), drops blocks that fell
out of a sliding window, registers full blocks in the prefix caches, forks, truncates and releases — always
through the BlockManager's public interface. In a pool with recurrent-state slots (:mod:`pagedcore.state_slots`) it
also holds the sequence's state slot (copied before a write when shared: :meth:`BlockTables.write_state`) and the
snapshots it took (:meth:`BlockTables.snapshot`), filed beside their blocks when it registers them
(:mod:`pagedcore.sequence_slots`). A sequence whose holder reserved blocks
(:meth:`KVPool.reserve <pagedcore.kv_pool.KVPool.reserve>`) draws from that reservation: every change to the blocks
it holds is accounted to it (see :class:`~pagedcore.capacity.Reservation`), and nothing it does takes blocks other
holders reserved.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Sequence

from pagedcore.block_manager import SlotAppend
from pagedcore.capacity import Reservation
from pagedcore.errors import InvalidBlockError, OutOfBlocksError
from pagedcore.kv_pool import KVPool, PoolMatch
from pagedcore.sequence_slots import SequenceSlots, StateCopy
from pagedcore.validation import as_integer

__all__ = ["BlockTables", "Copy", "StateCopy", "append_all"]

Copy = tuple[int, int, int]
"""A copy-on-write copy to perform before writing: ``(group index, source block, destination block)``."""


class BlockTables:
    """A sequence's blocks in every group, and the number of token positions they hold.

    Positions ``0 .. num_tokens - 1`` have slots. In a sliding group the blocks that fell wholly out of the window
    have been released: ``num_dropped(g)`` leading logical blocks are gone and ``table(g)`` starts after them.

    Args:
        pool: the pool the blocks come from.
        reservation: the holder's :class:`~pagedcore.capacity.Reservation`, drawn from as the tables grow (forks
            draw from it too); None for a holder without one, which never gets blocks other holders reserved.

    Example:
        >>> pool = KVPool(num_blocks=8, block_size=4)
        >>> seq = BlockTables(pool)
        >>> seq.append(6)                       # room for tokens 0..5
        []
        >>> seq.table(0), seq.slots(0, 4, 6)    # 2 blocks; tokens 4 and 5 go to slots 4 and 5
        ([0, 1], [4, 5])
        >>> seq.release()
        >>> pool.groups[0].block_manager.num_free_blocks
        8
    """

    __slots__ = ("_arrays", "_bs", "_dropped", "_last_private", "_next_drop", "_next_full", "_num_cached_blocks",
                 "_num_tokens", "_pool", "_released", "_reservation", "_row_tables", "_rows", "_sliding", "_slots",
                 "_stamp", "_tables", "_uncachable")  # fmt: skip

    def __init__(self, pool: KVPool, reservation: Reservation | None = None) -> None:
        self._pool = pool
        self._reservation = reservation
        self._tables: list[list[int]] = [[] for _ in pool.groups]
        self._arrays: list[array[int] | None] = [None] * len(pool.groups)  # table_array's copies (None: stale)
        self._rows = [-1] * len(pool.groups)  # table_row's row of each group's TableRows (-1: none held)
        self._row_tables: list[array[int] | None] = [None] * len(pool.groups)  # the table_array each row holds
        self._dropped = [0] * len(pool.groups)
        self._num_tokens = 0
        self._num_cached_blocks = [0] * len(pool.groups)  # leading full blocks registered in the prefix cache
        self._uncachable = [False] * len(pool.groups)  # the chain's head was evicted: stop registering
        # The partly filled last block of every group was allocated by this sequence's own append (ref 1, not
        # cached), so writing into it needs no copy: decode steps then skip the BlockManager entirely.
        self._last_private = False
        self._next_full = 0  # cache_full_blocks has nothing to do before this many computed tokens
        self._released = False
        self._bs = pool.block_size
        self._sliding = [g.index for g in pool.groups if g.kind.is_sliding]
        self._next_drop = 0  # drop_out_of_window has nothing to release before this position
        self._stamp = pool.stamp  # the pool's epoch and scope clock as this table started filling (cache_full_blocks)
        # The recurrent state and its snapshots, in a pool with state slots.
        self._slots = SequenceSlots(pool) if pool.states is not None else None

    # ------------------------------------------------------------------ queries
    @property
    def pool(self) -> KVPool:
        """The pool the blocks come from."""
        return self._pool

    @property
    def num_tokens(self) -> int:
        """Token positions that have a slot."""
        return self._num_tokens

    @property
    def reservation(self) -> Reservation | None:
        """The reservation its growth draws from (None: none)."""
        return self._reservation

    @reservation.setter
    def reservation(self, value: Reservation | None) -> None:
        self._reservation = value

    def table(self, group: int) -> list[int]:
        """Live blocks of ``group`` (a copy), starting at logical block ``num_dropped(group)``."""
        return list(self._tables[group])

    def table_array(self, group: int) -> array[int]:
        """:meth:`table` as an ``array('i')`` (int32), kept between calls until the table changes: a step packs the
        block tables of hundreds of sequences into one tensor by copying these buffers, without a per-block Python
        loop (a decode step changes a sequence's table once per ``block_size`` tokens). Do not modify it.

        Example:
            >>> seq = BlockTables(KVPool(num_blocks=8, block_size=4))
            >>> _ = seq.append(6)
            >>> seq.table_array(0).tolist(), seq.table_array(0) is seq.table_array(0)
            ([0, 1], True)
        """
        cached = self._arrays[group]
        if cached is None:
            cached = self._arrays[group] = array("i", self._tables[group])
        return cached

    def table_row(self, group: int) -> int:
        """The row of the group's :class:`~pagedcore.table_rows.TableRows` (``pool.groups[group].rows``) that holds
        :meth:`table`, written now if the table changed since it was last written; held until :meth:`release`. A
        step gathers its sequences' tables from those rows in one copy (:meth:`TableRows.gather
        <pagedcore.table_rows.TableRows.gather>`) instead of copying every table again.

        Example:
            >>> pool = KVPool(num_blocks=8, block_size=4)
            >>> seq = BlockTables(pool)
            >>> _ = seq.append(6)
            >>> row = seq.table_row(0)
            >>> pool.groups[0].rows.gather([row]).tolist()
            [[0, 1]]
            >>> seq.release(); pool.groups[0].rows.num_used
            0
        """
        row, written = self._rows[group], self._row_tables[group]
        if written is not None and written is self._arrays[group]:
            return row  # the table has not changed since (a changed table's array is dropped: _stale)
        rows = self._pool.groups[group].rows
        if row < 0:
            row = self._rows[group] = rows.acquire()
        table = self.table_array(group)
        rows.write(row, table)
        self._row_tables[group] = table  # kept alive, so no later array can be mistaken for it
        return row

    @property
    def state_slot(self) -> int | None:
        """The slot holding the sequence's recurrent state after its ``num_tokens`` tokens (None: no state yet, or a
        pool without state slots)."""
        return None if self._slots is None else self._slots.slot

    @property
    def pending_snapshots(self) -> list[tuple[int, int]]:
        """``(position, slot)`` of the snapshots taken and not filed in the prefix cache yet (held by this table)."""
        return [] if self._slots is None else self._slots.pending

    def can_register(self, namespace: Hashable = None) -> bool:
        """Whether the tables' blocks (and the snapshots taken beside them) can still enter the prefix caches in
        ``namespace``: they were filled in the pool's current epoch, under an adapter version still open (see
        :meth:`cache_full_blocks`), and not released."""
        return not self._released and self._pool.may_register(self._stamp, namespace)

    def needs_state_slot(self) -> bool:
        """Whether the next :meth:`write_state` takes a slot from the pool: the sequence has no state yet, or shares
        its slot (a fork, a restored snapshot, a snapshot filed) and must copy it first. False without state slots."""
        return self._slots is not None and self._slots.needs_slot()

    def num_held_slots(self) -> int:
        """State slots this sequence holds (its state and its pending snapshots)."""
        return 0 if self._slots is None else self._slots.num_held()

    def num_dropped(self, group: int) -> int:
        """Leading logical blocks of ``group`` released because they left the sliding window."""
        return self._dropped[group]

    def num_held_blocks(self) -> int:
        """Blocks this sequence holds, over all groups."""
        return sum(len(t) for t in self._tables)

    def slots(self, group: int, start: int, end: int) -> list[int]:
        """Physical slots (``block * block_size + offset``) of positions ``start .. end - 1`` in ``group``."""
        bs = self._bs
        first = self._dropped[group] * bs
        if start < first or end > self._num_tokens or start > end:
            raise InvalidBlockError(
                f"slots: positions [{start}, {end}) are not held (held: [{first}, {self._num_tokens}))"
            )
        table = self._tables[group]
        dropped = self._dropped[group]
        if end - start == 1:
            return [table[start // bs - dropped] * bs + start % bs]
        return [table[p // bs - dropped] * bs + p % bs for p in range(start, end)]

    def blocks_needed(self, num_new_tokens: int) -> list[int]:
        """Blocks each group would allocate for ``append(num_new_tokens)``."""
        if self._fits_in_private_block(num_new_tokens):
            return [0] * len(self._tables)
        return [
            g.block_manager.blocks_needed(self._tables[i], self._held_tokens(i), num_new_tokens)
            for i, g in enumerate(self._pool.groups)
        ]

    def can_append(self, num_new_tokens: int, *, reserve: int = 0) -> bool:
        """Whether ``append(num_new_tokens)`` would succeed, leaving ``reserve`` blocks free in every group that
        allocates (the pool decides: :meth:`KVPool.shortfalls`, with this sequence's reservation)."""
        if self._fits_in_private_block(num_new_tokens):
            return True
        needs = self.blocks_needed(num_new_tokens)
        return not self._pool.shortfalls(needs, reserve=reserve, reservation=self._reservation)

    def blocks_to_peak(self, peaks: Sequence[int]) -> list[int]:
        """Per group, the blocks still to allocate before its table holds ``peaks[g]`` blocks (a copy of a shared,
        partly filled last block included): what a sequence whose worst case is ``peaks`` may still take.

        Example:
            >>> seq = BlockTables(KVPool(num_blocks=8, block_size=4))
            >>> _ = seq.append(6)
            >>> seq.blocks_to_peak([5])
            [3]
        """
        copy = int(not self._last_private and self._num_tokens % self._bs != 0)
        return [max(0, peak - len(table)) + copy for peak, table in zip(peaks, self._tables)]

    def can_truncate(self, num_tokens: int) -> bool:
        """Whether :meth:`truncate` to ``num_tokens`` positions is possible: in a sliding group, the query at
        ``num_tokens`` must not need keys whose blocks already left the window (its kind decides)."""
        bs = self._bs
        return all(
            g.kind.can_truncate(num_tokens, self._dropped[g.index], bs) for g in self._pool.groups if g.kind.is_sliding
        )

    # ------------------------------------------------------------------ commands
    def attach(self, match: PoolMatch, num_tokens: int) -> None:
        """Start from a prefix hit: hold the blocks that cover the first ``num_tokens`` tokens of ``match``.

        ``num_tokens`` may end inside a block (e.g. to leave the last prompt token to compute); that block is then
        shared and gets copied on the first write into it.
        """
        self._check_live()
        if self._num_tokens or any(self._tables):
            raise InvalidBlockError("attach: the sequence already holds blocks")
        if not 0 <= num_tokens <= match.num_tokens:
            raise InvalidBlockError(f"attach: num_tokens {num_tokens} outside the match [0, {match.num_tokens}]")
        bs = self._pool.block_size
        count = -(-num_tokens // bs)
        state = None if self._slots is None else self._slots.check_restore(match, num_tokens, self._reservation)
        revived = self._check_revival([ids[:count] for ids in match.block_ids])
        held: list[tuple[int, list[int]]] = []
        try:
            for i, group in enumerate(self._pool.groups):
                ids = match.block_ids[i][:count]
                group.block_manager.retain(ids)
                held.append((i, ids))
        except Exception:
            for i, ids in held:
                self._pool.groups[i].block_manager.release(ids[::-1])
            raise
        if self._reservation is not None:
            for i, n in enumerate(revived):
                self._reservation.take(i, n)
        if self._slots is not None:
            self._slots.restore(state, self._reservation)
        self._stale()
        self._stamp = self._pool.stamp  # an empty table starts over with the current cache's blocks
        for i, ids in held:
            self._tables[i] = list(ids)
            self._num_cached_blocks[i] = num_tokens // bs
        self._num_tokens = num_tokens
        self._last_private = False
        self._next_full = 0

    def append(self, num_new_tokens: int) -> list[Copy]:
        """Give ``num_new_tokens`` more positions a slot in every group. All groups or none.

        Returns the copy-on-write copies to perform before writing. Raises :class:`OutOfBlocksError` and changes
        nothing when some group is short of blocks.
        """
        self._check_live()
        if self._fits_in_private_block(num_new_tokens):
            self._num_tokens += num_new_tokens
            return []
        short = self._pool.shortfalls(self.blocks_needed(num_new_tokens), reservation=self._reservation)
        if short:
            detail = ", ".join(f"group {s.group}: need {s.needed}, have {s.available}" for s in short)
            raise OutOfBlocksError(
                f"append: not enough blocks for {num_new_tokens} tokens ({detail})",
                requested=sum(s.needed for s in short),
                available=sum(s.available for s in short),
            )
        return self._grow(num_new_tokens)

    def try_append(self, num_new_tokens: int, *, reserve: int = 0) -> list[Copy] | None:
        """:meth:`append` when it would leave ``reserve`` blocks free in every group, else None (nothing changed).

        One call for the scheduler's check-then-grow; a decode step into a private block costs a few comparisons,
        one that starts a block computes what it needs once.
        """
        used = self._num_tokens % self._bs
        if self._last_private and used and used + num_new_tokens <= self._bs and not self._released:
            self._num_tokens += num_new_tokens  # the decode fast path, inlined
            return []
        self._check_live()
        if not self.can_append(num_new_tokens, reserve=reserve):
            return None
        return self._grow(num_new_tokens)

    def _grow(self, num_new_tokens: int) -> list[Copy]:
        """:meth:`append` once the blocks it needs are known to be available. All groups or none: when a group's
        allocation raises anyway (its eviction policy, a plugin's code, failed: ``PluginError``), the groups grown
        before it are undone, so no block is left held by nobody and the tables stay as they were."""
        copies: list[Copy] = []
        self._stale()
        before = self._available()
        grown: list[tuple[int, list[int], SlotAppend]] = []
        try:
            for i, group in enumerate(self._pool.groups):
                out = group.block_manager.append_slot(self._tables[i], self._held_tokens(i), num_new_tokens)
                grown.append((i, self._tables[i], out))
                self._tables[i] = out.block_ids
                copies.extend((i, src, dst) for src, dst in out.copies)
        except Exception:
            for i, table, out in grown:
                bm = self._pool.groups[i].block_manager
                bm.retain([src for src, _ in out.copies])  # the copied block, held again (it is in use or cached)
                bm.free(out.new_block_ids)
                self._tables[i] = table
            raise
        finally:
            self._settle(before)
        self._num_tokens += num_new_tokens
        # Every group's last block is now private: fresh, a copy, or checked by the manager (ref 1, uncached).
        self._last_private = num_new_tokens > 0
        return copies

    @property
    def has_sliding_groups(self) -> bool:
        """Whether any group of the pool has a sliding window (else :meth:`drop_out_of_window` is a no-op)."""
        return bool(self._sliding)

    def drop_out_of_window(self, next_position: int) -> int:
        """Release sliding-group blocks that no query at ``next_position`` or later can see. Returns blocks released."""
        if next_position < self._next_drop:
            return 0  # the common decode step: no group's next block has left its window yet
        bs = self._bs
        released = 0
        next_drop = None
        before = self._available()
        gave = [0] * len(self._tables)
        for i in self._sliding:
            group = self._pool.groups[i]
            kind = group.kind
            count = min(kind.first_needed_block(next_position, bs) - self._dropped[i], len(self._tables[i]))
            if count > 0:
                gone = self._tables[i][:count]
                group.block_manager.release(gone[::-1])
                del self._tables[i][:count]
                self._arrays[i] = None
                self._dropped[i] += count
                released += count
                gave[i] = count
            # The first query that no longer sees the last key of the group's first live block.
            last = kind.last_query_seeing((self._dropped[i] + 1) * bs - 1)
            if last is not None and (next_drop is None or last + 1 < next_drop):
                next_drop = last + 1
        self._next_drop = next_drop if next_drop is not None else 0
        self._settle(before)
        if before is not None and released:
            self._replace_kept(before, gave)
        return released

    def cache_full_blocks(self, token_ids: Sequence[int], num_computed: int, namespace: Hashable = None) -> None:
        """Register blocks whose ``block_size`` tokens all have computed KV in the prefix caches.

        ``token_ids`` are the sequence's tokens (at least ``num_computed`` of them). Where another sequence cached
        the same content first, this sequence switches to that block and gives its duplicate back. A growing
        sequence registers each new block under its last registered one, in O(1). A sequence that started before
        the pool's last :meth:`~pagedcore.kv_pool.KVPool.reset_prefix_cache` registers nothing: its keys and values
        were computed by the model as it was; nor does one in an adapter's namespace whose version was closed, or
        reopened since it started (:meth:`~pagedcore.kv_pool.KVPool.close_scope`).
        """
        if num_computed < self._next_full:
            return  # the common decode step: no block filled up since the last call
        self._check_live()
        if not self._pool.may_register(self._stamp, namespace):
            return
        bs = self._bs
        num_full = min(num_computed, self._num_tokens, len(token_ids)) // bs
        if num_full <= min(self._num_cached_blocks):
            self._next_full = (num_full + 1) * bs
            self._file_pending(num_full * bs)
            return
        for i, group in enumerate(self._pool.groups):
            done = self._num_cached_blocks[i]
            if self._uncachable[i] or num_full <= done:
                continue
            first = self._dropped[i]
            table = self._tables[i]
            parent = table[done - 1 - first] if done > first else None
            if parent is not None and group.trie.contains(parent):
                own = table[done - first : num_full - first]
                canonical = group.trie.insert(token_ids[done * bs : num_full * bs], own, namespace, parent=parent)
                offset = done - first
            else:
                head: list[int] = []
                if first:
                    # Blocks that left a sliding window are no longer held; the chain's head must still be cached.
                    hit = group.trie.match(token_ids[: first * bs], namespace)
                    head = hit.block_ids
                    if hit.num_tokens < first * bs:
                        self._uncachable[i] = True  # evicted: nothing after it can be reached from the root
                        continue
                own = table[: num_full - first]
                canonical = group.trie.insert(token_ids[: num_full * bs], head + own, namespace)[first:]
                offset = 0
            swaps = [(offset + j, can) for j, (mine, can) in enumerate(zip(own, canonical)) if mine != can]
            if swaps and not self._can_swap(i, [table[j] for j, _ in swaps], [can for _, can in swaps]):
                swaps = []  # keep our own copies: sharing would revive cached blocks that other holders reserved
            if swaps:
                before = self._available()
                # Same content was cached by another sequence first: share its block, give ours back.
                group.block_manager.retain([can for _, can in swaps])
                group.block_manager.release([table[j] for j, _ in reversed(swaps)])
                for j, can in swaps:
                    table[j] = can
                self._arrays[i] = None
                self._settle(before)
            self._num_cached_blocks[i] = num_full
        self._next_full = (num_full + 1) * bs
        self._file_pending(num_full * bs)

    def cache_partial_block(self, token_ids: Sequence[int], num_computed: int, namespace: Hashable = None) -> None:
        """Register the full blocks and then the partly filled last block (its first ``num_computed % block_size``
        positions) in the prefix caches, so that a prompt continuing this sequence inside that block (the next chat
        turn) reuses them too. For a sequence that stops here: it finished, was preempted, or its ``generate`` call
        ended.

        ``token_ids`` are the sequence's tokens (at least ``num_computed`` of them). The block becomes shared
        content: a later write into it (a kept cache continued) copies it first. A group registers it only under its
        cached chain (a sliding group whose chain was evicted, or whose blocks another holder's duplicate stands in
        for, does not; the pool's match then stops at the full blocks), and nothing is registered for a sequence
        filled before the pool's last :meth:`~pagedcore.kv_pool.KVPool.reset_prefix_cache`.

        Example:
            >>> pool = KVPool(num_blocks=8, block_size=4)
            >>> seq = BlockTables(pool)
            >>> _ = seq.append(6)
            >>> seq.cache_partial_block([1, 2, 3, 4, 5, 6], 6)
            >>> pool.num_cached_blocks, pool.match([1, 2, 3, 4, 5, 9]).num_tokens
            (2, 5)
        """
        self.cache_full_blocks(token_ids, num_computed, namespace)
        if self._released or not self._pool.may_register(self._stamp, namespace):
            return
        count = min(num_computed, self._num_tokens, len(token_ids))
        num_full, used = divmod(count, self._bs)
        if not used:
            self._file_live(count)
            return
        tokens = token_ids[num_full * self._bs : count]
        for i, group in enumerate(self._pool.groups):
            first, table = self._dropped[i], self._tables[i]
            if self._uncachable[i] or self._num_cached_blocks[i] < num_full or num_full < first:
                continue
            block = table[num_full - first]
            chained, parent = self._cached_parent(i, token_ids, num_full, namespace)
            if not chained or group.trie.contains(block):
                continue  # no cached chain to hang it on, or attached from the cache and never written
            group.trie.insert_partial(tokens, block, namespace, parent=parent)
        self._last_private = False  # cached now: the next write into it copies it
        self._file_pending(count)
        self._file_live(count)

    def write_state(self, perform: Callable[[StateCopy], None]) -> None:
        """Before a forward writes the sequence's recurrent state: make its slot its own. A sequence without one
        gets a fresh slot (``perform((None, slot))``: start it empty); one sharing its slot with a fork, or whose slot
        is a snapshot, gets a copy (``perform((old, new))``, before the old slot can be reused). Raises
        :class:`OutOfBlocksError`, changing nothing, when no slot can be had.

        Example:
            >>> pool = KVPool(num_blocks=4, block_size=2, state_slots=4)
            >>> seq = BlockTables(pool)
            >>> seq.write_state(print)              # the first forward: an empty state in a fresh slot
            (None, 0)
            >>> twin = seq.fork()
            >>> twin.write_state(print)             # the fork writes: its own copy
            (0, 1)
        """
        if self._slots is None:
            raise InvalidBlockError("write_state: the pool has no recurrent-state slots")
        self._check_live()
        self._slots.write(perform, self._reservation)

    def snapshot(self) -> bool:
        """Keep the recurrent state after the sequence's ``num_tokens`` tokens as a snapshot, filed beside its block
        when the sequence registers that block (:meth:`cache_full_blocks`, :meth:`cache_partial_block`); the next
        write copies the state first. False, changing nothing, without a state or when one was taken there."""
        return self._slots is not None and self._slots.snapshot(self._num_tokens)

    def take_snapshots(self, positions: Sequence[int]) -> list[tuple[int, int]]:
        """Fresh state slots to keep the state after each of ``positions`` (positions this sequence computes next):
        the forward that computes them copies the state into each slot as it passes its position. They are filed
        beside their blocks when the sequence registers them, as :meth:`snapshot`'s are. Returns ``(position, slot)``
        for each (none for a position taken already). Raises :class:`OutOfBlocksError`, changing nothing, when the
        pool cannot spare them.

        Example:
            >>> pool = KVPool(num_blocks=4, block_size=2, state_slots=4)
            >>> seq = BlockTables(pool)
            >>> _ = seq.append(4); seq.write_state(lambda copy: None)
            >>> seq.take_snapshots([2, 3]), seq.pending_snapshots   # the forward fills slots 1 and 2
            ([(2, 1), (3, 2)], [(2, 1), (3, 2)])
        """
        if self._slots is None:
            raise InvalidBlockError("take_snapshots: the pool has no recurrent-state slots")
        self._check_live()
        return self._slots.reserve_snapshots(positions, self._reservation)

    def fork(self) -> BlockTables:
        """A new sequence sharing every block of this one (copy-on-write on its first write into a shared block)."""
        self._check_live()
        child = BlockTables(self._pool, self._reservation)
        for i, group in enumerate(self._pool.groups):
            group.block_manager.retain(self._tables[i])
            child._tables[i] = list(self._tables[i])
        child._dropped = list(self._dropped)
        child._next_drop = self._next_drop
        child._num_tokens = self._num_tokens
        child._num_cached_blocks = list(self._num_cached_blocks)
        child._uncachable = list(self._uncachable)
        child._stamp = self._stamp  # the same keys and values
        if self._slots is not None:
            child._slots = self._slots.fork(self._reservation)
        self._last_private = False  # shared now: the first write copies
        return child

    def truncate(self, num_tokens: int) -> None:
        """Keep only positions ``0 .. num_tokens - 1``, releasing blocks past them (e.g. rejected draft tokens)."""
        self._check_live()
        number = as_integer(num_tokens)
        if number is None or not 0 <= number <= self._num_tokens:
            raise InvalidBlockError(f"truncate: {num_tokens!r} outside [0, {self._num_tokens}]")
        num_tokens = number
        bs = self._pool.block_size
        if not self.can_truncate(num_tokens):
            first = min(self._dropped[g.index] for g in self._pool.groups if g.kind.is_sliding) * bs
            raise InvalidBlockError(
                f"truncate: a query at position {num_tokens} needs keys that left a sliding window "
                f"(positions before {first} were released)"
            )
        keep_blocks = -(-num_tokens // bs)
        before = self._available()
        for i, group in enumerate(self._pool.groups):
            keep = max(0, keep_blocks - self._dropped[i])
            gone = self._tables[i][keep:]
            if gone:
                group.block_manager.release(gone[::-1])
                del self._tables[i][keep:]
                self._arrays[i] = None
            self._num_cached_blocks[i] = min(self._num_cached_blocks[i], num_tokens // bs)
        self._settle(before)
        self._num_tokens = num_tokens
        self._last_private = False  # a cached full block may now be partly filled
        self._next_full = 0
        if self._slots is not None:  # snapshots of positions no longer held (the state is its holder's to put back)
            self._slots.truncate(num_tokens, self._reservation)

    def release(self) -> None:
        """Give every block back (tail first, so chains are evicted from their leaves). Idempotent."""
        if self._released:
            return
        before = self._available()
        for i, group in enumerate(self._pool.groups):
            table = self._tables[i]
            if table:
                group.block_manager.release(table[::-1])
            self._tables[i] = []
        self._settle(before)
        if self._slots is not None:
            self._slots.release(self._reservation)
        self._stale()
        for i, row in enumerate(self._rows):
            if row >= 0:
                self._pool.groups[i].rows.release(row)
        self._rows = [-1] * len(self._rows)
        self._row_tables = [None] * len(self._rows)
        self._released = True
        self._num_tokens = 0

    @property
    def released(self) -> bool:
        """Whether :meth:`release` was called."""
        return self._released

    def reset(self) -> None:
        """Release everything and start over empty (the object can be used again)."""
        self.release()
        self._released = False
        self._dropped = [0] * len(self._pool.groups)
        self._next_drop = 0
        self._num_cached_blocks = [0] * len(self._pool.groups)
        self._uncachable = [False] * len(self._pool.groups)
        self._last_private = False
        self._next_full = 0
        self._stamp = self._pool.stamp

    def _stale(self) -> None:
        """Forget every :meth:`table_array` copy (the tables are about to change)."""
        self._arrays = [None] * len(self._tables)

    def __repr__(self) -> str:
        return f"BlockTables(num_tokens={self._num_tokens}, tables={self._tables}, dropped={self._dropped})"

    # ------------------------------------------------------------------ internals
    def _fits_in_private_block(self, num_new_tokens: int) -> bool:
        used = self._num_tokens % self._bs
        return self._last_private and used != 0 and used + num_new_tokens <= self._bs and not self._released

    def _held_tokens(self, group: int) -> int:
        """Tokens stored in the live part of a group's table (what append_slot needs)."""
        return self._num_tokens - self._dropped[group] * self._pool.block_size

    def _check_live(self) -> None:
        if self._released:
            raise InvalidBlockError("this sequence's blocks were released; reset() it to use it again")

    def _available(self) -> list[int] | None:
        """Each group's available blocks before a change, when the change must be accounted to a reservation."""
        reservation = self._reservation
        if reservation is None or not reservation.active:
            return None
        return [g.block_manager.num_available_blocks for g in self._pool.groups]

    def _settle(self, before: list[int] | None) -> None:
        """Account a change to the reservation: blocks taken draw from it, blocks that became free return to it."""
        if before is None:
            return
        assert self._reservation is not None
        for i, group in enumerate(self._pool.groups):
            self._reservation.take(i, before[i] - group.block_manager.num_available_blocks)

    def _replace_kept(self, before: list[int], gave: list[int]) -> None:
        """The window gave back blocks that another holder keeps in use (it attached them as a prefix hit): they did
        not become free, so the reservation, which counts on the window's blocks coming back, takes as many
        unreserved blocks instead, as far as there are any."""
        reservation = self._reservation
        assert reservation is not None
        for i, group in enumerate(self._pool.groups):
            kept = gave[i] - (group.block_manager.num_available_blocks - before[i])
            if kept > 0:
                reservation.take(i, -min(kept, max(0, self._pool.available_blocks(i))))

    def _cached_parent(
        self, group: int, token_ids: Sequence[int], num_full: int, namespace: Hashable
    ) -> tuple[bool, int | None]:
        """Whether the chain of this sequence's first ``num_full`` blocks is cached in ``group``, and its last block
        there (None for an empty chain)."""
        if num_full == 0:
            return True, None
        trie, first = self._pool.groups[group].trie, self._dropped[group]
        if num_full > first:
            parent = self._tables[group][num_full - 1 - first]
            return trie.contains(parent), parent
        hit = trie.match(token_ids[: num_full * self._bs], namespace)  # it left the window: the cached chain's
        if hit.num_tokens < num_full * self._bs:
            return False, None
        return True, hit.block_ids[-1]

    def _check_revival(self, chains: Sequence[Sequence[int]]) -> list[int]:
        """Per group, the cached blocks at reference count 0 among ``chains`` (retaining them takes them out of the
        evictable pool). Raises :class:`OutOfBlocksError`, changing nothing, when that would take blocks other
        holders reserved."""
        pool = self._pool
        if not pool.has_reservations():
            return [0] * len(chains)
        revived = []
        for group, ids in zip(pool.groups, chains):
            bm = group.block_manager
            count = sum(1 for b in ids if bm.ref_count(b) == 0)
            available = pool.available_blocks(group.index, self._reservation)
            if count > available:
                raise OutOfBlocksError(
                    f"attach: the prefix hit would take {count} cached blocks out of group {group.index}'s evictable "
                    f"pool, but only {max(available, 0)} are not reserved by other holders",
                    requested=count,
                    available=max(available, 0),
                )
            revived.append(count)
        return revived

    def _can_swap(self, group: int, own: list[int], canonical: list[int]) -> bool:
        """Whether switching ``own`` blocks for the ``canonical`` cached ones takes no block other holders reserved."""
        pool = self._pool
        if not pool.has_reservations():
            return True
        bm = pool.groups[group].block_manager
        revived = sum(1 for b in canonical if bm.ref_count(b) == 0)
        freed = sum(1 for b in own if bm.ref_count(b) == 1)
        return revived - freed <= pool.available_blocks(group, self._reservation)

    def _file_pending(self, limit: int) -> None:
        """File the pending snapshots of positions up to ``limit`` beside their (registered) blocks."""
        if self._slots is not None and self._slots.pending:
            anchor = self._pool.anchor
            self._slots.file_pending(limit, self._tables[anchor], self._dropped[anchor], self._reservation)

    def _file_live(self, count: int) -> None:
        """File the state as the snapshot where the sequence stops (``count`` tokens: all it holds)."""
        slots = self._slots
        if slots is not None and slots.slot is not None and count == self._num_tokens:
            anchor = self._pool.anchor
            slots.file(count, slots.slot, self._tables[anchor], self._dropped[anchor])


def append_all(tables: Sequence[BlockTables], counts: Sequence[int], perform: Callable[[list[Copy]], None]) -> None:
    """Give ``tables[i]`` ``counts[i]`` more positions, all of them or none: one batched step's reservation.

    Each table's copy-on-write copies go to ``perform`` as soon as that table has grown (a later table's
    allocation may evict a copy's source from the prefix cache and hand its block out again). When a table cannot
    grow, the tables grown before it are cut back to their length before the call and the
    :class:`~pagedcore.errors.OutOfBlocksError` is raised: the pool holds what it held.

    Example:
        >>> pool = KVPool(num_blocks=3, block_size=4)
        >>> rows = [BlockTables(pool), BlockTables(pool)]
        >>> append_all(rows, [8, 5], perform=lambda copies: None)
        Traceback (most recent call last):
        ...
        pagedcore.errors.OutOfBlocksError: append: not enough blocks for 5 tokens (group 0: need 2, have 1)
        >>> [row.num_tokens for row in rows], pool.num_used_blocks
        ([0, 0], 0)
    """
    before = [table.num_tokens for table in tables]
    grown: list[int] = []
    try:
        for i, (table, count) in enumerate(zip(tables, counts)):
            perform(table.append(count))
            grown.append(i)
    except OutOfBlocksError:
        for i in grown:
            tables[i].truncate(before[i])
        raise
