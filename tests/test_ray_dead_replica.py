"""The ingress's statistics probe on a live local Ray cluster with a replica killed (issue 26.9: it was verified only
over a fake deployment handle). Right after the kill ``/metrics`` answers at once, counts the live replica's pool
alone (the dead one's figures leave its gauges), keeps every counter, and once Ray Serve has replaced the replica
counts two pools again, never three."""

from __future__ import annotations

import socket
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from pagedcore.serve.ray import ModelSpec, build_app, deploy  # noqa: E402
from pagedcore.serve.ray.deployment import ENGINE_DEPLOYMENT  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster and two replicas take a minute to start on 2 cores

TINY = ModelSpec(builtin_overrides={"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128}, threads=1)
BLOCKS = 28
SERIES = ("pagedcore_kv_blocks", "pagedcore_kv_blocks_used", "pagedcore_generation_tokens_total")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_metrics(url: str) -> tuple[dict[str, float], float]:
    """The series this test reads, and how long ``/metrics`` took to answer."""
    started = time.monotonic()
    text = httpx.get(f"{url}/metrics", timeout=30).text
    took = time.monotonic() - started
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in SERIES:
            values[name] = float(value)
    return values, took


def test_the_probe_drops_a_killed_replica_at_once_and_counts_its_replacement_once():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        app = build_app(
            TINY, replicas=2, engine_kwargs={"num_blocks": BLOCKS, "block_size": 16}, num_cpus_per_replica=0.5
        )
        url = deploy(app, name="dead", route_prefix="/dead", port=free_port())
        for index in range(4):
            body = {"model": "pagedcore-builtin", "prompt": f"hi {index}", "max_tokens": 3, "temperature": 0}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
        deadline = time.monotonic() + 60
        while read_metrics(url)[0].get("pagedcore_generation_tokens_total") != 12.0:
            assert time.monotonic() < deadline, read_metrics(url)
            time.sleep(0.2)
        before, _ = read_metrics(url)
        assert before["pagedcore_kv_blocks"] == 2 * BLOCKS

        handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name="dead")
        victim = handle.stats.remote().result(timeout_s=60).replica
        ray.kill(ray.get_actor(victim, namespace="serve"))
        killed = time.monotonic()
        seen: list[tuple[float, dict[str, float]]] = []
        while time.monotonic() - killed < 180:
            values, took = read_metrics(url)
            assert took < 2.0, f"/metrics took {took:.1f} s with a dead replica"
            assert values["pagedcore_kv_blocks"] <= 2 * BLOCKS, values  # never the dead one's figures on top
            assert values["pagedcore_generation_tokens_total"] == 12.0, values  # its counters stay counted
            seen.append((time.monotonic() - killed, values))
            if values["pagedcore_kv_blocks"] == 2 * BLOCKS and any(v["pagedcore_kv_blocks"] == BLOCKS for _, v in seen):
                break
            time.sleep(0.25)
        alone = [t for t, v in seen if v["pagedcore_kv_blocks"] == BLOCKS]
        assert alone and alone[0] < 10, seen[:12]  # the dead replica left the gauges within a few polls
        assert seen[-1][1] == {**before, "pagedcore_kv_blocks": 2.0 * BLOCKS}, seen[-3:]  # replaced: two pools
    finally:
        serve.shutdown()
        ray.shutdown()
