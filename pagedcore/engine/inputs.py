"""Prompts as callers give them (token id lists, numpy arrays, tensors, batches of them) -> validated token ids.

The rules on the ids themselves live in :mod:`pagedcore.validation` (one home for every entry point); this module
adds what only the adapter knows: tensors, whose dtype is checked before their values are read (a float tensor is
refused as such, never truncated to integers).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pagedcore.errors import InvalidRequestError
from pagedcore.validation import token_ids

__all__ = ["TOKEN_DTYPES", "as_prompt_list", "check_token_tensor", "token_id_list"]

TOKEN_DTYPES = (torch.int64, torch.int32)  # what embedding lookups accept


def check_token_tensor(
    value: torch.Tensor,
    *,
    vocab_size: int | None = None,
    name: str = "token ids",
    dtypes: tuple[torch.dtype, ...] | None = None,
    hint: str = "",
    param: str | None = None,
) -> None:
    """Raise :class:`~pagedcore.errors.InvalidRequestError` unless ``value`` holds token ids: an integer dtype (one
    of ``dtypes`` when given), at least one id, every id in ``[0, vocab_size)``.

    The dtype is checked before any value is read (a float tensor is refused as such, never truncated); the range
    with tensor operations, the ids outside it named by :func:`pagedcore.validation.token_ids`, whose rules these
    are. ``hint`` is appended to the dtype error; ``param`` is the errors' ``param`` (e.g. ``"prompt"``).

    Example:
        >>> check_token_tensor(torch.tensor([[5, 6], [7, 8]]), vocab_size=10)
        >>> check_token_tensor(torch.tensor([[5, 12]]), vocab_size=10)
        Traceback (most recent call last):
        ...
        pagedcore.errors.InvalidRequestError: token ids [12] are outside the model's vocabulary [0, 10)
        >>> check_token_tensor(torch.tensor([5, 6], dtype=torch.uint8), dtypes=TOKEN_DTYPES)
        Traceback (most recent call last):
        ...
        pagedcore.errors.InvalidRequestError: token ids must be integers (torch.int64 or torch.int32), got a ...
    """
    if value.numel() == 0:
        token_ids([], name=name, param=param)  # raises: the prompt is empty (whatever the dtype of no values)
    refused = value.is_floating_point() or value.is_complex() or value.dtype == torch.bool
    if refused or (dtypes is not None and value.dtype not in dtypes):
        shown = [round(v, 4) if isinstance(v, float) else v for v in value.flatten()[:5].tolist()]
        allowed = "" if dtypes is None else f" ({' or '.join(str(d) for d in dtypes)})"
        raise InvalidRequestError(
            f"{name} must be integers{allowed}, got a {value.dtype} tensor {shown}{hint}", param=param
        )
    outside = value < 0 if vocab_size is None else (value < 0) | (value >= vocab_size)
    if bool(outside.any()):
        token_ids(value[outside].unique().tolist(), vocab_size=vocab_size, name=name, param=param)  # raises


def token_id_list(
    value: object, *, vocab_size: int | None = None, name: str = "token ids", param: str | None = "prompt"
) -> list[int]:
    """One prompt's token ids: a sequence of integers, a 1-D (or ``1 x n``) integer tensor, or a numpy array.

    Raises :class:`~pagedcore.errors.InvalidRequestError` naming the values for anything else (floats, bools,
    numeric strings, float or bool tensors) and for ids outside ``[0, vocab_size)``, with ``param`` (a prompt's,
    by default).

    Example:
        >>> token_id_list(torch.tensor([[5, 6, 7]]), vocab_size=10)
        [5, 6, 7]
        >>> token_id_list(torch.tensor([5.9, 6.1]))
        Traceback (most recent call last):
        ...
        pagedcore.errors.InvalidRequestError: token ids must be integers, got a torch.float32 tensor [5.9, 6.1]
    """
    if isinstance(value, torch.Tensor):
        check_token_tensor(value, vocab_size=vocab_size, name=name, param=param)
        if value.dim() == 2 and value.shape[0] == 1:
            value = value[0]
        if value.dim() != 1:
            raise InvalidRequestError(
                f"{name}: expected a 1-D tensor (or 1 x n), got shape {tuple(value.shape)}", param=param
            )
        value = value.tolist()
    return token_ids(value, vocab_size=vocab_size, name=name, param=param)


def as_prompt_list(prompts: Any) -> list[Any]:
    """The prompts of a ``generate``/``stream`` call: a string or one list of token ids is one prompt; a 2-D tensor
    is one prompt per row; any other iterable is a list of prompts.

    Example:
        >>> as_prompt_list([5, 6, 7]), as_prompt_list(["hi", [5, 6]]), len(as_prompt_list(torch.ones(3, 4).long()))
        ([[5, 6, 7]], ['hi', [5, 6]], 3)
    """
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            return [prompts]
        if prompts.dim() == 2:
            return list(prompts)
        raise InvalidRequestError(f"a tensor of prompts must be 1-D or 2-D, got shape {tuple(prompts.shape)}")
    if not isinstance(prompts, Iterable):
        raise InvalidRequestError(
            f"prompts must be a string, a list of token ids or a list of prompts, got {type(prompts).__name__}"
        )
    items = list(prompts)
    if items and all(_is_scalar(item) for item in items):
        return [items]  # one prompt given as a flat list (its values are checked later)
    return items


def _is_scalar(item: object) -> bool:
    if isinstance(item, torch.Tensor):
        return item.dim() == 0
    return not isinstance(item, (str, bytes, Iterable))
