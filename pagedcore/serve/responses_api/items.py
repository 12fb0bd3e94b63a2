"""A Responses request's ``input`` as chat messages, and a response's output as the assistant's turn of the
conversation a later ``previous_response_id`` continues.

Input items: a message (``{"role", "content"}``, with or without ``"type": "message"``; content as text or
``input_text`` / ``output_text`` / ``refusal`` parts), a ``function_call`` (the assistant's call; consecutive calls
are one assistant turn), a ``function_call_output`` (a tool message answering a call) and a ``reasoning`` item (the
reasoning of the assistant turn it precedes, for templates that render it). Anything else (images, files, built-in
tools' items, item references) is refused with a 400 naming it, as is a key an item or part does not have
(:data:`ITEM_KEYS`): the keys OpenAI's answers carry that change nothing here (``id``, ``status``, a message's
``phase``, an ``output_text``'s ``annotations`` and ``logprobs``) are taken, checked and left; encrypted reasoning
(``encrypted_content``) cannot be read and is refused.
"""

from __future__ import annotations

import json
import reprlib
from typing import Any

from ..protocol import ApiError

__all__ = ["ITEM_KEYS", "PART_KEYS", "assistant_turn", "chat_messages"]

_ROLES = ("user", "assistant", "system", "developer")
_SEEN = ("id", "status")  # as the API answered an item: of no effect here
ITEM_KEYS: dict[str, tuple[str, ...]] = {
    "message": ("type", "role", "content", "phase", *_SEEN),
    "function_call": ("type", "call_id", "name", "arguments", *_SEEN),
    "function_call_output": ("type", "call_id", "output", *_SEEN),
    "reasoning": ("type", "content", "summary", "encrypted_content", *_SEEN),
}
"""The keys each kind of input item may have."""
PART_KEYS: dict[str, tuple[str, ...]] = {
    "input_text": ("type", "text"),
    "text": ("type", "text"),
    "output_text": ("type", "text", "annotations", "logprobs"),
    "refusal": ("type", "refusal"),
}
"""The keys each kind of text part may have (the first after ``type`` holds its text)."""
_OF_NO_EFFECT: dict[str, tuple[Any, ...]] = {  # the values a key of no effect may take
    "status": (None, "in_progress", "completed", "incomplete"),
    "phase": (None, "commentary", "final_answer"),
    "encrypted_content": (None,),
}


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
        given = item.get("type", "message") if isinstance(item, dict) else None
        kind = given if isinstance(given, str) else None  # a list or an object is no kind (nor a dict key)
        if kind in ITEM_KEYS:
            _check_keys(item, ITEM_KEYS[kind], where)
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
            what = f"{reprlib.repr(given)} items are not supported" if isinstance(item, dict) else "expected an object"
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
    """A message's ``content`` (or an output's ``output``, ``where`` names it): text, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: expected text or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in PART_KEYS:
            raise ApiError(400, f"{where}.{j}: {kind!r} parts are not supported (text only)", param=f"{where}.{j}.type")
        _check_keys(part, PART_KEYS[kind], f"{where}.{j}")
        text = part.get(PART_KEYS[kind][1])
        if not isinstance(text, str):
            what = PART_KEYS[kind][1]
            raise ApiError(400, f"{where}.{j}: a {kind} part needs its {what} (text)", param=f"{where}.{j}.{what}")
        texts.append(text)
    return "".join(texts)


def _check_keys(value: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    """Refuse a key ``value`` does not have, or a key of no effect at a value it cannot take."""
    for key, got in value.items():
        if key not in keys:
            raise ApiError(400, f"{where}.{key}: no such field here", param=f"{where}.{key}")
        if not _fits(key, got):
            why = "encrypted reasoning cannot be read by this server" if key == "encrypted_content" else "bad value"
            raise ApiError(400, f"{where}.{key}: {why} (got {reprlib.repr(got)})", param=f"{where}.{key}")


def _fits(key: str, value: Any) -> bool:
    """Whether a key of no effect has a value it may take (the keys that are read are checked as they are read)."""
    if key in _OF_NO_EFFECT:
        return any(value is allowed or value == allowed for allowed in _OF_NO_EFFECT[key])
    if key == "id":
        return value is None or isinstance(value, str)
    if key in ("annotations", "logprobs"):
        return isinstance(value, list)
    return True


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise ApiError(400, f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", param=f"{where}.role")
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


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
    return {"role": "tool", "content": _text(output, f"{where}.output"), "tool_call_id": call_id}


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    content, summary = item.get("content"), item.get("summary")
    if not isinstance(content, (list, type(None))) or not isinstance(summary, (list, type(None))):
        raise ApiError(400, f"{where}: reasoning content and summary are lists of parts", param=where)
    texts = []
    for name, parts, kind in (("content", content, "reasoning_text"), ("summary", summary, "summary_text")):
        for j, part in enumerate(parts or ()):
            text = part.get("text") if isinstance(part, dict) and part.get("type") == kind else None
            if not isinstance(text, str) or set(part) != {"type", "text"}:
                message = f"{where}.{name}.{j}: expected {{'type': {kind!r}, 'text': ...}}"
                raise ApiError(400, message, param=f"{where}.{name}.{j}")
            texts.append(text)
    return "".join(texts)


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
