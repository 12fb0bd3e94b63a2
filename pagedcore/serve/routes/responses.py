"""``POST /v1/responses`` (OpenAI's Responses API), ``GET /v1/responses/{id}`` and ``DELETE /v1/responses/{id}``.

A request becomes the chat request it asks for (:func:`~pagedcore.serve.responses_api.request.to_chat`: the kept
conversation of ``previous_response_id``, its instructions and input, its tools and text format) and is served by
the chat path (template, reasoning, constraint, tool calls); its answer is shaped as a response
(:mod:`pagedcore.serve.responses_api.render`). Responses are kept (``store``, default true) in memory per tenant,
within a byte budget: a dropped one is not found (404), as is another tenant's.

Example:
    >>> sorted(route.path for route in router.routes)
    ['/v1/responses', '/v1/responses/{response_id:path}', '/v1/responses/{response_id:path}']
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ..body import read_body
from ..context import Context, ServeContext
from ..openapi import ERROR_RESPONSES, json_body
from ..pipeline import answer, lora_of, off_loop
from ..protocol import ApiError, ChatRequest, parse_body
from ..responses_api.items import assistant_turn, chat_messages
from ..responses_api.output import ResponseFrame
from ..responses_api.render import ResponsesRenderer
from ..responses_api.request import ResponsesRequest, check_fields, to_chat
from ..sampling_defaults import apply_defaults
from .chat import chat_generation

__all__ = ["router"]

router = APIRouter()
_FOUND_ERRORS: dict[int | str, dict[str, Any]] = {status: ERROR_RESPONSES[status] for status in (401, 404)}

# The chat fields a request's own fields became, for errors: a 400 names the field the client wrote.
_PARAMS = {
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "prompt": "input",  # the rendered prompt: the input's tokens
    "logprobs": "include",
    "truncate_prompt_tokens": "truncation",
}


@router.post("/v1/responses", responses=ERROR_RESPONSES, openapi_extra=json_body(ResponsesRequest))
async def create_response(request: Request, ctx: Context) -> Response:
    """OpenAI's ``responses.create``: one answer to the input (and the conversation it continues), as a response
    object or its events."""
    tenant = ctx.authorize(request)
    ctx.admission.check()
    body = await off_loop(_parse, await read_body(request, ctx.limits, ctx.admission))
    if body.model is not None:
        ctx.check_model(body.model)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        kept = ctx.responses.get(tenant, body.previous_response_id)
        if kept is None:
            raise ApiError(
                404,
                f"previous_response_id {body.previous_response_id!r}: no such response is kept (responses are kept "
                "in memory per API key, the least recently used dropped past the budget; store: false keeps none)",
                param="previous_response_id",
                code="not_found",
            )
        history = kept.conversation
    try:
        chat = await off_loop(_chat_request, body, history, ctx)
        requests, shape = await chat_generation(ctx, chat, tenant)
    except ApiError as exc:
        raise _renamed(exc) from exc
    response_id = f"resp_{body.request_id or uuid.uuid4().hex}"
    shape = replace(shape, response_id=response_id)
    store = body.store is not False
    name = lora_of(ctx, body) or ctx.model_name
    frame = ResponseFrame(response_id, time.time(), name, body, store, ctx.settings.sampling_defaults)
    conversation = [*history, *chat_messages(body.input)]

    def done(response: dict[str, Any], message: dict[str, Any]) -> None:
        if store:
            ctx.responses.put(tenant, response, [*conversation, assistant_turn(message)])

    decode = ctx.encoder.tokenizer.decode if ctx.encoder.tokenizer is not None else None
    renderer = ResponsesRenderer(frame, shape, decode, done)
    return await answer(ctx, request, requests, shape, stream=bool(chat.stream), renderer=renderer)


@router.get("/v1/responses/{response_id:path}", responses=_FOUND_ERRORS)  # an id may hold "/"
async def retrieve_response(response_id: str, request: Request, ctx: Context) -> Response:
    """A kept response (404 when it is not kept for this API key)."""
    tenant = ctx.authorize(request)
    kept = ctx.responses.get(tenant, response_id)
    if kept is None:
        raise ApiError(404, f"no response {response_id!r} is kept", param="response_id", code="not_found")
    return JSONResponse(kept.response)


@router.delete("/v1/responses/{response_id:path}", responses=_FOUND_ERRORS)
async def delete_response(response_id: str, request: Request, ctx: Context) -> Response:
    """Forget a kept response."""
    tenant = ctx.authorize(request)
    if not ctx.responses.delete(tenant, response_id):
        raise ApiError(404, f"no response {response_id!r} is kept", param="response_id", code="not_found")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _parse(raw: bytes) -> ResponsesRequest:
    """The body, its fields checked by name first (OpenAI's and vLLM's, each implemented or refused)."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    check_fields(data)
    body: ResponsesRequest = parse_body(ResponsesRequest, raw)
    return body


def _chat_request(body: ResponsesRequest, history: list[dict[str, Any]], ctx: ServeContext) -> ChatRequest:
    chat = to_chat(body, history, ctx.context_length)
    try:
        parsed = ChatRequest.model_validate(chat)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise ApiError(400, f"{where}: {error['msg']}", param=where) from None
    result: ChatRequest = apply_defaults(parsed, ctx.settings.sampling_defaults)
    return result


def _renamed(error: ApiError) -> ApiError:
    """A chat error as the Responses request's: the field named as the client wrote it."""
    param = error.param
    if param is None:
        return error
    head, _, rest = param.partition(".")
    name = _PARAMS.get(head)
    if name is None:
        return error
    message = error.message.replace(head, name, 1) if error.message.startswith(head) else error.message
    renamed = name + (f".{rest}" if rest else "")
    return ApiError(error.status, message, type=error.type, param=renamed, code=error.code)
