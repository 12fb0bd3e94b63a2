"""ReplicaStats: the ingress's view of its engine replicas' statistics, which its ``/metrics`` exports.

Reports come from two places: the :class:`~pagedcore.serve.ray.replica.ReplicaReport` a replica sends at the end of
each request's stream, and the ingress's poll of every live replica (Ray Serve's ``broadcast``, every
``stats_interval`` seconds, see :class:`~pagedcore.serve.ray.replica_loop.ReplicaLoop`). A replica numbers its
reports, so its newest one wins whatever order they arrive in, and a poll that follows a request's end carries the
loop's statistics published after the step that finished it.

Live replicas are those that answered the last poll (or reported since). Gauges (KV blocks in the pool and in use,
KV usage and bytes, waiting and running requests) are summed over live replicas only: a replica that died or was
replaced stops counting at the next poll. Counters (requests, tokens, steps, preemptions, failed steps, seconds)
keep what every replica counted, departed ones included, so they never go down (Prometheus reads a decrease as a
restart). At most ``MAX_DEPARTED`` departed replicas are kept by name; older ones are folded into one total.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import MISSING, fields, replace
from typing import Any

from ..loop import LoopStats
from .replica import ReplicaReport

__all__ = ["MAX_DEPARTED", "ReplicaStats", "counters_only", "merge_stats", "zero_stats"]

MAX_DEPARTED = 64
_ENGINE_GAUGES = frozenset({"kv_usage", "kv_used_bytes", "kv_peak_used_bytes", "kv_store_bytes"})
_LOOP_GAUGES = frozenset({"num_waiting", "num_running", "num_used_blocks", "num_blocks"})


def merge_stats(reports: Sequence[LoopStats]) -> LoopStats | None:
    """The sum of several loops' statistics (KV usage: the highest), or None without any.

    Example:
        >>> from pagedcore.adapters.transformers import EngineStats
        >>> one = LoopStats(EngineStats(2, 2, 0, 0, 5, 0, 64, 48, 16, 8, 0.5, 0, 0, 0.1), 0, 1, 4, 32, 24, 0)
        >>> two = LoopStats(EngineStats(1, 1, 0, 0, 3, 0, 32, 0, 32, 4, 0.25, 0, 0, 0.1), 1, 0, 2, 32, 12, 0)
        >>> merged = merge_stats([one, two])
        >>> merged.engine.prefix_hit_rate, merged.engine.kv_usage, merged.num_blocks
        (0.5, 0.5, 64)
    """
    if not reports:
        return None
    engine_type = type(reports[0].engine)
    engine = {}
    for item in fields(engine_type):
        values = [getattr(r.engine, item.name) for r in reports]
        engine[item.name] = max(values) if item.name == "kv_usage" else _sum(values)
    counts = {f.name: sum(getattr(r, f.name) for r in reports) for f in fields(LoopStats) if f.name != "engine"}
    return LoopStats(engine=engine_type(**engine), **counts)


def zero_stats() -> LoopStats:
    """Statistics of no replica: every figure 0.

    Example:
        >>> zero_stats().num_blocks, zero_stats().engine.generated_tokens
        (0, 0)
    """
    from pagedcore.adapters.transformers import EngineStats

    zeros: dict[str, Any] = {f.name: 0 for f in fields(EngineStats) if f.default_factory is MISSING}
    engine = EngineStats(**zeros)
    return LoopStats(engine, **{f.name: 0 for f in fields(LoopStats) if f.name != "engine"})


def counters_only(stats: LoopStats) -> LoopStats:
    """``stats`` with its gauges at 0: what a replica that left still contributes.

    Example:
        >>> stats = replace(zero_stats(), num_blocks=64, num_prompt_tokens=9)
        >>> counters_only(stats).num_blocks, counters_only(stats).num_prompt_tokens
        (0, 9)
    """
    engine = replace(stats.engine, **{name: _zero(getattr(stats.engine, name)) for name in _ENGINE_GAUGES})
    return replace(stats, engine=engine, **{name: 0 for name in _LOOP_GAUGES})


def _sum(values: list[Any]) -> Any:
    """Numbers add up; per-name counts (the tiers below each pool) add up name by name."""
    if values and isinstance(values[0], dict):
        merged: dict[str, Any] = {}
        for value in values:
            for name, count in value.items():
                merged[name] = merged.get(name, 0) + count
        return merged
    return sum(values)


def _zero(value: Any) -> Any:
    return {} if isinstance(value, dict) else 0


class ReplicaStats:
    """Each replica's newest report; gauges over live replicas, counters over all (see the module docstring).

    Example:
        >>> one = replace(zero_stats(), num_blocks=64, num_prompt_tokens=10)
        >>> table = ReplicaStats()
        >>> table.record(ReplicaReport("r1", one, 1))
        >>> table.record_poll([ReplicaReport("r2", one, 1)])  # r1 did not answer: it is gone
        >>> merged = table.merged()
        >>> merged.num_blocks, merged.num_prompt_tokens, sorted(table.live)
        (64, 20, ['r2'])
    """

    def __init__(self) -> None:
        self._newest: dict[str, ReplicaReport] = {}
        self._live: set[str] = set()
        self._departed: OrderedDict[str, None] = OrderedDict()  # oldest departure first
        self._folded: LoopStats | None = None  # counters of departed replicas no longer kept by name

    @property
    def live(self) -> frozenset[str]:
        """The replicas whose gauges count."""
        return frozenset(self._live)

    def record(self, report: ReplicaReport) -> None:
        """A replica's report: kept if it is that replica's newest; the replica counts as live."""
        current = self._newest.get(report.replica)
        if current is not None and current.sequence > report.sequence:
            return
        self._newest[report.replica] = report
        self._live.add(report.replica)
        self._departed.pop(report.replica, None)

    def record_poll(self, reports: Iterable[ReplicaReport]) -> None:
        """A poll's answers: the replicas that answered are the live ones; the others leave (their counters stay)."""
        answered = set()
        for report in reports:
            self.record(report)
            answered.add(report.replica)
        for name in sorted(self._live - answered):
            self._live.discard(name)
            self._departed[name] = None
        while len(self._departed) > MAX_DEPARTED:
            name, _ = self._departed.popitem(last=False)
            gone = counters_only(self._newest.pop(name).stats)
            self._folded = gone if self._folded is None else merge_stats([self._folded, gone])

    def merged(self) -> LoopStats | None:
        """The live replicas' figures plus the departed replicas' counters; None before any report."""
        parts = [self._newest[name].stats for name in sorted(self._live)]
        parts += [counters_only(self._newest[name].stats) for name in self._departed]
        if self._folded is not None:
            parts.append(self._folded)
        return merge_stats(parts)
