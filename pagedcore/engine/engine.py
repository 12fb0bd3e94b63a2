"""Engine: continuous batching over a model, driven by pagedcore's scheduler and prefix trie through a model runner.

Each :meth:`Engine.step` runs five stages: **schedule** (the :class:`~pagedcore.scheduler.Scheduler` says what to
compute: decodes first, then chunks of prefills, within the token budget), **prepare** (:func:`.batch.plan_step`
picks the rows to sample and the prompt positions to score; the runner's ``prepare`` packs every scheduled token of
every sequence into its forward's inputs), **forward** (the runner runs the model once: its attention reads each
sequence's keys and values from the pool through its block table), **sample** (:func:`.sampling.sample_rows` draws
the next token of every sequence that completed its known tokens) and **record** (the tokens go back to the
scheduler, which stops a sequence at a stop token or its length, and through each sample's
:class:`~.stopping.SampleText`, which decodes them incrementally and stops a sample at a stop string in the same
step; they become token events and, when a sample finishes, its output). New requests join between steps; finished
ones release their blocks and leave their full blocks in the prefix cache for later requests.

The model is the runner's (:class:`~.runner.ModelRunner`); the Engine knows only that protocol.

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
import itertools
import logging
import threading
import time
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from pagedcore.errors import ConcurrentUseError, ConfigError, InvalidRequestError, PagedCoreError, RequestNotFoundError
from pagedcore.scheduler import Scheduler
from pagedcore.sequence import FinishReason, SequenceState

from .admission import Admission, GenerateArguments, Params, Spec
from .batch import StepBatch, plan_step
from .config import EngineConfig
from .context import ContextWindow
from .detokenizer import DecodeError
from .inputs import as_prompt_list
from .locks import Locks
from .logprobs import prompt_logprobs
from .lora import AdapterRequests, AdapterSet, loras_per_prompt
from .outputs import EngineStats, RequestMetrics, RequestOutput, StepOutput, TokenEvent, TokenLogprobs, token_event
from .progress import progress_bar
from .request import Request, RequestState
from .runner import ArgmaxTokens, ModelRunner
from .sampling import StepSamples, argmax_samples, sample_rows
from .stats import EngineCounters, engine_stats
from .structured.spec import StructuredOutput

logger = logging.getLogger(__name__)

__all__ = ["Engine"]

Prompt = str | Sequence[int] | torch.Tensor
_Self = TypeVar("_Self", bound="Engine")
_ENDED = (FinishReason.ABORT.value, FinishReason.ERROR.value)


class Engine:
    """Continuous batching of many requests over one model, through its runner.

    Args:
        runner: the model's runner (:class:`~.runner.ModelRunner`): it owns the model, the pool and the forward.
        tokenizer: optional; lets prompts be strings and outputs carry text.
        config: the Engine's settings (:class:`~.config.EngineConfig`: the scheduler's limits and policy,
            ``max_logprobs``, ``max_model_len``, ``compile_timeout``); or give them as keyword arguments
            (``max_num_seqs=8``, ``scheduling_policy="fcfs"``, ...), not both. The pool's settings, ``compile`` and
            ``attention_backend`` belong to the runner, which was built with them.
        arguments: a front end's own parameter words (:class:`~.admission.GenerateArguments`; the transformers
            adapter's: ``model.generate``'s keyword arguments); without them, parameters are a
            :class:`~.sampling.SamplingParams` or a dict of its fields.

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
        >>> from pagedcore.adapters.torch_reference import TorchLlama, TorchRunner
        >>> from pagedcore.engine import SamplingParams
        >>> model = TorchLlama.tiny()
        >>> with Engine(TorchRunner(model, num_blocks=64, block_size=8)) as engine:
        ...     outs = engine.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=4), use_tqdm=False)
        >>> [len(o.token_ids) for o in outs]
        [4, 4]
    """

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any = None,
        *,
        config: EngineConfig | None = None,
        arguments: GenerateArguments | None = None,
        **settings: Any,
    ) -> None:
        config = EngineConfig.of(config, **settings)
        runners = {"pool": not config.pool.is_default, "compile": config.compile != "auto"}
        runners["attention_backend"] = config.attention_backend is not None
        runners["lora"] = config.lora is not None
        if any(runners.values()):  # the runner was built with its own: these would be ignored here
            given = ", ".join(name for name, set_ in runners.items() if set_)
            raise ConfigError(
                f"{given}: the runner's settings (it builds the pool and runs the model), not the Engine's"
            )
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.scheduler = Scheduler(runner.kv, config.scheduler, plugins=runner.plugins)
        self.context = ContextWindow.served(runner.info.max_positions, config.max_model_len, runner.info.limit_note)
        self._admission = Admission(
            runner.info,
            tokenizer,
            self.scheduler,
            self.context,
            max_logprobs=config.max_logprobs,
            compile_timeout=config.compile_timeout,
            arguments=arguments,
        )
        self._adapters = AdapterRequests(getattr(runner, "adapters", None))  # requests naming a LoRA adapter
        self._init_state()
        self._closed = False

    def _init_state(self) -> None:
        """The requests, events, locks and counters of a new Engine."""
        self._requests: dict[str, RequestState] = {}  # queued or running: not every sample has finished
        self._ready: list[tuple[object | None, RequestOutput]] = []  # (owner, output) finished, not yet reported
        self._events: list[tuple[object | None, TokenEvent]] = []  # (owner, event) not yet reported
        self._aborting: set[str] = set()  # aborted during a forward: their sequences are released after it
        self._in_flight = False  # a step's forward is running on the batch it took
        # The Engine's requests and the pool's blocks, in that order: the pool's lock guards its block state for every
        # holder (enable()d calls and caches on the same pool), so the Engine takes it whenever it books blocks.
        self._lock = Locks(threading.RLock(), self.runner.lock, events=self.runner.plugins)  # observers: after it
        self._stepping = threading.Lock()
        self._stepper: int | None = None  # the thread inside step()
        self._ids = itertools.count()
        self._counters = EngineCounters()
        self._weights_version = 0  # the runner's weights version at the step being computed
        self._dropping: object = _KEEP  # the owner whose token events this step's caller drops (_step)

    @property
    def max_logprobs(self) -> int:
        """The most log-probabilities a request may ask for (-1: no limit)."""
        return self.config.max_logprobs

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Abort what is still running, drop what is not reported yet, and close the runner (it gives the model
        back as it was and writes the cached prefixes to the tiers below the pool; always, even if aborting
        fails). Waits for a step running in another thread."""
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
            grammars = self._admission.grammars
            if grammars is not None:
                grammars.close()
            try:
                self.runner.close()
            except Exception:
                logger.exception("pagedcore: closing the Engine's model runner failed")

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ low-level API
    def add_request(
        self,
        prompt: Prompt | Request,
        params: Params | None = None,
        *,
        request_id: str | None = None,
        namespace: Hashable = None,
        priority: int = 0,
        lora: str | None = None,
        **generate_kwargs: Any,
    ) -> str:
        """Queue a request; returns its id. Raises a typed error (and queues nothing) for bad input.

        ``prompt`` may be a :class:`~.request.Request` (then nothing else is given), or a prompt with ``params``: a
        :class:`SamplingParams` or a dict of its fields; or pass the front end's keyword arguments instead (see
        :class:`Engine`). The request is reported by :meth:`step` / :meth:`step_events`.
        ``priority`` (``scheduling_policy="priority"`` only): lower values are admitted first. ``lora``: the name of a
        loaded LoRA adapter to serve it with (:attr:`loras`).
        """
        if isinstance(prompt, Request):
            given = (params, request_id, namespace, lora)
            if generate_kwargs or priority or any(value is not None for value in given):
                raise InvalidRequestError("a Request carries its own parameters, id, namespace, priority and lora")
            return self._submit(self._validate(prompt), owner=None).request_id
        (spec,) = self._admission.specs(params, generate_kwargs, 1)
        request = Request(prompt, request_id=request_id, namespace=namespace, priority=priority, lora=lora)
        return self._submit(self._validate(request, spec), owner=None).request_id

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
        """One scheduling step and forward pass: the finished requests no ``generate``/``stream`` call reports."""
        finished, _ = self._step(None, events=False)
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
        lora: str | Sequence[str | None] | None = None,
        **generate_kwargs: Any,
    ) -> list[RequestOutput]:
        """Generate for many prompts; returns one output per prompt, in order.

        ``params``: one :class:`SamplingParams` (or dict of its fields) for all prompts, or one per prompt; or
        ``model.generate``'s keyword arguments (see :class:`Engine`). A prompt with bad input or bad parameters
        gets an output with ``error`` set (finish reason "error"); the others finish. Arguments that are wrong
        whatever the prompt (e.g. ``num_beams=4``) raise :class:`~pagedcore.errors.InvalidRequestError`. ``lora``:
        a loaded adapter's name for every prompt, or one name (or None: the base model) per prompt.
        """
        prompt_list = as_prompt_list(prompts)
        specs = self._admission.specs(params, generate_kwargs, len(prompt_list))
        loras = loras_per_prompt(lora, len(prompt_list))
        outputs: list[RequestOutput | None] = [None] * len(prompt_list)
        valid: list[tuple[int, RequestState]] = []
        for i, (prompt, spec) in enumerate(zip(prompt_list, specs)):
            try:
                asked = Request(prompt, namespace=namespace, priority=priority, lora=loras[i])
                valid.append((i, self._validate(asked, spec)))
            except PagedCoreError as exc:
                outputs[i] = self._rejected(prompt, spec, exc)
        owner = object()
        mine: list[RequestState] = []
        taken: list[RequestOutput] = []
        progress = progress_bar(len(prompt_list), use_tqdm)
        progress.update(len(prompt_list) - len(valid))
        try:
            for i, request in valid:
                mine.append(self._submit(request, owner))
                outputs[i] = request.output
            while len(taken) < len(mine):
                finished, _ = self._step(owner, events=False)
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
        lora: str | Sequence[str | None] | None = None,
        **generate_kwargs: Any,
    ) -> Iterator[TokenEvent]:
        """Yield every token of every request as it is produced (a sample's last event has ``finish_reason``).

        Every prompt and parameter is checked here, before anything is queued: a bad one raises
        :class:`~pagedcore.errors.InvalidRequestError` naming it. The requests are queued when iteration starts;
        closing the iterator early aborts the unfinished ones (the next :meth:`step` reports them).
        """
        prompt_list = as_prompt_list(prompts)
        specs = self._admission.specs(params, generate_kwargs, len(prompt_list))
        loras = loras_per_prompt(lora, len(prompt_list))
        new = []
        for i, (prompt, spec) in enumerate(zip(prompt_list, specs)):
            try:
                new.append(self._validate(Request(prompt, namespace=namespace, priority=priority, lora=loras[i]), spec))
            except InvalidRequestError as exc:
                if len(prompt_list) == 1:
                    raise
                raise InvalidRequestError(f"prompt {i}: {exc}") from exc
        return self._stream(new)

    def stats(self) -> EngineStats:
        """Counters and gauges (see :class:`EngineStats`)."""
        with self._lock:
            return engine_stats(self._counters, self.scheduler.stats, self.runner.kv, self.runner.stats())

    @property
    def loras(self) -> AdapterSet:
        """The runner's LoRA adapters: ``load(name, path)``, ``unload(name)``, ``adapters()`` (thread-safe; raises
        :class:`~pagedcore.errors.AdapterError` when the Engine was built without ``enable_lora``)."""
        return self._adapters.require()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """What stops a request whose ``stop_token_ids`` are None (unless ``ignore_eos``): the runner's
        (:attr:`ModelInfo.eos_token_ids <pagedcore.engine.runner.ModelInfo.eos_token_ids>`; a transformers model's
        generation config's and its tokenizer's eos, as vLLM stops)."""
        return tuple(self.runner.info.eos_token_ids)

    def prepare_structured(self, spec: StructuredOutput) -> StructuredOutput:
        """Parse and compile a structured-output spec now, in the calling thread (a server's worker, never the step
        loop): a bad spec, one past the grammar engine's limits or one that does not compile within
        ``compile_timeout`` raises :class:`~pagedcore.errors.GrammarError` here. The spec returned carries its
        grammar: a request with it is neither parsed nor held for compilation."""
        return self._admission.grammar_engine(spec).prepare(spec)

    def max_new_tokens(self, prompt_tokens: int) -> int | None:
        """The most new tokens a request with a prompt of ``prompt_tokens`` tokens can be given: the least of what the
        context leaves (:class:`~.context.ContextWindow`) and what the pool can ever hold for one sequence
        (:meth:`Scheduler.max_new_tokens <pagedcore.scheduler.Scheduler.max_new_tokens>`, exact); 0: not even one,
        None: no bound. A query, safe from any thread (tests/test_capacity.py has examples)."""
        rooms = (self.context.room(prompt_tokens), self.scheduler.max_new_tokens(prompt_tokens))
        return min((room for room in rooms if room is not None), default=None)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix of the pool now (vLLM's name; the runner's ``reset_prefix_cache``).
        Weight updates the fingerprint sees need no call: each step checks it. Running requests finish on the keys
        and values they computed; none of their blocks is cached afterwards. Returns the cached blocks forgotten.
        Thread-safe with a stepping thread.

        Example:
            >>> from pagedcore.adapters.torch_reference import TorchLlama, TorchRunner
            >>> with Engine(TorchRunner(TorchLlama.tiny(), num_blocks=32, block_size=4)) as engine:
            ...     _ = engine.generate([list(range(1, 11))], {"max_new_tokens": 2}, use_tqdm=False)
            ...     engine.reset_prefix_cache(), engine.runner.kv.num_cached_blocks   # 2 full blocks, 1 partly filled
            (3, 0)
        """
        with self._lock:
            return self.runner.reset_prefix_cache()

    def stage_seconds(self) -> dict[str, float]:
        """The ``*_seconds`` stage fields of :meth:`stats` by stage name, cheap enough to read around every step."""
        with self._lock:
            return dict(self._counters.phases)

    # ------------------------------------------------------------------ the step
    def _step(self, owner: object | None, *, events: bool = True) -> tuple[list[RequestOutput], list[TokenEvent]]:
        """schedule -> forward -> sample -> record; returns the reports that belong to ``owner`` (None: the requests
        no ``generate``/``stream`` call reports). Without ``events`` the caller drops its token events: their common
        one (a token of a running sample) is not made for its requests (their text is taken all the same)."""
        with self._stepping_now():
            self._dropping = _KEEP if events else owner
            batch = self._schedule()
            if batch is not None:
                samples = self._sample(batch, self._forward(batch))
                self._record(batch, samples)
            elif (grammars := self._admission.grammars) is not None and grammars.num_held:
                grammars.wait(0.01)  # nothing to compute but grammars compiling: wait a little, not spin
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
            self._counters.busy += time.perf_counter() - started
            self._stepper = None
            self._stepping.release()

    def _schedule(self) -> StepBatch | None:
        """schedule (and prepare: plan the step's rows, the runner packs its inputs), under the lock; None when
        nothing is to be computed. From here until the batch's forward ends, aborts leave its blocks alone."""
        timed = self._counters.timed
        with self._lock:
            self._check_open()
            with timed("schedule"):
                self.runner.check_weights(admitting=self._may_admit())  # forget old prefixes before admitting
                self._weights_version = self.runner.weights_version  # what this step's forward computes with
                self._admit_compiled()
                self._adapters.admit(self.scheduler, self._fail)  # whose adapter can enter the model now
                plan = self.scheduler.schedule()
                for request_id, why in plan.failed.items():  # the pool's eviction policy (a plugin's) failed
                    self._fail(self._requests[request_id], why)
            with timed("prepare"):
                self._counters.peak_bytes = max(self._counters.peak_bytes, self.runner.used_bytes())
                if plan.is_empty:
                    return None
                batch = plan_step(plan, self._requests)
                batch.prepared = self.runner.prepare(batch.forward)
                self._in_flight = True
                return batch

    def _may_admit(self) -> bool:
        """Whether this step may admit a request (one waits in the scheduler, for its grammar or for its adapter):
        then the weights check compares the model's settings too, before the prefix lookup."""
        grammars = self._admission.grammars
        return bool(self.scheduler.num_waiting or self._adapters.num_held or (grammars and grammars.num_held))

    def _forward(self, batch: StepBatch) -> torch.Tensor | ArgmaxTokens | str:
        """forward, without the lock (it reads only the batch): the logits (or an argmax-only batch's tokens), or why
        the forward failed (which fails the step's requests, not the engine)."""
        try:
            with self._counters.timed("forward"):
                return self.runner.execute(batch.prepared)
        except Exception as exc:
            logger.exception("pagedcore: the model forward failed; failing this step's requests")
            return f"{type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._in_flight = False
                for request_id in self._aborting:  # aborted during the forward: their blocks can go back now
                    self._release(request_id)
                self._aborting.clear()

    def _sample(self, batch: StepBatch, logits: torch.Tensor | ArgmaxTokens | str) -> StepSamples:
        """sample, without the lock: the tokens of every row (a failed forward fails every scheduled sequence)."""
        if isinstance(logits, str):
            return StepSamples(failed=dict.fromkeys((item.request_id for item in batch.plan.scheduled), logits))
        with self._counters.timed("sample"):
            if isinstance(logits, ArgmaxTokens):  # the runner took the argmax-only rows' tokens (runner.py)
                return argmax_samples(batch.rows, logits.tokens)
            rows = len(batch.rows)
            grammars = self._admission.grammars
            masks = grammars.masks if grammars is not None else None
            samples = sample_rows(logits[:rows] if batch.prompt_spans else logits, batch.rows, masks)
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
        with self._lock, self._counters.timed("record"):
            for lost in self.scheduler.fail(list(samples.failed)) if samples.failed else ():
                request = batch.owners[lost.request_id]
                if request.output.error is None:
                    request.output.error = samples.failed[lost.request_id]
                    request.output.client_error = lost.request_id in samples.client_errors
                indices = range(lost.num_samples) if lost.needs_fork else [lost.sample_index]
                for index in indices:
                    self._finish_sample(request, index, FinishReason.ERROR.value)
            for request in batch.owners.values():  # a request's weights version: that of its first step
                if request.output.weights_version is None:
                    request.output.weights_version = self._weights_version
            self.scheduler.update(batch.plan, samples.tokens)
            if samples.prompt_logprobs:
                self._record_prompts(samples)
            now = time.perf_counter()
            plain = not samples.logits and not samples.logprobs  # no row of this step returns either
            for row in batch.rows:
                tokens, seq = samples.tokens.get(row.request_id), row.sequence
                request = batch.owners[row.request_id]
                if not tokens or seq is None or request.is_done:
                    continue
                metrics = request.output.metrics
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                metrics.num_cached_tokens, metrics.num_preemptions = seq.num_cached_tokens, seq.num_preemptions
                if plain and len(tokens) == 1 and request.grammar is None and request.params.max_new_tokens:
                    self._counters.generated += 1  # the common row (hundreds per step): one token, nothing to keep
                    self._emit(request, seq, tokens[0])
                else:
                    self._record_row(request, seq, tokens, samples)

    def _record_prompts(self, samples: StepSamples) -> None:
        """Each request's new prompt log-probabilities (positions recomputed after a preemption are not added twice)."""
        for request_id, (first, entries) in samples.prompt_logprobs.items():
            request = self._requests.get(request_id)
            scored = request.output.prompt_logprobs if request is not None and not request.is_done else None
            if scored is not None and first <= len(scored) < first + len(entries):
                scored.extend(entries[len(scored) - first :])

    def _record_row(self, request: RequestState, seq: SequenceState, tokens: list[int], samples: StepSamples) -> None:
        """One sampled row's tokens: one token, or one per sample at the step that forked the request."""
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
            self._counters.generated += 1
            if request.grammar is not None and not request.grammar.accept(index, token):
                self._events.append((request.owner, TokenEvent(request.request_id, index, token)))
                why = request.grammar.error(index) or f"token {token} is not allowed"
                self._fail(request, f"GrammarError: {request.grammar.spec.describe()}: {why}", client_error=True)
                return
            if not self._emit(request, member, token, lp):
                return

    def _emit(self, request: RequestState, seq: SequenceState, token: int, lp: TokenLogprobs | None = None) -> bool:
        """The event of one sample's new token (not made where its caller drops it: ``_step``), and the sample's
        finish when the token ended it; False when the tokenizer failed (which fails the request)."""
        try:
            piece, reason, stop_reason = self._advance_text(request, seq, token)
        except DecodeError as exc:
            self._events.append((request.owner, TokenEvent(request.request_id, seq.sample_index, token, logprobs=lp)))
            self._fail(request, str(exc))
            return False
        if request.owner is not self._dropping:
            prompt = request.output.prompt_logprobs if seq.num_output_tokens == 1 else None
            event = token_event(request.request_id, seq.sample_index, token, piece, reason, stop_reason, lp, prompt)
            self._events.append((request.owner, event))
        if reason is not None:
            self._finish_sample(request, seq.sample_index, reason, stop_reason, event=False)
        return True

    def _scored_event(self, request: RequestState, index: int) -> TokenEvent:
        """The one event of a sample of a ``max_new_tokens=0`` request (it only scores its prompt): its finish,
        with the prompt log-probabilities."""
        return TokenEvent(request.request_id, index, None, "", "length", prompt_logprobs=request.output.prompt_logprobs)

    def _advance_text(
        self, request: RequestState, seq: SequenceState, token: int
    ) -> tuple[str | None, str | None, str | int | None]:
        """One sample's new token into its text: the text that became final, and whether and why the sample
        finished with it (a stop string finishes the sequence here). Its event (``_emit``) carries them, the token's
        log-probabilities and, the first, the prompt's."""
        text = request.texts[seq.sample_index]
        stop_token = seq.finish_reason is FinishReason.STOP  # a stop token (SequenceState.append_token)
        if not stop_token or text.keeps_stop:  # vLLM's: a stop token's text only if asked
            text.add(token, seq.num_output_tokens)
        reason: str | None = None
        stop_reason: str | int | None = None
        if stop_token:
            string = text.stop_by_id(token)
            reason, stop_reason = FinishReason.STOP.value, token if string is None else string
        elif text.stop_reason is not None:  # a stop string in the text
            self.scheduler.finish([seq.request_id], FinishReason.STOP)
            reason, stop_reason = FinishReason.STOP.value, text.stop_reason
        elif seq.finish_reason is FinishReason.LENGTH:
            reason = FinishReason.LENGTH.value
        if reason is not None:
            text.finish()
        return text.take(), reason, stop_reason

    # ------------------------------------------------------------------ requests: validate -> submit -> finish
    def _validate(self, request: Request, spec: Spec | None = None) -> RequestState:
        """Everything about one request that can be refused, checked before anything is queued."""
        return self._admission.validate(self._adapters.narrow(request), spec, fresh_id=self._fresh_id)

    def _admit_compiled(self) -> None:
        """Schedule the held requests whose grammar is built; fail those whose grammar failed or timed out."""
        grammars = self._admission.grammars
        if grammars is None or not grammars.num_held:
            return
        for request, error in grammars.take_ready():
            if request.is_done:  # aborted while its grammar compiled
                continue
            if error is None:
                try:
                    self._adapters.enqueue(request, self.scheduler)
                except PagedCoreError as exc:  # e.g. the pool was rebuilt smaller while the grammar compiled
                    self._fail(request, f"{type(exc).__name__}: {exc}")
            else:
                self._fail(request, f"GrammarError: {error}", client_error=True)

    def _submit(self, request: RequestState, owner: object | None) -> RequestState:
        with self._lock:
            self._check_open()
            rid = request.request_id
            if rid in self._requests:
                raise InvalidRequestError(f"request id {rid!r} is already in use", param="request_id")
            request.owner = owner
            request.output.metrics.arrival_time = time.perf_counter()
            if request.sequence is not None:
                grammars = self._admission.grammars
                if request.grammar is not None and grammars is not None:
                    grammars.hold(request.grammar, request)  # scheduled once its grammar is built
                else:
                    self._adapters.enqueue(request, self.scheduler)
                self._requests[rid] = request
            self._counters.requests += 1
            if request.sequence is None:  # max_new_tokens=0: done at once
                for index in range(request.params.n):
                    self._finish_sample(request, index, FinishReason.LENGTH.value)
            return request

    def _finish_sample(
        self,
        request: RequestState,
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
            self._adapters.finish(request)
            self._requests.pop(request.request_id, None)
            self._ready.append((request.owner, request.output))
            outcome = "failed" if request.output.error else "aborted" if reason == FinishReason.ABORT.value else ""
            self._counters.count(outcome or "finished")
        elif escalate is not None:
            self._fail(request, escalate)

    def _fail(self, request: RequestState, message: str, *, client_error: bool = False) -> None:
        """Fail a request's unfinished samples; its blocks go back. ``client_error``: its own fault (its grammar)."""
        if request.is_done:
            return
        if request.output.error is None:
            request.output.error = message
            request.output.client_error = client_error
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

    def _give_up(self, owner: object, mine: list[RequestState], unreported: Iterable[RequestOutput]) -> None:
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

    def _stream(self, new: list[RequestState]) -> Iterator[TokenEvent]:
        owner: object = object()
        mine: list[RequestState] = []
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
    def _fresh_id(self) -> str:
        while True:
            rid = f"req-{next(self._ids)}"
            if rid not in self._requests and rid not in self._aborting:
                return rid

    def _rejected(self, prompt: Any, spec: Spec, exc: PagedCoreError) -> RequestOutput:
        """The output of a request refused by ``generate`` (counted as a failed request)."""
        with self._lock:
            self._counters.requests += 1
            self._counters.count("failed")
            rid = f"rejected-{next(self._ids)}"
        return self._admission.rejected(prompt, spec, exc, rid)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this Engine was closed")


_KEEP = object()  # no owner: every event is made
_NO_OUTPUT = RequestOutput("", [], [], RequestMetrics(0.0))
