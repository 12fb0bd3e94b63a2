"""A bounded load run through the Ray Serve ingress: prefix routing against random routing, loopback only.

Needs: the `ray` extra and httpx (`pip install 'pagedcore[ray]' httpx`; both in `all`).

Starts a local Ray cluster (or uses the one ``ray.init`` connected to, and leaves it running), deploys
``--replicas`` engine replicas of the built-in model behind the OpenAI ingress (``pagedcore.serve.ray``), and sends
a workload of ``--systems`` system prompts x ``--questions`` questions (streaming, greedy) from ``--concurrency``
clients, once with prefix routing and once with random routing (fresh replicas each time). Each replica's pool
(``--num-blocks``) holds about half the system prompts, as when a cache is smaller than the working set. Reports
requests/s, tokens/s, latency and the replicas' prefix hit rate (from the ingress's ``/metrics``), then deletes its
apps (and shuts down what it started).

python examples/ray_serve_load.py [--replicas 2] [--systems 8] [--questions 16] [--concurrency 8] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import random
import socket
import sys
from pathlib import Path

import httpx

NAME = "pagedcore-builtin"


def _serve_load():  # the single-process load run's client and report, shared
    spec = importlib.util.spec_from_file_location("serve_load", Path(__file__).with_name("serve_load.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def workload(systems: int, questions: int, seed: int = 0) -> list[str]:
    """Interleaved: every system prompt with question 0, then with question 1, and so on."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz "
    heads = [f"System {i}: " + "".join(rng.choice(letters) for _ in range(180)) for i in range(systems)]
    tails = [f" Question {j}: " + "".join(rng.choice(letters) for _ in range(20)) for j in range(questions)]
    return [head + tail for tail in tails for head in heads]


def hit_rate(url: str) -> float:
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        for name in ("pagedcore_prefix_cache_hits_total", "pagedcore_prefix_cache_queries_total"):
            if line.startswith(name + " "):
                values[name] = float(line.split()[1])
    queries = values.get("pagedcore_prefix_cache_queries_total", 0.0)
    return values.get("pagedcore_prefix_cache_hits_total", 0.0) / queries if queries else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--systems", type=int, default=8)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=64, help="KV blocks of 16 tokens per replica")
    parser.add_argument("--cpus-per-replica", type=float, default=1.0)
    parser.add_argument("--routing", choices=["prefix", "random", "both"], default="both")
    parser.add_argument("--port", type=int, default=None, help="Ray Serve's HTTP port (default: a free one)")
    parser.add_argument("--quick", action="store_true", help="4 system prompts x 4 questions, 4 new tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.systems, args.questions, args.concurrency, args.max_tokens = 4, 4, 4, 4
    if min(args.replicas, args.systems, args.questions, args.concurrency, args.max_tokens) < 1:
        parser.error("counts must be >= 1")

    import ray
    from ray import serve

    from pagedcore.serve.ray import ModelSpec, build_app, deploy

    load = _serve_load()
    prompts = workload(args.systems, args.questions)
    port = args.port
    if port is None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    rows = []
    try:
        for routing in ("prefix", "random") if args.routing == "both" else (args.routing,):
            threads = max(1, int(args.cpus_per_replica))
            app = build_app(
                ModelSpec(threads=threads),
                replicas=args.replicas,
                routing=routing,
                engine_kwargs={"num_blocks": args.num_blocks, "block_size": 16, "max_num_seqs": args.concurrency},
                num_cpus_per_replica=args.cpus_per_replica,
            )
            url = deploy(app, name=f"load-{routing}", route_prefix=f"/load-{routing}", port=port)
            try:
                results, wall = asyncio.run(load.drive(url, NAME, prompts, args.concurrency, args.max_tokens))
                row = load.report(f"{args.replicas} replicas, {routing} routing", results, wall)
                row["prefix_hit_rate"] = round(hit_rate(url), 3)
                rows.append(row)
            finally:
                serve.delete(f"load-{routing}")
    finally:
        if started_ray:  # else Serve and Ray belong to the caller
            serve.shutdown()
            ray.shutdown()
    print(
        f"{len(prompts)} requests ({args.systems} system prompts x {args.questions} questions), {args.concurrency} "
        f"concurrent clients, {args.max_tokens} new tokens each, greedy, streaming, through the Ray Serve ingress"
    )
    for row in rows:
        print("  " + ", ".join(f"{key}={value}" for key, value in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
