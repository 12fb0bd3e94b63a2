"""The request plumbing every generation endpoint shares: authorize, read the body (bounded), parse it, encode the
prompts, fit them to the context, submit, then stream or collect the answer.

Parsing and tokenizing run in a worker thread (:func:`off_loop`), never on the event loop (other clients' streams
go on meanwhile) nor on the engine's step loop (the engine receives token ids).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedcore.adapters.transformers import SamplingParams

from .answers import AnswerOptions, Shape, Tally
from .body import read_body
from .context import ServeContext
from .errors import log_context, outcome, public_error, request_id
from .jobs import Job
from .loop import Submission
from .protocol import ApiError, parse_request
from .responses import JobStream, collect, sse_events
from .tool_calls import ToolCalls

__all__ = ["Generation", "answer", "fit_prompts", "namespace_of", "off_loop", "read_request", "shape_of"]

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
    ctx.admission.check()  # shutting down: 503 before the body is read
    raw = await read_body(request, ctx.limits)
    body = await off_loop(parse_request, cls, raw, max_prompt_tokens=ctx.context_length)
    request.state.client_request_id = getattr(body, "request_id", None)  # logged beside the server's own id
    if body.model is not None:
        ctx.check_model(body.model)
    return tenant, body


def namespace_of(tenant: str | None, cache_salt: str | None) -> Hashable:
    """The prefix-cache namespace of a request: its tenant, narrowed by its ``cache_salt``. A salted request shares
    blocks only with requests of the same tenant and the same salt, so a salt can never reach another tenant's
    blocks (namespaces are told apart by type and value, :func:`pagedcore.block_keys.namespace_key`).

    Example:
        >>> namespace_of("alice", None), namespace_of("alice", "s1"), namespace_of(None, "s1")
        ('alice', ('alice', 's1'), (None, 's1'))
    """
    return tenant if cache_salt is None else (tenant, cache_salt)


def fit_prompts(
    ctx: ServeContext, body: Any, prompts: Sequence[str | list[int]], max_new_tokens: int
) -> list[str | list[int]]:
    """Apply ``truncate_prompt_tokens`` (``truncation_side`` keeps the last tokens by default, as vLLM) and refuse a
    prompt that, with ``max_new_tokens``, would not fit in the served context (``--max-model-len``).

    Example:
        >>> import inspect
        >>> list(inspect.signature(fit_prompts).parameters)
        ['ctx', 'body', 'prompts', 'max_new_tokens']
    """
    keep = body.truncate_prompt_tokens
    context = ctx.context_length
    if keep == -1:
        keep = context
    fitted: list[str | list[int]] = []
    for index, prompt in enumerate(prompts):
        if keep is not None and not isinstance(prompt, str) and len(prompt) > keep:
            prompt = prompt[:keep] if body.truncation_side == "right" else prompt[len(prompt) - keep :]
        if context is not None and not isinstance(prompt, str) and len(prompt) + max_new_tokens > context:
            which = "the prompt" if len(prompts) == 1 else f"prompt {index}"
            raise ApiError(
                400,
                f"{which} has {len(prompt)} tokens and asks for {max_new_tokens} more: that is over the "
                f"context of {context} tokens this server serves",
                param="max_tokens" if len(prompt) < context else "prompt",
            )
        fitted.append(prompt)
    return fitted


@dataclass(frozen=True)
class Generation:
    """What one generation request asks of the engine.

    Attributes:
        prompts: token ids (or texts, when the server has no tokenizer), one per prompt.
        params: the sampling parameters of each prompt (stop strings included: stopping is the Engine's).
        namespace: the prefix-cache namespace (:func:`namespace_of`).
        stream: answer with server-sent events.

    Example:
        >>> Generation([[5]], SamplingParams(stop_strings=["\\n"]), "tenant").params.stop_strings
        ('\\n',)
    """

    prompts: Sequence[str | Sequence[int]]
    params: SamplingParams
    namespace: Hashable
    stream: bool = False


def shape_of(ctx: ServeContext, body: Any, chat: bool, options: AnswerOptions, tools: ToolCalls | None = None) -> Shape:
    """The answer's :class:`~pagedcore.serve.answers.Shape`: its id (``request_id`` when the client gave one, as
    vLLM), the served model's name, what the request asked to see and how its answers become ``tool_calls``.

    Example:
        >>> import inspect
        >>> list(inspect.signature(shape_of).parameters)
        ['ctx', 'body', 'chat', 'options', 'tools']
    """
    prefix = "chatcmpl" if chat else "cmpl"
    response_id = f"{prefix}-{body.request_id or uuid.uuid4().hex}"
    return Shape(chat, response_id, int(time.time()), ctx.model_name, options, tools)


async def answer(ctx: ServeContext, request: Request, generation: Generation, shape: Shape) -> Response:
    """Submit ``generation`` and answer it: a stream of events, or one JSON body once every choice has ended.

    Example:
        >>> import inspect
        >>> list(inspect.signature(answer).parameters)
        ['ctx', 'request', 'generation', 'shape']
    """
    request.state.response_id = shape.response_id  # the log names the server's own id, and this beside it
    leave = ctx.admission.enter()
    try:
        job = await _start(ctx, generation)
    except BaseException:
        leave()
        raise
    known = [len(p) for p in generation.prompts if not isinstance(p, str)]
    tally = Tally(job.request_ids, generation.params.n, known)
    if generation.stream:

        def stream_error(error: ApiError) -> ApiError:
            ctx.metrics.count(outcome(error))
            return (
                error if ctx.loop_errors_are_public else public_error(error, request_id(request), log_context(request))
            )

        def finished() -> None:
            ctx.metrics.count("finished")

        events = sse_events(job, tally, shape, on_error=stream_error, on_finish=finished)
        return JobStream(events, job, lambda: ctx.metrics.count("aborted"), on_close=leave)
    try:
        if not await collect(request, job, tally):
            return Response(status_code=499)  # the client left; its requests are aborted below
        ctx.metrics.count("finished")
        return JSONResponse(shape.response(tally))
    finally:
        leave()
        if job.abort():
            ctx.metrics.count("aborted")


async def _start(ctx: ServeContext, generation: Generation) -> Job:
    params = generation.params
    job = Job(ctx.loop, on_finished=lambda finished: ctx.metrics.observe_request(finished, params))
    submissions = [Submission(p, generation.params, generation.namespace) for p in generation.prompts]
    try:
        await job.start(submissions)
    except BaseException:
        job.abort()  # e.g. the client left while waiting: nothing may keep running for it
        raise
    return job
