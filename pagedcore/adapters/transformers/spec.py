"""What a transformers model needs from a paged KV cache: per layer, its attention kind, KV heads and head size.

Built from the model's config with transformers' own layer-type inference, so the layer kinds (full, sliding) are
exactly those :class:`transformers.DynamicCache` would use. Models the paged cache cannot serve get an
:class:`~pagedcore.errors.UnsupportedModelError` naming the model type instead of silently wrong output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

from pagedcore.errors import PoolMismatchError, UnsupportedModelError
from pagedcore.validation import as_integer

from .state_spec import STATE_LAYER_TYPES, kv_layer_type

__all__ = ["LayerSpec", "ModelKVSpec", "context_limit", "text_config"]

_SUPPORTED = {"full_attention", "sliding_attention", "dummy"}
_WHY = {
    "chunked_attention": "chunked attention (e.g. Llama 4) keeps per-chunk state the paged cache does not model",
    "indexed_attention": "sparse indexed attention keeps an extra indexer cache",
}


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its kind, window, KV heads and head sizes.

    Example:
        >>> LayerSpec("sliding_attention", 4096, 8, 128, 128).has_cache
        True
    """

    layer_type: str
    sliding_window: int | None
    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    @property
    def has_cache(self) -> bool:
        """Whether the layer stores keys and values (KV-sharing and attention-free layers do not)."""
        return self.layer_type != "dummy"


@dataclass(frozen=True)
class ModelKVSpec:
    """The KV layout of a model, and how its layers map onto KV groups.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama_config
        >>> spec = ModelKVSpec.from_config(tiny_llama_config())
        >>> spec.windows, spec.layer_groups, spec.layers[0].num_kv_heads, spec.layers[0].head_dim
        ((None,), (0, 0), 2, 16)
    """

    model_type: str
    layers: tuple[LayerSpec, ...]
    windows: tuple[int | None, ...]  # one entry per KV group
    layer_groups: tuple[int | None, ...]  # per layer, its group (None: no cache)

    @classmethod
    def from_model(cls, model: PreTrainedModel | PretrainedConfig) -> ModelKVSpec:
        """The spec of a model (or of a config)."""
        return cls.from_config(text_config(model))

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> ModelKVSpec:
        """The spec of a decoder config; raises :class:`UnsupportedModelError` for models it cannot serve."""
        model_type = getattr(config, "model_type", type(config).__name__)
        if getattr(config, "is_encoder_decoder", False):
            raise UnsupportedModelError(
                f"model type {model_type!r} is an encoder-decoder model: its cross-attention cache is not a paged "
                "self-attention cache, so pagedcore cannot serve it (decoder-only models only)"
            )
        if getattr(config, "kv_lora_rank", None) is not None:
            raise UnsupportedModelError(
                f"model type {model_type!r} uses multi-head latent attention (kv_lora_rank="
                f"{config.kv_lora_rank}); its cached latents are not per-head keys and values, which pagedcore "
                "pages: use transformers' DynamicCache for this model"
            )
        try:
            layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
        except Exception as exc:  # configs without the usual fields
            raise UnsupportedModelError(f"model type {model_type!r}: cannot read its layer types ({exc})") from exc
        for i, kind in enumerate(layer_types):
            if kind not in _SUPPORTED and kind not in STATE_LAYER_TYPES:
                why = _WHY.get(kind, "pagedcore pages full and sliding-window attention and keeps recurrent states")
                raise UnsupportedModelError(f"model type {model_type!r}, layer {i} is {kind!r}: {why}")
        stateful = any(kind in STATE_LAYER_TYPES for kind in layer_types)
        layer_types = [kv_layer_type(kind) for kind in layer_types]  # a recurrent state is state_spec's business
        heads = getattr(config, "num_attention_heads", None)
        hidden = getattr(config, "hidden_size", None)
        attention_free = stateful and all(kind == "dummy" for kind in layer_types)
        if attention_free:  # a pure state-space model (Mamba-2): one KV group of no layers indexes its tokens
            heads, hidden = heads or 1, hidden or 1
        if not heads or not hidden:
            raise UnsupportedModelError(f"model type {model_type!r}: the config names no attention heads")
        kv_heads = _num_kv_heads(config, heads)
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        v_head_dim = getattr(config, "v_head_dim", None) or head_dim
        windows: list[int | None] = []
        groups: list[int | None] = []
        layers = []
        for kind, kwargs in zip(layer_types, layer_kwargs):
            window = kwargs.get("sliding_window") if kind == "sliding_attention" else None
            layers.append(LayerSpec(kind, window, kv_heads, head_dim, v_head_dim))
            if kind == "dummy":
                groups.append(None)
                continue
            if window not in windows:
                windows.append(window)
            groups.append(windows.index(window))
        if not windows and attention_free:
            windows.append(None)
        if not windows:
            raise UnsupportedModelError(f"model type {model_type!r} has no layer with a KV cache")
        return cls(model_type, tuple(layers), tuple(windows), tuple(groups))

    @property
    def num_layers(self) -> int:
        """Decoder layers (with or without a cache)."""
        return len(self.layers)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block id costs over all layers (keys and values)."""
        item = torch.empty((), dtype=dtype).element_size()
        return sum(
            block_size * layer.num_kv_heads * (layer.head_dim + layer.v_head_dim) * item
            for layer in self.layers
            if layer.has_cache
        )

    def check_compatible(self, other: ModelKVSpec) -> None:
        """Raise :class:`PoolMismatchError` unless a pool built for ``other`` can serve this model."""
        if self.layers != other.layers:
            mine = _summary(self)
            theirs = _summary(other)
            raise PoolMismatchError(
                f"this pool was built for {other.model_type!r} ({theirs}) and cannot serve "
                f"{self.model_type!r} ({mine}): layers, KV heads, head sizes and windows must all match"
            )


def _num_kv_heads(config: PretrainedConfig, heads: int) -> int:
    """KV heads per layer as the model caches them."""
    if getattr(config, "model_type", None) == "falcon":
        # Falcon caches every head with its new decoder architecture (it expands its KV groups before the cache),
        # one head when multi-query (Falcon-7B), else config.num_kv_heads (which has no num_key_value_heads alias).
        if getattr(config, "new_decoder_architecture", False):
            return heads
        return 1 if getattr(config, "multi_query", False) else int(getattr(config, "num_kv_heads", None) or heads)
    return int(getattr(config, "num_key_value_heads", None) or heads)


def _summary(spec: ModelKVSpec) -> str:
    first = next(layer for layer in spec.layers if layer.has_cache)
    return f"{spec.num_layers} layers, {first.num_kv_heads} KV heads of {first.head_dim}, windows {list(spec.windows)}"


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
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict):
        per_kind = [v for v in rope.values() if isinstance(v, dict)] or [rope]  # Gemma3: one entry per layer kind
        if any(p.get("rope_type") == "dynamic" for p in per_kind):
            return None
    for name in ("max_position_embeddings", "n_positions"):
        limit = as_integer(getattr(config, name, None))
        if limit is not None and limit > 0:
            return limit
    return None


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
