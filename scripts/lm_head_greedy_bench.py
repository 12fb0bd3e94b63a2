"""The greedy choice fused into the LM head, against the LM head followed by the sampler's greedy pass (issue 33.3:
"greedy choice and sampling without a separate full pass over the logits").

At 256 rows the sampler's greedy pass (:func:`pagedcore.engine.sampling.greedy_tokens`) reads 256 x 32000 float32
logits (33 MB) once more after the LM head wrote them: about half of the Engine's host time per step there. The
fused variant computes the LM head in column chunks straight into the logits tensor (``torch.mm`` into a column
view: MKL writes a sub-matrix in place, no copy) and takes each chunk's 256-column block maxima while the chunk is
still in cache, so the greedy choice needs no full pass; the logits stay whole for log-probabilities and
processors. Per row count, float32, one torch thread by default, medians of ``--rounds`` rounds with the variants
alternating:

- ``linear + greedy``: ``F.linear`` (what transformers' LM head runs), then ``greedy_tokens``;
- ``chunked + block maxima``: the fused variant, ``--chunk`` columns per chunk;
- ``ArgmaxHead``: the Engine's chunked way (:mod:`pagedcore.adapters.transformers.argmax_head`, ``way="chunks"``;
  the Engine measures it against the whole GEMM per bucket of row counts and keeps the faster): each chunk
  (:func:`~pagedcore.adapters.transformers.argmax_head.chunk_columns`) a fresh small GEMM whose numpy argmax is taken
  at once, the logits never written whole (its bit check is done before the timed rounds);

with whether the chunked logits are bit-equal to ``F.linear``'s and the tokens equal (both variants').
``--evict`` streams 64 MiB through the caches before every call, as a forward streams the model's weights before
its head. Shapes: the benchmark model's
LM head (``--size``) and a Qwen-sized one (hidden 1024, vocab 151936).

    python scripts/lm_head_greedy_bench.py [--size small] [--rows 1,16,64,256] [--chunk 2048] [--rounds 7] [--evict]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from pagedcore.adapters.transformers import argmax_head
from pagedcore.adapters.transformers.argmax_head import ArgmaxHead
from pagedcore.benchmarks.common import bench_config
from pagedcore.engine.sampling import _BLOCK, greedy_tokens  # the sampler's block width: the fused path keeps it


def chunked_logits(h: torch.Tensor, w: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.linear(h, w)`` computed ``chunk`` columns at a time into one tensor, with the block maxima of every
    256-column block taken from each chunk while it is hot: ``(logits, block maxima)``."""
    rows, vocab = h.shape[0], w.shape[0]
    out = torch.empty(rows, vocab)
    blocks = torch.empty(rows, -(-vocab // _BLOCK))
    for start in range(0, vocab, chunk):
        end = min(vocab, start + chunk)
        part = out[:, start:end]
        torch.mm(h, w[start:end].t(), out=part)
        whole = (end - start) // _BLOCK * _BLOCK
        if whole:
            first = start // _BLOCK
            blocks[:, first : first + whole // _BLOCK] = part[:, :whole].reshape(rows, -1, _BLOCK).amax(dim=-1)
        if whole < end - start:
            blocks[:, -1] = part[:, whole:].amax(dim=-1)
    return out, blocks


def greedy_from_blocks(logits: torch.Tensor, blocks: torch.Tensor) -> list[int]:
    """The first maximal index per row, searching only the first block that holds the row's maximum."""
    vocab = logits.shape[1]
    row_max = blocks.amax(dim=-1, keepdim=True)
    starts = (blocks == row_max).to(torch.uint8).argmax(dim=-1) * _BLOCK
    columns = (starts[:, None] + torch.arange(_BLOCK)[None, :]).clamp(max=vocab - 1)
    within = (logits.gather(1, columns) == row_max).to(torch.uint8).argmax(dim=-1)
    return (starts + within).tolist()


def _head_logits(layer: torch.nn.Linear, h: torch.Tensor) -> torch.Tensor:
    """The head's logits of ``h``, as the model's forward computes them (one batch row of packed tokens)."""
    return layer(h[None])[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--evict", action="store_true", help="stream 64 MiB through the caches before every call")
    args = parser.parse_args(argv)
    if args.chunk <= 0 or args.chunk % _BLOCK:
        parser.error(f"--chunk must be a positive multiple of {_BLOCK} (the sampler's block width), got {args.chunk}")
    torch.set_num_threads(args.threads)
    argmax_head.MIN_ROWS = 1  # the chunks at one row too (the Engine keeps one row on the whole head: they lose there)
    config = bench_config(size=args.size)
    shapes = {f"{args.size} ({config.hidden_size} x {config.vocab_size})": (config.hidden_size, config.vocab_size),
              "Qwen-sized (1024 x 151936)": (1024, 151936)}  # fmt: skip
    print(f"# {torch.get_num_threads()} thread(s), chunk {args.chunk}, {args.rounds} rounds, wall ms per call, "
          f"caches {'evicted' if args.evict else 'warm'}; load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print("| LM head | rows | linear + greedy ms | chunked + block maxima ms | ArgmaxHead ms | speed (separate / "
          "block maxima, separate / ArgmaxHead) | logits bit-equal | tokens equal |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    streamed = torch.zeros(16 << 20) if args.evict else None  # 64 MiB
    for name, (hidden, vocab) in shapes.items():
        w = torch.randn(vocab, hidden, generator=gen) * 0.02
        layer = torch.nn.Linear(hidden, vocab, bias=False)
        layer.weight.data = w
        head = ArgmaxHead(layer, way="chunks")  # the chunks always (the Engine measures both ways per bucket)
        for rows in [int(r) for r in args.rows.split(",")]:
            h = torch.randn(rows, hidden, generator=gen)
            ref = F.linear(h, w)
            logits, blocks = chunked_logits(h, w, args.chunk)
            forward = functools.partial(_head_logits, layer, h)
            with torch.inference_mode():
                head.step(forward, rows)  # the head's checks, then its tokens
                fused = head.step(forward, rows)
            bits = torch.equal(logits, ref) and not isinstance(fused, torch.Tensor)
            want = greedy_tokens(ref)[0]
            same = greedy_from_blocks(logits, blocks) == want and getattr(fused, "tokens", None) == want
            times: dict[str, list[float]] = {"separate": [], "fused": [], "head": []}
            for r in range(args.rounds + 1):
                for key in ("separate", "fused", "head") if r % 2 else ("head", "fused", "separate"):
                    if streamed is not None:
                        streamed.add_(1.0)
                    start = time.perf_counter()
                    if key == "separate":
                        greedy_tokens(F.linear(h, w))
                    elif key == "fused":
                        greedy_from_blocks(*chunked_logits(h, w, args.chunk))
                    else:
                        with torch.inference_mode():
                            head.step(forward, rows)
                    if r:  # the first round warms up
                        times[key].append(time.perf_counter() - start)
            a, b, c = (statistics.median(times[k]) * 1e3 for k in ("separate", "fused", "head"))
            print(f"| {name} | {rows} | {a:.2f} | {b:.2f} | {c:.2f} | {a / b:.2f}x, {a / c:.2f}x | "
                  f"{'yes' if bits else 'no'} | {'yes' if same else 'no'} |")  # fmt: skip
        head.close()
    print(f"# load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
