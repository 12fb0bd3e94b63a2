"""The answers of the generation endpoints: OpenAI's response and chunk shapes, the tally of a job's choices, and
the two ways a job is answered (one JSON body, or server-sent events).

Nothing here submits or parses: :mod:`pagedcore.serve.pipeline` hands a started :class:`~pagedcore.serve.jobs.Job`
to :func:`collect` or :func:`stream`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from .jobs import Job, error_of
from .loop import Delta, Finished
from .protocol import ApiError
from .tool_calls import ToolCalls

__all__ = ["JobStream", "Shape", "Tally", "collect", "sse_events"]


@dataclass(frozen=True)
class Shape:
    """How one endpoint names and shapes its responses.

    Example:
        >>> Shape(False, "cmpl-1", 0, "m").chunk(0, "Hi", None)["choices"]
        [{'index': 0, 'text': 'Hi', 'logprobs': None, 'finish_reason': None}]
    """

    chat: bool
    response_id: str
    created: int
    model: str
    tools: ToolCalls | None = None  # a chat with tools: answers that call them carry ``tool_calls``

    def chunk(self, index: int, text: str | None, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        """One streamed chunk of choice ``index``."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice.update(logprobs=None, finish_reason=finish_reason)
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def response(self, texts: list[str], reasons: list[str | None], usage: dict[str, Any]) -> dict[str, Any]:
        """The whole (not streamed) answer."""
        choices = []
        for index, (text, reason) in enumerate(zip(texts, reasons)):
            choice: dict[str, Any] = {"index": index}
            if self.chat:
                choice["message"], reason = self.message(text, reason)
            else:
                choice["text"] = text
            choice.update(logprobs=None, finish_reason=reason)
            choices.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage
        return body

    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A chat answer's message and finish reason: with tools, a finished answer that called them has
        ``tool_calls`` and the reason ``"tool_calls"`` (an answer cut by its length is left as text)."""
        if self.tools is None or reason != "stop":
            return {"role": "assistant", "content": text}, reason
        message = self.tools.message(text)
        return message, "tool_calls" if "tool_calls" in message else reason

    def tool_chunk(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        """The last chunk of a streamed chat answer with tools: its whole content or ``tool_calls`` in one delta
        (the text is held until the answer ends, to know which it is)."""
        message, reason = self.message(text, finish_reason)
        message.pop("role")
        if message.get("content") is None:
            message.pop("content")
        choice = {"index": index, "delta": message, "logprobs": None, "finish_reason": reason}
        return self._envelope("chat.completion.chunk", [choice])

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk of a stream with ``stream_options.include_usage``."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage
        return body

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


class Tally:
    """Texts, finish reasons and token counts of a job's choices (choice = prompt index * n + sample).

    Example:
        >>> tally = Tally(["r0"], n=1)
        >>> tally.add(Delta("r0", 0, "Hi", "length"))
        >>> tally.add(Finished("r0", 3, (1,), ("length",)))
        >>> tally.texts, tally.usage()["total_tokens"]
        (['Hi'], 4)
    """

    def __init__(self, request_ids: list[str], n: int) -> None:
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._n = n
        count = len(request_ids) * n
        self.texts = [""] * count
        self.reasons: list[str | None] = [None] * count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0

    def choice(self, event: Delta) -> int:
        """The choice index of a delta."""
        return self._index[event.request_id] * self._n + event.sample

    def add(self, event: Delta | Finished) -> None:
        """Count one event."""
        if isinstance(event, Delta):
            index = self.choice(event)
            self.texts[index] += event.text
            self.reasons[index] = event.finish_reason or self.reasons[index]
            return
        base = self._index[event.request_id] * self._n
        for sample, reason in enumerate(event.finish_reasons):
            self.reasons[base + sample] = self.reasons[base + sample] or reason
        self.prompt_tokens += event.prompt_tokens
        self.completion_tokens += sum(event.completion_tokens)
        self.cached_tokens += event.cached_tokens

    def usage(self) -> dict[str, Any]:
        """OpenAI's ``usage`` object."""
        total = self.prompt_tokens + self.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": total,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},  # OpenAI's field for prefix-cache hits
        }


class JobStream(StreamingResponse):
    """Server-sent events of a job; whatever way the response ends (client gone included), the job's open
    requests are aborted and ``on_abort`` is called.

    Example:
        >>> async def nothing():
        ...     yield ""
        >>> stream = JobStream(nothing(), Job(loop=None), on_abort=lambda: None)
        >>> stream.media_type, stream.headers["cache-control"]
        ('text/event-stream', 'no-cache')
    """

    def __init__(self, content: AsyncIterator[str], job: Job, on_abort: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._job = job
        self._on_abort = on_abort

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._job.abort():
                self._on_abort()


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
    include_usage: bool,
    *,
    on_error: Callable[[ApiError], ApiError],
    on_finish: Callable[[], None],
) -> AsyncIterator[str]:
    """The ``data:`` lines of a streamed answer, ending with ``data: [DONE]``. An error ends the stream with
    ``on_error(error)``'s body (the caller counts and redacts it) before ``[DONE]``; a stream that ends well calls
    ``on_finish()``.

    Example:
        >>> import inspect
        >>> inspect.isasyncgenfunction(sse_events)
        True
    """

    def data(payload: dict[str, Any]) -> str:
        if include_usage and "usage" not in payload:
            payload["usage"] = None
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    if shape.chat:
        for index in range(len(tally.texts)):
            yield data(shape.chunk(index, None, None, role=True))
    async for event in job.events():
        if isinstance(event, Finished) and event.error is not None:
            job.abort()
            yield f"data: {json.dumps(on_error(error_of(event)).body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        tally.add(event)
        if isinstance(event, Delta) and shape.tools is not None:
            if event.finish_reason is not None:  # a chat with tools: the answer goes out whole, as text or calls
                index = tally.choice(event)
                yield data(shape.tool_chunk(index, tally.texts[index], event.finish_reason))
        elif isinstance(event, Delta):
            yield data(shape.chunk(tally.choice(event), event.text, event.finish_reason))
    if include_usage:
        yield data(shape.usage_chunk(tally.usage()))
    yield "data: [DONE]\n\n"
    on_finish()


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body was read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
