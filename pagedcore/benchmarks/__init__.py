"""pagedcore's benchmarks: ``pagedcore bench`` and ``examples/bench_*.py`` run them.

Each benchmark is one module, registered in :mod:`~pagedcore.benchmarks.registry` (report order), whose
``run(ctx)`` is its workload and nothing else: it takes the run's model, quick setting and seed from the
:class:`~pagedcore.benchmarks.context.BenchContext`, times its variants with the one runner, serves its requests
with the one peers module, and returns a result that describes itself in the one report shape:

- :mod:`~pagedcore.benchmarks.prefix`: a long shared system prompt + many questions, ``enable(model)`` vs plain
  ``generate``.
- :mod:`~pagedcore.benchmarks.cold`: one sequence without reuse, ``PagedCache`` (sdpa and paged attention) vs
  ``DynamicCache``.
- :mod:`~pagedcore.benchmarks.memory`: KV bytes reserved per byte of real tokens for a mixed-length padded batch.
- :mod:`~pagedcore.benchmarks.engine`: many requests sharing a prefix, the ``Engine`` vs ``generate`` one at a time,
  the padded batch and transformers' continuous batching.
- :mod:`~pagedcore.benchmarks.core`: the plain-Python bookkeeping (blocks, prefix trie, one scheduler step).
- :mod:`~pagedcore.benchmarks.decode`: decode time per token against context length, ``PagedCache`` (both attention
  paths) vs ``DynamicCache`` and ``StaticCache``, on the run's model and a narrower-headed one.
- :mod:`~pagedcore.benchmarks.chat`: multi-turn chat, the ``Engine`` (prefix cache across turns) vs the padded batch.
- :mod:`~pagedcore.benchmarks.host`: host time per decode step outside the forward, the ``Engine`` vs transformers'
  continuous batching, 1-256 sequences at contexts 512 and 4k.
- :mod:`~pagedcore.benchmarks.scaling`: the ``Engine``'s throughput, host share and KV memory as requests and prompts
  grow, next to the compute floor.

Shared: :mod:`~pagedcore.benchmarks.runner` (how a benchmark is timed: the clock, token stamps, warm-ups, rotating
rounds, medians, threads, progress), :mod:`~pagedcore.benchmarks.peers` (every peer run side by side, each a small
adapter: ``generate`` with each cache, one at a time, the padded batch, transformers' continuous batching, the
Engine; and the equality check of their outputs), :mod:`~pagedcore.benchmarks.report` (the report shape:
``Section``, tables, aims, the machine), :mod:`~pagedcore.benchmarks.options` (what a run is asked for),
:mod:`~pagedcore.benchmarks.context` (its device, dtype and shared model), :mod:`~pagedcore.cli.devices`,
:mod:`~pagedcore.benchmarks.common` (model, workloads, ``generate``), :mod:`~pagedcore.benchmarks.floor` (the
compute floor: FLOPs at the measured matmul rate), :mod:`~pagedcore.benchmarks.steps` (forward and host time of a
serving loop's steps, from model hooks), :mod:`~pagedcore.benchmarks.chart` (the bar chart) and
:mod:`~pagedcore.benchmarks.plots` (line charts), :mod:`~pagedcore.benchmarks.suite` (run the benchmarks, write
``results.md``, ``engine.png`` and the line charts) and :mod:`~pagedcore.benchmarks.profiles` (the profiling
scenarios).

Every model benchmark runs its peers side by side in one process, on the same model, and reports ratios next to
their aims. Timings are wall-clock (``time.perf_counter``, after waiting for the GPU when there is one) on whatever
else the machine is doing: compare figures measured on a quiet machine only. Each benchmark warms its code paths up
before timing. Importing this package imports neither torch nor transformers; the benchmark modules do.

Example:
    >>> from pagedcore.benchmarks import BENCHMARKS, BenchOptions
    >>> list(BENCHMARKS)
    ['prefix', 'cold', 'memory', 'engine', 'core', 'decode', 'chat', 'host', 'scaling', 'peers', 'hybrid']
    >>> BenchOptions(only=("core",)).needs_torch
    False
"""

from __future__ import annotations

from .options import BenchOptions
from .registry import BENCHMARKS, Benchmark
from .suite import run_all, run_benchmarks, run_one, script_main

__all__ = ["BENCHMARKS", "BenchOptions", "Benchmark", "run_all", "run_benchmarks", "run_one", "script_main"]
