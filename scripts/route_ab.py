"""The Engine's decode step with and without its layers' settled routes (``adapters/transformers/linear_routes.py``),
side by side in one process: two Engines on two copies of the benchmark model, alternating as in
``scripts/engine_ab.py`` (whose timing this reuses), side A never given a route (built with ``prepacked.MAX_ROUTES``
0, so its route tables hold none and every linear call goes the full way), side B with them.

    CLOCK=wall python scripts/route_ab.py [--batches 1,2,4,8,16] [--threads 2] [--rounds 5] [--compile]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from engine_ab import prompts, timed  # this folder's scripts/engine_ab.py

from pagedcore.adapters.transformers import Engine, prepacked
from pagedcore.benchmarks.common import bench_model

LIMIT = prepacked.MAX_ROUTES


@contextmanager
def routes(on: bool) -> Iterator[None]:
    """Linears installed in the block get route tables of the usual size (``on``) or of none."""
    prepacked.MAX_ROUTES = LIMIT if on else 0
    try:
        yield
    finally:
        prepacked.MAX_ROUTES = LIMIT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=33)
    parser.add_argument("--compile", action="store_true", help="both Engines with compile=True")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = bench_model(size="small")
    vocab = model.config.vocab_size
    sides = {"A": False, "B": True}
    engines = {}
    for name, m in (("A", model), ("B", copy.deepcopy(model))):
        with routes(sides[name]):  # each table's limit is read when the Engine's linears are installed
            engines[name] = Engine(m, num_blocks=2048, block_size=16, max_num_seqs=256, compile=args.compile)
    print(f"# {os.environ.get('CLOCK', 'cpu')} time; small model, {args.threads} thread(s), A = no routes, B = routes, "
          f"compile={args.compile}, prompts {args.prompt} + {args.new} new", flush=True)  # fmt: skip
    for size in [int(b) for b in args.batches.split(",")]:
        for engine in engines.values():
            timed(engine, prompts(vocab, size, 99, args.prompt), 3)
        decode: dict[str, list[float]] = {n: [] for n in engines}
        same = True
        for r in range(args.rounds):
            order = list(engines.items()) if r % 2 == 0 else list(reversed(engines.items()))
            tokens = {}
            for name, engine in order:
                step, _, tokens[name] = timed(engine, prompts(vocab, size, r, args.prompt), args.new)
                decode[name].append(step)
            same = same and tokens["A"] == tokens["B"]
        a, b = (statistics.median(decode[n]) * 1e3 for n in ("A", "B"))
        print(f"batch {size}: decode A {a:.2f} / B {b:.2f} ms per step (A / B {a / b:.2f}x); greedy tokens equal: "
              f"{same}; load average {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
