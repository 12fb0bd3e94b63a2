"""The Engine against the roofline floor, quickly and on a loaded machine (issue 33.1): the peers section's workloads
(batch 1 / 16 of 128-token prompts + 128 new, 32 x (512 shared + 32) with 64 new) on the benchmark model, each
Engine run timed in wall time and in this thread's CPU time (with one torch thread the whole step runs in it, so the
waits of a loaded machine are left out), both over the workload's roofline floor measured in the same run
(``pagedcore.benchmarks.roofline``), its GEMM rate and bandwidth timed in CPU time too. Greedy tokens are checked
against transformers' ``generate`` first.

``python scripts/roofline_check.py [--size small] [--threads 1] [--rounds 3]``. On a quiet machine use
``pagedcore bench --only peers`` (the same workloads next to CTranslate2, wall time, 3 rounds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.benchmarks.common import BLOCK_SIZE, bench_model, blocks_for
from pagedcore.benchmarks.native import workloads
from pagedcore.benchmarks.peers import PaddedBatch
from pagedcore.benchmarks.roofline import machine_limits, roofline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", default="0,1,3", help="indices into the peers section's workloads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = bench_model(size=args.size)
    limits = machine_limits(model, clock=time.thread_time)  # a loaded machine's waits do not inflate the floor
    print(f"# {args.size} model, {args.threads} thread(s); {limits.describe()}; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    chosen = workloads(False, model.config.vocab_size)
    for w in (chosen[int(i)] for i in args.workloads.split(",")):
        floor = roofline(model, w.requests(), limits)
        reference = PaddedBatch().serve(model, w.batch).tokens
        tokens = [len(p) + n for b in (w.batch, w.warm) for p, n in zip(b.prompts, b.new_tokens)]
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in w.batch.new_tokens]
        walls, cpus, same = [], [], True
        for _ in range(args.rounds):
            with Engine(model, num_blocks=sum(blocks_for(t) for t in tokens) + 8, block_size=BLOCK_SIZE,
                        max_num_seqs=w.batch.size) as engine:  # fmt: skip
                engine.generate(w.warm.prompts, SamplingParams(max_new_tokens=2, ignore_eos=True), use_tqdm=False)
                start, cpu = time.perf_counter(), time.thread_time()
                outputs = engine.generate(w.batch.prompts, params, use_tqdm=False)
                walls.append(time.perf_counter() - start)
                cpus.append(time.thread_time() - cpu)
            same = same and [list(o.token_ids) for o in outputs] == reference
        wall, cpu = statistics.median(walls), statistics.median(cpus)
        print(f"{w.label}: floor {floor.seconds:.3f} s ({floor.memory_bound} of {floor.steps} steps bound by memory); "
              f"Engine wall {wall:.3f} s = {wall / floor.seconds:.2f}x, CPU {cpu:.3f} s = {cpu / floor.seconds:.2f}x "
              f"the floor; tokens equal to transformers' generate: {same}; load average {os.getloadavg()[0]:.2f}",
              flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
