"""What a transformers model keeps besides keys and values: its recurrent-state layers, and what their states are.

transformers 5.24 names a layer's cache by its ``layer_types`` entry (``cache_utils.DYNAMIC_LAYER_TYPE_MAPPING``):
``"linear_attention"`` and ``"conv"`` layers keep fixed-size states only (``LinearAttentionLayer``: conv states and
recurrent states, ``number_of_conv_states`` of each), ``"hybrid"`` / ``"hybrid_sliding"`` layers keep such states and
the keys and values of a full / sliding-window attention (Falcon-H1, Zamba2). :func:`kv_layer_type` says what the
paged KV cache keeps of each (the KV spec, :mod:`.spec`, pages those), :class:`StateSpec` which layers keep states and
how many, and :func:`probe_states` what the states are (shape and dtype per layer, read off one forward of the model
itself, so every family is described by its own code).

Two facts about a family's modeling code decide how a prefix hit can resume its state (:class:`StateSpec` fields,
checked against the code by the test suite on every family):

- ``resumes_chunks``: a forward of several tokens on a cached state continues from it. The Mamba (v1) layers of
  Jamba, Mamba, Falcon-Mamba and Zamba drop the state in their full-sequence scan: their cached states are only
  continued one token at a time. A family missing here is refused by the Engine's probe (``probe.py``: a chunked
  run whose pieces continue states), not served wrongly.
- ``custom_cache``: MiniMax keeps its linear-attention states in a cache class of its own (``MiniMaxCache``, which
  its model requires); the paged cache then is one too (:mod:`.state_cache`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, get_layer_types_and_kwargs

__all__ = ["STATE_LAYER_TYPES", "StateShape", "StateSpec", "kv_layer_type", "probe_states", "state_bytes"]

STATE_LAYER_TYPES = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding"})
"""Layer types whose cache keeps recurrent states (transformers' ``LinearAttention*Layer`` classes)."""

# Layer types with a recurrent state, by what their keys and values are in the paged KV cache.
_KV_OF_STATE = {
    "linear_attention": "dummy",
    "conv": "dummy",
    "hybrid": "full_attention",
    "hybrid_sliding": "sliding_attention",
}
# Families whose multi-token forward on a cached state does not continue from it (see the module docstring).
_TOKEN_BY_TOKEN = frozenset({"jamba", "mamba", "falcon_mamba", "zamba", "recurrent_gemma"})
_CUSTOM_CACHE = frozenset({"minimax"})
# Families whose state ``enable()`` resumes from a snapshot only for a repeated prompt (nothing to resume: Mamba and
# Falcon-Mamba, state layers only, multiply each resumed token by the call's whole attention mask) or never (each
# call computes its prompt whole, as stock: RecurrentGemma's forwards over a resumed state differ from stock's).
_SNAPSHOT_HITS = {"mamba": "repeats", "falcon_mamba": "repeats", "recurrent_gemma": "none"}


def kv_layer_type(layer_type: str) -> str:
    """The layer type the paged KV cache pages for a layer: state-only layers keep no keys and values (``"dummy"``),
    a hybrid layer's attention is full or sliding; every other type is itself.

    Example:
        >>> kv_layer_type("linear_attention"), kv_layer_type("hybrid"), kv_layer_type("sliding_attention")
        ('dummy', 'full_attention', 'sliding_attention')
    """
    return _KV_OF_STATE.get(layer_type, layer_type)


@dataclass(frozen=True)
class StateShape:
    """One recurrent state of one layer, per sequence.

    Attributes:
        layer: the decoder layer.
        kind: ``"conv"`` (the last inputs of a short convolution) or ``"recurrent"`` (the recurrent / SSM state).
        index: the state's index within the layer (``state_idx``).
        shape: its shape for one sequence (the batch dimension left out).
        dtype: its dtype (many families keep recurrent states in float32 whatever the model's dtype).

    Example:
        >>> StateShape(0, "recurrent", 0, (4, 16, 16), torch.float32).nbytes
        4096
    """

    layer: int
    kind: str
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of one sequence's state."""
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StateSpec:
    """The recurrent-state layers of a model.

    Attributes:
        model_type: the model's type.
        layers: per state layer, its index and how many conv / recurrent states it keeps.
        resumes_chunks: a forward of several tokens on a cached state continues from it (else a resumed state is
            continued one token at a time).
        custom_cache: the model requires a cache class of its own (MiniMax).
        snapshot_hits: which ``enable()``d calls resume a state snapshot: ``"all"``, ``"repeats"`` (a repeated
            prompt's, which resumes no token) or ``"none"`` (every call computes its prompt).

    Example:
        >>> from transformers import AutoConfig
        >>> config = AutoConfig.for_model("lfm2", num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"])
        >>> spec = StateSpec.from_config(config)
        >>> spec.layers, spec.has_states, spec.resumes_chunks
        ({0: 1, 2: 1}, True, True)
    """

    model_type: str
    layers: dict[int, int]
    resumes_chunks: bool = True
    custom_cache: bool = False
    snapshot_hits: str = "all"

    @classmethod
    def from_config(cls, config: Any) -> StateSpec:
        """The state layers of a decoder config (none for a model of attention layers only)."""
        model_type = str(getattr(config, "model_type", type(config).__name__))
        try:
            layer_types, kwargs = get_layer_types_and_kwargs(config)
        except Exception:  # the KV spec says why such a config cannot be served
            return cls(model_type, {})
        layers = {
            i: int(kw.get("number_of_states", 1) or 1)
            for i, (kind, kw) in enumerate(zip(layer_types, kwargs))
            if kind in STATE_LAYER_TYPES
        }
        family = model_type.removesuffix("_text")
        return cls(
            model_type,
            layers,
            family not in _TOKEN_BY_TOKEN,
            family in _CUSTOM_CACHE,
            _SNAPSHOT_HITS.get(family, "all"),
        )

    @property
    def has_states(self) -> bool:
        """Whether any layer keeps a recurrent state."""
        return bool(self.layers)


def probe_states(model: Any, spec: StateSpec, dtype: torch.dtype | None = None) -> list[StateShape] | None:
    """Every recurrent state of ``model`` (a model or its decoder config): shape and dtype per sequence, read off the
    cache of one forward of one token. The model is built again on the ``meta`` device in ``dtype`` (its own by
    default) and run there (no memory, no compute); a model whose meta forward fails (data-dependent code:
    mixture-of-experts routing) runs that token for real, under ``torch.no_grad``. None when neither works.

    Example:
        >>> from transformers import AutoConfig
        >>> config = AutoConfig.for_model("lfm2", num_hidden_layers=2, layer_types=["conv", "full_attention"],
        ...     hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
        >>> [(s.layer, s.kind, s.shape) for s in probe_states(config, StateSpec.from_config(config))]
        [(0, 'conv', (32, 3))]
    """
    if not spec.has_states:
        return []
    config = model.config if isinstance(model, torch.nn.Module) else model
    if dtype is None:
        dtype = getattr(model, "dtype", None) if isinstance(model, torch.nn.Module) else None
    shapes = _probe_meta(config, spec, dtype)
    if shapes is None and isinstance(model, torch.nn.Module):
        shapes = _probe_real(model, spec)
    return shapes


def _probe_meta(config: Any, spec: StateSpec, dtype: torch.dtype | None) -> list[StateShape] | None:
    from transformers import AutoModelForCausalLM

    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    try:
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(
                copy.deepcopy(text), attn_implementation="eager", experts_implementation="eager", dtype=dtype
            )
        ids = torch.zeros(1, 1, dtype=torch.long, device="meta")
        return _read(meta, ids, spec)
    except Exception:  # data-dependent code, or a model class that cannot be built alone
        return None


def _probe_real(model: torch.nn.Module, spec: StateSpec) -> list[StateShape] | None:
    try:
        device = model.get_input_embeddings().weight.device  # type: ignore[operator]
        ids = torch.zeros(1, 1, dtype=torch.long, device=device)
        return _read(model, ids, spec)
    except Exception:
        return None


def _read(model: Any, ids: torch.Tensor, spec: StateSpec) -> list[StateShape]:
    if spec.custom_cache:
        module = __import__(type(model).__module__, fromlist=["MiniMaxCache"])
        cache: Any = module.MiniMaxCache()
    else:
        cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    return _shapes(cache, spec)


def _shapes(cache: Any, spec: StateSpec) -> list[StateShape]:
    out: list[StateShape] = []
    for layer, count in sorted(spec.layers.items()):
        if spec.custom_cache:  # MiniMax: one linear-attention state per layer
            state = cache.get_linear_cache(layer)
            if isinstance(state, torch.Tensor):
                out.append(StateShape(layer, "recurrent", 0, tuple(state.shape[1:]), state.dtype))
            continue
        cached = cache.layers[layer]
        for kind, states in (("conv", cached.conv_states), ("recurrent", cached.recurrent_states)):
            for index in range(count):
                state = states.get(index)
                if isinstance(state, torch.Tensor):
                    out.append(StateShape(layer, kind, index, tuple(state.shape[1:]), state.dtype))
    return out


def state_bytes(shapes: Sequence[StateShape]) -> int:
    """Bytes of one sequence's states over every layer (one state slot).

    Example:
        >>> state_bytes([StateShape(0, "conv", 0, (4, 3), torch.float32)])
        48
    """
    return sum(s.nbytes for s in shapes)
