"""The OpenAI-compatible HTTP app (FastAPI) in front of an :class:`~pagedcore.serve.loop.EngineLoop`.

Endpoints: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``, ``POST /v1/chat/completions``
(JSON or server-sent events with ``"stream": true``), ``GET /health``, ``GET /metrics`` (Prometheus text).
Handlers never touch the engine: they submit to the loop and read their events from an asyncio queue.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from pagedcore import __version__
from pagedcore.adapters.transformers.spec import text_config

from .auth import ApiKeys
from .jobs import Job, error_of
from .loop import Delta, EngineLoop, Finished, RequestLoop, Submission
from .metrics import CONTENT_TYPE, ServeMetrics
from .prompts import ChatRenderer, completion_prompts
from .protocol import ApiError, ChatRequest, CompletionRequest, parse_request, sampling_params, stop_strings

__all__ = ["DEFAULT_COMPLETION_MAX_TOKENS", "create_app"]

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

_STATUS_NAMES = {400: "invalid", 401: "unauthorized", 404: "invalid", 429: "overloaded", 503: "unavailable"}


@dataclass(frozen=True)
class _Shape:
    """How one endpoint names and shapes its responses."""

    chat: bool
    response_id: str
    created: int
    model: str

    def chunk(self, index: int, text: str | None, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
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
        choices = []
        for index, (text, reason) in enumerate(zip(texts, reasons)):
            choice: dict[str, Any] = {"index": index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice.update(logprobs=None, finish_reason=reason)
            choices.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage
        return body

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
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


class _Tally:
    """Texts, finish reasons and token counts of a job's choices (choice = prompt index * n + sample)."""

    def __init__(self, job: Job, n: int) -> None:
        self._index = {rid: i for i, rid in enumerate(job.request_ids)}
        self._n = n
        count = len(job.request_ids) * n
        self.texts = [""] * count
        self.reasons: list[str | None] = [None] * count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0

    def choice(self, event: Delta) -> int:
        return self._index[event.request_id] * self._n + event.sample

    def add(self, event: Delta | Finished) -> None:
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
        total = self.prompt_tokens + self.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": total,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},  # OpenAI's field for prefix-cache hits
        }


class _JobStream(StreamingResponse):
    """Server-sent events of a job; whatever way the response ends (client gone included), the job's open
    requests are aborted."""

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


def create_app(
    loop: RequestLoop,
    *,
    model_name: str,
    api_keys: ApiKeys | None = None,
    tokenizer: Any = None,
    context_length: int | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over ``loop`` (which the caller starts and stops).

    Args:
        loop: the engine loop (or another :class:`~pagedcore.serve.loop.RequestLoop`, e.g. engine replicas on Ray).
        model_name: the name clients give as ``model`` (``GET /v1/models`` lists it).
        api_keys: when given, every ``/v1`` request needs ``Authorization: Bearer KEY`` of a known key (else 401),
            and runs in its tenant's prefix-cache namespace.
        tokenizer: default: the engine's (an :class:`EngineLoop`'s); chat needs one.
        context_length: the model's context in tokens (the default length of a chat answer); default: the
            engine's model's ``max_position_embeddings``.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import Engine
        >>> model = tiny_llama(num_hidden_layers=1)
        >>> with Engine(model, num_blocks=16, block_size=8) as engine:
        ...     app = create_app(EngineLoop(engine), model_name="tiny")
        >>> sorted(route.path for route in app.routes if route.path.startswith("/v1"))
        ['/v1/chat/completions', '/v1/completions', '/v1/models', '/v1/models/{model_id:path}']
    """
    context = context_length
    if isinstance(loop, EngineLoop):
        engine = loop.engine
        tokenizer = engine.tokenizer if tokenizer is None else tokenizer
        if context is None:
            context = getattr(text_config(engine.model), "max_position_embeddings", None)
    renderer = ChatRenderer(tokenizer)
    metrics = ServeMetrics(loop)
    created = int(time.time())
    app = FastAPI(title="pagedcore", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics
    app.state.loop = loop

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        metrics.count(_STATUS_NAMES.get(exc.status, "failed"))
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:  # unknown path, method
        error = ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code))
        return JSONResponse(error.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:  # a bug: still OpenAI's error shape
        metrics.count("failed")
        error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(error.body(), status_code=500)

    def authorize(request: Request) -> str | None:
        if api_keys is None:
            return None
        tenant = api_keys.tenant(request.headers.get("authorization"))
        if tenant is None:
            raise ApiError(401, "a valid API key is required: Authorization: Bearer KEY", code="invalid_api_key")
        return tenant

    def check_model(name: str) -> None:
        if name != model_name:
            raise ApiError(
                404,
                f"the model {name!r} does not exist; this server serves {model_name!r}",
                param="model",
                code="model_not_found",
            )

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "pagedcore"}

    @app.get("/health")
    async def health() -> Response:
        if not loop.is_running:
            return JSONResponse({"status": "stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        authorize(request)
        check_model(model_id)
        return JSONResponse(model_card())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        tenant = authorize(request)
        body: CompletionRequest = parse_request(CompletionRequest, await request.body())
        check_model(body.model)
        prompts = completion_prompts(body.prompt)
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        shape = _Shape(False, f"cmpl-{uuid.uuid4().hex}", int(time.time()), model_name)
        return await run(request, body, prompts, sampling_params(body, max_tokens), tenant, shape)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        tenant = authorize(request)
        body: ChatRequest = parse_request(ChatRequest, await request.body())
        check_model(body.model)
        prompt = renderer.render(body.messages)
        # Without a limit, the answer may run to the end of the model's context (as OpenAI's chat does).
        rest = max(1, context - len(prompt)) if context else DEFAULT_COMPLETION_MAX_TOKENS
        shape = _Shape(True, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model_name)
        params = sampling_params(body, body.max_new_tokens(rest))
        return await run(request, body, [prompt], params, tenant, shape)

    async def run(
        request: Request, body: Any, prompts: list[Any], params: Any, tenant: str | None, shape: _Shape
    ) -> Response:
        # Stopping is the engine's: the stop strings go with the parameters (special tokens among them match by id).
        include = bool(body.include_stop_str_in_output)
        params = replace(params, stop_strings=stop_strings(body), include_stop_str_in_output=include)
        job = Job(loop)
        submissions = [Submission(p, params, tenant) for p in prompts]
        try:
            await job.start(submissions)
        except BaseException:
            job.abort()  # e.g. the client left while waiting: nothing may keep running for it
            raise
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = sse(job, _Tally(job, params.n), shape, include_usage)
            return _JobStream(events, job, lambda: metrics.count("aborted"))
        try:
            return await respond(request, job, _Tally(job, params.n), shape)
        finally:
            if job.abort():
                metrics.count("aborted")

    async def respond(request: Request, job: Job, tally: _Tally, shape: _Shape) -> Response:
        async def collect() -> None:
            async for event in job.events():
                if isinstance(event, Finished) and event.error is not None:
                    job.abort()
                    raise error_of(event)
                tally.add(event)

        collector = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not collector.done():
                collector.cancel()
        if not collector.done() or collector.cancelled():
            return Response(status_code=499)  # the client left; the caller aborts its requests
        collector.result()  # raises the request's ApiError
        metrics.count("finished")
        return JSONResponse(shape.response(tally.texts, tally.reasons, tally.usage()))

    async def sse(job: Job, tally: _Tally, shape: _Shape, include_usage: bool) -> AsyncIterator[str]:
        def data(payload: dict[str, Any]) -> str:
            if include_usage and "usage" not in payload:
                payload["usage"] = None
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        if shape.chat:
            for index in range(len(tally.texts)):
                yield data(shape.chunk(index, None, None, role=True))
        async for event in job.events():
            if isinstance(event, Finished) and event.error is not None:
                error = error_of(event)
                job.abort()
                metrics.count(_STATUS_NAMES.get(error.status, "failed"))
                yield f"data: {json.dumps(error.body())}\n\n"
                yield "data: [DONE]\n\n"
                return
            tally.add(event)
            if isinstance(event, Delta):
                yield data(shape.chunk(tally.choice(event), event.text, event.finish_reason))
        if include_usage:
            yield data(shape.usage_chunk(tally.usage()))
        yield "data: [DONE]\n\n"
        metrics.count("finished")

    return app


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body was read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
