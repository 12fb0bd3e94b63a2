"""Few-row ``F.linear`` against the row split and the row kernel (``adapters/transformers/row_kernel.py``), side by
side on one machine.

For each weight shape of the benchmark model (hidden 512, 2 KV heads of 64, MLP 1536), enough copies to stream from
memory (a decode step reads every weight once, out of the caches), float32, at decode row counts: milliseconds per
call of ``F.linear``, of ``split_linear`` over the weight's row blocks and of the kernel, each the best of 7 rounds;
the kernel's blocked rows again in 256-bit vectors where it runs them in 512-bit ones (AVX-512F; "-" otherwise);
the ratios; the order whose bits equal ``F.linear``'s (a block width, "lanes", or both by rows; "-": none, so the
Engine would not use the kernel there, and the kernel is timed in blocks of 192).

    python scripts/row_kernel_bench.py [--threads 2] [--rows 1,4,8,16,32,64,128]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from row_split import best  # this folder's scripts/row_split.py: best of 7 after a warm-up

from pagedcore.adapters.transformers.row_kernel import Order, load
from pagedcore.adapters.transformers.row_split import split_blocks, split_linear

SHAPES = [(512, 512), (128, 512), (1536, 512), (512, 1536)]


def compare(rows: int, shape: tuple[int, int], threads: int) -> str:
    kernel = load()
    assert kernel is not None, "no row kernel on this machine (no C compiler, no AVX2, or PAGEDCORE_ROW_KERNEL=0)"
    blocks = split_blocks(shape[0], threads)
    weights = [torch.randn(*shape) * 0.02 for _ in range(max(2, (256 << 20) // (shape[0] * shape[1] * 4)))]
    x = torch.randn(rows, shape[1])
    order = kernel.exact_order(x, weights[0], None, F.linear(x, weights[0]), threads)
    run = Order.blocks(192, rows) if order is None else order
    plain = best(lambda: [F.linear(x, w) for w in weights]) / len(weights)
    split = best(lambda: [split_linear(x, w, None, blocks) for w in weights]) / len(weights) if blocks else None
    fast = best(lambda: [kernel.linear(x, w, None, run, threads) for w in weights]) / len(weights)
    narrow = "-"
    if kernel.wide and run.lanes_from:  # the blocked rows again in 256-bit vectors
        kernel.set_wide(False)
        try:
            slow = best(lambda: [kernel.linear(x, w, None, run, threads) for w in weights]) / len(weights)
            narrow = f"{slow * 1e3:.3f}"
        finally:
            kernel.set_wide(True)
    shown = "-" if split is None else f"{split * 1e3:.3f}"
    versus = "-" if split is None else f"{split / fast:.2f}x"
    return (f"| {shape[0]}x{shape[1]} | {rows} | {plain * 1e3:.3f} | {shown} | {fast * 1e3:.3f} | {narrow} | "
            f"{plain / fast:.2f}x | {versus} | {'-' if order is None else order.label(rows)} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,8,16,32,64,128")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads {args.threads}; float32; weights streamed from memory (copies totalling ~256 MB)\n")
    kernel = load()
    wide = kernel is not None and kernel.wide
    print(f"the kernel's blocked rows in {'512' if wide else '256'}-bit vectors (AVX-512F {'on' if wide else 'off'})\n")
    print("| weight | rows | F.linear ms | split ms | kernel ms | kernel, 256-bit ms | F.linear / kernel "
          "| split / kernel | exact order |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            for shape in SHAPES:
                print(compare(rows, shape, args.threads), flush=True)


if __name__ == "__main__":
    main()
