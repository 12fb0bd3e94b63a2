"""One HTTP request's engine requests, seen from the server's event loop.

The :class:`~pagedcore.serve.loop.EngineLoop` calls a job's sink on its own thread; the sink hands each event to
the event loop with ``call_soon_threadsafe``, onto an asyncio queue that the request handler reads.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

from .loop import (
    Delta,
    Finished,
    LoopClosedError,
    LoopEvent,
    QueueFullError,
    Request,
    RequestLoop,
    Started,
)
from .protocol import ApiError, engine_error

__all__ = ["Job", "error_of"]

_ERRORS = {
    # error_kind -> (HTTP status, OpenAI error type, code)
    "invalid": (400, "invalid_request_error", None),
    "failed": (500, "server_error", "engine_error"),
    "shutdown": (503, "server_error", "shutting_down"),
    "aborted": (500, "server_error", "aborted"),
    "overloaded": (429, "rate_limit_error", "queue_full"),
}


def error_of(finished: Finished) -> ApiError:
    """The :class:`ApiError` that answers a request that ended with an error.

    Example:
        >>> error = error_of(Finished("r0", 0, (), (), "the prompt is empty", "invalid", error_param="prompt"))
        >>> error.status, error.param
        (400, 'prompt')
    """
    status, type_, code = _ERRORS.get(finished.error_kind or "failed", _ERRORS["failed"])
    message = finished.error or "the request failed"
    if finished.error_kind == "invalid":  # the engine refused it: its error names the field
        return engine_error(message, finished.error_param, status, type=type_, code=code)
    return ApiError(status, message, type=type_, code=code)


class Job:
    """The engine requests of one HTTP request (one per prompt), and their events in arrival order.

    Args:
        loop: the engine loop (or any :class:`~pagedcore.serve.loop.RequestLoop`).
        on_finished: called with each request's :class:`Finished` as the loop sends it (on the loop's thread),
            whether or not anyone still reads the job's events (the metrics count a request the client left).

    Call :meth:`start` (inside a running event loop), then iterate :meth:`events`; :meth:`abort` in a
    ``finally`` gives back the blocks of whatever is still running (e.g. when the client leaves).

    Example:
        >>> import asyncio
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import Engine, SamplingParams
        >>> from pagedcore.serve.loop import EngineLoop
        >>> model = tiny_llama(num_hidden_layers=1)
        >>> async def run(loop):
        ...     job = Job(loop)
        ...     await job.start([Request([1, 2, 3], SamplingParams(max_new_tokens=2))])
        ...     return [type(event).__name__ async for event in job.events()]
        >>> with Engine(model, num_blocks=16, block_size=8) as engine:
        ...     loop = EngineLoop(engine)
        ...     loop.start()
        ...     names = asyncio.run(run(loop))
        ...     loop.stop()
        >>> names[-1]
        'Finished'
    """

    def __init__(self, loop: RequestLoop, on_finished: Callable[[Finished], None] | None = None) -> None:
        self._loop = loop
        self._on_finished = on_finished
        self._queue: asyncio.Queue[LoopEvent] = asyncio.Queue()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._backlog: deque[LoopEvent] = deque()
        self.request_ids: list[str] = []
        self._open: set[str] = set()
        self._accepted: set[str] = set()
        self._grammar_fields: dict[str, str] = {}  # request id -> the request field its grammar came from

    @property
    def is_open(self) -> bool:
        """Whether some of its engine requests have not ended yet."""
        return bool(self._open)

    async def start(self, requests: Sequence[Request]) -> None:
        """Queue the requests and wait until the engine accepted every one of them. Raises :class:`ApiError`:
        429 when the queue is full, 503 when the server is stopping, and the error of the first request the
        engine refused (the others are aborted)."""
        self._aloop = asyncio.get_running_loop()
        try:
            self.request_ids = self._loop.submit(requests, self._sink)
        except QueueFullError as exc:
            raise ApiError(429, str(exc), type="rate_limit_error", code="queue_full") from exc
        except LoopClosedError as exc:
            raise ApiError(503, str(exc), type="server_error", code="shutting_down") from exc
        self._open = set(self.request_ids)
        for request_id, request in zip(self.request_ids, requests):
            source = getattr(request.params.structured, "source", None)  # set by the server: the grammar's field
            if source is not None:
                self._grammar_fields[request_id] = source
        waiting = set(self.request_ids)
        while waiting:
            event = self._named(await self._queue.get())
            if isinstance(event, Finished) and event.error is not None:
                self._open.discard(event.request_id)
                self.abort()
                raise error_of(event)
            if isinstance(event, Started):
                self._accepted.add(event.request_id)
            if isinstance(event, (Started, Finished)):
                waiting.discard(event.request_id)
            if not isinstance(event, Started):
                self._backlog.append(event)

    async def events(self) -> AsyncIterator[Delta | Finished]:
        """Every :class:`Delta` and :class:`Finished` until each request has ended."""
        while self._open:
            event = self._named(self._backlog.popleft() if self._backlog else await self._queue.get())
            if isinstance(event, Started):
                continue
            if isinstance(event, Finished):
                self._open.discard(event.request_id)
            yield event

    def abort(self) -> bool:
        """Abort the requests that have not ended; returns whether there were any."""
        for request_id in self._open:
            self._loop.abort(request_id)
        had = bool(self._open)
        self._open.clear()
        return had

    def _named(self, event: LoopEvent) -> LoopEvent:
        """A grammar's failure as the error of the request field the grammar came from (its spec's ``source``):
        the engine's error about its ``structured`` parameter, or a client error after the engine accepted the
        request, which only the request's grammar makes (the server refuses ``allowed_token_ids`` with one)."""
        if not isinstance(event, Finished) or event.error_kind != "invalid":
            return event
        field = self._grammar_fields.get(event.request_id)
        ours = event.error_param == "structured" or (event.error_param is None and event.request_id in self._accepted)
        return replace(event, error_param=field) if field is not None and ours else event

    def _sink(self, event: LoopEvent) -> None:  # the loop thread
        assert self._aloop is not None
        if isinstance(event, Finished) and self._on_finished is not None:
            self._on_finished(event)
        self._aloop.call_soon_threadsafe(self._queue.put_nowait, event)
