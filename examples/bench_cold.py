"""Cold generation of one sequence: PagedCache vs DynamicCache (wall time, slowdown ratio).

Needs: the `transformers` extra (`make demo` installs it).

PagedCache in compatible mode (sdpa) and with attn_implementation="paged", against DynamicCache; 512-token
prompt, 256 new tokens, greedy; median of several rounds with the order rotating.

A thin wrapper over ``pagedcore.benchmarks`` (``pagedcore bench --only cold`` runs the same); prints the
markdown report.

Usage:
    python examples/bench_cold.py                         # full workload on the benchmark-sized Llama (random weights)
    python examples/bench_cold.py --quick                 # smaller model and workload: a smoke run
    python examples/bench_cold.py --out cold.md           # also write the report to a file
    python examples/bench_cold.py --threads 1             # steadier figures on a machine shared with other jobs
    python examples/bench_cold.py --device cuda --dtype bfloat16 --model-size 1b  # on a GPU, the ~1B model
"""

from __future__ import annotations

from pagedcore.benchmarks import script_main


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the benchmark and print its markdown."""
    return script_main("cold", argv, __doc__ or "")


if __name__ == "__main__":
    raise SystemExit(main())
