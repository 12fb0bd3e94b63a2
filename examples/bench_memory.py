"""KV memory of a mixed-length, left-padded batch: bytes reserved per byte of real tokens.

PagedCache (blocks held) against DynamicCache (padded tensors) and StaticCache (preallocated tensors).

A thin wrapper over ``pagedcore.adapters.transformers.benchmarks``; prints the markdown report.

Usage:
    python examples/bench_memory.py                       # full workload on the benchmark-sized Llama (random weights)
    python examples/bench_memory.py --quick               # smaller model and workload: a smoke run
    python examples/bench_memory.py --out memory.md       # also write the report to a file
    python examples/bench_memory.py --threads 1           # steadier figures on a machine shared with other jobs
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pagedcore.adapters.transformers.benchmarks import run_one


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, run the benchmark and print its markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model and workload (a smoke run)")
    parser.add_argument("--out", type=Path, help="also write the markdown report to this file")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    markdown = run_one("memory", quick=args.quick, progress=not args.no_progress, threads=args.threads)
    print(markdown)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(markdown)


if __name__ == "__main__":
    main()
