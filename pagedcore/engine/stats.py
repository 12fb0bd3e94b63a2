"""The Engine's own counters: what only it sees (requests by outcome, tokens generated, busy time and the time of
each stage of the steps, the peak of the KV memory in use). :meth:`Engine.stats <pagedcore.engine.engine.Engine.stats>`
joins them with the scheduler's, the pool's (prefix lookups, the tiers below it) and the runner's figures.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["PHASES", "EngineCounters"]

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
