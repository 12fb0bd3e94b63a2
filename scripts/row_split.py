"""Few-row ``F.linear`` against the split of ``adapters/transformers/row_split.py``, on one machine, side by side.

For each weight shape of the benchmark model (hidden 512, 2 KV heads of 64, MLP 1536; its LM head at one row), enough
copies to stream from memory (a decode step reads every weight once, out of the caches), float32, at decode row
counts: milliseconds per call of ``F.linear`` and of ``split_linear`` over the weight's row blocks, each the best of 7
rounds; the ratio; whether the split gave ``F.linear``'s very bits. Then the whole model's one-row pass (every decoder
weight once, and the head) both ways.

    python scripts/row_split.py [--threads 2] [--rows 1,4,16,32,64,128,256]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pagedcore.adapters.transformers.row_split import split_blocks, split_linear

SHAPES = [(512, 512), (128, 512), (1536, 512), (512, 1536)]
LAYER = [(512, 512), (128, 512), (128, 512), (512, 512), (1536, 512), (1536, 512), (512, 1536)]  # q k v o gate up down


def best(call, rounds: int = 7) -> float:
    call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def compare(rows: int, shape: tuple[int, int], threads: int) -> str:
    blocks = split_blocks(shape[0], threads)
    if blocks is None:
        return f"| {shape[0]}x{shape[1]} | {rows} | - | not split | | |"
    weights = [torch.randn(*shape) * 0.02 for _ in range(max(2, (256 << 20) // (shape[0] * shape[1] * 4)))]
    x = torch.randn(rows, shape[1])
    same = all(torch.equal(split_linear(x, w, None, blocks), F.linear(x, w)) for w in weights[:2])
    plain = best(lambda: [F.linear(x, w) for w in weights]) / len(weights)
    split = best(lambda: [split_linear(x, w, None, blocks) for w in weights]) / len(weights)
    return f"| {shape[0]}x{shape[1]} | {rows} | {plain * 1e3:.3f} | {split * 1e3:.3f} | {plain / split:.2f}x | {same} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,16,32,64,128,256")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads {args.threads}; float32; weights streamed from memory (copies totalling ~256 MB)\n")
    print("| weight | rows | F.linear ms | split ms | F.linear / split | same bits |")
    print("| --- | --- | --- | --- | --- | --- |")
    with torch.inference_mode():
        print(compare(1, (32000, 512), args.threads))
        for rows in [int(r) for r in args.rows.split(",")]:
            for shape in SHAPES:
                print(compare(rows, shape, args.threads))
        model = [torch.randn(r, c) * 0.02 for _ in range(8) for r, c in LAYER] + [torch.randn(32000, 512) * 0.02]
        inputs = {c: torch.randn(1, c) for _, c in LAYER}

        def one_pass(split: bool) -> None:
            for w in model:
                x = inputs[w.shape[1]]
                blocks = split_blocks(w.shape[0], args.threads)
                _ = split_linear(x, w, None, blocks) if split and blocks else F.linear(x, w)

        plain, split = best(lambda: one_pass(False)), best(lambda: one_pass(True))
        print(f"\nthe benchmark model's weights once at one row (8 layers and the head): "
              f"F.linear {plain * 1e3:.2f} ms, split {split * 1e3:.2f} ms ({plain / split:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
