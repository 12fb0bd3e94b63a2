"""What the construction-time probe costs: the first PagedCache / Engine on a model against the next ones.

Needs: the `transformers` extra (`make demo` installs it).

When a ``PagedCache``, ``enable()`` or an ``Engine`` is first set up on a model, pagedcore runs a few short forwards
to check that its paged path gives the model's own output (``pagedcore.adapters.transformers.probe``; refused
otherwise). The verdict is kept per model, so only the first construction pays. This script times, on a fresh model
each time (the median of ``--runs``): the first construction, the second, the probe's own time, and one ``generate``
of 64 + 32 tokens for scale, in one run.

    python examples/probe_cost.py            # a tiny Llama and the benchmark model (hidden 512, 8 layers, vocab 32k)
    python examples/probe_cost.py --quick    # the tiny Llama only
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from pagedcore.adapters.transformers import Engine, PagedCache
from pagedcore.adapters.transformers.probe import verdicts
from pagedcore.adapters.transformers.testing import tiny_llama
from pagedcore.benchmarks.common import bench_model


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _generate_seconds(model: torch.nn.Module) -> float:
    ids = torch.randint(3, 100, (1, 64))
    return _seconds(lambda: model.generate(ids, max_new_tokens=32, do_sample=False))


def measure(make_model: Callable[[], torch.nn.Module], runs: int) -> dict[str, float]:
    """Medians in milliseconds: first and next PagedCache / Engine, their probes, and one generate."""
    found: dict[str, list[float]] = {}
    for _ in range(runs):
        for kind in ("cache", "engine"):
            model = make_model()

            def build(model: torch.nn.Module = model, kind: str = kind) -> None:
                if kind == "cache":
                    PagedCache(model, num_blocks=64, block_size=16).release()
                else:
                    Engine(model, num_blocks=64, block_size=16).close()

            found.setdefault(f"{kind} first", []).append(_seconds(build))
            found.setdefault(f"{kind} next", []).append(_seconds(build))
            found.setdefault(f"{kind} probe", []).append(sum(v.seconds for v in verdicts(model)))
        found.setdefault("generate 64+32", []).append(_generate_seconds(make_model()))
    return {k: 1000 * statistics.median(v) for k, v in found.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny Llama only, one run")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    models: dict[str, Callable[[], torch.nn.Module]] = {"tiny Llama (2 x 64)": tiny_llama}
    if not args.quick:
        models["benchmark Llama (8 x 512, vocab 32k)"] = bench_model
    for name, make in models.items():
        ms = measure(make, 1 if args.quick else args.runs)
        print(f"{name}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in ms.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
