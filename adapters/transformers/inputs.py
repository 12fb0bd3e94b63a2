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

__all__ = ["as_prompt_list", "token_id_list"]


def token_id_list(value: object, *, vocab_size: int | None = None, name: str = "token ids") -> list[int]:
    """One prompt's token ids: a sequence of integers, a 1-D (or ``1 x n``) integer tensor, or a numpy array.

    Raises :class:`~pagedcore.errors.InvalidRequestError` naming the values for anything else (floats, bools,
    numeric strings, float or bool tensors) and for ids outside ``[0, vocab_size)``.

    Example:
        >>> token_id_list(torch.tensor([[5, 6, 7]]), vocab_size=10)
        [5, 6, 7]
        >>> token_id_list(torch.tensor([5.9, 6.1]))
        Traceback (most recent call last):
        ...
        pagedcore.errors.InvalidRequestError: token ids must be integers, got a torch.float32 tensor [5.9, 6.1]
    """
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            shown = [round(v, 4) if isinstance(v, float) else v for v in value.flatten()[:5].tolist()]
            raise InvalidRequestError(f"{name} must be integers, got a {value.dtype} tensor {shown}")
        if value.dim() == 2 and value.shape[0] == 1:
            value = value[0]
        if value.dim() != 1:
            raise InvalidRequestError(f"{name}: expected a 1-D tensor (or 1 x n), got shape {tuple(value.shape)}")
        value = value.tolist()
    return token_ids(value, vocab_size=vocab_size, name=name)


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
