"""The Engine eager, the Engine compiled (``compile=True``) and CTranslate2 fp32 (tuned malloc) side by side on the
peers section's batch workloads (``pagedcore bench --only peers``: 128-token prompts + 128 new, the benchmark Llama).

``python scripts/native_ab.py --batches 1,16,64 --rounds 3 [--threads 2] [--size small]``: each side keeps one
session open for the whole run (one Engine each, one CTranslate2 worker), warmed on the workload itself (so the
compiled Engine has compiled every bucket the timed rounds meet, as a server that warmed its buckets at start-up;
the peers section warms on 2 new tokens and builds a new Engine per round, which would time the compiler), then
``--rounds`` timed rounds, the sides' order rotating, a pause of :data:`PAUSE` before each (without it the side run
just after CTranslate2 shared the cores with its spinning threads: the compiled Engine took 7.9-8.4 ms a token at
batch 1 there, 6.9-7.1 ms alternating with the eager Engine alone). Each Engine gets its own copy of the model: an
Engine installs its fused head and its linears' forwards on its model's layers, which a second Engine on the same
model finds taken (until 5 December this script shared one model, so the compiled Engine ran without them). Prints
each side's tokens/s (median), the ratios to CTranslate2, the load average, and whether every side's greedy tokens
were identical to the first side's.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import tempfile
import time

from pagedcore.benchmarks import ct2
from pagedcore.benchmarks.common import bench_model, blocks_for
from pagedcore.benchmarks.native import workloads
from pagedcore.benchmarks.peers import ENGINE_COMPILE, Batch, CTranslate2Peer, EnginePeer
from pagedcore.benchmarks.runner import torch_threads

PAUSE = 1.0  # seconds between two timed runs: CTranslate2's OpenMP threads spin-wait after a run (200 ms by default)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size", default="small")
    args = parser.parse_args()
    sizes = [int(b) for b in args.batches.split(",")]
    model = bench_model(size=args.size)
    chosen = [w for w in workloads(False, model.config.vocab_size) if w.batch.size in sizes and w.aim]
    print(f"# {args.size} model, {args.threads} thread(s) each side; load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="pagedcore-ct2-") as root, torch_threads(args.threads):
        model_dir = str(ct2.convert_model(model, root))
        for w in chosen:  # the batch workloads (the shared-prefix one has its own shape: not here)
            if "shared" in w.label:
                continue
            blocks = sum(blocks_for(len(p) + n) for p, n in zip(w.batch.prompts, w.batch.new_tokens)) + 8
            sides = {
                "eager": (False, EnginePeer(num_blocks=blocks, max_seqs=w.batch.size)),
                "compiled": (True, EnginePeer(num_blocks=blocks, max_seqs=w.batch.size)),
                "ct2": (None, CTranslate2Peer(model_dir, "float32", args.threads, name="ct2")),
            }
            print(w.label, flush=True)
            _measure(model, w.batch, sides, args.rounds)


def _measure(model: object, batch: Batch, sides: dict[str, tuple[bool | None, object]], rounds: int) -> None:
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    tokens: dict[str, list[list[int]]] = {}
    with contextlib.ExitStack() as stack:
        serves = {}
        for name, (compile_, peer) in sides.items():
            token = ENGINE_COMPILE.set(compile_) if compile_ is not None else None
            try:
                own = copy.deepcopy(model) if compile_ is not None else model  # an Engine's own copy (see above)
                serves[name] = stack.enter_context(peer.session(own))  # type: ignore[attr-defined]
                start = time.perf_counter()
                serves[name](batch)  # the warm-up: the workload itself
                print(f"  {name}: warm-up {time.perf_counter() - start:.1f} s", flush=True)
            finally:
                if token is not None:
                    ENGINE_COMPILE.reset(token)
        names = list(sides)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                time.sleep(PAUSE)  # the previous side's threads stop spinning first
                start = time.perf_counter()
                served = serves[name](batch)
                seconds[name].append(served.ended - start)
                tokens[name] = served.tokens
    generated = sum(batch.new_tokens)
    rate = {name: generated / statistics.median(s) for name, s in seconds.items()}
    first = tokens[names[0]]
    for name in names:
        ratio = rate[name] / rate["ct2"]
        print(f"  {name}: {rate[name]:.1f} tokens/s, {ratio:.2f}x CTranslate2; rounds "
              f"{[round(s, 3) for s in seconds[name]]} s; tokens equal: {tokens[name] == first}")  # fmt: skip
    print(f"  load average {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
