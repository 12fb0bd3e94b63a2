"""vLLM's tokenizer endpoints: ``POST /tokenize`` (a prompt or chat messages to token ids), ``POST /detokenize``
(token ids to text) and ``GET /tokenizer_info`` (what lm-eval's ``tokenizer_backend=remote`` reads: the special
tokens and the chat template). They need the API key like ``/v1`` does when the server has keys.

Example:
    >>> sorted(route.path for route in router.routes)
    ['/detokenize', '/tokenize', '/tokenizer_info']
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from ..body import read_body
from ..context import Context, ServeContext
from ..openapi import ERROR_RESPONSES, json_body
from ..pipeline import off_loop
from ..prompts import ChatOptions
from ..protocol import ApiError, DetokenizeRequest, TokenizeRequest, parse_body

__all__ = ["router"]

router = APIRouter()


@router.post("/tokenize", responses=ERROR_RESPONSES, openapi_extra=json_body(TokenizeRequest, streams=False))
async def tokenize(request: Request, ctx: Context) -> Response:
    """``{"count", "max_model_len", "tokens", "token_strs"}`` of a prompt or of chat messages."""
    body = await _read(ctx, request, TokenizeRequest)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give either prompt or messages", param="prompt")
    tokens = await off_loop(_tokens, ctx, body)
    strs = [ctx.logprob_format(server_default=False).token(t) for t in tokens] if body.return_token_strs else None
    answer = {"count": len(tokens), "max_model_len": ctx.context_length, "tokens": tokens, "token_strs": strs}
    return JSONResponse(answer)


@router.post("/detokenize", responses=ERROR_RESPONSES, openapi_extra=json_body(DetokenizeRequest, streams=False))
async def detokenize(request: Request, ctx: Context) -> Response:
    """``{"prompt": text}`` of token ids (special tokens kept)."""
    body = await _read(ctx, request, DetokenizeRequest)
    text = await off_loop(ctx.encoder.decode, body.tokens, "tokens")
    return JSONResponse({"prompt": text})


@router.get("/tokenizer_info", responses={401: ERROR_RESPONSES[401], 404: ERROR_RESPONSES[404]})
async def tokenizer_info(request: Request, ctx: Context) -> Response:
    """The tokenizer's class, special tokens, context and chat template (vLLM's ``/tokenizer_info``)."""
    ctx.authorize(request)
    tokenizer = ctx.encoder.tokenizer
    if tokenizer is None:
        raise ApiError(404, "this server has no tokenizer", code="not_found")
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(tokenizer, name, None)
        info[name] = token if isinstance(token, str) else None
    info["model_max_length"] = ctx.context_length
    info["chat_template"] = ctx.encoder.renderer.template
    return JSONResponse(info)


async def _read(ctx: ServeContext, request: Request, cls: type[BaseModel]) -> Any:
    ctx.authorize(request)
    body = parse_body(cls, await read_body(request, ctx.limits, ctx.admission))
    if body.model is not None:
        ctx.check_model(body.model)
    return body


def _tokens(ctx: ServeContext, body: TokenizeRequest) -> list[int]:
    if body.messages is not None:
        options = ChatOptions(
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            add_special_tokens=bool(body.add_special_tokens),
            tools=body.tools,
            template_kwargs=body.chat_template_kwargs,
        )
        return ctx.encoder.chat(body.messages, options)
    assert body.prompt is not None
    encoded = ctx.encoder.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    if isinstance(encoded, str):
        raise ApiError(400, "this server has no tokenizer: it cannot tokenize", param="prompt")
    return encoded
