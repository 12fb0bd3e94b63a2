"""From request bodies to engine prompts: the completion prompt forms and chat messages through a chat template;
texts become token ids here (in a worker thread of the server, never on its event loop nor on the engine's step
loop), after a bound on their length in characters. Stop strings are the Engine's (``SamplingParams.stop_strings``).

Chat messages go through the tokenizer's chat template when it has one. Without one (the built-in tokenizer has
none) they go through this plain template, documented in the README::

    system: You are terse.
    user: Hello
    assistant:

one ``role: content`` line per message, then ``assistant:``; the model's answer follows that last colon.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .protocol import ApiError, ChatMessage

__all__ = ["ChatRenderer", "PromptEncoder", "completion_prompts", "plain_chat_prompt", "text_bound"]

# Normalizers and pre-tokenizers (tokenizers' type names) that can drop characters: behind one of them, a text's
# length says nothing about its number of tokens.
_DROPPING = frozenset(
    {
        "BertNormalizer",
        "StripAccents",
        "Strip",
        "Nmt",  # drops control characters
        "Precompiled",  # SentencePiece's character map: may map a character to nothing
        "BertPreTokenizer",
        "Whitespace",
        "WhitespaceSplit",
        "CharDelimiterSplit",
    }
)
_COMPOSING = frozenset({"NFC", "NFKC"})  # may merge a few characters into one (Hangul jamo: 3 into 1)
_COMPOSED_AT_MOST = 4


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a completion request: one string, one list of token ids, or a batch of either.

    Example:
        >>> completion_prompts("hi"), completion_prompts([5, 6]), completion_prompts(["a", "b"])
        (['hi'], [[5, 6]], ['a', 'b'])
    """
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [[int(t) for t in prompt]]
    return list(prompt)


def plain_chat_prompt(messages: Sequence[ChatMessage]) -> str:
    """The plain template for tokenizers without a chat template.

    Example:
        >>> plain_chat_prompt([ChatMessage(role="system", content="Be terse."), ChatMessage(role="user", content="Hi")])
        'system: Be terse.\\nuser: Hi\\nassistant:'
    """
    return "".join(f"{m.role}: {m.text}\n" for m in messages) + "assistant:"


class ChatRenderer:
    """Turns chat messages into prompt token ids with a tokenizer.

    Args:
        tokenizer: a transformers tokenizer.

    Example:
        >>> from pagedcore.adapters.transformers.builtin import builtin_tokenizer
        >>> renderer = ChatRenderer(builtin_tokenizer())
        >>> renderer.uses_template
        False
        >>> ids = renderer.render([ChatMessage(role="user", content="Hi")])
        >>> builtin_tokenizer().decode(ids)  # the built-in vocabulary has no newline: it reads as <unk>
        'user: Hi<unk>assistant:'
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.uses_template = bool(getattr(tokenizer, "chat_template", None))

    def render(self, messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Prompt token ids for ``messages``, ending where the assistant's answer starts; ``tools`` (OpenAI's
        function definitions) go to the chat template (``apply_chat_template(tools=...)``), or, with the plain
        template, into a first ``tools:`` line."""
        tokenizer = self._tokenizer
        if tokenizer is None:
            raise ApiError(400, "this server has no tokenizer: chat needs one", param="messages")
        if not self.uses_template:
            head = f"tools: {json.dumps(tools, ensure_ascii=False)}\n" if tools else ""
            return _encoded(tokenizer, head + plain_chat_prompt(messages))
        conversation = [_template_message(m) for m in messages]
        try:
            text = tokenizer.apply_chat_template(
                conversation, tools=tools or None, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja2 raises TemplateError (e.g. "roles must alternate") or ValueError
            raise ApiError(400, f"the chat template refused the messages: {exc}", param="messages") from exc
        # The rendered text already holds the template's special tokens (e.g. a bos): add none again.
        return _encoded(tokenizer, text, add_special_tokens=False)


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: an assistant's tool calls with their arguments as objects (templates
    write them with ``tojson``), a tool result with the id of the call it answers."""
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role, "content": message.text}
    if message.tool_calls:
        out["tool_calls"] = [_template_call(call) for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, f"a tool call needs a function with a name, got {str(call)[:80]}", param="messages")
    function = dict(function)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # the template gets the text as it is
    return {**call, "function": function}


def _encoded(tokenizer: Any, text: str, *, param: str = "messages", **options: Any) -> list[int]:
    """``text``'s token ids; the tokenizer's failure (e.g. on a lone surrogate, which JSON allows) is a 400."""
    try:
        return list(tokenizer(text, **options)["input_ids"])
    except Exception as exc:  # the tokenizer is user code: its failure is this request's error
        message = f"the tokenizer failed on the {param} {text[:40]!r}: {type(exc).__name__}: {exc}"
        raise ApiError(400, message, param=param) from exc


def text_bound(tokenizer: Any, context: int | None) -> int | None:
    """The most characters a text can have and still fit in ``context`` tokens, or None when the tokenizer gives
    no such bound (no context, no tokenizer, a slow tokenizer, or a normalizer or pre-tokenizer that drops
    characters, e.g. BERT's whitespace splitting).

    Each token covers at most as many characters as its vocabulary entry is long (byte-level vocabularies spell
    one byte per character, so they count bytes, which is more), so a text longer than ``context`` times the
    longest entry needs more than ``context`` tokens; Unicode composition (NFC, NFKC) can merge up to four
    characters into one and multiplies the bound by four.

    Example:
        >>> from pagedcore.adapters.transformers.builtin import builtin_tokenizer
        >>> text_bound(builtin_tokenizer(), 512)  # its longest entry is '<unk>'
        2560
        >>> text_bound(builtin_tokenizer(), None) is None
        True
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if context is None or backend is None:
        return None
    spec = json.loads(backend.to_str())
    factor = _merging_factor([spec.get("normalizer"), spec.get("pre_tokenizer")])
    if factor is None:
        return None
    longest = max((len(entry) for entry in tokenizer.get_vocab()), default=1)
    return int(context * longest * factor)


def _merging_factor(component: Any) -> int | None:
    """How many characters of the text one character after ``component`` (a normalizer or pre-tokenizer, as
    ``tokenizer.json`` spells it) may stand for; None when it may drop characters."""
    if isinstance(component, list):
        factor: int | None = 1
        for part in component:
            inner = _merging_factor(part)
            factor = None if factor is None or inner is None else factor * inner
        return factor
    if not isinstance(component, dict):
        return 1
    kind = component.get("type")
    if kind in _DROPPING:
        return None
    if kind == "Replace":
        pattern, content = component.get("pattern", {}), component.get("content", "")
        if "String" not in pattern or not content or len(pattern["String"]) > len(content):
            return None  # a regex, or a replacement shorter than what it replaces
    if kind == "Split" and component.get("behavior") == "Removed":
        return None
    factor = _COMPOSED_AT_MOST if kind in _COMPOSING else 1
    inner = _merging_factor(component.get("normalizers") or component.get("pretokenizers") or [])
    return None if inner is None else factor * inner


class PromptEncoder:
    """The prompts of a request as the engine takes them: token ids, encoded by the server's tokenizer.

    Meant to run in a worker thread (tokenizing is the costly part of a request's admission). A text longer than
    :func:`text_bound` is refused before the tokenizer sees it; a list of ids longer than the context is refused by
    :func:`~pagedcore.serve.protocol.parse_request`. Without a tokenizer, texts go to the engine as they are (it
    says why it cannot take them).

    Args:
        tokenizer: a transformers tokenizer (or None).
        context: the model's context in tokens (None: unknown, no bound).

    Example:
        >>> from pagedcore.adapters.transformers.builtin import builtin_tokenizer
        >>> encoder = PromptEncoder(builtin_tokenizer(), context=4)
        >>> encoder.completion("Hi"), encoder.completion([5, 6])
        ([[44, 77]], [[5, 6]])
        >>> encoder.completion("x" * 21)
        Traceback (most recent call last):
        ...
        pagedcore.serve.protocol.ApiError: the prompt has 21 characters: more than ... (at most 20 characters)
    """

    def __init__(self, tokenizer: Any, context: int | None) -> None:
        self.renderer = ChatRenderer(tokenizer)
        self.context = context
        self.max_chars = text_bound(tokenizer, context)
        self._tokenizer = tokenizer

    def completion(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
        """Each prompt of a completion request as token ids (see :func:`completion_prompts` for the forms)."""
        return [self.encode(p) if isinstance(p, str) else p for p in completion_prompts(prompt)]

    def chat(self, messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt token ids of chat ``messages`` (and ``tools``; see :class:`ChatRenderer`)."""
        self._check_length(sum(len(m.text) for m in messages), "the messages have", "messages")
        return self.renderer.render(messages, tools)

    def encode(self, text: str) -> str | list[int]:
        """One completion text as token ids (or as it is, without a tokenizer)."""
        self._check_length(len(text), "the prompt has", "prompt")
        if self._tokenizer is None:
            return text
        return _encoded(self._tokenizer, text, param="prompt")

    def _check_length(self, chars: int, subject: str, param: str) -> None:
        if self.max_chars is not None and chars > self.max_chars:
            raise ApiError(
                400,
                f"{subject} {chars} characters: more than the model's context of {self.context} tokens can hold "
                f"with this tokenizer (at most {self.max_chars} characters)",
                param=param,
            )
