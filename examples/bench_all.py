"""Every benchmark on one model: prefix caching, cold generation, KV memory, Engine, bookkeeping core.

Needs: the `transformers` extra (`make demo` installs it); the `bench` extra for the charts (matplotlib) and the
peers section (CTranslate2).

The same as ``pagedcore bench`` (a thin wrapper over ``pagedcore.benchmarks``): prints the markdown and writes
``OUT/results.md`` and the chart ``OUT/engine.png``.

Usage:
    python examples/bench_all.py                      # full workloads on the benchmark-sized Llama (random weights)
    python examples/bench_all.py --quick              # smaller model and workloads (about 2 minutes on 2 cores)
    python examples/bench_all.py --out bench-out      # output folder (default: bench-out)
    python examples/bench_all.py --threads 1          # steadier figures on a machine shared with other jobs
    python examples/bench_all.py --only prefix,engine # a subset
    python examples/bench_all.py --device cuda --dtype bfloat16 --model-size 1b   # on a GPU, the ~1B model
"""

from __future__ import annotations

import sys

from pagedcore.cli import main as cli


def main(argv: list[str] | None = None) -> int:
    """Run ``pagedcore bench`` with these arguments; returns its exit code."""
    return cli(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
