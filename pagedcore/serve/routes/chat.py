"""``POST /v1/chat/completions``: chat messages through the chat template (the request's, the server's
``--chat-template``, the tokenizer's, or the plain one), answered.

Example:
    >>> [route.path for route in router.routes]
    ['/v1/chat/completions']
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..answers import AnswerOptions
from ..context import Context, ServeContext
from ..openapi import ERROR_RESPONSES, json_body
from ..pipeline import Generation, answer, fit_prompts, namespace_of, off_loop, read_request, shape_of
from ..prompts import ChatOptions
from ..protocol import ApiError, ChatRequest, sampling_params
from ..structured import constraint
from .completions import DEFAULT_COMPLETION_MAX_TOKENS

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/chat/completions", responses=ERROR_RESPONSES, openapi_extra=json_body(ChatRequest))
async def chat_completions(request: Request, ctx: Context) -> Response:
    """OpenAI's chat completions: ``n`` answers to the conversation, as JSON or server-sent events."""
    tenant, body = await read_request(ctx, request, ChatRequest)
    # A bad schema or tool_choice: a 400 naming the field, before the prompt is rendered.
    spec, calls = await off_loop(constraint, body, ctx.tool_call_parser, ctx.loop.prepare_structured)
    rendered = await off_loop(ctx.encoder.chat, body.messages, _chat_options(ctx, body))
    (truncated,) = fit_prompts(ctx, body, [rendered], 0)
    # Without a limit the answer may run to the end of what the context and the KV pool hold for it.
    room = ctx.max_new_tokens(len(truncated))
    max_tokens = body.max_new_tokens(DEFAULT_COMPLETION_MAX_TOKENS if room is None else max(1, room))
    (prompt,) = fit_prompts(ctx, body, [truncated], max_tokens)
    params = replace(sampling_params(body, max_tokens, ctx.eos_token_ids), structured=spec)
    shape = shape_of(ctx, body, True, _options(ctx, body, prompt), calls)
    generation = Generation([prompt], params, namespace_of(tenant, body.cache_salt), bool(body.stream))
    return await answer(ctx, request, generation, shape)


def _chat_options(ctx: ServeContext, body: ChatRequest) -> ChatOptions:
    if body.chat_template is not None and not ctx.trust_request_chat_template:
        raise ApiError(
            400,
            "chat_template: this server does not run a request's own chat template (start it with "
            "--trust-request-chat-template to allow it)",
            param="chat_template",
        )
    return ChatOptions(
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        documents=body.documents,
        template=body.chat_template,
        template_kwargs=body.chat_template_kwargs,
        add_special_tokens=bool(body.add_special_tokens),
        tools=body.tools,
    )


def _options(ctx: ServeContext, body: ChatRequest, prompt: Any) -> AnswerOptions:
    """``echo`` (vLLM's): the last message's text goes before the answer when it is the assistant's."""
    last = body.messages[-1]
    echo = (last.text,) if body.echo and last.role == "assistant" else ()
    usage = body.stream_options
    return AnswerOptions(
        echo=echo,
        prompt_token_ids=None if isinstance(prompt, str) else (tuple(prompt),),
        return_token_ids=bool(body.return_token_ids),
        include_usage=bool(usage and usage.include_usage),
        continuous_usage=bool(usage and usage.continuous_usage_stats),
        logprobs=body.top_logprobs_k,
        prompt_logprobs=body.prompt_logprobs is not None,
        format=ctx.logprob_format(bool(body.return_tokens_as_token_ids)),
    )
