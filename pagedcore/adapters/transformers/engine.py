"""Engine: continuous batching over a transformers model, driven by pagedcore's scheduler and prefix trie.

Each :meth:`Engine.step` runs five stages: **schedule** (the :class:`~pagedcore.scheduler.Scheduler` says what to
compute: decodes first, then chunks of prefills, within the token budget), **prepare** (:func:`.step_batch.pack`
packs every scheduled token of every sequence into one ``(1, num_tokens)`` batch without padding), **forward** (the
model runs once with ``attn_implementation="paged"``: the attention reads each sequence's keys and values from the
pool through its block table), **sample** (:func:`.sampling.sample_rows` draws the next token of every sequence
that completed its known tokens) and **record** (the tokens go back to the scheduler, which stops a sequence at a
stop token or its length, and through each sample's :class:`~.stopping.SampleText`, which decodes them
incrementally and stops a sample at a stop string in the same step; they become token events and, when a sample
finishes, its output). New requests join between steps; finished ones release their blocks and leave their full
blocks in the prefix cache for later requests.

Thread safety: ``add_request`` / ``abort`` / ``stats`` / ``has_unfinished`` may be called from any thread while
another thread runs ``step`` or ``step_events``; they serialize on one lock that a step holds only while it
schedules, prepares and records (not during the forward and sampling, which read only the step's own batch). That
lock includes the pool's bookkeeping lock (``pool.lock``), which guards the pool's blocks for every holder, so an
Engine and ``enable()``d ``generate`` calls (or caches) can share one pool from different threads. An
abort during a forward finishes the request at once; its blocks go back when the forward ends (it is still
writing into them) and the token sampled for it is dropped. Only one thread may step at a time.

Reporting: every request is reported exactly once, by whoever is waiting for it. ``generate`` returns its own
requests' outputs and ``stream`` yields its own requests' events; everything else (requests queued with
``add_request``, and the requests of a ``generate``/``stream`` that was interrupted or closed early, which are
aborted) is reported by the next ``step()`` / ``step_events()``, whatever other call ran the steps meanwhile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import logging
import threading
import time
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from pagedcore.attention import to_device
from pagedcore.errors import (
    ConcurrentUseError,
    ConfigError,
    InvalidRequestError,
    PagedCoreError,
    RequestNotFoundError,
    UnsupportedModelError,
)
from pagedcore.kv_tiers import TierStats
from pagedcore.scheduler import Scheduler, SchedulerConfig
from pagedcore.sequence import FinishReason, SequenceState
from pagedcore.validation import as_integer, integer
from pagedcore.validation import token_ids as valid_token_ids

from .attention import ATTN_IMPLEMENTATION, CONTEXT_KEY
from .compiled import CompileCounts, CompiledDecode, DecodeInputs, resolve_compile
from .detokenizer import DecodeError, IncrementalDetokenizer
from .inputs import as_prompt_list, token_id_list
from .locks import Locks
from .logprobs import prompt_logprobs
from .outputs import EngineStats, RequestMetrics, RequestOutput, SampleOutput, StepOutput, TokenEvent, TokenLogprobs
from .pool import KVStoreSpec, PagedKVPool
from .request import EngineRequest
from .sampling import SamplingParams, StepSamples, merge_generation_config, sample_rows, to_sampling_params
from .spec import context_limit, text_config
from .step_batch import PackedCache, StepBatch, pack
from .stopping import SampleText, StopStrings, stop_strings
from .structured.requests import EngineGrammars, RequestGrammar
from .structured.spec import StructuredOutput

logger = logging.getLogger(__name__)

__all__ = ["Engine"]

Prompt = str | Sequence[int] | torch.Tensor
Params = SamplingParams | dict[str, Any]
_ENDED = (FinishReason.ABORT.value, FinishReason.ERROR.value)
_PHASES = ("schedule", "prepare", "forward", "sample", "record")  # the stages of a step, timed in stats()


@dataclass(frozen=True)
class _Generation:
    """Parameters given in transformers' words, merged with the model's generation_config (per call)."""

    config: Any  # transformers.GenerationConfig
    extras: dict[str, Any]  # sampling.GENERATE_EXTENSIONS given (seed, logprobs, ...)
    structured: StructuredOutput | None = None  # generate(structured=...) / generate(response_format=...)


class Engine:
    """Continuous batching of many requests over one transformers model.

    Args:
        model: a causal LM (its attention implementation is switched to ``"paged"`` until :meth:`close`).
        tokenizer: optional; lets prompts be strings and outputs carry text.
        pool: a :class:`PagedKVPool` to use (e.g. shared with ``enable``); else one is built from the sizing args.
        num_blocks / memory_budget / block_size: sizing of a new pool.
        max_num_batched_tokens: tokens computed per step (the token budget; long prompts are chunked).
        max_num_seqs: sequences running at once.
        enable_prefix_caching: reuse cached prompt prefixes.
        attention_backend: backend name (default: the plugins' choice for the device).
        watermark: fraction of blocks kept free when admitting new requests.
        scheduling_policy: ``"fair"`` (the default: round-robin over namespaces, so one tenant's burst does not hold
            back another's first token), ``"fcfs"``, or ``"priority"`` (lowest ``priority=`` first, as vLLM); see
            :class:`~pagedcore.scheduler.SchedulerConfig`.
        max_logprobs: the most ``logprobs`` / ``prompt_logprobs`` a request may ask for (vLLM's default, 20; -1:
            no limit, so ``-1``, the whole vocabulary, is allowed).
        compile: run decode-only steps as a compiled graph over power-of-two batch and context buckets
            (:mod:`.compiled`; prefill and mixed steps stay eager): ``True``, ``False``, or ``"auto"`` (on CUDA, with
            CUDA graphs; not on the CPU, where compiling each bucket costs seconds). ``stats()`` counts the graphs
            compiled; a compiled step that fails (logged) turns compiling off for this Engine and runs eagerly.
        kv_store / kv_store_bytes: tiers below a new pool (a directory and its budget; see :class:`PagedKVPool`):
            evicted prefixes are written there and loaded back before a prefill that continues them; :meth:`close`
            writes the cached ones too, so a restarted Engine on the same model answers them from the store.
        compile_timeout: seconds a structured-output request may wait for its grammar to compile (in a worker,
            off the step loop) before it fails with :class:`~pagedcore.errors.GrammarTimeoutError`.

    Generation parameters: either a :class:`SamplingParams` (or a dict of its fields), or ``model.generate``'s
    keyword arguments (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``min_p``,
    ``repetition_penalty``, ``sequence_bias``, ``num_return_sequences``, ``eos_token_id``, ``stop_strings``,
    ``min_new_tokens``, ``output_logits``, ``generation_config=``, plus ``seed``, ``logprobs``, ``prompt_logprobs``,
    ``presence_penalty`` and ``frequency_penalty``), with the model's ``generation_config`` as the default exactly
    as ``model.generate`` uses it; not both.

    Log-probabilities: ``logprobs=k`` gives each generated token's :class:`~.outputs.TokenLogprobs` (in
    ``SampleOutput.logprobs`` and ``TokenEvent.logprobs``), ``prompt_logprobs=k`` each prompt token's (in
    ``RequestOutput.prompt_logprobs``), from the model's logits before any processing (vLLM's ``raw_logprobs``).

    Stopping and text are the Engine's: a sample stops at a stop token (eos by default), at its length, or at a stop
    string (``stop_strings``, matched in its text across token boundaries; needs the tokenizer), in the step that
    produced the token that ends it; its text is decoded incrementally (:mod:`.detokenizer`), so streamed text never
    holds half a character and the pieces joined are the final text.

    Structured outputs (``SamplingParams(structured=...)``, or ``generate(..., structured=...)`` /
    ``response_format=...``; needs the tokenizer): a bad spec is refused at admission; the grammar compiles in a
    worker while the request waits outside the scheduler (the other requests keep stepping); each step masks the
    constrained rows in one batched operation and the unconstrained rows are not touched.

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
        pool: PagedKVPool | None = None,
        num_blocks: int | None = None,
        memory_budget: int | float | str | None = None,
        block_size: int | None = None,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        enable_prefix_caching: bool = True,
        attention_backend: str | None = None,
        watermark: float = 0.01,
        scheduling_policy: str = "fair",
        max_logprobs: int = 20,
        compile: bool | str = "auto",
        kv_store: KVStoreSpec | None = None,
        kv_store_bytes: int | float | str | None = None,
        compile_timeout: float = 30.0,
    ) -> None:
        compiling = resolve_compile(compile, model.get_input_embeddings().weight.device)
        self._owns_pool = pool is None
        pool = _pool_for(model, pool, num_blocks, memory_budget, block_size, kv_store, kv_store_bytes)
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        self.attention_backend = attention_backend
        self.max_logprobs = integer("max_logprobs", max_logprobs, minimum=-1, error=ConfigError)
        self.scheduler = _scheduler(
            pool, max_num_batched_tokens, max_num_seqs, watermark, enable_prefix_caching, scheduling_policy
        )
        self._text_config = text_config(model)
        self._vocab_size: int | None = int(getattr(self._text_config, "vocab_size", 0) or 0) or None
        self._max_positions = context_limit(model)  # the spec decides per family (None: no fixed limit)
        self._eos = _eos_ids(model)
        self._added_vocab = _added_vocab(tokenizer)  # where a stop string that is a special token finds its id
        self._grammars: EngineGrammars | None = None  # structured outputs: built with the first constrained request
        self._compile_timeout = _seconds("compile_timeout", compile_timeout)
        self._cache = PackedCache(pool)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._decode = CompiledDecode(model, pool) if compiling else None
        self._decode_counts = CompileCounts()  # the counters of a compiled step turned off
        self._init_state(pool)
        self._original_attn = getattr(self._text_config, "_attn_implementation", None)
        self._use_paged_attention()
        self._closed = False

    def _init_state(self, pool: PagedKVPool) -> None:
        """The requests, events, locks and counters of a new Engine."""
        self._requests: dict[str, EngineRequest] = {}  # queued or running: not every sample has finished
        self._ready: list[tuple[object | None, RequestOutput]] = []  # (owner, output) finished, not yet reported
        self._events: list[tuple[object | None, TokenEvent]] = []  # (owner, event) not yet reported
        self._aborting: set[str] = set()  # aborted during a forward: their sequences are released after it
        self._in_flight = False  # a step's forward is running on the batch it took
        # The Engine's requests and the pool's blocks, in that order: the pool's lock guards its block state for every
        # holder (enable()d calls and caches on the same pool), so the Engine takes it whenever it books blocks.
        self._lock = Locks(threading.RLock(), pool.lock)
        self._stepping = threading.Lock()
        self._stepper: int | None = None  # the thread inside step()
        self._ids = itertools.count()
        self._counts = {"requests": 0, "finished": 0, "aborted": 0, "failed": 0, "generated": 0}
        self._peak_bytes = 0
        self._weights_version = 0  # the pool's weights version at the step being computed
        self._busy = 0.0
        self._phases = dict.fromkeys(_PHASES, 0.0)  # cumulative seconds per stage of the steps

    def _use_paged_attention(self) -> None:
        self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        if getattr(self._text_config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            # transformers leaves such a model as it was (with a warning): its attention would read only the step's
            # own keys from the Engine's cache, the cached ones never, and answer wrongly without an error.
            raise UnsupportedModelError(
                f"{type(self.model).__name__} does not attend through transformers' AttentionInterface, so the "
                "Engine's paged attention cannot serve it; use PagedCache or enable() with this model"
            )

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Abort what is still running, drop what is not reported yet, and give the model its attention
        implementation back (always, even if aborting fails). Waits for a step running in another thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # no new request or step from here on
        waited = self._stepper != threading.get_ident() and self._stepping.acquire()
        try:
            with self._lock:
                for request_id in list(self._requests):
                    try:
                        self.abort(request_id)
                    except Exception:
                        logger.exception("pagedcore: aborting request %r while closing the Engine failed", request_id)
                self._requests.clear()
                self._ready.clear()
                self._events.clear()
        finally:
            if waited:
                self._stepping.release()
            if self._grammars is not None:
                self._grammars.close()
            if self._original_attn is not None and self._original_attn != ATTN_IMPLEMENTATION:
                self.model.set_attn_implementation(self._original_attn)
            self._close_tiers()

    def _close_tiers(self) -> None:
        tiers = self.pool.tiers
        if tiers is None:
            return
        try:
            self.pool.save_kv_store()  # the blocks still cached, so that a restart finds them
            if self._owns_pool:
                tiers.close()
        except Exception:
            logger.exception("pagedcore: writing the cached prefixes to the KV store while closing failed")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ low-level API
    def add_request(
        self,
        prompt: Prompt,
        params: Params | None = None,
        *,
        request_id: str | None = None,
        namespace: Hashable = None,
        priority: int = 0,
        **generate_kwargs: Any,
    ) -> str:
        """Queue a request; returns its id. Raises a typed error (and queues nothing) for bad input.

        ``params`` may be a :class:`SamplingParams` or a dict of its fields; or pass ``model.generate``'s keyword
        arguments instead (see :class:`Engine`). The request is reported by :meth:`step` / :meth:`step_events`.
        ``priority`` (``scheduling_policy="priority"`` only): lower values are admitted first.
        """
        (spec,) = self._specs(params, generate_kwargs, 1)
        return self._submit(self._validate(prompt, spec, namespace, request_id, priority), owner=None).request_id

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request (all its samples) and return its output; it is also reported by the next :meth:`step`.

        Its blocks go back at once, or, when a step's forward is running in another thread, as soon as it ends
        (the token sampled for it in that step is dropped).
        """
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                raise InvalidRequestError(f"no running request {request_id!r}")
            if self._in_flight:
                self._aborting.add(request_id)
            else:
                self._release(request_id)
            for index in range(len(request.output.samples)):
                self._finish_sample(request, index, FinishReason.ABORT.value)
            return request.output

    def has_unfinished(self) -> bool:
        """Whether any request is queued or running, or finished and not yet reported by :meth:`step` (the requests
        of a ``generate``/``stream`` call that is still waiting are reported by that call, not counted here)."""
        with self._lock:
            return bool(self._requests) or any(owner is None for owner, _ in self._ready)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and forward pass. Returns the requests that finished (and are not reported by a
        ``generate``/``stream`` call)."""
        finished, _ = self._step(None)
        return finished

    def step_events(self) -> StepOutput:
        """:meth:`step`, also returning the step's token events (for callers that run their own loop and stream,
        e.g. a server: one thread steps, and hands each event to the request it belongs to). Thread-safe with
        :meth:`add_request` / :meth:`abort` from other threads, like :meth:`step`."""
        finished, events = self._step(None)
        return StepOutput(finished, events)

    # ------------------------------------------------------------------ high-level API
    def generate(
        self,
        prompts: Prompt | Iterable[Prompt],
        params: Params | Sequence[Params] | None = None,
        *,
        use_tqdm: bool = True,
        namespace: Hashable = None,
        priority: int = 0,
        **generate_kwargs: Any,
    ) -> list[RequestOutput]:
        """Generate for many prompts; returns one output per prompt, in order.

        ``params``: one :class:`SamplingParams` (or dict of its fields) for all prompts, or one per prompt; or
        ``model.generate``'s keyword arguments (see :class:`Engine`). A prompt with bad input or bad parameters
        gets an output with ``error`` set (finish reason "error"); the others finish. Arguments that are wrong
        whatever the prompt (e.g. ``num_beams=4``) raise :class:`~pagedcore.errors.InvalidRequestError`.
        """
        prompt_list = as_prompt_list(prompts)
        specs = self._specs(params, generate_kwargs, len(prompt_list))
        outputs: list[RequestOutput | None] = [None] * len(prompt_list)
        valid: list[tuple[int, EngineRequest]] = []
        for i, (prompt, spec) in enumerate(zip(prompt_list, specs)):
            try:
                valid.append((i, self._validate(prompt, spec, namespace, priority=priority)))
            except PagedCoreError as exc:
                outputs[i] = self._rejected(prompt, spec, exc)
        owner = object()
        mine: list[EngineRequest] = []
        taken: list[RequestOutput] = []
        progress = _progress(len(prompt_list), use_tqdm)
        progress.update(len(prompt_list) - len(valid))
        try:
            for i, request in valid:
                mine.append(self._submit(request, owner))
                outputs[i] = request.output
            while len(taken) < len(mine):
                finished, _ = self._step(owner)
                taken.extend(finished)
                progress.update(len(finished))
        except BaseException:  # e.g. KeyboardInterrupt: the next step() reports these requests
            self._give_up(owner, mine, taken)
            raise
        finally:
            progress.close()
        return [o for o in outputs if o is not None]

    def stream(
        self,
        prompts: Prompt | Iterable[Prompt],
        params: Params | Sequence[Params] | None = None,
        *,
        namespace: Hashable = None,
        priority: int = 0,
        **generate_kwargs: Any,
    ) -> Iterator[TokenEvent]:
        """Yield every token of every request as it is produced (a sample's last event has ``finish_reason``).

        Every prompt and parameter is checked here, before anything is queued: a bad one raises
        :class:`~pagedcore.errors.InvalidRequestError` naming it. The requests are queued when iteration starts;
        closing the iterator early aborts the unfinished ones (the next :meth:`step` reports them).
        """
        prompt_list = as_prompt_list(prompts)
        specs = self._specs(params, generate_kwargs, len(prompt_list))
        new = []
        for i, (prompt, spec) in enumerate(zip(prompt_list, specs)):
            try:
                new.append(self._validate(prompt, spec, namespace, priority=priority))
            except InvalidRequestError as exc:
                if len(prompt_list) == 1:
                    raise
                raise InvalidRequestError(f"prompt {i}: {exc}") from exc
        return self._stream(new)

    def stats(self) -> EngineStats:
        """Counters and gauges (see :class:`EngineStats`)."""
        with self._lock:
            sched = self.scheduler.stats
            memory = self.pool.memory_stats()
            counts = self._decode.counts if self._decode is not None else self._decode_counts
            return EngineStats(
                num_requests=self._counts["requests"],
                num_finished=self._counts["finished"],
                num_aborted=self._counts["aborted"],
                num_failed=self._counts["failed"],
                num_steps=sched.num_steps,
                num_preemptions=sched.num_preemptions,
                prefix_query_tokens=self.pool.num_query_tokens,
                prefix_hit_tokens=self.pool.num_hit_tokens,
                prompt_tokens_computed=sched.num_prompt_tokens_computed,
                generated_tokens=self._counts["generated"],
                kv_usage=self.pool.kv.usage,
                kv_used_bytes=memory.used_bytes,
                kv_peak_used_bytes=self._peak_bytes,
                busy_seconds=self._busy,
                kernel_failures=self._kernel_failures(),
                **self._phase_fields(),
                compiled_steps=counts.steps,
                compiled_graphs=counts.graphs,
                compiled_buckets=counts.buckets,
                compile_failures=counts.failures,
                **_store_fields(self.pool.tier_stats()),
            )

    def _phase_fields(self) -> dict[str, Any]:
        return {f"{phase}_seconds": seconds for phase, seconds in self._phases.items()}

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix of the pool now (vLLM's name; see :meth:`PagedKVPool.reset_prefix_cache`).
        Weight updates the fingerprint sees need no call: each step checks it. Running requests finish on the keys
        and values they computed; none of their blocks is cached afterwards. Returns the cached blocks forgotten.
        Thread-safe with a stepping thread.

        Example:
            >>> from pagedcore.adapters.transformers.testing import tiny_llama
            >>> with Engine(tiny_llama(), num_blocks=32, block_size=4) as engine:
            ...     _ = engine.generate([list(range(1, 11))], max_new_tokens=2, use_tqdm=False)
            ...     engine.reset_prefix_cache(), engine.pool.kv.num_cached_blocks   # 2 full blocks, 1 partly filled
            (3, 0)
        """
        with self._lock:
            return self.pool.reset_prefix_cache()

    def _kernel_failures(self) -> int:
        """The attention backend's kernel calls that fell back to the torch backend (0 if it does not count)."""
        weight = self.model.get_input_embeddings().weight
        backend = self.pool.attention_backend(weight.device, weight.dtype, self.attention_backend)
        return int(getattr(getattr(backend, "stats", None), "kernel_failures", 0))

    def stage_seconds(self) -> dict[str, float]:
        """The ``*_seconds`` stage fields of :meth:`stats` by stage name, cheap enough to read around every step."""
        with self._lock:
            return dict(self._phases)

    # ------------------------------------------------------------------ the step
    def _step(self, owner: object | None) -> tuple[list[RequestOutput], list[TokenEvent]]:
        """schedule -> forward -> sample -> record; returns the reports that belong to ``owner`` (None: the requests
        no ``generate``/``stream`` call reports)."""
        with self._stepping_now():
            batch = self._schedule()
            if batch is not None:
                samples = self._sample(batch, self._forward_batch(batch))
                self._record(batch, samples)
            elif self._grammars is not None and self._grammars.num_held:
                self._grammars.wait(0.01)  # nothing to compute but grammars compiling: wait a little, not spin
            with self._lock:
                return self._take(owner)

    @contextlib.contextmanager
    def _stepping_now(self) -> Iterator[None]:
        """One stepping thread at a time; the step's time counts as busy."""
        if not self._stepping.acquire(blocking=False):
            raise ConcurrentUseError("Engine.step is already running in another thread; run one loop per engine")
        self._stepper = threading.get_ident()
        started = time.perf_counter()
        try:
            yield
        finally:
            self._busy += time.perf_counter() - started
            self._stepper = None
            self._stepping.release()

    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self._phases[phase] += time.perf_counter() - started

    def _schedule(self) -> StepBatch | None:
        """schedule (and prepare: pack the plan into the step's batch), under the lock; None when nothing is to be
        computed. From here until the batch's forward ends, aborts leave its blocks alone."""
        with self._lock:
            self._check_open()
            with self._timed("schedule"):
                self.pool.check_weights()  # after a weight update: forget the old prefixes before admitting
                self._weights_version = self.pool.weights_version  # what this step's forward computes with
                self._admit_compiled()
                plan = self.scheduler.schedule()
            with self._timed("prepare"):
                self._peak_bytes = max(self._peak_bytes, self.pool.memory_stats().used_bytes)
                if plan.is_empty:
                    return None
                batch = pack(plan, self.pool, self._requests, self.attention_backend)
                self._in_flight = True
                return batch

    def _forward_batch(self, batch: StepBatch) -> torch.Tensor | str:
        """forward, without the lock (it reads only the batch): the logits, or why the forward failed (which fails
        the step's requests, not the engine)."""
        try:
            with self._timed("forward"):
                return self._forward(batch)
        except Exception as exc:
            logger.exception("pagedcore: the model forward failed; failing this step's requests")
            return f"{type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._in_flight = False
                for request_id in self._aborting:  # aborted during the forward: their blocks can go back now
                    self._release(request_id)
                self._aborting.clear()

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        device = self.model.get_input_embeddings().weight.device
        if self._decode is not None and DecodeInputs.is_decode(batch):
            logits = self._forward_compiled(self._decode, batch, device)
            if logits is not None:
                return logits
        self._cache.begin([meta.slot_mapping for meta in batch.context.metadata if meta is not None])
        kwargs: dict[str, Any] = {
            "input_ids": to_device(torch.tensor([batch.input_ids]), device),
            "position_ids": to_device(torch.tensor([batch.position_ids]), device),
            "cache": self._cache,
            "use_cache": True,
            CONTEXT_KEY: batch.context,
        }
        keep = batch.logit_rows + batch.prompt_rows if batch.prompt_rows else batch.logit_rows
        if self._keeps_logits:
            kwargs["logits_to_keep"] = to_device(torch.tensor(keep), device) if keep else 1
        with torch.inference_mode():
            logits = self.model(**kwargs).logits[0]
        if not self._keeps_logits and keep:
            logits = logits[to_device(torch.tensor(keep), logits.device)]
        return logits.float()  # (len(batch.rows) + len(batch.prompt_rows), vocab)

    def _forward_compiled(self, decode: CompiledDecode, batch: StepBatch, device: torch.device) -> torch.Tensor | None:
        """The decode step's logits from the compiled graph; None (and compiling off from here on) if it failed: the
        step then runs eagerly, rewriting the same slots."""
        try:
            return decode(DecodeInputs.from_batch(batch, self.pool, device)).float()
        except Exception:
            logger.exception("pagedcore: the compiled decode step failed; this Engine runs eagerly from here on")
            self._decode_counts = dataclasses.replace(decode.counts, failures=1)  # kept for stats()
            self._decode = None
            return None

    def _sample(self, batch: StepBatch, logits: torch.Tensor | str) -> StepSamples:
        """sample, without the lock: the tokens of every row (a failed forward fails every scheduled sequence)."""
        if isinstance(logits, str):
            return StepSamples(failed=dict.fromkeys((item.request_id for item in batch.plan.scheduled), logits))
        with self._timed("sample"):
            rows = len(batch.rows)
            masks = self._grammars.masks if self._grammars is not None else None
            samples = sample_rows(logits[:rows] if batch.prompt_rows else logits, batch.rows, masks)
            if batch.prompt_spans:
                self._score_prompts(batch, logits[rows:], samples)
            return samples

    def _score_prompts(self, batch: StepBatch, logits: torch.Tensor, samples: StepSamples) -> None:
        """The prompt log-probabilities of the step's prompt positions (``logits``: theirs, in span order)."""
        vocab = logits.shape[-1]
        targets = [token for span in batch.prompt_spans for token in span.targets]
        ks = [vocab if span.k == -1 else min(span.k, vocab) for span in batch.prompt_spans for _ in span.targets]
        entries = prompt_logprobs(logits, targets, ks)
        start = 0
        for span in batch.prompt_spans:
            samples.prompt_logprobs[span.request_id] = (span.first, entries[start : start + len(span.targets)])
            start += len(span.targets)

    def _record(self, batch: StepBatch, samples: StepSamples) -> None:
        """record, under the lock: the scheduler takes the tokens (stop tokens and lengths finish sequences there),
        then each sample's text takes them (stop strings finish samples here), giving events and outputs.

        Sequences aborted or failed since the step was planned are skipped: their tokens are dropped.
        """
        with self._lock, self._timed("record"):
            for seq in self.scheduler.fail(list(samples.failed)):
                request = batch.owners[seq.request_id]
                request.output.error = request.output.error or samples.failed[seq.request_id]
                indices = range(seq.num_samples) if seq.needs_fork else [seq.sample_index]
                for index in indices:
                    self._finish_sample(request, index, FinishReason.ERROR.value)
            for item in batch.plan.scheduled:  # a request's weights version: that of its first step
                output = batch.owners[item.request_id].output
                if output.weights_version is None:
                    output.weights_version = self._weights_version
            self.scheduler.update(batch.plan, samples.tokens)
            if samples.prompt_logprobs:
                self._record_prompts(samples)
            now = time.perf_counter()
            for row in batch.rows:
                tokens = samples.tokens.get(row.request_id)
                request = batch.owners[row.request_id]
                if tokens and row.sequence is not None and not request.is_done:
                    self._record_row(request, row.sequence, tokens, samples, now)

    def _record_prompts(self, samples: StepSamples) -> None:
        """Each request's new prompt log-probabilities (positions recomputed after a preemption are not added twice)."""
        for request_id, (first, entries) in samples.prompt_logprobs.items():
            request = self._requests.get(request_id)
            scored = request.output.prompt_logprobs if request is not None and not request.is_done else None
            if scored is not None and first <= len(scored) < first + len(entries):
                scored.extend(entries[len(scored) - first :])

    def _record_row(
        self, request: EngineRequest, seq: SequenceState, tokens: list[int], samples: StepSamples, now: float
    ) -> None:
        """One sampled row's tokens: one token, or one per sample at the step that forked the request."""
        metrics = request.output.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.num_cached_tokens = seq.num_cached_tokens
        metrics.num_preemptions = seq.num_preemptions
        family = [seq, *seq.forks] if len(tokens) > 1 else [seq]
        logits, logprobs = samples.logits.get(seq.request_id), samples.logprobs.get(seq.request_id)
        for k, (member, token) in enumerate(zip(family, tokens)):
            index = member.sample_index
            if not request.params.max_new_tokens:  # prompt_logprobs alone: the prompt was scored, the token is not
                self._events.append((request.owner, self._scored_event(request, index)))
                self._finish_sample(request, index, FinishReason.LENGTH.value, event=False)
                continue
            sample = request.output.samples[index]
            if logits is not None:
                if sample.logits is None:
                    sample.logits = []
                sample.logits.append(logits)
            lp = logprobs[k] if logprobs is not None else None
            if lp is not None and sample.logprobs is not None:
                sample.logprobs.append(lp)
            self._counts["generated"] += 1
            if request.grammar is not None and not request.grammar.accept(index, token):
                self._events.append((request.owner, TokenEvent(request.request_id, index, token)))
                self._fail(request, f"GrammarError: token {token} is not allowed by {request.grammar.spec.describe()}")
                return
            try:
                event = self._text_event(request, member, token, lp)
            except DecodeError as exc:
                self._events.append((request.owner, TokenEvent(request.request_id, index, token, logprobs=lp)))
                self._fail(request, str(exc))
                return
            self._events.append((request.owner, event))
            if event.finish_reason is not None:
                self._finish_sample(request, index, event.finish_reason, event.stop_reason, event=False)

    def _scored_event(self, request: EngineRequest, index: int) -> TokenEvent:
        """The one event of a sample of a ``max_new_tokens=0`` request (it only scores its prompt): its finish,
        with the prompt log-probabilities."""
        return TokenEvent(request.request_id, index, None, "", "length", prompt_logprobs=request.output.prompt_logprobs)

    def _text_event(
        self, request: EngineRequest, seq: SequenceState, token: int, logprobs: TokenLogprobs | None = None
    ) -> TokenEvent:
        """The event of one sample's new token: its text, its log-probabilities, and whether and why the sample
        finished with it (a stop string finishes the sequence here, in the step that completed it). A sample's
        first event carries the request's prompt log-probabilities (with ``prompt_logprobs``)."""
        index = seq.sample_index
        text = request.texts[index]
        text.add(token, seq.num_output_tokens)
        reason: str | None = None
        stop_reason: str | int | None = None
        if seq.finish_reason is FinishReason.STOP:  # a stop token (SequenceState.append_token)
            string = text.stop_by_id(token)
            reason, stop_reason = FinishReason.STOP.value, token if string is None else string
        elif text.stop_reason is not None:  # a stop string in the text
            self.scheduler.finish([seq.request_id], FinishReason.STOP)
            reason, stop_reason = FinishReason.STOP.value, text.stop_reason
        elif seq.finish_reason is FinishReason.LENGTH:
            reason = FinishReason.LENGTH.value
        if reason is not None:
            text.finish()
        prompt = request.output.prompt_logprobs if seq.num_output_tokens == 1 else None
        return TokenEvent(request.request_id, index, token, text.take(), reason, stop_reason, logprobs, prompt)

    # ------------------------------------------------------------------ requests: validate -> submit -> finish
    def _specs(self, params: Any, generate_kwargs: dict[str, Any], count: int) -> list[Params | _Generation]:
        """One parameter spec per prompt; raises for what is wrong whatever the prompt."""
        if generate_kwargs and params is not None:
            raise InvalidRequestError(
                "pass either params= (SamplingParams, or a dict of its fields) or model.generate's keyword "
                f"arguments, not both: got params= and {', '.join(sorted(generate_kwargs))}"
            )
        if params is None:
            structured = _structured_kwarg(generate_kwargs)
            config, extras = merge_generation_config(getattr(self.model, "generation_config", None), generate_kwargs)
            return [_Generation(config, extras, structured)] * count
        if isinstance(params, (SamplingParams, dict)):
            return [params] * count
        if isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
            raise InvalidRequestError(f"params must be SamplingParams, a dict or a list of them, got {params!r}")
        items = list(params)
        if len(items) != count:
            raise InvalidRequestError(f"{len(items)} SamplingParams for {count} prompts")
        return items

    def _validate(
        self,
        prompt: Any,
        spec: Params | _Generation,
        namespace: Hashable,
        request_id: str | None = None,
        priority: int = 0,
    ) -> EngineRequest:
        """Everything about one request that can be refused, checked before anything is queued."""
        token_ids = self._encode(prompt)
        params = self._params(spec, len(token_ids))
        if self._max_positions and len(token_ids) + params.max_new_tokens > self._max_positions:
            raise InvalidRequestError(
                f"{len(token_ids)} prompt tokens + {params.max_new_tokens} new tokens exceed the model's context "
                f"of {self._max_positions} positions"
            )
        if request_id is not None and (not isinstance(request_id, str) or not request_id or "#" in request_id):
            raise InvalidRequestError(f"request ids must be non-empty strings without '#', got {request_id!r}")
        stop = () if params.ignore_eos else (params.stop_token_ids if params.stop_token_ids is not None else self._eos)
        stop_ids = valid_token_ids(stop, vocab_size=self._vocab_size, name="stop_token_ids", allow_empty=True)
        self._check_model_fields(params)
        stops = stop_strings(params.stop_strings, params.include_stop_str_in_output, self.tokenizer, self._added_vocab)
        grammar = None
        if params.structured is not None and params.max_new_tokens:
            grammar = self._grammar(StructuredOutput.from_value(params.structured), params.n)
            stop_ids = [*stop_ids, *grammar.stop_token_ids]  # a finished grammar's end stops the sequence
        rid = request_id if request_id is not None else self._fresh_id()
        seq = None
        scoring = params.prompt_logprobs is not None
        if params.max_new_tokens or scoring:  # max_new_tokens=0 with prompt_logprobs: the prompt runs, one draw dropped
            seq = SequenceState(
                rid,
                token_ids,
                params.max_new_tokens or 1,
                frozenset(stop_ids) | stops.by_id.keys(),  # stop strings that are special tokens stop by id
                namespace,
                params.n,
                params.min_new_tokens,
                priority,
                read_prefix_cache=not scoring,  # every prompt position's logits are needed
            )
            self.scheduler.check_admissible(seq)  # also checks the namespace
        samples = [SampleOutput(k, logprobs=None if params.logprobs is None else []) for k in range(params.n)]
        output = RequestOutput(rid, token_ids, samples, RequestMetrics(time.perf_counter()))
        output.prompt_logprobs = [None] if scoring else None
        texts = [self._sample_text(stops, params.min_new_tokens) for _ in range(params.n)]
        device = self.model.get_input_embeddings().weight.device  # draws happen where the logits are
        return EngineRequest(rid, params, seq, output, texts, params.generators(device), grammar=grammar)

    def _grammar(self, spec: StructuredOutput, num_samples: int) -> RequestGrammar:
        """Start compiling a request's grammar (bad specs raise here, at admission); the compiler is built with the
        first structured request."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                f"structured outputs ({spec.kind}) need the tokenizer: Engine(model, tokenizer=...)"
            )
        with self._lock:
            if self._grammars is None:
                fallback = getattr(self.tokenizer, "eos_token_id", None)
                eos = self._eos or ([] if fallback is None else [int(fallback)])
                self._grammars = EngineGrammars(
                    self.tokenizer,
                    vocab_size=self._vocab_size,
                    stop_token_ids=eos,
                    compile_timeout=self._compile_timeout,
                )
            grammars = self._grammars
        return grammars.request(spec, num_samples)

    def _admit_compiled(self) -> None:
        """Schedule the held requests whose grammar is built; fail those whose grammar failed or timed out."""
        if self._grammars is None or not self._grammars.num_held:
            return
        for request, error in self._grammars.take_ready():
            if request.is_done:  # aborted while its grammar compiled
                continue
            if error is None:
                try:
                    self.scheduler.add(request.sequence)
                except PagedCoreError as exc:  # e.g. the pool was rebuilt smaller while the grammar compiled
                    self._fail(request, f"{type(exc).__name__}: {exc}")
            else:
                self._fail(request, f"GrammarError: {error}")

    def _check_model_fields(self, params: SamplingParams) -> None:
        """What :class:`SamplingParams` cannot check alone: token ids in this model's vocabulary, ``logprobs`` and
        ``prompt_logprobs`` within ``max_logprobs``."""
        vocab = self._vocab_size
        if params.logit_bias:
            valid_token_ids([t for t, _ in params.bias_items], vocab_size=vocab, name="logit_bias token ids")
        if params.allowed_token_ids:
            valid_token_ids(params.allowed_token_ids, vocab_size=vocab, name="allowed_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is None or self.max_logprobs == -1:
                continue
            if (k == -1 and (vocab is None or vocab > self.max_logprobs)) or k > self.max_logprobs:
                raise InvalidRequestError(
                    f"{name}={k} is more than this Engine allows: at most max_logprobs={self.max_logprobs} "
                    "(Engine(max_logprobs=...); -1 asks for the whole vocabulary)"
                )

    def _sample_text(self, stops: StopStrings, min_new_tokens: int) -> SampleText:
        detokenizer = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        return SampleText(detokenizer, stops, min_new_tokens)

    def _submit(self, request: EngineRequest, owner: object | None) -> EngineRequest:
        with self._lock:
            self._check_open()
            rid = request.request_id
            if rid in self._requests:
                raise InvalidRequestError(f"request id {rid!r} is already in use")
            request.owner = owner
            request.output.metrics.arrival_time = time.perf_counter()
            if request.sequence is not None:
                if request.grammar is not None and self._grammars is not None:
                    self._grammars.hold(request.grammar, request)  # scheduled once its grammar is built
                else:
                    self.scheduler.add(request.sequence)
                self._requests[rid] = request
            self._counts["requests"] += 1
            if request.sequence is None:  # max_new_tokens=0: done at once
                for index in range(request.params.n):
                    self._finish_sample(request, index, FinishReason.LENGTH.value)
            return request

    def _finish_sample(
        self,
        request: EngineRequest,
        index: int,
        reason: str,
        stop_reason: str | int | None = None,
        *,
        event: bool = True,
    ) -> None:
        """Finish one sample: its tokens and final text go into its output; the request is reported once its last
        sample finishes. Without ``event``, the caller has emitted the sample's last event.

        A tokenizer that fails here fails the request (unless it was being aborted or failed already)."""
        sample = request.output.samples[index]
        if sample.finish_reason is not None:
            return
        escalate = piece = None
        text = request.texts[index]
        try:
            text.finish()
            piece = text.take()
            sample.text = text.text
        except DecodeError as exc:
            sample.text = None
            if reason not in _ENDED:  # a sample that was ending anyway keeps its reason
                reason = FinishReason.ERROR.value
                escalate = str(exc)
                request.output.error = request.output.error or escalate
        seq = request.sample_sequence(index)
        sample.token_ids = seq.output_token_ids if seq is not None and request.params.max_new_tokens else []
        sample.finish_reason, sample.stop_reason = reason, stop_reason
        if event:
            self._events.append((request.owner, TokenEvent(request.request_id, index, None, piece, reason)))
        request.done += 1
        if request.is_done:
            request.output.metrics.finish_time = time.perf_counter()
            self._requests.pop(request.request_id, None)
            self._ready.append((request.owner, request.output))
            outcome = "failed" if request.output.error else "aborted" if reason == FinishReason.ABORT.value else ""
            self._counts[outcome or "finished"] += 1
        elif escalate is not None:
            self._fail(request, escalate)

    def _fail(self, request: EngineRequest, message: str) -> None:
        """Fail every unfinished sample of a request (e.g. its tokenizer raised); its blocks go back."""
        if request.is_done:
            return
        if request.output.error is None:
            request.output.error = message
        self.scheduler.fail([seq.request_id for seq in request.sequences()])
        for index in range(len(request.output.samples)):
            self._finish_sample(request, index, FinishReason.ERROR.value)

    def _release(self, request_id: str) -> None:
        """Give an aborted request's sequences and blocks back to the scheduler."""
        try:
            self.scheduler.abort(request_id)
        except RequestNotFoundError:
            pass  # every sample had already finished in the scheduler

    def _take(self, owner: object | None) -> tuple[list[RequestOutput], list[TokenEvent]]:
        """Remove and return the finished outputs and events that ``owner`` reports (under the lock)."""
        finished = [out for who, out in self._ready if who is owner]
        events = [event for who, event in self._events if who is owner]
        self._ready = [(who, out) for who, out in self._ready if who is not owner]
        self._events = [(who, event) for who, event in self._events if who is not owner]
        return finished, events

    def _give_up(self, owner: object, mine: list[EngineRequest], unreported: Iterable[RequestOutput]) -> None:
        """A generate/stream call stops early: its requests are aborted and reported by the next ``step()``."""
        with self._lock:
            if self._closed:
                return
            for request in mine:
                request.owner = None
            self._ready = [(None if who is owner else who, out) for who, out in self._ready]
            self._ready.extend((None, out) for out in unreported)
            self._events = [(who, event) for who, event in self._events if who is not owner]
            for request in mine:
                if not request.is_done:
                    self.abort(request.request_id)

    def _stream(self, new: list[EngineRequest]) -> Iterator[TokenEvent]:
        owner: object = object()
        mine: list[EngineRequest] = []
        unreported: dict[str, RequestOutput] = {}  # finished, but their last events are not yielded yet
        finals: dict[str, int] = {}
        try:
            for request in new:
                mine.append(self._submit(request, owner))
            while True:
                done = all(request.is_done for request in mine)
                if done:  # e.g. a generate() call ran them to the end: only their reports are left
                    with self._lock:
                        finished, events = self._take(owner)
                else:
                    finished, events = self._step(owner)
                unreported.update((out.request_id, out) for out in finished)
                for event in events:
                    if event.finish_reason is not None:
                        finals[event.request_id] = finals.get(event.request_id, 0) + 1
                        if finals[event.request_id] == len(unreported.get(event.request_id, _NO_OUTPUT).samples):
                            unreported.pop(event.request_id)  # its consumer receives its last event now
                    yield event
                if done:
                    return
        finally:
            self._give_up(owner, mine, unreported.values())

    # ------------------------------------------------------------------ helpers
    def _params(self, spec: Params | _Generation, prompt_length: int) -> SamplingParams:
        if isinstance(spec, _Generation):
            params = to_sampling_params(
                spec.config, prompt_length=prompt_length, max_positions=self._max_positions, **spec.extras
            )
            return params if spec.structured is None else replace(params, structured=spec.structured)
        if isinstance(spec, SamplingParams):
            return spec
        if isinstance(spec, dict):
            return SamplingParams.from_fields(spec)  # this class's names or vLLM's (max_tokens, min_tokens, stop)
        raise InvalidRequestError(f"params must be SamplingParams or a dict, got {type(spec).__name__}")

    def _encode(self, prompt: Any) -> list[int]:
        if not isinstance(prompt, str):
            return token_id_list(prompt, vocab_size=self._vocab_size)
        if self.tokenizer is None:
            raise InvalidRequestError("a string prompt needs a tokenizer: Engine(model, tokenizer=...)")
        try:
            encoded = self.tokenizer(prompt)["input_ids"]
        except Exception as exc:  # the tokenizer is user code: its failure is this request's error
            raise InvalidRequestError(
                f"the tokenizer failed on the prompt {prompt[:40]!r}: {type(exc).__name__}: {exc}"
            ) from exc
        return token_id_list(encoded, vocab_size=self._vocab_size)

    def _fresh_id(self) -> str:
        while True:
            rid = f"req-{next(self._ids)}"
            if rid not in self._requests and rid not in self._aborting:
                return rid

    def _rejected(self, prompt: Any, spec: Params | _Generation, exc: Exception) -> RequestOutput:
        """The output of a request refused by ``generate`` (counted as a failed request)."""
        n = 1
        if isinstance(spec, SamplingParams):
            n = spec.n
        elif isinstance(spec, dict) and isinstance(spec.get("n"), int) and spec["n"] >= 1:
            n = spec["n"]
        elif isinstance(spec, _Generation):
            n = spec.config.num_return_sequences or 1
        samples = [SampleOutput(k, finish_reason=FinishReason.ERROR.value) for k in range(n)]
        tokens = prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt if isinstance(prompt, list) else []
        now = time.perf_counter()
        with self._lock:
            self._counts["requests"] += 1
            self._counts["failed"] += 1
            rid = f"rejected-{next(self._ids)}"
        return RequestOutput(
            rid,
            [n for n in map(as_integer, tokens) if n is not None],
            samples,
            RequestMetrics(now, None, now),
            error=f"{type(exc).__name__}: {exc}",
        )

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this Engine was closed")


_NO_OUTPUT = RequestOutput("", [], [], RequestMetrics(0.0))


def _seconds(name: str, value: object) -> float:
    """A positive number of seconds, or :class:`~pagedcore.errors.ConfigError` naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name} must be > 0 seconds, got {value!r}")
    return float(value)


def _structured_kwarg(kwargs: dict[str, Any]) -> StructuredOutput | None:
    """Take ``structured=`` (a :class:`StructuredOutput` or a dict of one) or OpenAI's ``response_format=`` out of
    ``generate``'s keyword arguments, as a spec (checked here: a bad one raises whatever the prompt)."""
    structured, response_format = kwargs.pop("structured", None), kwargs.pop("response_format", None)
    if structured is not None and response_format is not None:
        raise InvalidRequestError("pass structured= or response_format=, not both")
    value = structured if structured is not None else response_format
    return None if value is None else SamplingParams(structured=value).structured  # type: ignore[return-value]


def _added_vocab(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's added tokens (special ones included) by text; empty for tokenizers without them."""
    try:
        return dict(tokenizer.get_added_vocab()) if tokenizer is not None else {}
    except Exception:  # not a transformers tokenizer: stop strings match in the text only
        return {}


def _store_fields(tiers: TierStats | None) -> dict[str, Any]:
    """The :class:`EngineStats` fields of the tiers below the pool (none without them)."""
    if tiers is None:
        return {}
    return {
        "kv_store_loaded_blocks": tiers.blocks_loaded,
        "kv_store_loaded_tokens": tiers.tokens_loaded,
        "kv_store_written_blocks": tiers.blocks_written,
        "kv_store_load_seconds": tiers.load_seconds,
        "kv_store_write_seconds": tiers.write_seconds,
        "kv_store_writes_skipped": tiers.writes_skipped,
        "kv_store_write_failures": tiers.write_failures,
        "kv_store_refused": {
            "checksum": tiers.refused_checksum,
            "fingerprint": tiers.refused_fingerprint,
            "foreign": tiers.refused_foreign,
        },
        "kv_store_hits": {name: s["hits"] for name, s in tiers.stores.items()},
        "kv_store_bytes": {name: s["bytes"] for name, s in tiers.stores.items()},
    }


def _scheduler(
    pool: PagedKVPool, tokens: int, seqs: int, watermark: float, prefix_caching: bool, policy: str
) -> Scheduler:
    """The Engine's scheduler over ``pool``'s blocks (its limits checked by :class:`SchedulerConfig`)."""
    config = SchedulerConfig(
        max_num_batched_tokens=tokens,
        max_num_seqs=seqs,
        watermark=watermark,
        enable_prefix_caching=prefix_caching,
        policy=policy,
    )
    return Scheduler(pool.kv, config, plugins=pool.plugins)


def _pool_for(
    model: Any,
    pool: PagedKVPool | None,
    num_blocks: int | None,
    memory_budget: Any,
    block_size: int | None,
    kv_store: KVStoreSpec | None,
    kv_store_bytes: int | float | str | None,
) -> PagedKVPool:
    """A new pool of ``num_blocks`` / ``memory_budget`` (and its tiers below) for ``model``, or ``pool`` bound to it
    (not both)."""
    if pool is None:
        return PagedKVPool(
            model,
            num_blocks=num_blocks,
            memory_budget=memory_budget,
            block_size=block_size,
            kv_store=kv_store,
            kv_store_bytes=kv_store_bytes,
        )
    if num_blocks is not None or memory_budget is not None:
        raise ConfigError("num_blocks / memory_budget size a new pool: not with pool=")
    if kv_store is not None or kv_store_bytes is not None:
        raise ConfigError("kv_store / kv_store_bytes belong to a new pool: give them to PagedKVPool")
    pool.bind(model)
    return pool


def _eos_ids(model: Any) -> list[int]:
    """The stop tokens ``model.generate`` would use: the generation config's eos (the model config's if none)."""
    config = getattr(model, "generation_config", None)
    eos = config.eos_token_id if config is not None else getattr(text_config(model), "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


class _NoProgress:
    def update(self, n: int = 1) -> None:
        """Nothing to show."""

    def close(self) -> None:
        """Nothing to close."""


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoProgress()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="pagedcore", unit="req", dynamic_ncols=True)
