"""The request plumbing every generation endpoint shares: authorize, read the body (bounded), parse it, encode the
prompts, submit, then stream or collect the answer.

Parsing and tokenizing run in a worker thread (:func:`off_loop`), never on the event loop (other clients' streams
go on meanwhile) nor on the engine's step loop (the engine receives token ids).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedcore.adapters.transformers import SamplingParams

from .body import read_body
from .context import ServeContext
from .errors import outcome, public_error
from .jobs import Job
from .loop import Submission
from .protocol import ApiError, parse_request, stop_strings
from .responses import JobStream, Shape, Tally, collect, sse_events

__all__ = ["Generation", "answer", "off_loop", "read_request"]

T = TypeVar("T")


async def off_loop(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``function(*args, **kwargs)`` in a worker thread (for parsing and tokenizing).

    Example:
        >>> import asyncio
        >>> asyncio.run(off_loop(sum, [1, 2, 3]))
        6
    """
    return await run_in_threadpool(functools.partial(function, *args, **kwargs))


async def read_request(ctx: ServeContext, request: Request, cls: type[Any]) -> tuple[str | None, Any]:
    """Authorize ``request``, read its body within the limits, parse it as ``cls`` off the event loop and check
    its model; returns ``(tenant, body)`` or raises :class:`ApiError`.

    Example:
        >>> import inspect
        >>> list(inspect.signature(read_request).parameters)
        ['ctx', 'request', 'cls']
    """
    tenant = ctx.authorize(request)
    raw = await read_body(request, ctx.limits)
    body = await off_loop(parse_request, cls, raw, max_prompt_tokens=ctx.context_length)
    ctx.check_model(body.model)
    return tenant, body


@dataclass(frozen=True)
class Generation:
    """What one generation request asks of the engine.

    Attributes:
        prompts: token ids (or texts, when the server has no tokenizer), one per prompt.
        params: the sampling parameters of each prompt (stop strings included: stopping is the Engine's).
        tenant: the prefix-cache namespace.
        stream: answer with server-sent events.
        include_usage: end a stream with a usage chunk.

    Example:
        >>> from pagedcore.serve.protocol import CompletionRequest
        >>> body = CompletionRequest.model_validate({"model": "m", "prompt": "x", "stop": "\\n", "stream": True})
        >>> Generation.of(body, [[5]], SamplingParams(), None).params.stop_strings
        ('\\n',)
    """

    prompts: Sequence[str | Sequence[int]]
    params: SamplingParams
    tenant: str | None
    stream: bool = False
    include_usage: bool = False

    @classmethod
    def of(
        cls, body: Any, prompts: Sequence[str | Sequence[int]], params: SamplingParams, tenant: str | None
    ) -> Generation:
        """The generation a parsed request body asks for."""
        usage = body.stream_options is not None and body.stream_options.include_usage
        include = bool(body.include_stop_str_in_output)
        params = replace(params, stop_strings=stop_strings(body), include_stop_str_in_output=include)
        return cls(prompts, params, tenant, bool(body.stream), bool(usage))


async def answer(ctx: ServeContext, request: Request, generation: Generation, shape: Shape) -> Response:
    """Submit ``generation`` and answer it: a stream of events, or one JSON body once every choice has ended.

    Example:
        >>> import inspect
        >>> list(inspect.signature(answer).parameters)
        ['ctx', 'request', 'generation', 'shape']
    """
    request.state.request_id = shape.response_id
    job = await _start(ctx, generation)
    tally = Tally(job.request_ids, generation.params.n)
    if generation.stream:

        def stream_error(error: ApiError) -> ApiError:
            ctx.metrics.count(outcome(error))
            return error if ctx.loop_errors_are_public else public_error(error, shape.response_id)

        events = sse_events(
            job,
            tally,
            shape,
            generation.include_usage,
            on_error=stream_error,
            on_finish=lambda: ctx.metrics.count("finished"),
        )
        return JobStream(events, job, lambda: ctx.metrics.count("aborted"))
    try:
        if not await collect(request, job, tally):
            return Response(status_code=499)  # the client left; its requests are aborted below
        ctx.metrics.count("finished")
        return JSONResponse(shape.response(tally.texts, tally.reasons, tally.usage()))
    finally:
        if job.abort():
            ctx.metrics.count("aborted")


async def _start(ctx: ServeContext, generation: Generation) -> Job:
    job = Job(ctx.loop)
    submissions = [Submission(p, generation.params, generation.tenant) for p in generation.prompts]
    try:
        await job.start(submissions)
    except BaseException:
        job.abort()  # e.g. the client left while waiting: nothing may keep running for it
        raise
    return job
