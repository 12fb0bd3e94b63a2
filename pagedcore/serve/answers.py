"""What an answer holds: the state of a job's choices as events come in (:class:`Tally`) and OpenAI's shapes for the
whole answer and its streamed chunks (:class:`Shape`).

A choice is one sample of one prompt (choice = prompt index * n + sample). What a request asked to see beside the
text (the echoed prompt, token ids, usage in every chunk) is in its :class:`AnswerOptions`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedcore.engine.outputs import TokenLogprobs

from .logprob_shapes import LogprobFormat, PromptEntry
from .loop import Delta, Finished
from .reasoning import AnswerReasoning
from .tool_calls import ToolCalls

__all__ = ["AnswerOptions", "Choice", "Shape", "Tally"]

_IDS = LogprobFormat(None, True)  # no tokenizer: tokens shown as token_id:ID


@dataclass(frozen=True)
class AnswerOptions:
    """What an answer shows beside each choice's text.

    Attributes:
        echo: per prompt, text put before each of its choices' text (completions' ``echo``; chat's ``echo`` of a
            last assistant message).
        prompt_token_ids: per prompt, its token ids (shown with ``return_token_ids``; the echoed prompt's
            log-probabilities are theirs), else None.
        return_token_ids: each choice's token ids in the answer.
        include_usage: a stream ends with a usage chunk.
        continuous_usage: every chunk of a stream carries the usage so far (vLLM's ``continuous_usage_stats``).
        logprobs: show each token's log-probabilities (the request's k; None: ``logprobs: null``).
        echo_logprobs: completions' ``echo`` with ``logprobs``: the prompt's positions come first.
        prompt_logprobs: show vLLM's ``prompt_logprobs`` (the request asked for them).
        format: how tokens and log-probabilities are shown.
        stop_token_ids: the stop tokens the request named: a choice that a stop token ended shows it as its
            ``stop_reason``, unless it is the model's eos the request did not name (then null, as vLLM's eos).

    Example:
        >>> AnswerOptions(echo=("Hi",)).prefix(0)
        'Hi'
    """

    echo: tuple[str, ...] = ()
    prompt_token_ids: tuple[tuple[int, ...], ...] | None = None
    return_token_ids: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: int | None = None
    echo_logprobs: bool = False
    prompt_logprobs: bool = False
    format: LogprobFormat = _IDS
    stop_token_ids: frozenset[int] = frozenset()

    def prefix(self, prompt: int) -> str:
        """The text before prompt ``prompt``'s choices."""
        return self.echo[prompt] if prompt < len(self.echo) else ""

    def stop_reason(self, choice: Choice) -> str | int | None:
        """vLLM's ``stop_reason`` of an ended ``choice``: the stop string, or the stop token id the request named,
        that ended it; null for the model's eos, the length, or a choice still running.

        Example:
            >>> AnswerOptions(stop_token_ids=frozenset({7})).stop_reason(Choice(0, reason="stop", stop_reason=7))
            7
            >>> AnswerOptions().stop_reason(Choice(0, reason="stop", stop_reason=2)) is None   # the model's eos
            True
        """
        reason = choice.stop_reason
        if isinstance(reason, int) and reason not in self.stop_token_ids:
            return None
        return reason


@dataclass
class Choice:
    """One choice's text, tokens, log-probabilities and end so far, and whether a stream has sent it a chunk yet
    (``shown_chars``: the characters of the tokens its stream showed in ``logprobs``, for ``text_offset``).

    Example:
        >>> Choice(prompt=0).text
        ''
    """

    prompt: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    reason: str | None = None
    stop_reason: str | int | None = None  # the engine's: the stop string or stop token id that ended it
    started: bool = False
    closed: bool = False
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    shown_chars: int = 0
    splitter: Any = None  # a streamed answer with a reasoning parser: its ThinkSplitter


class Tally:
    """The choices of a job and its token counts, as its events come in.

    Args:
        request_ids: the job's engine requests, one per prompt.
        n: samples per prompt.
        prompt_tokens: per prompt, its length when known before the engine reports it (for usage in every chunk:
            all of them, or none when the prompts are texts).
        keeps_prefixes: the engine keeps the prompt blocks it computes for later requests (the Responses API's
            ``cache_write_tokens``; False with prefix caching off).

    Example:
        >>> tally = Tally(["r0"], n=1)
        >>> _ = tally.add(Delta("r0", 0, "Hi", "length", (5,)))
        >>> _ = tally.add(Finished("r0", 3, (1,), ("length",)))
        >>> tally.choices[0].text, tally.usage()["total_tokens"]
        ('Hi', 4)
    """

    def __init__(
        self, request_ids: list[str], n: int, prompt_tokens: Sequence[int] = (), keeps_prefixes: bool = True
    ) -> None:
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._n = n
        self.choices = [Choice(prompt=i // n) for i in range(len(request_ids) * n)]
        self._prompt_lengths = list(prompt_tokens) or [0] * len(request_ids)  # per prompt; the engine's when done
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.num_finished = 0
        self.keeps_prefixes = keeps_prefixes  # the engine keeps the prompt blocks it computed (usage's cache writes)

    def add(self, event: Delta | Finished) -> list[int]:
        """Count one event; returns the choices it touched."""
        base = self._index[event.request_id] * self._n
        if isinstance(event, Delta):
            choice = self.choices[base + event.sample]
            choice.text += event.text
            choice.token_ids.extend(event.token_ids)
            if event.logprobs is not None:
                choice.logprobs.append(event.logprobs)
            if event.prompt_logprobs is not None and choice.prompt_logprobs is None:
                choice.prompt_logprobs = event.prompt_logprobs
            choice.reason = event.finish_reason or choice.reason
            if event.stop_reason is not None:
                choice.stop_reason = event.stop_reason
            return [base + event.sample]
        touched = list(range(base, base + self._n))
        self._prompt_lengths[self._index[event.request_id]] = event.prompt_tokens
        for sample, reason in enumerate(event.finish_reasons):
            choice = self.choices[base + sample]
            choice.reason = choice.reason or reason
        self.prompt_tokens += event.prompt_tokens
        self.completion_tokens += sum(event.completion_tokens)
        self.cached_tokens += event.cached_tokens
        self.num_finished += 1
        return touched

    def choice_usage(self, index: int) -> dict[str, Any]:
        """The usage of choice ``index`` so far: its prompt's tokens and the tokens it generated (vLLM's
        ``continuous_usage_stats``: every chunk carries its own choice's counts).

        Example:
            >>> tally = Tally(["r0", "r1"], n=2, prompt_tokens=[2, 4])
            >>> _ = tally.add(Delta("r1", 1, "Hi", None, (5,)))
            >>> tally.choice_usage(3)
            {'prompt_tokens': 4, 'completion_tokens': 1, 'total_tokens': 5}
        """
        choice = self.choices[index]
        prompt, completion = self._prompt_lengths[choice.prompt], len(choice.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def usage(self) -> dict[str, Any]:
        """OpenAI's ``usage`` object of the whole answer."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},  # OpenAI's field for prefix-cache hits
        }


@dataclass(frozen=True)
class Shape:
    """How one endpoint names and shapes its answers.

    Example:
        >>> shape = Shape(False, "cmpl-1", 0, "m")
        >>> shape.chunk(0, Choice(prompt=0), "Hi", None)["choices"]
        [{'index': 0, 'text': 'Hi', 'logprobs': None, 'finish_reason': None, 'stop_reason': None}]
    """

    chat: bool
    response_id: str
    created: int
    model: str
    options: AnswerOptions = AnswerOptions()
    tools: ToolCalls | None = None  # a chat with tools: answers that call them carry ``tool_calls``
    role: str = "assistant"  # chat answers' role (--response-role)
    reasoning: AnswerReasoning | None = None  # a chat with a reasoning parser: reasoning split off the content

    def chunk(
        self,
        index: int,
        choice: Choice,
        text: str,
        finish_reason: str | None,
        token_ids: Sequence[int] = (),
        logprobs: Sequence[TokenLogprobs] = (),
    ) -> dict[str, Any]:
        """One streamed chunk of choice ``index``: ``text`` is its new text, ``token_ids`` and ``logprobs`` its new
        tokens'; a choice's first chunk carries the role (chat), the prompt's token ids (with
        ``return_token_ids``) and the echoed prompt's log-probabilities."""
        body: dict[str, Any] = {"index": index}
        if self.chat:
            body["delta"] = self._delta(choice, text, finish_reason, token_ids)
        else:
            body["text"] = text
        body.update(logprobs=self._stream_logprobs(choice, token_ids, logprobs), finish_reason=finish_reason)
        body["stop_reason"] = self.options.stop_reason(choice) if finish_reason is not None else None
        if not self.chat and not choice.started and self.options.prompt_logprobs:
            body["prompt_logprobs"] = self.options.format.prompt(self._prompt_entries(choice))
        prompt_ids = None
        if self.options.return_token_ids:
            body["token_ids"] = list(token_ids)
            if not choice.started and self.options.prompt_token_ids is not None:
                prompt_ids = list(self.options.prompt_token_ids[choice.prompt])
                if not self.chat:
                    body["prompt_token_ids"] = prompt_ids
        chunk = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [body])
        if self.chat and prompt_ids is not None:
            chunk["prompt_token_ids"] = prompt_ids  # vLLM: chat has it beside the choices, in the first chunk
        if self.chat and not choice.started and self.options.prompt_logprobs:
            chunk["prompt_logprobs"] = self.options.format.prompt(self._prompt_entries(choice))
        return chunk

    def _delta(
        self, choice: Choice, text: str, finish_reason: str | None, token_ids: Sequence[int] = ()
    ) -> dict[str, Any]:
        """A chat chunk's delta: the role in a choice's first, its new content (and reasoning, split as it streams)."""
        delta: dict[str, Any] = {"role": self.role, "content": ""} if not choice.started else {}
        if self.reasoning is None:
            if text:
                delta["content"] = text
            return delta
        if choice.splitter is None:
            choice.splitter = self.reasoning.splitter()
        thought, content = choice.splitter.feed(text, token_ids)
        if finish_reason is not None:
            more_thought, more_content = choice.splitter.flush()
            thought, content = thought + more_thought, content + more_content
        fields = self.reasoning.fields(thought or None, content or None)
        delta.update((key, value) for key, value in fields.items() if value is not None)
        return delta

    def response(self, tally: Tally) -> dict[str, Any]:
        """The whole (not streamed) answer."""
        choices = []
        for index, choice in enumerate(tally.choices):
            text = self.options.prefix(choice.prompt) + choice.text
            body: dict[str, Any] = {"index": index}
            reason = choice.reason
            if self.chat:
                body["message"], reason = self.message(text, reason, choice.token_ids)
            else:
                body["text"] = text
            body.update(
                logprobs=self._logprobs(choice), finish_reason=reason, stop_reason=self.options.stop_reason(choice)
            )
            if not self.chat and self.options.prompt_logprobs:
                body["prompt_logprobs"] = self.options.format.prompt(self._prompt_entries(choice))
            if self.options.return_token_ids:
                body["token_ids"] = list(choice.token_ids)
                if not self.chat and self.options.prompt_token_ids is not None:
                    body["prompt_token_ids"] = list(self.options.prompt_token_ids[choice.prompt])
            choices.append(body)
        answer = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        answer["usage"] = tally.usage()
        if self.chat and self.options.return_token_ids and self.options.prompt_token_ids is not None:
            answer["prompt_token_ids"] = list(self.options.prompt_token_ids[0])
        if self.chat and self.options.prompt_logprobs and tally.choices:
            answer["prompt_logprobs"] = self.options.format.prompt(self._prompt_entries(tally.choices[0]))
        return answer

    def message(
        self, text: str, reason: str | None, token_ids: Sequence[int] = ()
    ) -> tuple[dict[str, Any], str | None]:
        """A chat answer's message and finish reason: with tools, a finished answer that called them has
        ``tool_calls`` and the reason ``"tool_calls"`` (an answer cut by its length is left as text). ``token_ids``:
        the answer's tokens (a reasoning format of special tokens reads them).

        Example:
            >>> Shape(True, "chatcmpl-1", 0, "m").message("Hi", "stop")
            ({'role': 'assistant', 'content': 'Hi'}, 'stop')
        """
        thought: str | None = None
        content: str | None = text
        if self.reasoning is not None:
            thought, content = self.reasoning.split(text, token_ids)
        if self.tools is None or reason != "stop" or content is None:
            message = {"role": self.role, **self._reasoned(thought, content)}
            return message, reason
        message = {**self.tools.message(content), "role": self.role}
        message.update((k, v) for k, v in self._reasoned(thought, message["content"]).items() if k != "content")
        return message, "tool_calls" if "tool_calls" in message else reason

    def _reasoned(self, thought: str | None, content: str | None) -> dict[str, Any]:
        """A message's content (and reasoning, with a reasoning parser)."""
        if self.reasoning is None:
            return {"content": content}
        return self.reasoning.fields(thought, content)

    def tool_chunk(self, index: int, choice: Choice, finish_reason: str | None) -> dict[str, Any]:
        """The one chunk of a streamed chat answer with tools, once it has ended: its whole content or its
        ``tool_calls`` in one delta (the text is held until the end, to know which it is), with its tokens' ids
        and log-probabilities when asked for.

        Example:
            >>> from pagedcore.serve.tool_calls import ToolCalls
            >>> shape = Shape(True, "chatcmpl-1", 0, "m", tools=ToolCalls("named", "f"))
            >>> chunk = shape.tool_chunk(0, Choice(prompt=0, text='{"x": 1}'), "stop")["choices"][0]
            >>> chunk["delta"]["tool_calls"][0]["function"], chunk["finish_reason"]
            ({'name': 'f', 'arguments': '{"x": 1}'}, 'tool_calls')
        """
        message, reason = self.message(
            self.options.prefix(choice.prompt) + choice.text, finish_reason, choice.token_ids
        )
        chunk = self.chunk(index, choice, "", reason, choice.token_ids, choice.logprobs)
        delta = chunk["choices"][0]["delta"]
        delta.update((key, value) for key, value in message.items() if key != "role")
        if delta.get("content") is None:
            delta.pop("content", None)
        return chunk

    def _logprobs(self, choice: Choice) -> dict[str, Any] | None:
        """A whole choice's ``logprobs`` (None unless asked)."""
        if self.options.logprobs is None:
            return None
        if self.chat:
            return self.options.format.chat(choice.logprobs)
        positions = self._prompt_entries(choice) if self.options.echo_logprobs else []
        positions += list(zip(choice.token_ids, choice.logprobs))
        return self.options.format.completion(positions)

    def _stream_logprobs(
        self, choice: Choice, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]
    ) -> dict[str, Any] | None:
        """The ``logprobs`` of one chunk's tokens (the echoed prompt's too in a choice's first chunk)."""
        if self.options.logprobs is None:
            return None
        if self.chat:
            return self.options.format.chat(logprobs)
        positions = self._prompt_entries(choice) if self.options.echo_logprobs and not choice.started else []
        positions += list(zip(token_ids, logprobs))
        shown = self.options.format.completion(positions, choice.shown_chars)
        choice.shown_chars += sum(len(token) for token in shown["tokens"])
        return shown

    def _prompt_entries(self, choice: Choice) -> list[PromptEntry]:
        ids = self.options.prompt_token_ids
        if ids is None or choice.prompt_logprobs is None:
            return []
        return list(zip(ids[choice.prompt], choice.prompt_logprobs))

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk of a stream with ``stream_options.include_usage``."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage
        return body

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
