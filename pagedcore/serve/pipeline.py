"""The request plumbing every generation endpoint shares: authorize, read the body (bounded), parse it, encode the
prompts, fit them to the context, submit, then stream or collect the answer.

Parsing and tokenizing run in a worker thread (:func:`off_loop`), never on the event loop (other clients' streams
go on meanwhile) nor on the engine's step loop (the engine receives token ids).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from typing import Any, Protocol, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedcore.engine import request as engine_request
from pagedcore.engine.sampling import SamplingParams
from pagedcore.errors import InvalidRequestError

from .answers import AnswerOptions, Shape, Tally
from .body import read_body
from .context import ServeContext
from .errors import log_context, outcome, public_error, request_id
from .jobs import Job
from .protocol import ApiError, engine_error, parse_request
from .responses import JobStream, collect, sse_events
from .sampling_defaults import apply_defaults
from .tool_calls import ToolCalls

__all__ = [
    "Renderer",
    "answer",
    "fit_prompts",
    "lora_of",
    "namespace_of",
    "off_loop",
    "read_request",
    "requests_of",
    "shape_of",
]

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
    raw = await read_body(request, ctx.limits, ctx.admission)
    body = await off_loop(parse_request, cls, raw, max_prompt_tokens=ctx.context_length)
    request.state.client_request_id = getattr(body, "request_id", None)  # logged beside the server's own id
    if body.model is not None:
        ctx.check_model(body.model)
    return tenant, apply_defaults(body, ctx.settings.sampling_defaults)


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
    prompt that, with ``max_new_tokens``, would not fit in the served context (``--max-model-len``; the rule is
    :class:`~pagedcore.engine.context.ContextWindow`'s, which the engine applies too).

    Example:
        >>> import inspect
        >>> list(inspect.signature(fit_prompts).parameters)
        ['ctx', 'body', 'prompts', 'max_new_tokens']
    """
    keep = body.truncate_prompt_tokens
    if keep == -1:
        keep = ctx.context_length
    fitted: list[str | list[int]] = []
    for index, prompt in enumerate(prompts):
        if keep is not None and not isinstance(prompt, str) and len(prompt) > keep:
            prompt = prompt[:keep] if body.truncation_side == "right" else prompt[len(prompt) - keep :]
        if not isinstance(prompt, str):
            which = "the prompt" if len(prompts) == 1 else f"prompt {index}"
            try:
                ctx.context.check(len(prompt), max_new_tokens, which=which)
            except InvalidRequestError as exc:
                raise engine_error(exc) from exc
        fitted.append(prompt)
    return fitted


def requests_of(
    prompts: Sequence[str | Sequence[int]], params: SamplingParams, namespace: Hashable, lora: str | None = None
) -> list[engine_request.Request]:
    """A generation request's engine requests, one per prompt: the one conversion of a request body at the edge
    (prompts token ids, or texts when the server has no tokenizer; the sampling parameters, stop strings included:
    stopping is the Engine's; the prefix-cache namespace, :func:`namespace_of`; the LoRA adapter its ``model``
    names, :func:`lora_of`).

    Example:
        >>> requests_of([[5], [6, 7]], SamplingParams(stop_strings=["\\n"]), "tenant")[1].prompt
        [6, 7]
    """
    return [engine_request.Request(prompt, params, namespace=namespace, lora=lora) for prompt in prompts]


def lora_of(ctx: ServeContext, body: Any) -> str | None:
    """The LoRA adapter a request's ``model`` names (None: the base model); 404 for a name not served.

    Example:
        >>> from types import SimpleNamespace
        >>> lora_of(None, SimpleNamespace(model=None)) is None
        True
    """
    return None if body.model is None else ctx.check_model(body.model)


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
    name = lora_of(ctx, body) or ctx.model_name  # an adapter's answers carry its name (vLLM)
    return Shape(chat, response_id, int(time.time()), name, options, tools)


class Renderer(Protocol):
    """How an endpoint other than completions and chat (the Responses API) shapes its answers.

    Example:
        >>> from pagedcore.serve.responses_api.render import ResponsesRenderer
        >>> callable(ResponsesRenderer.response) and callable(ResponsesRenderer.events)
        True
    """

    def response(self, tally: Tally) -> dict[str, Any]:
        """The whole answer."""

    def events(
        self, job: Job, tally: Tally, *, on_error: Callable[[ApiError], ApiError], on_finish: Callable[[], None]
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed answer."""


async def answer(
    ctx: ServeContext,
    request: Request,
    requests: Sequence[engine_request.Request],
    shape: Shape,
    *,
    stream: bool,
    renderer: Renderer | None = None,
) -> Response:
    """Submit ``requests`` (one per prompt, :func:`requests_of`) and answer them: a stream of events (``stream``),
    or one JSON body once every choice has ended (in ``shape``'s form, or ``renderer``'s).

    Example:
        >>> import inspect
        >>> list(inspect.signature(answer).parameters)
        ['ctx', 'request', 'requests', 'shape', 'stream', 'renderer']
    """
    request.state.response_id = shape.response_id  # the log names the server's own id, and this beside it
    if ctx.settings.request_log is not None:
        client = request.client.host if request.client is not None else None
        logged = request_id(request) + log_context(request)  # the server's unique id, the client's beside it
        ctx.settings.request_log.log(logged, client, [r.prompt for r in requests], requests[0].params)
    leave = ctx.admission.enter()
    try:
        job = await _start(ctx, requests)
    except BaseException:
        leave()
        raise
    known = [len(r.prompt) for r in requests if not isinstance(r.prompt, str)]
    tally = Tally(job.request_ids, requests[0].params.n, known, ctx.settings.prefix_caching)
    if stream:

        def stream_error(error: ApiError) -> ApiError:
            ctx.metrics.count(outcome(error))
            return (
                error if ctx.loop_errors_are_public else public_error(error, request_id(request), log_context(request))
            )

        def finished() -> None:
            ctx.metrics.count("finished")

        if renderer is not None:
            events = renderer.events(job, tally, on_error=stream_error, on_finish=finished)
        else:
            events = sse_events(job, tally, shape, on_error=stream_error, on_finish=finished)
        return JobStream(events, job, lambda: ctx.metrics.count("aborted"), on_close=leave)
    try:
        if not await collect(request, job, tally):
            return Response(status_code=499)  # the client left; its requests are aborted below
        ctx.metrics.count("finished")
        return JSONResponse(shape.response(tally) if renderer is None else renderer.response(tally))
    finally:
        leave()
        if job.abort():
            ctx.metrics.count("aborted")


async def _start(ctx: ServeContext, requests: Sequence[engine_request.Request]) -> Job:
    params = requests[0].params
    job = Job(ctx.loop, on_finished=lambda finished: ctx.metrics.observe_request(finished, params))
    try:
        await job.start(requests)
    except BaseException:
        job.abort()  # e.g. the client left while waiting: nothing may keep running for it
        raise
    return job
