"""Benchmark of the plain-Python bookkeeping core: block operations, prefix trie, eviction, one scheduler step.

Needs: pagedcore alone (the core is plain Python).

Prints a markdown table with the measured cost next to its aim (2 us per block operation, 1 ms per scheduler step)
and the machine it ran on. Every figure is the median over several runs; a run times many repetitions with
``time.perf_counter_ns`` around the operation alone (setup and clean-up stay outside the timed region), with the
garbage collector paused as ``timeit`` does. A thin wrapper over ``pagedcore.benchmarks.core`` (``pagedcore bench
--only core`` runs the same).

Usage:
    python examples/bench_core.py                 # full run (about 20 s on an idle machine)
    python examples/bench_core.py --quick         # fewer repetitions (a few seconds)
    python examples/bench_core.py --out bench.md  # also write the report to a file
    python examples/bench_core.py --profile       # append a cProfile of every operation that misses its aim
    python examples/bench_core.py --clock cpu     # process CPU time instead of wall time (on a busy machine)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagedcore.benchmarks.core import CLOCKS, core_benchmark, profile_report
from pagedcore.errors import PagedCoreError


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the benchmark and print its markdown."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a few seconds)")
    parser.add_argument("--out", type=Path, help="also write the markdown report to this file")
    parser.add_argument("--profile", action="store_true", help="append a cProfile of each operation missing its aim")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="wall time (default) or CPU time")
    parser.add_argument("--num-seqs", type=int, default=256, help="running sequences in the scheduler step")
    parser.add_argument("--seq-tokens", type=int, default=2048, help="tokens per sequence in the scheduler step")
    args = parser.parse_args(argv)
    try:
        result = core_benchmark(args.quick, clock=args.clock, num_seqs=args.num_seqs, seq_tokens=args.seq_tokens)
    except PagedCoreError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    text = result.markdown()
    if args.profile:
        text += profile_report(result)
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
