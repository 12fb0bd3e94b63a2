"""The xformers ops the backend launches, behind a two-method protocol that CPU tests replace with dense attention.

xformers' public entry point (``memory_efficient_attention_forward``) validates its inputs and asks the op's
``not_supported_reasons`` on every call: per layer, per step. The backend asks :meth:`XFormersKernels.supports` once
per op and shape bucket and then calls the op's ``apply`` directly (:meth:`XFormersKernels.run`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Protocol, runtime_checkable

import torch

from .runtime import import_xformers

logger = logging.getLogger(__name__)

__all__ = ["AttentionKernels", "XFormersKernels", "xformers_op"]

OP_MODULES = {"triton_splitk": "triton_splitk", "flash_paged": "flash", "flash": "flash", "cutlass": "cutlass"}
"""The xformers module of each op name the backend uses (``flash_paged`` is ``flash`` with a paged bias)."""


@functools.cache
def xformers_op(op: str) -> Any:
    """The forward op class (``FwOp``) of ``"triton_splitk"``, ``"flash"``, ``"flash_paged"`` or ``"cutlass"``.

    Example:
        >>> xformers_op("cutlass").__name__
        'FwOp'
    """
    return import_xformers(f"xformers.ops.fmha.{OP_MODULES[op]}").FwOp


@functools.cache
def _inputs_class() -> Any:
    return import_xformers("xformers.ops.fmha").Inputs


@runtime_checkable
class AttentionKernels(Protocol):
    """Runs one xformers op (``"triton_splitk"``, ``"flash_paged"``, ``"flash"``, ``"cutlass"``) on prepared inputs.

    Queries are ``[1, T, Hq, D]`` or ``[1, T, Hkv, Hq // Hkv, D]``, keys and values the same layout over the pool or
    the gathered keys; the result has the queries' shape with the values' head dim. Injected into
    :class:`~pagedcore.plugins.xformers.backend.XFormersPagedAttention` so that tests can run the whole plan on CPU
    against a dense reference.

    Example:
        >>> isinstance(XFormersKernels(), AttentionKernels)
        True
    """

    def supports(
        self, op: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Any, scale: float
    ) -> bool:
        """Whether ``op`` accepts inputs like these (asked once per op and shape bucket)."""
        ...

    def run(
        self, op: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Any, scale: float
    ) -> torch.Tensor:
        """``op``'s attention output (inputs ``supports`` accepted)."""
        ...


class XFormersKernels:
    """The real kernels: each op's ``not_supported_reasons``, then its ``apply`` without the per-call checks.

    Example:
        >>> from pagedcore.plugins.xformers.backend import XFormersPagedAttention
        >>> XFormersPagedAttention(XFormersKernels()).name   # what the plugin hook returns on a GPU
        'xformers'
    """

    def supports(
        self, op: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Any, scale: float
    ) -> bool:
        try:
            fw_op = xformers_op(op)
        except ImportError as exc:
            logger.debug("pagedcore: xformers op %s cannot be imported: %s", op, exc)
            return False
        inputs = _inputs_class()(query=query, key=key, value=value, attn_bias=bias, scale=scale)
        try:
            inputs.validate_inputs()
            reasons = fw_op.not_supported_reasons(inputs)
        except ValueError as exc:
            reasons = [str(exc)]
        if reasons:
            logger.debug("pagedcore: xformers op %s declines %s: %s", op, type(bias).__name__, "; ".join(reasons))
        return not reasons

    def run(
        self, op: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Any, scale: float
    ) -> torch.Tensor:
        inputs = _inputs_class()(query=query, key=key, value=value, attn_bias=bias, scale=scale)
        out, _ = xformers_op(op).apply(inputs, needs_gradient=False)
        return out.reshape(*query.shape[:-1], value.shape[-1])
