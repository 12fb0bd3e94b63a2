"""A response as OpenAI's Responses API shows it: the ``response`` object around its output items (a ``reasoning``
item, a ``message`` with its ``output_text``, ``function_call`` items), built from an answer's chat message
(:meth:`~pagedcore.serve.answers.Shape.message`: reasoning split off, tool calls parsed).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..answers import Choice, Tally
from .request import ResponsesRequest

__all__ = [
    "ResponseFrame",
    "choice_texts",
    "function_call_item",
    "message_item",
    "new_id",
    "output_items",
    "reasoning_item",
    "split_tokens",
    "usage_of",
]


def new_id(prefix: str) -> str:
    """A new item or response id (``msg_...``, ``rs_...``, ``fc_...``).

    Example:
        >>> new_id("msg").startswith("msg_")
        True
    """
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A ``reasoning`` output item holding the model's reasoning text.

    Example:
        >>> reasoning_item("rs_1", "Let me see.")["content"]
        [{'type': 'reasoning_text', 'text': 'Let me see.'}]
    """
    content = [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "encrypted_content": None,
            "status": status}  # fmt: skip


def message_item(item_id: str, text: str | None, logprobs: list[Any], status: str = "completed") -> dict[str, Any]:
    """A ``message`` output item (one ``output_text`` part unless ``text`` is None, as an item just opened).

    Example:
        >>> opened, done = message_item("msg_1", None, [], "in_progress"), message_item("msg_1", "Hi", [])
        >>> opened["content"], done["content"][0]["text"]
        ([], 'Hi')
    """
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def function_call_item(item_id: str, call: dict[str, Any], arguments: str | None = None) -> dict[str, Any]:
    """A ``function_call`` output item of one of the answer's ``tool_calls`` (``arguments``: as streamed so far).

    Example:
        >>> call = {"id": "call_1", "function": {"name": "f", "arguments": "{}"}}
        >>> item = function_call_item("fc_1", call)
        >>> item["call_id"], item["name"], item["arguments"], item["status"]
        ('call_1', 'f', '{}', 'completed')
    """
    function = call["function"]
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"] if arguments is None else arguments,
        "status": "completed" if arguments is None else "in_progress",
    }


def split_tokens(texts: Sequence[str], full: str, content: str | None) -> int:
    """How many of an answer's tokens (their texts, ``texts``) are its reasoning: those before its content, which
    ends ``full`` (all of them when it has no content).

    Example:
        >>> split_tokens(["<think>", "hm", "</think>", "Yes"], "<think>hm</think>Yes", "Yes")
        3
    """
    if content is None:
        return len(texts)
    start, seen = len(full) - len(content), 0
    for index, text in enumerate(texts):
        if seen >= start:
            return index
        seen += len(text)
    return len(texts)


@dataclass(frozen=True)
class ResponseFrame:
    """What a response shows besides its output: its id, creation time and model, and the request's settings.

    Example:
        >>> frame = ResponseFrame("resp_1", 0.0, "m", ResponsesRequest.model_validate({"input": "Hi"}), True)
        >>> frame.envelope("in_progress", [], None)["tool_choice"]
        'auto'
    """

    response_id: str
    created_at: float
    model: str
    body: ResponsesRequest
    store: bool
    defaults: dict[str, Any] | None = None

    def envelope(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The ``response`` object in ``status`` with these output items."""
        body, defaults = self.body, self.defaults or {}
        text_format = (body.text or {}).get("format") or {"type": "text"}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "error": error, "incomplete_details": incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "max_tool_calls": body.max_tool_calls, "model": self.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": self.store, "background": False, "service_tier": "default",
            "temperature": _pick(body.temperature, defaults.get("temperature"), 1.0),
            "top_p": _pick(body.top_p, defaults.get("top_p"), 1.0), "top_logprobs": body.top_logprobs,
            "text": {"format": text_format}, "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "truncation": body.truncation or "disabled", "usage": usage, "user": body.user,
            "safety_identifier": body.safety_identifier, "metadata": body.metadata or {},
        }  # fmt: skip


def _pick(*values: Any) -> Any:
    return next(value for value in values if value is not None)


def usage_of(tally: Tally, reasoning_tokens: int) -> dict[str, Any]:
    """The Responses API's ``usage`` of a finished answer: ``cached_tokens`` the prompt tokens read from the prefix
    cache, ``cache_write_tokens`` the others, which the engine computed and keeps there for later requests (none
    with prefix caching off).

    Example:
        >>> usage_of(Tally(["r"], 1), 0)["total_tokens"]
        0
    """
    written = tally.prompt_tokens - tally.cached_tokens if tally.keeps_prefixes else 0
    return {
        "input_tokens": tally.prompt_tokens,
        "input_tokens_details": {"cached_tokens": tally.cached_tokens, "cache_write_tokens": written},
        "output_tokens": tally.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": tally.prompt_tokens + tally.completion_tokens,
    }


def output_items(
    message: dict[str, Any], reason: str | None, logprobs: list[Any], ids: Callable[[str], str] = new_id
) -> list[dict[str, Any]]:
    """The output items of an answer's chat ``message``: its reasoning, its text (unless it only called tools, or
    said nothing), its calls.

    Example:
        >>> items = output_items({"content": "Hi", "reasoning_content": "hm"}, "stop", [])
        >>> [item["type"] for item in items]
        ['reasoning', 'message']
    """
    items = []
    if message.get("reasoning_content") is not None:
        items.append(reasoning_item(ids("rs"), message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if content is not None and (content or not calls):
        status = "incomplete" if reason == "length" else "completed"
        items.append(message_item(ids("msg"), content, logprobs, status))
    items.extend(function_call_item(ids("fc"), call) for call in calls)
    return items


def choice_texts(choice: Choice, decode: Callable[[int], str] | None) -> list[str]:
    """Each token's text of a choice (empty without a tokenizer).

    Example:
        >>> choice_texts(Choice(prompt=0, token_ids=[1, 2]), lambda token: "ab"[token - 1])
        ['a', 'b']
    """
    return [decode(token) for token in choice.token_ids] if decode is not None else []
