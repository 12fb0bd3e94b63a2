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

import sys
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.utils import logging

from pagedcore.attention import PagedAttentionMetadata, eager_attention, to_device
from pagedcore.attention_kinds import AttentionKind
from pagedcore.errors import UnsupportedModelError

from .layer_attention import LatentProjection, model_space, pool_read, retemper, sinks_of, verify_latent

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
# Set by a probe (:mod:`.probe`) around its forwards: every ForwardContext made meanwhile records into it.
PROBE_TRACE: ContextVar[Any] = ContextVar("pagedcore_probe_trace", default=None)
_LOGGER = logging.get_logger(__name__)


class StepAttention:
    """A forward's attention computed by the context itself (the Engine's compiled decode step,
    :class:`~pagedcore.adapters.transformers.compiled.DecodeAttention`): ``paged_attention_forward`` hands it each
    layer's query and new keys and values, and returns what :meth:`attend` returns.

    Example:
        >>> class Zeros(StepAttention):
        ...     def attend(self, layer_idx, query, key, value, scale, softcap, sliding_window, **extra):
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
               softcap: float | None, sliding_window: int | None, *, module: torch.nn.Module | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """``(1, q_len, heads, dim_v)``: the attention output of the layer's ``query (1, heads, q_len, dim)``;
        ``module`` is the layer's attention module, ``sinks`` its sink logits (``s_aux``) or None."""
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
        positions: the packed tokens' positions (the Engine), for what a model computes from a cache length a
            packed forward does not have (Llama 4's query temperature: :func:`~.layer_attention.retemper`).
        query_len: rectangular positions per row in this forward (PagedCache); 0 for packed queries (the Engine).
        new_tokens: per batch row, the real (stored) tokens among them (PagedCache); None for packed queries.
        trace: set only by a probe forward (:mod:`.probe`): records which layers stored keys and values, and
            which layers' attention received the context with what keys and values.

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
    positions: torch.Tensor | None = None
    query_len: int = 0
    new_tokens: list[int] | None = None
    trace: Any = field(default_factory=PROBE_TRACE.get)  # a probe.ProbeTrace during a probe forward
    _index_on: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)
    _mask_checks: dict[tuple[int, AttentionKind | None], tuple[Any, bool]] = field(default_factory=dict, repr=False)
    _trailing: dict[int, ForwardContext] = field(default_factory=dict, repr=False)

    def for_queries(self, count: int) -> ForwardContext:
        """The context of a layer that gets only the last ``count`` of the forward's queries: of each row
        (rectangular), or of the packed tokens (the Engine). Gemma 4 runs its KV-shared layers on the positions
        whose logits are kept (``logits_to_keep``) only. Itself when ``count`` is all of them; derived once per
        count, for all such layers.

        Example:
            >>> import torch
            >>> from pagedcore.adapters.transformers.testing import tiny_llama_config
            >>> from pagedcore.adapters.transformers import PagedKVPool
            >>> pool = PagedKVPool(tiny_llama_config(), num_blocks=8, block_size=4)
            >>> meta = PagedAttentionMetadata.build(block_size=4, query_lens=[2, 3], seq_lens=[2, 3],
            ...     block_offsets=[0, 0], tables=[[0], [1]], slots=[[0, 1], [4, 5, 6]], sliding_window=None,
            ...     pad_block=pool.pad_block)
            >>> ctx = ForwardContext(pool, [meta], torch.tensor([1, 2, 3, 4, 5]), query_len=3, new_tokens=[2, 3])
            >>> last = ctx.for_queries(1)
            >>> last.metadata[0].query_lens, last.metadata[0].seq_lens, last.real_index
            ([1, 1], [2, 3], None)
        """
        total = self.query_len if self.new_tokens is not None else sum(_first(self.metadata).query_lens)
        if count == total:
            return self
        cached = self._trailing.get(count)
        if cached is None:
            cached = self._trailing[count] = self._derive(count)
        return cached

    def _derive(self, count: int) -> ForwardContext:
        if self.new_tokens is None:  # packed: the last `count` tokens, from the last sequence backwards
            lens, left = [], count
            for n in reversed(_first(self.metadata).query_lens):
                lens.append(min(n, left))
                left -= lens[-1]
            lens.reverse()
            real_index = None
            positions = None if self.positions is None else self.positions[-count:]
        else:  # rectangular: each row's last `count` positions, of which its real tokens are the last
            per_row = [min(count, n) for n in self.new_tokens]
            lens = [k for k, n in zip(per_row, self.new_tokens) if n > 0]
            flat = [r * count + t for r, k in enumerate(per_row) for t in range(count - k, count)]
            real_index = None if len(flat) == count * len(per_row) else torch.tensor(flat, dtype=torch.long)
            positions = None
        metas = [None if m is None else _with_queries(m, lens) for m in self.metadata]
        return ForwardContext(self.pool, metas, real_index, self.backend, self.pads, self.length, self.dense,
                              positions, count if self.new_tokens is not None else 0, self.new_tokens,
                              self.trace)  # fmt: skip

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

    def mask_matches(self, mask: Any, kind: AttentionKind | None = None) -> bool:
        """Whether ``mask`` hides exactly the unstored padding (and, given the layer's ``kind``, the keys no query
        of the forward sees under it: a chunked layer's earlier chunks), the only things the paged path leaves out.

        The cache reads padding from ``position_ids``; a padded ``attention_mask`` whose padding the positions do
        not show (``model(ids, attention_mask=mask, cache=cache)`` without ``position_ids``: the model then makes
        ``arange`` positions) hides keys that are stored, and the paged path would attend to them. Checked once
        per mask object and kind (all layers of a kind share it).
        """
        if self.pads is None or self.dense is None:
            return True
        if mask is None:
            return not any(self.pads)
        key = (id(mask), kind)
        entry = self._mask_checks.get(key)
        if entry is None or entry[0]() is not mask:  # a weak reference: a dead mask's id may be reused
            matches = _hides_only_padding(mask, self.pads, self.length, kind)
            entry = self._mask_checks[key] = (weakref.ref(mask), matches)
        return entry[1]


def _first(metadata: list[PagedAttentionMetadata | None]) -> PagedAttentionMetadata:
    return next(m for m in metadata if m is not None)


def _with_queries(meta: PagedAttentionMetadata, query_lens: list[int]) -> PagedAttentionMetadata:
    """``meta`` whose sequences' queries are their last ``query_lens[i]`` positions (no writes: no slots)."""
    return PagedAttentionMetadata(
        meta.block_size, query_lens, meta.seq_lens, meta.block_offsets, meta.block_tables,
        meta.slot_mapping[:0], meta.sliding_window, meta.pad_block, host_block_tables=meta.host_block_tables,
        group_kind=meta.group_kind,
    )  # fmt: skip


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
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    ctx: ForwardContext | StepAttention | None = kwargs.get(CONTEXT_KEY)
    layer_idx = cast(int, kwargs.get(LAYER_KEY, module.layer_idx))
    if isinstance(ctx, StepAttention):
        sinks = kwargs.get("s_aux")
        out = ctx.attend(layer_idx, query, key, value, scaling, softcap, sliding_window, module=module, sinks=sinks)
        return out, None
    if kwargs.get("output_attentions") or kwargs.get(WEIGHTS_KEY):
        eager = _model_eager_attention(module)
        if eager is not None:  # the weights are asked for: the model's own eager attention over the gathered keys
            if ctx is not None and ctx.dense is not None:
                key, value = _dense_kv(ctx, module, layer_idx)
            return _with_weights(eager, module, query, key, value, attention_mask, scaling, softcap, kwargs)
    if ctx is None:
        return _dense(module, query, key, value, attention_mask, scaling, softcap, kwargs)
    if ctx.trace is not None:
        ctx.trace.read(layer_idx, key, value, sliding_window)
    if not ctx.mask_matches(attention_mask, ctx.pool.spec.layers[layer_idx].kind):
        key, value = _dense_kv(ctx, module, layer_idx)
        return _dense(module, query, key, value, attention_mask, scaling, softcap, kwargs)
    return _over_pool(ctx, module, layer_idx, query, scaling, softcap, sliding_window, kwargs), None


def _check_supported(module: torch.nn.Module, dropout: float, kwargs: dict[str, Any]) -> None:
    """Refuse what paged attention does not implement: dropout in training."""
    if module.training and dropout:
        raise UnsupportedModelError("paged attention is for inference: put the model in eval() mode")


def _dense_kv(ctx: ForwardContext, module: torch.nn.Module, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values the layer's attention function takes, gathered from the pool (its KV source's for a
    KV-shared layer; an MLA layer's latents expanded)."""
    spec = ctx.pool.spec
    source = spec.source(layer_idx)
    if ctx.dense is None or source is None:
        raise RuntimeError(f"layer {layer_idx}: no keys and values to gather for the dense fallback")
    keys, values = ctx.dense(source)
    return model_space(module, spec.layers[source], keys, values)


def _over_pool(
    ctx: ForwardContext,
    module: torch.nn.Module,
    layer_idx: int,
    query: torch.Tensor,
    scaling: float,
    softcap: float | None,
    sliding_window: int | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """The paged path: the real queries packed, the backend's attention over the pool, unpacked (pads get zeros).
    The layer's description says what it reads and asks (:mod:`.layer_attention`)."""
    layer = ctx.pool.spec.layers[layer_idx]
    ctx = ctx.for_queries(query.shape[2] if ctx.new_tokens is not None else query.shape[0] * query.shape[2])
    group, key_cache, value_cache = pool_read(ctx.pool, layer_idx)
    meta = ctx.group_metadata(group, query.device)
    if sliding_window is not None and meta.sliding_window != sliding_window:
        raise UnsupportedModelError(
            f"layer {layer_idx} attends with a window of {sliding_window} tokens but its KV group was built for "
            f"{meta.sliding_window}"
        )
    # An MLA layer attends in its latent space (a KV-shared one would read its source's latents with its own
    # up-projection, described with the sizes KV sharing requires to be the source's).
    projection = None
    if layer.latent is not None:
        verify_latent(module, layer.latent)  # once per module: its expand_kv is what the latent attention stands for
        projection = LatentProjection(module, layer.latent)
    if projection is not None:
        query = projection.query(query)
    query = retemper(query, layer, ctx.positions)
    batch, heads, q_len, dim = query.shape
    flat = query.transpose(1, 2).reshape(batch * q_len, heads, dim)
    index = ctx.index_on(query.device)
    packed = flat if index is None else flat.index_select(0, index)
    backend = ctx.pool.attention_backend(query.device, query.dtype, ctx.backend)
    sinks = sinks_of(layer, kwargs)
    extra = {} if sinks is None else {"sinks": sinks}
    out = backend.forward(packed, key_cache, value_cache, meta, scale=scaling, softcap=softcap, **extra)
    if projection is not None:
        out = projection.output(out)
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


def _hides_only_padding(mask: Any, pads: list[int], length: int, kind: AttentionKind | None = None) -> bool:
    """Whether the keys no query of a row may see are exactly that row's first ``pads[row]`` positions, and, given
    the layer's ``kind``, the keys none of the row's queries sees under it (counted from the row's first token).

    Causal and sliding masks built by transformers let some query of a row see every other key of the row (the
    last query sees every earlier key, the first query its whole window), so only padding is hidden from all; a
    chunked mask also hides the chunks before the forward's queries.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[0] != len(pads):
        return False
    kv_len, q_len = mask.shape[-1], mask.shape[-2]
    device = mask.device
    pad = torch.tensor(pads, device=device)[:, None, None]
    keys = torch.arange(length - kv_len, length, device=device)[None, None, :] - pad  # (rows, 1, kv) from the 1st
    queries = torch.arange(length - q_len, length, device=device)[None, :, None] - pad  # (rows, q, 1)
    seen = (keys >= 0) & (queries >= 0) & (keys <= queries)
    if kind is not None:
        seen &= kind.sees(queries, keys)
    return torch.equal(mask.any(dim=2).any(dim=1), seen.any(dim=1))


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
    sinks = extra.pop("s_aux", None)  # sdpa has no sinks: a layer with them (gpt-oss) attends step by step
    if softcap is None and sinks is None:
        out, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, dropout=0.0, **extra)
        return out, None
    if mask is None:
        mask = _causal(query, key)
    out = eager_attention(query, key, value, mask, scale=scaling, softcap=softcap, sinks=sinks)
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
    through the attention interface (Bloom, Falcon, GPT-Neo): it adds the mask to its scores, as eager's float mask.
    A probe forward records the window a sliding mask keeps (``local_size``)."""
    trace = None if torch.compiler.is_compiling() else PROBE_TRACE.get()  # (dynamo cannot trace ContextVar.get)
    if trace is not None:
        trace.masked(kwargs.get("local_size"))
    if config is not None and not _uses_attention_interface(type(config).__module__):
        return eager_mask(*args, config=config, **kwargs)
    return sdpa_mask(*args, config=config, **kwargs)


_USES_INTERFACE: dict[str, bool] = {}  # config module -> the answer of _uses_attention_interface


@torch.compiler.assume_constant_result  # traced: called once, its answer a constant (no lru_cache for dynamo to trace)
def _uses_attention_interface(config_module: str) -> bool:
    """Whether the modeling file next to ``config_module`` (a config class's module) calls transformers' attention
    interface (remembered per module)."""
    known = _USES_INTERFACE.get(config_module)
    if known is None:
        module = sys.modules.get(config_module.replace(".configuration_", ".modeling_"))
        known = _USES_INTERFACE[config_module] = module is None or hasattr(module, "ALL_ATTENTION_FUNCTIONS")
    return known
