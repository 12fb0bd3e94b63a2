"""The linear layers of a decode step in each weight layout the CPU offers, side by side (issue 33: "prepacked /
pre-transposed weights ... measure each").

For the benchmark model's weight shapes (one layer's projections and MLP, and the LM head) at 1 .. 512 rows, float32,
milliseconds for one pass over them:

- ``F.linear``: what transformers' ``nn.Linear`` runs (MKL ``sgemm`` with the weight transposed, or ``gemv``);
- ``mm, pre-transposed``: ``x @ w.T`` with ``w.T`` stored contiguous;
- ``mkl packed``: ``torch.ops.mkl._mkl_linear`` on ``_mkl_reorder_linear_weight(w, rows)`` (what inductor's
  ``freezing`` emits for float32 linears with MKL; packed for one row count: other counts fall back to ``linear``);
- ``oneDNN packed``: ``torch.ops.mkldnn._linear_pointwise`` on ``_reorder_linear_weight(w, rows)`` (the layout
  ``prepacked.PrepackedLinears`` uses; any row count);

each the median of 7 rounds, the variants alternating, with the largest difference from ``F.linear``'s output and
whether the pre-transposed ``mm`` gave ``F.linear``'s very bits (``mm = linear``).

By default one pass is one layer's weights and the LM head, timed over and over, so the layer's weights stay in the
caches; ``--step`` makes a pass every layer's weights once, as a decode step reads them (the model's whole set,
streamed from memory: what the Engine's step pays). The two disagree: on this project's machine the pre-transposed
``mm`` is 1.5-3x faster at 16 rows with one layer (cached) and 0.98x with every layer (streamed).

    python scripts/prepack_bench.py [--size small] [--threads 1] [--rows 1,2,4,8,16,32,64,128,256] [--step]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedcore.benchmarks.common import bench_config
from pagedcore.benchmarks.floor import ModelShape


def _time(fn: Callable[[], object], reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


_MKL_REORDER = getattr(torch.ops.mkl, "_mkl_reorder_linear_weight")  # noqa: B009
_MKL_LINEAR = getattr(torch.ops.mkl, "_mkl_linear")  # noqa: B009
_DNN_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight")  # noqa: B009
_DNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise")  # noqa: B009


def layouts(
    weights: list[torch.Tensor], rows: int, gen: torch.Generator
) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """One pass over ``weights`` with ``rows`` input rows, in each layout."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen) for w in weights}
    transposed = [w.t().contiguous() for w in weights]
    mkl = [_MKL_REORDER(w, rows) for w in weights]
    dnn = [_DNN_REORDER(w, rows) for w in weights]
    return {
        "linear": lambda: [F.linear(xs[w.shape[1]], w) for w in weights],
        "mm": lambda: [torch.mm(xs[t.shape[0]], t) for t in transposed],
        "mkl": lambda: [_MKL_LINEAR(xs[w.shape[1]], p, w, None, rows) for w, p in zip(weights, mkl)],
        "dnn": lambda: [_DNN_LINEAR(xs[w.shape[1]], p, None, "none", [], "") for p, w in zip(dnn, weights)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--step", action="store_true", help="every layer's weights once per pass (a decode step)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = ModelShape.from_config(bench_config(size=args.size))
    gen = torch.Generator().manual_seed(0)
    *layer, head = shape.weight_shapes()
    shapes = layer * (shape.layers if args.step else 1) + [head]
    weights = [torch.randn(o, i, generator=gen) / i**0.5 for o, i in shapes]
    what = f"every layer's weights ({shape.layers} layers) and the LM head" if args.step else "one layer and the head"
    print(f"# {args.size} model, one pass = {what}: shapes {shape.weight_shapes()}, float32, {args.threads} "
          f"thread(s); load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(
        "| rows | F.linear ms | mm, pre-transposed | mkl packed | oneDNN packed | max diff (mkl / oneDNN) | "
        "mm = linear |"
    )
    print("|---:|---:|---:|---:|---:|---|---|")
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            variants = layouts(weights, rows, gen)
            reference = variants["linear"]()
            diff = {
                k: max(float((a - b).abs().max()) for a, b in zip(reference, variants[k]())) for k in ("mkl", "dnn")
            }
            same = all(torch.equal(a, b) for a, b in zip(reference, variants["mm"]()))
            reps = max(2, 64 // rows)
            times: dict[str, list[float]] = {k: [] for k in variants}
            for r in range(args.rounds):
                for name in list(variants)[r % 4 :] + list(variants)[: r % 4]:
                    times[name].append(_time(variants[name], reps))
            med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
            print(f"| {rows} | {med['linear']:.3f} | {med['mm']:.3f} | {med['mkl']:.3f} | {med['dnn']:.3f} | "
                  f"{diff['mkl']:.1e} / {diff['dnn']:.1e} | {'yes' if same else 'no'} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
