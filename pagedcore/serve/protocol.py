"""The OpenAI request bodies this server accepts, their validation, and OpenAI-style errors.

Bodies are parsed strictly (no ``"5"`` for 5, no ``true`` for 1). Every field OpenAI or vLLM defines is in
:mod:`pagedcore.serve.fields`: implemented here, or refused with a 400 naming it unless it is absent or at its
no-op value; none is accepted and ignored. A field neither defines is refused too (400 naming it: vLLM only logs
it, which hides a misspelt ``max_token`` behind a default answer). Every problem becomes an :class:`ApiError` with
a 4xx status and OpenAI's error body.
"""

from __future__ import annotations

import json
import logging
import reprlib
import unicodedata
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pagedcore.engine.context import ContextWindow
from pagedcore.engine.sampling import SamplingParams
from pagedcore.errors import InvalidRequestError, PagedCoreError

from .fields import CHAT, COMPLETIONS, FIELDS, Endpoint, rules_for

__all__ = [
    "MAX_ID_CHARS",
    "MAX_PROMPTS",
    "MAX_SALT_CHARS",
    "MAX_STOP_STRINGS",
    "ApiError",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "StreamOptions",
    "TextPart",
    "TokenizeRequest",
    "check_fields",
    "engine_error",
    "parse_body",
    "parse_request",
    "sampling_params",
    "stop_strings",
]

logger = logging.getLogger("pagedcore.serve")

MAX_STOP_STRINGS = 16
MAX_PROMPTS = 2048  # prompts in one completion request (OpenAI's bound on an array input)
MAX_ID_CHARS = 256  # request_id
MAX_SALT_CHARS = 1024  # cache_salt (vLLM's bound)
_INT64 = (-(2**63), 2**63 - 1)  # vLLM's seed range
# Request fields that are SamplingParams fields of the same name.
_CONTROLS = (
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "min_p",
    "prompt_logprobs",
)

# What a field holds, for messages about fields that accept several shapes.
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}

# The Engine's names of request fields (an error's ``param``) as clients know them; the others are the same.
_CLIENT_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "stop_strings": "stop",
    "lora": "model",  # the LoRA adapter a request names
}


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


class _Closed(BaseModel):
    """An object inside a request: a key it does not define is refused (400 naming it), not ignored; the request
    objects themselves refuse theirs by name in :func:`check_fields`."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Closed):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts; ``continuous_usage_stats``
    (vLLM) puts the counts so far in every chunk; OpenAI's ``include_obfuscation`` must be false (no padding field
    is ever added).

    Example:
        >>> StreamOptions.model_validate({"include_usage": True}).include_usage
        True
    """

    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: Literal[False] = False


class _Request(_Strict):
    endpoint: ClassVar[Endpoint]

    model: str | None = None  # vLLM: absent means the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool | None = None  # vLLM's extension: keep the stop string that ended the text
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    min_p: float | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    safety_identifier: str | None = None
    echo: bool | None = None
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_SALT_CHARS)
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    return_token_ids: bool | None = None
    # Structured outputs (pagedcore.serve.structured): OpenAI's response_format, vLLM's fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def top_logprobs_k(self) -> int | None:
        """How many alternatives each token's log-probabilities list (None: no log-probabilities)."""
        return None

    @model_validator(mode="after")
    def _check_truncation(self) -> _Request:
        tokens = self.truncate_prompt_tokens
        if tokens is not None and tokens != -1 and tokens < 1:
            message = f"truncate_prompt_tokens must be -1 (the context) or >= 1, got {tokens}"
            raise ApiError(400, message, param="truncate_prompt_tokens")
        if self.stream_options is not None and not self.stream:  # vLLM refuses it too
            raise ApiError(400, "stream_options is only for a streamed answer (stream: true)", param="stream_options")
        bad = None if self.request_id is None else control_character(self.request_id)
        if bad is not None:
            message = f"request_id must not hold control or format characters (it names the answer), got {bad}"
            raise ApiError(400, message, param="request_id")
        return self


class CompletionRequest(_Request):
    """``POST /v1/completions``; the fields and what each does are in :mod:`pagedcore.serve.fields`.

    Example:
        >>> CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"], "max_tokens": 4}).prompt
        ['a', 'b']
    """

    endpoint: ClassVar[Endpoint] = COMPLETIONS
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None

    @property
    def top_logprobs_k(self) -> int | None:
        """How many alternatives each token's log-probabilities list (None: no log-probabilities)."""
        return self.logprobs


class CacheBreakpoint(_Closed):
    """OpenAI's ``prompt_cache_breakpoint`` on a text part: the prefix up to it is worth reusing. The prefix cache
    keeps every prompt's blocks (and matches to the token inside a partly filled one) while the pool has room, so
    ``{"mode": "explicit"}`` asks for nothing more; a ``ttl`` (a lifetime it cannot promise) is refused.

    Example:
        >>> CacheBreakpoint.model_validate({"mode": "explicit"}).mode
        'explicit'
    """

    mode: Literal["explicit"]
    ttl: None = None


class TextPart(_Closed):
    """A text part of a message's content (the only kind this server takes).

    Example:
        >>> TextPart.model_validate({"type": "text", "text": "hi"}).text
        'hi'
    """

    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: CacheBreakpoint | None = None


class ChatMessage(_Closed):
    """One chat message. A key it does not define is refused; OpenAI's ``refusal``, ``annotations``, ``audio`` and
    ``function_call``, which clients send back with an earlier assistant answer, are taken empty (null, ``[]``).

    Example:
        >>> ChatMessage.model_validate({"role": "user", "content": "hi"}).text
        'hi'
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning (templates that keep it render it)
    reasoning: str | None = None  # vLLM's newer name of reasoning_content
    refusal: None = None  # an earlier answer's keys, as the openai client returns it: empty only
    annotations: list[Any] | None = Field(default=None, max_length=0)
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _check_tool_message(self) -> ChatMessage:
        if self.role == "tool" and (self.content is None or self.tool_call_id is None):
            missing = " and ".join(n for n in ("content", "tool_call_id") if getattr(self, n) is None)
            raise ApiError(400, f"messages: a tool message needs {missing} (OpenAI's rule)", param="messages")
        return self

    @property
    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Request):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is the newer name of ``max_tokens``. The fields
    and what each does are in :mod:`pagedcore.serve.fields`.

    Example:
        >>> body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 8}
        >>> ChatRequest.model_validate(body).max_new_tokens(default=100)
        8
    """

    endpoint: ClassVar[Endpoint] = CHAT
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # pagedcore.serve.tool_calls
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool | None = None  # with --reasoning-parser: false leaves the reasoning out of the answer

    @model_validator(mode="after")
    def _check_generation_prompt(self) -> ChatRequest:
        if self.add_generation_prompt and self.continue_final_message:
            message = "continue_final_message needs add_generation_prompt set to false (vLLM's rule)"
            raise ApiError(400, message, param="continue_final_message")
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        return self

    @property
    def top_logprobs_k(self) -> int | None:
        """How many alternatives each token's log-probabilities list (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self, default: int) -> int:
        """``max_completion_tokens``, else ``max_tokens``, else ``default``."""
        for value in (self.max_completion_tokens, self.max_tokens):
            if value is not None:
                return value
        return default


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a ``prompt`` (text) or chat ``messages`` (through the chat template).

    Example:
        >>> TokenizeRequest.model_validate({"prompt": "hi", "add_special_tokens": False}).add_special_tokens
        False
    """

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None  # rendered by the chat template, as a chat request's are (vLLM's)
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids to text.

    Example:
        >>> DetokenizeRequest.model_validate({"tokens": [1, 2]}).tokens
        [1, 2]
    """

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    tokens: list[int]


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
    data = _json_object(body)
    check_fields(cls.endpoint, data)
    _check_lengths(data, max_prompt_tokens)
    return _validated(cls, data)


def parse_body(cls: type[BaseModel], body: bytes) -> Any:
    """Parse and validate the JSON body of a request without a field list (``/tokenize``, ``/detokenize``) as
    ``cls``; raises :class:`ApiError` (400) on any problem.

    Example:
        >>> parse_body(StreamOptions, b'{"include_usage": 1}')
        Traceback (most recent call last):
        ...
        pagedcore.serve.protocol.ApiError: include_usage: Input should be a valid boolean
    """
    return _validated(cls, _json_object(body))


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body, parse_float=_json_number)
    except RecursionError:  # the C decoder's depth guard: a 400 like any other bad JSON, not a 500
        raise ApiError(400, "the request body is not valid JSON: it nests too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def control_character(text: str) -> str | None:
    """The first control, format or line-separator character of ``text``, escaped (``ascii``), or None: what must
    never reach a log line as it is.

    Example:
        >>> control_character("req-1"), control_character("a" + chr(10) + "b"), control_character(chr(27) + "[31m")
        (None, "'\\\\n'", "'\\\\x1b'")
    """
    for char in text:
        if unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp"):
            return ascii(char)
    return None


def _json_number(text: str) -> int | float:
    """A JSON number written with a fraction or exponent: an integer when it is one (``85.0``, ``1e3``), as JSON
    Schema counts it (its ``integer`` includes them); else a float.

    Example:
        >>> _json_number("85.0"), _json_number("1e3"), _json_number("0.5"), _json_number("1e300") == 1e300
        (85, 1000, 0.5, True)
    """
    value = float(text)
    return int(value) if value.is_integer() and abs(value) < 2**63 else value


def _validated(cls: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise _from_validation(exc) from None
    except RecursionError:  # deeply nested values in fields the models keep as they are
        raise ApiError(400, "the request body nests too deeply") from None


def check_fields(endpoint: Endpoint, data: dict[str, Any]) -> None:
    """Refuse (400, naming it) every field of ``data`` that this server does not implement, unless it is at its
    no-op value, and every field that neither OpenAI nor vLLM defines (a misspelt name would otherwise pass unseen).

    Example:
        >>> check_fields(COMPLETIONS, {"model": "m", "prompt": "x", "use_beam_search": True})
        Traceback (most recent call last):
        ...
        pagedcore.serve.protocol.ApiError: use_beam_search is not supported by this server (got True): beam search ...
    """
    rules = rules_for(endpoint)
    for name, value in data.items():
        rule = rules.get(name)
        if rule is None:
            why = "it is a field of the other endpoint" if name in FIELDS else "neither OpenAI nor vLLM defines it"
            raise ApiError(400, f"{name} is not a field of {endpoint} requests ({why})", param=name)
        if not rule.accepts(value):
            message = f"{name} is not supported by this server (got {_brief(value)}): {rule.note}"
            raise ApiError(400, message, param=name)


def _check_lengths(data: dict[str, Any], max_tokens: int | None) -> None:
    """Refuse lists no valid request has, by their length alone (their elements are validated later)."""
    window = ContextWindow(max_tokens)
    prompt = data.get("prompt")
    try:
        if isinstance(prompt, list) and prompt:
            if isinstance(prompt[0], (str, list)):
                if len(prompt) > MAX_PROMPTS:
                    raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", param="prompt")
                for index, ids in enumerate(prompt):
                    if isinstance(ids, list):
                        window.check_length(len(ids), f"prompt {index}")
            else:
                window.check_length(len(prompt), "the prompt")
        messages = data.get("messages")
        if isinstance(messages, list):
            window.check_length(len(messages), f"{len(messages)} messages", param="messages", ids=False)
    except InvalidRequestError as exc:
        raise engine_error(exc) from exc


def sampling_params(request: _Request, max_new_tokens: int, eos_token_ids: Sequence[int] = ()) -> SamplingParams:
    """The engine's :class:`SamplingParams` for a request, with OpenAI's defaults (temperature 1, top_p 1, n 1);
    bad values raise :class:`ApiError` (400) naming the field. ``stop_token_ids`` stop besides the model's
    ``eos_token_ids`` (vLLM's rule: the engine's own field replaces them), and with ``ignore_eos`` only they stop.

    Example:
        >>> request = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "temperature": 0})
        >>> sampling_params(request, 16).is_greedy
        True
        >>> stops = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stop_token_ids": [7]})
        >>> sampling_params(stops, 16, eos_token_ids=[2]).stop_token_ids
        (2, 7)
    """
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "n": 1 if request.n is None else request.n,
        "seed": request.seed,
        "stop_strings": stop_strings(request),
        "include_stop_str_in_output": bool(request.include_stop_str_in_output),
    }
    if request.seed is not None and not _INT64[0] <= request.seed <= _INT64[1]:
        raise ApiError(400, f"seed must be in vLLM's range -2**63..2**63-1, got {request.seed}", param="seed")
    if request.top_k is not None:
        kwargs["top_k"] = 0 if request.top_k == -1 else request.top_k  # vLLM's -1: every token
    if request.min_tokens is not None:
        if request.min_tokens > max_new_tokens:  # vLLM's rule: it could not be met
            message = f"min_tokens must be at most max_tokens ({max_new_tokens}), got {request.min_tokens}"
            raise ApiError(400, message, param="min_tokens")
        kwargs["min_new_tokens"] = request.min_tokens
    kwargs.update(_controls(request))
    ids = kwargs.get("stop_token_ids")
    if ids is not None:
        if kwargs.get("ignore_eos"):  # the engine's ignore_eos would ignore stop_token_ids too: vLLM's does not
            kwargs["ignore_eos"] = False
        else:
            kwargs["stop_token_ids"] = [*eos_token_ids, *(i for i in ids if i not in eos_token_ids)]
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError as exc:  # the engine owns the ranges; the error names its field
        raise engine_error(exc) from exc


def engine_error(error: PagedCoreError | str, param: str | None = None, status: int = 400, **kwargs: Any) -> ApiError:
    """An :class:`ApiError` for an error the engine raised (or its message and ``param``, as a loop reports it):
    its ``param`` (the engine's name of the field, :attr:`~pagedcore.errors.PagedCoreError.param`) as the client's
    field, and the message naming that field as the client knows it. A ``param`` that is no request field (an
    engine setting) is not shown.

    Example:
        >>> from pagedcore.validation import integer
        >>> try:
        ...     integer("max_new_tokens", -1, minimum=0)
        ... except InvalidRequestError as exc:
        ...     error = engine_error(exc)
        >>> error.param, error.message
        ('max_tokens', 'max_tokens must be an integer >= 0, got -1')
    """
    message = str(error)
    if isinstance(error, PagedCoreError):
        param = error.param
    field = _CLIENT_NAMES.get(param, param) if param is not None else None
    if field is not None and field not in FIELDS:
        field = None
    if field is not None and param is not None and field != param and message.startswith(param):
        message = field + message[len(param) :]
    return ApiError(status, message, param=field, **kwargs)


def _controls(request: _Request) -> dict[str, Any]:
    """vLLM's sampling controls and log-probabilities, as :class:`SamplingParams` fields (absent ones left out)."""
    given = {name: getattr(request, name) for name in _CONTROLS if getattr(request, name) is not None}
    if "logit_bias" in given:
        bias: dict[int, float] = {}
        for key, value in given["logit_bias"].items():
            if not key.lstrip("-").isdigit():
                raise ApiError(400, f"logit_bias keys must be token ids, got {_brief(key)}", param="logit_bias")
            bias[int(key)] = value
        given["logit_bias"] = bias
    k = request.top_logprobs_k
    if k is not None:
        given["logprobs"] = k
    if request.echo and k is not None and isinstance(request, CompletionRequest):
        given.setdefault("prompt_logprobs", k)  # the echoed prompt's tokens carry theirs (vLLM)
    return given


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


def _from_validation(exc: ValidationError) -> ApiError:
    errors = exc.errors()

    def written(error: Any) -> list[str]:
        # Union members appear in the location ("prompt.str"); keep the path to the field the client wrote.
        return [str(part) for part in error["loc"] if not _is_type_name(str(part))]

    # a value that took one member's shape (a list of parts) is wrong at a key inside it: name that key
    first = written(errors[0])
    keyed = [e for e in errors if any(not p.isdigit() for p in written(e)[len(first) :])]
    error = max(keyed, key=lambda e: len(written(e))) if keyed else errors[0]
    loc = [str(part) for part in error["loc"]]
    field = loc[0] if loc else None
    path = ".".join(written(error))
    leaf = next((p for p in reversed(loc) if not _is_type_name(p) and not p.isdigit()), field)
    if error["type"] == "missing":
        message = f"{path}: this field is required"
    elif leaf in _EXPECTED and len(errors) > 1:
        message = f"{path}: expected {_EXPECTED[leaf]}"
    else:
        message = f"{path}: {error['msg']}"
    return ApiError(400, message, param=path or None)


def _is_type_name(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "list", "TextPart") or part.startswith(("list[", "function-"))
