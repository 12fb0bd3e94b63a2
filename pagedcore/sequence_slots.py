"""SequenceSlots: one sequence's recurrent-state slot and the snapshots it took, as its
:class:`~pagedcore.block_tables.BlockTables` holds them in a pool with state slots (:mod:`pagedcore.state_slots`).

The rules of a sequence's state: the slot holds the state after exactly the sequence's tokens; before a forward writes
it, a slot that is shared (a fork) or filed as a snapshot is copied (:meth:`SequenceSlots.write`); a prefix hit
restores the snapshot filed where the hit ends, never anywhere else (:meth:`SequenceSlots.restore`); a snapshot taken
while the sequence grows (:meth:`SequenceSlots.snapshot`) is held until the sequence registers the block it ends in,
then filed in that block at its position (:meth:`SequenceSlots.file_pending`), and where the sequence stops its own
state is filed (:meth:`SequenceSlots.file`). Every slot taken or given back is accounted to the holder's reservation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pagedcore.capacity import Reservation
from pagedcore.errors import InvalidBlockError, OutOfBlocksError

if TYPE_CHECKING:
    from pagedcore.kv_pool import KVPool, PoolMatch

__all__ = ["SequenceSlots", "StateCopy"]

StateCopy = tuple[int | None, int]
"""What to put into a sequence's state slot before a write: ``(source slot, destination slot)``; a source of None
starts the destination empty (a sequence's first state)."""


class SequenceSlots:
    """A sequence's state slot and pending snapshots (see the module docstring).

    Args:
        pool: a pool with state slots.

    Example:
        >>> from pagedcore.kv_pool import KVPool
        >>> pool = KVPool(num_blocks=4, block_size=2, state_slots=4)
        >>> seq = SequenceSlots(pool)
        >>> seq.write(print, None)          # the first forward: an empty state in a fresh slot
        (None, 0)
        >>> twin = seq.fork(None)
        >>> twin.write(print, None)         # the fork writes: its own copy
        (0, 1)
        >>> seq.write(print, None)          # the parent holds its slot alone again: nothing to do
        >>> seq.release(None); twin.release(None); pool.states.num_used
        0
    """

    __slots__ = ("_pending", "_pool", "_slot", "_states")

    def __init__(self, pool: KVPool) -> None:
        states = pool.states
        if states is None:
            raise InvalidBlockError("the pool has no recurrent-state slots")
        self._pool = pool
        self._states = states
        self._slot: int | None = None  # the state after the sequence's tokens (None: not started)
        self._pending: list[tuple[int, int]] = []  # (position, slot): snapshots taken, not filed yet

    @property
    def slot(self) -> int | None:
        """The slot holding the sequence's state (None before its first forward)."""
        return self._slot

    @property
    def pending(self) -> list[tuple[int, int]]:
        """``(position, slot)`` of the snapshots taken and not filed yet."""
        return list(self._pending)

    def num_held(self) -> int:
        """Slots held: the state and the pending snapshots."""
        return int(self._slot is not None) + len(self._pending)

    def write(self, perform: Callable[[StateCopy], None], reservation: Reservation | None) -> None:
        """Make the slot the sequence's own before a forward writes it: a fresh one (``perform((None, new))``) or a
        copy of a shared one or a snapshot (``perform((old, new))``, while the old one is still held). Raises
        :class:`OutOfBlocksError`, changing nothing, when no slot can be had."""
        states, old = self._states, self._slot
        if old is not None and not states.must_copy(old):
            return
        resource = self._pool.state_resource
        assert resource is not None
        available = self._pool.available_blocks(resource, reservation)
        if available < 1:
            raise OutOfBlocksError(
                f"no recurrent-state slot for this sequence: {states.num_available} of {states.num_slots} are "
                f"available, {max(available, 0)} of them not reserved by other holders",
                requested=1,
                available=max(available, 0),
            )
        new: list[int] = []
        self._account(reservation, lambda: new.append(states.allocate()))
        try:
            perform((old, new[0]))
        except BaseException:
            self._account(reservation, lambda: states.release(new[0]))
            raise
        self._slot = new[0]
        if old is not None:
            self._account(reservation, lambda: states.release(old))

    def snapshot(self, position: int) -> bool:
        """Keep the state (the one after ``position`` tokens) as a snapshot to file later. False, changing nothing,
        without a state or when one was taken at ``position``."""
        slot = self._slot
        if slot is None or position <= 0 or any(p == position for p, _ in self._pending):
            return False
        self._states.retain(slot)  # held already: no slot taken from the pool
        self._pending.append((position, slot))
        return True

    def needs_slot(self) -> bool:
        """Whether the next :meth:`write` takes a slot from the pool (no state yet, or one it must copy first)."""
        slot = self._slot
        return slot is None or self._states.must_copy(slot)

    def reserve_snapshots(self, positions: Sequence[int], reservation: Reservation | None) -> list[tuple[int, int]]:
        """Fresh slots to hold the state after each of ``positions`` (the forward that computes them copies the
        state into each as it passes the position), held as pending snapshots like those :meth:`snapshot` takes:
        ``(position, slot)`` each. Raises :class:`OutOfBlocksError`, changing nothing, when the pool cannot spare
        them."""
        held = {p for p, _ in self._pending}
        wanted = [p for p in positions if p > 0 and p not in held]
        if not wanted:
            return []
        resource = self._pool.state_resource
        assert resource is not None
        available = self._pool.available_blocks(resource, reservation)
        if available < len(wanted):
            raise OutOfBlocksError(
                f"no recurrent-state slots for {len(wanted)} snapshots: {max(available, 0)} can be had",
                requested=len(wanted),
                available=max(available, 0),
            )
        slots: list[int] = []
        self._account(reservation, lambda: slots.extend(self._states.allocate() for _ in wanted))
        taken = list(zip(wanted, slots))
        self._pending = sorted(self._pending + taken)
        return taken

    def check_restore(self, match: PoolMatch, num_tokens: int, reservation: Reservation | None) -> int | None:
        """The snapshot a hit of ``num_tokens`` tokens restores (None: nothing to restore). Raises
        :class:`InvalidBlockError` for a hit that does not end where its snapshot is, :class:`OutOfBlocksError` when
        restoring an unheld snapshot would take a slot other holders reserved. Changes nothing."""
        if num_tokens == 0:
            return None
        slot = match.state_slot
        if slot is None or num_tokens != match.num_tokens:
            raise InvalidBlockError(
                f"attach: with recurrent-state layers a hit is taken where its state snapshot is ({match.num_tokens} "
                f"tokens), not at {num_tokens}"
            )
        resource = self._pool.state_resource
        assert resource is not None
        if self._states.ref_count(slot) == 0 and self._pool.available_blocks(resource, reservation) < 1:
            raise OutOfBlocksError("attach: restoring the state snapshot would take a slot other holders reserved")
        return slot

    def restore(self, slot: int | None, reservation: Reservation | None) -> None:
        """Hold ``slot`` (checked by :meth:`check_restore`) as the state: the first write copies it."""
        if self._slot is not None or self._pending:
            raise InvalidBlockError("attach: the sequence already holds a state")
        if slot is not None:
            self._account(reservation, lambda: self._states.retain(slot))
            self._slot = slot

    def fork(self, reservation: Reservation | None) -> SequenceSlots:
        """A copy sharing the state and the pending snapshots (each retained once more)."""
        child = SequenceSlots(self._pool)
        shared = ([] if self._slot is None else [self._slot]) + [slot for _, slot in self._pending]
        child._account(reservation, lambda: self._retain_all(shared))
        child._slot, child._pending = self._slot, list(self._pending)
        return child

    def truncate(self, num_tokens: int, reservation: Reservation | None) -> None:
        """Let go of the snapshots of positions after ``num_tokens`` (the state itself is its holder's to restore)."""
        gone = [slot for position, slot in self._pending if position > num_tokens]
        if gone:
            self._pending = [(p, s) for p, s in self._pending if p <= num_tokens]
            self._account(reservation, lambda: self._release_all(gone))

    def release(self, reservation: Reservation | None) -> None:
        """Let go of the state and the pending snapshots."""
        held = ([] if self._slot is None else [self._slot]) + [slot for _, slot in self._pending]
        self._slot, self._pending = None, []
        if held:
            self._account(reservation, lambda: self._release_all(held))

    def file_pending(self, limit: int, table: Sequence[int], dropped: int, reservation: Reservation | None) -> None:
        """File the pending snapshots of positions up to ``limit`` (their blocks are registered now) beside their
        blocks, then let go of them (one that cannot be filed is freed). ``table`` is the sequence's table in the
        pool's anchor group, ``dropped`` the logical blocks before it."""
        ready = [(p, s) for p, s in self._pending if p <= limit]
        if not ready:
            return
        self._pending = [(p, s) for p, s in self._pending if p > limit]
        for position, slot in ready:
            self.file(position, slot, table, dropped)
        self._account(reservation, lambda: self._release_all([slot for _, slot in ready]))

    def file(self, position: int, slot: int, table: Sequence[int], dropped: int) -> bool:
        """File ``slot`` as the snapshot after ``position`` tokens, in the anchor group's trie block holding token
        ``position - 1`` (``table``'s, when it is cached with that token). The slot stays its holders'; a write into
        it copies it from now on."""
        bs = self._pool.block_size
        if position <= 0:
            return False
        logical = (position - 1) // bs
        index, offset = logical - dropped, position - logical * bs
        if not 0 <= index < len(table):
            return False
        block = table[index]
        if self._pool.groups[self._pool.anchor].trie.block_tokens(block) < offset:
            return False
        return self._states.register(block, offset, slot)

    # ------------------------------------------------------------------ internals
    def _account(self, reservation: Reservation | None, change: Callable[[], object]) -> None:
        """Run a change of held slots, accounting what it took from (or gave back to) the pool to ``reservation``."""
        resource = self._pool.state_resource
        if resource is None or reservation is None or not reservation.active:
            change()
            return
        before = self._states.num_available
        change()
        reservation.take(resource, before - self._states.num_available)

    def _retain_all(self, slots: list[int]) -> None:
        for slot in slots:
            self._states.retain(slot)

    def _release_all(self, slots: list[int]) -> None:
        for slot in slots:
            self._states.release(slot)
