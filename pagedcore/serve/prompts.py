"""From request bodies to engine prompts: the completion prompt forms and chat messages through a chat template;
texts become token ids here (in a worker thread of the server, never on its event loop nor on the engine's step
loop), after a bound on their length in characters. Stop strings are the Engine's (``SamplingParams.stop_strings``).

Chat messages go through the tokenizer's chat template when it has one. Without one (the built-in tokenizer has
none) they go through this plain template, documented in docs/serving.md::

    system: You are terse.
    user: Hello
    assistant:

one ``role: content`` line per message, then ``assistant:``; the model's answer follows that last colon.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .protocol import ApiError, ChatMessage

__all__ = [
    "ChatOptions",
    "ChatRenderer",
    "PromptEncoder",
    "completion_prompts",
    "plain_chat_prompt",
    "text_bound",
]

# apply_chat_template's own parameters: chat_template_kwargs may not set them (they have fields of their own).
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "messages",
    }
)

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


@dataclass(frozen=True)
class ChatOptions:
    """How a request's messages become a prompt (vLLM's chat fields).

    Attributes:
        add_generation_prompt: end where the assistant's answer starts.
        continue_final_message: leave the last message open, for the model to continue.
        documents: documents for a RAG chat template.
        template: the request's own chat template (else the server's, else the tokenizer's).
        template_kwargs: extra variables for the template.
        add_special_tokens: add the tokenizer's special tokens on top of the template's (the plain template always
            has them: it adds none of its own).
        tools: OpenAI's function definitions, for the chat template (``apply_chat_template(tools=...)``); the plain
            template writes them on a first ``tools:`` line.

    Example:
        >>> ChatOptions().add_generation_prompt
        True
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, str]] | None = None
    template: str | None = None
    template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    tools: list[dict[str, Any]] | None = None


def plain_chat_prompt(messages: Sequence[ChatMessage], options: ChatOptions | None = None) -> str:
    """The plain template for tokenizers without a chat template.

    Example:
        >>> plain_chat_prompt([ChatMessage(role="system", content="Be terse."), ChatMessage(role="user", content="Hi")])
        'system: Be terse.\\nuser: Hi\\nassistant:'
        >>> plain_chat_prompt([ChatMessage(role="user", content="Hi"), ChatMessage(role="assistant", content="Hel")],
        ...                   ChatOptions(add_generation_prompt=False, continue_final_message=True))
        'user: Hi\\nassistant: Hel'
    """
    options = options or ChatOptions()
    lines = [f"{m.role}: {m.text}" for m in messages]
    if options.continue_final_message:
        return "\n".join(lines)
    return "".join(f"{line}\n" for line in lines) + ("assistant:" if options.add_generation_prompt else "")


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

    def __init__(self, tokenizer: Any, template: str | None = None, thinking_off: str | None = None) -> None:
        self._tokenizer = tokenizer
        self.template = template or getattr(tokenizer, "chat_template", None) or None
        self.uses_template = self.template is not None
        self._thinking_off = thinking_off  # the plain template's closed reasoning block (with a reasoning parser)

    def render(self, messages: Sequence[ChatMessage], options: ChatOptions | None = None) -> list[int]:
        """Prompt token ids for ``messages``, ending where the assistant's answer starts (see :class:`ChatOptions`)."""
        options = options or ChatOptions()
        tokenizer = self._tokenizer
        if tokenizer is None:
            raise ApiError(400, "this server has no tokenizer: chat needs one", param="messages")
        template = options.template or self.template
        if template is None:
            # The plain template adds no special tokens of its own: the tokenizer's (a bos) are the prompt's start.
            head = f"tools: {json.dumps(options.tools, ensure_ascii=False)}\n" if options.tools else ""
            return _encoded(tokenizer, head + plain_chat_prompt(messages, options) + self._plain_thinking(options))
        text = self._apply(tokenizer, template, messages, options)
        # The rendered text holds the template's special tokens (e.g. a bos): add none again unless asked to.
        return _encoded(tokenizer, text, add_special_tokens=options.add_special_tokens)

    def _plain_thinking(self, options: ChatOptions) -> str:
        """What the plain template writes for the request's template variables: with a reasoning parser,
        ``enable_thinking: false`` closes an empty reasoning block after ``assistant:`` (as Qwen3's template does);
        any other variable (and ``documents``) needs a chat template (400 naming the field)."""
        kwargs = dict(options.template_kwargs or {})
        thinking = kwargs.pop("enable_thinking", None) if self._thinking_off is not None else None
        for name, value in (("documents", options.documents), ("chat_template_kwargs", kwargs)):
            if value:
                message = f"{name} needs a chat template: this model has none (give chat_template or serve with "
                more = "; enable_thinking alone works with --reasoning-parser" if name == "chat_template_kwargs" else ""
                raise ApiError(400, message + f"--chat-template{more})", param=name)
        if thinking is not None and not isinstance(thinking, bool):
            message = f"enable_thinking must be true or false, got {thinking!r}"
            raise ApiError(400, message, param="chat_template_kwargs")
        if thinking is False and options.add_generation_prompt and self._thinking_off is not None:
            return self._thinking_off
        return ""

    @staticmethod
    def _apply(tokenizer: Any, template: str, messages: Sequence[ChatMessage], options: ChatOptions) -> str:
        kwargs = dict(options.template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
        if reserved:
            message = (
                f"chat_template_kwargs may not set {', '.join(reserved)} (they are request fields or the server's)"
            )
            raise ApiError(400, message, param="chat_template_kwargs")
        if options.documents is not None:
            kwargs["documents"] = options.documents
        conversation = [_template_message(m) for m in messages]
        try:
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=template,
                tools=options.tools or None,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                tokenize=False,
                **kwargs,
            )
        except Exception as exc:  # jinja2 raises TemplateError (e.g. "roles must alternate") or ValueError
            raise ApiError(400, f"the chat template refused the messages: {exc}", param="messages") from exc
        return str(text)


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
    thought = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if thought is not None:
        out["reasoning_content"] = thought
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
        chat_template: the server's chat template (over the tokenizer's).
        reasoning: the server's reasoning parser (:class:`~pagedcore.serve.reasoning.Reasoning`): the plain template
            then honours ``enable_thinking``.

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

    def __init__(
        self, tokenizer: Any, context: int | None, chat_template: str | None = None, reasoning: Any = None
    ) -> None:
        thinking_off = None if reasoning is None else reasoning.format.disabled
        self.renderer = ChatRenderer(tokenizer, chat_template, thinking_off)
        self.context = context
        self.max_chars = text_bound(tokenizer, context)
        self._tokenizer = tokenizer

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (None: the server has none)."""
        return self._tokenizer

    def completion(
        self, prompt: str | list[str] | list[int] | list[list[int]], *, add_special_tokens: bool = True
    ) -> list[str | list[int]]:
        """Each prompt of a completion request as token ids (see :func:`completion_prompts` for the forms)."""
        prompts = completion_prompts(prompt)
        return [self.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str) else p for p in prompts]

    def chat(self, messages: Sequence[ChatMessage], options: ChatOptions | None = None) -> list[int]:
        """The prompt token ids of chat ``messages`` (see :class:`ChatRenderer`)."""
        self._check_length(sum(len(m.text) for m in messages), "the messages have", "messages")
        return self.renderer.render(messages, options)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> str | list[int]:
        """One completion text as token ids (or as it is, without a tokenizer)."""
        self._check_length(len(text), "the prompt has", "prompt")
        if self._tokenizer is None:
            return text
        return _encoded(self._tokenizer, text, param="prompt", add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], param: str = "prompt") -> str:
        """Token ids as text (special tokens kept, as a prompt's echo shows them); 400 naming ``param`` for ids
        outside the vocabulary (a tokenizer would decode them as nothing, or fail) or that it cannot decode."""
        if self._tokenizer is None:
            raise ApiError(400, "this server has no tokenizer: it cannot turn token ids into text", param=param)
        size = self.vocab_size
        bad = [t for t in token_ids if t < 0 or (size is not None and t >= size)]
        if bad:
            shown = ", ".join(str(t) for t in bad[:5]) + (", ..." if len(bad) > 5 else "")
            where = f" [0, {size})" if size is not None else ""
            raise ApiError(400, f"token ids {shown} are outside the vocabulary{where}", param=param)
        try:
            return str(self._tokenizer.decode(list(token_ids)))
        except Exception as exc:
            raise ApiError(400, f"the tokenizer cannot decode these token ids: {exc}", param=param) from exc

    @property
    def vocab_size(self) -> int | None:
        """The ids the tokenizer knows (``len(tokenizer)``: added tokens included), or None without one."""
        return None if self._tokenizer is None else len(self._tokenizer)

    def _check_length(self, chars: int, subject: str, param: str) -> None:
        if self.max_chars is not None and chars > self.max_chars:
            raise ApiError(
                400,
                f"{subject} {chars} characters: more than the model's context of {self.context} tokens can hold "
                f"with this tokenizer (at most {self.max_chars} characters)",
                param=param,
            )
