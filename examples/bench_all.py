"""All four transformers-adapter benchmarks on one model: prefix caching, cold generation, KV memory, Engine.

A thin wrapper over ``pagedcore.adapters.transformers.benchmarks.run_all``: prints the markdown and writes
``OUT/results.md`` and the chart ``OUT/engine.png``.

Usage:
    python examples/bench_all.py                      # full workloads on the benchmark-sized Llama (random weights)
    python examples/bench_all.py --quick              # smaller model and workloads (about 2 minutes on 2 cores)
    python examples/bench_all.py --out bench-out      # output folder (default: bench-out)
    python examples/bench_all.py --threads 1          # steadier figures on a machine shared with other jobs
"""

from __future__ import annotations

import argparse

from pagedcore.adapters.transformers.benchmarks import run_all


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, run every benchmark and print the markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model and workloads (a smoke run)")
    parser.add_argument("--out", default="bench-out", help="folder for results.md and engine.png (default: bench-out)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    print(run_all(quick=args.quick, out_dir=args.out, progress=not args.no_progress, threads=args.threads))


if __name__ == "__main__":
    main()
