"""Timing a serving loop's steps from outside: when each model forward started and ended, how many positions it
computed and from which position on. What a loop does between two forwards (sampling, bookkeeping, scheduling,
packing the next batch) is its host work per step; neither the Engine nor transformers' continuous batching report
it, so it is read here from the gaps between forwards.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedcore.adapters.transformers.hook_ids import transparent_hook

__all__ = ["Forward", "ForwardLog", "StepTimes", "forward_edges", "logging_forwards"]


@dataclass(frozen=True)
class Forward:
    """One model forward: start and end (``time.perf_counter``), positions computed, the smallest position.

    Example:
        >>> Forward(start=1.0, end=1.25, tokens=64, first_position=512).seconds
        0.25
    """

    start: float
    end: float
    tokens: int
    first_position: int

    @property
    def seconds(self) -> float:
        """Its duration."""
        return self.end - self.start


@dataclass(frozen=True)
class StepTimes:
    """Per step of a run of consecutive decode steps: forward seconds and host seconds (from the end of the step's
    forward to the start of the next one's).

    Example:
        >>> times = StepTimes(forward=[0.010, 0.012, 0.011], host=[0.001, 0.003, 0.002])
        >>> times.host_ms, times.forward_ms, round(times.host_share, 3)
        (2.0, 11.0, 0.154)
    """

    forward: list[float]
    host: list[float]
    stages: dict[str, list[float]] = field(default_factory=dict)  # per step, seconds in each Engine stage

    def stage_ms(self, name: str) -> float:
        """Median milliseconds per step in one of the Engine's stages (``Engine.stage_seconds``)."""
        return 1000 * statistics.median(self.stages[name])

    @property
    def stages_host_ms(self) -> float:
        """Median milliseconds per step in the Engine's host stages (all but ``forward``)."""
        per_step = [sum(values) for values in zip(*(v for k, v in self.stages.items() if k != "forward"))]
        return 1000 * statistics.median(per_step)

    @property
    def steps(self) -> int:
        """Steps timed."""
        return len(self.host)

    @property
    def host_ms(self) -> float:
        """Median host milliseconds per step."""
        return 1000 * statistics.median(self.host)

    @property
    def forward_ms(self) -> float:
        """Median forward milliseconds per step."""
        return 1000 * statistics.median(self.forward)

    @property
    def host_share(self) -> float:
        """Host time / (host + forward time), over the steps."""
        host = sum(self.host)
        return host / (host + sum(self.forward))


class ForwardLog:
    """Records every forward of a model (any thread): hooks on the modules each forward calls first and last
    (:func:`forward_edges`).

    Example:
        >>> from pagedcore.benchmarks.common import bench_model
        >>> model = bench_model(size="tiny")
        >>> with logging_forwards(model) as log, torch.inference_mode():
        ...     _ = model(torch.tensor([[5, 6, 7]]))
        ...     _ = model(torch.tensor([[8]]), position_ids=torch.tensor([[3]]))
        >>> [(f.tokens, f.first_position) for f in log.forwards]
        [(3, 0), (1, 3)]
        >>> log.busy_seconds() > 0
        True
    """

    def __init__(self, model: Any) -> None:
        self.forwards: list[Forward] = []
        self._open: tuple[float, int, int] | None = None
        first, last, positions = forward_edges(model)
        self._handles = [
            first.register_forward_pre_hook(self._before, with_kwargs=True),
            last.register_forward_hook(self._after, with_kwargs=True),
        ]
        if positions is not first:
            self._handles.append(positions.register_forward_pre_hook(self._positions, with_kwargs=True))

    @transparent_hook  # timers: not a change of the model (the prefix cache keeps its prefixes)
    def _before(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        tokens = int(ids.numel()) if isinstance(ids, torch.Tensor) else 0
        self._open = (time.perf_counter(), tokens, 0)
        self._positions(module, args[1:], kwargs)

    @transparent_hook
    def _positions(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        positions = kwargs.get("position_ids", args[0] if args else None)
        if self._open is not None and isinstance(positions, torch.Tensor) and positions.numel():
            self._open = (self._open[0], self._open[1], int(positions.min()))

    @transparent_hook
    def _after(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if self._open is not None:
            start, tokens, first = self._open
            self.forwards.append(Forward(start, time.perf_counter(), tokens, first))
            self._open = None

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()

    def clear(self) -> None:
        """Forget the forwards recorded so far."""
        self.forwards.clear()

    def busy_seconds(self) -> float:
        """Total seconds spent inside forwards."""
        return sum(f.seconds for f in self.forwards)

    def decode_steps(
        self, num_seqs: int, from_position: int, skip: int = 0, stages: list[dict[str, float]] | None = None
    ) -> StepTimes:
        """The forwards that each computed exactly ``num_seqs`` positions, all at or after ``from_position`` (a
        decode step of every sequence, no prefill in it), and were followed by another such forward; the first
        ``skip`` of them are left out (warm-up). Host time = the gap to the next such forward. ``stages``: per
        forward, the seconds of each stage of the step that ran it (e.g. the Engine's), kept for the same steps."""
        decode = [f.tokens == num_seqs and f.first_position >= from_position for f in self.forwards]
        forward: list[float] = []
        host: list[float] = []
        kept: dict[str, list[float]] = {}
        for i in range(len(self.forwards) - 1):
            if decode[i] and decode[i + 1]:
                forward.append(self.forwards[i].seconds)
                host.append(self.forwards[i + 1].start - self.forwards[i].end)
                for name, seconds in (stages[i] if stages is not None else {}).items():
                    kept.setdefault(name, []).append(seconds)
        return StepTimes(forward[skip:], host[skip:], {name: values[skip:] for name, values in kept.items()})


def forward_edges(model: Any) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """The modules a forward of ``model`` calls first and last, and the one handed its ``position_ids``: its input
    embedding, its head and its base model's rotary embedding; the model itself where it has none of them. The hooks
    that time and count forwards go there, not on the model: a hook on the model itself makes an Engine run the
    model's own forward rather than its direct layers (``adapters/transformers/direct_layers.py``), which would
    change what is measured. So a forward here runs from the embedding's call to the head's end (the model's call
    and its output wrapping, around them, count as the loop's).

    Example:
        >>> from pagedcore.benchmarks.common import bench_model
        >>> model = bench_model(size="tiny")
        >>> [type(m).__name__ for m in forward_edges(model)]
        ['Embedding', 'Linear', 'LlamaRotaryEmbedding']
    """
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if not isinstance(embeddings, torch.nn.Module) or not isinstance(head, torch.nn.Module):
        return model, model, model
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    return embeddings, head, rotary if isinstance(rotary, torch.nn.Module) else model


@contextlib.contextmanager
def logging_forwards(model: Any) -> Iterator[ForwardLog]:
    """A :class:`ForwardLog` on ``model`` for the block (its hooks removed afterwards).

    Example:
        >>> from pagedcore.benchmarks.common import bench_model
        >>> model = bench_model(size="tiny")
        >>> with logging_forwards(model) as log, torch.inference_mode():
        ...     _ = model(torch.tensor([[5, 6]]))
        >>> with torch.inference_mode():
        ...     _ = model(torch.tensor([[7]]))   # after the block: not recorded
        >>> len(log.forwards)
        1
    """
    log = ForwardLog(model)
    try:
        yield log
    finally:
        log.close()
