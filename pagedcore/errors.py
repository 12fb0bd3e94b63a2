"""Typed errors. Every error pagedcore raises on bad input derives from :class:`PagedCoreError`.

A call that raises one of these leaves the object it was called on unchanged. An error about one field of a request
or one option names it in ``param`` (as the raiser calls it: a :class:`~pagedcore.engine.sampling.SamplingParams`
field, ``"prompt"``, ``"num_blocks"``), so a front end can say which field failed without reading the message.

Example:
    >>> from pagedcore.validation import integer
    >>> try:
    ...     integer("max_new_tokens", -1, minimum=0)
    ... except InvalidRequestError as exc:
    ...     print(exc.param, "|", exc)
    max_new_tokens | max_new_tokens must be an integer >= 0, got -1
"""

from __future__ import annotations


class PagedCoreError(Exception):
    """Base class of every error raised by pagedcore.

    Attributes:
        param: the request field or option the error concerns, or None (see the module docstring).
    """

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param


class ConfigError(PagedCoreError, ValueError):
    """A constructor or option got a value it cannot work with (e.g. ``num_blocks <= 0``)."""


class OutOfBlocksError(PagedCoreError):
    """Fewer blocks can be had than asked for, even after evicting every unreferenced cached block.

    Attributes:
        requested: blocks asked for.
        available: blocks that could have been had (free + evictable).
    """

    def __init__(self, message: str, *, requested: int = 0, available: int = 0, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.requested = requested
        self.available = available


class InvalidBlockError(PagedCoreError, ValueError):
    """A block id is unknown, out of range, duplicated within one call, or not in the state the call needs."""


class DoubleReleaseError(InvalidBlockError):
    """A block whose reference count is already 0 was released (or freed) again."""


class SharedBlockError(InvalidBlockError):
    """``free`` was called on a block that another holder still references (ref count != 1)."""


class InvalidRequestError(PagedCoreError, ValueError):
    """A request cannot be served as given (empty prompt, larger than the pool, bad sampling parameters...)."""


class RequestNotFoundError(PagedCoreError, KeyError):
    """No request with that id is known (never added, already finished or aborted)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class DuplicateRequestError(InvalidRequestError):
    """A request id is already in use by a waiting or running request."""


class PluginError(PagedCoreError):
    """A plugin returned something unusable, or no plugin could serve a hook that needs an answer."""


class UnsupportedModelError(PagedCoreError, ValueError):
    """The model (or one of its layers) cannot be served by a paged cache; the message names the model type."""


class PoolMismatchError(PagedCoreError, ValueError):
    """A pool built for one model (layers, KV heads, head size) was used with another."""


class ConcurrentUseError(PagedCoreError, RuntimeError):
    """An object that is not thread-safe was entered from a second thread while in use."""


class GrammarError(InvalidRequestError):
    """A structured-output request's schema, regex, choice list or grammar is invalid (or cannot be used with the
    request's other parameters); the message names the kind and what is wrong."""


class GrammarTimeoutError(GrammarError):
    """A grammar did not compile within the bound (``compile_timeout``): the request is refused, the message says
    how long it ran. The compilation goes on in the background and is cached, so the same spec may succeed later."""


class AdapterError(InvalidRequestError):
    """A LoRA adapter cannot be loaded or served as asked: its files, its kind (only plain LoRA on linear layers),
    its rank over ``max_lora_rank``, a name already taken, or an Engine that serves no adapters."""


class AdapterNotFoundError(AdapterError):
    """No adapter of that name is loaded (never loaded, or unloaded), or its files are not there."""
