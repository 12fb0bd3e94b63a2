"""What the benchmark tests share: a run's context on a given model, and a way to make a peer's tokens differ."""

from __future__ import annotations

from pagedcore.benchmarks import BenchOptions
from pagedcore.benchmarks.context import BenchContext


def ctx(model, quick: bool = True) -> BenchContext:
    """A run's context on ``model`` (the quick workloads unless ``quick=False``), without progress bars."""
    return BenchContext(BenchOptions(quick=quick, progress=False), model)


def wrong_tokens(tokens: list[int]) -> list[int]:
    """Other tokens than ``tokens``: what a peer that computed something else would return."""
    return [t + 1 for t in tokens]
