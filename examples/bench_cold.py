"""Cold generation of one sequence: PagedCache vs DynamicCache (wall time, slowdown ratio).

PagedCache in compatible mode (sdpa) and with attn_implementation="paged", against DynamicCache; 512-token
prompt, 256 new tokens, greedy; median of several rounds with the order rotating.

A thin wrapper over ``pagedcore.adapters.transformers.benchmarks``; prints the markdown report.

Usage:
    python examples/bench_cold.py                         # full workload on the benchmark-sized Llama (random weights)
    python examples/bench_cold.py --quick                 # smaller model and workload: a smoke run
    python examples/bench_cold.py --out cold.md           # also write the report to a file
    python examples/bench_cold.py --threads 1             # steadier figures on a machine shared with other jobs
"""

from __future__ import annotations

from pagedcore.adapters.transformers.benchmarks import script_main


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the benchmark and print its markdown."""
    return script_main("cold", argv, __doc__ or "")


if __name__ == "__main__":
    raise SystemExit(main())
