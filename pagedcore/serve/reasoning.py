"""Reasoning models: ``--reasoning-parser`` splits the ``<think>...</think>`` a model writes before its answer off the
answer, as vLLM does: the answer's ``content`` is what follows, the reasoning goes to ``reasoning_content`` (and
``reasoning``, vLLM's newer name), in streams to ``delta.reasoning_content``.

The formats (:data:`FORMATS`):

- ``deepseek_r1``: everything before ``</think>`` is reasoning (DeepSeek-R1's template opens ``<think>`` in the
  prompt; an output that writes it itself has it removed); an output that never closes is all reasoning.
- ``qwen3``: Qwen3's templates either open ``<think>`` in the prompt (Qwen3.5: all before ``</think>`` is
  reasoning), close an empty one there (``enable_thinking: false``: all is content), or leave the model to open it
  (the first Qwen3 releases): then an output is reasoning only when it starts with ``<think>`` (an instruct model
  that never thinks is all content).

Where the answer starts is read from the prompt (:meth:`Reasoning.state`): the part the template adds as the
generation prompt is decoded and its last marker decides (:data:`INSIDE`: the output starts inside the reasoning,
:data:`ENDED`: it starts with the answer, :data:`OPEN`: it may open one).

Structured outputs and tool calls constrain the answer only: :meth:`Reasoning.constrain` wraps the request's
constraint in a grammar that allows free text up to ``</think>`` (the marker token, or its text) and the constraint
after it, so the reasoning is free and the content is exactly what the constraint allows. Tool calls are parsed
from the content alone.

- ``openai_gptoss`` (vLLM's name; ``gpt_oss`` too): gpt-oss's channel format,
  ``<|channel|>analysis<|message|>...<|end|>`` then ``<|start|>assistant<|channel|>final<|message|>...``: the
  analysis channel is the reasoning, the rest the content.
  Its markers are special tokens, left out of an answer's text, so it is split from the answer's token ids
  (:mod:`.harmony`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedcore.adapters.transformers.structured import GrammarCompiler, StructuredOutput

from .harmony import HarmonyFormat, HarmonySplitter, harmony_grammar, harmony_state, thought_tokens

__all__ = [
    "ENDED",
    "FORMATS",
    "INSIDE",
    "OPEN",
    "AnswerReasoning",
    "Reasoning",
    "ReasoningFormat",
    "ThinkSplitter",
    "generation_prompt",
]

INSIDE = "inside"
"""The prompt opened a reasoning block: the output is reasoning until its end marker."""
ENDED = "ended"
"""The prompt's last reasoning block is closed (e.g. ``enable_thinking: false``): the output is the answer."""
OPEN = "open"
"""The prompt has no reasoning marker: the output may open a reasoning block."""


@dataclass(frozen=True)
class ReasoningFormat:
    """How one family marks its reasoning.

    Attributes:
        name: the ``--reasoning-parser`` name.
        implicit: an output without a start marker is reasoning until the end marker (DeepSeek-R1); else it is
            reasoning only if it opens with the start marker (Qwen3).
        start / end: the markers.
        disabled: what the plain chat template (a model without one) writes after ``assistant:`` for
            ``chat_template_kwargs={"enable_thinking": false}``: an empty, closed reasoning block, as Qwen3's
            template does.

    Example:
        >>> FORMATS["qwen3"].disabled
        '<think>\\n\\n</think>\\n\\n'
    """

    name: str
    implicit: bool
    start: str = "<think>"
    end: str = "</think>"

    @property
    def disabled(self) -> str:
        return f"{self.start}\n\n{self.end}\n\n"


FORMATS: dict[str, ReasoningFormat | HarmonyFormat] = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", implicit=True),
    "qwen3": ReasoningFormat("qwen3", implicit=False),
    "openai_gptoss": HarmonyFormat("openai_gptoss"),
    "gpt_oss": HarmonyFormat("gpt_oss"),  # the same parser under the model family's name
}
"""The reasoning formats, by ``--reasoning-parser`` name."""


class ThinkSplitter:
    """One answer's text, fed as it streams, split into reasoning and content. A marker split across deltas is held
    back until it is complete (or cannot be one), so no part of a marker is ever shown.

    Args:
        fmt: the format.
        state: where the output starts (:data:`INSIDE`, :data:`ENDED` or :data:`OPEN`).

    Example:
        >>> splitter = ThinkSplitter(FORMATS["qwen3"], OPEN)
        >>> splitter.feed("<thi"), splitter.feed("nk>Hm</th"), splitter.feed("ink>\\n\\nYes"), splitter.flush()
        (('', ''), ('Hm', ''), ('', '\\n\\nYes'), ('', ''))
    """

    def __init__(self, fmt: ReasoningFormat, state: str) -> None:
        self._fmt = fmt
        self._mode = {INSIDE: "reasoning", ENDED: "content"}.get(state, "reasoning" if fmt.implicit else "detect")
        self.thought = self._mode == "reasoning"  # the answer had a reasoning part (possibly empty)
        self._at_start = True  # a leading start marker is dropped (the model opened the block itself)
        self._held = ""

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> tuple[str, str]:
        """The reasoning and the content ``text`` (the next delta; its tokens are not needed) makes final."""
        self._held += text
        reasoning = content = ""
        while self._held:
            if self._mode == "content":
                content, self._held = content + self._held, ""
            elif self._mode == "detect":
                if not self._detect():
                    break
            else:
                shown, done = self._reason()
                reasoning += shown
                if not done:
                    break
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is held at the end of the answer (an incomplete marker is text after all)."""
        held, self._held = self._held, ""
        if self._mode == "content" or (self._mode == "detect"):
            return "", held
        return held, ""

    def _detect(self) -> bool:
        """Decide whether the output opens a reasoning block; False while the text could still be its start."""
        stripped = self._held.lstrip()
        start = self._fmt.start
        if stripped.startswith(start):
            self._mode = "reasoning"
            self.thought = True
            return True
        if start.startswith(stripped):
            return False
        self._mode = "content"
        return True

    def _reason(self) -> tuple[str, bool]:
        """Reasoning text up to the end marker (the rest of the answer is content): what is shown, and whether the
        marker was found."""
        held = self._held
        if self._at_start:
            stripped = held.lstrip()
            if self._fmt.start.startswith(stripped) and len(stripped) < len(self._fmt.start):
                return "", False  # maybe the start marker, not complete yet
            self._at_start = False
            if stripped.startswith(self._fmt.start):
                held = stripped[len(self._fmt.start) :]
        end = self._fmt.end
        at = held.find(end)
        if at >= 0:
            self._held = held[at + len(end) :]
            self._mode = "content"
            return held[:at], True
        keep = _partial_suffix(held, end)
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep], False


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class Reasoning:
    """A server's reasoning parser: its format, and the tokenizer's view of its markers.

    Args:
        name: a key of :data:`FORMATS`.
        tokenizer: the server's tokenizer (markers that are one token of it are matched by id in grammars).

    Example:
        >>> reasoning = Reasoning("deepseek_r1", None)
        >>> reasoning.split("<think>Let me see.</think>It is 4.", OPEN)
        ('Let me see.', 'It is 4.')
        >>> reasoning.split("It is 4.", ENDED)
        (None, 'It is 4.')
    """

    def __init__(self, name: str, tokenizer: Any) -> None:
        self.format = FORMATS[name]
        self._tokenizer = tokenizer
        fmt = self.format
        if isinstance(fmt, HarmonyFormat):
            self._harmony: dict[str, int] | None = fmt.marker_ids(tokenizer)  # refused without its special tokens
            self._ids: dict[str, int | None] = {}
        else:
            self._harmony = None
            self._ids = {marker: _single_token(tokenizer, marker) for marker in (fmt.start, fmt.end)}

    @property
    def name(self) -> str:
        """The ``--reasoning-parser`` name."""
        return self.format.name

    @property
    def reads_tokens(self) -> bool:
        """Whether answers are split from their tokens (markers that are special tokens, left out of the text): a
        stream must then feed the splitter every token, even one that adds no text."""
        return self._harmony is not None

    def state(self, generation_prompt: str) -> str:
        """Where an output starts, from the text the template wrote after the last message (its generation
        prompt): the last marker in it decides.

        Example:
            >>> Reasoning("qwen3", None).state("<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n")
            'ended'
        """
        fmt = self.format
        if isinstance(fmt, HarmonyFormat):
            return harmony_state(generation_prompt)
        start, end = generation_prompt.rfind(fmt.start), generation_prompt.rfind(fmt.end)
        if start < 0 and end < 0:
            return OPEN
        return ENDED if end > start else INSIDE

    def decode_prompt(self, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> str:
        """A prompt's text as :meth:`state` reads it: ``decode``'s, or, for a format of special tokens, the
        tokenizer's with them kept."""
        if self._harmony is None:
            return decode(token_ids)
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=False))

    def splitter(self, state: str) -> ThinkSplitter | HarmonySplitter:
        """A splitter for one streamed answer that starts in ``state``."""
        if self._harmony is not None:
            return HarmonySplitter(self._tokenizer, state)
        fmt = self.format
        assert isinstance(fmt, ReasoningFormat)
        return ThinkSplitter(fmt, state)

    def thought_tokens(self, state: str, token_ids: Sequence[int]) -> int | None:
        """How many of an answer's tokens precede its content, for a format read from tokens (None for the others:
        their markers are text, counted from it)."""
        if self._harmony is None:
            return None
        return thought_tokens(self._tokenizer, state, token_ids)

    def split(self, text: str, state: str, token_ids: Sequence[int] = ()) -> tuple[str | None, str | None]:
        """A whole answer's reasoning and content (None where there is none); ``token_ids``: its tokens (a format of
        special tokens reads them, not the text)."""
        splitter = self.splitter(state)
        reasoning, content = splitter.feed(text, token_ids)
        more_reasoning, more_content = splitter.flush()
        reasoning, content = reasoning + more_reasoning, content + more_content
        return (reasoning if splitter.thought else None), (content or None)

    def constrain(self, spec: StructuredOutput, state: str) -> StructuredOutput:
        """``spec`` applied to the answer only: a grammar with free reasoning up to the end marker first (unless the
        prompt ended the reasoning already). Raises :class:`~pagedcore.errors.GrammarError` for a bad ``spec``.

        Example:
            >>> reasoning = Reasoning("deepseek_r1", None)
            >>> print(reasoning.constrain(StructuredOutput.regex("[0-9]+"), INSIDE).spec)  # doctest: +ELLIPSIS
            start: pagedcore_reasoning pagedcore_answer
            ...
        """
        if state == ENDED:
            return spec
        inner = _embedded(_parser().parse(spec))
        if self._harmony is not None:
            return StructuredOutput.grammar(harmony_grammar(inner, self._harmony, state))
        fmt = self.format
        assert isinstance(fmt, ReasoningFormat)
        start, end = (self._marker(m) for m in (fmt.start, fmt.end))
        opens = state == INSIDE or fmt.implicit  # the output is reasoning first (an opening marker optional)
        thought = "pagedcore_thought: pagedcore_text_end" + (f" | PAGEDCORE_TEXT {end.token}" if end.token else "")
        rules = [
            f"start: pagedcore_reasoning{'' if opens else '?'} pagedcore_answer",
            f"pagedcore_reasoning: {start}{'?' if opens else ''} pagedcore_thought",
            thought,
            f"pagedcore_text_end[lazy]: PAGEDCORE_TEXT {end.text}",
            "PAGEDCORE_TEXT: /(.|\\n)*/",
            f"pagedcore_answer: {inner}",
        ]
        return StructuredOutput.grammar("\n".join(rules) + "\n")

    def _marker(self, marker: str) -> _Marker:
        token = self._ids.get(marker)
        return _Marker(json.dumps(marker), f"<[{token}]>" if token is not None else None)


@dataclass(frozen=True)
class AnswerReasoning:
    """How one request's answers are split: the server's parser, where the answers start (from the prompt), and
    whether the reasoning is shown (``include_reasoning``; hidden, it is still kept out of the content).

    Example:
        >>> answer = AnswerReasoning(Reasoning("qwen3", None), OPEN)
        >>> answer.fields(*answer.split("<think>Hm.</think>Yes."))
        {'content': 'Yes.', 'reasoning_content': 'Hm.', 'reasoning': 'Hm.'}
    """

    reasoning: Reasoning
    state: str
    include: bool = True

    def split(self, text: str, token_ids: Sequence[int] = ()) -> tuple[str | None, str | None]:
        """A whole answer's reasoning and content (``token_ids``: its tokens, see :meth:`Reasoning.split`)."""
        return self.reasoning.split(text, self.state, token_ids)

    def splitter(self) -> ThinkSplitter | HarmonySplitter:
        """A splitter for one streamed answer."""
        return self.reasoning.splitter(self.state)

    @property
    def reads_tokens(self) -> bool:
        """Whether the splitter needs every token (see :attr:`Reasoning.reads_tokens`)."""
        return self.reasoning.reads_tokens

    def thought_tokens(self, token_ids: Sequence[int]) -> int | None:
        """How many of an answer's tokens precede its content (see :meth:`Reasoning.thought_tokens`)."""
        return self.reasoning.thought_tokens(self.state, token_ids)

    def fields(self, thought: str | None, content: str | None) -> dict[str, Any]:
        """A message's (or a delta's) fields: ``content``, then ``reasoning_content`` and ``reasoning`` (vLLM's names,
        old and new) when there is reasoning to show."""
        out: dict[str, Any] = {"content": content}
        if thought is not None and self.include:
            out["reasoning_content"] = thought
            out["reasoning"] = thought
        return out


@dataclass(frozen=True)
class _Marker:
    """A marker in a Lark grammar: its text, and its token (``<[id]>``) when it is one token."""

    text: str
    token: str | None

    def __format__(self, spec: str) -> str:
        return f"({self.text} | {self.token})" if self.token else self.text


def _single_token(tokenizer: Any, marker: str) -> int | None:
    """The id of ``marker`` when the tokenizer has it as one token, else None."""
    if tokenizer is None:
        return None
    try:
        ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
    except Exception:  # a tokenizer that cannot encode: the marker is text only
        return None
    return int(ids[0]) if len(ids) == 1 else None


def _embedded(grammar: str) -> str:
    """A parsed grammar (llguidance's text: a JSON grammar list, or Lark) as one Lark expression."""
    try:
        document = json.loads(grammar)
    except ValueError:
        document = None
    if isinstance(document, dict) and isinstance(document.get("grammars"), list) and document["grammars"]:
        first = document["grammars"][0]
        if first.get("json_schema") is not None:
            return "%json " + json.dumps(first["json_schema"], ensure_ascii=False)
        grammar = str(first.get("lark_grammar") or "")
    return "%lark {\n" + grammar + "\n}"


@functools.lru_cache(maxsize=1)
def _parser() -> GrammarCompiler:
    """A compiler used only to parse (no vocabulary): the constraint's grammar, canonical as the engine builds it."""
    return GrammarCompiler(None)


def generation_prompt(render: Callable[[bool], Sequence[int]], decode: Callable[[Sequence[int]], str]) -> str:
    """The text a chat template writes after the last message: the prompt rendered with and without the generation
    prompt (``render(add_generation_prompt)``), the difference decoded (the whole prompt when the shorter one is not
    a start of the longer one).

    Example:
        >>> generation_prompt(lambda add: [1, 2, 3] if add else [1, 2], lambda ids: str(list(ids)))
        '[3]'
    """
    full, bare = list(render(True)), list(render(False))
    if len(bare) <= len(full) and full[: len(bare)] == bare:
        return decode(full[len(bare) :])
    return decode(full)
