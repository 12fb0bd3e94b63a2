"""The sampler's greedy pass right after the LM head, per way of searching the logits (issue 33.3: "greedy choice
... without a separate full pass over the logits").

For ``ROWS`` rows of the benchmark model's LM head (``--size``, float32 logits of its vocabulary), each round runs
``F.linear`` (the LM head, which streams its weights through the caches as a forward's last op does) and then times
one way of choosing the greedy tokens (each row's first maximal index, and whether the row has a finite value):

- ``numpy``: :func:`~pagedcore.engine.sampling.greedy_tokens` on CPU float32 logits: numpy's vectorized ``argmax``
  over the tensor's memory, one pass;
- ``blocks``: the block search it uses for other logits (``amax`` over 256-column blocks, then ``argmax`` within
  the first block holding the maximum), what float32 logits took before;
- ``reference``: ``argmax(-1)`` and ``isfinite(...).any(-1)``, torch's scalar loops.

Medians of ``--rounds`` rounds, the ways alternating; every way's answers checked equal to the reference's.

    python scripts/greedy_bench.py [--size small] [--rows 1,4,16,64,256] [--rounds 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedcore.benchmarks.common import bench_config
from pagedcore.engine.sampling import _block_greedy, greedy_tokens

Answer = tuple[list[int], list[bool]]


def _reference(logits: torch.Tensor) -> Answer:
    return logits.argmax(dim=-1).tolist(), torch.isfinite(logits).any(dim=-1).tolist()


WAYS: dict[str, Callable[[torch.Tensor], Answer]] = {
    "numpy": greedy_tokens,
    "blocks": _block_greedy,
    "reference": _reference,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small", help="benchmark model size (its hidden size and vocabulary)")
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = bench_config(size=args.size)
    weight = torch.randn(config.vocab_size, config.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.05
    print(f"LM head {config.vocab_size} x {config.hidden_size} float32, {args.threads} torch thread(s), "
          f"medians of {args.rounds} rounds\n")  # fmt: skip
    print("| rows | numpy ms | blocks ms | reference ms | numpy / blocks | numpy / reference | same answers |")
    print("|---|---|---|---|---|---|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        hidden = torch.randn(rows, config.hidden_size, generator=torch.Generator().manual_seed(rows))
        times: dict[str, list[float]] = {name: [] for name in WAYS}
        same = True
        for r in range(args.rounds):
            names = list(WAYS) if r % 2 == 0 else list(reversed(WAYS))
            for name in names:
                with torch.inference_mode():
                    logits = F.linear(hidden, weight)
                    start = time.perf_counter()
                    answer = WAYS[name](logits)
                    times[name].append(time.perf_counter() - start)
                    same = same and answer == _reference(logits)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        ratios = f"{ms['numpy'] / ms['blocks']:.2f}x | {ms['numpy'] / ms['reference']:.2f}x"
        print(f"| {rows} | {ms['numpy']:.3f} | {ms['blocks']:.3f} | {ms['reference']:.3f} | {ratios} | "
              f"{'yes' if same else 'NO'} |")  # fmt: skip


if __name__ == "__main__":
    main()
