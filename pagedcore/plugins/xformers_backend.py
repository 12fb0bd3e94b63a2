"""Built-in attention backend: xformers' paged attention kernels on CUDA (fp16/bf16).

The plugin (entry point ``xformers``): its hook offers :class:`XFormersPagedAttention` for CUDA tensors in fp16/bf16
when :func:`xformers_status` found the kernels working. The backend lives in :mod:`pagedcore.plugins.xformers`:
``plan`` (which op computes which sequences, shape buckets), ``biases`` (the per-forward tensors), ``kernels``,
``backend`` (counters, fallback to the torch backend), ``runtime`` and ``status`` (loading xformers' CUDA library
beside the installed torch, and why it does not load).

xformers is imported lazily, so importing this module never fails on a machine without it.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedcore.attention import AttentionBackend
from pagedcore.hookspecs import hookimpl
from pagedcore.plugins.xformers.backend import XFormersPagedAttention, XFormersStats
from pagedcore.plugins.xformers.biases import GatheredKeys, build_attn_bias, build_gathered_keys
from pagedcore.plugins.xformers.kernels import AttentionKernels, XFormersKernels
from pagedcore.plugins.xformers.plan import Step, plan_steps
from pagedcore.plugins.xformers.status import XFormersStatus, xformers_status

__all__ = [
    "AttentionKernels",
    "GatheredKeys",
    "Step",
    "XFormersKernels",
    "XFormersPagedAttention",
    "XFormersStats",
    "XFormersStatus",
    "build_attn_bias",
    "build_gathered_keys",
    "pagedcore_attention_backend",
    "plan_steps",
    "xformers_available",
    "xformers_status",
]

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def xformers_available() -> bool:
    """Whether CUDA is present and xformers' kernels run on it (see :func:`xformers_status` for why not).

    Example:
        >>> xformers_available() if not torch.cuda.is_available() else False
        False
    """
    return xformers_status().available


_BACKEND = XFormersPagedAttention()


@hookimpl(trylast=True)
def pagedcore_attention_backend(device_type: str, dtype: Any, name: str | None) -> AttentionBackend | None:
    """The xformers backend for CUDA tensors in fp16/bf16 when xformers' kernels work; otherwise None.

    Example:
        >>> pagedcore_attention_backend(device_type="cpu", dtype=torch.float16, name=None) is None
        True
    """
    if name not in (None, "xformers") or device_type != "cuda" or dtype not in _HALF_DTYPES:
        return None
    if not xformers_available():
        return None
    return _BACKEND
