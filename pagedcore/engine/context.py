"""Does a request fit the context: the one owner of that rule and of its messages.

A model serves a fixed number of positions (prompt + new tokens; :attr:`ContextWindow.limit`, None: no fixed limit),
at most its own (``--max-model-len`` may serve fewer). The Engine checks every request against it at admission, the
server before it queues one (and by a token list's length alone, before its elements are read), ``enable()``d
``generate`` before a call, and a chat without ``max_tokens`` asks it how many new tokens are left
(:meth:`ContextWindow.room`). Plain Python.

Example:
    >>> window = ContextWindow(512)
    >>> window.room(500)
    12
    >>> window.check(500, 20)
    Traceback (most recent call last):
    ...
    pagedcore.errors.InvalidRequestError: the prompt has 500 tokens and asks for 20 more: that is over the context ...
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedcore.errors import ConfigError, InvalidRequestError
from pagedcore.validation import integer

__all__ = ["ContextWindow"]


@dataclass(frozen=True)
class ContextWindow:
    """The positions a request may span (see the module docstring).

    Attributes:
        limit: prompt + new tokens at most; None: no fixed limit.

    Example:
        >>> ContextWindow(None).room(10**9) is None
        True
    """

    limit: int | None

    def __post_init__(self) -> None:
        if self.limit is not None:
            object.__setattr__(self, "limit", integer("context", self.limit, minimum=1, error=ConfigError))

    @classmethod
    def served(cls, model_limit: int | None, max_model_len: int | None = None, note: str = "") -> ContextWindow:
        """The context served: ``max_model_len`` when given (at most the model's own), else the model's; ``note``
        says why the model's limit is what it is, in the refusal of a longer ``max_model_len``.

        Example:
            >>> ContextWindow.served(4096, 512).limit, ContextWindow.served(None, 512).limit
            (512, 512)
            >>> ContextWindow.served(4096, 8192)
            Traceback (most recent call last):
            ...
            pagedcore.errors.ConfigError: max_model_len 8192 is more than the model's context of 4096 tokens
        """
        if max_model_len is None:
            return cls(model_limit)
        length = integer("max_model_len", max_model_len, minimum=1, error=ConfigError)
        if model_limit is not None and length > model_limit:
            raise ConfigError(
                f"max_model_len {length} is more than the model's context of {model_limit} tokens"
                + (f" ({note})" if note else ""),
                param="max_model_len",
            )
        return cls(length)

    def room(self, prompt_tokens: int) -> int | None:
        """New tokens a prompt of this length leaves (0 when it fills the context); None: no limit."""
        return None if self.limit is None else max(0, self.limit - prompt_tokens)

    def check(self, prompt_tokens: int, new_tokens: int, *, which: str = "the prompt") -> None:
        """Raise :class:`~pagedcore.errors.InvalidRequestError` unless ``prompt_tokens + new_tokens`` fit; its
        ``param`` is ``"prompt"`` when the prompt alone fills the context, else ``"max_new_tokens"``.

        Example:
            >>> ContextWindow(8).check(8, 1, which="prompt 2")
            Traceback (most recent call last):
            ...
            pagedcore.errors.InvalidRequestError: prompt 2 has 8 tokens and asks for 1 more: that is over the ...
        """
        if self.limit is None or prompt_tokens + new_tokens <= self.limit:
            return
        raise InvalidRequestError(
            f"{which} has {prompt_tokens} tokens and asks for {new_tokens} more: that is over the context of "
            f"{self.limit} tokens",
            param="prompt" if prompt_tokens >= self.limit else "max_new_tokens",
        )

    def check_length(self, count: int, what: str, *, param: str = "prompt", ids: bool = True) -> None:
        """Refuse a list by its length alone, before its elements are read: ``count`` token ids (``ids``), or
        ``count`` items that take a position each at least, cannot fit.

        Example:
            >>> ContextWindow(8).check_length(9, "9 messages", param="messages", ids=False)
            Traceback (most recent call last):
            ...
            pagedcore.errors.InvalidRequestError: 9 messages cannot fit in the model's context of 8 tokens (each ...
        """
        if self.limit is None or count <= self.limit:
            return
        if ids:
            message = f"{what} has {count} token ids, more than the model's context of {self.limit} tokens"
        else:
            message = f"{what} cannot fit in the model's context of {self.limit} tokens (each takes one at least)"
        raise InvalidRequestError(message, param=param)
