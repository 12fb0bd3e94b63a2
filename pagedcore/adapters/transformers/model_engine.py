"""``pagedcore.adapters.transformers.Engine``: the Engine (:class:`pagedcore.engine.Engine`) over a transformers model.

It builds the model's runner (:class:`~.runner.TransformersRunner`: the pool, paged attention, the compiled decode
step) and reads ``model.generate``'s keyword arguments (:class:`~.generate_kwargs.GenerateKwargs`); everything else is
the framework-agnostic Engine's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pagedcore.config import KVStoreSpec, PoolConfig
from pagedcore.engine.config import EngineConfig
from pagedcore.engine.engine import Engine as BaseEngine

from .generate_kwargs import GenerateKwargs
from .pool import PagedKVPool
from .runner import TransformersRunner

__all__ = ["Engine"]


class Engine(BaseEngine):
    """Continuous batching of many requests over one transformers model.

    Args:
        model: a causal LM (its attention implementation is switched to ``"paged"`` until :meth:`close`).
        tokenizer: optional; lets prompts be strings and outputs carry text.
        config: the Engine's settings (:class:`~pagedcore.engine.config.EngineConfig`: the pool's, the scheduler's
            and its own); or give them as the keyword arguments below, not both.
        pool: a :class:`PagedKVPool` to use (e.g. shared with ``enable``); else one is built from the pool settings.
        num_blocks / memory_budget / block_size / eviction_policy: sizing of a new pool.
        max_num_batched_tokens: tokens computed per step (the token budget; long prompts are chunked; 512).
        max_num_seqs: sequences running at once (64).
        enable_prefix_caching: reuse cached prompt prefixes (True).
        attention_backend: backend name (default: the plugins' choice for the device).
        watermark: fraction of blocks kept free when admitting new requests (0.01).
        scheduling_policy: ``"fair"`` (the default: round-robin over namespaces, so one tenant's burst does not hold
            back another's first token), ``"fcfs"``, or ``"priority"`` (lowest ``priority=`` first, as vLLM); see
            :class:`~pagedcore.scheduler.SchedulerConfig`.
        max_logprobs: the most ``logprobs`` / ``prompt_logprobs`` a request may ask for (vLLM's default, 20; -1:
            no limit, so ``-1``, the whole vocabulary, is allowed).
        max_model_len: the context served (prompt + new tokens), at most the model's (default: the model's).
        compile: run decode-only steps as a graph over power-of-two batch and context buckets (prefill and mixed
            steps stay eager): ``True`` (inductor, :mod:`.compiled`; with CUDA graphs on CUDA; each bucket's first
            step compiles, seconds to tens of seconds), ``"cudagraphs"`` (CUDA only: captured from the eager step,
            nothing compiled, :mod:`.decode_graphs`), ``False``, or ``"auto"`` (eager for now, on every device).
            ``stats()`` counts the graphs; a compiled step or capture that fails (logged) turns graphs off for this
            Engine and runs eagerly.
        kv_store / kv_store_bytes: tiers below a new pool (a directory and its budget; see :class:`PagedKVPool`):
            evicted prefixes are written there and loaded back before a prefill that continues them; :meth:`close`
            writes the cached ones too, so a restarted Engine on the same model answers them from the store.
        compile_timeout: seconds a structured-output request may wait for its grammar to compile (in a worker,
            off the step loop) before it fails with :class:`~pagedcore.errors.GrammarTimeoutError` (30).
        enable_lora / max_loras / max_lora_rank: serve LoRA adapters (vLLM's names; see :mod:`.lora`): load them
            with ``engine.loras.load(name, folder)``, and a request names its adapter (``lora="name"``); at most
            ``max_loras`` (1) in the model at once, none of a rank above ``max_lora_rank`` (16).
        state_slots / snapshot_interval: a model with recurrent-state layers (Qwen3.5, Mamba-2...; docs/families.md):
            the slots of a new pool (live states and snapshots) and how often a prompt keeps a snapshot of its state
            (every this many blocks; 1 by default) for later prompts to resume.
        prepack: the linear weights prepacked for the CPU's GEMM in the Engine's forwards (:mod:`.prepacked`):
            ``False`` (the default), ``True`` or ``"auto"`` (on the CPU in float32). About 1.2x faster decode steps
            of 16-64 rows, for a second copy of the linear weights; packs are rebuilt after the weights change, and
            only the Engine's forwards use them. Off by default: the packed GEMM sums in another order, so logits move
            by float noise (2e-6 measured) and a greedy near-tie can pick the other token than ``generate`` does.
        fused_argmax: steps whose rows only take their argmax take it inside the model's head, a vocabulary chunk
            at a time or over the whole GEMM, whichever each bucket of row counts measured faster (:mod:`.argmax_head`:
            on the CPU in float32, where the checks find the chunks bit-identical to the whole head; the tokens are
            ``generate``'s). True by default; False keeps the logits path (for comparing the two).
        split_rows: linear calls of up to 256 rows (decode steps) split across the CPU's threads as one batched
            product over the weight's row blocks (:mod:`.row_split`: on the CPU in float32 with 2+ threads, per
            shape and row count only where its bits are ``F.linear``'s and it is faster; the tokens are
            ``generate``'s). True by default; False keeps ``F.linear`` (for comparing the two).
        row_kernel: those few-row calls may also take a C kernel that reads each weight once and sums in MKL's
            order (:mod:`.row_kernel`: built with the system's C compiler at the process's first Engine, about a
            second; AVX2 CPUs on Linux; per shape and row count only where its bits are ``F.linear``'s and it is
            faster). True by default; False keeps the split and ``F.linear`` (for comparing).

    Generation parameters: either a :class:`~pagedcore.engine.sampling.SamplingParams` (or a dict of its fields), or
    ``model.generate``'s keyword arguments (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
    ``min_p``, ``repetition_penalty``, ``sequence_bias``, ``num_return_sequences``, ``eos_token_id``,
    ``stop_strings``, ``min_new_tokens``, ``output_logits``, ``generation_config=``, plus ``seed``, ``logprobs``,
    ``prompt_logprobs``, ``presence_penalty`` and ``frequency_penalty``), with the model's ``generation_config`` as
    the default exactly as ``model.generate`` uses it; not both. The rest (log-probabilities, stopping and text,
    structured outputs, threads, reporting) is :class:`pagedcore.engine.Engine`'s.

    Example:
        >>> import torch
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import Engine, SamplingParams
        >>> model = tiny_llama()
        >>> with Engine(model, num_blocks=64, block_size=8) as engine:
        ...     outs = engine.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=4), use_tqdm=False)
        ...     same = engine.generate([[1, 2, 3], [4, 5, 6, 7]], max_new_tokens=4, do_sample=False, use_tqdm=False)
        >>> [len(o.token_ids) for o in outs], [o.token_ids for o in outs] == [o.token_ids for o in same]
        ([4, 4], True)
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        config: EngineConfig | None = None,
        pool: PagedKVPool | None = None,
        num_blocks: int | None = None,
        memory_budget: int | float | str | None = None,
        block_size: int | None = None,
        eviction_policy: str | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        enable_prefix_caching: bool | None = None,
        attention_backend: str | None = None,
        watermark: float | None = None,
        scheduling_policy: str | None = None,
        max_logprobs: int | None = None,
        max_model_len: int | None = None,
        compile: bool | str | None = None,
        kv_store: KVStoreSpec | None = None,
        kv_store_bytes: int | float | str | None = None,
        compile_timeout: float | None = None,
        enable_lora: bool | None = None,
        max_loras: int | None = None,
        max_lora_rank: int | None = None,
        state_slots: int | None = None,
        snapshot_interval: int | None = None,
        prepack: bool | str = False,
        fused_argmax: bool = True,
        split_rows: bool = True,
        row_kernel: bool = True,
    ) -> None:
        settings = dict(locals())
        runner_only = ("prepack", "fused_argmax", "split_rows", "row_kernel")  # the runner's, not EngineConfig's
        for name in ("self", "model", "tokenizer", "config", "pool", "__class__", *runner_only):
            settings.pop(name, None)
        config = EngineConfig.of(config, **settings)  # every setting checked before anything changes
        runner = TransformersRunner(
            model,
            pool=pool,
            config=config.pool,
            compile=config.compile,
            attention_backend=config.attention_backend,
            tokenizer=tokenizer,
            lora=config.lora,
            prepack=prepack,
            fused_argmax=fused_argmax,
            split_rows=split_rows,
            row_kernel=row_kernel,
        )
        try:
            own = replace(config, pool=PoolConfig(), compile="auto", attention_backend=None, lora=None)  # the runner's
            super().__init__(runner, tokenizer, config=own, arguments=GenerateKwargs(model))
        except BaseException:
            runner.close()
            raise
        self.config = config  # the settings it was built with, the pool's included

    @property
    def model(self) -> Any:
        """The model."""
        return self._transformers_runner.model

    @property
    def pool(self) -> PagedKVPool:
        """The model's pool (shared with ``enable()`` and caches when given as ``pool=``)."""
        return self._transformers_runner.pool

    @property
    def attention_backend(self) -> str | None:
        """The attention backend's name (None: the plugins' choice)."""
        return self.config.attention_backend

    @property
    def _transformers_runner(self) -> TransformersRunner:
        runner = self.runner
        assert isinstance(runner, TransformersRunner)
        return runner
