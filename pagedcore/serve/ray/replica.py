"""EngineReplica: one Engine, run by an :class:`~pagedcore.serve.loop.EngineLoop`, as a Ray Serve replica.

``build_app`` deploys it N times behind the ingress. Each call of :meth:`EngineReplica.generate` submits one request
to the replica's loop and streams the loop's events back (Ray Serve streams a generator's items to the caller); the
last item is a :class:`ReplicaReport` with the replica's statistics, which the ingress merges for ``/metrics`` (it
also polls :meth:`EngineReplica.stats` on every live replica). A caller that cancels the stream (the client left)
aborts the request, so its blocks go back before the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagedcore.cli.gc_heap import freeze_startup_heap

from ..loop import EngineLoop, Finished, LoopClosedError, LoopEvent, LoopStats, QueueFullError
from .model_spec import ModelSpec
from .routing import RoutedRequest

__all__ = ["EngineReplica", "ReplicaReport"]


@dataclass(frozen=True)
class ReplicaReport:
    """A replica's statistics, sent after each request's :class:`~pagedcore.serve.loop.Finished` and answering
    the ingress's polls; ``sequence`` numbers one replica's reports in the order it read them (newest highest).

    Example:
        >>> from pagedcore.adapters.transformers import EngineStats
        >>> stats = LoopStats(EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0, 0, 0.0), 0, 0, 0, 8, 0, 0)
        >>> ReplicaReport("r1", stats, 3).sequence
        3
    """

    replica: str
    stats: LoopStats
    sequence: int = 0


class EngineReplica:
    """An Engine on its own loop thread, for Ray Serve (``serve.deployment(EngineReplica)``).

    Args:
        model: the model to load.
        engine_kwargs: keyword arguments of :class:`~pagedcore.adapters.transformers.Engine` (``num_blocks``,
            ``block_size``, ``max_num_seqs``, ...).
        max_queue: requests that may wait in this replica before new ones are refused ("overloaded").

    Example:
        >>> from pagedcore.adapters.transformers import SamplingParams
        >>> from pagedcore.serve.loop import Submission
        >>> replica = EngineReplica(ModelSpec(builtin_overrides={"num_hidden_layers": 1, "hidden_size": 64,
        ...     "intermediate_size": 128}), {"num_blocks": 16, "block_size": 8})
        >>> async def run():
        ...     request = RoutedRequest(Submission([5, 6, 7], SamplingParams(max_new_tokens=3)))
        ...     return [item async for item in replica.generate(request)]
        >>> items = asyncio.run(run())
        >>> [type(item).__name__ for item in items][-2:], items[-2].completion_tokens
        (['Finished', 'ReplicaReport'], (3,))
        >>> replica.shutdown()
    """

    def __init__(self, model: ModelSpec, engine_kwargs: dict[str, Any] | None = None, max_queue: int = 512) -> None:
        from pagedcore.adapters.transformers import Engine

        loaded, tokenizer = model.load()
        self._engine = Engine(loaded, tokenizer, **(engine_kwargs or {}))
        self._loop = EngineLoop(self._engine, max_queue=max_queue)
        self._name = _replica_name()
        if self._name != "local":  # a Ray Serve replica's own process: its start-up heap, as `pagedcore serve` does
            frozen = freeze_startup_heap()
            if frozen is not None:
                print(f"pagedcore replica {self._name}: start-up heap frozen ({frozen} objects)", file=sys.stderr)
        self._loop.start()
        self._sequence = itertools.count(1)
        self._report_lock = threading.Lock()  # a number and a reading taken together keep their order

    @property
    def name(self) -> str:
        """The replica's Ray actor name (``SERVE_REPLICA::app#deployment#id``), or ``local`` outside Ray Serve."""
        return self._name

    async def generate(self, request: RoutedRequest) -> AsyncIterator[LoopEvent | ReplicaReport]:
        """The request's loop events (``Started``, ``Delta``..., ``Finished``), then a :class:`ReplicaReport`."""
        queue: asyncio.Queue[LoopEvent] = asyncio.Queue()
        aloop = asyncio.get_running_loop()

        def sink(event: LoopEvent) -> None:  # the loop thread
            aloop.call_soon_threadsafe(queue.put_nowait, event)

        try:
            [request_id] = self._loop.submit([request.submission], sink)
        except QueueFullError as exc:
            yield Finished("", 0, (), (), str(exc), "overloaded")
            return
        except LoopClosedError as exc:
            yield Finished("", 0, (), (), str(exc), "shutdown")
            return
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = isinstance(event, Finished)
                yield event
        finally:
            if not finished:  # the caller cancelled the stream: give the request's blocks back
                self._loop.abort(request_id)
        yield self.stats()

    def stats(self) -> ReplicaReport:
        """This replica's statistics now: its loop's snapshot, published after its latest step."""
        with self._report_lock:
            return ReplicaReport(self._name, self._loop.stats, next(self._sequence))

    def check_health(self) -> None:
        """Ray Serve's health check: raises when the loop thread is gone (Ray Serve then replaces the replica)."""
        if not self._loop.is_running:
            raise RuntimeError("the engine loop is not running")

    def shutdown(self) -> None:
        """Stop the loop (running requests end with an error) and give the model back its attention."""
        self._loop.stop()
        self._engine.close()

    def __del__(self) -> None:
        if hasattr(self, "_engine"):
            self.shutdown()


def _replica_name() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.to_full_id_str())
    except Exception:  # not in a Ray Serve replica
        return "local"
