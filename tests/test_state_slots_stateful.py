"""Property-based test of the recurrent-state slots (hypothesis state machine): sequences of a pool with a
full-attention group, a sliding-window group and state slots run forwards (a state write after their blocks grew),
take snapshots, fork (``n > 1``, beams), register their blocks (full, and the partly filled last one where they stop),
restore prefix hits, are released (finished, preempted, aborted) with and without registering, while reservations
of blocks and slots come and go, cached prefixes are cleared or reset (a weight update), and allocations evict.

A fake adapter keeps what each slot holds: the tokens whose state it is. After every step: a forward only ever writes
a slot its sequence holds alone and that is no snapshot (copy-on-write), every live sequence's slot holds exactly its
tokens' state, every snapshot holds the state of exactly the tokens of the trie node it is filed under (so a prefix
hit restores the right state, also after evictions), every slot's reference count is the number of its holders, and
the pool can back every reservation, of slots too. At the end no slot is held or reserved (no leak).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedcore import BlockTables, InvalidBlockError, KVPool, OutOfBlocksError
from pagedcore.capacity import Demand, Reservation

BLOCK = 2
NUM_BLOCKS = 16
NUM_SLOTS = 10
tokens_st = st.lists(st.sampled_from([3, 4]), min_size=1, max_size=5)  # tiny alphabet: many prefix hits


class StateSlotBookkeeping(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = KVPool(NUM_BLOCKS, BLOCK, (None, 4), state_slots=NUM_SLOTS)
        self.states = self.pool.states
        assert self.states is not None
        self.content: dict[int, tuple[int, ...]] = {}  # slot -> the tokens whose state it holds
        self.seqs: list[tuple[BlockTables, list[int]]] = []  # (tables, their tokens)
        self.reservations: list[Reservation] = []
        self.registered: list[list[int]] = []

    # ---------------------------------------------------------------- helpers
    def pick(self, data) -> tuple[BlockTables, list[int]]:
        return self.seqs[data.draw(st.integers(0, len(self.seqs) - 1))]

    def pick_reservation(self, data) -> Reservation | None:
        live = [r for r in self.reservations if not r.released]
        index = data.draw(st.integers(-1, len(live) - 1))
        return live[index] if index >= 0 else None

    def perform(self, copy: tuple[int | None, int]) -> None:
        source, destination = copy
        self.content[destination] = () if source is None else self.content[source]

    def forward(self, seq: BlockTables, held: list[int], tokens: list[int]) -> bool:
        """One forward of ``tokens``: the state slot made private, the blocks grown, then the state written."""
        slots_before = (self.states.num_used, self.states.num_available)
        try:
            seq.write_state(self.perform)
        except OutOfBlocksError:
            assert (self.states.num_used, self.states.num_available) == slots_before
            return False
        try:
            seq.append(len(tokens))
        except OutOfBlocksError:
            return False
        slot = seq.state_slot
        assert slot is not None
        assert self.states.ref_count(slot) == 1 and not self.states.is_snapshot(slot), "a shared slot was written"
        assert self.content[slot] == tuple(held), "the state does not hold the sequence's tokens"
        self.content[slot] = tuple(held + tokens)
        held.extend(tokens)
        seq.drop_out_of_window(len(held))
        return True

    # ---------------------------------------------------------------- reservations
    @rule(needs=st.tuples(st.integers(0, 6), st.integers(0, 3), st.integers(0, 4)))
    def reserve(self, needs):
        try:
            self.reservations.append(self.pool.reserve(list(needs)))
        except OutOfBlocksError:
            pass

    @rule(prompt=st.integers(1, 9), new=st.integers(1, 4), copies=st.integers(1, 3))
    def reserve_worst_case(self, prompt, new, copies):
        demand = Demand(prompt, new, num_copies=copies, share_prompt=copies > 1, snapshots=True)
        needs = self.pool.worst_case(demand)
        assert len(needs) == 3 and needs[2] >= copies
        try:
            self.reservations.append(self.pool.reserve(needs))
        except OutOfBlocksError:
            pass

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def release_reservation(self, data):
        self.reservations[data.draw(st.integers(0, len(self.reservations) - 1))].release()

    # ---------------------------------------------------------------- sequences
    @rule(data=st.data(), tokens=tokens_st)
    def new_sequence(self, data, tokens):
        seq = BlockTables(self.pool, self.pick_reservation(data))
        held: list[int] = []
        if self.forward(seq, held, tokens):
            self.seqs.append((seq, held))
        else:
            seq.release()

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), tokens=tokens_st)
    def step(self, data, tokens):
        seq, held = self.pick(data)
        self.forward(seq, held, tokens)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def snapshot(self, data):
        seq, held = self.pick(data)
        fresh = not any(position == len(held) for position, _ in seq.pending_snapshots)
        assert seq.snapshot() == (seq.state_slot is not None and len(held) > 0 and fresh)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        seq, held = self.pick(data)
        self.seqs.append((seq.fork(), list(held)))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), partial=st.booleans())
    def register(self, data, partial):
        seq, held = self.pick(data)
        if partial:
            seq.cache_partial_block(held, len(held))
        else:
            seq.cache_full_blocks(held, len(held))
        self.registered.append(list(held))

    @rule(data=st.data(), tokens=tokens_st)
    def attach_hit(self, data, tokens):
        prompt = tokens * 3
        if self.registered and data.draw(st.integers(0, 3)):  # mostly a registered sequence, continued
            prompt = self.registered[data.draw(st.integers(0, len(self.registered) - 1))] + tokens
        match = self.pool.match(prompt, max_tokens=len(prompt) - 1)
        if not match.num_tokens:
            assert match.state_slot is None
            return
        assert match.state_slot is not None
        assert self.content[match.state_slot] == tuple(prompt[: match.num_tokens]), "a snapshot of other tokens"
        seq = BlockTables(self.pool, self.pick_reservation(data))
        if match.num_tokens > 1:
            with pytest.raises(InvalidBlockError):  # a recurrent state cannot be cut: only at the snapshot
                BlockTables(self.pool).attach(match, match.num_tokens - 1)
        try:
            seq.attach(match, match.num_tokens)
        except OutOfBlocksError:  # restoring would take what other holders reserved
            return
        assert seq.state_slot == match.state_slot
        seq.drop_out_of_window(match.num_tokens)
        self.seqs.append((seq, prompt[: match.num_tokens]))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), register=st.booleans())
    def release(self, data, register):
        # finished (registers where it stops), preempted or aborted (releases only)
        seq, held = self.pick(data)
        self.seqs.remove((seq, held))
        if register:
            seq.cache_partial_block(held, len(held))
            self.registered.append(list(held))
        seq.release()
        assert seq.state_slot is None and not seq.pending_snapshots

    @rule(data=st.data(), reset=st.booleans())
    def forget_prefixes(self, data, reset):
        if data.draw(st.integers(0, 3)):  # rarely: most runs should build up cached prefixes
            return
        if reset:
            self.pool.reset_prefix_cache()  # a weight update: nothing computed before is ever filed
        else:
            self.pool.clear_prefix_cache()
        assert self.states.num_snapshots == 0

    # ---------------------------------------------------------------- invariants
    @invariant()
    def consistent(self):
        self.pool.check_invariants()  # also: slots reserved <= free + evictable slots
        holders: dict[int, int] = {}
        for seq, held in self.seqs:
            if seq.state_slot is not None:
                holders[seq.state_slot] = holders.get(seq.state_slot, 0) + 1
                assert self.content[seq.state_slot] == tuple(held)
            for position, slot in seq.pending_snapshots:
                holders[slot] = holders.get(slot, 0) + 1
                assert self.content[slot] == tuple(held[:position])
        for slot in range(NUM_SLOTS):
            assert self.states.ref_count(slot) == holders.get(slot, 0), f"slot {slot}: ref count is not its holders"
        trie = self.pool.groups[self.pool.anchor].trie
        bs = trie.block_size
        for block, offset, slot in self.states.snapshots():
            _, tokens = trie.chain(block)
            depth = (len(tokens) - 1) // bs * bs  # the tokens before the block
            assert self.content[slot] == tuple(tokens[: depth + offset]), f"snapshot {slot} holds another state"
        resource = self.pool.state_resource
        reserved = sum(r.remaining[resource] for r in self.reservations if not r.released)
        assert reserved == self.pool.num_reserved_slots <= self.states.num_available

    def teardown(self):
        for seq, _ in self.seqs:
            seq.release()
        for reservation in self.reservations:
            reservation.release()
        assert self.states.num_used == 0, "state slots leaked"
        assert self.pool.num_used_blocks == 0, "blocks leaked"
        assert self.pool.num_reserved_slots == 0
        self.pool.check_invariants()


TestStateSlots = StateSlotBookkeeping.TestCase
TestStateSlots.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
