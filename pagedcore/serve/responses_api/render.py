"""The Responses API's answers to a finished or running job: the whole ``response`` object, or the server-sent
events the openai client's ``responses.stream`` reads (``response.created``, ``response.in_progress``, per output
item ``response.output_item.added`` ... ``response.output_item.done`` with its parts' deltas, then
``response.completed`` (also past ``max_output_tokens``: the response's status says ``incomplete``), or
``response.failed``).

Reasoning streams as it comes (``response.reasoning_text.delta``), as does text, except with tools: an answer's
text is held until it ends, to know whether it is text or calls (as chat streams it).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from ..answers import Choice, Shape, Tally
from ..jobs import Job, error_of
from ..loop import Delta, Finished
from ..protocol import ApiError
from .output import (
    ResponseFrame,
    choice_texts,
    function_call_item,
    message_item,
    new_id,
    output_items,
    reasoning_item,
    split_tokens,
    usage_of,
)

__all__ = ["ResponsesRenderer"]

Done = Callable[[dict[str, Any], dict[str, Any]], None]


class ResponsesRenderer:
    """Renders one job's answer (one choice) as a response; ``on_done(response, message)`` is called with the
    finished response and its chat message (to keep it for ``previous_response_id``).

    Args:
        frame: the response's id, model and request.
        shape: the chat shape of the answer (reasoning, tools, logprobs).
        decode: one token's text (to count the reasoning's tokens; None: no tokenizer).
        on_done: called once the response finished well.

    Example:
        >>> sorted(name for name in vars(ResponsesRenderer) if not name.startswith("_"))
        ['events', 'logprobs', 'reasoning_tokens', 'response']
    """

    def __init__(self, frame: ResponseFrame, shape: Shape, decode: Callable[[int], str] | None, on_done: Done) -> None:
        self.frame = frame
        self.shape = shape
        self.decode = decode
        self.on_done = on_done

    def response(self, tally: Tally) -> dict[str, Any]:
        """The whole response of a finished job."""
        choice = tally.choices[0]
        message, reason = self.shape.message(choice.text, choice.reason, choice.token_ids)
        thought_tokens = self.reasoning_tokens(choice, message)
        logprobs = self.logprobs(choice)[thought_tokens:]
        items = output_items(message, reason, logprobs)
        response = self.frame.envelope(_status(reason), items, usage_of(tally, thought_tokens))
        self.on_done(response, message)
        return response

    async def events(
        self, job: Job, tally: Tally, *, on_error: Callable[[ApiError], ApiError], on_finish: Callable[[], None]
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed response."""
        stream = _Stream(self)
        yield stream.event("response.created", response=self.frame.envelope("in_progress", [], None))
        yield stream.event("response.in_progress", response=self.frame.envelope("in_progress", [], None))
        async for event in job.events():
            if isinstance(event, Finished) and event.error is not None:
                job.abort()
                error = on_error(error_of(event))
                failed = {"code": error.code or "server_error", "message": error.message}
                response = self.frame.envelope("failed", stream.items, None, failed)
                yield stream.event("response.failed", response=response)
                return
            tally.add(event)
            if isinstance(event, Delta) and event.sample == 0:
                for line in stream.delta(event):
                    yield line
        for line in stream.finish(tally):
            yield line
        on_finish()

    def reasoning_tokens(self, choice: Choice, message: dict[str, Any]) -> int:
        """How many of the answer's tokens are its reasoning (its markers included)."""
        if message.get("reasoning_content") is None:
            return 0
        reasoning = self.shape.reasoning
        counted = None if reasoning is None else reasoning.thought_tokens(choice.token_ids)
        if counted is not None:  # a format of special tokens: counted from the tokens, the text lacks its markers
            return counted
        return split_tokens(choice_texts(choice, self.decode), choice.text, message.get("content"))

    def logprobs(self, choice: Choice) -> list[Any]:
        """Every token's log-probabilities as ``output_text`` shows them (none unless asked for)."""
        options = self.shape.options
        if options.logprobs is None:
            return []
        return list(options.format.chat(choice.logprobs)["content"])


def _status(reason: str | None) -> str:
    return "incomplete" if reason == "length" else "completed"


class _Stream:
    """One streamed response's events and open items."""

    def __init__(self, renderer: ResponsesRenderer) -> None:
        self.renderer = renderer
        shape = renderer.shape
        self._numbers = itertools.count()
        self._splitter = shape.reasoning.splitter() if shape.reasoning is not None else None
        self._hold = shape.tools is not None
        self.items: list[dict[str, Any]] = []  # closed items, in output order
        self._thought: dict[str, Any] | None = None  # the open reasoning item: id, index, text
        self._text: dict[str, Any] | None = None  # the open message item: id, index, text, logprobs

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, **fields, "sequence_number": next(self._numbers)}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def delta(self, delta: Delta) -> Iterator[str]:
        thought, content = (
            ("", delta.text) if self._splitter is None else self._splitter.feed(delta.text, delta.token_ids)
        )
        if delta.finish_reason is not None and self._splitter is not None:
            more_thought, more_content = self._splitter.flush()
            thought, content = thought + more_thought, content + more_content
        if thought:
            yield from self._reason(thought)
        if content:
            yield from self._close_reasoning()
            if not self._hold:
                yield from self._say(content, delta)

    def _reason(self, text: str) -> Iterator[str]:
        if self._thought is None:
            self._thought = {"id": new_id("rs"), "index": len(self.items), "text": ""}
            item = reasoning_item(self._thought["id"], "", "in_progress")
            yield self.event("response.output_item.added", output_index=self._thought["index"], item=item)
            part = {"type": "reasoning_text", "text": ""}
            yield self.event("response.content_part.added", **self._at(self._thought), part=part)
        self._thought["text"] += text
        yield self.event("response.reasoning_text.delta", **self._at(self._thought), delta=text)

    def _close_reasoning(self) -> Iterator[str]:
        if self._thought is None or self._thought.get("closed"):
            return
        thought = self._thought
        thought["closed"] = True
        yield self.event("response.reasoning_text.done", **self._at(thought), text=thought["text"])
        part = {"type": "reasoning_text", "text": thought["text"]}
        yield self.event("response.content_part.done", **self._at(thought), part=part)
        item = reasoning_item(thought["id"], thought["text"])
        self.items.append(item)
        yield self.event("response.output_item.done", output_index=thought["index"], item=item)

    def _say(self, text: str, delta: Delta | None, logprobs: list[Any] | None = None) -> Iterator[str]:
        if self._text is None:
            self._text = {"id": new_id("msg"), "index": len(self.items), "text": "", "logprobs": []}
            item = message_item(self._text["id"], None, [], "in_progress")
            yield self.event("response.output_item.added", output_index=self._text["index"], item=item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield self.event("response.content_part.added", **self._at(self._text), part=part)
        if logprobs is None:
            logprobs = self._token_logprobs(delta)
        self._text["text"] += text
        self._text["logprobs"].extend(logprobs)
        yield self.event("response.output_text.delta", **self._at(self._text), delta=text, logprobs=logprobs)

    def _token_logprobs(self, delta: Delta | None) -> list[Any]:
        options = self.renderer.shape.options
        if delta is None or options.logprobs is None or delta.logprobs is None:
            return []
        return list(options.format.chat([delta.logprobs])["content"])

    def _close_text(self, status: str) -> Iterator[str]:
        text = self._text
        if text is None:
            return
        yield self.event("response.output_text.done", **self._at(text), text=text["text"], logprobs=text["logprobs"])
        part = {"type": "output_text", "text": text["text"], "annotations": [], "logprobs": text["logprobs"]}
        yield self.event("response.content_part.done", **self._at(text), part=part)
        item = message_item(text["id"], text["text"], text["logprobs"], status)
        self.items.append(item)
        yield self.event("response.output_item.done", output_index=text["index"], item=item)

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": item["index"], "content_index": 0}

    def finish(self, tally: Tally) -> Iterator[str]:
        renderer = self.renderer
        choice = tally.choices[0]
        message, reason = renderer.shape.message(choice.text, choice.reason, choice.token_ids)
        yield from self._close_reasoning()
        if self._hold:
            content, calls = message.get("content"), message.get("tool_calls") or []
            if content is not None and (content or not calls):
                skipped = renderer.reasoning_tokens(choice, message)
                yield from self._say(content, None, renderer.logprobs(choice)[skipped:])
            yield from self._close_text(_status(reason))
            for call in calls:
                yield from self._call(call)
        else:
            yield from self._close_text(_status(reason))
        usage = usage_of(tally, renderer.reasoning_tokens(choice, message))
        response = renderer.frame.envelope(_status(reason), self.items, usage)
        renderer.on_done(response, message)
        # An answer cut at max_output_tokens ends with response.completed too (its status says incomplete), as
        # vLLM's: the openai client's get_final_response() reads only that event.
        yield self.event("response.completed", response=response)

    def _call(self, call: dict[str, Any]) -> Iterator[str]:
        item_id, index = new_id("fc"), len(self.items)
        added = function_call_item(item_id, call, "")
        yield self.event("response.output_item.added", output_index=index, item=added)
        arguments = call["function"]["arguments"]
        at = {"item_id": item_id, "output_index": index}
        yield self.event("response.function_call_arguments.delta", **at, delta=arguments)
        yield self.event("response.function_call_arguments.done", **at, arguments=arguments)
        item = function_call_item(item_id, call)
        self.items.append(item)
        yield self.event("response.output_item.done", output_index=index, item=item)
