"""Tool calling: a request's ``tools`` / ``tool_choice`` as a constraint, and the model's output as OpenAI's
``tool_calls``.

- ``tool_choice="required"`` and a named function are enforced by a grammar (vLLM's way): the output is constrained
  to a compact JSON list of ``{"name": ..., "parameters": {...}}`` calls (one of the tools each, its parameters
  valid against the tool's schema; exactly one call without ``parallel_tool_calls``), or, for a named function, to
  that function's arguments. Either way the answer's ``tool_calls`` come from that JSON, so they always parse
  and validate.
- ``"auto"`` (the default with tools) leaves the output free and reads the calls the model wrote in its chat
  template's format with a parser from :data:`TOOL_PARSERS` (Hermes / Qwen ``<tool_call>{json}</tool_call>``, and
  Llama 3's bare JSON); a new model's format is one function added there.
- ``"none"``: the tools are rendered, nothing is parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedcore.engine.structured import StructuredOutput
from pagedcore.validation import unknown_key

from .protocol import ApiError
from .tool_formats import deepseek_v3_tool_calls, mistral_tool_calls, pythonic_tool_calls, qwen3_coder_tool_calls

__all__ = ["TOOL_PARSERS", "ToolCalls", "hermes_tool_calls", "llama3_json_tool_calls", "tool_calls_of"]

Call = dict[str, Any]  # {"name": ..., "arguments": {...}}


def hermes_tool_calls(text: str) -> tuple[str | None, list[Call]]:
    """Hermes / Qwen 2.5 format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; the text before
    the first is the content. Blocks that are not such JSON are left in the content.

    Example:
        >>> hermes_tool_calls('Sure. <tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
        ('Sure.', [{'name': 'f', 'arguments': {'x': 1}}])
    """
    calls = []
    for block in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
        call = _call(block)
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    content = text[: text.index("<tool_call>")].strip()
    return content or None, calls


def llama3_json_tool_calls(text: str) -> tuple[str | None, list[Call]]:
    """Llama 3's JSON format: the whole answer (after an optional ``<|python_tag|>``) is ``{"name": ...,
    "parameters": {...}}``, or several separated by ``;``.

    Example:
        >>> llama3_json_tool_calls('{"name": "f", "parameters": {"x": 1}}')
        (None, [{'name': 'f', 'arguments': {'x': 1}}])
    """
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = [_call(part) for part in body.split(";")]
    if any(call is None for call in calls):
        return text, []
    return None, [call for call in calls if call is not None]


TOOL_PARSERS: dict[str, Callable[..., tuple[str | None, list[Call]]]] = {
    "hermes": hermes_tool_calls,
    "llama3_json": llama3_json_tool_calls,
    "mistral": mistral_tool_calls,  # these four: pagedcore.serve.tool_formats (they take the tools' schemas too)
    "qwen3_coder": qwen3_coder_tool_calls,
    "pythonic": pythonic_tool_calls,
    "deepseek_v3": deepseek_v3_tool_calls,
}
"""The tool-call formats ``tool_choice="auto"`` reads, by name; each takes the answer's text and returns its content
(None when it is only calls) and its calls."""


def _call(text: str) -> Call | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return {"name": value["name"], "arguments": arguments} if isinstance(arguments, dict) else None


@dataclass(frozen=True)
class ToolCalls:
    """How one chat request's answers become ``tool_calls``.

    Attributes:
        mode: ``"auto"`` (parse with ``parser``), ``"required"`` (the answer is a JSON list of calls), ``"named"``
            (the answer is ``function``'s arguments).
        function: the named function (``"named"`` only).
        parser: the format ``"auto"`` reads (a key of :data:`TOOL_PARSERS`).

    Example:
        >>> ToolCalls("named", "f").message('{"x": 1}')["tool_calls"][0]["function"]
        {'name': 'f', 'arguments': '{"x": 1}'}
    """

    mode: str
    function: str | None = None
    parser: str = "hermes"
    schemas: dict[str, Any] | None = field(default=None, compare=False)  # each tool's parameters, by name

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        """The content and calls of one answer (no calls when it is not what the mode expects)."""
        if self.mode == "named":
            try:
                arguments = json.loads(text)
            except ValueError:
                return text, []
            return None, [{"name": self.function, "arguments": arguments}]
        if self.mode == "required":
            try:
                return None, [{"name": c["name"], "arguments": c["parameters"]} for c in json.loads(text)]
            except (ValueError, TypeError, KeyError):  # not the grammar's whole output (e.g. cut by a stop string)
                return text, []
        if self.parser in ("hermes", "llama3_json"):
            return TOOL_PARSERS[self.parser](text)
        return TOOL_PARSERS[self.parser](text, self.schemas)

    def message(self, text: str) -> dict[str, Any]:
        """The ``message`` (or a stream's last ``delta``) of one answer: ``content`` and, when it called tools,
        ``tool_calls`` as OpenAI sends them (arguments as JSON text, an id per call)."""
        content, calls = self.parse(text)
        out: dict[str, Any] = {"role": "assistant", "content": content if calls else text}
        if calls:
            out["tool_calls"] = [
                {
                    "index": i,
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
                }
                for i, c in enumerate(calls)
            ]
        return out


def tool_calls_of(data: dict[str, Any], parser: str = "hermes") -> tuple[ToolCalls | None, StructuredOutput | None]:
    """What a chat body's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask: how to read the answers
    (None: no tool calls) and the constraint that enforces them (None for ``auto`` and ``none``); raises
    :class:`~pagedcore.serve.protocol.ApiError` naming the bad field.

    Example:
        >>> tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        >>> calls, spec = tool_calls_of({"tools": [tool], "tool_choice": "required"})
        >>> calls.mode, spec.kind
        ('required', 'json_schema')
    """
    tools = _tools(data.get("tools"))
    choice = data.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        return None, None
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None, None
    if choice == "auto":
        return ToolCalls("auto", parser=parser, schemas=tools), None
    if choice == "required":
        parallel = data.get("parallel_tool_calls")
        schema = _calls_schema(tools, parallel is not False)
        return ToolCalls("required"), StructuredOutput.json_schema(schema, max_whitespace=0)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if isinstance(choice, dict):
        only_keys(choice, ("type", "function"), "tool_choice", "tool_choice")
        if isinstance(function, dict):
            only_keys(function, ("name",), "tool_choice.function", "tool_choice")
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(
            400,
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
            f"got {choice!r}"[:300],
            param="tool_choice",
        )
    if name not in tools:
        raise ApiError(400, f"tool_choice names {name!r}, which is not one of the tools", param="tool_choice")
    return ToolCalls("named", name), StructuredOutput.json_schema(tools[name], max_whitespace=0)


def only_keys(value: dict[str, Any], known: tuple[str, ...], where: str, param: str) -> None:
    """Refuse (400, naming it) a key of ``value`` that is not ``known``: a misspelt key would be ignored.

    Example:
        >>> only_keys({"type": "function", "fuction": {}}, ("type", "function"), "tool_choice", "tool_choice")
        Traceback (most recent call last):
        ...
        pagedcore.serve.protocol.ApiError: tool_choice.fuction is not a field here (known: type, function)
    """
    key = unknown_key(value, known)
    if key is not None:
        raise ApiError(400, f"{where}.{key} is not a field here (known: {', '.join(known)})", param=param)


def _tools(value: Any) -> dict[str, dict[str, Any]]:
    """Each function tool's parameters schema, by name."""
    if value is None:
        return {}
    if not isinstance(value, list):
        raise ApiError(400, f"tools must be a list, got {type(value).__name__}", param="tools")
    out: dict[str, dict[str, Any]] = {}
    first: dict[str, int] = {}
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            expected = "{'type': 'function', 'function': {'name': ...}}"
            raise ApiError(400, f"tools.{i}: expected {expected}", param="tools")
        if name in first:  # the model calls tools by name: a second one would silently win
            message = f"tools.{i}: the name {name!r} is given twice (tools.{first[name]}); tool names must be unique"
            raise ApiError(400, message, param="tools")
        first[name] = i
        only_keys(tool, ("type", "function"), f"tools.{i}", "tools")
        only_keys(function, ("name", "description", "parameters", "strict"), f"tools.{i}.function", "tools")  # type: ignore[arg-type]
        parameters = function.get("parameters") or {"type": "object", "properties": {}}  # type: ignore[union-attr]
        if not isinstance(parameters, dict):
            raise ApiError(400, f"tools.{i}.function.parameters must be a JSON schema object", param="tools")
        out[name] = parameters
    return out


def _calls_schema(tools: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON list of calls, each one of ``tools`` with its parameters (vLLM's schema for ``required``). Each tool's
    schema moves under ``#/items/anyOf/i/properties/parameters``: its local references (``$ref: "#/$defs/X"``,
    pydantic's way for nested models) are rebased there, so they still point into its own schema.

    Example:
        >>> nested = {"$defs": {"A": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/A"}}}
        >>> _calls_schema({"f": nested}, True)["items"]["anyOf"][0]["properties"]["parameters"]["properties"]
        {'a': {'$ref': '#/items/anyOf/0/properties/parameters/$defs/A'}}
    """
    each = []
    for i, (name, own) in enumerate(tools.items()):
        parameters = _rebased(own, f"#/items/anyOf/{i}/properties/parameters")
        each.append(
            {"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
             "required": ["name", "parameters"], "additionalProperties": False}
        )  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": each}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# Keywords whose value maps names to schemas (the names are no keywords), and those whose values are data.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_DATA = frozenset({"const", "enum", "default", "examples", "required"})


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with every local ``$ref`` (``#...``) pointing under ``base`` instead of its own root."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased(sub, base) for name, sub in value.items()}
        elif key in _DATA:
            out[key] = value
        else:
            out[key] = _rebased(value, base)
    return out
