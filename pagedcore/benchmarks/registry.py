"""The benchmarks ``pagedcore bench`` knows, in report order. A new benchmark is one module plus one line here.

A benchmark module has ``run(ctx: BenchContext) -> Reported``: it takes the run's options and shared model from the
:class:`~pagedcore.benchmarks.context.BenchContext` and returns a result that describes itself as one report
:class:`~pagedcore.benchmarks.report.Section` (its markdown, the panels it adds to the run's bar chart, its line
charts). Modules are imported only when their benchmark runs, so listing them imports nothing heavy.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .report import Reported

__all__ = ["BENCHMARKS", "Benchmark"]


@dataclass(frozen=True)
class Benchmark:
    """One registered benchmark.

    Attributes:
        name: what ``--only`` and ``run_one`` call it.
        module: its module in ``pagedcore.benchmarks`` (imported on first run).
        summary: one line for listings.
        uses_model: whether it runs the benchmark model (so it needs torch, a device and a dtype).
        chart_rank: where its section's ``panels`` go in the bar chart, lowest first (None: it has none).

    Example:
        >>> BENCHMARKS["core"].uses_model, BENCHMARKS["engine"].chart_rank
        (False, 0)
        >>> list(BENCHMARKS)
        ['prefix', 'cold', 'memory', 'engine', 'core', 'decode', 'chat', 'host', 'scaling', 'peers', 'hybrid']
    """

    name: str
    module: str
    summary: str
    uses_model: bool = True
    chart_rank: int | None = None

    def run(self, ctx: object) -> Reported:
        """Import the benchmark's module and run it with ``ctx`` (the run's
        :class:`~pagedcore.benchmarks.context.BenchContext`, handed on as it is)."""
        module = importlib.import_module(f"{__package__}.{self.module}")
        result: Reported = module.run(ctx)
        return result


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("prefix", "prefix", "shared system prompt: enable(model) vs plain generate", chart_rank=1),
        Benchmark("cold", "cold", "one sequence, no reuse: PagedCache vs DynamicCache"),
        Benchmark("memory", "memory", "KV bytes of a mixed-length batch: PagedCache vs DynamicCache, StaticCache"),
        Benchmark("engine", "engine", "continuous batching: Engine vs generate and transformers' own", chart_rank=0),
        Benchmark("core", "core", "plain-Python bookkeeping: blocks, prefix trie, scheduler step", uses_model=False),
        Benchmark("decode", "decode", "decode time per token against context: PagedCache vs Dynamic/StaticCache"),
        Benchmark("chat", "chat", "multi-turn chat: Engine (prefix cache across turns) vs the padded batch per turn"),
        Benchmark("host", "host", "host time per decode step outside the forward: Engine vs transformers' manager"),
        Benchmark("scaling", "scaling", "Engine throughput, host share and KV memory as requests and prompts grow"),
        Benchmark("peers", "native", "the native CPU engine: Engine vs CTranslate2 (fp32 tuned/default malloc, int8)"),
        Benchmark("hybrid", "hybrid", "a Qwen3.5-like hybrid model: multi-session chat, Engine vs the padded batch"),
    )
}
