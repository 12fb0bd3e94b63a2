"""The scheduler over a pool with recurrent-state slots, in the core (plain Python, no model): where prompts keep
snapshots, hits that resume them, a slot for every write (preemption when there is none), snapshots only from the
slots left over, the one-token-per-step rule of a model that cannot resume chunks, and no slot leaked.

A fake runner does what the transformers runner does to the bookkeeping each step: make every scheduled sequence's
slot its own (``write_state``) and take the snapshot slots the plan asks for (``take_snapshots``)."""

from __future__ import annotations

import random

import pytest

from pagedcore import ConfigError, KVPool, Scheduler, SchedulerConfig, SequenceState
from pagedcore.scheduler import SchedulerOutput
from pagedcore.state_planner import StatePlanner

BS = 4


def pool(slots: int = 16, interval: int = 1, blocks: int = 64, chunks: bool = True) -> KVPool:
    return KVPool(blocks, BS, state_slots=slots, snapshot_interval=interval, resumes_chunks=chunks)


def prepare(plan: SchedulerOutput) -> None:
    """The runner's share of the bookkeeping (under the lock, before the forward); it must never run short."""
    for item in plan.scheduled:
        item.blocks.write_state(lambda copy: None)
        taken = item.blocks.take_snapshots(item.snapshots)
        assert [p for p, _ in taken] == list(item.snapshots)


def step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[SequenceState]]:
    plan = sched.schedule()
    prepare(plan)
    sampled = {item.request_id: [token] * item.num_samples for item in plan.scheduled if item.sample}
    finished = sched.update(plan, sampled)
    sched.check_invariants()
    return plan, finished


def drain(sched: Scheduler) -> list[SchedulerOutput]:
    plans = []
    while sched.has_unfinished():
        plans.append(step(sched)[0])
    return plans


def settled(kv: KVPool) -> None:
    assert kv.num_used_blocks == 0 and kv.states is not None and kv.states.num_used == 0
    kv.check_invariants()


def test_snapshot_points_of_a_chunk():
    kv = pool()
    planner = StatePlanner(kv, caching=True)
    seq = SequenceState("a", list(range(3, 13)), max_new_tokens=2)  # 10 tokens: blocks end at 4, 8; last-but-one 9
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=8))
    sched.add(seq)
    plan = sched.schedule()
    assert plan.scheduled[0].snapshots == (4, 8)
    assert planner.points(seq, 8, 10) == [9] and planner.points(seq, 9, 10) == []
    assert StatePlanner(kv, caching=False).points(seq, 0, 10) == []


def test_prompts_keep_snapshots_that_later_prompts_resume():
    kv = pool()
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=6))
    prompt = list(range(3, 14))  # 11 tokens
    sched.add(SequenceState("a", prompt, max_new_tokens=3))
    plans = drain(sched)
    assert [p for plan in plans for item in plan.scheduled for p in item.snapshots] == [4, 8, 10]
    sched.add(SequenceState("same", prompt, max_new_tokens=1))  # a repeated prompt: its last-but-one token
    sched.add(SequenceState("shared", [*prompt[:9], 99, 98], max_new_tokens=1))  # the block boundary before it leaves
    turn = [*prompt, 7, 7, *range(50, 60)]  # the next turn: "a"'s prompt and reply, a new message
    sched.add(SequenceState("turn", turn, max_new_tokens=1))
    plan = sched.schedule()
    assert {item.request_id: item.start for item in plan.scheduled} == {"same": 10, "shared": 8, "turn": 13}
    prepare(plan)
    sched.update(plan, {item.request_id: [1] for item in plan.scheduled if item.sample})
    taken = {item.request_id: item.snapshots for item in plan.scheduled}
    for later in drain(sched):
        for item in later.scheduled:
            taken[item.request_id] += item.snapshots
    # Resumed prompts keep no periodic snapshot ("turn" would at 16 and 20), only their last-but-one token's.
    assert taken == {"same": (), "shared": (10,), "turn": (22,)}
    settled(kv)


def test_a_prompt_leaving_a_cached_prefix_snapshots_where_it_leaves():
    """With a snapshot every 100 blocks no prompt point is a block boundary; the second prompt sharing 8 tokens
    with a cached one snapshots at 8 (it recomputes them: no snapshot lies there yet), the third resumes there."""
    kv = pool(interval=100)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64))
    shared = list(range(3, 11))
    sched.add(SequenceState("a", [*shared, 20, 21, 22], max_new_tokens=1))
    assert [item.snapshots for item in drain(sched)[0].scheduled] == [(10,)]  # its last-but-one only
    sched.add(SequenceState("b", [*shared, 30, 31, 32], max_new_tokens=1))
    plan = sched.schedule()
    assert plan.scheduled[0].start == 0 and plan.scheduled[0].snapshots == (8, 10)
    prepare(plan)
    sched.update(plan, {"b": [1]})
    sched.add(SequenceState("c", [*shared, 40], max_new_tokens=1))
    assert sched.schedule().scheduled[0].start == 8


def test_a_model_resuming_one_token_at_a_time():
    kv = pool(chunks=False)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64))
    base = list(range(3, 13))
    sched.add(SequenceState("a", base, max_new_tokens=1))
    assert [item.snapshots for item in drain(sched)[0].scheduled] == [(9,)]  # no block boundaries: its last-but-one
    sched.add(SequenceState("near", [*base[:9], *range(60, 90)], max_new_tokens=1))  # 30 tokens after the snapshot
    sched.add(SequenceState("far", [*base[:9], *range(100, 140)], max_new_tokens=1))  # 40 after it
    plan = sched.schedule()
    assert [(item.request_id, item.start, item.num_new_tokens) for item in plan.scheduled] == [
        ("near", 9, 1),  # resumed, then one token per step
        ("far", 0, 49),  # computed from its start
    ]


def test_a_write_without_a_slot_preempts_and_snapshots_take_only_spare_slots():
    """Randomized: few slots and blocks, many sequences with shared prefixes and forks; the runner's bookkeeping
    never runs short, every step keeps the invariants, everything finishes and nothing leaks."""
    rng = random.Random(0)
    for slots in (2, 3, 5):
        kv = pool(slots=slots, blocks=24)
        sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=4))
        prefix = [rng.randrange(3, 50) for _ in range(6)]
        for i in range(12):
            prompt = (prefix if i % 2 else []) + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 12))]
            sched.add(SequenceState(f"r{i}", prompt, max_new_tokens=rng.randrange(1, 8), num_samples=1 + i % 3 // 2))
        plans = drain(sched)
        assert len(plans) < 500
        settled(kv)
        assert sched.stats.num_finished == 12 + 4  # four requests forked into two samples


def test_a_sequence_filled_before_a_weight_update_takes_no_snapshot():
    kv = pool()
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=4))
    sched.add(SequenceState("a", list(range(3, 15)), max_new_tokens=1))
    step(sched)
    kv.reset_prefix_cache()  # its blocks and states were computed by the old weights
    assert all(item.snapshots == () for plan in drain(sched) for item in plan.scheduled)
    assert kv.states is not None and kv.states.num_snapshots == 0
    settled(kv)


def test_the_engine_needs_two_slots_with_prefix_caching():
    with pytest.raises(ConfigError, match="at least 2 recurrent-state slots") as caught:
        Scheduler(pool(slots=1))
    assert caught.value.param == "state_slots"
    Scheduler(pool(slots=1), SchedulerConfig(enable_prefix_caching=False))  # a state, no snapshot: one is enough


def test_worst_case_and_reservation_count_the_slots():
    kv = pool(slots=4)
    sched = Scheduler(kv)
    seq = SequenceState("a", list(range(3, 40)), max_new_tokens=5)
    assert sched.worst_case(seq)[kv.state_resource] == 2  # its state and the snapshot it keeps
    sched.add(seq)
    step(sched)
    sched.refresh_reservation()
    assert kv.num_reserved_slots == 2 - seq.blocks.num_held_slots()
