"""A Responses request's ``input`` as chat messages, and a response's output as the assistant's turn of the
conversation a later ``previous_response_id`` continues.

Input items: a message (``{"role", "content"}``, with or without ``"type": "message"``; content as text or
``input_text`` / ``output_text`` / ``refusal`` parts), a ``function_call`` (the assistant's call; consecutive calls
are one assistant turn), a ``function_call_output`` (a tool message answering a call) and a ``reasoning`` item (the
reasoning of the assistant turn it precedes, for templates that render it). Anything else (images, files, built-in
tools' items, item references) is refused with a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any

from ..protocol import ApiError

__all__ = ["assistant_turn", "chat_messages"]

_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_ROLES = ("user", "assistant", "system", "developer")


def chat_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of an ``input``.

    Example:
        >>> messages = chat_messages([{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        ...                           {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        ...                           {"type": "function_call_output", "call_id": "c1", "output": "42"}])
        >>> [m["role"] for m in messages], messages[1]["tool_calls"][0]["function"], messages[2]["tool_call_id"]
        (['user', 'assistant', 'tool'], {'name': 'f', 'arguments': '{}'}, 'c1')
    """
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise ApiError(400, "input is an empty list", param="input")
    messages: list[dict[str, Any]] = []
    thought: str | None = None
    for index, item in enumerate(value):
        where = f"input.{index}"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "reasoning":
            thought = (thought or "") + _reasoning_text(item, where)
            continue
        message: dict[str, Any] | None
        if kind == "message":
            message = _message(item, where)
        elif kind == "function_call":
            message = _call(item, where, messages)
        elif kind == "function_call_output":
            message = _output(item, where)
        else:
            what = f"{kind!r} items are not supported" if kind is not None else "expected an object"
            raise ApiError(400, f"{where}: {what} (messages, function_call, function_call_output, reasoning)",
                           param=where)  # fmt: skip
        if thought is not None and message is not None and message["role"] == "assistant":
            message["reasoning_content"] = thought
            thought = None
        if message is not None:
            messages.append(message)
    if not messages:
        raise ApiError(400, "input has no message", param="input")
    return messages


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content: expected text or a list of text parts", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise ApiError(400, f"{where}.content.{j}: {kind!r} parts are not supported (text only)",
                           param=f"{where}.content.{j}.type")  # fmt: skip
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise ApiError(400, f"{where}.content.{j}: expected its text", param=f"{where}.content.{j}")
        texts.append(text)
    return "".join(texts)


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise ApiError(400, f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", param=f"{where}.role")
    return {"role": role, "content": _text(item.get("content"), where)}


def _call(item: dict[str, Any], where: str, messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A function call: a new assistant turn, or one more call of the assistant turn just before (None)."""
    name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
    if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(arguments, str):
        raise ApiError(400, f"{where}: a function_call needs name, call_id and arguments (text)", param=where)
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
        last["tool_calls"].append(call)
        return None
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _output(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str):
        raise ApiError(400, f"{where}: a function_call_output needs the call_id it answers", param=where)
    text = output if isinstance(output, str) else _text(output, where) if isinstance(output, list) else None
    if text is None:
        raise ApiError(400, f"{where}.output: expected text or text parts", param=f"{where}.output")
    return {"role": "tool", "content": text, "tool_call_id": call_id}


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    content, summary = item.get("content") or [], item.get("summary") or []
    if not isinstance(content, list) or not isinstance(summary, list):
        raise ApiError(400, f"{where}: reasoning content and summary are lists of parts", param=where)
    parts = [*content, *summary]
    texts = [part.get("text") for part in parts if isinstance(part, dict)]
    strings = [text for text in texts if isinstance(text, str)]
    if len(strings) != len(parts):
        raise ApiError(400, f"{where}: reasoning content and summary parts need their text", param=where)
    return "".join(strings)


def assistant_turn(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant's turn a response adds to its conversation: its content and tool calls (its reasoning stays
    out: templates drop the reasoning of past turns).

    Example:
        >>> assistant_turn({"role": "assistant", "content": "Hi", "reasoning_content": "hm"})
        {'role': 'assistant', 'content': 'Hi'}
    """
    turn: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        turn["tool_calls"] = [
            {"id": call["id"], "type": "function", "function": dict(call["function"])} for call in message["tool_calls"]
        ]
    return json.loads(json.dumps(turn))  # a copy that shares nothing with the answer
