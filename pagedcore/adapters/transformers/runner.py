"""TransformersRunner: the Engine's model runner (:class:`~pagedcore.engine.runner.ModelRunner`) for a transformers
causal LM.

It owns the model's side of an Engine: the pool (:class:`~.pool.PagedKVPool`: the layer tensors, the block
bookkeeping, the weights watch), the model's attention switched to ``attn_implementation="paged"`` (and back at
:meth:`TransformersRunner.close`), the forward through a :class:`~.step_batch.PackedCache` with every layer's
:class:`~.attention.ForwardContext`, the compiled decode step (:mod:`.compiled`), which it turns off when a
compiled step fails, and, with ``lora=``, the LoRA adapters requests name (:mod:`.lora`: steps with adapter rows run
eagerly; the compiled step runs those without).

Example:
    >>> from pagedcore.adapters.transformers.testing import tiny_llama
    >>> runner = TransformersRunner(tiny_llama(), config=PoolConfig(num_blocks=16, block_size=4))
    >>> runner.info.vocab_size, runner.kv.num_blocks, runner.model.config._attn_implementation
    (100, 16, 'paged')
    >>> runner.close(); runner.model.config._attn_implementation
    'sdpa'
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from pagedcore.attention import long_tensor, to_device
from pagedcore.config import PoolConfig
from pagedcore.engine.lora import LoRAConfig
from pagedcore.engine.packing import pack_tokens
from pagedcore.engine.runner import ArgmaxTokens, CompileCounts, ForwardBatch, ModelInfo, RunnerStats
from pagedcore.errors import ConfigError, UnsupportedModelError
from pagedcore.kv_pool import KVPool
from pagedcore.plugin_manager import PluginManager
from pagedcore.validation import as_integer

from . import row_kernel
from .argmax_head import ArgmaxHead
from .attention import ATTN_IMPLEMENTATION, CONTEXT_KEY, ForwardContext
from .compiled import CompiledDecode, DecodeInputs
from .decode_graphs import DecodeGraphs, resolve_compile
from .direct_layers import DirectLayers
from .generate_call import draws_dropout
from .hook_ids import global_hooks
from .layer_attention import check_paged_attention
from .lora import LoraAdapters
from .padded_step import PaddedStep
from .pool import PagedKVPool
from .prepacked import PrepackedLinears, installed_forward, resolve_prepack
from .probe import engine_path
from .spec import context_limit, rope_capped, text_config
from .state_spec import StateSpec
from .state_step import PreparedStateStep, StateSteps
from .step_batch import PackedCache, PreparedStep

logger = logging.getLogger(__name__)
_SHARED: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()  # model -> a forward warned of

__all__ = ["TransformersRunner", "eos_token_ids"]


class TransformersRunner:
    """The model runner of one transformers causal LM (see the module docstring).

    Args:
        model: a causal LM (its attention implementation is switched to ``"paged"`` until :meth:`close`).
        pool: a :class:`~.pool.PagedKVPool` to use (e.g. shared with ``enable``); else one is built with ``config``.
        config: the settings of a new pool (:class:`~pagedcore.config.PoolConfig`).
        compile: decode-only steps as a compiled graph: ``True`` (inductor), ``False``, ``"auto"`` (eager for now)
            or ``"cudagraphs"`` (captured from the eager step, CUDA only: :mod:`.decode_graphs`).
        attention_backend: the attention backend's name (None: the plugins' choice for the device).
        tokenizer: the model's tokenizer, when there is one: its eos stops requests too (:func:`eos_token_ids`).
        lora: serve LoRA adapters with these settings (:class:`~pagedcore.engine.lora.LoRAConfig`; the runner's
            :attr:`adapters`); None: none.
        prepack: the linear weights prepacked for the CPU's GEMM in this runner's forwards (:mod:`.prepacked`):
            ``False`` (the default: exact ties with ``generate``), ``True`` or ``"auto"`` (on the CPU in float32;
            costs a second copy of the linear weights).
        fused_argmax: argmax-only steps take their tokens inside the model's head (:mod:`.argmax_head`, where it
            applies; True by default), or always through the logits (False).
        split_rows: linear calls of a few rows split across the threads where exact and faster (:mod:`.row_split`;
            True by default), or always ``F.linear`` (False).
        row_kernel: those calls may also take the C kernel of :mod:`.row_kernel` where exact and faster (True by
            default; built at the first runner of the process), or not (False).

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
        lora: LoRAConfig | None = None,
        prepack: bool | str = False,
        fused_argmax: bool = True,
        split_rows: bool = True,
        row_kernel: bool = True,
    ) -> None:
        for name, flag in (("fused_argmax", fused_argmax), ("split_rows", split_rows), ("row_kernel", row_kernel)):
            if not isinstance(flag, bool):
                raise ConfigError(f"{name} must be True or False, got {flag!r}", param=name)
        device = model.get_input_embeddings().weight.device
        compiling = resolve_compile(compile, device)  # "inductor", "cudagraphs" or None
        states = StateSpec.from_config(text_config(model))
        if states.has_states:
            _refuse_with_states(states.model_type, compile, lora)
        self.owns_pool = pool is None
        self.pool = PagedKVPool.resolve(model, pool, config if config is not None else PoolConfig())
        with self.pool.closed_on_failure(self.owns_pool):
            ways = (fused_argmax, split_rows, row_kernel)
            self._build(model, device, compiling, attention_backend, tokenizer, lora, prepack, ways)

    def _build(
        self,
        model: Any,
        device: torch.device,
        compiling: str | None,
        attention_backend: str | None,
        tokenizer: Any,
        lora: LoRAConfig | None,
        prepack: bool | str,
        ways: tuple[bool, bool, bool],
    ) -> None:
        """The rest of :meth:`__init__`, once the pool is made: the model's steps, its adapters and its forwards
        (``ways``: fused_argmax, split_rows, row_kernel)."""
        fused_argmax, split_rows, row_kernel = ways
        self.model = model
        self.attention_backend = attention_backend
        self._text_config = text_config(model)
        vocab = as_integer(getattr(self._text_config, "vocab_size", None)) or None
        limit, note = rope_capped(context_limit(model), model)  # dynamic / longrope RoPE: up to where it changes
        self._info = ModelInfo(vocab, limit, tuple(eos_token_ids(model, tokenizer)), device, note)
        self._cache = PackedCache(self.pool)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        # A model with recurrent-state layers runs each step as the forwards its states need (state_step.py), eagerly.
        self._states = StateSteps(model, self.pool, attention_backend) if self.pool.states is not None else None
        self._decode: CompiledDecode | DecodeGraphs | None = None
        if compiling is not None and self._states is None:
            graphs = compiling == "cudagraphs"
            self._decode = DecodeGraphs(model, self.pool) if graphs else CompiledDecode(model, self.pool)
        self._decode_counts = CompileCounts()  # the counters of a compiled step turned off
        self._original_attn = getattr(self._text_config, "_attn_implementation", None)
        check_paged_attention(model, self.pool.spec.layers)  # what the paged attention cannot serve, refused now
        # Exact or refused (probe.py): the packed paged path, or left-padded rows over the model's own attention.
        verdict = engine_path(model, self.pool, TransformersRunner, attention_backend)
        self._padded = PaddedStep(model, self.pool) if verdict.path == "padded" else None
        if verdict.injected or self._padded is not None:
            self._decode = None  # the compiled step hands its attention the context at the top only, and pages it
        if self._padded is not None and lora is not None:
            raise ConfigError(
                f"enable_lora: {type(model).__name__} runs on the Engine's compatible path (left-padded rows over its "
                "own attention), which applies no LoRA adapter; serve it without enable_lora",
                param="enable_lora",
            )
        self.adapters = None if lora is None else LoraAdapters(model, self.pool, lora, keeps_logits=self._keeps_logits)
        weight = model.get_input_embeddings().weight
        packing = self._padded is None and resolve_prepack(prepack, device, weight.dtype)  # the packed forward's
        splitting = split_rows and self._padded is None and device.type == "cpu" and weight.dtype == torch.float32
        # Steps whose rows only take their argmax: their tokens taken inside the head (argmax_head.py); not
        # with adapters (a LoRA on the head), the compatible path, or a forward that computes every position's logits.
        fusing = fused_argmax and lora is None and self._padded is None and self._states is None and self._keeps_logits
        kernel = row_kernel and device.type == "cpu"  # (a CPU kernel: built only where it can serve)
        self._argmax, self._linears = _layer_forwards(model, packing, splitting, fusing, kernel)
        self._packs = self._linears if packing else None
        # The packed forward's decoder layers as direct calls, where the family is known (direct_layers.py).
        self._direct = DirectLayers.of(model) if self._padded is None and self._states is None else None

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
    def prepacked(self) -> PrepackedLinears | None:
        """The linear weights prepacked for this runner's forwards (None: not prepacking)."""
        return self._packs

    def row_split_ways(self) -> dict[tuple[int, int, bool, int, int, int], str | None]:
        """How this runner's forwards compute each few-row linear shape (:meth:`~.row_split.RowSplit.ways`; empty
        off the CPU or float32)."""
        return {} if self._linears is None else self._linears.row_split.ways()

    @property
    def argmax_head(self) -> ArgmaxHead | None:
        """The fused greedy head of argmax-only steps (None: not on this model or runner; :mod:`.argmax_head`)."""
        return self._argmax

    @property
    def plugins(self) -> PluginManager:
        """The pool's plugin manager."""
        return self.pool.plugins

    # ------------------------------------------------------------------ a step
    def check_weights(self, *, admitting: bool = True) -> int:
        """The pool's weights check (:meth:`~.pool.PagedKVPool.check_weights`; ``admitting``: with each module's
        settings, where a prefix lookup follows), and the adapters' (changed in place, or unloaded and no longer
        used: :meth:`~.lora.LoraAdapters.maintain`); a new weights version drops the packed weights (rebuilt from
        the new ones at their next use)."""
        forgotten = self.pool.check_weights(settings=admitting)
        if self._linears is not None:
            self._linears.refresh(self.pool.weights_version)
        return forgotten + self.adapters.maintain() if self.adapters is not None else forgotten

    @property
    def weights_version(self) -> int:
        """The pool's weights version (:attr:`~.pool.PagedKVPool.weights_version`)."""
        return self.pool.weights_version

    def prepare(self, batch: ForwardBatch) -> PreparedStep | PreparedStateStep:
        """The batch's copy-on-write copies, then its tokens packed with each KV group's metadata (a model with
        recurrent-state layers: its state slots and snapshots too, as :class:`~.state_step.StateSteps` prepares)."""
        if self._states is not None:
            return self._states.prepare(batch)
        self.pool.copy_blocks(list(batch.copies))
        packed = pack_tokens(batch.scheduled, self.pool.kv)
        positions = _packed_positions(self.pool, packed.position_ids)
        context = ForwardContext(self.pool, list(packed.metadata), None, self.attention_backend, positions=positions)
        keep = list(batch.logit_rows)
        adapters = None if self.adapters is None else self.adapters.step(batch.scheduled, keep, self._info.device)
        return PreparedStep(packed, context, keep, batch.is_decode, adapters, batch.argmax_only)

    def execute(self, prepared: PreparedStep | PreparedStateStep) -> torch.Tensor | ArgmaxTokens:
        """The forward: the compiled decode step when it runs one, else the model eagerly with paged attention (an
        argmax-only step: its tokens, through :class:`~.argmax_head.ArgmaxHead`, where it applies). A model that
        draws dropout (in train() mode, any dropout above 0) is refused: its prefix hits hold keys of another draw."""
        # checked per step: the mode can change between steps (TRL: dropout 0 served); over the weights watch's walk
        # where it is still the model's tree (no walk of the tree here)
        watch = self.pool.weights
        if draws_dropout(self.model, None if watch is None else watch.modules(self.model)):
            raise UnsupportedModelError(
                f"{type(self.model).__name__} draws dropout (train() mode with a dropout above 0): the Engine serves "
                "inference only, where a prompt's cached keys equal its own; put the model in eval() mode"
            )
        device = self._info.device
        if isinstance(prepared, PreparedStateStep):
            assert self._states is not None
            return self._states.execute(prepared, device)
        # not while a global module hook is set: a graph has no guard on them (a graph traced with one would keep it,
        # one traced without would skip it); the eager step calls it at every module
        if self._decode is not None and prepared.is_decode and prepared.adapters is None and not global_hooks():
            logits = self._forward_compiled(self._decode, prepared, device)
            if logits is not None:
                return logits
        if self._padded is not None:  # the compatible path (probe.py chose it): left-padded rows, the model's attention
            return self._padded.logits(prepared)
        packed = prepared.packed
        self._cache.begin([meta.slot_mapping for meta in packed.metadata], prepared.context)
        kwargs: dict[str, Any] = {
            "input_ids": to_device(long_tensor(packed.input_ids)[None], device),
            "position_ids": to_device(long_tensor(packed.position_ids)[None], device),
            "cache": self._cache,
            "use_cache": True,
            CONTEXT_KEY: prepared.context,
        }
        keep = prepared.keep
        if self._keeps_logits:
            kwargs["logits_to_keep"] = to_device(long_tensor(keep), device) if keep else 1
        packs = self._linears.active() if self._linears is not None else contextlib.nullcontext()
        forward = self._model_forward(prepared, kwargs)
        with torch.inference_mode(), self._adapters_applied(prepared), packs:
            if self._argmax is not None and prepared.argmax_only and prepared.adapters is None:
                return self._argmax.step(lambda: forward()[0], len(keep))
            logits = forward()[0]
        if not self._keeps_logits and keep:
            logits = logits[to_device(long_tensor(keep), logits.device)]
        return logits.float()  # (len(keep), vocab)

    def _model_forward(self, prepared: PreparedStep, kwargs: dict[str, Any]) -> Callable[[], torch.Tensor]:
        """The packed forward's logits ``(1, rows, vocab)`` as a call: the direct layers' where they serve this step
        (:mod:`.direct_layers`, whose first step is checked against the model's), else the model's (with LoRA rows,
        and in a probe's forward)."""
        direct = self._direct
        probing = prepared.context.trace is not None  # a probe's forward examines the model's own layers
        if direct is None or prepared.adapters is not None or probing or not direct.serves():
            return lambda: self.model(**kwargs).logits
        return functools.partial(direct.logits, kwargs)

    def _forward_compiled(
        self, decode: CompiledDecode | DecodeGraphs, prepared: PreparedStep, device: torch.device
    ) -> torch.Tensor | ArgmaxTokens | None:
        """The decode step's logits from the compiled graph; None (and compiling off from here on) if it failed: the
        step then runs eagerly, rewriting the same slots."""
        linears = self._linears.active() if self._linears is not None else contextlib.nullcontext()
        try:
            inputs = DecodeInputs.from_batch(prepared.packed, self.pool, device)
            head = self._argmax if prepared.argmax_only and isinstance(decode, CompiledDecode) else None
            with linears:  # the graph's linears split their rows as the eager forward's (prepacked.row_linear)
                if isinstance(decode, CompiledDecode):
                    decode.settle(inputs)  # a new row count: its split measured before the graph traces it
                if head is not None:  # the head's op in the graph takes the tokens (argmax_head.head_call)
                    return head.step(lambda: decode(inputs), inputs.real, padded=inputs.key[0])
                return decode(inputs).float()
        except Exception:
            logger.exception("pagedcore: the compiled decode step failed; this Engine runs eagerly from here on")
            self._decode_counts = dataclasses.replace(decode.counts, failures=1)  # kept for stats()
            self._decode = None
            return None

    def _adapters_applied(self, prepared: PreparedStep) -> AbstractContextManager[Any]:
        """The forward applies each row's LoRA adapter (:meth:`~.lora.LoraAdapters.applied`), if any row has one."""
        if self.adapters is None or prepared.adapters is None:
            return contextlib.nullcontext()
        return self.adapters.applied(prepared.adapters)

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
        pool (so a restart finds them; a pool this runner built closes its tiers and the stores it made). The model
        loses its adapters, and a compiled or captured decode step its graphs (their memory with them)."""
        if self._decode is not None:
            self._decode_counts, self._decode = self._decode.counts, None
        if self.adapters is not None:
            self.adapters.close()
        if self._original_attn is not None and self._original_attn != ATTN_IMPLEMENTATION:
            self.model.set_attn_implementation(self._original_attn)
        if self._linears is not None:
            self._linears.close()
        if self._argmax is not None:
            self._argmax.close()
        if self.pool.tiers is None:
            return
        try:
            self.pool.save_kv_store()  # the blocks still cached, so that a restart finds them
            if self.owns_pool:
                self.pool.close_tiers()  # its writer, and the stores it made (a store's open directory)
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


def _layer_forwards(
    model: Any, packing: bool, splitting: bool, fusing: bool, kernel: bool
) -> tuple[ArgmaxHead | None, PrepackedLinears | None]:
    """The fused greedy head and the linear layers' forwards the runner installs (each where asked). Packs take every
    linear layer, the head too (the fused head then does not install); without packs the fused head installs first
    (it splits its own GEMM) and the split (:mod:`.row_split`, with :mod:`.row_kernel`'s kernel where ``kernel``,
    as the fused head's screen) takes the layers left, the head too where no fused head took it."""
    others = [f for m in model.modules() if (f := installed_forward(m)) is not None]  # another Engine's forwards
    taken = len(others) if packing or splitting or fusing else 0
    warned = _SHARED.get(model)
    if taken and (warned is None or warned() is not others[0]):  # once per other Engine (not for its probe's too)
        _SHARED[model] = weakref.ref(others[0])
        logger.warning(
            "pagedcore: %d linear layers of this %s already run another open Engine's forwards (two Engines on one "
            "model share its modules): this Engine runs them without its own row split, packs and fused greedy head "
            "(the same tokens, slower). Close the other Engine first, or give each Engine its own copy of the model",
            taken,
            type(model).__name__,
        )
    screen = row_kernel.load() if kernel else None  # the fused head's screen's float16 product, too
    if packing:
        linears = PrepackedLinears(model, split=splitting, kernel=kernel)
        return (ArgmaxHead.install(model, screen) if fusing else None), linears
    head = ArgmaxHead.install(model, screen) if fusing else None
    return head, (PrepackedLinears(model, pack=False, kernel=kernel) if splitting else None)


def _packed_positions(pool: PagedKVPool, positions: list[int]) -> torch.Tensor | None:
    """The packed tokens' positions, for a model whose attention needs them beyond ``position_ids`` (Llama 4's
    query temperature: :func:`~.layer_attention.retemper`); None for every other model."""
    if not any(layer.query_temperature is not None for layer in pool.spec.layers):
        return None
    return long_tensor(positions)


def _refuse_with_states(model_type: str, compile: bool | str, lora: LoRAConfig | None) -> None:
    """What a model with recurrent-state layers cannot run here, refused by name before anything is built."""
    if compile is True or compile == "cudagraphs":
        raise ConfigError(
            f"compile={compile!r}: {model_type!r} keeps recurrent states, whose layers the compiled decode step "
            "does not run; use compile=False or 'auto'",
            param="compile",
        )
    if lora is not None:
        raise ConfigError(
            f"enable_lora: {model_type!r} keeps recurrent states, whose per-step forwards do not apply LoRA adapters "
            "yet; serve it without enable_lora",
            param="enable_lora",
        )
