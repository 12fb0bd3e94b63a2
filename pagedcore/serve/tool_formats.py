"""More tool-call formats ``tool_choice="auto"`` reads (``--tool-call-parser``, vLLM's names), for the families this
project serves: Mistral (``mistral``), Qwen3-Coder (``qwen3_coder``), Llama 3.2 / 4's Python calls (``pythonic``)
and DeepSeek-V3 (``deepseek_v3``). Hermes / Qwen and Llama 3's JSON are in :mod:`pagedcore.serve.tool_calls`.

Each parser takes an answer's text and returns its content (None when it is only calls) and its calls
(``{"name": ..., "arguments": {...}}``); an answer that is not the format's calls is all content. The text is the
answer as the server decodes it: special tokens are left out, so a format's markers that are special tokens of the
model's tokenizer (Mistral's ``[TOOL_CALLS]``) may be absent, and the parser reads what is left.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["deepseek_v3_tool_calls", "mistral_tool_calls", "pythonic_tool_calls", "qwen3_coder_tool_calls"]

Call = dict[str, Any]
Schemas = Mapping[str, Mapping[str, Any]]  # each tool's parameters schema, by name


def _arguments(value: Any) -> dict[str, Any] | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def mistral_tool_calls(text: str, schemas: Schemas | None = None) -> tuple[str | None, list[Call]]:
    """Mistral's format: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (v3 tokenizers), or one
    ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11+); the text before the first marker is the content. Without the
    marker in the text (a special token, left out), an answer that is exactly such a JSON list is calls.

    Example:
        >>> mistral_tool_calls('[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]')
        (None, [{'name': 'f', 'arguments': {'x': 1}}])
        >>> mistral_tool_calls('Sure.[TOOL_CALLS]f[ARGS]{"x": 1}')
        ('Sure.', [{'name': 'f', 'arguments': {'x': 1}}])
    """
    marker = "[TOOL_CALLS]"
    if marker not in text:
        whole = _json_calls(text.strip())
        return (None, whole) if whole else (text, [])
    content, _, rest = text.partition(marker)
    calls: list[Call] = []
    for part in rest.split(marker):
        found = _json_calls(part.strip())
        if not found and "[ARGS]" in part:
            name, _, args = part.partition("[ARGS]")
            arguments = _arguments(args.strip())
            found = [{"name": name.strip(), "arguments": arguments}] if arguments is not None and name.strip() else []
        if not found:
            return text, []
        calls.extend(found)
    return content.strip() or None, calls


def _json_calls(text: str) -> list[Call]:
    """A JSON list (or one object) of ``{"name", "arguments"}`` calls, or [] when it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        name = item.get("name") if isinstance(item, dict) else None
        arguments = _arguments(item.get("arguments", item.get("parameters", {}))) if isinstance(item, dict) else None
        if not isinstance(name, str) or arguments is None:
            return []
        calls.append({"name": name, "arguments": arguments})
    return calls


_QWEN_CALL = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def qwen3_coder_tool_calls(text: str, schemas: Schemas | None = None) -> tuple[str | None, list[Call]]:
    """Qwen3-Coder's XML format: ``<tool_call><function=NAME><parameter=P>value</parameter>...</function>
    </tool_call>``; each value is text, converted by the tool's schema (integer, number, boolean, object, array,
    null) as vLLM does, kept as text for a string or an unknown parameter.

    Example:
        >>> text = "Let me look.<tool_call><function=f><parameter=n>\\n3\\n</parameter></function></tool_call>"
        >>> qwen3_coder_tool_calls(text, {"f": {"properties": {"n": {"type": "integer"}}}})
        ('Let me look.', [{'name': 'f', 'arguments': {'n': 3}}])
    """
    matches = list(_QWEN_CALL.finditer(text))
    if not matches:
        return text, []
    calls = []
    for match in matches:
        name = match.group(1)
        properties = ((schemas or {}).get(name) or {}).get("properties") or {}
        arguments = {key: _typed(value, properties.get(key)) for key, value in _QWEN_PARAMETER.findall(match.group(2))}
        calls.append({"name": name, "arguments": arguments})
    return text[: matches[0].start()].strip() or None, calls


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type (text when the schema says string, or says nothing)."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if not kinds or "string" in kinds:
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        try:
            parsed = ast.literal_eval(value)  # Python's True / None, single quotes
        except (ValueError, SyntaxError):
            return value
    return parsed


def pythonic_tool_calls(text: str, schemas: Schemas | None = None) -> tuple[str | None, list[Call]]:
    """Llama 3.2 / 4's Python calls: the answer is a list ``[f(a=1, b="x"), g()]`` of calls with literal keyword
    arguments (``<|python_start|>`` ... ``<|python_end|>`` around it are special tokens, left out).

    Example:
        >>> pythonic_tool_calls('[get_weather(city="Paris", days=2), now()]')
        (None, [{'name': 'get_weather', 'arguments': {'city': 'Paris', 'days': 2}}, {'name': 'now', 'arguments': {}}])
    """
    body = text.strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return text, []
    if not isinstance(tree, ast.List) or not tree.elts:
        return text, []
    calls = []
    for node in tree.elts:
        call = _python_call(node)
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


def _python_call(node: ast.expr) -> Call | None:
    if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
        return None
    name = ast.unparse(node.func)
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, SyntaxError):
            return None
    return {"name": name, "arguments": arguments}


_DEEPSEEK_BEGIN = "<｜tool▁calls▁begin｜>"
_DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>\s*(\w+)\s*<｜tool▁sep｜>\s*(.+?)\s*\n```(?:json)?\s*\n(.*?)\n\s*```\s*<｜tool▁call▁end｜>",
    re.DOTALL,
)


def deepseek_v3_tool_calls(text: str, schemas: Schemas | None = None) -> tuple[str | None, list[Call]]:
    """DeepSeek-V3's format: ``<｜tool▁calls▁begin｜>`` then per call
    ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``, the arguments in a fenced ``json`` block,
    ``<｜tool▁call▁end｜>``; the text before is the content.

    Example:
        >>> call = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{\\"x\\": 1}\\n```<｜tool▁call▁end｜>"
        >>> deepseek_v3_tool_calls("Ok." + _DEEPSEEK_BEGIN + call + "<｜tool▁calls▁end｜>")
        ('Ok.', [{'name': 'f', 'arguments': {'x': 1}}])
    """
    if _DEEPSEEK_BEGIN not in text:
        return text, []
    content, _, rest = text.partition(_DEEPSEEK_BEGIN)
    calls = []
    for kind, name, args in _DEEPSEEK_CALL.findall(rest):
        arguments = _arguments(args)
        if kind != "function" or arguments is None:
            return text, []
        calls.append({"name": name, "arguments": arguments})
    if not calls:
        return text, []
    return content.strip() or None, calls
