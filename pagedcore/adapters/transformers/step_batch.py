"""One Engine step as the transformers runner runs it: the cache its forward writes through, and what it prepared.

The Engine plans a step (:mod:`pagedcore.engine.batch`); the runner's ``prepare``
(:meth:`~.runner.TransformersRunner.prepare`) packs it (:func:`pagedcore.engine.packing.pack_tokens`: every scheduled
token of every sequence in one ``(1, num_tokens)`` row without padding, each KV group's paged-attention metadata) into
a :class:`PreparedStep`, which holds everything the forward reads, so it runs without the Engine's lock while other
threads add and abort requests. The forward writes each layer's new keys and values through :class:`PackedCache`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer

from pagedcore.attention import to_device, write_kv
from pagedcore.engine.packing import PackedTokens

from .attention import CONTEXT_KEY, LAYER_KEY, ForwardContext
from .pool import PagedKVPool

__all__ = ["PackedCache", "PackedLayer", "PreparedStep"]


class PackedLayer(CacheLayerMixin):
    """An attention layer's view for transformers' mask code in the Engine's forwards (a packed step's, a state
    model's step): the paged attention reads the pool through the forward's context, never a mask.

    Example:
        >>> PackedLayer(is_sliding=False).get_mask_sizes(5)
        (5, 0)
    """

    is_compileable = False

    def __init__(self, is_sliding: bool) -> None:
        super().__init__()
        self.is_sliding = is_sliding
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("updated through the Engine's cache")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class PackedCache(Cache):
    """The cache a packed Engine forward writes through: every new token's keys/values go to its slot.

    ``update`` also hands the forward's context to the layer's attention through the keyword arguments it is given
    (as a :class:`~pagedcore.adapters.transformers.PagedCache` does): a decoder layer that calls its attention
    without the model's keyword arguments (StableLM, Nemotron) would otherwise never pass the context on, and its
    attention would read only the step's own keys.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> model = tiny_llama()
        >>> PackedCache(PagedKVPool(model, num_blocks=8, block_size=4)).get_seq_length()
        0
    """

    def __init__(self, pool: PagedKVPool) -> None:
        layers: list[Any] = [
            PackedLayer(spec.kind is not None and spec.kind.is_sliding) if spec.has_cache else DummyLayer()
            for spec in pool.spec.layers
        ]
        super().__init__(layers=layers)
        self._pool = pool
        self._slots: list[torch.Tensor] = []
        self._on: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._context: ForwardContext | None = None

    def begin(self, slots: list[torch.Tensor], context: ForwardContext | None = None) -> None:
        """Start a forward whose new tokens go to ``slots`` (one tensor per KV group) and whose layers attend with
        ``context``."""
        self._slots = slots
        self._on = {}
        self._context = context

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys = key_states[0].transpose(0, 1)  # (tokens, kv_heads, head_dim)
        values = value_states[0].transpose(0, 1)
        key_cache, value_cache = self._pool.layer_kv(layer_idx, keys, values)
        write_kv(key_cache, value_cache, keys, values, self.slots(layer_idx, keys.device))
        context = self._context
        if context is not None:
            model_kwargs = kwargs.get("kwargs")
            handed = isinstance(model_kwargs, dict) and CONTEXT_KEY not in model_kwargs
            if handed:
                model_kwargs[CONTEXT_KEY] = context  # type: ignore[index]
                model_kwargs[LAYER_KEY] = layer_idx  # type: ignore[index]
            if context.trace is not None:  # a probe forward (probe.py)
                context.trace.stored(layer_idx, key_states, value_states, returns_new=True, injected=handed)
        return key_states, value_states

    @property
    def pool(self) -> PagedKVPool:
        """The pool this cache writes to."""
        return self._pool

    def slots(self, layer_idx: int, device: torch.device) -> torch.Tensor:
        """The slots of this forward's new tokens in layer ``layer_idx``'s KV group, on ``device``."""
        group = self._pool.group_of(layer_idx)
        slots = self._on.get((group, device))
        if slots is None:
            slots = self._on[(group, device)] = to_device(self._slots[group], device)
        return slots

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False


@dataclass(frozen=True)
class PreparedStep:
    """What one step's forward reads, taken under the Engine's lock.

    Attributes:
        packed: the packed tokens, positions and per-group metadata (:class:`~pagedcore.engine.packing.PackedTokens`).
        context: the paged-attention context every layer's attention receives.
        keep: the packed indices whose logits the forward returns, in order.
        is_decode: every sequence decodes one token (a compiled decode step can run it).
        adapters: which rows each LoRA adapter applies to (:class:`~.lora.LoraStep`), or None: no row uses one.
        argmax_only: the rows only take their argmax (:attr:`ForwardBatch.argmax_only
            <pagedcore.engine.runner.ForwardBatch.argmax_only>`): the runner may return their tokens.

    Example:
        >>> PreparedStep(PackedTokens([], [], []), ForwardContext(None, [], None, None), [], False).num_tokens
        0
    """

    packed: PackedTokens
    context: ForwardContext
    keep: list[int]
    is_decode: bool
    adapters: Any = None
    argmax_only: bool = False

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this step."""
        return self.packed.num_tokens
