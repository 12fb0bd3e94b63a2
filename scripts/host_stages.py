"""The Engine's host stages per decode step, medians: what `pagedcore bench`'s section 8 splits, without its peers, for
comparing two checkouts of pagedcore (issue 33.3, host work per step).

``N`` sequences share a 464-token prefix (computed once by an earlier request, then served by the prefix cache) and
have 16 own prompt tokens; after their prefills, ``--steps`` decode steps are timed. Per step: the Engine's own
``stage_seconds()`` (schedule / prepare / sample / record, wall) read around ``step()``, and the step's thread CPU
time less its forward's (the host work's CPU time: the machine's other load is left out). Prints medians.

A process's host figures move by ±15% from one run to the next on a 2-core VM (where its memory lands), far more
than one optimisation changes them, so compare two checkouts by alternating processes, several rounds:

    for r in 1 2 3 4; do for tree in /path/to/before /path/to/after; do
      PYTHONPATH=$tree OMP_NUM_THREADS=1 python scripts/host_stages.py --size small --rows 256; done; done

(``PYTHONPATH`` puts that checkout's ``pagedcore`` ahead of the installed one; check with ``--where``.)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

import pagedcore
from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.benchmarks.common import BLOCK_SIZE, bench_model

STAGES = ("schedule", "prepare", "sample", "record")
SHARED, OWN = 464, 16


def measure(size: str, rows: int, steps: int, seed: int = 0) -> dict[str, float]:
    """Median ms per decode step of each host stage, their sum, and the host CPU time (step CPU less forward CPU)."""
    model = bench_model(size=size)
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(SHARED)]
    engine = Engine(model, num_blocks=64 + rows * 6, block_size=BLOCK_SIZE, max_num_batched_tokens=512,
                    max_num_seqs=rows)  # fmt: skip
    engine.generate([shared + [1] * OWN], SamplingParams(max_new_tokens=2, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(max_new_tokens=steps + 20, ignore_eos=True)
    for _ in range(rows):
        engine.add_request(shared + [rng.randrange(vocab) for _ in range(OWN)], params)
    for _ in range(-(-rows * 2 * OWN // 512) + 3):  # the prefills, and a few decode steps
        engine.step()
    forward = [0.0]
    execute = engine.runner.execute

    def timed(prepared: Any) -> torch.Tensor:
        started = time.thread_time()
        try:
            return execute(prepared)
        finally:
            forward[0] += time.thread_time() - started

    engine.runner.execute = timed  # type: ignore[method-assign]
    per: dict[str, list[float]] = {name: [] for name in (*STAGES, "sum", "cpu-host")}
    for _ in range(steps):
        before, forward[0], cpu = engine.stage_seconds(), 0.0, time.thread_time()
        engine.step()
        cpu, after = time.thread_time() - cpu, engine.stage_seconds()
        for name in STAGES:
            per[name].append((after[name] - before[name]) * 1000)
        per["sum"].append(sum(per[name][-1] for name in STAGES))
        per["cpu-host"].append((cpu - forward[0]) * 1000)
    engine.close()
    return {name: statistics.median(values) for name, values in per.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small", help="benchmark model size (pagedcore.benchmarks MODEL_SIZES)")
    parser.add_argument("--rows", type=int, default=256, help="sequences decoding together")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed")
    parser.add_argument("--where", action="store_true", help="print which pagedcore is imported")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.where:
        print(pagedcore.__file__)
    figures = measure(args.size, args.rows, args.steps)
    print(f"{args.size} {args.rows} rows: " + " ".join(f"{k} {v:.3f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
