"""What a transformers model needs from a paged KV cache: one description of each layer's attention.

:class:`LayerSpec` says, for one decoder layer, everything the cache, the pool, the attention backends and the
Engine ask about it: its attention kind (full, sliding window, chunked), its query and KV heads, its key and value
head sizes (per layer: Gemma 4's global layers have their own), what it keeps (its own keys and values, another
layer's: KV sharing, or nothing), its attention sinks, Llama 4's position-dependent query scale, and for multi-head
latent attention (DeepSeek V2/V3, Kimi) the latent it caches instead of per-head keys and values
(:class:`LatentLayout`). :class:`ModelKVSpec` holds them all and forms the KV groups: layers that attend the same
way and store the same shapes share block ids.

It is read here and nowhere else, from the model's config (transformers' own layer-type inference, so the layer
kinds are exactly those :class:`transformers.DynamicCache` would use; per-layer sizes from ``config.per_layer_config``)
and, given a model, from its attention modules (sinks). A new variant is one change here plus what its kind or
layout asks of the attention. Models the paged cache cannot serve get an
:class:`~pagedcore.errors.UnsupportedModelError` naming the model type and the reason instead of silently wrong
output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

from pagedcore.attention_kinds import AttentionKind, ChunkedAttention, attention_kind
from pagedcore.errors import PoolMismatchError, UnsupportedModelError
from pagedcore.validation import as_integer

from .encoder_decoder import decoder_layout
from .state_spec import STATE_LAYER_TYPES, kv_layer_type

__all__ = ["KEEPS", "LatentLayout", "LayerSpec", "ModelKVSpec", "context_limit", "text_config"]

KEEPS = ("kv", "shared", "none")
"""What a layer keeps between forwards: ``"kv"`` its own per-token keys and values (or MLA latents), ``"shared"`` none
of its own (it attends over the blocks of its ``kv_source`` layer), ``"none"`` nothing (an attention-free layer)."""

_ATTENTION = {"full_attention", "sliding_attention", "chunked_attention"}
_WHY = {
    "indexed_attention": "sparse indexed attention keeps an extra indexer cache",
}


@dataclass(frozen=True)
class LatentLayout:
    """What a multi-head latent attention layer caches per token: the compressed latent ``c_kv`` (``kv_lora_rank``
    values, after its norm) and the one rotary key shared by all heads (``rope_dim``), as transformers' MLA layers
    hand them to ``cache.update`` (keys and values of one "head"). The pool keeps them side by side in one tensor of
    ``width`` values per token; paged attention attends in that latent space (the query absorbed into it through
    the up-projection ``kv_b_proj``), so the per-head keys and values (``expanded_width`` values per token) are never
    stored.

    Example:
        >>> v3 = LatentLayout(kv_lora_rank=512, rope_dim=64, num_heads=128, nope_dim=128, v_head_dim=128)
        >>> v3.width, v3.expanded_width, round(v3.width / v3.expanded_width, 4)
        (576, 40960, 0.0141)
    """

    kv_lora_rank: int
    rope_dim: int
    num_heads: int
    nope_dim: int
    v_head_dim: int

    @property
    def width(self) -> int:
        """Values cached per token: the latent, then the rotary key."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def expanded_width(self) -> int:
        """Values per token of the per-head keys and values the latent stands for: ``heads * (nope + rope + v)``."""
        return self.num_heads * (self.nope_dim + self.rope_dim + self.v_head_dim)


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's attention, as the cache and the attention see it.

    Attributes:
        layer_type: transformers' layer type (``"full_attention"``, ``"sliding_attention"``, ``"chunked_attention"``,
            ``"dummy"`` for an attention-free layer).
        sliding_window: the window of a sliding layer, else None.
        num_kv_heads: KV heads as the layer hands them to ``cache.update`` (1 for a latent).
        head_dim: key head size as stored (the latent's ``kv_lora_rank`` for MLA).
        v_head_dim: value head size as stored (the rotary key's size for MLA).
        num_heads: query heads (0: not read).
        chunk_size: the chunk of a chunked-attention layer, else None.
        kv_source: for a KV-shared layer, the layer whose keys and values it attends over (it stores none).
        sinks: whether the layer's softmax has a learned sink logit per head (gpt-oss; read from the model's modules).
        latent: the MLA latent it caches instead of per-head keys and values, or None.
        keeps: what it keeps (:data:`KEEPS`).
        query_temperature: Llama 4's position-dependent query scale of its NoPE layers, ``(attn_scale,
            floor_scale)``: the query at position ``p`` is multiplied by ``log1p(floor((p + 1) / floor_scale)) *
            attn_scale + 1``; None for other layers.

    Example:
        >>> layer = LayerSpec("sliding_attention", 4096, 8, 128, 128)
        >>> layer.has_cache, layer.kind, layer.token_elements
        (True, SlidingWindow(window=4096), 2048)
    """

    layer_type: str
    sliding_window: int | None
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    num_heads: int = 0
    chunk_size: int | None = None
    kv_source: int | None = None
    sinks: bool = field(default=False, compare=False)  # no part of the storage: pools compare layers without it
    latent: LatentLayout | None = None
    keeps: str = "kv"
    query_temperature: tuple[float, float] | None = field(default=None, compare=False)

    @property
    def has_cache(self) -> bool:
        """Whether the layer stores keys and values of its own (KV-sharing and attention-free layers do not)."""
        return self.keeps == "kv"

    @property
    def attends(self) -> bool:
        """Whether the layer attends over cached keys and values (its own or its source's)."""
        return self.keeps in ("kv", "shared")

    @property
    def kind(self) -> AttentionKind | None:
        """How its queries see the keys (None for a layer that does not attend)."""
        if not self.attends:
            return None
        if self.chunk_size is not None:
            return ChunkedAttention(self.chunk_size)
        return attention_kind(self.sliding_window)

    @property
    def token_elements(self) -> int:
        """Values it stores per token (keys and values, or the latent): 0 for a layer without a cache of its own."""
        return self.num_kv_heads * (self.head_dim + self.v_head_dim) if self.has_cache else 0

    @property
    def expanded_elements(self) -> int:
        """Values per token its attention reads as per-head keys and values: what a cache that expanded latents
        and gave every layer its own keys would store for it."""
        if not self.attends:
            return 0
        if self.latent is not None:
            return self.latent.expanded_width
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)

    @property
    def storage(self) -> tuple[Any, ...]:
        """What decides its pool tensors and KV group: kind, KV heads, head sizes, latent (layers with the same
        storage share a group)."""
        return (self.kind, self.num_kv_heads, self.head_dim, self.v_head_dim, self.latent)


@dataclass(frozen=True)
class ModelKVSpec:
    """The attention of every layer of a model, and how its layers map onto KV groups.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama_config
        >>> spec = ModelKVSpec.from_config(tiny_llama_config())
        >>> spec.windows, spec.layer_groups, spec.layers[0].num_kv_heads, spec.layers[0].head_dim
        ((None,), (0, 0), 2, 16)
    """

    model_type: str
    layers: tuple[LayerSpec, ...]
    kinds: tuple[AttentionKind, ...]  # one entry per KV group
    layer_groups: tuple[int | None, ...]  # per layer, the group it stores into (None: no cache of its own)

    @classmethod
    def from_model(cls, model: PreTrainedModel | PretrainedConfig) -> ModelKVSpec:
        """The spec of a model (or of a config). Given a model, its attention modules are read too (sinks). A config
        it cannot read is an :class:`UnsupportedModelError` too, where the cache, ``enable()`` or the Engine is set
        up, never an error later."""
        config: Any = getattr(model, "config", model)
        if decoder_layout(config) is None:  # an encoder-decoder family's config says its decoder's layout itself
            config = text_config(model)
        try:
            spec = cls.from_config(config)
        except (UnsupportedModelError, PoolMismatchError):
            raise
        except Exception as exc:
            model_type = getattr(config, "model_type", type(config).__name__)
            raise UnsupportedModelError(
                f"model type {model_type!r}: pagedcore cannot read its KV layout ({type(exc).__name__}: {exc})"
            ) from exc
        if isinstance(model, torch.nn.Module):
            spec = spec.with_sinks(_layers_with_sinks(model))
        return spec

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> ModelKVSpec:
        """The spec of a decoder config; raises :class:`UnsupportedModelError` for models it cannot serve."""
        model_type = getattr(config, "model_type", type(config).__name__)
        decoder = decoder_layout(config)  # Whisper, T5, BART...: the decoder's self-attention (encoder_decoder.py)
        if decoder is not None:
            layer = LayerSpec("full_attention", None, decoder.num_kv_heads, decoder.head_dim, decoder.head_dim)
            return cls.from_layers(model_type, (layer,) * decoder.num_layers)
        if getattr(config, "use_bidirectional_attention", None) in (True, "all"):
            raise UnsupportedModelError(
                f"model type {model_type!r} attends bidirectionally (use_bidirectional_attention="
                f"{config.use_bidirectional_attention!r}): its queries see later positions, so no cache of earlier "
                "keys and values can serve it (an encoder, e.g. an embedding model)"
            )
        layers = tuple(_read_layers(config, model_type))
        return cls.from_layers(model_type, layers, token_group=_attention_free(config, layers))

    @classmethod
    def from_layers(cls, model_type: str, layers: Sequence[LayerSpec], *, token_group: bool = False) -> ModelKVSpec:
        """The spec of these layers: groups formed by storage (:attr:`LayerSpec.storage`), in order of first use.
        ``token_group``: a model whose layers all keep recurrent states (Mamba-2) gets one full-attention KV group of
        no layers, which indexes its tokens (prefix matches, snapshots).

        Example:
            >>> spec = ModelKVSpec.from_layers("x", [LayerSpec("sliding_attention", 8, 2, 16, 16),
            ...     LayerSpec("full_attention", None, 2, 32, 32), LayerSpec("sliding_attention", 8, 2, 16, 16,
            ...     kv_source=0, keeps="shared")])
            >>> spec.kinds, spec.layer_groups, spec.source(2), spec.read_group(2)
            ((SlidingWindow(window=8), FullAttention()), (0, 1, None), 0, 0)
        """
        storages: list[tuple[Any, ...]] = []
        groups: list[int | None] = []
        for layer in layers:
            if not layer.has_cache:
                groups.append(None)
                continue
            if layer.storage not in storages:
                storages.append(layer.storage)
            groups.append(storages.index(layer.storage))
        if not storages and token_group:
            storages.append((attention_kind(None), 0, 0, 0, None))
        if not storages:
            raise UnsupportedModelError(f"model type {model_type!r} has no layer with a KV cache")
        return cls(model_type, tuple(layers), tuple(s[0] for s in storages), tuple(groups))

    def with_sinks(self, layers: set[int]) -> ModelKVSpec:
        """The same spec with attention sinks on ``layers``."""
        if not layers:
            return self
        marked = tuple(LayerSpec(**{**layer.__dict__, "sinks": i in layers}) for i, layer in enumerate(self.layers))
        return ModelKVSpec(self.model_type, marked, self.kinds, self.layer_groups)

    @property
    def num_layers(self) -> int:
        """Decoder layers (with or without a cache)."""
        return len(self.layers)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per KV group, its sliding window (None: full or chunked attention)."""
        return tuple(kind.sliding_window for kind in self.kinds)

    def source(self, layer_idx: int) -> int | None:
        """The layer whose keys and values ``layer_idx`` attends over: itself, its KV source (a shared layer), or
        None (a layer that does not attend)."""
        layer = self.layers[layer_idx]
        if layer.keeps == "shared":
            return layer.kv_source
        return layer_idx if layer.has_cache else None

    def read_group(self, layer_idx: int) -> int | None:
        """The KV group whose blocks ``layer_idx`` attends over (its source's), or None."""
        source = self.source(layer_idx)
        return None if source is None else self.layer_groups[source]

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block id costs over all layers (keys and values, or latents)."""
        return block_size * self.bytes_per_token(dtype)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one token's keys and values (or latents) take over all layers that store their own."""
        item = torch.empty((), dtype=dtype).element_size()
        return sum(layer.token_elements for layer in self.layers) * item

    def expanded_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one token would take if every attention layer stored its own per-head keys and values (no latent,
        no KV sharing): :meth:`bytes_per_token` against this is what MLA and KV sharing save."""
        item = torch.empty((), dtype=dtype).element_size()
        return sum(layer.expanded_elements for layer in self.layers) * item

    def describe(self) -> list[list[Any]]:
        """Per layer, what its stored blocks hold (for fingerprints of stored blocks): group, what it keeps, heads,
        head sizes, kind and latent."""
        return [_described(layer, group) for layer, group in zip(self.layers, self.layer_groups)]

    def check_compatible(self, other: ModelKVSpec) -> None:
        """Raise :class:`PoolMismatchError` unless a pool built for ``other`` can serve this model."""
        if self.layers != other.layers:
            mine = _summary(self)
            theirs = _summary(other)
            raise PoolMismatchError(
                f"this pool was built for {other.model_type!r} ({theirs}) and cannot serve "
                f"{self.model_type!r} ({mine}): layers, KV heads, head sizes and windows must all match"
            )


def _described(layer: LayerSpec, group: int | None) -> list[Any]:
    latent = None if layer.latent is None else layer.latent.width
    return [group, layer.keeps, layer.num_kv_heads, layer.head_dim, layer.v_head_dim, repr(layer.kind), latent]


# ---------------------------------------------------------------------------------------------- reading a config
def _read_layers(config: PretrainedConfig, model_type: str) -> list[LayerSpec]:
    """Every layer's description, from the config (see the module docstring)."""
    try:
        cache_types, layer_kwargs = get_layer_types_and_kwargs(config)
        per_layer = list(getattr(config, "per_layer_config", None) or [config] * len(cache_types))
    except Exception as exc:  # configs without the usual fields
        raise UnsupportedModelError(f"model type {model_type!r}: cannot read its layer types ({exc})") from exc
    declared = list(getattr(config, "layer_types", None) or cache_types)
    sharing = list(getattr(config, "kv_sharing_modes", None) or [None] * len(cache_types))
    layers = []
    for i, (kind, kwargs, layer_config) in enumerate(zip(cache_types, layer_kwargs, per_layer)):
        kind = kv_layer_type(kind)  # a recurrent state is state_spec's business; a hybrid layer's attention is ours
        if kind == "dummy" and sharing[i] == "reuse":
            source = _kv_source(i, declared, sharing, model_type)
            own = _read_attention(declared[i], layer_kwargs[source], layer_config, config, model_type, i)
            layers.append(LayerSpec(**{**own.__dict__, "kv_source": source, "keeps": "shared"}))
        elif kind == "dummy":
            layers.append(LayerSpec("dummy", None, 0, 0, 0, keeps="none"))
        elif kind in _ATTENTION:
            layers.append(_read_attention(kind, kwargs, layer_config, config, model_type, i))
        else:
            why = _WHY.get(
                kind, "pagedcore pages full, sliding-window and chunked attention and keeps recurrent states"
            )
            raise UnsupportedModelError(f"model type {model_type!r}, layer {i} is {kind!r}: {why}")
    return layers


def _read_attention(
    kind: str, kwargs: dict[str, Any], layer: Any, config: Any, model_type: str, index: int
) -> LayerSpec:
    """One attention layer's description from its per-layer config (``layer``) and the model's (``config``)."""
    heads = as_integer(_field(layer, "num_attention_heads"))
    hidden = as_integer(_field(layer, "hidden_size"))
    if not heads or not hidden:
        raise UnsupportedModelError(f"model type {model_type!r}: the config names no attention heads")
    window = kwargs.get("sliding_window") if kind == "sliding_attention" else None
    chunk = kwargs.get("sliding_window") if kind == "chunked_attention" else None
    temperature = _query_temperature(config, index)
    latent = _latent(layer, heads)
    if latent is not None:  # MLA: one "head" of the latent (keys) and the rotary key (values), as update gets them
        return LayerSpec(kind, window, 1, latent.kv_lora_rank, latent.rope_dim, heads, chunk, latent=latent,
                         query_temperature=temperature)  # fmt: skip
    head_dim = as_integer(_field(layer, "head_dim")) or hidden // heads
    v_head_dim = as_integer(_field(layer, "v_head_dim")) or head_dim
    kv_heads = _num_kv_heads(layer, heads)
    return LayerSpec(kind, window, kv_heads, head_dim, v_head_dim, heads, chunk, query_temperature=temperature)


def _attention_free(config: PretrainedConfig, layers: Sequence[LayerSpec]) -> bool:
    """Whether every layer keeps a recurrent state and none attends (a pure state-space model: Mamba-2)."""
    if any(layer.has_cache or layer.keeps == "shared" for layer in layers):
        return False
    types, _ = get_layer_types_and_kwargs(config)  # read once already by _read_layers: it does not raise here
    return any(kind in STATE_LAYER_TYPES for kind in types)


def _field(layer: Any, name: str) -> Any:
    """A per-layer config's field (None when it has none)."""
    try:
        return getattr(layer, name, None)
    except Exception:  # a heterogeneous config's global view of a per-layer field (AmbiguousGlobalPerLayer...)
        return None


def _latent(layer: Any, heads: int) -> LatentLayout | None:
    """The MLA latent layout, for a config with ``kv_lora_rank``."""
    rank = as_integer(_field(layer, "kv_lora_rank"))
    if rank is None:
        return None
    rope = as_integer(_field(layer, "qk_rope_head_dim")) or 0
    nope = as_integer(_field(layer, "qk_nope_head_dim")) or 0
    v_dim = as_integer(_field(layer, "v_head_dim")) or 0
    return LatentLayout(rank, rope, heads, nope, v_dim)


def _kv_source(index: int, declared: list[str], sharing: list[str | None], model_type: str) -> int:
    """The layer whose keys and values the KV-sharing layer ``index`` reuses: the ``"store"`` layer of its type
    (Gemma 3n / Gemma 4's ``kv_sharing_modes``)."""
    for j, (kind, mode) in enumerate(zip(declared, sharing)):
        if mode == "store" and kind == declared[index]:
            return j
    raise UnsupportedModelError(
        f"model type {model_type!r}: layer {index} reuses the keys and values of a {declared[index]!r} layer, "
        "but no layer of that type stores them"
    )


def _query_temperature(config: Any, index: int) -> tuple[float, float] | None:
    """Llama 4's temperature tuning of its NoPE layers (``no_rope_layers[i] == 0``), or None."""
    if not getattr(config, "attn_temperature_tuning", False):
        return None
    no_rope = getattr(config, "no_rope_layers", None)
    if not no_rope or index >= len(no_rope) or no_rope[index]:
        return None
    return float(config.attn_scale), float(config.floor_scale)


def _num_kv_heads(config: Any, heads: int) -> int:
    """KV heads per layer as the model caches them."""
    if getattr(config, "model_type", None) == "falcon":
        # Falcon caches every head with its new decoder architecture (it expands its KV groups before the cache),
        # one head when multi-query (Falcon-7B), else config.num_kv_heads (which has no num_key_value_heads alias).
        if getattr(config, "new_decoder_architecture", False):
            return heads
        return 1 if getattr(config, "multi_query", False) else int(getattr(config, "num_kv_heads", None) or heads)
    return int(_field(config, "num_key_value_heads") or heads)


def _layers_with_sinks(model: torch.nn.Module) -> set[int]:
    """The layers whose attention module has a learned sink logit per head (a ``sinks`` tensor: gpt-oss, Granite
    SWA, Flint): their ``s_aux`` reaches the attention function."""
    found = set()
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and isinstance(getattr(module, "sinks", None), torch.Tensor):
            found.add(index)
    return found


def _summary(spec: ModelKVSpec) -> str:
    first = next(layer for layer in spec.layers if layer.has_cache)
    return f"{spec.num_layers} layers, {first.num_kv_heads} KV heads of {first.head_dim}, kinds {list(spec.kinds)}"


def context_limit(model: Any) -> int | None:
    """The most positions (prompt + new tokens) a model can be asked for, or None when it has no fixed limit.

    - Learned or tabled absolute positions (GPT-2 ``n_positions``, OPT, GPT-Neo, CTRL): a hard limit; past it the
      position embedding lookup fails (``IndexError``).
    - Rotary positions (Llama, Mistral, Qwen, Gemma, Phi-3, GPT-NeoX, Falcon...): ``max_position_embeddings``, the
      context the model is configured for (with its rope scaling, if any: yarn, linear, llama3 and longrope configs
      state the scaled context there); past it output degrades silently.
    - Dynamic NTK rope scaling (``rope_type="dynamic"``) rescales past ``max_position_embeddings`` by design, and
      ALiBi models (Bloom, Falcon with ``alibi=True``) have no position table: no limit.

    Example:
        >>> from transformers import GPT2Config, LlamaConfig
        >>> context_limit(GPT2Config(n_positions=512)), context_limit(LlamaConfig(max_position_embeddings=4096))
        (512, 4096)
        >>> context_limit(LlamaConfig(max_position_embeddings=4096, rope_parameters={"rope_type": "dynamic",
        ...     "factor": 2.0, "rope_theta": 10000.0})) is None
        True
    """
    config = text_config(model)
    if getattr(config, "alibi", False) or getattr(config, "model_type", None) == "bloom":
        return None
    if any(p.get("rope_type") == "dynamic" for p in _rope_kinds(config)):
        return None
    for name in ("max_position_embeddings", "n_positions"):
        limit = as_integer(getattr(config, name, None))
        if limit is not None and limit > 0:
            return limit
    return None


def packed_rope_limit(model: Any) -> tuple[int, str] | None:
    """The longest context whose every forward gets the same rotary frequencies, and why, for a model whose
    frequencies depend on the largest position of each forward (``rope_type`` ``"dynamic"``: rescaled past
    ``max_position_embeddings``; ``"longrope"``: its long factors past ``original_max_position_embeddings``); None
    for any other model. The Engine packs several sequences into one forward, chunks prompts and resumes cached
    prefixes, so past this length its forwards would see other largest positions than stock ``generate``'s on each
    request, and other frequencies.

    Example:
        >>> from transformers import LlamaConfig
        >>> packed_rope_limit(LlamaConfig(max_position_embeddings=4096, rope_parameters={"rope_type": "dynamic",
        ...     "factor": 2.0, "rope_theta": 10000.0}))[0]
        4096
        >>> packed_rope_limit(LlamaConfig(max_position_embeddings=4096)) is None
        True
    """
    config = text_config(model)
    limits = []
    for params in _rope_kinds(config):
        kind = params.get("rope_type")
        if kind == "dynamic":
            limit = as_integer(getattr(config, "max_position_embeddings", None))
        elif kind == "longrope":
            limit = as_integer(params.get("original_max_position_embeddings")) or as_integer(
                getattr(config, "original_max_position_embeddings", None)
            )
        else:
            continue
        if limit:
            limits.append((limit, str(kind)))
    if not limits:
        return None
    limit, kind = min(limits)
    return limit, (
        f"its rope_type {kind!r} picks its frequencies from the largest position of each forward, which the "
        f"Engine's packed, chunked and prefix-cached forwards change past {limit} positions"
    )


def rope_capped(limit: int | None, model: Any) -> tuple[int | None, str]:
    """``limit`` (a context) at most :func:`packed_rope_limit`'s, and why when that lowered it (else ``""``): the
    context an Engine of ``model`` serves.

    Example:
        >>> from transformers import LlamaConfig
        >>> rope_capped(4096, LlamaConfig(max_position_embeddings=4096))
        (4096, '')
    """
    rope = packed_rope_limit(model)
    return rope if rope is not None and (limit is None or rope[0] < limit) else (limit, "")


def _rope_kinds(config: Any) -> list[dict[str, Any]]:
    """The config's rope parameters, one dict per layer kind (Gemma3: one entry per kind), or none."""
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict):
        return []
    return [v for v in rope.values() if isinstance(v, dict)] or [rope]


def text_config(model: Any) -> PretrainedConfig:
    """The decoder text config of a model or config.

    Example:
        >>> from transformers import LlamaConfig
        >>> text_config(LlamaConfig()).model_type
        'llama'
    """
    config = model.config if hasattr(model, "config") else model
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config
