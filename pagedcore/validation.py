"""Validators for values that come from callers: integers, token ids, the keys of an object. Plain Python, no torch.

One home for these rules, so every entry point (the Engine, ``enable``d ``generate``, a server, the core's own
constructors and commands) refuses the same inputs with the same message. Anything with ``__index__`` counts as an
integer (``int``, numpy integers, a one-element integer tensor); ``bool`` does not, although it is an ``int``
subclass: ``True`` as a token id is a bug in the caller, not token 1. Floats are never rounded: ``5.7`` is
refused, not read as ``5``.

Example:
    >>> token_ids([5, 6, 7], vocab_size=100)
    [5, 6, 7]
    >>> token_ids([5.7, 6.2])
    Traceback (most recent call last):
    ...
    pagedcore.errors.InvalidRequestError: token ids must be integers, got 5.7, 6.2
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

from pagedcore.errors import InvalidRequestError, PagedCoreError

__all__ = ["as_integer", "integer", "token_ids", "unknown_key"]

_SHOWN = 5  # bad values named in a message


def unknown_key(value: Iterable[str], known: Iterable[str]) -> str | None:
    """The first key of ``value`` (a mapping's keys) that is not ``known``, or None: an object's misspelt key is
    refused by name, not ignored.

    Example:
        >>> unknown_key({"type": "function", "fuction": {}}, ("type", "function")), unknown_key({"type": 1}, ("type",))
        ('fuction', None)
    """
    allowed = set(known)
    return next((key for key in value if key not in allowed), None)


def integer(
    name: str,
    value: object,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    error: type[PagedCoreError] = InvalidRequestError,
    expected: str | None = None,
    param: str | None = None,
) -> int:
    """``value`` as an ``int`` (anything with ``__index__`` except ``bool``) in ``[minimum, maximum]``.

    Raises ``error`` (:class:`~pagedcore.errors.InvalidRequestError` by default; constructors pass
    :class:`~pagedcore.errors.ConfigError`) naming ``name`` and the value otherwise, with ``param`` (default:
    ``name``) as its :attr:`~pagedcore.errors.PagedCoreError.param`. ``expected`` words what is expected (default:
    "an integer", with its bounds).

    Hot paths keep a fast path in front of it (``if type(x) is not int or x < 1: x = integer(...)``): the rule stays
    here, and a plain valid ``int`` costs one comparison.

    Example:
        >>> integer("max_new_tokens", 8, minimum=0)
        8
        >>> integer("n", 0, minimum=1)
        Traceback (most recent call last):
        ...
        pagedcore.errors.InvalidRequestError: n must be an integer >= 1, got 0
        >>> from pagedcore.errors import ConfigError
        >>> integer("block_size", True, minimum=1, error=ConfigError, expected="a positive integer")
        Traceback (most recent call last):
        ...
        pagedcore.errors.ConfigError: block_size must be a positive integer, got True
    """
    number = as_integer(value)
    if number is None or (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        if expected is None:
            bounds = [f">= {minimum}"] if minimum is not None else []
            bounds += [f"<= {maximum}"] if maximum is not None else []
            expected = " ".join(["an integer", " and ".join(bounds)]).strip()
        raise error(f"{name} must be {expected}, got {value!r}", param=name if param is None else param)
    return number


def as_integer(value: object) -> int | None:
    """``value`` as an ``int`` when it is an integer (see :func:`integer`: ``__index__``, not ``bool``), else None.

    Example:
        >>> as_integer(3), as_integer(True), as_integer(2.0)
        (3, None, None)
    """
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def token_ids(
    values: object,
    *,
    vocab_size: int | None = None,
    name: str = "token ids",
    allow_empty: bool = False,
    param: str | None = None,
) -> list[int]:
    """``values`` as a list of token ids: integers (see :func:`integer`) in ``[0, vocab_size)``.

    Refuses (with :class:`~pagedcore.errors.InvalidRequestError` naming the offending values) a string, anything
    not iterable, any element that is not an integer (floats, numeric strings, bools, nested lists), ids outside
    the vocabulary, and an empty sequence (a prompt) unless ``allow_empty`` (e.g. stop ids). Tensors are the
    adapter's business: check their dtype first (a float tensor's elements would be refused here one by one),
    then pass ``tensor.tolist()``. ``param`` is the errors' :attr:`~pagedcore.errors.PagedCoreError.param` (e.g.
    ``"prompt"``).

    Example:
        >>> token_ids((3, 4), vocab_size=10, name="stop_token_ids")
        [3, 4]
        >>> token_ids([True, 5])
        Traceback (most recent call last):
        ...
        pagedcore.errors.InvalidRequestError: token ids must be integers, got True
        >>> token_ids([3, 12, -1], vocab_size=10)
        Traceback (most recent call last):
        ...
        pagedcore.errors.InvalidRequestError: token ids [12, -1] are outside the model's vocabulary [0, 10)
        >>> token_ids([])
        Traceback (most recent call last):
        ...
        pagedcore.errors.InvalidRequestError: the prompt is empty
    """
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidRequestError(f"{name} must be a sequence of integers, got {_show(values)}", param=param)
    out: list[int] = []
    bad: list[object] = []
    for value in values:
        number = as_integer(value)
        if number is None:
            bad.append(value)
        else:
            out.append(number)
    if bad:
        shown = ", ".join(_show(v) for v in bad[:_SHOWN]) + (
            f" (and {len(bad) - _SHOWN} more)" if len(bad) > _SHOWN else ""
        )
        raise InvalidRequestError(f"{name} must be integers, got {shown}", param=param)
    if not out and not allow_empty:
        raise InvalidRequestError("the prompt is empty", param=param)
    outside = [t for t in out if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if outside:
        where = f"the model's vocabulary [0, {vocab_size})" if vocab_size is not None else "the ids >= 0"
        raise InvalidRequestError(f"{name} {outside[:_SHOWN]} are outside {where}", param=param)
    return out


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
