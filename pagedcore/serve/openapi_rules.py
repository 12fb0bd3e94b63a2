"""What ``/openapi.json`` says a request may hold: everything this server enforces that JSON Schema can state.

The request models (:mod:`pagedcore.serve.protocol`) give the shapes; this module adds this app's facts and rules:
the served model's names, the vocabulary (token ids), the context (lengths, ``max_tokens``), ``max_logprobs``, the
sequences an engine runs (``n``), non-empty prompts and stop strings, value ranges, the fields this server knows
but refuses except at their no-op values (and no other field: ``additionalProperties: false``), ``/tokenize``'s
one-of ``prompt`` / ``messages``, tool messages' ``content`` and ``tool_call_id``. Values that are programs in
another language carry a ``format`` naming it (``llguidance-regex``, ``llguidance-grammar``, ``json-schema``).

What JSON Schema cannot state is in each operation's ``x-pagedcore-rules`` (and its description), e.g. that the
prompt's tokens, as ``POST /tokenize`` counts them, plus ``max_tokens`` fit the context.
"""

from __future__ import annotations

import functools
import sys
import unicodedata
from dataclasses import dataclass
from typing import Any

from pagedcore.adapters.transformers.structured.spec import MAX_CHOICES

from .fields import CHAT, COMPLETIONS, Endpoint, rules_for
from .openapi_schemas import TOKEN as _TOKEN
from .openapi_schemas import closed as _object
from .openapi_schemas import integer as _int
from .openapi_schemas import nullable as _nullable
from .openapi_schemas import text as _text
from .protocol import MAX_ID_CHARS, MAX_PROMPTS, MAX_STOP_STRINGS

__all__ = [
    "NO_AUTO_TOOL_CHOICE",
    "RULES",
    "ServedFacts",
    "no_control_pattern",
    "sampling_schemas",
    "state_rules",
    "tighten",
    "tool_choice_schema",
]

_SPELLABLE = (
    "every option of a choice (guided_choice, structured_outputs.choice) is text the tokenizer can spell: POST "
    "/tokenize then POST /detokenize gives it back"
)
RULES: dict[str, tuple[str, ...]] = {
    "completions": (
        "each prompt's tokens (as POST /tokenize counts them) plus max_tokens (default 16) fit max_model_len",
        _SPELLABLE,
        "at most one of response_format, structured_outputs, guided_json, guided_regex, guided_choice, guided_grammar",
        "with a structured output: no ignore_eos, no min_tokens, no allowed_token_ids",
        "min_tokens <= max_tokens",
    ),
    "chat": (
        "the rendered messages' tokens (as POST /tokenize with messages counts them) plus max_tokens / "
        "max_completion_tokens fit max_model_len (without either, the answer takes what is left)",
        "the messages' contents have at most as many characters in all as a text prompt may (prompt's maxLength)",
        _SPELLABLE,
        "at most one of response_format, structured_outputs, guided_json, guided_regex, guided_choice, guided_grammar, "
        "and none of them with tool_choice required or a named function",
        "with a structured output or tool_choice required / named: no ignore_eos, no min_tokens, no allowed_token_ids",
        "min_tokens <= max_tokens",
        "top_logprobs needs logprobs: true",
        "continue_final_message needs add_generation_prompt: false",
        "tool_choice other than none needs tools; a named function is one of them; tool names are unique",
    ),
    "tokenize": (
        "the messages' contents have at most as many characters in all as a text prompt may (prompt's maxLength)",
    ),
}
"""The rules JSON Schema cannot state, per endpoint (the document's ``x-pagedcore-rules``)."""


@dataclass(frozen=True)
class ServedFacts:
    """What the document needs to know about this app.

    Attributes:
        model_names: the names ``model`` may take.
        vocab_size: token ids are below it (None: unknown).
        context: the context in tokens (None: unknown).
        max_prompt_chars: the longest text prompt (None: unbounded).
        max_logprobs: the most log-probabilities a request may ask (None: no bound).
        max_num_seqs: the most samples one request may ask (``n``; None: unknown).
        trust_request_chat_template: whether a request's own ``chat_template`` is taken.
        has_chat_template: whether the server renders chat with a template (else ``documents`` and
            ``chat_template_kwargs`` have nothing to go to).
        splits_reasoning: whether the server has a reasoning parser (else ``include_reasoning`` cannot be false:
            nothing splits the reasoning off).
        auto_tool_choice: whether ``tool_choice`` ``auto`` (the default with tools) is served.

    Example:
        >>> ServedFacts(("tiny",), 99, 48, 192, 20, 8, False).vocab_size
        99
    """

    model_names: tuple[str, ...]
    vocab_size: int | None
    context: int | None
    max_prompt_chars: int | None
    max_logprobs: int | None
    max_num_seqs: int | None
    trust_request_chat_template: bool
    has_chat_template: bool = True
    splits_reasoning: bool = False
    auto_tool_choice: bool = True


def tighten(document: dict[str, Any], facts: ServedFacts) -> None:
    """Write ``facts`` and the server's rules into an OpenAPI ``document`` (built from the request models).

    Example:
        >>> doc = {"components": {"schemas": {}}, "paths": {}}
        >>> tighten(doc, ServedFacts(("tiny",), 99, 48, 192, 20, 8, False))
        >>> doc["components"]["schemas"]["TokenId"]
        {'type': 'integer', 'minimum': 0, 'maximum': 98}
    """
    schemas = document["components"]["schemas"]
    schemas["TokenId"] = _int(0, None if facts.vocab_size is None else facts.vocab_size - 1)
    for name, endpoint in (("CompletionRequest", COMPLETIONS), ("ChatRequest", CHAT)):
        if name in schemas:
            _request(schemas[name], endpoint, facts)
    if "ChatMessage" in schemas:
        schemas["ChatMessage"]["allOf"] = [_TOOL_MESSAGE]
    if "TokenizeRequest" in schemas:
        tokenize = schemas["TokenizeRequest"]
        tokenize["properties"]["model"] = _nullable({"enum": list(facts.model_names)})
        any_text = {**_text(facts.max_prompt_chars), "minLength": 0}  # an empty prompt has its tokens too (none)
        tokenize["properties"]["prompt"] = _nullable(any_text)
        tokenize["oneOf"] = [_given("prompt", "messages"), _given("messages", "prompt")]
        if not facts.has_chat_template:
            tokenize["properties"]["chat_template_kwargs"] = {"type": "null"}
    if "DetokenizeRequest" in schemas:
        detokenize = schemas["DetokenizeRequest"]
        detokenize["properties"]["model"] = _nullable({"enum": list(facts.model_names)})
        detokenize["properties"]["tokens"] = {"type": "array", "items": _TOKEN}
    for path, item in document.get("paths", {}).items():
        for method, operation in item.items():
            if path == "/v1/models/{model_id}":
                for parameter in operation.get("parameters", ()):
                    parameter["schema"] = {"enum": list(facts.model_names)}
            rules_of = _OPERATION_RULES.get(path)
            if rules_of is not None and method == "post":
                state_rules(operation, RULES[rules_of])


def state_rules(operation: dict[str, Any], rules: tuple[str, ...]) -> None:
    """Write ``rules`` (what JSON Schema cannot state) into an operation: its ``x-pagedcore-rules`` and its
    description.

    Example:
        >>> operation = {"description": "Answers."}
        >>> state_rules(operation, ("a <= b",))
        >>> operation["x-pagedcore-rules"], operation["description"].split()
        (['a <= b'], ['Answers.', 'Also:', 'a', '<=', 'b.'])
    """
    operation["x-pagedcore-rules"] = list(rules)
    operation["description"] = f"{operation.get('description', '')}\n\nAlso: {'; '.join(rules)}.".strip()


_OPERATION_RULES = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/tokenize": "tokenize"}


@functools.cache
def no_control_pattern() -> str:
    """A pattern of strings without what :func:`~pagedcore.serve.protocol.control_character` refuses (control,
    format and line-separator characters), as a character class of ranges (``\\uXXXX`` escapes in the BMP).

    Example:
        >>> import re
        >>> [bool(re.fullmatch(no_control_pattern(), s)) for s in ("req-1", "a" + chr(10), chr(0x202E), chr(0xE0001))]
        [True, False, False, False]
    """
    ranges: list[list[int]] = []
    for code in range(sys.maxunicode + 1):
        if unicodedata.category(chr(code)) in ("Cc", "Cf", "Zl", "Zp"):
            if ranges and ranges[-1][1] == code - 1:
                ranges[-1][1] = code
            else:
                ranges.append([code, code])

    def char(code: int) -> str:
        return f"\\u{code:04x}" if code < 0x10000 else chr(code)  # an astral code point as itself

    body = "".join(char(a) if a == b else f"{char(a)}-{char(b)}" for a, b in ranges)
    return f"^[^{body}]*$"


_TOOL_MESSAGE = {
    "if": {"properties": {"role": {"const": "tool"}}, "required": ["role"]},
    "then": {
        "required": ["content", "tool_call_id"],
        "properties": {"content": {"not": {"type": "null"}}, "tool_call_id": {"type": "string"}},
    },
}


def _request(schema: dict[str, Any], endpoint: Endpoint, facts: ServedFacts) -> None:
    properties = schema["properties"]
    for name, rule in rules_for(endpoint).items():
        if rule.status == "refused":
            properties[name] = {"enum": [None, *rule.no_op]}  # accepted at its no-op values only
    schema["additionalProperties"] = False  # any other field is a 400 naming it
    context, logprobs = facts.context, facts.max_logprobs
    given = {
        **sampling_schemas(facts),
        "max_tokens": _int(0, context),
        "min_tokens": _int(0, context),
        "n": _int(1, facts.max_num_seqs),
        "stop_token_ids": {"type": "array", "items": _TOKEN},
        "allowed_token_ids": {"type": "array", "items": _TOKEN, "minItems": 1},
        "prompt_logprobs": _int(0, logprobs),
        "truncate_prompt_tokens": {"anyOf": [{"const": -1}, _int(1, None)]},
        **_structured_fields(),
    }
    if endpoint == COMPLETIONS:
        given["prompt"] = _prompt(facts)
        given["logprobs"] = _int(0, logprobs)
    else:
        given["max_completion_tokens"] = _int(0, context)
        given["top_logprobs"] = _int(0, 20 if logprobs is None else min(20, logprobs))
        if not facts.splits_reasoning:
            given["include_reasoning"] = {"const": True}
        if not facts.trust_request_chat_template:
            given["chat_template"] = {"type": "null"}
            if not facts.has_chat_template:
                given["documents"] = given["chat_template_kwargs"] = {"type": "null"}
        messages = properties["messages"]
        if context is not None:
            messages["maxItems"] = context
        given["tools"] = {"type": "array", "items": _TOOL}
        given["tool_choice"] = tool_choice_schema(facts, _NAMED)
        if not facts.auto_tool_choice:
            schema["allOf"] = [NO_AUTO_TOOL_CHOICE]
    for name, value in given.items():
        properties[name] = value if name in schema.get("required", ()) else _nullable(value)


def sampling_schemas(facts: ServedFacts) -> dict[str, Any]:
    """The schemas of the fields every generation endpoint shares (completions, chat, responses): the model's
    names, the sampling values' ranges, stop strings, ``logit_bias`` over this vocabulary, ``request_id``.

    Example:
        >>> sampling_schemas(ServedFacts(("tiny",), 99, 48, 192, 20, 8, False))["top_p"]
        {'type': 'number', 'exclusiveMinimum': 0, 'maximum': 1}
    """
    return {
        "model": {"enum": list(facts.model_names)},
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": _int(-1, None),
        "seed": _int(-(2**63), 2**63 - 1),
        "stop": {"anyOf": [_text(), {"type": "array", "items": _text(), "maxItems": MAX_STOP_STRINGS}]},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "logit_bias": {
            "type": "object",
            "propertyNames": {"pattern": _id_pattern(facts.vocab_size)},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        },
        "request_id": {"type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS, "pattern": no_control_pattern()},
    }


def tool_choice_schema(facts: ServedFacts, named: dict[str, Any]) -> dict[str, Any]:
    """``tool_choice``: none, auto (where served), required, or a ``named`` function.

    Example:
        >>> facts = ServedFacts(("tiny",), 99, 48, 192, 20, 8, False, auto_tool_choice=False)
        >>> tool_choice_schema(facts, {"type": "object"})["anyOf"][0]
        {'enum': ['none', 'required']}
    """
    modes = ["none", "auto", "required"] if facts.auto_tool_choice else ["none", "required"]
    return {"anyOf": [{"enum": modes}, named]}


NO_AUTO_TOOL_CHOICE = {
    "if": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]},
    "then": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"type": "null"}}}},
}
"""Without ``auto`` served, tools need a ``tool_choice`` (its default, ``auto``, is refused)."""


def _structured_fields() -> dict[str, Any]:
    regex = {"type": "string", "minLength": 1, "format": "llguidance-regex"}
    grammar = {"type": "string", "minLength": 1, "format": "llguidance-grammar"}
    schema_text = {"type": "string", "format": "json-schema"}
    choice = {"type": "array", "items": _text(), "minItems": 1, "maxItems": MAX_CHOICES}
    json_schema = {"anyOf": [{"type": "object"}, schema_text]}
    kinds = {"json": json_schema, "regex": regex, "choice": choice, "grammar": grammar, "json_object": {"const": True}}
    one_kind = [
        {"type": "object", "required": [kind], "properties": {kind: value, "strict": _nullable({"type": "boolean"})},
         "additionalProperties": False}
        for kind, value in kinds.items()
    ]  # fmt: skip
    response_format = {
        "oneOf": [
            _object(type={"const": "text"}),
            _object(type={"const": "json_object"}),
            _object(
                type={"const": "json_schema"},
                json_schema=_object(
                    schema=json_schema,
                    name={"type": "string"},
                    description={"type": "string"},
                    strict={"type": "boolean"},
                ),
                required=("type", "json_schema"),
            ),
        ]
    }
    return {
        "guided_regex": regex,
        "guided_grammar": grammar,
        "guided_choice": choice,
        "guided_json": {"anyOf": [{"type": "object"}, schema_text]},
        "structured_outputs": {"oneOf": one_kind},
        "response_format": response_format,
    }


_FUNCTION: dict[str, Any] = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "description": {"type": "string"},
        "parameters": {"type": "object", "format": "json-schema"},
        "strict": {"type": "boolean"},
    },
    "additionalProperties": False,  # another key is a 400 naming it
}
_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {"type": {"const": "function"}, "function": _FUNCTION},
    "additionalProperties": False,
}
_NAMED = _object(
    type={"const": "function"}, function={**_FUNCTION, "properties": {"name": _FUNCTION["properties"]["name"]}}
)


def _prompt(facts: ServedFacts) -> dict[str, Any]:
    context = facts.context
    ids = {"type": "array", "items": _TOKEN, "minItems": 1, **({"maxItems": context} if context else {})}
    return {
        "anyOf": [
            _text(facts.max_prompt_chars),
            {"type": "array", "items": _text(facts.max_prompt_chars), "minItems": 1, "maxItems": MAX_PROMPTS},
            ids,
            {"type": "array", "items": ids, "minItems": 1, "maxItems": MAX_PROMPTS},
        ]
    }


def _given(present: str, absent: str) -> dict[str, Any]:
    """``present`` given (not null) and ``absent`` not."""
    return {
        "required": [present],
        "properties": {present: {"not": {"type": "null"}}},
        "not": {"required": [absent], "properties": {absent: {"not": {"type": "null"}}}},
    }


def _id_pattern(vocab_size: int | None) -> str:
    """A pattern of the decimal token ids below ``vocab_size`` (any non-negative integer when unknown).

    Example:
        >>> import re
        >>> pattern = _id_pattern(99)
        >>> [bool(re.fullmatch(pattern, s)) for s in ("0", "98", "99", "-1", "007")]
        [True, True, False, False, False]
    """
    if vocab_size is None:
        return "^(0|[1-9][0-9]*)$"
    return f"^({_below(str(vocab_size - 1))})$"


def _below(top: str) -> str:
    """A regex of the decimal numbers 0 ..= ``top`` without leading zeros."""
    parts = ["0"]
    for width in range(1, len(top)):  # every number with fewer digits
        parts.append("[1-9]" + "[0-9]" * (width - 1))
    parts.extend(_same_width(top))
    return "|".join(dict.fromkeys(p for p in parts if p))


def _same_width(top: str) -> list[str]:
    """Numbers of ``len(top)`` digits (no leading zero) that are <= ``top``."""
    out = []
    for i, digit in enumerate(top):
        low = 1 if i == 0 else 0
        if int(digit) > low:
            out.append(top[:i] + f"[{low}-{int(digit) - 1}]" + "[0-9]" * (len(top) - i - 1))
    if top != "0":
        out.append(top)
    return out
