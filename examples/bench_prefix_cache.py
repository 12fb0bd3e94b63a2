"""Prefix caching for plain generate: a shared system prompt followed by many questions.

Needs: the `transformers` extra (`make demo` installs it).

generate with enable(model) against plain generate with a DynamicCache: time to first token, total time,
prefill tokens computed against the unique tokens, and whether the greedy outputs are identical.

A thin wrapper over ``pagedcore.benchmarks`` (``pagedcore bench --only prefix`` runs the same); prints the
markdown report.

Usage:
    python examples/bench_prefix_cache.py                 # full workload on the benchmark-sized Llama (random weights)
    python examples/bench_prefix_cache.py --quick         # smaller model and workload: a smoke run
    python examples/bench_prefix_cache.py --out prefix.md  # also write the report to a file
    python examples/bench_prefix_cache.py --threads 1     # steadier figures on a machine shared with other jobs
    python examples/bench_prefix_cache.py --device cuda --dtype bfloat16 --model-size 1b  # on a GPU, the ~1B model
"""

from __future__ import annotations

from pagedcore.benchmarks import script_main


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the benchmark and print its markdown."""
    return script_main("prefix", argv, __doc__ or "")


if __name__ == "__main__":
    raise SystemExit(main())
