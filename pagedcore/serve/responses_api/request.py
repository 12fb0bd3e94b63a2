"""A ``POST /v1/responses`` body: its fields (:data:`FIELDS`: each implemented, refused with a 400 naming it, or of
no effect by definition), its strict model (:class:`ResponsesRequest`) and its conversion to the chat request it
asks for (:func:`to_chat`), which the chat path then serves (template, reasoning, constraint, tools).
"""

from __future__ import annotations

import reprlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..fields import FieldRule
from ..protocol import MAX_ID_CHARS, MAX_SALT_CHARS, ApiError
from .items import chat_messages

__all__ = [
    "FIELDS",
    "LOGPROBS_INCLUDE",
    "MAX_INPUT_ITEMS",
    "ResponseStreamOptions",
    "ResponsesRequest",
    "check_fields",
    "to_chat",
]

MAX_INPUT_ITEMS = 4096
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _impl(note: str) -> FieldRule:
    return FieldRule("implemented", note)


def _refused(note: str, *no_op: Any) -> FieldRule:
    return FieldRule("refused", note, tuple(no_op))


FIELDS: dict[str, FieldRule] = {
    "model": _impl("the served model's name (or an alias), or a loaded LoRA adapter's"),
    "input": _impl("text, or a list of items: messages (text parts), function_call, function_call_output, reasoning"),
    "instructions": _impl("a system message before the input (not carried over by previous_response_id)"),
    "previous_response_id": _impl("continue a stored response's conversation (kept in memory, per API key)"),
    "store": _impl("keep the response for previous_response_id and GET /v1/responses/{id} (default true)"),
    "metadata": _impl("key-value pairs kept with the response and returned with it"),
    "stream": _impl("server-sent events as the openai client's responses.stream reads them"),
    "stream_options": _impl("include_obfuscation must be false (no obfuscation field is ever added)"),
    "max_output_tokens": _impl("new tokens at most (reasoning included); past it the response is incomplete"),
    "temperature": _impl("as chat's"),
    "top_p": _impl("as chat's"),
    "top_k": _impl("vLLM's: as chat's"),
    "min_p": _impl("vLLM's: as chat's"),
    "seed": _impl("vLLM's: as chat's"),
    "stop": _impl("vLLM's: as chat's"),
    "repetition_penalty": _impl("vLLM's: as chat's"),
    "presence_penalty": _impl("as chat's"),
    "frequency_penalty": _impl("as chat's"),
    "logit_bias": _impl("vLLM's: as chat's"),
    "ignore_eos": _impl("vLLM's: as chat's"),
    "include_stop_str_in_output": _impl("vLLM's: as chat's"),
    "cache_salt": _impl("vLLM's: as chat's"),
    "request_id": _impl("vLLM's: the response id (resp_ + this id)"),
    "tools": _impl("function tools; other tool types are refused by name"),
    "tool_choice": _impl("none, auto, required, or {type: function, name}"),
    "parallel_tool_calls": _impl("false: tool_choice=required makes exactly one call"),
    "text": _impl("format: text, json_object or json_schema (a grammar constrains the answer); verbosity: medium"),
    "include": _impl("message.output_text.logprobs (the others name outputs this server has none of)"),
    "top_logprobs": _impl("alternatives per token, 0..20 (with include message.output_text.logprobs)"),
    "truncation": _impl("disabled (default: too long is a 400) or auto (the input's start is dropped to fit)"),
    "user": FieldRule("no effect", "an end-user id (OpenAI: for abuse monitoring); it never changes the answer"),
    "safety_identifier": FieldRule("no effect", "OpenAI's newer name of user; it never changes the answer"),
    "max_tool_calls": FieldRule("no effect", "it bounds calls to built-in tools, of which this server has none"),
    "reasoning": _refused(
        "reasoning effort and summaries are not supported (a --reasoning-parser returns the reasoning as a "
        "reasoning item)",
        {},
        {"effort": None, "summary": None},
    ),
    "background": _refused("responses are answered as they are generated (no background mode)", False),
    "conversation": _refused("no Conversations API: use previous_response_id"),
    "service_tier": _refused("one service tier", "auto", "default"),
    "prompt": _refused("stored prompt templates are not supported: send the input"),
    "prompt_cache_key": _refused("use cache_salt (isolation) or tenants' API keys"),
    "prompt_cache_retention": _refused("the prefix cache keeps blocks while the pool has room"),
    "prompt_cache_options": _refused("the prefix cache keeps blocks while the pool has room"),
    "context_management": _refused("context compaction is not supported"),
    "access_programs": _refused("no access programs"),
    "background_options": _refused("no background mode"),
    "image": _refused("no image generation"),
    "moderation": _refused("moderation is not supported"),
    "priority": _refused("priority scheduling is not available in this build", 0),
    "skip_special_tokens": _refused("special tokens are always left out of the text", True),
    "structured_outputs": _refused("use text.format"),
    "mm_processor_kwargs": _refused("no multimodal input", {}),
    "enable_response_messages": _refused("the rendered messages are not returned", False),
    "previous_input_messages": _refused("use previous_response_id"),
    "previous_response": _refused("use previous_response_id"),
    "vllm_xargs": _refused("no custom extensions", {}),
}
"""Every field of a Responses request this server knows (OpenAI's and vLLM's)."""


class ResponseStreamOptions(BaseModel):
    """A Responses request's ``stream_options``: OpenAI's ``include_obfuscation`` only, false (no padding field is
    ever added to events).

    Example:
        >>> ResponseStreamOptions.model_validate({"include_obfuscation": False}).include_obfuscation
        False
    """

    model_config = ConfigDict(strict=True, extra="forbid")

    include_obfuscation: Literal[False] = False


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` (see :data:`FIELDS`).

    Example:
        >>> ResponsesRequest.model_validate({"model": "m", "input": "Hi", "max_output_tokens": 5}).input
        'Hi'
    """

    # check_fields refuses every name it does not know and every refused field at another value than its no-op
    # ones: what reaches the model undeclared is a refused field at a no-op value (``background: false``), kept as
    # an extra of no effect.
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    stream: bool | None = False
    stream_options: ResponseStreamOptions | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_SALT_CHARS)
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    truncation: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = None


def check_fields(data: dict[str, Any]) -> None:
    """Refuse (400, naming it) every field of ``data`` that is not implemented at the value given, and every field
    neither OpenAI nor vLLM defines for this endpoint; refuse an ``input`` list too long to be a request.

    Example:
        >>> check_fields({"input": "x", "background": True})
        Traceback (most recent call last):
        ...
        pagedcore.serve.protocol.ApiError: background is not supported by this server (got True): responses are ...
    """
    for name, value in data.items():
        rule = FIELDS.get(name)
        if rule is None:
            raise ApiError(400, f"{name} is not a field of responses requests", param=name)
        if not rule.accepts(value):
            message = f"{name} is not supported by this server (got {reprlib.repr(value)}): {rule.note}"
            raise ApiError(400, message, param=name)
    items = data.get("input")
    if isinstance(items, list) and len(items) > MAX_INPUT_ITEMS:
        raise ApiError(400, f"input has {len(items)} items, more than {MAX_INPUT_ITEMS}", param="input")


_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "logit_bias", "ignore_eos", "include_stop_str_in_output", "cache_salt", "user",
             "safety_identifier")  # fmt: skip


def to_chat(body: ResponsesRequest, history: list[dict[str, Any]], context: int | None) -> dict[str, Any]:
    """The chat request ``body`` asks for (a dict of chat fields): ``history`` (the messages of the response it
    continues) then its input, after its instructions; its tools, tool choice and text format in chat's forms.

    Example:
        >>> body = ResponsesRequest.model_validate({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 9})
        >>> chat = to_chat(body, [], None)
        >>> chat["messages"], chat["max_completion_tokens"]
        ([{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}], 9)
    """
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    chat: dict[str, Any] = {"messages": [*system, *history, *chat_messages(body.input)]}
    chat.update({name: getattr(body, name) for name in _SAMPLING if getattr(body, name) is not None})
    chat["stream"] = bool(body.stream)
    if body.model is not None:
        chat["model"] = body.model  # the base model, or the LoRA adapter it names
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.request_id is not None:
        chat["request_id"] = body.request_id
    chat.update(_logprobs(body))
    chat.update(_tools(body))
    response_format = _format(body.text)
    if response_format is not None:
        chat["response_format"] = response_format
    if body.truncation not in (None, "disabled", "auto"):
        raise ApiError(400, f"truncation must be disabled or auto, got {body.truncation!r}", param="truncation")
    if body.truncation == "auto" and context is not None:
        chat["truncate_prompt_tokens"] = max(1, context - (body.max_output_tokens or 1))
    return chat


def _logprobs(body: ResponsesRequest) -> dict[str, Any]:
    include = body.include or []
    other = [item for item in include if item != LOGPROBS_INCLUDE]
    if other:
        why = "only message.output_text.logprobs can be included (the others name outputs this server has none of)"
        raise ApiError(400, f"include: {other[0]!r}: {why}", param="include")
    if LOGPROBS_INCLUDE not in include:
        if body.top_logprobs:
            message = f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}] (logprobs are returned only then)"
            raise ApiError(400, message, param="top_logprobs")
        return {}
    return {"logprobs": True, "top_logprobs": body.top_logprobs or 0}


def _tools(body: ResponsesRequest) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` in chat's forms."""
    out: dict[str, Any] = {}
    if body.tools is not None:
        out["tools"] = [_tool(i, tool) for i, tool in enumerate(body.tools)]
    choice = body.tool_choice
    if isinstance(choice, dict):
        if set(choice) != {"type", "name"} or choice["type"] != "function" or not isinstance(choice["name"], str):
            got = reprlib.repr(choice)
            raise ApiError(400, f'tool_choice must be "none", "auto", "required" or {{"type": "function", '
                           f'"name": ...}}, got {got}', param="tool_choice")  # fmt: skip
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    if body.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = body.parallel_tool_calls
    return out


_TOOL_KEYS: dict[str, tuple[type, ...]] = {  # a function tool's keys and their types (None: null)
    "type": (str,),
    "name": (str,),
    "description": (str, type(None)),
    "parameters": (dict, type(None)),
    "strict": (bool, type(None)),
}


def _tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool in chat's form; any other key, or a key of another type, is refused naming it."""
    kind = tool.get("type")
    if kind != "function":
        raise ApiError(400, f"tools.{index}: {kind!r} tools are not supported (function tools only)", param="tools")
    for key, value in tool.items():
        if key not in _TOOL_KEYS:
            raise ApiError(400, f"tools.{index}.{key} is not a field of a function tool", param=f"tools.{index}.{key}")
        if not isinstance(value, _TOOL_KEYS[key]):
            got = reprlib.repr(value)
            raise ApiError(400, f"tools.{index}.{key}: bad value {got}", param=f"tools.{index}.{key}")
    function = {key: value for key, value in tool.items() if key != "type"}
    return {"type": "function", "function": function}


def _format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None: free text); ``text.verbosity`` only at medium."""
    text = dict(text or {})
    verbosity = text.pop("verbosity", None)
    if verbosity not in (None, "medium"):
        raise ApiError(400, f"text.verbosity {verbosity!r} is not supported (medium only)", param="text.verbosity")
    fmt = text.pop("format", None)
    if text:
        raise ApiError(400, f"text.{next(iter(text))} is not a field of text", param=f"text.{next(iter(text))}")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if not isinstance(kind, str) or kind not in _FORMAT_KEYS:
        raise ApiError(400, "text.format.type must be text, json_object or json_schema", param="text.format")
    for key, value in fmt.items():
        if key not in _FORMAT_KEYS[kind]:
            raise ApiError(400, f"text.format.{key} is not a field of a {kind} format", param=f"text.format.{key}")
        if not isinstance(value, _FORMAT_KEYS[kind][key]):
            got = reprlib.repr(value)
            raise ApiError(400, f"text.format.{key}: bad value {got}", param=f"text.format.{key}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if "schema" not in fmt:
        raise ApiError(400, "text.format json_schema needs a schema", param="text.format")
    return {"type": "json_schema", "json_schema": {key: value for key, value in fmt.items() if key != "type"}}


_FORMAT_KEYS: dict[str, dict[str, tuple[type, ...]]] = {  # each text.format's keys and their types
    "text": {"type": (str,)},
    "json_object": {"type": (str,)},
    "json_schema": {
        "type": (str,),
        "schema": (dict, str),
        "name": (str,),
        "strict": (bool, type(None)),
        "description": (str, type(None)),
    },
}
