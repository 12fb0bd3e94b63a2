"""Scheduling policies: fair between tenants by default, first come first served or by priority on request.

Before the policies every request was admitted first come first served: one tenant's burst of 200 requests delayed
another tenant's single request until the burst had drained (``test_one_tenants_burst_...`` failed on that code:
tenant B's first token came after ~250 steps). Under the default ``"fair"`` policy admission goes round-robin over
namespaces, the one with the fewest running sequences first, so B waits at most for one running slot to free.
Bounds are in engine steps, never in seconds.
"""

from __future__ import annotations

import threading
import time

import pytest
from fake_model import FakeModel, reference_output
from models import FIRST_TOKEN, tiny_model

from pagedcore import ConfigError, InvalidRequestError, KVPool, Scheduler, SchedulerConfig, SequenceState
from pagedcore.adapters.transformers import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW = 4
SLOTS = 8  # max_num_seqs
# Tenant B's first token comes once a slot frees (at most MAX_NEW steps: a running request finishes) and B's prompt
# is computed in the step that admits it, plus a step of slack for the finishing step itself.
BOUND = MAX_NEW + 2


def steps_to_first_token(engine: Engine, rid: str, limit: int) -> int | None:
    """Step the engine until request ``rid`` gets its first token; the step count, or None after ``limit`` steps."""
    for step in range(1, limit + 1):
        if any(event.request_id == rid and event.token_id is not None for event in engine.step_events().events):
            return step
    return None


def burst_then_one(engine: Engine, **b_options) -> str:
    for i in range(200):
        prompt = [FIRST_TOKEN + i % 50, FIRST_TOKEN + 1, FIRST_TOKEN + 2, FIRST_TOKEN + i % 7]
        engine.add_request(prompt, SamplingParams(max_new_tokens=MAX_NEW), namespace="tenant-a", request_id=f"a{i}")
    engine.step()  # the burst is running and queued before B arrives
    return engine.add_request(
        [FIRST_TOKEN + 9] * 5, SamplingParams(max_new_tokens=MAX_NEW), request_id="b", **b_options
    )


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_one_tenants_burst_does_not_hold_back_another_tenants_first_token(model):
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=SLOTS) as engine:
        rid = burst_then_one(engine, namespace="tenant-b")
        got = steps_to_first_token(engine, rid, limit=BOUND)
        assert got is not None and got <= BOUND, f"tenant B's first token took more than {BOUND} steps"
        engine.scheduler.check_invariants()
        assert engine.scheduler.config.policy == "fair"  # the default
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=SLOTS, scheduling_policy="fcfs") as engine:
        rid = burst_then_one(engine, namespace="tenant-b")
        assert steps_to_first_token(engine, rid, limit=4 * BOUND) is None  # first come first served: B queues


def test_priority_admits_the_lowest_value_first(model):
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=SLOTS, scheduling_policy="priority") as engine:
        for i in range(60):
            engine.add_request([FIRST_TOKEN + i] * 4, SamplingParams(max_new_tokens=MAX_NEW), priority=1)
        engine.step()
        rid = engine.add_request([FIRST_TOKEN + 9] * 5, SamplingParams(max_new_tokens=MAX_NEW), priority=-1)
        got = steps_to_first_token(engine, rid, limit=BOUND)
        assert got is not None and got <= BOUND
    with Engine(model, num_blocks=64, block_size=4) as engine, pytest.raises(InvalidRequestError, match="priority"):
        engine.add_request([FIRST_TOKEN] * 4, SamplingParams(max_new_tokens=2), priority=3)  # policy "fair"
    with pytest.raises(ConfigError, match="policy must be one of"):
        SchedulerConfig(policy="lifo")


def run(sched: Scheduler, model: FakeModel, done: dict[str, SequenceState]) -> list[str]:
    """One step through the fake model; returns the ids preempted in it."""
    step = sched.schedule()
    done.update((s.request_id, s) for s in sched.update(step, model.step(step)))
    sched.check_invariants()
    return step.preempted


@pytest.mark.parametrize(
    ("policy", "victims"),
    [
        ("fcfs", "b0"),  # the newest
        ("fair", "a2"),  # the newest of the namespace running the most (a: 3, b: 1)
        ("priority", "a1"),  # the least urgent (priority 5), then the newest among equals
    ],
)
def test_preemption_follows_the_policy(policy, victims):
    # 4 sequences of 4-token prompts in 8 blocks of 2: they run, then their growth needs more than the pool.
    sched = Scheduler(KVPool(num_blocks=8, block_size=2), SchedulerConfig(max_num_batched_tokens=64, policy=policy))
    priorities = {"a0": 0, "a1": 5 if policy == "priority" else 0, "a2": 0, "b0": 0}
    for rid, priority in priorities.items():
        prompt = [FIRST_TOKEN + len(rid) + int(rid[1]) + (10 if rid[0] == "b" else 0)] * 4
        sched.add(SequenceState(rid, prompt, max_new_tokens=6, namespace=rid[0], priority=priority))
    model = FakeModel(sched)
    done: dict[str, SequenceState] = {}
    preempted: list[str] = []
    while sched.has_unfinished():
        preempted.extend(run(sched, model, done))
    assert preempted and preempted[0] == victims
    for seq in done.values():  # a preempted sequence recomputes exactly what it would have alone
        assert seq.output_token_ids == reference_output(seq.prompt_token_ids, 6)
    assert sched.pool.num_used_blocks == 0


def test_fair_admission_keeps_the_prefix_sharing_wait():
    # Two requests of one namespace with a common prompt prefix arrive together, with a request of another namespace
    # between them: the second still waits a step for the first's blocks and hits them instead of computing them.
    pool = KVPool(num_blocks=64, block_size=4)
    sched = Scheduler(pool, SchedulerConfig(max_num_batched_tokens=64))
    shared = list(range(FIRST_TOKEN, FIRST_TOKEN + 12))
    sched.add(SequenceState("x1", [*shared, 40], max_new_tokens=2, namespace="x"))
    sched.add(SequenceState("y1", [50, 51, 52], max_new_tokens=2, namespace="y"))
    sched.add(SequenceState("x2", [*shared, 41], max_new_tokens=2, namespace="x"))
    model = FakeModel(sched)
    done: dict[str, SequenceState] = {}
    first = sched.schedule()
    assert [s.request_id for s in first.scheduled] == ["x1", "y1"]  # x2 waits for x1's blocks
    done.update((s.request_id, s) for s in sched.update(first, model.step(first)))
    while sched.has_unfinished():
        run(sched, model, done)
    assert done["x2"].num_cached_tokens == 12
    assert done["x2"].output_token_ids == reference_output([*shared, 41], 2)


def test_through_the_server_one_tenants_burst_does_not_hold_back_another_tenant():
    # Tenants come from API keys (the server's namespace is the key's tenant): A sends 200 requests at once, B one.
    asyncio = pytest.importorskip("asyncio")
    httpx = pytest.importorskip("httpx")
    from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer
    from pagedcore.serve.app import create_app
    from pagedcore.serve.auth import ApiKeys
    from pagedcore.serve.loop import EngineLoop
    from pagedcore.serve.server import BackgroundServer

    model = builtin_model(hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256)
    engine = Engine(model, builtin_tokenizer(), num_blocks=512, block_size=8, max_num_seqs=16)
    marks: dict[str, int] = {}
    b_ids: list[str] = []
    add_request, step_events = engine.add_request, engine.step_events

    def add(request, *args, **kwargs):  # the server's loop adds requests and steps through these: count B's steps
        rid = add_request(request, *args, **kwargs)
        if request.namespace == "tenant-b":  # the loop hands the engine its Request
            b_ids.append(rid)
            marks["added"] = engine.scheduler.stats.num_steps
        return rid

    def step():
        out = step_events()
        if b_ids and "first" not in marks and any(e.request_id in b_ids and e.token_id is not None for e in out.events):
            marks["first"] = engine.scheduler.stats.num_steps
        return out

    engine.add_request, engine.step_events = add, step  # type: ignore[method-assign]
    loop = EngineLoop(engine, max_queue=512)
    keys = ApiKeys({"sk-a": "tenant-a", "sk-b": "tenant-b"})
    server = BackgroundServer(create_app(loop, model_name="tiny", api_keys=keys), loop, start_loop=False)
    server.start()
    url = f"{server.url}/v1/completions"

    def body(i: int) -> dict:
        return {"model": "tiny", "prompt": f"request {i} of the burst", "max_tokens": 8, "temperature": 0}

    async def burst() -> list[int]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=300, limits=limits, headers={"Authorization": "Bearer sk-a"}) as client:
            responses = await asyncio.gather(*(client.post(url, json=body(i)) for i in range(200)))
        return [r.status_code for r in responses]

    statuses: list[int] = []
    burster = threading.Thread(target=lambda: statuses.extend(asyncio.run(burst())))
    try:
        burster.start()
        while loop.stats.num_waiting < 200:  # the whole burst is queued (the loop is not stepping yet)
            assert burster.is_alive(), f"the burst ended early: {statuses}"
            time.sleep(0.01)
        loop.start()  # it adds the burst to the engine, then steps: 16 run, 184 wait
        response = httpx.post(url, json=body(-1), headers={"Authorization": "Bearer sk-b"}, timeout=300)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] is not None
        assert marks["first"] - marks["added"] <= 8 + 2, f"tenant B waited {marks['first'] - marks['added']} steps"
        burster.join()
        assert statuses == [200] * 200
    finally:
        server.stop()
        engine.close()
    assert engine.pool.kv.num_used_blocks == 0
