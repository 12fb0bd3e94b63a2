"""``attn_implementation="paged"``: attention that reads keys and values straight from the pool.

Registered with transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` when
``pagedcore.adapters.transformers`` is imported. Each forward, the cache (or the Engine) hands every layer a
:class:`ForwardContext` through the keyword arguments that reach the attention call; the function packs the real
query tokens, asks the backend selected by the ``pagedcore_attention_backend`` hook for attention over the pool,
and unpacks. Without a context (a model that calls ``cache.update`` without its kwargs, or a batch whose padding
the cache could not account for) it falls back to dense attention over the keys and values ``update`` returned,
masked by the standard mask — the same result, computed the ordinary way. So does a forward whose mask hides
more than the padding the cache left out (``ForwardContext.mask_matches``), over keys the context gathers.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.utils import logging

from pagedcore.attention import PagedAttentionMetadata, eager_attention, to_device
from pagedcore.errors import UnsupportedModelError

if TYPE_CHECKING:
    from .pool import PagedKVPool

__all__ = [
    "CONTEXT_KEY",
    "LAYER_KEY",
    "WEIGHTS_KEY",
    "ForwardContext",
    "StepAttention",
    "paged_attention_forward",
    "register",
]

ATTN_IMPLEMENTATION = "paged"
CONTEXT_KEY = "pagedcore_forward"
# Set by PagedCache.update for a forward called with output_attentions=True, for models that consume that argument
# themselves instead of handing it on to the attention function (GPT-2).
WEIGHTS_KEY = "pagedcore_attention_weights"
# The cache layer a PagedCache layer's update stored (Zamba2's shared attention blocks have no layer index of their
# own: they pass the hybrid layer's index to the cache).
LAYER_KEY = "pagedcore_layer"
_OWN_KEYS = (CONTEXT_KEY, WEIGHTS_KEY, LAYER_KEY)
_LOGGER = logging.get_logger(__name__)


class StepAttention:
    """A forward's attention computed by the context itself (the Engine's compiled decode step,
    :class:`~pagedcore.adapters.transformers.compiled.DecodeAttention`): ``paged_attention_forward`` hands it each
    layer's query and new keys and values, and returns what :meth:`attend` returns.

    Example:
        >>> class Zeros(StepAttention):
        ...     def attend(self, layer_idx, query, key, value, scale, softcap, sliding_window):
        ...         return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[-1])
        >>> import torch
        >>> layer = torch.nn.Module()
        >>> layer.layer_idx = 0
        >>> out, _ = paged_attention_forward(layer, torch.ones(1, 4, 2, 8), torch.ones(1, 2, 2, 8),
        ...     torch.ones(1, 2, 2, 8), None, pagedcore_forward=Zeros())
        >>> out.shape
        torch.Size([1, 2, 4, 8])
    """

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               softcap: float | None, sliding_window: int | None) -> torch.Tensor:  # fmt: skip
        """``(1, q_len, heads, dim_v)``: the attention output of the layer's ``query (1, heads, q_len, dim)``."""
        raise NotImplementedError


@dataclass
class ForwardContext:
    """What every layer's attention needs in one forward.

    Attributes:
        pool: the pool holding the layers' keys and values.
        metadata: per KV group, where each sequence's queries and keys are (on the CPU; moved per device).
        real_index: flat indices of the real query tokens in ``(batch * q_len)``, or None when the queries are
            already packed (the Engine).
        backend: attention backend name requested by the user, or None for the plugin hook's choice.
        pads: per batch row, its leading positions that are not stored (PagedCache); None when there is no
            rectangular batch to check the attention mask against (the Engine).
        length: rectangular positions per row after this forward (with ``pads``).
        dense: ``dense(layer_idx) -> (keys, values)``: the layer's keys and values gathered as ``update`` returns
            them without a context, for a forward whose mask the paged path cannot honour (see :meth:`mask_matches`).

    Example:
        A PagedCache builds one per forward; here, by hand, for a left-padded batch of two rows of 3 positions whose
        row 0 starts with one unstored padding position:

        >>> import torch
        >>> from pagedcore.adapters.transformers.testing import tiny_llama_config
        >>> from pagedcore.adapters.transformers import PagedKVPool
        >>> from pagedcore.attention import PagedAttentionMetadata, eager_attention
        >>> pool = PagedKVPool(tiny_llama_config(), num_blocks=8, block_size=4)
        >>> meta = PagedAttentionMetadata.build(block_size=4, query_lens=[2, 3], seq_lens=[2, 3], block_offsets=[0, 0],
        ...     tables=[[0], [1]], slots=[[0, 1], [4, 5, 6]], sliding_window=None, pad_block=pool.pad_block)
        >>> ctx = ForwardContext(pool, [meta], real_index=torch.tensor([1, 2, 3, 4, 5]), pads=[1, 0], length=3,
        ...     dense=lambda layer_idx: ...)   # dense: the fallback's gather (not called here)
        >>> ctx.group_metadata(0, torch.device("cpu")).seq_lens
        [2, 3]
        >>> causal = torch.ones(3, 3, dtype=torch.bool).tril()
        >>> ctx.mask_matches(causal.expand(2, 1, 3, 3))   # lets row 0 see its padding, which the pool does not hold
        False
        >>> padded = causal.expand(2, 1, 3, 3).clone()
        >>> padded[0, ..., 0] = False   # hides exactly row 0's padding: the paged path gives the same result
        >>> ctx.mask_matches(padded)
        True
    """

    pool: PagedKVPool
    metadata: list[PagedAttentionMetadata | None]
    real_index: torch.Tensor | None
    backend: str | None = None
    pads: list[int] | None = None
    length: int = 0
    dense: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None
    _index_on: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)
    _mask_checks: dict[int, tuple[Any, bool]] = field(default_factory=dict, repr=False)

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
            moved = self._index_on[device] = to_device(self.real_index, device)  # pinned, non-blocking
        return moved

    def mask_matches(self, mask: Any) -> bool:
        """Whether ``mask`` hides exactly the unstored padding, the only thing the paged path leaves out.

        The cache reads padding from ``position_ids``; a padded ``attention_mask`` whose padding the positions do
        not show (``model(ids, attention_mask=mask, cache=cache)`` without ``position_ids``: the model then makes
        ``arange`` positions) hides keys that are stored, and the paged path would attend to them. Checked once
        per mask object (all layers of a kind share it).
        """
        if self.pads is None or self.dense is None:
            return True
        if mask is None:
            return not any(self.pads)
        entry = self._mask_checks.get(id(mask))
        if entry is None or entry[0]() is not mask:  # a weak reference: a dead mask's id may be reused
            entry = self._mask_checks[id(mask)] = (weakref.ref(mask), _hides_only_padding(mask, self.pads, self.length))
        return entry[1]


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention over the paged pool (see the module docstring). Returns ``(out (batch, q, heads, dim), None)``,
    or with ``output_attentions=True`` the weights too: the model's own eager attention (its modeling file's
    ``eager_attention_forward``) over the keys gathered from the pool, as ``attn_implementation="eager"`` gives them
    (a model without one: a warning and no weights, as transformers' sdpa). Registered as
    ``attn_implementation="paged"``: a model set to it reads the pool of a
    :class:`~pagedcore.adapters.transformers.PagedCache` (or the Engine) instead of gathered keys.

    Example:
        >>> import torch
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import PagedCache
        >>> model = tiny_llama()
        >>> ids = torch.tensor([[1, 2, 3, 4]])
        >>> reference = model.generate(ids, max_new_tokens=4, do_sample=False)   # sdpa + DynamicCache
        >>> model.set_attn_implementation("paged")
        >>> out = model.generate(ids, max_new_tokens=4, do_sample=False, cache=PagedCache(model, num_blocks=16))
        >>> torch.equal(out, reference)
        True

        Without a :class:`ForwardContext` in the kwargs it is ordinary (dense) attention over the given keys:

        >>> query, key, value = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
        >>> out, weights = paged_attention_forward(model.model.layers[0].self_attn, query, key, value, None)
        >>> out.shape, weights
        (torch.Size([1, 3, 4, 16]), None)
    """
    _check_supported(module, dropout, kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    ctx: ForwardContext | StepAttention | None = kwargs.get(CONTEXT_KEY)
    layer_idx = cast(int, kwargs.get(LAYER_KEY, module.layer_idx))
    if isinstance(ctx, StepAttention):
        return ctx.attend(layer_idx, query, key, value, scaling, softcap, sliding_window), None
    if kwargs.get("output_attentions") or kwargs.get(WEIGHTS_KEY):
        eager = _model_eager_attention(module)
        if eager is not None:  # the weights are asked for: the model's own eager attention over the gathered keys
            if ctx is not None and ctx.dense is not None:
                key, value = ctx.dense(layer_idx)
            return _with_weights(eager, module, query, key, value, attention_mask, scaling, softcap, kwargs)
    if ctx is None:
        return _dense(module, query, key, value, attention_mask, scaling, softcap, kwargs)
    if not ctx.mask_matches(attention_mask):
        assert ctx.dense is not None
        key, value = ctx.dense(layer_idx)
        return _dense(module, query, key, value, attention_mask, scaling, softcap, kwargs)
    return _over_pool(ctx, layer_idx, query, scaling, softcap, sliding_window), None


def _check_supported(module: torch.nn.Module, dropout: float, kwargs: dict[str, Any]) -> None:
    """Refuse what paged attention does not implement: attention sinks, dropout in training."""
    if kwargs.get("s_aux") is not None:
        raise UnsupportedModelError(
            f"{type(module).__name__} uses attention sinks (s_aux), which pagedcore's attention does not implement"
        )
    if module.training and dropout:
        raise UnsupportedModelError("paged attention is for inference: put the model in eval() mode")


def _over_pool(
    ctx: ForwardContext,
    layer_idx: int,
    query: torch.Tensor,
    scaling: float,
    softcap: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """The paged path: the real queries packed, the backend's attention over the pool, unpacked (pads get zeros)."""
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
    return out.view(batch, q_len, heads, -1)


def _model_eager_attention(module: torch.nn.Module) -> Callable[..., Any] | None:
    """The ``eager_attention_forward`` of the module's own modeling file (what ``attn_implementation="eager"``
    runs), or None (with a warning, once) for a model that has none."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if callable(fn):
        return fn
    _LOGGER.warning_once(
        f"{type(module).__name__} has no eager attention to return attention weights with: paged attention returns "
        "none. Load the model with attn_implementation='eager' if you want them."
    )
    return None


def _with_weights(
    eager: Callable[..., Any],
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, weights)`` from the model's eager attention, as with ``attn_implementation="eager"``: the boolean
    mask the paged mask function builds (sdpa's, None when it is plain causal) becomes eager's additive one."""
    if mask is None:
        mask = _causal(query, key)[None, None]
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min
        )
    extra = {k: v for k, v in kwargs.items() if k not in _OWN_KEYS}
    out, weights = eager(module, query, key, value, mask, scaling=scaling, dropout=0.0, softcap=softcap, **extra)
    return out, weights


def _causal(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The causal mask ``(q_len, k_len)`` aligned to the newest key: what a None mask means here."""
    q_len, k_len = query.shape[-2], key.shape[-2]
    return torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)


def _hides_only_padding(mask: Any, pads: list[int], length: int) -> bool:
    """Whether the keys no query of a row may see are exactly that row's first ``pads[row]`` positions.

    Causal and sliding masks built by transformers let some query of a row see every other key of the row (the
    last query sees every earlier key, the first query its whole window), so only padding is hidden from all.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[0] != len(pads):
        return False
    kv_len = mask.shape[-1]
    positions = torch.arange(length - kv_len, length, device=mask.device)
    expected = positions[None, :] >= torch.tensor(pads, device=mask.device)[:, None]
    return torch.equal(mask.any(dim=2).any(dim=1), expected)


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
    extra = {k: v for k, v in kwargs.items() if k not in _OWN_KEYS}
    if softcap is None:
        out, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, dropout=0.0, **extra)
        return out, None
    if mask is None:
        mask = _causal(query, key)
    out = eager_attention(query, key, value, mask, scale=scaling, softcap=softcap)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"paged"`` with transformers' attention and mask interfaces (idempotent).

    Importing ``pagedcore.adapters.transformers`` already calls it; call it again only if something replaced the
    registration.

    Example:
        >>> from transformers import AttentionInterface
        >>> register()
        >>> AttentionInterface()["paged"] is paged_attention_forward
        True
    """
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    # The mask is only used by the dense fallback; the paged path knows each sequence's extent exactly.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _paged_mask)


def _paged_mask(*args: Any, config: Any = None, **kwargs: Any) -> Any:
    """sdpa's boolean mask (what the dense fallback reads), except for a model that attends in its own code, never
    through the attention interface (Bloom, Falcon, GPT-Neo): it adds the mask to its scores, as eager's float mask."""
    if config is not None and not _uses_attention_interface(type(config).__module__):
        return eager_mask(*args, config=config, **kwargs)
    return sdpa_mask(*args, config=config, **kwargs)


@functools.cache
def _uses_attention_interface(config_module: str) -> bool:
    """Whether the modeling file next to ``config_module`` (a config class's module) calls transformers' attention
    interface."""
    module = sys.modules.get(config_module.replace(".configuration_", ".modeling_"))
    return module is None or hasattr(module, "ALL_ATTENTION_FUNCTIONS")
