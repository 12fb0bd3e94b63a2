"""Two Engine settings side by side in one process: decode ms per step and prefill time, alternating, on the
benchmark model (issue 33's measurements of prepacked weights and the compiled step).

``python scripts/engine_ab.py --a prepack=False --b prepack=True --batches 1,16,64 [--threads 1] [--size small]``:
each side is an ``Engine(model, **settings)`` on its own copy of the model (an Engine installs its fused head and its
linears' forwards on its model's layers, which a second Engine on the same model would find taken; until 5 December
both sides shared one model, so side B ran without the fused head whenever side A installed one). Per batch size, an
untimed warm-up run of the same shape, then ``--rounds`` rounds, the two sides' order alternating; per round and side
the prefill alone (``max_new_tokens=1``) and the same prompts with ``--new`` new tokens (the prefix cache cleared
before each): decode ms per step = the difference of their times over the difference of their steps. Times are this
thread's CPU time (``--threads 1``: the step runs in it, and the waits of a loaded machine are left out;
``CLOCK=wall`` for the Engine's ``busy_seconds`` instead: needed with more threads, whose work this thread's CPU time
leaves out).
Prints medians, the ratio, the load average and whether the two sides' greedy tokens were identical.
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import statistics
import sys
import time
from typing import Any

import torch

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.benchmarks.common import bench_model


def settings(text: str) -> dict[str, Any]:
    """``"prepack=False,compile=True"`` as keyword arguments."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=", 1)
        out[key] = ast.literal_eval(value) if value not in ("auto",) else value
    return out


def prompts(vocab: int, batch: int, seed: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def timed(engine: Engine, batch: list[list[int]], new: int) -> tuple[float, float, list[list[int]]]:
    """(decode seconds per step, prefill seconds, greedy tokens) of ``batch`` on ``engine``, in this thread's CPU
    time (with one torch thread the whole step runs in it; a loaded machine's waits are not counted), or in wall
    time (``busy_seconds``) with ``CLOCK=wall``."""
    wall = os.environ.get("CLOCK") == "wall"

    def clock() -> float:
        return engine.stats().busy_seconds if wall else time.thread_time()

    engine.pool.clear_prefix_cache()
    s0, c0 = engine.stats(), clock()
    engine.generate(batch, SamplingParams(max_new_tokens=1, ignore_eos=True), use_tqdm=False)
    s1, c1 = engine.stats(), clock()
    engine.pool.clear_prefix_cache()
    outputs = engine.generate(batch, SamplingParams(max_new_tokens=new, ignore_eos=True), use_tqdm=False)
    s2, c2 = engine.stats(), clock()
    steps = (s2.num_steps - s1.num_steps) - (s1.num_steps - s0.num_steps)
    seconds = (c2 - c1) - (c1 - c0)
    return seconds / steps, c1 - c0, [list(o.token_ids) for o in outputs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="prepack=False")
    parser.add_argument("--b", default="prepack=True")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--size", default="small")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=33)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = bench_model(size=args.size)
    vocab = model.config.vocab_size
    sides = {"A": settings(args.a), "B": settings(args.b)}
    # Each side its own copy of the model: an Engine installs its fused head and its linears' forwards on its model's
    # layers, which a second Engine on the same model would find taken (and run without).
    models = {"A": model, "B": copy.deepcopy(model)}
    engines = {
        name: Engine(models[name], num_blocks=2048, block_size=16, max_num_seqs=256, **kw) for name, kw in sides.items()
    }
    print(f"# {os.environ.get('CLOCK', 'cpu')} time; {args.size} model, {args.threads} thread(s), A = {args.a}, "
          f"B = {args.b}, prompts {args.prompt} + {args.new} new; load average {os.getloadavg()[0]:.2f}",
          flush=True)  # fmt: skip
    for size in [int(b) for b in args.batches.split(",")]:
        for engine in engines.values():
            timed(engine, prompts(vocab, size, 99, args.prompt), 3)
        decode: dict[str, list[float]] = {n: [] for n in engines}
        prefill: dict[str, list[float]] = {n: [] for n in engines}
        same = True
        for r in range(args.rounds):
            order = list(engines.items()) if r % 2 == 0 else list(reversed(engines.items()))
            tokens = {}
            batch = prompts(vocab, size, r, args.prompt)
            for name, engine in order:
                step, first, tokens[name] = timed(engine, batch, args.new)
                decode[name].append(step)
                prefill[name].append(first)
            same = same and tokens["A"] == tokens["B"]
        a, b = (statistics.median(decode[n]) * 1e3 for n in ("A", "B"))
        pa, pb = (statistics.median(prefill[n]) * 1e3 for n in ("A", "B"))
        print(f"batch {size}: decode A {a:.2f} / B {b:.2f} ms per step (A / B {a / b:.2f}x); prefill A {pa:.1f} / "
              f"B {pb:.1f} ms ({pa / pb:.2f}x); greedy tokens equal: {same}; load average {os.getloadavg()[0]:.2f}",
              flush=True)  # fmt: skip
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
