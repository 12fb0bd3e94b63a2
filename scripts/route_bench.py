"""A linear layer's call through its settled route (``adapters/transformers/linear_routes.py``) against the same layer
going the full way to the kernel, and ``F.linear``, side by side in one process.

For each weight shape of the benchmark model (hidden 512, 2 KV heads of 64, MLP 1536), float32, at decode row counts:
a layer of the Engine's linears (``PrepackedLinears``, as an Engine with ``row_kernel=True`` installs them) whose row
split settled on the kernel, called inside the runner's forward (``active()``, inference mode) with its route, and
a twin layer whose route table holds none (built with ``prepacked.MAX_ROUTES`` 0); microseconds per call, median
of 7 rounds of 2000 calls. The weights stay in the caches, so what differs is the work around the kernel's call.

    python scripts/route_bench.py [--threads 2] [--rows 1,2,4,8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedcore.adapters.transformers import prepacked
from pagedcore.adapters.transformers.prepacked import PrepackedLinears
from pagedcore.adapters.transformers.row_split import TRIALS

SHAPES = [(512, 512), (128, 512), (1536, 512), (512, 1536)]


def per_call(call: Callable[[], object], calls: int = 2000) -> float:
    """Median microseconds per call over 7 rounds, after a warm-up."""
    for _ in range(200):
        call()
    rounds = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def compare(rows: int, shape: tuple[int, int], threads: int) -> str:
    routed, full = torch.nn.Linear(shape[1], shape[0], bias=False), torch.nn.Linear(shape[1], shape[0], bias=False)
    full.weight = routed.weight
    packs = PrepackedLinears(routed, pack=False)
    limit = prepacked.MAX_ROUTES
    prepacked.MAX_ROUTES = 0  # the twin's route table holds none (its limit is read when its forward is installed)
    try:
        twin = PrepackedLinears(full, pack=False)
    finally:
        prepacked.MAX_ROUTES = limit
    x = torch.randn(1, rows, shape[1])
    with torch.inference_mode():
        for _ in range(4 * TRIALS + 2):  # each row split's check and trials: the ways settle
            with packs.active():
                routed(x)
            with twin.active():
                full(x)
        way = packs.row_split.settled((shape[0], shape[1], False), rows, threads)
        with packs.active():
            with_route = per_call(lambda: routed(x))
        with twin.active():
            without = per_call(lambda: full(x))
        plain = per_call(lambda: F.linear(x, routed.weight))
        with packs.active():
            same = torch.equal(routed(x), F.linear(x, routed.weight))
        with twin.active():
            same = same and torch.equal(full(x), F.linear(x, routed.weight))
    packs.close()
    twin.close()
    return (f"| {shape[0]}x{shape[1]} | {rows} | {way} | {without:.1f} | {with_route:.1f} | {without - with_route:.1f} "
            f"| {plain:.1f} | {same} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,4,8")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads {args.threads}; float32; weights in the caches; µs per call, median of 7 x 2000\n")
    print("| weight | rows | settled way | full way µs | route µs | saved µs | F.linear µs | bits equal |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for rows in [int(r) for r in args.rows.split(",")]:
        for shape in SHAPES:
            print(compare(rows, shape, args.threads), flush=True)


if __name__ == "__main__":
    main()
