"""Engine: continuous batching over a transformers model, driven by pagedcore's scheduler and prefix trie.

Each :meth:`Engine.step` asks the :class:`~pagedcore.scheduler.Scheduler` what to compute (decodes first, then
chunks of prefills, within the token budget), packs every scheduled token of every sequence into one
``(1, num_tokens)`` batch without padding, runs the model once with ``attn_implementation="paged"`` (the attention
reads each sequence's keys and values from the pool through its block table, via the backend the plugin hook
picks), samples the next token of every sequence that completed its known tokens, and hands the tokens back to
the scheduler. New requests join between steps; finished ones release their blocks and leave their full blocks
in the prefix cache for later requests.

Thread safety: ``add_request`` / ``abort`` / ``stats`` may be called from any thread while another thread runs
``step``; they serialize on one lock that ``step`` holds only while it plans and records (not during the forward).
Only one thread may run ``step`` at a time.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
import time
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer

from pagedcore.attention import PagedAttentionMetadata, write_kv
from pagedcore.errors import ConcurrentUseError, ConfigError, InvalidRequestError, PagedCoreError
from pagedcore.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedcore.sequence import FinishReason
from pagedcore.sequence import Sequence as CoreSequence

from .attention import ATTN_IMPLEMENTATION, CONTEXT_KEY, ForwardContext
from .outputs import EngineStats, RequestMetrics, RequestOutput, SampleOutput, StepOutput, TokenEvent
from .pool import PagedKVPool
from .sampling import SamplingParams, sample_tokens
from .spec import text_config

logger = logging.getLogger(__name__)

__all__ = ["Engine"]

Prompt = str | Sequence[int]


class _PackedLayer(CacheLayerMixin):
    """Layer view for transformers' mask code; the engine's attention does not use masks."""

    is_compileable = False

    def __init__(self, sliding_window: int | None) -> None:
        super().__init__()
        self.is_sliding = sliding_window is not None
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("updated through the engine's cache")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class _PackedCache(Cache):
    """The cache a packed engine forward writes through: every new token's keys/values go to its slot."""

    def __init__(self, pool: PagedKVPool) -> None:
        layers: list[Any] = [
            _PackedLayer(spec.sliding_window) if spec.has_cache else DummyLayer() for spec in pool.spec.layers
        ]
        super().__init__(layers=layers)
        self._pool = pool
        self._slots: list[torch.Tensor] = []
        self._on: dict[tuple[int, torch.device], torch.Tensor] = {}

    def begin(self, slots: list[torch.Tensor]) -> None:
        self._slots = slots
        self._on = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        group = self._pool.group_of(layer_idx)
        keys = key_states[0].transpose(0, 1)  # (tokens, kv_heads, head_dim)
        values = value_states[0].transpose(0, 1)
        key_cache, value_cache = self._pool.layer_kv(layer_idx, keys, values)
        slots = self._on.get((group, keys.device))
        if slots is None:
            slots = self._on[(group, keys.device)] = self._slots[group].to(keys.device)
        write_kv(key_cache, value_cache, keys, values, slots)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generators: list[torch.Generator]
    output: RequestOutput
    texts: list[str] = field(default_factory=list)
    done: int = 0


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

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from pagedcore.adapters.transformers import Engine, SamplingParams
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        ...     num_hidden_layers=2, intermediate_size=128, vocab_size=100)).eval()
        >>> with Engine(model, num_blocks=64, block_size=8) as engine:
        ...     outs = engine.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=4), use_tqdm=False)
        >>> [len(o.token_ids) for o in outs]
        [4, 4]
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
    ) -> None:
        if pool is None:
            pool = PagedKVPool(model, num_blocks=num_blocks, memory_budget=memory_budget, block_size=block_size)
        else:
            if num_blocks is not None or memory_budget is not None:
                raise ConfigError("num_blocks / memory_budget size a new pool: not with pool=")
            pool.bind(model)
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        self.attention_backend = attention_backend
        config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            watermark=watermark,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.scheduler = Scheduler(pool.kv, config, plugins=pool.plugins)
        self._text_config = text_config(model)
        self._vocab_size = int(getattr(self._text_config, "vocab_size", 0) or 0)
        self._max_positions = getattr(self._text_config, "max_position_embeddings", None)
        self._eos = _eos_ids(model)
        self._cache = _PackedCache(pool)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._requests: dict[str, _Request] = {}
        self._ready: list[RequestOutput] = []
        self._events: list[TokenEvent] = []
        self._lock = threading.RLock()
        self._stepping = threading.Lock()
        self._ids = itertools.count()
        self._counts = {"requests": 0, "finished": 0, "aborted": 0, "failed": 0, "generated": 0}
        self._peak_bytes = 0
        self._busy = 0.0
        self._original_attn = getattr(self._text_config, "_attn_implementation", None)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Abort what is still running and give the model its attention implementation back."""
        if self._closed:
            return
        with self._lock:
            for request_id in list(self._requests):
                self.abort(request_id)
        if self._original_attn is not None and self._original_attn != ATTN_IMPLEMENTATION:
            self.model.set_attn_implementation(self._original_attn)
        self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ low-level API
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | dict[str, Any] | None = None,
        *,
        request_id: str | None = None,
        namespace: Hashable = None,
    ) -> str:
        """Queue a request; returns its id. Raises a typed error (and queues nothing) for bad input.

        ``params`` may be a :class:`SamplingParams` or a dict of its fields (validated here).
        """
        self._check_open()
        params = _params(params)
        token_ids = self._encode(prompt)
        if self._max_positions and len(token_ids) + params.max_new_tokens > self._max_positions:
            raise InvalidRequestError(
                f"{len(token_ids)} prompt tokens + {params.max_new_tokens} new tokens exceed the model's context "
                f"of {self._max_positions} positions"
            )
        stop = () if params.ignore_eos else (params.stop_token_ids if params.stop_token_ids is not None else self._eos)
        with self._lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._requests:
                raise InvalidRequestError(f"request id {rid!r} is already in use")
            if not isinstance(rid, str) or not rid or "#" in rid:
                raise InvalidRequestError(f"request ids must be non-empty strings without '#', got {rid!r}")
            output = RequestOutput(
                rid, token_ids, [SampleOutput(k) for k in range(params.n)], RequestMetrics(time.perf_counter())
            )
            request = _Request(rid, token_ids, params, params.generators(), output, [""] * params.n)
            if params.max_new_tokens == 0:
                for sample in output.samples:
                    sample.finish_reason = FinishReason.LENGTH.value
                    sample.text = "" if self.tokenizer is not None else None
                output.metrics.finish_time = output.metrics.arrival_time
                self._ready.append(output)
                self._counts["requests"] += 1
                self._counts["finished"] += 1
                return rid
            seq = CoreSequence(
                rid,
                token_ids,
                params.max_new_tokens,
                frozenset(int(t) for t in stop),
                namespace,
                params.n,
                params.min_new_tokens,
            )
            self.scheduler.add(seq)  # raises when it can never fit
            self._requests[rid] = request
            self._counts["requests"] += 1
        return rid

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request (all its samples); its blocks go back at once. The output is also reported by the next
        :meth:`step`."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                raise InvalidRequestError(f"no running request {request_id!r}")
            for seq in self.scheduler.abort(request_id):
                for index in _sample_indices(seq):
                    self._finish_sample(request, index, FinishReason.ABORT.value)
            self._counts["aborted"] += 1
            return request.output

    def has_unfinished(self) -> bool:
        """Whether any request is queued, running or finished but not yet reported."""
        with self._lock:
            return bool(self._requests or self._ready)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and forward pass. Returns the requests that finished in it."""
        finished, _ = self._step()
        return finished

    def step_events(self) -> StepOutput:
        """:meth:`step`, also returning every token event of the step (for callers that run their own loop and
        stream, e.g. a server: one thread steps, and hands each event to the request it belongs to)."""
        finished, events = self._step()
        return StepOutput(finished, events)

    # ------------------------------------------------------------------ high-level API
    def generate(
        self,
        prompts: Prompt | Iterable[Prompt],
        params: SamplingParams | dict[str, Any] | Sequence[SamplingParams | dict[str, Any]] | None = None,
        *,
        use_tqdm: bool = True,
        namespace: Hashable = None,
    ) -> list[RequestOutput]:
        """Generate for many prompts; returns one output per prompt, in order.

        ``params``: one :class:`SamplingParams` (or dict of its fields) for all prompts, or one per prompt. A
        prompt with bad input or bad parameters gets an output with ``error`` set (finish reason "error"); the
        others finish.
        """
        prompt_list = _as_prompt_list(prompts)
        param_list = _as_params(params, len(prompt_list))
        outputs: list[RequestOutput | None] = [None] * len(prompt_list)
        pending: dict[str, int] = {}
        for i, (prompt, sp) in enumerate(zip(prompt_list, param_list)):
            try:
                pending[self.add_request(prompt, sp, namespace=namespace)] = i
            except PagedCoreError as exc:
                outputs[i] = self._error_output(prompt, sp, exc)
        progress = _progress(len(prompt_list), use_tqdm)
        progress.update(len(prompt_list) - len(pending))
        others: list[RequestOutput] = []  # requests added by someone else: reported by the next step()
        try:
            while pending:
                for out in self.step():
                    index = pending.pop(out.request_id, None)
                    if index is None:
                        others.append(out)
                    else:
                        outputs[index] = out
                        progress.update(1)
        finally:
            progress.close()
            with self._lock:
                self._ready[:0] = others
            for request_id in pending:  # interrupted (e.g. KeyboardInterrupt): give the blocks back
                try:
                    self.abort(request_id)
                except PagedCoreError:
                    pass
        return [o for o in outputs if o is not None]

    def stream(
        self,
        prompts: Prompt | Iterable[Prompt],
        params: SamplingParams | dict[str, Any] | Sequence[SamplingParams | dict[str, Any]] | None = None,
        *,
        namespace: Hashable = None,
    ) -> Iterator[TokenEvent]:
        """Yield every token of every request as it is produced (a sample's last event has ``finish_reason``)."""
        prompt_list = _as_prompt_list(prompts)
        param_list = _as_params(params, len(prompt_list))
        ids = {self.add_request(p, sp, namespace=namespace) for p, sp in zip(prompt_list, param_list)}
        others: list[RequestOutput] = []  # requests added by someone else: reported by the next step()
        try:
            while ids:
                finished, events = self._step()
                for event in events:
                    if event.request_id in ids:
                        yield event
                for out in finished:
                    if out.request_id in ids:
                        ids.discard(out.request_id)
                    else:
                        others.append(out)
        finally:
            with self._lock:
                self._ready[:0] = others
            for request_id in ids:
                try:
                    self.abort(request_id)
                except PagedCoreError:
                    pass

    def stats(self) -> EngineStats:
        """Counters and gauges (see :class:`EngineStats`)."""
        with self._lock:
            sched = self.scheduler.stats
            memory = self.pool.memory_stats()
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
            )

    # ------------------------------------------------------------------ internals
    def _step(self) -> tuple[list[RequestOutput], list[TokenEvent]]:
        if not self._stepping.acquire(blocking=False):
            raise ConcurrentUseError("Engine.step is already running in another thread; run one loop per engine")
        started = time.perf_counter()
        try:
            with self._lock:
                self._check_open()
                plan = self.scheduler.schedule()
                batch = self._prepare(plan) if not plan.is_empty else None
                self._peak_bytes = max(self._peak_bytes, self.pool.memory_stats().used_bytes)
            sampled: dict[str, list[int]] = {}
            failed: dict[str, str] = {}
            kept: dict[str, torch.Tensor] = {}
            if batch is not None:
                try:
                    logits = self._forward(batch)
                except Exception as exc:  # a failing forward fails its step's requests, not the engine
                    logger.exception("pagedcore: the model forward failed; failing this step's requests")
                    failed = {item.request_id: f"{type(exc).__name__}: {exc}" for item in plan.scheduled}
                else:
                    sampled, failed, kept = self._sample(plan, logits)
            with self._lock:
                self._record(plan, sampled, failed, kept)
                finished, self._ready = self._ready, []
                events, self._events = self._events, []
            return finished, events
        finally:
            self._busy += time.perf_counter() - started
            self._stepping.release()

    def _prepare(self, plan: SchedulerOutput) -> dict[str, Any]:
        """Pack the step's tokens and build each KV group's metadata (under the lock: reads live tables)."""
        self.pool.copy_blocks(plan.copies)
        groups = self.pool.kv.groups
        tokens: list[int] = []
        positions: list[int] = []
        tables: list[list[list[int]]] = [[] for _ in groups]
        offsets: list[list[int]] = [[] for _ in groups]
        slots: list[list[list[int]]] = [[] for _ in groups]
        keep: list[int] = []
        for item in plan.scheduled:
            tokens.extend(item.token_ids)
            positions.extend(range(item.start, item.end))
            if item.sample:
                keep.append(len(tokens) - 1)
            item_tables, item_offsets, item_slots = item.block_tables, item.block_offsets, item.slots
            for g in range(len(groups)):
                tables[g].append(item_tables[g])
                offsets[g].append(item_offsets[g])
                slots[g].append(item_slots[g])
        query_lens = [item.num_new_tokens for item in plan.scheduled]
        seq_lens = [item.end for item in plan.scheduled]
        metas: list[PagedAttentionMetadata | None] = [
            PagedAttentionMetadata.build(
                block_size=self.pool.block_size,
                query_lens=query_lens,
                seq_lens=seq_lens,
                block_offsets=offsets[g.index],
                tables=tables[g.index],
                slots=slots[g.index],
                sliding_window=g.sliding_window,
                pad_block=self.pool.pad_block,
            )
            for g in groups
        ]
        return {
            "tokens": tokens,
            "positions": positions,
            "keep": keep,
            "context": ForwardContext(self.pool, metas, None, self.attention_backend),
        }

    def _forward(self, batch: dict[str, Any]) -> torch.Tensor:
        device = self.model.get_input_embeddings().weight.device
        context: ForwardContext = batch["context"]
        self._cache.begin([meta.slot_mapping for meta in context.metadata if meta is not None])
        kwargs: dict[str, Any] = {
            "input_ids": torch.tensor([batch["tokens"]], device=device),
            "position_ids": torch.tensor([batch["positions"]], device=device),
            "cache": self._cache,
            "use_cache": True,
            CONTEXT_KEY: context,
        }
        keep = batch["keep"]
        if self._keeps_logits:
            kwargs["logits_to_keep"] = torch.tensor(keep, device=device) if keep else 1
        with torch.inference_mode():
            logits = self.model(**kwargs).logits[0]
        if not self._keeps_logits and keep:
            logits = logits[torch.tensor(keep, device=logits.device)]
        return logits.float()

    def _sample(
        self, plan: SchedulerOutput, logits: torch.Tensor
    ) -> tuple[dict[str, list[int]], dict[str, str], dict[str, torch.Tensor]]:
        sampled: dict[str, list[int]] = {}
        failed: dict[str, str] = {}
        kept: dict[str, torch.Tensor] = {}
        # One batched argmax and finiteness check for the whole step instead of one small op per sequence.
        greedy = logits.argmax(dim=-1).tolist() if len(logits) else []
        finite = torch.isfinite(logits).any(dim=-1).tolist() if len(logits) else []
        row = 0
        for item in plan.scheduled:
            if not item.sample:
                continue
            request = self._requests[item.sequence.group_id]
            index = item.sequence.sample_index
            if request.params.is_greedy and finite[row]:
                sampled[item.request_id] = [greedy[row]] * item.num_samples
            else:
                generators = (
                    request.generators[: item.num_samples] if item.num_samples > 1 else [request.generators[index]]
                )
                try:
                    sampled[item.request_id] = sample_tokens(logits[row], request.params, generators)
                except Exception as exc:
                    failed[item.request_id] = f"{type(exc).__name__}: {exc}"
            if request.params.return_logits:
                kept[item.request_id] = logits[row].detach().cpu().clone()
            row += 1
        return sampled, failed, kept

    def _record(
        self,
        plan: SchedulerOutput,
        sampled: dict[str, list[int]],
        failed: dict[str, str],
        kept: dict[str, torch.Tensor],
    ) -> None:
        """Hand the step's results to the scheduler and turn them into outputs and events (under the lock)."""
        for seq in self.scheduler.fail(list(failed)):
            request = self._requests.get(seq.group_id)
            if request is not None:
                request.output.error = failed[seq.request_id]
                self._counts["failed"] += int(request.done == 0)
                for index in _sample_indices(seq):
                    self._finish_sample(request, index, FinishReason.ERROR.value)
        live = [item for item in plan.scheduled if item.request_id not in failed]
        finished = self.scheduler.update(SchedulerOutput(live, plan.copies, plan.preempted), sampled)
        reasons = {seq.request_id: seq.finish_reason for seq in finished}
        now = time.perf_counter()
        for item in live:
            tokens = sampled.get(item.request_id)
            if not tokens:
                continue
            seq = item.sequence
            request = self._requests.get(seq.group_id)
            if request is None:
                continue
            if request.output.metrics.first_token_time is None:
                request.output.metrics.first_token_time = now
            request.output.metrics.num_cached_tokens = seq.num_cached_tokens
            indices = range(len(tokens)) if item.num_samples > 1 else [seq.sample_index]
            for index, token in zip(indices, tokens):
                sample = request.output.samples[index]
                sample.token_ids.append(token)
                if item.request_id in kept:
                    if sample.logits is None:
                        sample.logits = []
                    sample.logits.append(kept[item.request_id])
                self._counts["generated"] += 1
                member = seq.request_id if index == seq.sample_index else f"{seq.request_id}#{index}"
                reason = reasons.get(member)
                self._events.append(
                    TokenEvent(
                        request.request_id,
                        index,
                        token,
                        self._text_delta(request, index),
                        reason.value if reason is not None else None,
                    )
                )
                if reason is not None:
                    self._finish_sample(request, index, reason.value, event=False)

    def _finish_sample(self, request: _Request, index: int, reason: str, *, event: bool = True) -> None:
        sample = request.output.samples[index]
        if sample.finish_reason is not None:
            return
        sample.finish_reason = reason
        if self.tokenizer is not None:
            sample.text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        if event:
            self._events.append(TokenEvent(request.request_id, index, None, None, reason))
        request.done += 1
        if request.done == len(request.output.samples):
            request.output.metrics.finish_time = time.perf_counter()
            self._requests.pop(request.request_id, None)
            self._ready.append(request.output)
            if reason not in (FinishReason.ABORT.value, FinishReason.ERROR.value):
                self._counts["finished"] += 1

    def _text_delta(self, request: _Request, index: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode(request.output.samples[index].token_ids, skip_special_tokens=True)
        delta = text[len(request.texts[index]) :]
        request.texts[index] = text
        return delta

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("a string prompt needs a tokenizer: Engine(model, tokenizer=...)")
            token_ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, torch.Tensor):
            token_ids = [int(t) for t in prompt.flatten().tolist()]
        else:
            try:
                token_ids = [int(t) if not isinstance(t, bool) else -1 for t in prompt]
            except (TypeError, ValueError) as exc:
                raise InvalidRequestError(f"a prompt must be a string or a list of token ids: {exc}") from exc
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        if self._vocab_size:
            bad = [t for t in token_ids if not 0 <= t < self._vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"token ids {bad[:5]} are outside the model's vocabulary [0, {self._vocab_size})"
                )
        return token_ids

    def _error_output(self, prompt: Prompt, params: Any, exc: Exception) -> RequestOutput:
        n = params.n if isinstance(params, SamplingParams) else 1
        if isinstance(params, dict) and isinstance(params.get("n"), int) and params["n"] >= 1:
            n = params["n"]
        samples = [SampleOutput(k, finish_reason=FinishReason.ERROR.value) for k in range(n)]
        token_ids = list(prompt) if not isinstance(prompt, str) else []
        now = time.perf_counter()
        self._counts["requests"] += 1
        self._counts["failed"] += 1
        return RequestOutput(
            f"rejected-{next(self._ids)}",
            [t for t in token_ids if isinstance(t, int)],
            samples,
            RequestMetrics(now, None, now),
            error=f"{type(exc).__name__}: {exc}",
        )

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this Engine was closed")


def _sample_indices(seq: CoreSequence) -> range | list[int]:
    """The samples a sequence stands for: all of them before it forked into its parallel samples."""
    return range(seq.num_samples) if seq.needs_fork else [seq.sample_index]


def _eos_ids(model: Any) -> list[int]:
    """The stop tokens ``model.generate`` would use: the generation config's eos (the model config's if none)."""
    config = getattr(model, "generation_config", None)
    eos = config.eos_token_id if config is not None else getattr(text_config(model), "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _as_prompt_list(prompts: Prompt | Iterable[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]  # one prompt given as a list of token ids
    return items


def _as_params(params: Any, count: int) -> list[Any]:
    if params is None or isinstance(params, (SamplingParams, dict)):
        return [params] * count
    items = list(params)
    if len(items) != count:
        raise InvalidRequestError(f"{len(items)} SamplingParams for {count} prompts")
    return items


def _params(params: SamplingParams | dict[str, Any] | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        try:
            return SamplingParams(**params)
        except TypeError as exc:  # unknown field
            raise InvalidRequestError(f"bad sampling parameters: {exc}") from exc
    raise InvalidRequestError(f"params must be SamplingParams or a dict, got {type(params).__name__}")


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
