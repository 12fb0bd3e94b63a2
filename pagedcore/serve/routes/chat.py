"""``POST /v1/chat/completions``: chat messages through the tokenizer's chat template (or the plain one), answered.

Example:
    >>> [route.path for route in router.routes]
    ['/v1/chat/completions']
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..context import Context
from ..openapi import ERROR_RESPONSES, json_body
from ..pipeline import Generation, answer, off_loop, read_request
from ..protocol import ChatRequest, sampling_params
from ..responses import Shape
from ..structured import constraint
from .completions import DEFAULT_COMPLETION_MAX_TOKENS

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/chat/completions", responses=ERROR_RESPONSES, openapi_extra=json_body(ChatRequest))
async def chat_completions(request: Request, ctx: Context) -> Response:
    """OpenAI's chat completions: ``n`` answers to the conversation, as JSON or server-sent events."""
    tenant, body = await read_request(ctx, request, ChatRequest)
    spec, calls = await off_loop(
        constraint, body, ctx.tool_call_parser
    )  # a bad schema or tool_choice: a 400 naming the field
    prompt = await off_loop(ctx.encoder.chat, body.messages, body.tools)
    context = ctx.context_length
    # Without a limit, the answer may run to the end of the model's context (as OpenAI's chat does).
    rest = max(1, context - len(prompt)) if context else DEFAULT_COMPLETION_MAX_TOKENS
    params = replace(sampling_params(body, body.max_new_tokens(rest)), structured=spec)
    shape = Shape(True, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), ctx.model_name, tools=calls)
    return await answer(ctx, request, Generation.of(body, [prompt], params, tenant), shape)
