"""The prefix router's load: the requests it assigned and has not seen complete (issue 17.9).

Ray Serve calls ``choose_replicas`` for every request of a burst before it sends any of them, so a load read from
its queue-length cache is the same stale figure for the whole burst: 32 hot-prefix requests went 32/0 to one of two
replicas. These tests route bursts through the router with fake replicas, as Ray's routing tasks do (every
decision before any send), then complete, cancel and reroute requests through the hooks Ray calls.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("ray.serve")

from ray_fakes import FakeReplica, make_router, pending

from pagedcore.errors import ConfigError
from pagedcore.serve.ray.in_flight import InFlight

HOT = [7] * 16  # four blocks of 4 every request of a burst shares


def name_of(replica) -> str:
    return replica.replica_id.unique_id


async def route_burst(router, replicas, count: int, start: int = 0) -> list:
    """``count`` hot-prefix requests (each with its own last block) routed together: every decision before any
    request is sent or completes. Returns the pending requests with the replica chosen for each."""
    requests = [pending([*HOT, *([i] * 4)], f"req-{i}") for i in range(start, start + count)]
    ranks = await asyncio.gather(*(router.choose_replicas(replicas, r) for r in requests))
    return [(r, rank[0][0]) for r, rank in zip(requests, ranks)]


def split(routed) -> list[int]:
    return sorted(Counter(name_of(chosen) for _, chosen in routed).values())


def test_a_burst_of_one_hot_prefix_spreads_over_both_replicas():
    # imbalance_threshold 8: the owner takes 9 (its load 0..8 is within 8 of the idle one), the other replica then
    # takes the prefix and 18 (until it is 9 over), the first takes the last 5. 32/0 before the fix.
    router, replicas = make_router(("r0", "r1"), imbalance_threshold=8)

    async def go():
        return split(await route_burst(router, replicas, 32))

    assert asyncio.run(go()) == [14, 18]


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 4), st.integers(0, 10), st.integers(1, 80))
def test_no_replica_ends_a_burst_more_than_the_threshold_plus_one_above_another(num_replicas, threshold, count):
    router, replicas = make_router(tuple(f"r{i}" for i in range(num_replicas)), imbalance_threshold=threshold)

    async def go():
        return await route_burst(router, replicas, count)

    loads = Counter({name_of(r): 0 for r in replicas})
    loads.update(name_of(chosen) for _, chosen in asyncio.run(go()))
    assert max(loads.values()) - min(loads.values()) <= threshold + 1


def test_completed_requests_stop_counting_and_their_replica_takes_the_next_burst():
    router, replicas = make_router(("r0", "r1"), imbalance_threshold=2)

    async def go():
        first = await route_burst(router, replicas, 6)  # 3 and 3
        done = [(r, chosen) for r, chosen in first if name_of(chosen) == name_of(first[-1][1])]
        for r, chosen in done:  # Ray resolves the routing future, sends, and reports the request completed
            r.future.set_result(chosen)
            await asyncio.sleep(0)
            router.on_request_completed(chosen.replica_id, r.metadata.internal_request_id)
        second = await route_burst(router, replicas, 3, start=6)
        return split(first), {name_of(c) for _, c in done}, {name_of(c) for _, c in second}

    first, freed, second = asyncio.run(go())
    assert first == [3, 3]
    assert second == freed  # the replica whose requests completed is the least loaded: the next 3 go there


def test_a_request_cancelled_while_routed_and_one_on_a_dead_replica_stop_counting():
    router, replicas = make_router(("r0", "r1"), imbalance_threshold=0)

    async def go():
        [(cancelled, first)] = await route_burst(router, replicas, 1)
        cancelled.future.cancel()  # the caller gave up before Ray found it a replica: never sent
        await asyncio.sleep(0)
        [(_, second)] = await route_burst(router, replicas, 1, start=1)  # affinity again: r0's load is 0
        router.on_replica_actor_died(second.replica_id)
        alive = [r for r in replicas if r.replica_id != second.replica_id]
        [(_, third)] = await route_burst(router, alive, 1, start=2)
        return first, second, third

    first, second, third = asyncio.run(go())
    assert second == first and third != second


def test_ray_queue_length_figure_counts_when_it_is_higher():
    router, replicas = make_router(("r0", "r1"), imbalance_threshold=1)

    async def go():
        [(_, owner)] = await route_burst(router, replicas, 1)
        router.replica_queue_len_cache.update(owner.replica_id, 5)  # e.g. another ingress's requests
        [(_, next_one)] = await route_burst(router, replicas, 1, start=1)
        return owner, next_one

    owner, next_one = asyncio.run(go())
    assert next_one != owner


# ---------------------------------------------------------------------------------------------------- InFlight
def run_with_loop(body):
    async def go():
        return await body(asyncio.get_running_loop())

    return asyncio.run(go())


def test_a_fallback_rank_moves_the_count_to_the_replica_ray_used():
    async def body(aloop):
        table = InFlight()
        future = aloop.create_future()
        table.assign("a", "r0", future)
        future.set_result(FakeReplica("r1"))  # r0 was full: Ray sent it to the next rank
        await asyncio.sleep(0)
        moved = (table.load("r0"), table.load("r1"))
        table.complete("a", "r1")
        return moved, table.load("r1"), len(table)

    assert run_with_loop(body) == ((0, 1), 0, 0)


def test_a_completion_before_the_future_settles_leaves_nothing_counted():
    # Ray's sending task resumes before the future's other callbacks: a send that fails at once completes the
    # request before this table hears the future's result.
    async def body(aloop):
        table = InFlight()
        future = aloop.create_future()
        table.assign("a", "r0", future)
        future.set_result(FakeReplica("r0"))
        table.complete("a", "r0")
        await asyncio.sleep(0)
        return table.load("r0"), len(table)

    assert run_with_loop(body) == (0, 0)


def test_a_late_completion_of_a_rejected_attempt_leaves_the_retry_counted():
    async def body(aloop):
        table = InFlight()
        first, retry = aloop.create_future(), aloop.create_future()
        table.assign("a", "r0", first)
        first.set_result(FakeReplica("r0"))
        await asyncio.sleep(0)
        table.assign("a", "r1", retry)  # r0 rejected it; Ray routes it again, same request id
        table.complete("a", "r0")  # the rejected attempt's completion arrives late
        first_done = table.load("r1")
        retry.set_result(FakeReplica("r1"))
        await asyncio.sleep(0)
        table.complete("a", "r1")
        return first_done, len(table)

    assert run_with_loop(body) == (1, 0)


def test_in_flight_is_bounded_and_checks_its_bound():
    table = InFlight(max_requests=3)
    for i in range(5):
        table.assign(f"r{i}", "x")
    assert len(table) == 3 and table.load("x") == 3
    table.retain_replicas(lambda replica: replica != "x")
    assert len(table) == 0 and table.load("x") == 0
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ConfigError, match="max_requests"):
            InFlight(max_requests=bad)
