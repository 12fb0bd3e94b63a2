"""KV memory of a mixed-length, left-padded batch: bytes reserved per byte of real tokens.

Needs: the `transformers` extra (`make demo` installs it).

PagedCache (blocks held) against DynamicCache (padded tensors) and StaticCache (preallocated tensors).

A thin wrapper over ``pagedcore.benchmarks`` (``pagedcore bench --only memory`` runs the same); prints the
markdown report.

Usage:
    python examples/bench_memory.py                       # full workload on the benchmark-sized Llama (random weights)
    python examples/bench_memory.py --quick               # smaller model and workload: a smoke run
    python examples/bench_memory.py --out memory.md       # also write the report to a file
    python examples/bench_memory.py --threads 1           # steadier figures on a machine shared with other jobs
    python examples/bench_memory.py --device cuda --dtype bfloat16 --model-size 1b  # on a GPU, the ~1B model
"""

from __future__ import annotations

from pagedcore.benchmarks import script_main


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the benchmark and print its markdown."""
    return script_main("memory", argv, __doc__ or "")


if __name__ == "__main__":
    raise SystemExit(main())
