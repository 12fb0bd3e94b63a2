"""The two ways a job is answered: one JSON body once every choice has ended (:func:`collect`), or server-sent
events as tokens come (:func:`sse_events` in a :class:`JobStream`). The answer's shapes are in
:mod:`pagedcore.serve.answers`.

Nothing here submits or parses: :mod:`pagedcore.serve.pipeline` hands a started :class:`~pagedcore.serve.jobs.Job`
to :func:`collect` or :func:`sse_events`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from .answers import Choice, Shape, Tally
from .jobs import Job, error_of
from .loop import Delta, Finished
from .protocol import ApiError

__all__ = ["JobStream", "collect", "sse_events"]


class JobStream(StreamingResponse):
    """Server-sent events of a job; whatever way the response ends (client gone included), the job's open
    requests are aborted (then ``on_abort`` is called) and ``on_close`` is called.

    Example:
        >>> async def nothing():
        ...     yield ""
        >>> stream = JobStream(nothing(), Job(loop=None), on_abort=lambda: None)
        >>> stream.media_type, stream.headers["cache-control"]
        ('text/event-stream', 'no-cache')
    """

    def __init__(
        self,
        content: AsyncIterator[str],
        job: Job,
        on_abort: Callable[[], None],
        on_close: Callable[[], None] = lambda: None,
    ) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._job = job
        self._on_abort = on_abort
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._job.abort():
                self._on_abort()
            self._on_close()


async def collect(request: Request, job: Job, tally: Tally) -> bool:
    """Read every event of ``job`` into ``tally``; returns False when the client left first (the caller aborts the
    job), raises the job's :class:`ApiError` when it failed.

    Example:
        >>> import inspect
        >>> inspect.iscoroutinefunction(collect)
        True
    """

    async def read() -> None:
        async for event in job.events():
            if isinstance(event, Finished) and event.error is not None:
                job.abort()
                raise error_of(event)
            tally.add(event)

    collector = asyncio.ensure_future(read())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not collector.done():
            collector.cancel()
    if not collector.done() or collector.cancelled():
        return False
    collector.result()  # raises the request's ApiError
    return True


async def sse_events(
    job: Job,
    tally: Tally,
    shape: Shape,
    *,
    on_error: Callable[[ApiError], ApiError],
    on_finish: Callable[[], None],
) -> AsyncIterator[str]:
    """The ``data:`` lines of a streamed answer, ending with ``data: [DONE]``. A choice's first chunk goes out with
    its first token (a chat choice's carries the role), never before; an empty token (a character or a possible
    stop string not yet complete) sends nothing unless token ids or log-probabilities are asked for. An error ends
    the stream with ``on_error(error)``'s body (the caller counts and redacts it) before ``[DONE]``; a stream that
    ends well calls ``on_finish()``.

    Example:
        >>> import inspect
        >>> inspect.isasyncgenfunction(sse_events)
        True
    """
    options = shape.options

    def data(payload: dict[str, Any]) -> str:
        if options.continuous_usage and payload["choices"]:  # the chunk's own choice's counts, as vLLM's
            payload["usage"] = tally.choice_usage(payload["choices"][0]["index"])
        elif options.include_usage and "usage" not in payload:
            payload["usage"] = None
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def chunk(index: int, delta: Delta | None) -> str:
        choice = tally.choices[index]
        if shape.tools is not None:
            payload = shape.tool_chunk(index, choice, choice.reason)
        else:
            text = "" if delta is None else delta.text
            if not choice.started:
                text = options.prefix(choice.prompt) + text
            reason = choice.reason if delta is None else delta.finish_reason
            logprobs = [delta.logprobs] if delta is not None and delta.logprobs is not None else []
            payload = shape.chunk(index, choice, text, reason, () if delta is None else delta.token_ids, logprobs)
            if not _shows(payload["choices"][0]):
                return ""  # e.g. a reasoning marker's first characters, held until it is complete
        choice.started = True
        choice.closed = payload["choices"][0]["finish_reason"] is not None
        return data(payload)

    async for event in job.events():
        if isinstance(event, Finished) and event.error is not None:
            job.abort()
            yield f"data: {json.dumps(on_error(error_of(event)).body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        for index in tally.add(event):
            if _due(shape, event, tally.choices[index]):
                line = chunk(index, event if isinstance(event, Delta) else None)
                if line:
                    yield line
    if options.include_usage:
        yield data(shape.usage_chunk(tally.usage()))
    yield "data: [DONE]\n\n"
    on_finish()


def _due(shape: Shape, event: Delta | Finished, choice: Choice) -> bool:
    """Whether ``event`` sends ``choice`` a chunk: with tools only its end (the answer goes out whole, as text or
    calls); else a token that shows something, and the end of a choice that ended without a token of its own
    (``max_tokens`` 0). A reasoning format of special tokens is fed every token (a marker adds no text)."""
    if shape.tools is not None:
        return not choice.closed and choice.reason is not None
    if isinstance(event, Delta):
        shows_tokens = shape.options.return_token_ids or shape.options.logprobs is not None
        shows_tokens = shows_tokens or (shape.reasoning is not None and shape.reasoning.reads_tokens)
        return bool(event.text or event.finish_reason or not choice.started or shows_tokens)
    return not choice.closed


def _shows(choice: dict[str, Any]) -> bool:
    """Whether a chat chunk's choice shows anything (a delta, an end, tokens or log-probabilities)."""
    shown = (choice.get("delta", True), choice["finish_reason"], choice.get("logprobs"), choice.get("token_ids"))
    return any(shown)


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body was read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
