"""``POST /v1/completions``: a prompt (text, token ids, or a batch of either) continued.

Example:
    >>> [route.path for route in router.routes]
    ['/v1/completions']
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
from ..protocol import CompletionRequest, sampling_params
from ..responses import Shape
from ..structured import constraint

__all__ = ["DEFAULT_COMPLETION_MAX_TOKENS", "router"]

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

router = APIRouter()


@router.post("/v1/completions", responses=ERROR_RESPONSES, openapi_extra=json_body(CompletionRequest))
async def completions(request: Request, ctx: Context) -> Response:
    """OpenAI's completions: one choice per prompt and sample, as JSON or server-sent events."""
    tenant, body = await read_request(ctx, request, CompletionRequest)
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    spec, _ = await off_loop(constraint, body)  # a bad schema: a 400 naming the field
    params = replace(sampling_params(body, max_tokens), structured=spec)
    prompts = await off_loop(ctx.encoder.completion, body.prompt)
    shape = Shape(False, f"cmpl-{uuid.uuid4().hex}", int(time.time()), ctx.model_name)
    return await answer(ctx, request, Generation.of(body, prompts, params, tenant), shape)
