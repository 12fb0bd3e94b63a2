"""The LM head's greedy choice, with the caches evicted before each call as a forward leaves them: the whole
``F.linear`` and one numpy argmax pass, and the screen (``head_screen.HeadScreen``: an approximate product, the
candidate columns, their exact logits) with fbgemm's float16-weight GEMM and with the row kernel's int8 product
(``row_kernel.RowKernel.byte_linear``, where this machine builds it), each product also timed alone; with the
exact columns per step and whether the screens' tokens are the whole GEMM's (docs/benchmarks.md, "The greedy choice
screened in half precision", "The screen in bytes").

``python scripts/head_screen_bench.py [--size small] [--rows 1,4,8,16,64] [--rounds 7] [--evict-mib 384]
[--threads 1]``: the head's inputs are the benchmark model's final hidden states over a random 160-token sequence
(its last ``rows`` positions), so the logits spread as the model's own do. Medians of ``--rounds``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedcore.adapters.transformers import head_screen, row_kernel
from pagedcore.benchmarks.common import bench_model

EVICT_MIB = 384  # written before each timed call: more than this machine's last-level cache holds


def _whole(x: torch.Tensor, weight: torch.Tensor) -> object:
    return F.linear(x, weight).numpy().argmax(axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--rows", default="1,4,8,16,64")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--evict-mib", type=int, default=EVICT_MIB, help="MiB written before each timed call")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    kernel = row_kernel.load()
    if not head_screen.available() or kernel is None:
        raise SystemExit("needs fbgemm's float16 GEMM (an x86 CPU build of torch has it) and the row kernel")
    torch.set_num_threads(args.threads)
    model = bench_model(size=args.size)
    weight = model.get_output_embeddings().weight.detach()
    screen, screen_k = head_screen.HeadScreen(), head_screen.HeadScreen(kernel)
    screen.prepare(weight)
    screen_k.prepare(weight)
    evict = torch.zeros(max(args.evict_mib, 1) << 18)  # float32: 2^18 per MiB
    ids = torch.randint(3, model.config.vocab_size, (1, 160), generator=torch.Generator().manual_seed(0))
    print(f"# {args.size} model, head {tuple(weight.shape)}, {args.threads} thread(s), medians of {args.rounds}, "
          "caches evicted")  # fmt: skip
    print("| rows | F.linear + argmax ms | screen ms: fbgemm / kernel | product alone ms: fbgemm / kernel | "
          "exact columns | tokens equal |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---|")
    with torch.inference_mode():
        hidden = model.model(ids).last_hidden_state[0]
        for rows in (int(r) for r in args.rows.split(",")):
            x = hidden[-rows:].contiguous()
            copy = screen._fresh_copy(weight).packed  # noqa: SLF001 (the GEMMs alone)
            turned = screen_k._fresh_copy(weight).packed  # noqa: SLF001
            assert isinstance(turned, tuple)
            ways: dict[str, Callable[[], object]] = {
                "whole": functools.partial(_whole, x, weight),
                "screen": functools.partial(screen.screen, x, weight),
                "screen_k": functools.partial(screen_k.screen, x, weight),
                "gemm": functools.partial(torch.ops.quantized.linear_dynamic_fp16, x, copy),
                "gemm_k": functools.partial(kernel.byte_linear, x, *turned, args.threads),
            }
            times: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(args.rounds):
                for name, way in ways.items():
                    evict.add_(1.0)
                    start = time.perf_counter()
                    way()
                    times[name].append((time.perf_counter() - start) * 1000)
            ms = {name: statistics.median(values) for name, values in times.items()}
            steps = [screen.screen(x, weight), screen_k.screen(x, weight)]
            want = F.linear(x, weight).argmax(-1).tolist()
            columns = " / ".join("-" if step is None else str(len(step.columns)) for step in steps)
            equal = " / ".join("not screened" if step is None else str(step.tokens == want) for step in steps)
            print(f"| {rows} | {ms['whole']:.2f} | {ms['screen']:.2f} / {ms['screen_k']:.2f} | {ms['gemm']:.2f} / "
                  f"{ms['gemm_k']:.2f} | {columns} | {equal} |")  # fmt: skip


if __name__ == "__main__":
    main()
