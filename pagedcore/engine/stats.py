"""The Engine's own counters: what only it sees (requests by outcome, tokens generated, busy time and the time of
each stage of the steps, the peak of the KV memory in use). :meth:`Engine.stats <pagedcore.engine.engine.Engine.stats>`
joins them with the scheduler's, the pool's (prefix lookups, the tiers below it) and the runner's figures.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pagedcore.kv_pool import KVPool
from pagedcore.kv_tiers import TierStats

from .outputs import EngineStats

__all__ = ["PHASES", "EngineCounters", "engine_stats"]

PHASES = ("schedule", "prepare", "forward", "sample", "record")
"""The stages of a step, timed in :class:`~.outputs.EngineStats`."""

_OUTCOMES = ("finished", "aborted", "failed")


@dataclass
class EngineCounters:
    """What the Engine counts (change it under the Engine's lock; the stage times from the stepping thread).

    Example:
        >>> counters = EngineCounters()
        >>> with counters.timed("forward"):
        ...     pass
        >>> counters.count("finished"); counters.requests, counters.outcomes["finished"]
        (0, 1)
    """

    requests: int = 0
    generated: int = 0
    peak_bytes: int = 0
    busy: float = 0.0
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_OUTCOMES, 0))
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def count(self, outcome: str) -> None:
        """One request ended: ``"finished"``, ``"aborted"`` or ``"failed"``."""
        self.outcomes[outcome] += 1

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the block's wall time to the stage ``phase``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phases[phase] += time.perf_counter() - started


def engine_stats(counters: EngineCounters, sched: Any, kv: KVPool, runner: Any) -> EngineStats:
    """The Engine's :class:`~.outputs.EngineStats`: its counters joined with the scheduler's (``sched``: its
    ``stats``), the pool's and the runner's (:class:`~.runner.RunnerStats`). Call it under the Engine's lock.

    Example:
        >>> from pagedcore.adapters.transformers import Engine
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> with Engine(tiny_llama(), num_blocks=16, block_size=4) as engine:
        ...     stats = engine_stats(EngineCounters(), engine.scheduler.stats, engine.runner.kv, engine.runner.stats())
        >>> stats.num_requests, stats.kv_usage
        (0, 0.0)
    """
    counts = runner.compile
    phases: dict[str, Any] = {f"{phase}_seconds": seconds for phase, seconds in counters.phases.items()}
    return EngineStats(
        num_requests=counters.requests,
        num_finished=counters.outcomes["finished"],
        num_aborted=counters.outcomes["aborted"],
        num_failed=counters.outcomes["failed"],
        num_steps=sched.num_steps,
        num_preemptions=sched.num_preemptions,
        prefix_query_tokens=kv.num_query_tokens,
        prefix_hit_tokens=kv.num_hit_tokens,
        prompt_tokens_computed=sched.num_prompt_tokens_computed,
        generated_tokens=counters.generated,
        kv_usage=kv.usage,
        kv_used_bytes=runner.used_bytes,
        kv_peak_used_bytes=counters.peak_bytes,
        busy_seconds=counters.busy,
        kernel_failures=runner.kernel_failures,
        **phases,
        compiled_steps=counts.steps,
        compiled_graphs=counts.graphs,
        compiled_buckets=counts.buckets,
        compile_failures=counts.failures,
        **_store_fields(None if kv.tiers is None else kv.tiers.stats()),
    )


def _store_fields(tiers: TierStats | None) -> dict[str, Any]:
    """The :class:`~.outputs.EngineStats` fields of the tiers below the pool (none without them)."""
    if tiers is None:
        return {}
    return {
        "kv_store_loaded_blocks": tiers.blocks_loaded,
        "kv_store_loaded_tokens": tiers.tokens_loaded,
        "kv_store_written_blocks": tiers.blocks_written,
        "kv_store_load_seconds": tiers.load_seconds,
        "kv_store_write_seconds": tiers.write_seconds,
        "kv_store_writes_skipped": tiers.writes_skipped,
        "kv_store_write_failures": tiers.write_failures,
        "kv_store_refused": {
            "checksum": tiers.refused_checksum,
            "fingerprint": tiers.refused_fingerprint,
            "foreign": tiers.refused_foreign,
            "file": sum(store.get("refused_files", 0) for store in tiers.stores.values()),
        },
        "kv_store_hits": {name: s["hits"] for name, s in tiers.stores.items()},
        "kv_store_bytes": {name: s["bytes"] for name, s in tiers.stores.items()},
    }
