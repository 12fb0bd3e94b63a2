"""``attn_implementation="paged"``: attention that reads keys and values straight from the pool.

Registered with transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` when
``pagedcore.adapters.transformers`` is imported. Each forward, the cache (or the Engine) hands every layer a
:class:`ForwardContext` through the keyword arguments that reach the attention call; the function packs the real
query tokens, asks the backend selected by the ``pagedcore_attention_backend`` hook for attention over the pool,
and unpacks. Without a context (a model that calls ``cache.update`` without its kwargs, or a batch whose padding
the cache could not account for) it falls back to dense attention over the keys and values ``update`` returned,
masked by the standard mask — the same result, computed the ordinary way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from pagedcore.attention import PagedAttentionMetadata
from pagedcore.errors import UnsupportedModelError

if TYPE_CHECKING:
    from .pool import PagedKVPool

__all__ = ["CONTEXT_KEY", "ForwardContext", "paged_attention_forward", "register"]

ATTN_IMPLEMENTATION = "paged"
CONTEXT_KEY = "pagedcore_forward"


@dataclass
class ForwardContext:
    """What every layer's attention needs in one forward.

    Attributes:
        pool: the pool holding the layers' keys and values.
        metadata: per KV group, where each sequence's queries and keys are (on the CPU; moved per device).
        real_index: flat indices of the real query tokens in ``(batch * q_len)``, or None when the queries are
            already packed (the Engine).
        backend: attention backend name requested by the user, or None for the plugin hook's choice.
    """

    pool: PagedKVPool
    metadata: list[PagedAttentionMetadata | None]
    real_index: torch.Tensor | None
    backend: str | None = None
    _index_on: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)

    def group_metadata(self, group: int, device: torch.device) -> PagedAttentionMetadata:
        """The group's metadata with tensors on ``device``."""
        meta = self.metadata[group]
        if meta is None:
            raise RuntimeError(f"KV group {group} has no metadata in this forward")
        return meta.to(device)

    def index_on(self, device: torch.device) -> torch.Tensor | None:
        """``real_index`` on ``device`` (cached)."""
        if self.real_index is None:
            return None
        moved = self._index_on.get(device)
        if moved is None:
            moved = self._index_on[device] = self.real_index.to(device)
        return moved


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the paged pool (see the module docstring). Returns ``(out (batch, q, heads, dim), None)``."""
    if kwargs.get("s_aux") is not None:
        raise UnsupportedModelError(
            f"{type(module).__name__} uses attention sinks (s_aux), which pagedcore's attention does not implement"
        )
    if module.training and dropout:
        raise UnsupportedModelError("paged attention is for inference: put the model in eval() mode")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    ctx: ForwardContext | None = kwargs.get(CONTEXT_KEY)
    if ctx is None:
        return _dense(module, query, key, value, attention_mask, scaling, softcap, kwargs)
    layer_idx = module.layer_idx  # type: ignore[attr-defined]
    group = ctx.pool.group_of(layer_idx)
    tensors = ctx.pool.layer_tensors(layer_idx)
    if tensors is None:
        raise RuntimeError(f"layer {layer_idx} has no pool tensors: its keys were never stored")
    key_cache, value_cache = tensors
    meta = ctx.group_metadata(group, query.device)
    if sliding_window is not None and meta.sliding_window != sliding_window:
        raise UnsupportedModelError(
            f"layer {layer_idx} attends with a window of {sliding_window} tokens but its KV group was built for "
            f"{meta.sliding_window}"
        )
    batch, heads, q_len, dim = query.shape
    flat = query.transpose(1, 2).reshape(batch * q_len, heads, dim)
    index = ctx.index_on(query.device)
    packed = flat if index is None else flat.index_select(0, index)
    backend = ctx.pool.attention_backend(query.device, query.dtype, ctx.backend)
    out = backend.forward(packed, key_cache, value_cache, meta, scale=scaling, softcap=softcap)
    if index is not None:
        full = out.new_zeros(batch * q_len, heads, out.shape[-1])
        out = full.index_copy_(0, index, out)
    return out.view(batch, q_len, heads, -1), None


def _dense(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """Ordinary attention over the (gathered) keys and values ``update`` returned, with the standard mask."""
    extra = {k: v for k, v in kwargs.items() if k != CONTEXT_KEY}
    if softcap is None:
        out, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, dropout=0.0, **extra)
        return out, None
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    q_len, k_len = query.shape[-2], key.shape[-2]
    if mask is None:  # causal, aligned to the newest key
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    bool_mask = mask.dtype == torch.bool
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if bool_mask else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"paged"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    # The mask is only used by the dense fallback; the paged path knows each sequence's extent exactly.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
