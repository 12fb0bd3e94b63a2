"""The OpenAI request bodies this server accepts, their validation, and OpenAI-style errors.

Bodies are parsed strictly (no ``"5"`` for 5, no ``true`` for 1); a field this server does not implement (e.g.
``logprobs``, penalties) is refused unless it is absent or set to its no-op value; fields it does not
know are ignored, as other OpenAI-compatible servers do. Every problem becomes an :class:`ApiError` with a 4xx
status and OpenAI's error body.
"""

from __future__ import annotations

import json
import reprlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedcore.adapters.transformers import SamplingParams
from pagedcore.errors import InvalidRequestError

__all__ = [
    "MAX_PROMPTS",
    "MAX_STOP_STRINGS",
    "ApiError",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "StreamOptions",
    "TextPart",
    "parse_request",
    "sampling_params",
    "stop_strings",
]

MAX_STOP_STRINGS = 16
MAX_PROMPTS = 2048  # prompts in one completion request (OpenAI's bound on an array input)

# Fields that OpenAI defines and this server does not implement: accepted only at these (no-op) values.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None,),
    "echo": (None, False),
    "suffix": (None,),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "prediction": (None,),
    "modalities": (None, ["text"]),
}

# What a field holds, for messages about fields that accept several shapes.
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}

# Engine parameter names as clients know them.
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
_PARAM_NAMES.update({"n": "n", "seed": "seed"})


class ApiError(Exception):
    """An error answered with an HTTP status and OpenAI's error body.

    Example:
        >>> ApiError(400, "max_tokens must be an integer >= 0, got -1", param="max_tokens").body()["error"]["param"]
        'max_tokens'
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts.

    Example:
        >>> StreamOptions.model_validate({"include_usage": True}).include_usage
        True
    """

    include_usage: bool = False


class _Request(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool | None = None  # vLLM's extension: keep the stop string that ended the text
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Structured outputs (pagedcore.serve.structured): OpenAI's response_format, vLLM's fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Request):
    """``POST /v1/completions``. ``top_k`` (0 = all tokens) and ``include_stop_str_in_output`` are extensions.

    Example:
        >>> CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"], "max_tokens": 4}).prompt
        ['a', 'b']
    """

    prompt: str | list[str] | list[int] | list[list[int]]


class TextPart(_Strict):
    """A text part of a message's content (the only kind this server takes).

    Example:
        >>> TextPart.model_validate({"type": "text", "text": "hi"}).text
        'hi'
    """

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat message.

    Example:
        >>> ChatMessage.model_validate({"role": "user", "content": "hi"}).text
        'hi'
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @property
    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Request):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is the newer name of ``max_tokens``.

    Example:
        >>> body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 8}
        >>> ChatRequest.model_validate(body).max_new_tokens(default=100)
        8
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None  # pagedcore.serve.tool_calls
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def max_new_tokens(self, default: int) -> int:
        """``max_completion_tokens``, else ``max_tokens``, else ``default``."""
        for value in (self.max_completion_tokens, self.max_tokens):
            if value is not None:
                return value
        return default


def parse_request(cls: type[_Request], body: bytes, *, max_prompt_tokens: int | None = None) -> Any:
    """Parse and validate a JSON body as ``cls``; raises :class:`ApiError` (400) on any problem.

    With ``max_prompt_tokens`` (the model's context), a list of token ids or of chat messages longer than that is
    refused by its length alone, before any element is validated (2M ids would take seconds).

    Example:
        >>> parse_request(CompletionRequest, b'{"model": "m", "prompt": "hi", "max_tokens": "5"}')
        Traceback (most recent call last):
        ...
        pagedcore.serve.protocol.ApiError: max_tokens: Input should be a valid integer
        >>> parse_request(CompletionRequest, b'{"model": "m", "prompt": [1, 2, 3]}', max_prompt_tokens=2)
        Traceback (most recent call last):
        ...
        pagedcore.serve.protocol.ApiError: the prompt has 3 token ids, more than the model's context of 2 tokens
    """
    try:
        data = json.loads(body)
    except RecursionError:  # the C decoder's depth guard: a 400 like any other bad JSON, not a 500
        raise ApiError(400, "the request body is not valid JSON: it nests too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    for name, allowed in _UNSUPPORTED.items():
        if name in data and not any(_same(data[name], value) for value in allowed):
            raise ApiError(400, f"{name} is not supported by this server (got {_brief(data[name])})", param=name)
    _check_lengths(data, max_prompt_tokens)
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise _from_validation(exc) from None
    except RecursionError:  # deeply nested values in fields the models keep as they are
        raise ApiError(400, "the request body nests too deeply") from None


def _check_lengths(data: dict[str, Any], max_tokens: int | None) -> None:
    """Refuse lists no valid request has, by their length alone (their elements are validated later)."""
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], (str, list)):
            if len(prompt) > MAX_PROMPTS:
                raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", param="prompt")
            for index, ids in enumerate(prompt):
                if isinstance(ids, list) and max_tokens is not None and len(ids) > max_tokens:
                    raise ApiError(
                        400,
                        f"prompt {index} has {len(ids)} token ids, more than the model's context of {max_tokens} "
                        "tokens",
                        param="prompt",
                    )
        elif max_tokens is not None and len(prompt) > max_tokens:
            message = f"the prompt has {len(prompt)} token ids, more than the model's context of {max_tokens} tokens"
            raise ApiError(400, message, param="prompt")
    messages = data.get("messages")
    if isinstance(messages, list) and max_tokens is not None and len(messages) > max_tokens:
        raise ApiError(
            400,
            f"{len(messages)} messages cannot fit in the model's context of {max_tokens} tokens (each takes one at "
            "least)",
            param="messages",
        )


def sampling_params(request: _Request, max_new_tokens: int) -> SamplingParams:
    """The engine's :class:`SamplingParams` for a request, with OpenAI's defaults (temperature 1, top_p 1, n 1);
    bad values raise :class:`ApiError` (400) naming the field.

    Example:
        >>> request = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "temperature": 0})
        >>> sampling_params(request, 16).is_greedy
        True
    """
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "n": 1 if request.n is None else request.n,
        "seed": request.seed,
    }
    if request.top_k is not None:
        kwargs["top_k"] = request.top_k
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError as exc:  # the engine owns the ranges; name the field as the client knows it
        word = str(exc).split(" ", 1)[0]
        name = _PARAM_NAMES.get(word)
        message = str(exc) if name is None or name == word else f"{name}{str(exc)[len(word) :]}"
        raise ApiError(400, message, param=name) from exc


def stop_strings(request: _Request) -> tuple[str, ...]:
    """The request's stop strings; raises :class:`ApiError` for an empty one or too many.

    Example:
        >>> stop_strings(CompletionRequest.model_validate({"model": "m", "prompt": "x", "stop": "\\n"}))
        ('\\n',)
    """
    stop = request.stop
    items = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if len(items) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}", param="stop")
    if any(not s for s in items):
        raise ApiError(400, "stop strings must not be empty", param="stop")
    return items


def _brief(value: Any) -> str:
    """A short repr of a client's value for a message (never the whole of a huge or deeply nested one)."""
    return reprlib.repr(value)


def _same(value: Any, allowed: Any) -> bool:
    if allowed is None or isinstance(allowed, bool) or isinstance(value, bool):
        return value is allowed
    if isinstance(allowed, (int, float)):
        return isinstance(value, (int, float)) and value == allowed
    return bool(value == allowed)


def _from_validation(exc: ValidationError) -> ApiError:
    error = exc.errors()[0]
    loc = [str(part) for part in error["loc"]]
    field = loc[0] if loc else None
    # Union members appear in the location ("prompt.str"); keep the path to the field the client wrote.
    path = ".".join(p for p in loc if not _is_type_name(p))
    leaf = next((p for p in reversed(loc) if not _is_type_name(p) and not p.isdigit()), field)
    if error["type"] == "missing":
        message = f"{path}: this field is required"
    elif leaf in _EXPECTED and len(exc.errors()) > 1:
        message = f"{path}: expected {_EXPECTED[leaf]}"
    else:
        message = f"{path}: {error['msg']}"
    return ApiError(400, message, param=path or None)


def _is_type_name(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "list", "TextPart") or part.startswith(("list[", "function-"))
