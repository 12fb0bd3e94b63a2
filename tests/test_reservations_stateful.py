"""Property-based test of reservations (hypothesis state machine): reserve, resize, release and drop reservations
while sequences with and without one allocate, attach prefix hits, fork, give back sliding-window blocks, truncate,
register and release, in any order, on a pool with a full-attention and a sliding-window group.

After every step: the pool can back every reservation (in each group the blocks reserved and not drawn are at most
the free and evictable ones: never oversubscribed), the pool's count of reserved blocks is what the live reservations
say, a reservation dropped without release stops counting once collected, a refused command changed nothing, a
sequence that grows within what its reservation has left always gets its blocks, and every live sequence's row of its
group's TableRows gathers to its block table. At the end nothing is held or reserved and no row is taken (no leak).
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedcore import BlockTables, KVPool, OutOfBlocksError
from pagedcore.attention import stack_block_tables
from pagedcore.capacity import Reservation

BLOCK = 2
NUM_BLOCKS = 10
WINDOWS = (None, 4)
tokens_st = st.lists(st.sampled_from([3, 4]), min_size=1, max_size=5)  # tiny alphabet: many prefix hits


class Reservations(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = KVPool(NUM_BLOCKS, BLOCK, WINDOWS)
        self.reservations: list[Reservation] = []
        self.seqs: list[tuple[BlockTables, list[int]]] = []  # (tables, the tokens in their positions)
        self.registered: list[list[int]] = []  # token lists whose full blocks were registered (prefix hits to try)

    # ---------------------------------------------------------------- helpers
    def snapshot(self) -> tuple:
        groups = self.pool.groups
        return (
            tuple(g.block_manager.num_available_blocks for g in groups),
            tuple(self.pool.available_blocks(g.index) for g in groups),
            tuple(r.remaining for r in self.reservations),
            tuple(tuple(s.table(g.index) for g in groups) for s, _ in self.seqs),
        )

    def pick_reservation(self, data) -> Reservation | None:
        # By index: a drawn object would be kept alive by hypothesis's record of the draw.
        live = [r for r in self.reservations if not r.released]
        index = data.draw(st.integers(-1, len(live) - 1))
        return live[index] if index >= 0 else None

    def pick_seq(self, data) -> tuple[BlockTables, list[int]]:
        return self.seqs[data.draw(st.integers(0, len(self.seqs) - 1))]  # by index, as pick_reservation

    # ---------------------------------------------------------------- reservations
    @rule(needs=st.tuples(st.integers(0, 7), st.integers(0, 4)))
    def reserve(self, needs):
        fits = all(
            n == 0 or n <= g.block_manager.num_available_blocks - self.reserved(g.index)
            for g, n in zip(self.pool.groups, needs)
        )
        before = self.snapshot()
        try:
            reservation = self.pool.reserve(list(needs))
        except OutOfBlocksError:
            assert not fits, f"{needs} fit but were refused"
            assert self.snapshot() == before
            return
        assert fits, f"{needs} did not fit but were reserved"
        assert reservation.remaining == needs
        self.reservations.append(reservation)

    @rule()
    def reserve_the_rest(self):
        # Every block nobody reserved: then only holders of a reservation can grow or revive cached blocks.
        needs = [max(0, self.pool.available_blocks(g.index)) for g in self.pool.groups]
        self.reservations.append(self.pool.reserve(needs))
        assert all(self.pool.available_blocks(g.index) == 0 for g in self.pool.groups)

    @precondition(lambda self: self.reservations)
    @rule(data=st.data(), needs=st.tuples(st.integers(0, 7), st.integers(0, 4)))
    def resize(self, data, needs):
        reservation = self.pick_reservation(data)
        if reservation is not None:
            granted = reservation.resize(list(needs))
            assert granted == (reservation.remaining == needs)

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def release_reservation(self, data):
        reservation = self.reservations[data.draw(st.integers(0, len(self.reservations) - 1))]
        reservation.release()
        assert reservation.remaining == (0, 0)

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def drop_reservation(self, data):
        # Dropped without release (and not used by any sequence): it stops counting once collected.
        index = data.draw(st.integers(0, len(self.reservations) - 1))
        reservation = self.reservations[index]
        if any(s.reservation is reservation for s, _ in self.seqs):
            return
        del self.reservations[index]
        del reservation  # the last reference: collected at once (no cycle holds it)

    # ---------------------------------------------------------------- sequences
    @rule(data=st.data(), tokens=tokens_st)
    def new_sequence(self, data, tokens):
        seq = BlockTables(self.pool, self.pick_reservation(data))
        self.grow(seq, [], tokens)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), tokens=tokens_st)
    def append(self, data, tokens):
        seq, held = self.pick_seq(data)
        self.seqs.remove((seq, held))
        self.grow(seq, held, tokens)

    def grow(self, seq: BlockTables, held: list[int], tokens: list[int]) -> None:
        reservation = seq.reservation
        needs = seq.blocks_needed(len(tokens))
        within = (
            reservation is not None
            and not reservation.released
            and all(n <= left for n, left in zip(needs, reservation.remaining))
        )
        before = self.snapshot()
        try:
            seq.append(len(tokens))
        except OutOfBlocksError:
            assert not within, f"a sequence growing within its reservation ({needs} of {reservation}) was refused"
            assert self.snapshot() == before
            if seq.num_tokens == 0:
                seq.release()
            else:
                self.seqs.append((seq, held))
            return
        held = held + tokens
        seq.drop_out_of_window(len(held))
        self.seqs.append((seq, held))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        seq, held = self.pick_seq(data)
        self.seqs.append((seq.fork(), list(held)))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def register(self, data):
        seq, held = self.pick_seq(data)
        seq.cache_full_blocks(held, len(held))
        self.registered.append(list(held))

    @rule(data=st.data(), tokens=tokens_st, reserved=st.booleans())
    def attach_hit(self, data, tokens, reserved):
        prompt = tokens * 3
        if self.registered and data.draw(st.booleans()):
            prompt = self.registered[data.draw(st.integers(0, len(self.registered) - 1))] + tokens
        match = self.pool.match(prompt)
        if not match.num_tokens:
            return
        seq = BlockTables(self.pool, self.pick_reservation(data) if reserved else None)
        before = self.snapshot()
        try:
            seq.attach(match, match.num_tokens)
        except OutOfBlocksError:  # reviving cached blocks would take what other holders reserved
            assert self.snapshot() == before
            return
        seq.drop_out_of_window(match.num_tokens)
        self.seqs.append((seq, prompt[: match.num_tokens]))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), keep=st.integers(0, 6))
    def truncate(self, data, keep):
        seq, held = self.pick_seq(data)
        keep = min(keep, seq.num_tokens)
        if seq.can_truncate(keep):
            seq.truncate(keep)
            held[keep:] = []

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), register=st.booleans())
    def release(self, data, register):
        seq, held = self.pick_seq(data)
        self.seqs.remove((seq, held))
        if register:  # a finished request: its full blocks stay cached (evictable) for later prefix hits
            seq.cache_full_blocks(held, len(held))
            self.registered.append(list(held))
        seq.release()

    # ---------------------------------------------------------------- invariants
    def reserved(self, group: int) -> int:
        return sum(r.remaining[group] for r in self.reservations if not r.released)

    @invariant()
    def never_oversubscribed(self):
        self.pool.check_invariants()  # also: reserved <= free + evictable in every group
        for g in self.pool.groups:
            assert self.reserved(g.index) <= g.block_manager.num_available_blocks
            assert self.pool.available_blocks(g.index) == g.block_manager.num_available_blocks - self.reserved(g.index)
        assert self.pool.num_reserved_blocks == sum(self.reserved(g.index) for g in self.pool.groups)

    @invariant()
    def table_rows_hold_the_tables(self):
        # What a step packs: each live sequence's row (rewritten only when its table changed) gathers to its table.
        for g in self.pool.groups:
            rows = [seq.table_row(g.index) for seq, _ in self.seqs]
            assert len(set(rows)) == len(rows) == g.rows.num_used, "rows shared, or held by released sequences"
            tables = [seq.table(g.index) for seq, _ in self.seqs]
            assert g.rows.gather(rows).tolist() == stack_block_tables(tables, self.pool.num_blocks).tolist()

    def teardown(self):
        for seq, _ in self.seqs:
            seq.release()
        for reservation in self.reservations:
            reservation.release()
        assert self.pool.num_used_blocks == 0, "blocks leaked"
        assert self.pool.num_reserved_blocks == 0, "a reservation leaked"
        assert all(g.rows.num_used == 0 for g in self.pool.groups), "a table row leaked"
        self.pool.check_invariants()


TestReservations = Reservations.TestCase
TestReservations.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
