"""Garbage-collector pauses in a serving process, with the start-up heap as it is and frozen (``gc.freeze``, what
``pagedcore serve`` does once its Engine is built: ``pagedcore/cli/gc_heap.py``); side by side, each in its own
process, alternating.

``engine`` (the default): an Engine on the tiny benchmark model steps under load for ``--seconds``: 64 requests of
8-63 random prompt tokens and 8 sampled tokens each at a time, with a byte-level tokenizer (every token decoded, as a
served request's is), new ones as the last finish. Per process: one full collection of the start-up heap, timed
(before the load; the frozen mode then freezes it); requests served, steps, the time from one step's end
to the next one's (the requests added between them included) p50 / p99 / max, and the collector's passes per
generation (count, total and longest ms, from ``gc.callbacks``).

``serve``: ``pagedcore serve`` (the built-in model, ``--threads 1``) in a subprocess, with ``PAGEDCORE_GC_FREEZE=0``
and without; ``--clients`` threads stream completions of 8 tokens back to back for ``--seconds``. Per server:
requests served, the gaps between two chunks of one stream, p50 / p99 / max (a full collection in the server
stalls every stream at once), and the server's full collections while it served
(``python_gc_collections_total{generation="2"}`` of its ``/metrics``, read before and after the load).

    python scripts/gc_pauses.py engine --seconds 60 --rounds 1
    python scripts/gc_pauses.py serve --seconds 150 --clients 8
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import subprocess
import sys
import threading
import time
from typing import Any

MODES = ("as is", "frozen")


def _percentiles(values: list[float]) -> tuple[float, float, float]:
    values = sorted(values)
    if not values:
        return 0.0, 0.0, 0.0
    return values[len(values) // 2], values[min(len(values) - 1, int(len(values) * 0.99))], values[-1]


def engine_run(seconds: float, frozen: bool) -> dict[str, Any]:
    """One process's run (``engine``): the Engine stepping for ``seconds``, the start-up heap frozen or not."""
    import torch

    from pagedcore.adapters.transformers import Engine, SamplingParams
    from pagedcore.benchmarks.common import bench_model, bench_tokenizer
    from pagedcore.cli.gc_heap import freeze_startup_heap

    torch.set_num_threads(1)
    model = bench_model(size="tiny")
    engine = Engine(model, bench_tokenizer(model.config.vocab_size), num_blocks=4096, block_size=16, max_num_seqs=64)
    engine.generate([[5] * 20], SamplingParams(max_new_tokens=4), use_tqdm=False)  # warm: the first steps' paths
    tracked = len(gc.get_objects())
    t = time.perf_counter()
    gc.collect()  # one full pass over the start-up heap, timed (both modes; the frozen one then freezes it)
    full_pass = time.perf_counter() - t
    frozen_count = freeze_startup_heap({}) if frozen else 0
    passes: dict[int, list[float]] = collections.defaultdict(list)
    started = [0.0]

    def watch(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            passes[info["generation"]].append(time.perf_counter() - started[0])

    gc.callbacks.append(watch)
    rng, steps, served = random.Random(0), [], 0
    begin = last = time.perf_counter()
    while last - begin < seconds:
        for _ in range(64):
            prompt = [rng.randrange(32, model.config.vocab_size) for _ in range(rng.randrange(8, 64))]
            engine.add_request(prompt, SamplingParams(max_new_tokens=8, temperature=0.7, seed=served))
            served += 1
        while engine.has_unfinished():
            engine.step()
            now = time.perf_counter()
            steps.append(now - last)  # from the previous step's end: the requests added count too
            last = now
    wall = last - begin
    gc.callbacks.remove(watch)
    engine.close()
    p50, p99, most = _percentiles(steps)
    return {
        "mode": MODES[frozen], "tracked_at_start": tracked, "full_pass_ms": round(1000 * full_pass, 1),
        "frozen": frozen_count, "requests": served,
        "seconds": round(wall, 1), "steps": len(steps), "step_gap_ms": [round(1000 * x, 2) for x in (p50, p99, most)],
        "passes": {g: [len(t), round(1000 * sum(t), 1), round(1000 * max(t), 1)] for g, t in sorted(passes.items())},
    }  # fmt: skip


def _full_collections(metrics: str) -> int:
    """``python_gc_collections_total{generation="2"}`` of a ``/metrics`` text."""
    series = 'python_gc_collections_total{generation="2"}'
    (value,) = [line.split()[-1] for line in metrics.splitlines() if line.startswith(series)]
    return int(float(value))


def serve_run(seconds: float, frozen: bool, clients: int) -> dict[str, Any]:
    """One server's run (``serve``): ``clients`` streaming threads for ``seconds``."""
    import httpx

    env = {**os.environ, "PAGEDCORE_GC_FREEZE": "1" if frozen else "0"}
    command = [sys.executable, "-m", "pagedcore", "serve", "--port", "0", "--threads", "1", "--num-blocks", "2048"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    assert process.stderr is not None
    url, said = "", []
    for line in process.stderr:
        said.append(line.strip())
        if line.startswith("pagedcore serve: model"):
            url = line.split(" at ", 1)[1].split(" ", 1)[0]
            break
    if not url:
        raise RuntimeError("the server did not start: " + " | ".join(said))
    threading.Thread(target=lambda: [None for _ in process.stderr or ()], daemon=True).start()  # drain its log
    base = url.rsplit("/v1", 1)[0]
    at_start = _full_collections(httpx.get(f"{base}/metrics", timeout=30).text)
    gaps: list[float] = []
    served = [0]
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def client(k: int) -> None:
        rng = random.Random(k)
        with httpx.Client(timeout=120) as http:
            while time.perf_counter() < stop:
                words = " ".join(
                    rng.choice(("tide", "moon", "salt", "reef", "gull")) for _ in range(rng.randrange(4, 40))
                )
                body = {"model": "pagedcore-builtin", "prompt": words, "max_tokens": 8, "stream": True,
                        "temperature": 0.7, "ignore_eos": True}  # fmt: skip
                mine, last = [], None
                with http.stream("POST", f"{url}/completions", json=body) as response:
                    for chunk in response.iter_lines():
                        if not chunk.startswith("data: {"):
                            continue
                        now = time.perf_counter()
                        if last is not None:
                            mine.append(now - last)
                        last = now
                with lock:
                    gaps.extend(mine)
                    served[0] += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    at_end = _full_collections(httpx.get(f"{base}/metrics", timeout=30).text)
    process.terminate()
    process.wait(timeout=60)
    p50, p99, most = _percentiles(gaps)
    note = [line for line in said if "heap" in line]
    return {"mode": MODES[frozen], "requests": served[0], "seconds": seconds, "clients": clients,
            "chunk_gap_ms": [round(1000 * x, 2) for x in (p50, p99, most)],
            "full_collections": at_end - at_start, "server": note}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", choices=("engine", "serve"), default="engine")
    parser.add_argument("--seconds", type=float, default=60.0, help="load per process")
    parser.add_argument("--rounds", type=int, default=1, help="pairs of processes, the modes alternating")
    parser.add_argument("--clients", type=int, default=8, help="serve: streaming clients")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:  # one measured process (engine)
        print(json.dumps(engine_run(args.seconds, args.child == "frozen")))
        return
    for _ in range(args.rounds):
        for mode in MODES:
            if args.what == "serve":
                row = serve_run(args.seconds, mode == "frozen", args.clients)
            else:
                child = [sys.executable, __file__, "--seconds", str(args.seconds), "--child", mode]
                done = subprocess.run(child, capture_output=True, text=True, check=True)
                row = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
