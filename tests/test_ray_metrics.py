"""The ingress's ``/metrics`` figures over Ray replicas (issue 17.10): a replica killed twice left its figures summed
for ever (``pagedcore_kv_blocks`` 64 -> 128 -> 192), an idle cluster showed 1-2 blocks used, counters missed each
request's last step. The ReplicaLoop here runs over a fake deployment handle whose streams end with the replica's
report and whose polls (Ray Serve's ``broadcast``) answer as scripted."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

pytest.importorskip("ray.serve")

from ray.exceptions import ActorDiedError
from ray.serve.exceptions import DeploymentUnavailableError
from ray_fakes import FakeHandle, FakeStream, finished, report

from pagedcore.adapters.transformers import SamplingParams
from pagedcore.errors import ConfigError
from pagedcore.serve.loop import Finished, Started, Submission
from pagedcore.serve.metrics import ServeMetrics
from pagedcore.serve.ray.replica_loop import ReplicaLoop
from pagedcore.serve.ray.replica_stats import MAX_DEPARTED, ReplicaStats, zero_stats

PARAMS = SamplingParams(max_new_tokens=2)


def figures(prompt_tokens: int = 0, generated: int = 0, used: int = 0, blocks: int = 64, running: int = 0):
    """One replica's loop statistics: a pool of ``blocks``, ``used`` of them held, and its counters."""
    stats = zero_stats()
    engine = replace(stats.engine, generated_tokens=generated, kv_usage=used / blocks if blocks else 0.0)
    return replace(
        stats, engine=engine, num_blocks=blocks, num_used_blocks=used, num_prompt_tokens=prompt_tokens,
        num_running=running,
    )  # fmt: skip


def serve_one(loop: ReplicaLoop, handle: FakeHandle, prompt: list[int]) -> None:
    """One request through the loop, to the end of its stream (the replica's report after the Finished)."""
    stream = handle.streams[0]

    async def go():
        loop.submit([Submission(prompt, PARAMS)], lambda event: None)
        while not stream.ended:
            await asyncio.sleep(0)

    asyncio.run(asyncio.wait_for(go(), 10))


def stream_with(name: str, stats, sequence: int) -> FakeStream:
    return FakeStream([Started("r"), finished("r"), report(name, stats, sequence)])


def metric(loop: ReplicaLoop, name: str) -> float:
    for line in ServeMetrics(loop).render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_a_replica_killed_twice_stops_counting_in_the_gauges_and_keeps_its_counters():
    # Two replicas of 64 blocks; r1 is killed and replaced by r3, which is killed and replaced by r4.
    handle = FakeHandle(
        streams=[stream_with("r1", figures(10), 1), stream_with("r2", figures(10), 1)],
        polls=[[report("r2", figures(10), 2), report("r3", figures(4), 1)], [report("r2", figures(10), 3)]],
    )
    loop = ReplicaLoop(handle, None, block_size=4, stats_interval=None)
    serve_one(loop, handle, [1, 2])
    serve_one(loop, handle, [3, 4])
    assert metric(loop, "pagedcore_kv_blocks") == 128
    asyncio.run(loop.refresh_stats())  # r1 is gone, r3 took its place
    assert metric(loop, "pagedcore_kv_blocks") == 128  # 192 before: r1's pool summed for ever
    assert metric(loop, "pagedcore_prompt_tokens_total") == 24  # r1's 10 tokens still counted
    asyncio.run(loop.refresh_stats())  # r3 is gone too; r4 still loading
    handle.streams.append(stream_with("r4", figures(0), 1))
    serve_one(loop, handle, [5, 6])
    assert metric(loop, "pagedcore_kv_blocks") == 128 and metric(loop, "pagedcore_prompt_tokens_total") == 24


def test_after_the_last_request_the_poll_shows_its_last_step_and_no_block_used():
    # A stream's report is read as the request finishes, before the loop published its last step: 2 blocks still
    # held and one token short. The poll that follows reads the published figures.
    handle = FakeHandle(
        streams=[stream_with("r1", figures(3, generated=1, used=2, running=1), 7)],
        polls=[[report("r1", figures(3, generated=2, used=0), 8)]],
    )
    loop = ReplicaLoop(handle, None, block_size=4, stats_interval=None)
    serve_one(loop, handle, [1, 2, 3])
    asyncio.run(loop.refresh_stats())
    assert metric(loop, "pagedcore_kv_blocks_used") == 0 and metric(loop, "pagedcore_kv_usage") == 0
    assert metric(loop, "pagedcore_generation_tokens_total") == 2


def test_a_stale_report_that_arrives_late_changes_nothing():
    table = ReplicaStats()
    table.record(report("r1", figures(5, used=0), 9))
    table.record(report("r1", figures(4, used=2), 8))  # read earlier, arrived later
    merged = table.merged()
    assert (merged.num_prompt_tokens, merged.num_used_blocks) == (5, 0)


def test_a_replica_that_fails_a_poll_leaves_the_gauges_and_no_replica_means_no_gauge():
    handle = FakeHandle(
        polls=[
            [report("r1", figures(5), 1), report("r2", figures(6), 1)],
            [report("r1", figures(5), 2), ActorDiedError()],  # r2 died between the router's update and the poll
            TimeoutError(),  # a poll that timed out changes nothing
            DeploymentUnavailableError("PagedcoreEngine"),  # no replica runs at all
        ]
    )
    loop = ReplicaLoop(handle, None, block_size=4, stats_interval=None)
    seen = []
    for _ in range(4):
        asyncio.run(loop.refresh_stats())
        seen.append((loop.stats.num_blocks, loop.stats.num_prompt_tokens))
    assert seen == [(128, 11), (64, 11), (64, 11), (0, 11)]


def test_counters_of_many_departed_replicas_are_folded_and_never_go_down():
    table = ReplicaStats()
    totals = []
    for i in range(MAX_DEPARTED + 10):
        table.record_poll([report(f"r{i}", figures(1, generated=2), 1)])  # each poll: a new replica, the last gone
        totals.append(table.merged().num_prompt_tokens)
    assert totals == list(range(1, MAX_DEPARTED + 11))
    assert table.merged().engine.generated_tokens == 2 * (MAX_DEPARTED + 10)
    assert table.merged().num_blocks == 64 and table.live == {f"r{MAX_DEPARTED + 9}"}


def test_the_loop_polls_every_interval_once_it_serves_and_stops_with_it():
    handle = FakeHandle(streams=[stream_with("r1", figures(1, used=1), 1)], polls=[[]] * 1000)
    loop = ReplicaLoop(handle, None, block_size=4, stats_interval=0.01)

    async def go():
        done = asyncio.Event()
        loop.submit([Submission([1], PARAMS)], lambda e: isinstance(e, Finished) and done.set())
        await asyncio.wait_for(done.wait(), 10)
        while handle.num_polls < 3:  # bounded by the test's timeout; each poll sleeps 10 ms
            await asyncio.sleep(0.01)
        loop.stop()
        polls = handle.num_polls
        await asyncio.sleep(0.05)
        return polls

    polls = asyncio.run(go())
    assert handle.num_polls == polls  # stopped: no poll after stop()
    assert loop.stats.num_blocks == 0  # every poll answered "no replica": r1's pool no longer counts
    for bad in (0, -1.0, "1", True):
        with pytest.raises(ConfigError, match="stats_interval"):
            ReplicaLoop(handle, None, block_size=4, stats_interval=bad)
