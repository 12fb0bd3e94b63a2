"""TransformersRunner: the Engine's model runner (:class:`~pagedcore.engine.runner.ModelRunner`) for a transformers
causal LM.

It owns the model's side of an Engine: the pool (:class:`~.pool.PagedKVPool`: the layer tensors, the block
bookkeeping, the weights watch), the model's attention switched to ``attn_implementation="paged"`` (and back at
:meth:`TransformersRunner.close`), the forward through a :class:`~.step_batch.PackedCache` with every layer's
:class:`~.attention.ForwardContext`, and the compiled decode step (:mod:`.compiled`), which it turns off when a
compiled step fails.

Example:
    >>> from pagedcore.adapters.transformers.testing import tiny_llama
    >>> runner = TransformersRunner(tiny_llama(), config=PoolConfig(num_blocks=16, block_size=4))
    >>> runner.info.vocab_size, runner.kv.num_blocks, runner.model.config._attn_implementation
    (100, 16, 'paged')
    >>> runner.close(); runner.model.config._attn_implementation
    'sdpa'
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from contextlib import AbstractContextManager
from typing import Any

import torch

from pagedcore.attention import to_device
from pagedcore.config import PoolConfig
from pagedcore.engine.packing import pack_tokens
from pagedcore.engine.runner import CompileCounts, ForwardBatch, ModelInfo, RunnerStats
from pagedcore.kv_pool import KVPool
from pagedcore.plugin_manager import PluginManager
from pagedcore.validation import as_integer

from .attention import ATTN_IMPLEMENTATION, CONTEXT_KEY, ForwardContext
from .compiled import CompiledDecode, DecodeInputs, resolve_compile
from .layer_attention import check_paged_attention
from .padded_step import PaddedStep
from .pool import PagedKVPool
from .probe import engine_path
from .spec import context_limit, text_config
from .step_batch import PackedCache, PreparedStep

logger = logging.getLogger(__name__)

__all__ = ["TransformersRunner", "eos_token_ids"]


class TransformersRunner:
    """The model runner of one transformers causal LM (see the module docstring).

    Args:
        model: a causal LM (its attention implementation is switched to ``"paged"`` until :meth:`close`).
        pool: a :class:`~.pool.PagedKVPool` to use (e.g. shared with ``enable``); else one is built with ``config``.
        config: the settings of a new pool (:class:`~pagedcore.config.PoolConfig`).
        compile: decode-only steps as a compiled graph: ``True``, ``False`` or ``"auto"`` (on CUDA).
        attention_backend: the attention backend's name (None: the plugins' choice for the device).
        tokenizer: the model's tokenizer, when there is one: its eos stops requests too (:func:`eos_token_ids`).

    Example:
        >>> from pagedcore.engine import Engine
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> with Engine(TransformersRunner(tiny_llama(), config=PoolConfig(num_blocks=16, block_size=4))) as engine:
        ...     (out,) = engine.generate([[1, 2, 3]], {"max_new_tokens": 2}, use_tqdm=False)
        >>> len(out.token_ids)
        2
    """

    def __init__(
        self,
        model: Any,
        *,
        pool: PagedKVPool | None = None,
        config: PoolConfig | None = None,
        compile: bool | str = "auto",
        attention_backend: str | None = None,
        tokenizer: Any = None,
    ) -> None:
        device = model.get_input_embeddings().weight.device
        compiling = resolve_compile(compile, device)
        self.owns_pool = pool is None
        self.pool = PagedKVPool.resolve(model, pool, config if config is not None else PoolConfig())
        self.model = model
        self.attention_backend = attention_backend
        self._text_config = text_config(model)
        vocab = as_integer(getattr(self._text_config, "vocab_size", None)) or None
        self._info = ModelInfo(vocab, context_limit(model), tuple(eos_token_ids(model, tokenizer)), device)
        self._cache = PackedCache(self.pool)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._decode = CompiledDecode(model, self.pool) if compiling else None
        self._decode_counts = CompileCounts()  # the counters of a compiled step turned off
        self._original_attn = getattr(self._text_config, "_attn_implementation", None)
        check_paged_attention(model, self.pool.spec.layers)  # what the paged attention cannot serve, refused now
        # Exact or refused (probe.py): the packed paged path, or left-padded rows over the model's own attention.
        verdict = engine_path(model, self.pool, TransformersRunner, attention_backend)
        self._padded = PaddedStep(model, self.pool) if verdict.path == "padded" else None
        if verdict.injected:
            self._decode = None  # the compiled step hands its attention the context at the top only

    # ------------------------------------------------------------------ the protocol's state
    @property
    def info(self) -> ModelInfo:
        """The model's vocabulary, context, eos tokens and device."""
        return self._info

    @property
    def kv(self) -> KVPool:
        """The pool's block bookkeeping."""
        return self.pool.kv

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """The pool's bookkeeping lock (every holder of the pool takes it)."""
        return self.pool.lock

    @property
    def plugins(self) -> PluginManager:
        """The pool's plugin manager."""
        return self.pool.plugins

    # ------------------------------------------------------------------ a step
    def check_weights(self) -> int:
        """The pool's weights check (:meth:`~.pool.PagedKVPool.check_weights`)."""
        return self.pool.check_weights()

    @property
    def weights_version(self) -> int:
        """The pool's weights version (:attr:`~.pool.PagedKVPool.weights_version`)."""
        return self.pool.weights_version

    def prepare(self, batch: ForwardBatch) -> PreparedStep:
        """The batch's copy-on-write copies, then its tokens packed with each KV group's metadata."""
        self.pool.copy_blocks(list(batch.copies))
        packed = pack_tokens(batch.scheduled, self.pool.kv)
        positions = _packed_positions(self.pool, packed.position_ids)
        context = ForwardContext(self.pool, list(packed.metadata), None, self.attention_backend, positions=positions)
        return PreparedStep(packed, context, list(batch.logit_rows), batch.is_decode)

    def execute(self, prepared: PreparedStep) -> torch.Tensor:
        """The forward: the compiled decode step when it runs one, else the model eagerly with paged attention."""
        device = self._info.device
        if self._decode is not None and prepared.is_decode:
            logits = self._forward_compiled(self._decode, prepared, device)
            if logits is not None:
                return logits
        if self._padded is not None:  # the compatible path (probe.py chose it): left-padded rows, the model's attention
            return self._padded.logits(prepared)
        packed = prepared.packed
        self._cache.begin([meta.slot_mapping for meta in packed.metadata], prepared.context)
        kwargs: dict[str, Any] = {
            "input_ids": to_device(torch.tensor([packed.input_ids]), device),
            "position_ids": to_device(torch.tensor([packed.position_ids]), device),
            "cache": self._cache,
            "use_cache": True,
            CONTEXT_KEY: prepared.context,
        }
        keep = prepared.keep
        if self._keeps_logits:
            kwargs["logits_to_keep"] = to_device(torch.tensor(keep), device) if keep else 1
        with torch.inference_mode():
            logits = self.model(**kwargs).logits[0]
        if not self._keeps_logits and keep:
            logits = logits[to_device(torch.tensor(keep), logits.device)]
        return logits.float()  # (len(keep), vocab)

    def _forward_compiled(
        self, decode: CompiledDecode, prepared: PreparedStep, device: torch.device
    ) -> torch.Tensor | None:
        """The decode step's logits from the compiled graph; None (and compiling off from here on) if it failed: the
        step then runs eagerly, rewriting the same slots."""
        try:
            return decode(DecodeInputs.from_batch(prepared.packed, self.pool, device)).float()
        except Exception:
            logger.exception("pagedcore: the compiled decode step failed; this Engine runs eagerly from here on")
            self._decode_counts = dataclasses.replace(decode.counts, failures=1)  # kept for stats()
            self._decode = None
            return None

    # ------------------------------------------------------------------ figures and lifecycle
    def used_bytes(self) -> int:
        """KV bytes held by running sequences now."""
        return self.pool.used_bytes()

    def stats(self) -> RunnerStats:
        """KV bytes in use, the attention kernels' fallbacks and the compiled step's counters."""
        counts = self._decode.counts if self._decode is not None else self._decode_counts
        return RunnerStats(self.used_bytes(), self._kernel_failures(), counts)

    def _kernel_failures(self) -> int:
        """The attention backend's kernel calls that fell back to the torch backend (0 if it does not count)."""
        weight = self.model.get_input_embeddings().weight
        backend = self.pool.attention_backend(weight.device, weight.dtype, self.attention_backend)
        return int(getattr(getattr(backend, "stats", None), "kernel_failures", 0))

    def reset_prefix_cache(self) -> int:
        """The pool's :meth:`~.pool.PagedKVPool.reset_prefix_cache`."""
        return self.pool.reset_prefix_cache()

    def close(self) -> None:
        """Give the model its attention implementation back, and write the cached prefixes to the tiers below the
        pool (so a restart finds them; a pool this runner built closes its tiers)."""
        if self._original_attn is not None and self._original_attn != ATTN_IMPLEMENTATION:
            self.model.set_attn_implementation(self._original_attn)
        tiers = self.pool.tiers
        if tiers is None:
            return
        try:
            self.pool.save_kv_store()  # the blocks still cached, so that a restart finds them
            if self.owns_pool:
                tiers.close()
        except Exception:
            logger.exception("pagedcore: writing the cached prefixes to the KV store while closing failed")


def eos_token_ids(model: Any, tokenizer: Any = None) -> list[int]:
    """The default stop tokens: the generation config's eos (the model config's if none) and the tokenizer's (a
    base model's folder often names its eos only there: vLLM stops at it too). A generation config whose
    ``eos_token_id`` is an empty list says "no eos" explicitly (the built-in demo model's): then none.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> eos_token_ids(tiny_llama())
        [2]
    """
    config = getattr(model, "generation_config", None)
    eos = config.eos_token_id if config is not None else getattr(text_config(model), "eos_token_id", None)
    ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    if eos is not None and not ids:
        return ids
    own = getattr(tokenizer, "eos_token_id", None)
    if isinstance(own, int) and own not in ids:
        ids.append(own)
    return ids


def _packed_positions(pool: PagedKVPool, positions: list[int]) -> torch.Tensor | None:
    """The packed tokens' positions, for a model whose attention needs them beyond ``position_ids`` (Llama 4's
    query temperature: :func:`~.layer_attention.retemper`); None for every other model."""
    if not any(layer.query_temperature is not None for layer in pool.spec.layers):
        return None
    return torch.tensor(positions, dtype=torch.long)
