"""One-row ``F.linear`` against the split of ``adapters/transformers/one_row.py``, on one machine, side by side.

For each weight shape of the benchmark model (and its LM head), enough copies to stream from memory (a decode step
reads every weight once, out of the caches), float32, one row: milliseconds per call of ``F.linear`` and of
``split_linear`` over the weight's row blocks, each the best of 5 rounds, alternating; GB/s of weight read; and
whether the split gave ``F.linear``'s very bits on 5 random rows. Then the whole model's pass (every decoder weight
once, and the head) both ways.

    python scripts/one_row_split.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pagedcore.adapters.transformers.one_row import split_blocks, split_linear

SHAPES = [(512, 512), (128, 512), (1536, 512), (512, 1536), (32000, 512)]
LAYER = [(512, 512), (128, 512), (128, 512), (512, 512), (1536, 512), (1536, 512), (512, 1536)]  # q k v o gate up down


def best(call, rounds: int = 5) -> float:
    call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads {args.threads}; one row, float32; weights streamed from memory (copies totalling ~256 MB)")
    print("| weight | F.linear ms | split ms | F.linear GB/s | split GB/s | same bits |")
    print("| --- | --- | --- | --- | --- | --- |")
    with torch.inference_mode():
        for rows, width in SHAPES:
            blocks = split_blocks(rows, args.threads)
            if blocks is None:
                print(f"| {rows}x{width} | - | not split | | | |")
                continue
            weights = [torch.randn(rows, width) * 0.02 for _ in range(max(1, (256 << 20) // (rows * width * 4)))]
            x = torch.randn(1, width)
            same = all(
                torch.equal(split_linear(v, weights[0], None, blocks), F.linear(v, weights[0]))
                for v in [torch.randn(1, width) for _ in range(5)]
            )
            plain = best(lambda ws=weights, x=x: [F.linear(x, w) for w in ws]) / len(weights)
            split = best(lambda ws=weights, x=x, n=blocks: [split_linear(x, w, None, n) for w in ws]) / len(weights)
            gb = rows * width * 4 / 1e9
            print(f"| {rows}x{width} | {plain * 1e3:.3f} | {split * 1e3:.3f} | {gb / plain:.1f} | {gb / split:.1f} "
                  f"| {same} |")  # fmt: skip
        model = [torch.randn(r, c) * 0.02 for _ in range(8) for r, c in LAYER] + [torch.randn(32000, 512) * 0.02]
        inputs = {c: torch.randn(1, c) for _, c in LAYER}

        def one_pass(split: bool) -> None:
            for w in model:
                x = inputs[w.shape[1]]
                blocks = split_blocks(w.shape[0], args.threads)
                _ = split_linear(x, w, None, blocks) if split and blocks else F.linear(x, w)

        plain, split = best(lambda: one_pass(False)), best(lambda: one_pass(True))
        print(f"\nthe benchmark model's weights once (8 layers and the head): F.linear {plain * 1e3:.2f} ms, "
              f"split {split * 1e3:.2f} ms ({plain / split:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
