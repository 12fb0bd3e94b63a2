"""The recurrent-state slots in the core (plain Python): StateSlots, a KVPool with state slots (capacity, prefix
matches to the deepest snapshot), BlockTables holding a state, and snapshots down to the tiers and back."""

from __future__ import annotations

import pytest

from pagedcore import BlockTables, ConfigError, InvalidBlockError, KVPool, OutOfBlocksError
from pagedcore.capacity import Demand, slots_to_allocate
from pagedcore.kv_store import MemoryKVStore
from pagedcore.kv_tiers import STATE_GROUP, KVTiers
from pagedcore.state_slots import StateSlots

BS = 4


def run(seq: BlockTables, content: dict[int, tuple[int, ...]], held: list[int], tokens: list[int]) -> None:
    """One forward of ``tokens``: the state made private (a fake adapter keeps each slot's tokens), blocks grown."""

    def perform(copy: tuple[int | None, int]) -> None:
        source, destination = copy
        content[destination] = () if source is None else content[source]

    seq.write_state(perform)
    seq.append(len(tokens))
    assert seq.state_slot is not None
    content[seq.state_slot] = tuple(held + tokens)
    held.extend(tokens)


# ---------------------------------------------------------------------------------------------- StateSlots
def test_slots_are_ref_counted_and_snapshots_evict_least_recently_used_first():
    seen = []
    slots = StateSlots(2, before_evict=lambda slot, block, offset: seen.append((slot, block, offset)))
    a, b = slots.allocate(), slots.allocate()
    assert slots.register(10, 4, a) and slots.register(11, 4, b)
    assert not slots.register(10, 4, b)  # one snapshot per position
    slots.release(a)
    slots.release(b)
    assert (slots.num_used, slots.num_snapshots, slots.num_available) == (0, 2, 2)
    c = slots.allocate()  # no free slot: the least recently released snapshot goes
    assert c == a and seen == [(a, 10, 4)]
    assert slots.snapshot_of(10, 4) is None and slots.snapshot_of(11, 4) == b
    with pytest.raises(OutOfBlocksError, match="recurrent-state slot"):
        slots.retain(b), slots.allocate(), slots.allocate()
    slots.check_invariants()


def test_deepest_snapshot_within_a_limit_and_blocks_dropping_theirs():
    slots = StateSlots(4)
    for offset in (1, 3, 4):
        slot = slots.allocate()
        slots.register(7, offset, slot)
        slots.release(slot)
    assert slots.deepest(7, 2)[0] == 1 and slots.deepest(7, 3)[0] == 3 and slots.deepest(7, 9)[0] == 4
    assert slots.deepest(8, 4) is None
    assert slots.forget_blocks([7]) == 3 and slots.num_free == 4
    slots.check_invariants()


def test_bad_sizes_are_config_errors():
    with pytest.raises(ConfigError):
        StateSlots(0)
    with pytest.raises(ConfigError):
        StateSlots(4, interval=0)
    with pytest.raises(ConfigError):
        KVPool(8, BS, state_slots=-1)


# ---------------------------------------------------------------------------------------------- capacity
def test_worst_case_counts_slots_and_snapshots():
    pool = KVPool(64, BS, state_slots=16)
    assert pool.num_resources == 2 and pool.state_resource == 1
    demand = Demand(17, 5, snapshots=True)  # computed to 16 with snapshots at 4, 8, 12, 16: 1 + 4 slots
    assert pool.worst_case(demand) == (6, 1 + 4)
    assert slots_to_allocate(Demand(17, 5), BS) == 1  # a plain generate: the row's state only
    forks = Demand(17, 5, num_held_tokens=8, num_copies=3, share_prompt=True, snapshots=True)
    assert slots_to_allocate(forks, BS) == 1 + 1 + 2 + 3  # the restored one, its copy, 12 and 16, three forks
    assert pool.capacity_shortfalls([1, 17])[0].needed == 17


def test_reservations_hold_slots_back_from_other_holders():
    pool = KVPool(64, BS, state_slots=3)
    held = pool.reserve([0, 2])
    assert pool.available_blocks(1) == 1 and pool.num_reserved_slots == 2
    mine = BlockTables(pool, held)
    other = BlockTables(pool)
    content: dict[int, tuple[int, ...]] = {}
    run(mine, content, [], [5, 6])
    assert held.remaining == (0, 1)  # drawn from the reservation
    run(other, content, [], [5])  # the one slot nobody reserved
    with pytest.raises(OutOfBlocksError, match="recurrent-state slot"):
        BlockTables(pool).write_state(lambda copy: None)
    assert pool.shortfalls([0, 1])  # the reserved slot is not available to others
    with pytest.raises(OutOfBlocksError, match="recurrent-state slots cannot spare"):
        pool.reserve([0, 2])
    mine.release()
    other.release()
    held.release()
    assert pool.states.num_used == 0 and pool.num_reserved_slots == 0
    pool.check_invariants()


# ---------------------------------------------------------------------------------------------- prefix hits
def test_a_hit_resumes_at_the_deepest_snapshot_of_the_match():
    pool = KVPool(64, BS, state_slots=16)
    content: dict[int, tuple[int, ...]] = {}
    prompt = list(range(10, 24))  # 14 tokens
    seq, held = BlockTables(pool), []
    run(seq, content, held, prompt[:8])
    assert seq.snapshot()  # after 8 tokens
    run(seq, content, held, prompt[8:13])
    assert seq.snapshot()  # after 13 (inside block 3)
    seq.cache_partial_block(held, len(held))  # registers blocks; files both snapshots and the state where it stops
    seq.release()
    assert pool.states.num_snapshots == 2  # 13 is both a pending snapshot and the end: filed once
    assert pool.match(prompt, max_tokens=13).num_tokens == 13
    at_8 = pool.match([*prompt[:12], 99, 98])
    assert (at_8.num_tokens, content[at_8.state_slot]) == (8, tuple(prompt[:8]))  # a shallower snapshot
    assert pool.match([99, *prompt]).num_tokens == 0  # no snapshot: no hit at all
    hit = pool.match(prompt, max_tokens=13)
    seq = BlockTables(pool)
    with pytest.raises(InvalidBlockError, match="where its state snapshot is"):
        seq.attach(hit, 12)
    seq.attach(hit, 13)
    assert seq.state_slot == hit.state_slot and content[seq.state_slot] == tuple(prompt[:13])
    copies = []
    seq.write_state(copies.append)  # the snapshot is copied before the sequence writes on
    assert copies == [(hit.state_slot, seq.state_slot)] and seq.state_slot != hit.state_slot
    seq.release()
    pool.check_invariants()


@pytest.mark.parametrize("how", ["evict", "clear", "reset"])
def test_snapshots_leave_with_their_blocks(how):
    pool = KVPool(4, BS, state_slots=8)
    content: dict[int, tuple[int, ...]] = {}
    seq, held = BlockTables(pool), []
    run(seq, content, held, list(range(8)))
    seq.cache_partial_block(held, 8)
    seq.release()
    assert pool.states.num_snapshots == 1
    if how == "evict":
        BlockTables(pool).append(16)  # needs every block: the cached ones are evicted, leaves first
    elif how == "clear":
        pool.clear_prefix_cache()
    else:
        pool.reset_prefix_cache()  # a weight update
    assert pool.states.num_snapshots == 0 and pool.match(list(range(9))).num_tokens == 0
    pool.check_invariants()


def test_a_sequence_filled_before_a_weight_update_files_no_snapshot():
    pool = KVPool(16, BS, state_slots=8)
    content: dict[int, tuple[int, ...]] = {}
    seq, held = BlockTables(pool), []
    run(seq, content, held, list(range(6)))
    seq.snapshot()
    pool.reset_prefix_cache()
    seq.cache_partial_block(held, len(held))
    assert pool.states.num_snapshots == 0 and pool.num_cached_blocks == 0
    seq.release()
    assert pool.states.num_used == 0


def test_forks_share_the_state_until_they_write():
    pool = KVPool(16, BS, state_slots=8)
    content: dict[int, tuple[int, ...]] = {}
    seq, held = BlockTables(pool), []
    run(seq, content, held, [1, 2, 3])
    seq.snapshot()
    twins = [seq.fork() for _ in range(2)]
    assert pool.states.ref_count(seq.state_slot) == 3 + 3  # the state, and the pending snapshot, in each
    for twin in twins:
        run(twin, content, list(held), [4])
    assert len({seq.state_slot, *(t.state_slot for t in twins)}) == 3
    for table in (seq, *twins):
        table.release()
    assert pool.states.num_used == 0
    pool.check_invariants()


# ---------------------------------------------------------------------------------------------- tiers
class FakeIO:
    """The adapter's side of the tiers: each block's and each slot's content as bytes."""

    def __init__(self, content: dict[int, tuple[int, ...]]) -> None:
        self.blocks: dict[int, bytes] = {}
        self.content = content

    def fingerprint(self) -> str:
        return "fake-model"

    def block_nbytes(self, group: int) -> int:
        return 4

    def read_block(self, group: int, block_id: int) -> bytes:
        return self.blocks.get(block_id, b"kv--")

    def to_bytes(self, copy: object) -> bytes:
        return copy if isinstance(copy, bytes) else bytes(copy)  # type: ignore[arg-type]

    def write_block(self, group: int, block_id: int, payload: bytes) -> None:
        self.blocks[block_id] = payload

    def state_nbytes(self) -> int:
        return 8

    def read_state(self, slot: int) -> bytes:
        return bytes(list(self.content[slot]) + [0] * (8 - len(self.content[slot])))

    def write_state(self, slot: int, payload: bytes) -> None:
        self.content[slot] = tuple(b for b in payload if b)


def test_snapshots_go_down_to_the_tiers_with_their_blocks_and_come_back():
    content: dict[int, tuple[int, ...]] = {}
    pool = KVPool(3, BS, state_slots=4)
    store = MemoryKVStore(1 << 20)
    tiers = KVTiers([store], FakeIO(content))
    pool.attach_tiers(tiers)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    seq, held = BlockTables(pool), []
    run(seq, content, held, prompt[:4])
    seq.snapshot()
    run(seq, content, held, prompt[4:8])
    seq.snapshot()
    seq.cache_full_blocks(held, 8)  # files the snapshots at 4 and 8
    seq.release()
    BlockTables(pool).append(12)  # every block is needed: the cached ones (and their snapshots) are evicted
    assert tiers.flush() and pool.num_cached_blocks == 0 and pool.states.num_snapshots == 0
    assert tiers.stats().snapshots_written == 2
    pool.load_prefix(prompt)  # nothing free: the load waits for room
    assert pool.match(prompt).num_tokens == 0
    for group in pool.groups:
        group.block_manager.check_invariants()
    pool.groups[0].block_manager.release(list(range(3))[::-1])
    pool.load_prefix(prompt)  # blocks back, then the deepest snapshot the store holds
    hit = pool.match(prompt, max_tokens=8)
    assert hit.num_tokens == 8 and content[hit.state_slot] == tuple(prompt[:8])
    assert tiers.stats().snapshots_loaded == 1
    assert STATE_GROUP < 0  # a key of its own, never a KV group's
    pool.check_invariants()
    tiers.close()


def test_resizing_with_the_groups_counts_only_holds_no_slot():
    pool = KVPool(64, BS, state_slots=4)
    held = pool.reserve([2, 2])
    assert held.resize([3]) and held.remaining == (3, 0)
    held.take(1, 1)  # a slot drawn from the pool, not from the reservation: no error, nothing below zero
    assert held.remaining == (3, 0)
    held.release()
