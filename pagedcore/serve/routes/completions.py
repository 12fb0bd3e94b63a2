"""``POST /v1/completions``: a prompt (text, token ids, or a batch of either) continued.

Example:
    >>> [route.path for route in router.routes]
    ['/v1/completions']
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..answers import AnswerOptions
from ..context import Context, ServeContext
from ..openapi import ERROR_RESPONSES, json_body
from ..pipeline import answer, fit_prompts, lora_of, namespace_of, off_loop, read_request, requests_of, shape_of
from ..protocol import CompletionRequest, sampling_params
from ..structured import constraint

__all__ = ["DEFAULT_COMPLETION_MAX_TOKENS", "router"]

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

router = APIRouter()


@router.post("/v1/completions", responses=ERROR_RESPONSES, openapi_extra=json_body(CompletionRequest))
async def completions(request: Request, ctx: Context) -> Response:
    """OpenAI's completions: one choice per prompt and sample, as JSON or server-sent events."""
    tenant, body = await read_request(ctx, request, CompletionRequest)
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    # A bad schema: a 400 naming the field; the spec is parsed (and compiled) here, in a worker, never on the loop.
    spec, _ = await off_loop(constraint, body, "hermes", ctx.loop.prepare_structured)
    params = replace(sampling_params(body, max_tokens, ctx.eos_token_ids), structured=spec)
    add_special = body.add_special_tokens is not False
    encoded = await off_loop(ctx.encoder.completion, body.prompt, add_special_tokens=add_special)
    prompts = fit_prompts(ctx, body, encoded, max_tokens)
    options = await off_loop(_options, ctx, body, encoded, prompts)
    shape = shape_of(ctx, body, False, options)
    requests = requests_of(prompts, params, namespace_of(tenant, body.cache_salt), lora_of(ctx, body))
    return await answer(ctx, request, requests, shape, stream=bool(body.stream))


def _options(ctx: ServeContext, body: Any, encoded: list[Any], prompts: list[Any]) -> AnswerOptions:
    """What the answer shows beside the text: the prompts' text with ``echo`` (as given, or decoded from the
    token ids that were sent or kept), their ids with ``return_token_ids``, log-probabilities with ``logprobs`` (the
    echoed prompt's first) and ``prompt_logprobs``."""
    echo: tuple[str, ...] = ()
    if body.echo:
        texts = (
            body.prompt if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str) else None
        )
        if isinstance(body.prompt, str):
            texts = [body.prompt]
        echo = tuple(
            texts[i] if texts is not None and kept is original else _text(ctx, kept)
            for i, (original, kept) in enumerate(zip(encoded, prompts))
        )
    ids = tuple(tuple(p) for p in prompts if not isinstance(p, str)) or None
    usage = body.stream_options
    return AnswerOptions(
        echo=echo,
        prompt_token_ids=ids,
        return_token_ids=bool(body.return_token_ids),
        include_usage=bool(usage and usage.include_usage),
        continuous_usage=bool(usage and usage.continuous_usage_stats),
        logprobs=body.logprobs,
        echo_logprobs=bool(body.echo) and body.logprobs is not None,
        prompt_logprobs=body.prompt_logprobs is not None,
        format=ctx.logprob_format(bool(body.return_tokens_as_token_ids)),
        stop_token_ids=frozenset(body.stop_token_ids or ()),
    )


def _text(ctx: ServeContext, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else ctx.encoder.decode(prompt)
