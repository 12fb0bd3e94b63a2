"""Scheduler: chunked prefill, decode-first, prefix hits, preemption by recompute, forks, aborts, bad input."""

from __future__ import annotations

import random

import pytest
from fake_model import FakeModel, reference_output, run_to_completion

from pagedcore import (
    DuplicateRequestError,
    FinishReason,
    InvalidRequestError,
    KVPool,
    LRUEvictionPolicy,
    RequestNotFoundError,
    Scheduler,
    SchedulerConfig,
    SequenceState,
)


def make(num_blocks=32, block_size=4, windows=(None,), **cfg) -> tuple[Scheduler, FakeModel]:
    sched = Scheduler(KVPool(num_blocks, block_size, windows), SchedulerConfig(**cfg))
    return sched, FakeModel(sched)


def test_chunked_prefill_respects_budget_then_decodes():
    sched, model = make(max_num_batched_tokens=4)
    sched.add(SequenceState("a", list(range(10)), max_new_tokens=3))
    chunks = []
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.num_batched_tokens <= 4
        chunks.append([(s.start, len(s.token_ids), s.sample) for s in out.scheduled])
        sched.update(out, model.step(out))
    assert chunks[:3] == [[(0, 4, False)], [(4, 4, False)], [(8, 2, True)]]
    assert chunks[3:] == [[(10, 1, True)], [(11, 1, True)]]


def test_decodes_come_first_and_outputs_match_reference():
    sched, model = make(max_num_batched_tokens=8)
    sched.add(SequenceState("a", [1, 2, 3], max_new_tokens=4))
    out = sched.schedule()
    sched.update(out, model.step(out))
    sched.add(SequenceState("b", list(range(20)), max_new_tokens=2))
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert len(out.scheduled[1].token_ids) == 7  # the rest of the budget goes to b's prefill chunk
    sched.update(out, model.step(out))
    done = run_to_completion(sched, model)
    assert done["a"].output_token_ids == reference_output([1, 2, 3], 4)
    assert done["b"].output_token_ids == reference_output(list(range(20)), 2)


def test_prefix_hit_shortens_prefill_and_full_hit_leaves_last_token():
    sched, model = make(block_size=4)
    prompt = list(range(12))
    sched.add(SequenceState("a", prompt, max_new_tokens=1))
    run_to_completion(sched, model)
    sched.add(SequenceState("b", [*prompt, 99, 98], max_new_tokens=1))
    out = sched.schedule()
    (item,) = out.scheduled
    assert item.start == 12 and item.token_ids == [99, 98]
    sched.update(out, model.step(out))
    # The whole prompt is cached: only its last token is computed (through a copy of the shared last block).
    sched.add(SequenceState("c", prompt, max_new_tokens=2))
    out = sched.schedule()
    (item,) = out.scheduled
    assert item.start == 11 and item.token_ids == [11]
    assert len(out.copies) == 1
    sched.update(out, model.step(out))
    done = run_to_completion(sched, model)
    assert done["c"].output_token_ids == reference_output(prompt, 2)
    assert sched.pool.num_hit_tokens == 12 + 11
    assert sched.stats.num_prompt_tokens_computed == 12 + 2 + 1


def test_namespaces_do_not_share_prefixes():
    sched, model = make()
    prompt = list(range(12))
    sched.add(SequenceState("a", prompt, max_new_tokens=1, namespace="tenant-a"))
    run_to_completion(sched, model)
    sched.add(SequenceState("b", prompt, max_new_tokens=1, namespace="tenant-b"))
    out = sched.schedule()
    assert out.scheduled[0].start == 0


def test_preemption_by_recompute_and_rehit_of_own_prefix():
    # 8 blocks of 4 tokens; three sequences that grow to 20 tokens (5 blocks) each cannot all run.
    sched, model = make(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    prompts = {name: [i] * 8 for i, name in enumerate("abc")}
    for name, prompt in prompts.items():
        sched.add(SequenceState(name, prompt, max_new_tokens=12))
    done = run_to_completion(sched, model)
    assert sched.stats.num_preemptions > 0
    assert any(s.num_preemptions and s.num_cached_tokens for s in done.values()), "a preempted sequence re-hit"
    for name, prompt in prompts.items():
        assert done[name].output_token_ids == reference_output(prompt, 12)
    assert sched.pool.num_used_blocks == 0


def test_request_that_can_never_fit_is_rejected_when_added():
    sched, _ = make(num_blocks=4, block_size=4)
    with pytest.raises(InvalidRequestError, match=r"can never fit: 10 prompt tokens \+ 10 new tokens need 5 blocks"):
        sched.add(SequenceState("big", list(range(10)), max_new_tokens=10))
    assert not sched.has_unfinished()
    sched.add(SequenceState("exact", list(range(10)), max_new_tokens=6))  # exactly the whole pool: fine
    model = FakeModel(sched)
    done = run_to_completion(sched, model)
    assert done["exact"].output_token_ids == reference_output(list(range(10)), 6)


def test_sliding_window_requests_need_only_their_window():
    sched, model = make(num_blocks=6, block_size=4, windows=(8,), max_num_batched_tokens=8)
    prompt = list(range(30))
    sched.add(SequenceState("long", prompt, max_new_tokens=20))  # 50 tokens = 13 blocks, but the window needs few
    done = run_to_completion(sched, model)
    assert done["long"].output_token_ids == reference_output(prompt, 20)


def test_hybrid_groups_release_only_sliding_blocks():
    sched, model = make(num_blocks=16, block_size=4, windows=(None, 4), max_num_batched_tokens=64)
    sched.add(SequenceState("a", list(range(40)), max_new_tokens=4))
    out = sched.schedule()
    sched.update(out, model.step(out))
    seq = sched.get("a")
    assert seq.blocks.num_dropped(1) > 0 and seq.blocks.num_dropped(0) == 0
    run_to_completion(sched, model)


def test_abort_releases_everything():
    sched, model = make()
    sched.add(SequenceState("a", list(range(9)), max_new_tokens=5))
    sched.add(SequenceState("b", list(range(9)), max_new_tokens=5))
    out = sched.schedule()
    sched.update(out, model.step(out))
    aborted = sched.abort("a")
    assert [s.finish_reason for s in aborted] == [FinishReason.ABORT]
    with pytest.raises(RequestNotFoundError, match="'a'"):
        sched.abort("a")
    run_to_completion(sched, model)
    assert sched.pool.num_used_blocks == 0


def test_abort_after_schedule_before_update_is_skipped():
    sched, model = make()
    sched.add(SequenceState("a", [1, 2, 3], max_new_tokens=5))
    out = sched.schedule()
    sampled = model.step(out)
    sched.abort("a")
    assert sched.update(out, sampled) == []
    assert sched.pool.num_used_blocks == 0


def test_fork_parallel_samples_share_prompt_blocks():
    sched, model = make(num_blocks=32, block_size=4)
    sched.add(SequenceState("p", list(range(10)), max_new_tokens=3, num_samples=3))
    out = sched.schedule()
    assert out.scheduled[0].num_samples == 3
    sched.update(out, model.step(out))
    family = [sched.get("p"), sched.get("p#1"), sched.get("p#2")]
    tables = [s.blocks.table(0) for s in family]
    assert tables[0] == tables[1] == tables[2]  # shared until each writes
    assert [s.output_token_ids[0] for s in family] == [(family[0].output_token_ids[0] + k) % 50 for k in range(3)]
    out = sched.schedule()
    assert len(out.copies) == 2  # two of the three copy the shared partial block; the last writer keeps it
    sched.update(out, model.step(out))
    done = run_to_completion(sched, model)
    assert {s.group_id for s in done.values()} == {"p"}
    assert sched.pool.num_used_blocks == 0


def test_bad_input():
    sched, _ = make(max_num_seqs=4)
    with pytest.raises(InvalidRequestError, match="empty"):
        SequenceState("x", [], max_new_tokens=1)
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        SequenceState("x", [1], max_new_tokens=0)
    with pytest.raises(InvalidRequestError, match="num_samples"):
        SequenceState("x", [1], max_new_tokens=1, num_samples=0)
    with pytest.raises(InvalidRequestError, match=r"\[-3\]"):
        SequenceState("x", [1, -3], max_new_tokens=1)
    with pytest.raises(InvalidRequestError, match="100 parallel samples"):
        sched.add(SequenceState("x", [1], max_new_tokens=1, num_samples=100))
    sched.add(SequenceState("x", [1], max_new_tokens=1))
    with pytest.raises(DuplicateRequestError, match="'x'"):
        sched.add(SequenceState("x", [1], max_new_tokens=1))
    with pytest.raises(InvalidRequestError, match="expected a SequenceState"):
        sched.add("x")  # type: ignore[arg-type]
    out = sched.schedule()
    with pytest.raises(InvalidRequestError, match="needs 1 sampled tokens, got 0"):
        sched.update(out, {})
    assert sched.get("x").num_computed_tokens == 0  # nothing changed


def snapshot(sched):
    """What an update changes: every sequence's progress and tokens, the pool's blocks, the counters."""
    seqs = [(s.request_id, s.status, s.num_computed_tokens, list(s.token_ids)) for s in sched.sequences()]
    pool = sched.pool
    return seqs, pool.num_used_blocks, pool.num_cached_blocks, sched.stats.num_computed_tokens


@pytest.mark.parametrize(
    ("tokens", "shown"),
    [
        ([-5], r"\[-5\] are outside the ids >= 0"),
        ([1.7], "must be integers, got 1.7"),
        ([None], "must be integers, got None"),
        (["x"], "must be integers, got 'x'"),
        ([True], "must be integers, got True"),
        (None, "must be a sequence of integers, got None"),
        (5, "must be a sequence of integers, got 5"),
    ],
)
def test_update_refuses_a_bad_sampled_token_naming_it_and_changes_nothing(tokens, shown):
    sched, model = make()
    sched.add(SequenceState("a", [1, 2, 3, 4, 5], max_new_tokens=3))
    sched.add(SequenceState("b", [6, 7, 8], max_new_tokens=3))
    out = sched.schedule()
    sampled = model.step(out)
    before = snapshot(sched)
    with pytest.raises(InvalidRequestError, match=f"update: request 'b': sampled token ids {shown}"):
        sched.update(out, {**sampled, "b": tokens})
    assert snapshot(sched) == before
    sched.check_invariants()
    sched.update(out, sampled)  # the same step with good tokens is still taken
    assert [s.num_computed_tokens for s in sched.sequences()] == [5, 3]
    run_to_completion(sched, model)
    assert sched.pool.num_used_blocks == 0


@pytest.mark.parametrize("abort", ["a#1", "a"])
def test_a_fork_into_a_taken_id_is_refused_before_update_changes_anything(abort):
    """Request ids are the caller's (the Scheduler takes any string; the Engine refuses '#'): a parallel request 'a'
    forks into 'a#1', which another request holds. The update used to raise from the fork after the other
    sequences' tokens were recorded."""
    sched, model = make(max_num_seqs=4)
    sched.add(SequenceState("a#1", [1, 2, 3], max_new_tokens=3))
    sched.add(SequenceState("a", [1, 2, 3, 4, 5], max_new_tokens=3, num_samples=2))
    out = sched.schedule()
    sampled = model.step(out)
    before = snapshot(sched)
    with pytest.raises(DuplicateRequestError, match=r"update: request 'a' forks into \['a#1'\]") as raised:
        sched.update(out, sampled)
    assert raised.value.param == "request_id"
    assert snapshot(sched) == before and sched.get("a").forks == []
    sched.check_invariants()
    sched.abort(abort)  # the caller resolves it; the same step is then taken
    sched.update(out, sampled)
    done = run_to_completion(sched, model)
    assert sorted(done) == (["a#1"] if abort == "a" else ["a", "a#1"])  # 'a#1' now: the fork of 'a'
    assert sched.pool.num_used_blocks == 0


class _FailingLRU(LRUEvictionPolicy):
    """LRU whose ``pop()`` raises ``failures`` times (a plugin's policy with a bug)."""

    failures = 0

    def pop(self) -> int:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("policy bug")
        return super().pop()


def _warm_failing_pool(num_blocks: int, groups: int) -> tuple[Scheduler, FakeModel, list[_FailingLRU]]:
    """A scheduler whose pool's blocks are all cached and evictable: every allocation evicts, in every group."""
    policies: list[_FailingLRU] = []
    pool = KVPool(
        num_blocks, 2, (None,) * groups, eviction_policy=lambda: policies.append(_FailingLRU()) or policies[-1]
    )
    sched = Scheduler(pool, SchedulerConfig())
    model = FakeModel(sched)
    for i in range(num_blocks // 4):
        sched.add(SequenceState(f"w{i}", [50 + i] * 7, max_new_tokens=1))
    run_to_completion(sched, model)
    assert all(g.block_manager.num_free_blocks == 0 for g in pool.groups)
    return sched, model, policies


@pytest.mark.parametrize("prompt", [[1, 2, 3, 4, 5], [50] * 7 + [9]], ids=["cold", "prefix-hit"])
def test_an_eviction_policy_failing_at_admission_fails_that_request_alone_and_leaks_nothing(prompt):
    sched, model, policies = _warm_failing_pool(12, groups=2)
    pool = sched.pool
    failing = SequenceState("a", prompt, max_new_tokens=4)
    sched.add(failing)
    sched.add(SequenceState("b", [60, 61, 62], max_new_tokens=4))
    policies[1].failures = 1  # group 0 grows, then group 1's pop() raises: "a" fails, "b" is admitted
    out = sched.schedule()
    assert list(out.failed) == ["a"] and "policy bug" in out.failed["a"]
    assert failing.finish_reason is FinishReason.ERROR and [s.request_id for s in out.scheduled] == ["b"]
    sched.check_invariants()  # the blocks group 0 took for "a" (and its prefix hit's) are back
    sched.update(out, model.step(out))
    done = run_to_completion(sched, model)
    assert done["b"].output_token_ids == reference_output([60, 61, 62], 4)
    assert pool.num_used_blocks == 0


def test_an_eviction_policy_failing_while_a_sequence_grows_fails_that_sequence_alone():
    sched, model, policies = _warm_failing_pool(16, groups=1)
    prompts = {"r": [1, 2, 3], "s": [4, 5, 6, 7, 8]}
    seqs = {rid: SequenceState(rid, prompt, max_new_tokens=6) for rid, prompt in prompts.items()}
    for seq in seqs.values():
        sched.add(seq)
    out = sched.schedule()
    sched.update(out, model.step(out))
    policies[0].failures = 1  # the next block either of them needs
    for _ in range(10):
        out = sched.schedule()
        sched.check_invariants()
        sched.update(out, model.step(out))
        if out.failed:
            break
    (failed,) = out.failed
    assert seqs[failed].finish_reason is FinishReason.ERROR
    (other,) = set(prompts) - {failed}
    done = run_to_completion(sched, model)
    assert done[other].output_token_ids == reference_output(prompts[other], 6)
    assert sched.pool.num_used_blocks == 0


class Index:
    """An integer-like token id (a numpy integer, a one-element tensor)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_update_takes_integer_like_tokens_as_ints():
    sched, _ = make()
    sched.add(SequenceState("a", [1, 2, 3], max_new_tokens=3))
    sched.update(sched.schedule(), {"a": (7,)})  # a tuple
    sched.update(sched.schedule(), {"a": [Index(8)]})  # anything with __index__ but bool
    assert sched.get("a").output_token_ids == [7, 8] and all(type(t) is int for t in sched.get("a").token_ids)


def test_a_replayed_or_superseded_step_is_refused_and_changes_nothing():
    sched, model = make()
    sched.add(SequenceState("a", [1, 2, 3, 4, 5], max_new_tokens=5))
    first = sched.schedule()
    sampled = model.step(first)
    sched.update(first, sampled)
    before = snapshot(sched)
    with pytest.raises(InvalidRequestError, match="update: step 1 was recorded already"):
        sched.update(first, sampled)  # the token would be appended twice
    assert snapshot(sched) == before
    second = sched.schedule()
    third = sched.schedule()  # plans the same positions again: the second plan is stale
    with pytest.raises(InvalidRequestError, match=r"update: step 2 is not the latest planned \(3\)"):
        sched.update(second, model.step(second))
    assert snapshot(sched) == before
    sched.update(third, model.step(third))
    run_to_completion(sched, model)
    assert not sched.has_unfinished()
    assert sched.pool.num_used_blocks == 0


@pytest.mark.parametrize("reason", [FinishReason.STOP, "stop", "length"])
def test_finish_takes_a_reason_or_its_value(reason):
    sched, model = make()
    sched.add(SequenceState("a", [1, 2, 3, 4, 5], max_new_tokens=5))
    out = sched.schedule()
    sched.update(out, model.step(out))
    (done,) = sched.finish(["a"], reason)
    assert done.finish_reason is FinishReason(reason) and done.blocks is None
    assert sched.stats.num_finished == 1 and sched.pool.num_used_blocks == 0
    assert sched.pool.num_cached_blocks == 2  # a stop or length keeps its computed prefix, its last block included


@pytest.mark.parametrize("reason", ["STOP", "done", None, 3])
def test_finish_refuses_another_reason_before_releasing_anything(reason):
    sched, model = make()
    sched.add(SequenceState("a", [1, 2, 3, 4, 5], max_new_tokens=5))
    out = sched.schedule()
    sched.update(out, model.step(out))
    before = snapshot(sched)
    with pytest.raises(InvalidRequestError, match="finish: reason must be one of 'stop', 'length', 'abort', 'error'"):
        sched.finish(["a"], reason)
    assert snapshot(sched) == before and sched.get("a").blocks is not None
    sched.check_invariants()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("windows", [(None,), (None, 6)])
def test_randomized_run_with_fake_model(seed, windows):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    budget = rng.choice([3, 8, 32])
    sched, model = make(
        num_blocks=24,
        block_size=block_size,
        windows=windows,
        max_num_batched_tokens=budget,
        max_num_seqs=rng.choice([2, 4, 8]),
    )
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    expected: dict[str, list[int]] = {}
    rejected: set[str] = set()
    aborted: set[str] = set()
    done: dict[str, SequenceState] = {}
    next_id = 0
    for _ in range(400):
        for _ in range(rng.choice([0, 0, 1, 2])):  # arrivals between steps
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 10))]
            if not prompt:
                prompt = [1]
            rid = f"r{next_id}"
            next_id += 1
            n = rng.choice([1, 1, 1, 2])
            seq = SequenceState(
                rid, prompt, max_new_tokens=rng.randrange(1, 14), num_samples=n, namespace=rng.choice([None, None, "t"])
            )
            try:
                sched.add(seq)
            except InvalidRequestError:
                rejected.add(rid)
                continue
            expected[rid] = prompt
        if sched.has_unfinished() and rng.random() < 0.03:
            victim = rng.choice(sched.sequences())
            aborted.update(s.request_id for s in sched.abort(victim.group_id))
        out = sched.schedule()
        assert out.num_batched_tokens <= budget
        assert sched.num_running <= sched.config.max_num_seqs
        for seq in sched.update(out, model.step(out)):
            done[seq.request_id] = seq
        sched.check_invariants()
        if next_id > 60 and not sched.has_unfinished():
            break
    done.update(run_to_completion(sched, model))
    assert sched.pool.num_used_blocks == 0, "blocks leaked"
    for rid, prompt in expected.items():
        if rid in aborted:
            continue
        seq = done[rid]
        assert seq.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        # Sample 0 of every request follows the deterministic reference exactly, whatever the batching.
        assert seq.output_token_ids == reference_output(prompt, seq.max_new_tokens)


def test_requests_arriving_together_compute_a_common_prefix_once():
    sched, model = make(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    prefix = list(range(20))
    for i in range(4):
        sched.add(SequenceState(f"r{i}", [*prefix, 100 + i, 200 + i], max_new_tokens=2))
    sched.add(SequenceState("other", [7, 7, 7, 7, 7], max_new_tokens=2))
    out = sched.schedule()
    # r0 computes the prefix; r1..r3 wait a step for its blocks; the unrelated request goes ahead.
    assert [s.request_id for s in out.scheduled] == ["r0", "other"]
    sched.update(out, model.step(out))
    out = sched.schedule()
    admitted = {s.request_id: s for s in out.scheduled if s.request_id.startswith("r") and s.request_id != "r0"}
    assert set(admitted) == {"r1", "r2", "r3"}
    assert all(s.start == 20 for s in admitted.values())  # the 5 prefix blocks were hits
    sched.update(out, model.step(out))
    done = run_to_completion(sched, model)
    assert sched.stats.num_prompt_tokens_computed == 22 + 3 * 2 + 5
    for i in range(1, 4):
        assert done[f"r{i}"].output_token_ids == reference_output([*prefix, 100 + i, 200 + i], 2)


def test_requests_with_the_same_prompt_reuse_its_partly_filled_last_block():
    """A GRPO group as separate requests: the others wait for the first one's prompt, which then registers its
    partly filled last block too, so each computes only its last token (not the 2 tokens after the full blocks)."""
    sched, model = make(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    prompt = list(range(3, 13))  # 10 tokens: 2 full blocks and 2 tokens
    for i in range(4):
        sched.add(SequenceState(f"g{i}", list(prompt), max_new_tokens=3))
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["g0"]
    sched.update(out, model.step(out))
    out = sched.schedule()
    starts = {s.request_id: s.start for s in out.scheduled if s.request_id != "g0"}
    assert starts == {"g1": 9, "g2": 9, "g3": 9}  # every prompt token but the last served from g0's blocks
    sched.update(out, model.step(out))
    done = run_to_completion(sched, model)
    assert sched.stats.num_prompt_tokens_computed == 10 + 3
    for i in range(4):
        assert done[f"g{i}"].output_token_ids == reference_output(prompt, 3)
    sched.check_invariants()
