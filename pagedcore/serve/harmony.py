"""gpt-oss's channel format ("harmony"), as ``--reasoning-parser openai_gptoss`` (vLLM's name) reads it.

gpt-oss writes its answer as messages on channels, each ``<|channel|>NAME<|message|>TEXT<|end|>``, a later one
after ``<|start|>assistant``, the last ending with ``<|return|>`` (its eos) or ``<|call|>``::

    <|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>

The ``analysis`` channel is the reasoning (``reasoning_content``); the ``final`` channel is the answer (``content``),
as are ``commentary`` messages (tool-call preambles); headers (the role, the channel, ``<|constrain|>json``, a
recipient ``to=...``) are neither. An answer without any channel is all content.

The markers are special tokens of gpt-oss's tokenizer, which the text of an answer leaves out, so the splitter here
reads the answer's token ids and decodes them itself with the special tokens kept (:class:`HarmonySplitter`); a
marker split across deltas is held back, as the ``<think>`` splitter does. Where the answer starts is read from the
generation prompt (:func:`harmony_state`: gpt-oss's template ends ``<|start|>assistant``, the model then opens a
channel). A structured output or a required tool call constrains the ``final`` message only: the grammar lets the
model write any number of ``analysis`` messages first (:func:`harmony_grammar`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedcore.engine.detokenizer import IncrementalDetokenizer
from pagedcore.errors import ConfigError

__all__ = [
    "HARMONY_MARKERS",
    "HarmonyFormat",
    "HarmonySplitter",
    "harmony_grammar",
    "harmony_state",
    "thought_tokens",
]

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
HARMONY_MARKERS = (START, END, MESSAGE, CHANNEL, RETURN, CALL, CONSTRAIN)
"""The special tokens of the format (gpt-oss's tokenizer has each as one token)."""

_REASONING_CHANNELS = ("analysis",)
_INSIDE, _ENDED, _OPEN = "inside", "ended", "open"  # as pagedcore.serve.reasoning's INSIDE, ENDED, OPEN


@dataclass(frozen=True)
class HarmonyFormat:
    """The channel format (see the module docstring).

    Attributes:
        name: the ``--reasoning-parser`` name.

    Example:
        >>> HarmonyFormat("openai_gptoss").disabled
        '<|channel|>final<|message|>'
    """

    name: str

    @property
    def disabled(self) -> str:
        """What the plain chat template writes after ``assistant:`` for ``enable_thinking: false``: the final
        channel opened, so the model answers at once."""
        return f"{CHANNEL}final{MESSAGE}"

    def marker_ids(self, tokenizer: Any) -> dict[str, int]:
        """Each marker's token id; raises :class:`~pagedcore.errors.ConfigError` for a tokenizer without them (the
        format cannot be read from its text: the markers would be left out of it)."""
        ids: dict[str, int] = {}
        for marker in HARMONY_MARKERS:
            try:
                encoded = tokenizer(marker, add_special_tokens=False)["input_ids"]
            except Exception:
                encoded = []
            if len(encoded) != 1:
                raise ConfigError(
                    f"--reasoning-parser {self.name} reads gpt-oss's channel format: the tokenizer must have "
                    f"{marker} as one token (gpt-oss's tokenizer has)"
                )
            ids[marker] = int(encoded[0])
        return ids


def harmony_state(generation_prompt: str) -> str:
    """Where an answer starts, from the text (special tokens kept) the template wrote after the last message: inside
    an ``analysis`` message, in the ``final`` one (ended), or before any channel (open).

    Example:
        >>> harmony_state("<|start|>assistant"), harmony_state("<|start|>assistant<|channel|>final<|message|>")
        ('open', 'ended')
    """
    opened = generation_prompt.rfind(MESSAGE)
    closed = max(generation_prompt.rfind(marker) for marker in (END, RETURN, CALL, START))
    if opened < 0 or closed > opened:
        return _OPEN
    channel = _channel(generation_prompt[:opened])
    return _INSIDE if channel in _REASONING_CHANNELS else _ENDED


def _channel(header: str) -> str:
    """The channel a message header names (its last ``<|channel|>``'s word), or "" without one."""
    at = header.rfind(CHANNEL)
    if at < 0:
        return ""
    words = header[at + len(CHANNEL) :].split(CONSTRAIN)[0].split()
    return words[0] if words else ""


class _Specials:
    """A tokenizer's decode that keeps the special tokens (the markers)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))


class HarmonySplitter:
    """One answer, fed its tokens as it streams, split into reasoning and content (see the module docstring).

    Args:
        tokenizer: the model's tokenizer (its special tokens are decoded here).
        state: where the answer starts (``"inside"`` an analysis message, ``"ended"``: in the final one,
            ``"open"``: before any channel).

    Example:
        >>> class Toy:                                   # token i decodes to pieces[i]
        ...     pieces = [CHANNEL, "analysis", MESSAGE, "Hm", END, START, "assistant", "final", "Yes", RETURN]
        ...     def decode(self, ids, skip_special_tokens=True):
        ...         return "".join(self.pieces[i] for i in ids)
        >>> splitter = HarmonySplitter(Toy(), "open")
        >>> splitter.feed("", [0, 1, 2, 3]), splitter.feed("", [4, 5, 6, 0, 7, 2, 8, 9]), splitter.flush()
        (('Hm', ''), ('', 'Yes'), ('', ''))
    """

    def __init__(self, tokenizer: Any, state: str) -> None:
        self._detok = IncrementalDetokenizer(_Specials(tokenizer))
        self._mode = {_INSIDE: "reasoning", _ENDED: "content"}.get(state, "header")
        self._header = ""  # the current message's header, while in one
        self._held = ""
        self._channels = 0  # messages opened (an answer that opens none is all content)
        self.thought = self._mode == "reasoning"

    @property
    def answering(self) -> bool:
        """Whether the tokens fed so far opened a message whose text is content (``final``, ``commentary``)."""
        return self._mode == "content"

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> tuple[str, str]:
        """The reasoning and content the new tokens make final (``text``, their text without the markers, is not
        needed: the tokens are decoded here)."""
        return self._route("".join(self._detok.step(int(token)) for token in token_ids))

    def flush(self) -> tuple[str, str]:
        """What is held at the end of the answer."""
        reasoning, content = self._route(self._detok.flush())
        held, self._held = self._held, ""
        if self._mode == "reasoning":
            return reasoning + held, content
        if self._mode == "header" and not self._channels:  # never opened a channel: all of it was content
            return reasoning, content + self._header + held
        return reasoning, content + (held if self._mode == "content" else "")

    def _route(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning = content = ""
        while self._held:
            at, marker = _next_marker(self._held)
            if at < 0:  # no whole marker: keep what could be the start of one
                keep = max(_partial(self._held, m) for m in HARMONY_MARKERS)
                piece, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
                reasoning, content = self._text(piece, reasoning, content)
                break
            reasoning, content = self._text(self._held[:at], reasoning, content)
            self._held = self._held[at + len(marker) :]
            self._marker(marker)
        return reasoning, content

    def _text(self, piece: str, reasoning: str, content: str) -> tuple[str, str]:
        if self._mode == "reasoning":
            return reasoning + piece, content
        if self._mode == "content":
            return reasoning, content + piece
        self._header += piece
        return reasoning, content

    def _marker(self, marker: str) -> None:
        if marker == MESSAGE:  # a header ends: its channel decides where the text goes
            reasoning = _channel(self._header) in _REASONING_CHANNELS
            self._mode = "reasoning" if reasoning else "content"
            self.thought = self.thought or reasoning
            self._header = ""
            self._channels += 1
        elif marker == CHANNEL:
            if self._mode != "header":
                self._mode, self._header = "header", ""
            self._header += CHANNEL
        elif marker == CONSTRAIN:
            self._header += CONSTRAIN if self._mode == "header" else ""
        else:  # START, END, RETURN, CALL: a message ends (a new header may follow)
            self._mode, self._header = "header", ""


def thought_tokens(tokenizer: Any, state: str, token_ids: Sequence[int]) -> int:
    """How many of an answer's tokens come before its content: its ``analysis`` messages and the headers up to the
    first message whose text is content (all of them when there is none).

    Example:
        >>> class Toy:
        ...     pieces = [CHANNEL, "analysis", MESSAGE, "Hm", END, START, "assistant", "final", "Yes", RETURN]
        ...     def decode(self, ids, skip_special_tokens=True):
        ...         return "".join(self.pieces[i] for i in ids)
        >>> thought_tokens(Toy(), "open", [0, 1, 2, 3, 4, 5, 6, 0, 7, 2, 8, 9])
        10
    """
    splitter = HarmonySplitter(tokenizer, state)
    for index, token in enumerate(token_ids):
        if splitter.answering:
            return index
        splitter.feed("", [token])
    return len(token_ids)


def _next_marker(text: str) -> tuple[int, str]:
    """The first whole marker in ``text``: its position and itself, or ``(-1, "")``."""
    found = [(text.find(m), m) for m in HARMONY_MARKERS if m in text]
    return min(found) if found else (-1, "")


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def harmony_grammar(answer: str, ids: dict[str, int], state: str) -> str:
    """A Lark grammar (llguidance's): any number of ``analysis`` messages, then the ``final`` message whose text is
    ``answer`` (a Lark expression: the request's constraint); from where the prompt left the answer (``state``).

    Example:
        >>> ids = {m: i for i, m in enumerate(HARMONY_MARKERS)}
        >>> print(harmony_grammar('"yes" | "no"', ids, "open").splitlines()[0])
        start: pagedcore_analysis* pagedcore_final
    """
    t = {marker: f"<[{token}]>" for marker, token in ids.items()}
    after = f'{t[END]} {t[START]} "assistant"'
    rules = {
        _OPEN: "start: pagedcore_analysis* pagedcore_final",
        _INSIDE: f"start: PAGEDCORE_TEXT? {after} pagedcore_analysis* pagedcore_final",
    }
    if state == _ENDED:
        return f"start: pagedcore_answer\npagedcore_answer: {answer}\n"
    lines = [
        rules.get(state, rules[_OPEN]),
        f'pagedcore_analysis: {t[CHANNEL]} "analysis" {t[MESSAGE]} PAGEDCORE_TEXT? {after}',
        f'pagedcore_final: {t[CHANNEL]} "final" {t[MESSAGE]} pagedcore_answer',
        "PAGEDCORE_TEXT: /(.|\\n)+/",
        f"pagedcore_answer: {answer}",
    ]
    return "\n".join(lines) + "\n"
