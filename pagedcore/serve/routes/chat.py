"""``POST /v1/chat/completions``: chat messages through the chat template (the request's, the server's
``--chat-template``, the tokenizer's, or the plain one), answered. With ``--reasoning-parser`` the reasoning is split
off the answers and a constraint applies after it (:mod:`pagedcore.serve.reasoning`).

Example:
    >>> [route.path for route in router.routes]
    ['/v1/chat/completions']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedcore.engine.request import Request as EngineRequest
from pagedcore.engine.structured import StructuredOutput
from pagedcore.errors import PagedCoreError

from ..answers import AnswerOptions, Shape
from ..context import Context, ServeContext
from ..openapi import ERROR_RESPONSES, json_body
from ..pipeline import answer, fit_prompts, lora_of, namespace_of, off_loop, read_request, requests_of, shape_of
from ..prompts import ChatOptions
from ..protocol import ApiError, ChatRequest, sampling_params
from ..reasoning import AnswerReasoning, generation_prompt
from ..structured import check_spec, constraint
from ..tool_calls import ToolCalls
from .completions import DEFAULT_COMPLETION_MAX_TOKENS

__all__ = ["chat_generation", "router"]

router = APIRouter()


@router.post("/v1/chat/completions", responses=ERROR_RESPONSES, openapi_extra=json_body(ChatRequest))
async def chat_completions(request: Request, ctx: Context) -> Response:
    """OpenAI's chat completions: ``n`` answers to the conversation, as JSON or server-sent events."""
    tenant, body = await read_request(ctx, request, ChatRequest)
    requests, shape = await chat_generation(ctx, body, tenant)
    return await answer(ctx, request, requests, shape, stream=bool(body.stream))


async def chat_generation(
    ctx: ServeContext, body: ChatRequest, tenant: str | None
) -> tuple[list[EngineRequest], Shape]:
    """What a parsed chat request asks of the engine, and the shape of its answer (the Responses API's requests
    become chat requests and go through here too).

    Example:
        >>> import inspect
        >>> list(inspect.signature(chat_generation).parameters)
        ['ctx', 'body', 'tenant']
    """
    # A bad schema or tool_choice: a 400 naming the field, before the prompt is rendered.
    prepare = ctx.loop.prepare_structured  # parsed and compiled here, in a worker: never on the step loop
    reasoned = ctx.settings.reasoning is not None  # the spec is wrapped to follow the reasoning, then prepared
    spec, calls = await off_loop(constraint, body, ctx.tool_call_parser, None if reasoned else prepare)
    _check_tools_readable(ctx, calls)
    _check_auto_tool_choice(ctx, calls)
    if body.include_reasoning is False and ctx.settings.reasoning is None:
        message = "include_reasoning false needs a server started with --reasoning-parser (none splits the reasoning)"
        raise ApiError(400, message, param="include_reasoning")
    options = _chat_options(ctx, body)
    rendered = await off_loop(ctx.encoder.chat, body.messages, options)
    reasoning = None
    if ctx.settings.reasoning is not None:
        reasoning = await off_loop(_reasoning, ctx, body, options, rendered)
        if spec is not None:
            spec = await off_loop(_after_reasoning, reasoning, spec, prepare)
    (truncated,) = fit_prompts(ctx, body, [rendered], 0)
    # Without a limit the answer may run to the end of what the context and the KV pool hold for it.
    room = ctx.max_new_tokens(len(truncated))
    max_tokens = body.max_new_tokens(DEFAULT_COMPLETION_MAX_TOKENS if room is None else max(1, room))
    (prompt,) = fit_prompts(ctx, body, [truncated], max_tokens)
    params = replace(sampling_params(body, max_tokens, ctx.eos_token_ids), structured=spec)
    shape = shape_of(ctx, body, True, _options(ctx, body, prompt), calls)
    role = ctx.settings.response_role if body.add_generation_prompt else body.messages[-1].role
    shape = replace(shape, role=role, reasoning=reasoning)
    return requests_of([prompt], params, namespace_of(tenant, body.cache_salt), lora_of(ctx, body)), shape


def _check_auto_tool_choice(ctx: ServeContext, calls: ToolCalls | None) -> None:
    """``tool_choice="auto"`` on a server that does not read tool calls is refused."""
    if calls is not None and calls.mode == "auto" and not ctx.settings.auto_tool_choice:
        raise ApiError(
            400,
            'tool_choice "auto" (the default with tools) needs a server started with --enable-auto-tool-choice '
            '(this one has --no-enable-auto-tool-choice): give tool_choice "none", "required" or a named function',
            param="tool_choice",
        )


def _check_tools_readable(ctx: ServeContext, calls: ToolCalls | None) -> None:
    """Tools under a reasoning format whose tool calls this server does not read (gpt-oss's, on its commentary
    channel) are refused rather than answered with the call's arguments as text."""
    reasoning = ctx.settings.reasoning
    if calls is not None and reasoning is not None and reasoning.reads_tokens:
        raise ApiError(
            400,
            f"tools: with --reasoning-parser {reasoning.name} the model calls tools on gpt-oss's commentary channel "
            "(vLLM's --tool-call-parser openai), which this server does not read: give no tools "
            '(or tool_choice "none")',
            param="tools",
        )


def _chat_options(ctx: ServeContext, body: ChatRequest) -> ChatOptions:
    if body.chat_template is not None and not ctx.trust_request_chat_template:
        raise ApiError(
            400,
            "chat_template: this server does not run a request's own chat template (start it with "
            "--trust-request-chat-template to allow it)",
            param="chat_template",
        )
    kwargs = {**ctx.settings.default_chat_template_kwargs, **(body.chat_template_kwargs or {})}
    return ChatOptions(
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        documents=body.documents,
        template=body.chat_template,
        template_kwargs=kwargs or None,
        add_special_tokens=bool(body.add_special_tokens),
        tools=body.tools,
    )


def _reasoning(ctx: ServeContext, body: ChatRequest, options: ChatOptions, rendered: list[int]) -> AnswerReasoning:
    """Where this request's answers start (inside a reasoning block, after one, or free to open one): read from the
    generation prompt the template wrote (or the last message, continued)."""
    reasoning = ctx.settings.reasoning
    if options.continue_final_message:
        state = reasoning.state(body.messages[-1].text)
    else:
        bare = replace(options, add_generation_prompt=False)

        def render(add: bool) -> list[int]:
            return rendered if add else ctx.encoder.renderer.render(body.messages, bare)

        def decode(ids: Sequence[int]) -> str:
            return reasoning.decode_prompt(ids, ctx.encoder.decode)

        state = reasoning.state(generation_prompt(render, decode) if options.add_generation_prompt else "")
    return AnswerReasoning(reasoning, state, include=body.include_reasoning is not False)


def _after_reasoning(
    reasoning: AnswerReasoning, spec: StructuredOutput, prepare: Callable[[StructuredOutput], StructuredOutput]
) -> StructuredOutput:
    """The request's constraint applied after the reasoning (checked and prepared here: a 400 rather than a failed
    request, and nothing parsed on the step loop)."""
    try:
        wrapped = reasoning.reasoning.constrain(spec, reasoning.state)
    except PagedCoreError as exc:
        raise ApiError(400, f"the constraint cannot follow the reasoning: {exc}", param=spec.source) from exc
    return check_spec(wrapped, spec.source or "response_format", prepare)  # the field the constraint came from


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
        stop_token_ids=frozenset(body.stop_token_ids or ()),
    )
