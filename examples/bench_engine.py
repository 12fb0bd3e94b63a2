"""Continuous batching of requests sharing a prefix: the pagedcore Engine and its peers.

Needs: the `transformers` extra (`make demo` installs it).

The Engine against generate one request at a time, generate on the left-padded batch and transformers' own
continuous batching: wall time, tokens/s, p50/p99 latency, prefill tokens computed, peak KV memory.

A thin wrapper over ``pagedcore.benchmarks`` (``pagedcore bench --only engine`` runs the same); prints the
markdown report.

Usage:
    python examples/bench_engine.py                       # full workload on the benchmark-sized Llama (random weights)
    python examples/bench_engine.py --quick               # smaller model and workload: a smoke run
    python examples/bench_engine.py --out engine.md       # also write the report to a file
    python examples/bench_engine.py --threads 1           # steadier figures on a machine shared with other jobs
    python examples/bench_engine.py --device cuda --dtype bfloat16 --model-size 1b  # on a GPU, the ~1B model
"""

from __future__ import annotations

from pagedcore.benchmarks import script_main


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the benchmark and print its markdown."""
    return script_main("engine", argv, __doc__ or "")


if __name__ == "__main__":
    raise SystemExit(main())
