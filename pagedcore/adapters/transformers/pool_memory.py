"""How a pool's tensors lie in host memory: zero tensors whose pages the operating system commits when first written.

A pool sized to a budget must not take all of it at its first call (``torch.zeros`` writes every page): on the CPU
its tensors lie in anonymous ``mmap`` memory, so resident memory grows as blocks are written
(``MemoryStats.reserved_bytes`` counts what is held; tests/test_pool_memory.py measures it).
"""

from __future__ import annotations

import mmap
from typing import Any

import torch

__all__ = ["layer_tensor", "zeros"]


def layer_tensor(shape: tuple[int, int], heads_dim: Any, like: torch.Tensor, heads_first: bool) -> torch.Tensor:
    """A zero ``(*shape, heads, dim)`` tensor; with ``heads_first`` stored head after head (a permuted view).

    Example:
        >>> like = torch.empty(0, 2, 4)  # (tokens, heads, dim)
        >>> t = layer_tensor((3, 16), like.shape[-2:], like, heads_first=True)
        >>> t.shape, t.is_contiguous()
        (torch.Size([3, 16, 2, 4]), False)
    """
    heads, dim = heads_dim
    if heads_first:
        return zeros((heads, *shape, dim), like).permute(1, 2, 0, 3)
    return zeros((*shape, heads, dim), like)


def zeros(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A zero tensor of ``shape`` in ``like``'s dtype and device. On the CPU it lies in anonymous memory from
    ``mmap``: the operating system hands out zero pages and commits each page when it is first written, so a pool
    takes memory as its blocks are written instead of all of its budget at once (``torch.zeros`` writes every
    page). Elsewhere ``torch.zeros``.

    Example:
        >>> t = zeros((3, 2), torch.empty(0, dtype=torch.float16))
        >>> t.shape, t.dtype, bool(t.eq(0).all())
        (torch.Size([3, 2]), torch.float16, True)
    """
    count = 1
    for size in shape:
        count *= size
    if like.device.type != "cpu" or count == 0 or torch.compiler.is_compiling():  # a traced forward: traceable zeros
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    buffer = mmap.mmap(-1, count * like.element_size())  # the tensor keeps the mapping alive
    return torch.frombuffer(buffer, dtype=like.dtype, count=count).view(shape)
