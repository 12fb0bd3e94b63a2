"""The Ray pieces that run without a cluster: prefix hashes, the prefix router's choices, and the ingress's
ReplicaLoop over a fake deployment handle (retries, failures, stalls, aborts, queue bound)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("ray.serve")

from ray.exceptions import ActorDiedError
from ray_fakes import FakeHandle, FakeStream, finished, make_router, request

from pagedcore.adapters.transformers import SamplingParams
from pagedcore.errors import ConfigError
from pagedcore.serve.loop import Delta, Finished, LoopClosedError, QueueFullError, Started, Submission
from pagedcore.serve.ray.replica import ReplicaReport
from pagedcore.serve.ray.replica_loop import ReplicaLoop
from pagedcore.serve.ray.replica_stats import merge_stats
from pagedcore.serve.ray.routing import RoutedRequest, prefix_hashes


# ---------------------------------------------------------------------------------------------------- prefix hashes
@given(
    st.lists(st.integers(0, 2**40), min_size=0, max_size=80),
    st.lists(st.integers(0, 2**40), min_size=0, max_size=80),
    st.integers(1, 9),
)
def test_prompts_share_their_first_k_hashes_exactly_when_they_share_their_first_k_blocks(a, b, block_size):
    ha, hb = prefix_hashes(a, block_size), prefix_hashes(b, block_size)
    assert len(ha) == len(a) // block_size and len(hb) == len(b) // block_size
    for k in range(min(len(ha), len(hb))):
        same_blocks = a[: (k + 1) * block_size] == b[: (k + 1) * block_size]
        assert (ha[k] == hb[k]) == same_blocks


def test_prefix_hashes_keep_namespaces_apart_and_stop_at_max_blocks():
    tokens = list(range(64))
    assert prefix_hashes(tokens, 8, "a")[0] != prefix_hashes(tokens, 8, "b")[0]
    assert prefix_hashes(tokens, 8, 1)[0] != prefix_hashes(tokens, 8, True)[0]  # namespaces by type and value
    assert len(prefix_hashes(tokens, 8, max_blocks=3)) == 3
    with pytest.raises(ConfigError, match="block_size"):
        prefix_hashes(tokens, 0)


# ---------------------------------------------------------------------------------------------------- the router
def choose(router, replicas, pending) -> str:
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    assert sum(len(rank) for rank in ranks) == len(replicas)  # every replica ranked: a fallback always exists
    return ranks[0][0].replica_id.unique_id


def test_a_prefix_goes_back_to_its_replica_and_new_prefixes_spread_evenly():
    router, replicas = make_router()
    prompts = [[p] * 12 + [q, q + 1] for p in range(6) for q in (100, 200)]  # 6 prefixes x 2 questions
    chosen = [choose(router, replicas, request(tokens)) for tokens in prompts]
    assert all(chosen[i] == chosen[i + 1] for i in range(0, 12, 2))  # the second question follows the first
    assert sorted(chosen[::2].count(name) for name in ("r0", "r1", "r2")) == [2, 2, 2]


def test_an_overloaded_replica_loses_its_prefixes_to_the_least_loaded_one():
    router, replicas = make_router(imbalance_threshold=2)
    owner = choose(router, replicas, request([7] * 12))
    owner_id = next(r.replica_id for r in replicas if r.replica_id.unique_id == owner)
    router.replica_queue_len_cache.update(owner_id, 2)
    assert choose(router, replicas, request([7] * 12)) == owner  # within the threshold: affinity
    router.replica_queue_len_cache.update(owner_id, 3)
    for r in replicas:
        if r.replica_id != owner_id:
            router.replica_queue_len_cache.update(r.replica_id, 0)
    assert choose(router, replicas, request([7] * 12)) != owner


def test_a_short_shared_header_does_not_pull_every_prompt_to_one_replica():
    router, replicas = make_router(min_match_fraction=0.5)
    header = [1, 2, 3, 4]  # one shared block, then 5 blocks of each prompt's own
    chosen = {choose(router, replicas, request(header + [p] * 20)) for p in range(3)}
    assert len(chosen) == 3


def test_a_dead_replica_is_forgotten_and_its_prefixes_move():
    router, replicas = make_router()
    owner = choose(router, replicas, request([9] * 12))
    dead = next(r for r in replicas if r.replica_id.unique_id == owner)
    router.on_replica_actor_died(dead.replica_id)
    alive = [r for r in replicas if r is not dead]
    moved = choose(router, alive, request([9] * 12))
    assert moved != owner and choose(router, alive, request([9] * 12)) == moved


def test_router_options_are_checked():
    for bad in ({"imbalance_threshold": -1}, {"min_match_fraction": 2.0}, {"max_entries": 0}):
        with pytest.raises(ConfigError):
            make_router(**bad)


def test_the_table_forgets_the_least_recently_used_chains_first():
    router, replicas = make_router(max_entries=4)
    for p in range(5):
        choose(router, replicas, request([p] * 8))  # 2 blocks each: 10 chains, 4 kept
    assert len(router._owners) == 4 and sum(router._num_owned.values()) == 4


# ---------------------------------------------------------------------------------------------------- ReplicaLoop
def run(loop: ReplicaLoop, submissions, until_done=True, after_submit=None):
    """Submit on a fresh event loop and collect the events until every request finished."""
    events = []

    async def go():
        done = asyncio.Event()
        ids = loop.submit(submissions, lambda e: (events.append(e), isinstance(e, Finished) and check()))

        def check():
            if sum(isinstance(e, Finished) for e in events) == len(ids):
                done.set()

        if after_submit is not None:
            await after_submit(ids)
        if until_done:
            await asyncio.wait_for(done.wait(), 10)
        return ids

    return asyncio.run(go()), events


PARAMS = SamplingParams(max_new_tokens=2)


def test_events_come_back_under_the_ingress_id_and_reports_feed_the_stats():
    stats = replace(ReplicaLoop(None, None, block_size=4).stats, num_blocks=8, num_used_blocks=3)
    stream = FakeStream([Started("r9"), Delta("r9", 0, "ab"), finished("r9", cached=4), ReplicaReport("A", stats)])
    handle = FakeHandle([stream])
    loop = ReplicaLoop(handle, None, block_size=4)
    ids, events = run(loop, [Submission([1, 2, 3, 4, 5], PARAMS)])
    assert [type(e).__name__ for e in events] == ["Started", "Delta", "Finished"]
    assert {e.request_id for e in events} == set(ids) and events[-1].cached_tokens == 4
    assert handle.requests[0].prefix_hashes == prefix_hashes([1, 2, 3, 4, 5], 4)
    assert (loop.stats.num_waiting, loop.stats.num_running, loop.stats.num_blocks, loop.stats.num_used_blocks) == (
        0,
        0,
        8,
        3,
    )
    assert merge_stats([stats, stats]).num_blocks == 16 and merge_stats([]) is None


def test_text_prompts_are_encoded_in_the_ingress_so_the_router_sees_their_blocks():
    from pagedcore.adapters.transformers.builtin import builtin_tokenizer

    tokenizer = builtin_tokenizer()
    handle = FakeHandle([FakeStream([Started("r"), finished("r")])])
    run(ReplicaLoop(handle, tokenizer, block_size=4), [Submission("Hello there", PARAMS)])
    ids = list(tokenizer("Hello there")["input_ids"])
    assert handle.requests[0].submission.prompt == ids
    assert handle.requests[0].prefix_hashes == prefix_hashes(ids, 4)


def test_a_replica_that_dies_before_any_output_is_retried_on_another():
    handle = FakeHandle(
        [
            FakeStream([ActorDiedError()]),
            FakeStream([Started("r"), ActorDiedError()]),  # accepted, but died before any token: still retried
            FakeStream([Started("r"), Delta("r", 0, "ok"), finished("r")]),
        ]
    )
    _, events = run(ReplicaLoop(handle, None, block_size=4), [Submission([1, 2], PARAMS)])
    assert len(handle.requests) == 3
    assert [type(e).__name__ for e in events] == ["Started", "Started", "Delta", "Finished"]
    assert events[-1].error is None


def test_a_replica_that_dies_after_output_fails_the_request_cleanly():
    handle = FakeHandle([FakeStream([Started("r"), Delta("r", 0, "a"), ActorDiedError()]), FakeStream([])])
    ids, events = run(ReplicaLoop(handle, None, block_size=4), [Submission([1, 2], PARAMS)])
    assert len(handle.requests) == 1  # not retried: the client has seen output
    assert events[-1].error_kind == "failed"
    assert f"the engine replica serving request {ids[0]} failed" in events[-1].error


def test_attempts_run_out_and_a_stream_that_ends_early_counts_as_a_failure():
    handle = FakeHandle([FakeStream([Started("r")]), FakeStream([ActorDiedError()])])
    _, events = run(ReplicaLoop(handle, None, block_size=4, attempts=2), [Submission([1], PARAMS)])
    assert len(handle.requests) == 2 and events[-1].error_kind == "failed"


def test_a_silent_replica_fails_the_request_after_the_stall_timeout():
    stream = FakeStream([Started("r")], block_after=True)
    handle = FakeHandle([stream])
    loop = ReplicaLoop(handle, None, block_size=4, attempts=1, stall_timeout=0.2)
    _, events = run(loop, [Submission([1], PARAMS)])
    assert events[-1].error_kind == "failed" and "sent nothing for 0.2 s" in events[-1].error and stream.cancelled


def test_abort_cancels_the_stream_and_ends_the_request_as_aborted():
    stream = FakeStream([Started("r")], block_after=True)
    loop = ReplicaLoop(FakeHandle([stream]), None, block_size=4)

    async def abort_soon(ids):
        await asyncio.sleep(0.05)
        loop.abort(ids[0])

    _, events = run(loop, [Submission([1], PARAMS)], after_submit=abort_soon)
    assert events[-1].error_kind == "aborted" and stream.cancelled
    assert loop.stats.num_running == 0


def test_a_full_replica_refuses_with_overloaded_which_the_app_answers_with_429():
    from pagedcore.serve.jobs import error_of
    from pagedcore.serve.ray import EngineReplica, ModelSpec

    tiny = ModelSpec(builtin_overrides={"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128})
    replica = EngineReplica(tiny, {"num_blocks": 16, "block_size": 8}, max_queue=1)
    replica._loop._max_queue = 0  # full: the loop refuses 0 as a bound, so the test fills it this way

    async def generate():
        return [item async for item in replica.generate(RoutedRequest(Submission([5, 6], PARAMS)))]

    try:
        [refused] = asyncio.run(generate())
    finally:
        replica.shutdown()
    assert refused.error_kind == "overloaded" and error_of(refused).status == 429


def test_the_queue_bound_and_stop():
    stream = FakeStream([], block_after=True)
    loop = ReplicaLoop(FakeHandle([stream, FakeStream([])]), None, block_size=4, max_queue=1)

    async def go():
        events = []
        loop.submit([Submission([1], PARAMS)], events.append)
        with pytest.raises(QueueFullError):
            loop.submit([Submission([2], PARAMS)], events.append)
        await asyncio.sleep(0.05)
        loop.stop()
        await asyncio.sleep(0.05)
        with pytest.raises(LoopClosedError):
            loop.submit([Submission([3], PARAMS)], events.append)
        return events

    events = asyncio.run(go())
    assert [e.error_kind for e in events] == ["shutdown"] and not loop.is_running
