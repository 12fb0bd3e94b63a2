"""From request bodies to engine prompts: the completion prompt forms, and chat messages through a chat template.

Chat messages go through the tokenizer's chat template when it has one. Without one (the built-in tokenizer has
none) they go through this plain template, documented in the README::

    system: You are terse.
    user: Hello
    assistant:

one ``role: content`` line per message, then ``assistant:``; the model's answer follows that last colon.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .protocol import ApiError, ChatMessage

__all__ = ["ChatRenderer", "completion_prompts", "plain_chat_prompt"]


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

    def render(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Prompt token ids for ``messages``, ending where the assistant's answer starts."""
        tokenizer = self._tokenizer
        if tokenizer is None:
            raise ApiError(400, "this server has no tokenizer: chat needs one", param="messages")
        if not self.uses_template:
            return list(tokenizer(plain_chat_prompt(messages))["input_ids"])
        conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in messages]
        try:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja2 raises TemplateError (e.g. "roles must alternate") or ValueError
            raise ApiError(400, f"the chat template refused the messages: {exc}", param="messages") from exc
        # The rendered text already holds the template's special tokens (e.g. a bos): add none again.
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
