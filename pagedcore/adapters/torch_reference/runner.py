"""TorchRunner: the Engine's model runner (:class:`~pagedcore.engine.runner.ModelRunner`) for
:class:`~.llama.TorchLlama`, in plain PyTorch.

It owns a pool of its own: the core's block bookkeeping (:class:`~pagedcore.kv_pool.KVPool`, one full-attention group)
and one ``(num_blocks + 1, block_size, kv_heads, head_dim)`` key and value tensor per layer (the last block is the
zero pad block). A step's ``prepare`` does the copy-on-write copies and packs the tokens with
:func:`~pagedcore.engine.packing.pack_tokens`; ``execute`` runs the model with an ``attend`` that writes each layer's
new keys and values to their slots and asks the plugins' attention backend (the torch backend on the CPU) for
attention over the pool through the block tables. Its weights epoch: the parameters' identities and version counters
(every in-place change bumps them); when they move, the cached prefixes are forgotten.

Example:
    >>> from pagedcore.engine import Engine, SamplingParams
    >>> from pagedcore.adapters.torch_reference import TorchLlama
    >>> with Engine(TorchRunner(TorchLlama.tiny(), num_blocks=32, block_size=4)) as engine:
    ...     first, again = (engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_new_tokens=3), use_tqdm=False)
    ...                     for _ in range(2))
    ...     engine.stats().prefix_hit_tokens > 0, first[0].token_ids == again[0].token_ids
    (True, True)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from pagedcore.attention import default_block_size, to_device, write_kv
from pagedcore.config import PoolConfig
from pagedcore.engine.packing import PackedTokens, pack_tokens
from pagedcore.engine.runner import ForwardBatch, ModelInfo, RunnerStats
from pagedcore.errors import ConfigError
from pagedcore.kv_pool import KVPool
from pagedcore.plugin_manager import PluginManager, default_plugin_manager

from .llama import TorchLlama

__all__ = ["TorchRunner"]

_DEFAULT_TOKENS = 32_768  # a pool's tokens when neither num_blocks nor memory_budget is given


@dataclass(frozen=True)
class _Prepared:
    packed: PackedTokens
    keep: list[int]


class TorchRunner:
    """The model runner of a :class:`~.llama.TorchLlama` (see the module docstring).

    Args:
        model: the model (its device and dtype are the pool's).
        config: the pool's settings (:class:`~pagedcore.config.PoolConfig`: ``num_blocks`` or ``memory_budget``,
            ``block_size``, ``eviction_policy``); or give them as keyword arguments, not both. Tiers below the pool
            and other layouts are refused.
        plugins: the plugin manager (eviction policies, the attention backend, events); the default one if None.
        attention_backend: the backend's name (None: the plugins' choice for the device).

    Example:
        >>> runner = TorchRunner(TorchLlama.tiny(), num_blocks=16, block_size=4)
        >>> runner.kv.num_blocks, runner.info.vocab_size, runner.used_bytes()
        (16, 100, 0)
    """

    def __init__(
        self,
        model: TorchLlama,
        config: PoolConfig | None = None,
        *,
        plugins: PluginManager | None = None,
        attention_backend: str | None = None,
        **settings: Any,
    ) -> None:
        config = PoolConfig.of(config, **settings)
        if config.kv_store is not None or config.kv_layout not in (None, "slots"):
            raise ConfigError("the plain-PyTorch runner keeps no tiers below its pool and only the 'slots' layout")
        weight = model.lm_head.weight
        shape = model.shape
        self.model = model
        self._plugins = plugins if plugins is not None else default_plugin_manager()
        block_size = config.block_size or default_block_size(weight.device)
        per_block = 2 * shape.num_hidden_layers * block_size * int(shape.num_key_value_heads or 0)
        per_block *= int(shape.head_dim or 0) * weight.element_size()
        num_blocks = _num_blocks(config, block_size, per_block)
        policy = config.eviction_policy
        self._plugins.eviction_policy(policy, num_blocks)  # fail now on an unknown policy name
        self._backend = self._plugins.attention_backend(weight.device.type, weight.dtype, attention_backend)  # fail now
        self._kv = KVPool(
            num_blocks, block_size, eviction_policy=lambda: self._plugins.eviction_policy(policy, num_blocks)
        )
        self._lock = threading.RLock()
        self._block_bytes = per_block
        kv_shape = (num_blocks + 1, block_size, int(shape.num_key_value_heads or 0), int(shape.head_dim or 0))
        self._layers = [
            (weight.new_zeros(kv_shape), weight.new_zeros(kv_shape)) for _ in range(shape.num_hidden_layers)
        ]
        eos = shape.eos_token_id
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        self._info = ModelInfo(shape.vocab_size, shape.max_position_embeddings, eos_ids, weight.device)
        self._weights = self._fingerprint()
        self._version = 0  # weights changes seen by check_weights

    @property
    def info(self) -> ModelInfo:
        """The model's vocabulary, context, eos tokens and device."""
        return self._info

    @property
    def kv(self) -> KVPool:
        """The pool's block bookkeeping."""
        return self._kv

    @property
    def lock(self) -> threading.RLock:
        """The pool's bookkeeping lock."""
        return self._lock

    @property
    def plugins(self) -> PluginManager:
        """The plugin manager."""
        return self._plugins

    def check_weights(self, *, admitting: bool = True) -> int:
        """Forget the cached prefixes when the weights moved since the last check (a new epoch). ``admitting``
        asks for nothing more here: this model's settings are its tensors."""
        now = self._fingerprint()
        if now == self._weights:
            return 0
        self._weights = now
        self._version += 1
        return self._kv.reset_prefix_cache()

    @property
    def weights_version(self) -> int:
        """Changes of the weights seen by :meth:`check_weights` (0: the weights it started with)."""
        return self._version

    def _fingerprint(self) -> tuple[tuple[int, int], ...]:
        return tuple((p.data_ptr(), p._version) for p in self.model.parameters())  # noqa: SLF001

    def prepare(self, batch: ForwardBatch) -> _Prepared:
        """The batch's block copies in every layer, then its tokens and metadata packed."""
        if batch.copies:
            device = self._info.device
            src = to_device(torch.tensor([source for _, source, _ in batch.copies]), device)
            dst = to_device(torch.tensor([destination for _, _, destination in batch.copies]), device)
            for tensors in self._layers:
                for t in tensors:
                    t.index_copy_(0, dst, t.index_select(0, src))
        return _Prepared(pack_tokens(batch.scheduled, self._kv), list(batch.logit_rows))

    def execute(self, prepared: _Prepared) -> torch.Tensor:
        """The model over the packed tokens, attending through the pool; the kept rows' float32 logits."""
        device = self._info.device
        packed = prepared.packed
        meta = packed.metadata[0].to(device)
        backend = self._backend

        def attend(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            key_cache, value_cache = self._layers[layer]
            write_kv(key_cache, value_cache, key, value, meta.slot_mapping)
            return backend.forward(query, key_cache, value_cache, meta, scale=query.shape[-1] ** -0.5)

        ids = to_device(torch.tensor(packed.input_ids), device)
        positions = to_device(torch.tensor(packed.position_ids), device)
        with torch.inference_mode():
            logits = self.model(ids, positions, attend)
        return logits[to_device(torch.tensor(prepared.keep), device)].float()

    def used_bytes(self) -> int:
        """KV bytes of the blocks held now."""
        return self._block_bytes * self._kv.num_used_blocks

    def stats(self) -> RunnerStats:
        """KV bytes in use (no kernel fallbacks, nothing compiled)."""
        return RunnerStats(used_bytes=self.used_bytes())

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix now."""
        with self._lock:
            return self.check_weights() + self._kv.reset_prefix_cache()

    def close(self) -> None:
        """Nothing to give back: the model was never changed."""


def _num_blocks(config: PoolConfig, block_size: int, per_block: int) -> int:
    """``num_blocks``, or what ``memory_budget`` holds, or the default's."""
    if config.num_blocks is not None:
        return config.num_blocks
    if config.memory_budget is None:
        return -(-_DEFAULT_TOKENS // block_size)
    if config.memory_budget < per_block:
        raise ConfigError(f"memory_budget {config.memory_budget} holds no block of {per_block} bytes")
    return config.memory_budget // per_block
