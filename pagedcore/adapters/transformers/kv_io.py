"""The tensors' side of the tiers below the pool (:mod:`pagedcore.kv_tiers`): copy a block out, bytes in, and the
model fingerprint a stored block is keyed by.

A block's payload is, for each layer of its KV group in layer order, its keys then its values as
``(block_size, kv_heads, head_dim)`` in the pool's dtype, C-contiguous: the same bytes whatever the pool's own
layout (``"slots"`` or ``"heads"``), so the fingerprint names this stored layout, not the pool's. An MLA layer's
"keys" and "values" are its latent and its rotary key; a KV-shared layer has none (its source's blocks are its).

The fingerprint covers the weights (:meth:`~pagedcore.adapters.transformers.weights.WeightsWatch.content_hash`,
once per weight epoch and again after every :meth:`~pagedcore.kv_pool.KVPool.reset_prefix_cache`), the stored dtype,
the block size, the stored layout, the model type and every layer's group, what it keeps, KV heads, head sizes, kind
and MLA latent width (:meth:`~.spec.ModelKVSpec.describe`), and everything else that changes the hidden states
without being a tensor: the model's config as transformers serializes it (``to_dict``, nested configs included:
``sliding_window``, ``rms_norm_eps``, rope scaling, soft-capping, layer types, ...) less what names, locates or
decorates it (:data:`NOT_NUMERICS`), and the attention implementation where its numerics differ from the
reference's (:func:`attention_numerics`). Two models with the same weights and another config never share stored
blocks.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Protocol

import torch

from pagedcore.kv_pool import KVPool

from .spec import ModelKVSpec
from .state_pool import StatePool
from .weights import Placement, WeightsWatch

__all__ = ["NOT_NUMERICS", "STORED_LAYOUT", "TensorBlockIO", "TensorPool", "attention_numerics", "config_digest"]


class TensorPool(Protocol):
    """What the tiers' tensor side reads of its pool (:class:`~.pool.PagedKVPool` is one; the pool makes its
    :class:`TensorBlockIO`, so this module names what it needs instead of importing the pool).

    Example:
        >>> from pagedcore.adapters.transformers import PagedKVPool
        >>> from pagedcore.adapters.transformers.testing import tiny_llama_config
        >>> pool: TensorPool = PagedKVPool(tiny_llama_config(), num_blocks=4, block_size=2)
        >>> pool.block_bytes(0)   # 2 layers x 2 KV heads x (16 + 16) x 2 tokens x 4 bytes
        1024
    """

    @property
    def spec(self) -> ModelKVSpec: ...
    @property
    def kv(self) -> KVPool: ...
    @property
    def weights(self) -> WeightsWatch | None: ...
    @property
    def stale_placement(self) -> Placement: ...
    @property
    def has_all_tensors(self) -> bool: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def block_size(self) -> int: ...
    def create_tensors(self, device: torch.device, dtype: torch.dtype) -> bool: ...
    def block_bytes(self, group: int) -> int: ...
    def layer_tensors(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None: ...
    @property
    def states(self) -> StatePool | None: ...
    @property
    def model(self) -> Any: ...


STORED_LAYOUT = "layer,kv,slot,head,dim"
NOT_NUMERICS = frozenset(
    {
        "_name_or_path", "name_or_path", "_commit_hash", "transformers_version", "architectures", "auto_map",
        "dtype", "torch_dtype", "id2label", "label2id", "problem_type", "finetuning_task", "task_specific_params",
        "tokenizer_class", "prefix", "output_attentions", "output_hidden_states", "return_dict", "use_cache",
        "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
        "initializer_range", "_attn_implementation_autoset",
    }
)  # fmt: skip
"""Config fields that never change a hidden state: names and paths, versions, head classes and labels, output
flags, special token ids, initialization (the weights are hashed), the dtype (the stored dtype is in the key)."""
# Implementations whose outputs equal the reference's within its tolerance (tests/test_paged_attention_weights.py):
# one numerics class. Any other (flash attention, a kernel from the hub, a registered function) is its own.
_REFERENCE_NUMERICS = frozenset({"eager", "sdpa", "paged"})


def config_digest(config: Any) -> str:
    """A hash of what in a model's config changes its hidden states (see the module docstring).

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama_config
        >>> a, b = tiny_llama_config(), tiny_llama_config()
        >>> b._name_or_path = "elsewhere/copy"
        >>> config_digest(a) == config_digest(b)
        True
        >>> b.rms_norm_eps = 1e-3
        >>> config_digest(a) == config_digest(b)
        False
    """
    serialized = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    text = json.dumps(_numerics(serialized), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _numerics(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _numerics(v) for k, v in value.items() if k not in NOT_NUMERICS}
    if isinstance(value, (list, tuple)):
        return [_numerics(v) for v in value]
    return value


def attention_numerics(config: Any) -> str:
    """The attention implementation as far as it changes numerics: ``"reference"`` for eager, sdpa and paged
    attention (equal within the reference's tolerance), else its name.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama_config
        >>> attention_numerics(tiny_llama_config())
        'reference'
    """
    name = getattr(config, "_attn_implementation", None) or "eager"
    return "reference" if name in _REFERENCE_NUMERICS else str(name)


class TensorBlockIO:
    """A pool's :class:`~pagedcore.kv_tiers.BlockIO`.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import PagedKVPool
        >>> model = tiny_llama()
        >>> pool = PagedKVPool(model, num_blocks=4, block_size=2)
        >>> io = TensorBlockIO(pool)
        >>> io.fingerprint() is None           # no weights watch yet: the pool has not checked the model
        True
        >>> _ = pool.check_weights(); len(io.fingerprint())
        64
    """

    def __init__(self, pool: TensorPool) -> None:
        self._pool = pool
        self._cached: tuple[tuple[int, int, int], str | None] | None = None

    def fingerprint(self) -> str | None:
        pool = self._pool
        watch = pool.weights
        if watch is None or pool.stale_placement is not None or watch.placement is None:
            return None
        dtype, device = watch.placement
        if not pool.has_all_tensors and not pool.create_tensors(device, dtype):
            return None
        epoch = (id(watch), watch.epoch, pool.kv.epoch)
        cached = self._cached
        if cached is None or cached[0] != epoch:
            fresh = cached is not None and cached[0][:2] == epoch[:2]  # only a reset moved: a change no check saw
            weights = watch.content_hash(fresh=fresh)
            cached = self._cached = (epoch, None if weights is None else self._describe(weights))
        return cached[1]

    def block_nbytes(self, group: int) -> int:
        return self._pool.block_bytes(group)

    def state_nbytes(self) -> int:
        states = self._pool.states
        return 0 if states is None or not states.complete() else states.slot_nbytes()

    def read_state(self, slot: int) -> object:
        states = self._pool.states
        assert states is not None
        return states.read(slot)

    def write_state(self, slot: int, payload: bytes) -> None:
        states = self._pool.states
        assert states is not None
        states.write(slot, payload)

    def read_block(self, group: int, block_id: int) -> object:
        out: list[torch.Tensor] = []
        for layer in self._layers(group):
            tensors = self._pool.layer_tensors(layer)
            assert tensors is not None
            out.extend(t[block_id].clone(memory_format=torch.contiguous_format) for t in tensors)
        return out

    def to_bytes(self, copy: object) -> bytes:
        assert isinstance(copy, list)
        return b"".join(t.to("cpu").reshape(-1).view(torch.uint8).numpy().tobytes() for t in copy)

    def write_block(self, group: int, block_id: int, payload: bytes) -> None:
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for layer in self._layers(group):
            tensors = self._pool.layer_tensors(layer)
            assert tensors is not None
            for t in tensors:
                target = t[block_id]
                size = target.numel() * t.element_size()
                piece = raw[offset : offset + size].view(t.dtype).view(target.shape)
                target.copy_(piece.to(t.device))
                offset += size
        if offset != len(payload):
            raise ValueError(f"write_block: a payload of {len(payload)} bytes for a block of {offset}")

    def _layers(self, group: int) -> list[int]:
        return [i for i, g in enumerate(self._pool.spec.layer_groups) if g == group]

    def _describe(self, weights: str) -> str:
        pool = self._pool
        spec = pool.spec
        layers = spec.describe()
        model = pool.model
        config = getattr(model, "config", None)
        described = {
            "weights": weights,
            "config": None if config is None else config_digest(config),
            "attention": None if config is None else attention_numerics(config),
            "dtype": str(pool.dtype),
            "block_size": pool.block_size,
            "layout": STORED_LAYOUT,
            "model_type": spec.model_type,
            "layers": layers,
        }
        shapes = None if pool.states is None else pool.states.shapes
        if shapes:  # recurrent states: their snapshots are stored too, in this layout
            described["states"] = [[s.layer, s.kind, s.index, list(s.shape), str(s.dtype)] for s in shapes]
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
