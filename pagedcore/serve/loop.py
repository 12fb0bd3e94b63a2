"""EngineLoop: the one thread that owns an :class:`~pagedcore.engine.Engine`.

Every engine mutation happens on this thread: requests and aborts from other threads are queued as commands and
applied between steps, then :meth:`Engine.step_events` runs and each token event goes to its request's *sink* (a
callable given with the request, called on the loop thread: an HTTP server hands it to its event loop with
``call_soon_threadsafe``; a Ray replica could put it on any queue). Nothing here knows about HTTP, so the loop can
be wrapped by other front ends.

Each request ends with exactly one :class:`Finished` event, whatever happens: finished, rejected by the engine,
aborted, failed in a step, or cut short by :meth:`EngineLoop.stop`. Stopping and text are the engine's (stop
strings travel in the request's :class:`~pagedcore.engine.SamplingParams`): each :class:`Delta` is the text an engine
token event made final, and :class:`Finished` reads the engine's output. Requests are the engine's own
:class:`~pagedcore.engine.Request` (a front end converts what it received once, at its edge).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from pagedcore.engine.request import Request
from pagedcore.errors import ConfigError, PagedCoreError
from pagedcore.hookspecs import hookimpl
from pagedcore.validation import integer

if TYPE_CHECKING:
    from pagedcore.engine import Engine, EngineStats, RequestOutput, TokenEvent
    from pagedcore.engine.outputs import TokenLogprobs
    from pagedcore.engine.structured import StructuredOutput

logger = logging.getLogger(__name__)

_REQUEST_IDS = itertools.count()  # one sequence for the process: every loop's ids are distinct (see _Admissions)

__all__ = [
    "Delta",
    "EngineLoop",
    "Finished",
    "LoopClosedError",
    "LoopEvent",
    "LoopStats",
    "QueueFullError",
    "Request",
    "RequestLoop",
    "RequestTimings",
    "Started",
    "Submission",
]


class QueueFullError(PagedCoreError):
    """More requests wait than the loop's ``max_queue`` allows; nothing was queued."""


class LoopClosedError(PagedCoreError):
    """The loop was stopped: it takes no new requests."""


Submission = Request
"""The old name of a loop's request: the engine's :class:`~pagedcore.engine.Request` (one request type from the edge
of a front end to the engine's report)."""


@dataclass(frozen=True)
class Started:
    """The engine accepted the request (sent before any :class:`Delta`).

    Example:
        >>> Started("r0").request_id
        'r0'
    """

    request_id: str


@dataclass(frozen=True)
class Delta:
    """One token of one sample (or the end of a sample without a token): the text it made final (``""`` while a
    character or a possible stop string is incomplete), its id, and ``finish_reason`` ("stop" or "length") on the
    sample's last delta; with ``logprobs``, the token's log-probabilities; with ``prompt_logprobs``, a sample's first
    delta carries the prompt's; ``stop_reason``: on a last delta with ``finish_reason="stop"``, the stop string or
    stop token id that ended it.

    Example:
        >>> Delta("r0", 0, "Hi", "stop", (42,)).finish_reason
        'stop'
    """

    request_id: str
    sample: int
    text: str
    finish_reason: str | None = None
    token_ids: tuple[int, ...] = ()
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    stop_reason: str | int | None = None


@dataclass(frozen=True)
class RequestTimings:
    """When one request's phases happened, in seconds (vLLM's request metrics; None: the phase never came).

    Attributes:
        queued: from arrival in the engine to its first admission (the scheduler's WAITING phase).
        first_token: from arrival to the first token (time to first token).
        prefill: from the first admission to the first token.
        decode: from the first token to the end.
        total: from arrival to the end.
        inter_token: the seconds between consecutive tokens of each sample.

    Example:
        >>> RequestTimings(0.1, 0.3, 0.2, 1.0, 1.3, (0.5, 0.5)).inter_token
        (0.5, 0.5)
    """

    queued: float | None
    first_token: float | None
    prefill: float | None
    decode: float | None
    total: float | None
    inter_token: tuple[float, ...] = ()


@dataclass(frozen=True)
class Finished:
    """The last event of every request.

    Attributes:
        request_id: the request.
        prompt_tokens: prompt length in tokens (0 when the engine rejected it).
        completion_tokens: tokens generated per sample (up to and including a stop).
        finish_reasons: per sample: "stop", "length", or None when the request failed or was aborted.
        error: why the request did not finish, else None.
        error_kind: "invalid" (the engine rejected it: bad input), "failed" (a step or the model failed),
            "aborted" (:meth:`EngineLoop.abort`), "shutdown" (:meth:`EngineLoop.stop`) or "overloaded" (a
            remote loop's queue was full); None on success.
        cached_tokens: prompt tokens served from the prefix cache (at the request's last admission).
        timings: when its phases happened (None for a request the engine never took).
        error_param: with ``error_kind="invalid"``, the field the engine's error concerns (its
            :attr:`~pagedcore.errors.PagedCoreError.param`, in the engine's names), or None.

    Example:
        >>> Finished("r0", 3, (2,), ("length",)).error is None
        True
    """

    request_id: str
    prompt_tokens: int
    completion_tokens: tuple[int, ...]
    finish_reasons: tuple[str | None, ...]
    error: str | None = None
    error_kind: str | None = None
    cached_tokens: int = 0
    timings: RequestTimings | None = None
    error_param: str | None = None


LoopEvent = Started | Delta | Finished
Sink = Callable[[LoopEvent], None]


@dataclass(frozen=True)
class LoopStats:
    """A snapshot the loop publishes after each step (safe to read from any thread).

    Attributes:
        engine: the engine's counters (:class:`~pagedcore.engine.EngineStats`).
        num_waiting: requests not yet running (queued in the loop or waiting in the scheduler).
        num_running: sequences running in the scheduler.
        num_used_blocks / num_blocks: KV blocks held by sequences / in the pool (summed over KV groups).
        num_prompt_tokens: prompt tokens of the requests that ended so far.
        num_failed_steps: steps that raised (their requests failed; the loop kept serving).

    Example:
        >>> from pagedcore.adapters.transformers import EngineStats
        >>> stats = LoopStats(EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0, 0, 0.0), 0, 0, 0, 64, 0, 0)
        >>> stats.num_blocks
        64
    """

    engine: EngineStats
    num_waiting: int
    num_running: int
    num_used_blocks: int
    num_blocks: int
    num_prompt_tokens: int
    num_failed_steps: int


class RequestLoop(Protocol):
    """What the HTTP app (:func:`~pagedcore.serve.app.create_app`, :class:`~pagedcore.serve.jobs.Job`, the
    metrics) needs from a loop: :class:`EngineLoop` in one process, or ``pagedcore.serve.ray``'s ``ReplicaLoop``
    over engine replicas in a Ray cluster. ``submit`` and ``abort`` follow :class:`EngineLoop`'s contract;
    ``prepare_structured`` checks a structured-output spec in the caller's thread as far as the loop can (the
    engine's compiler here; a parse in the Ray ingress, which has no vocabulary).

    Example:
        >>> sorted(name for name in vars(RequestLoop) if not name.startswith("_"))
        ['abort', 'add_step_listener', 'is_running', 'max_new_tokens', 'prepare_structured', 'stats', 'submit']
    """

    @property
    def stats(self) -> LoopStats: ...

    @property
    def is_running(self) -> bool: ...

    def submit(self, requests: Sequence[Request], sink: Sink) -> list[str]: ...

    def abort(self, request_id: str) -> None: ...

    def add_step_listener(self, listener: Callable[[float], None]) -> None: ...

    def max_new_tokens(self, prompt_tokens: int) -> int | None:
        """The most new tokens a request with a prompt of this length can be given (None: the loop cannot say)."""
        ...

    def prepare_structured(self, spec: StructuredOutput) -> StructuredOutput: ...


@dataclass(frozen=True)
class _Abort:
    request_id: str


_Add = tuple[Request, Sink]  # a request (with the id the loop gave it) and where its events go


class _Admissions:
    """An observer plugin: when each of the loop's requests was first admitted by the scheduler (the end of its
    queue time). Plugin managers may be shared by several pools, so it keeps only the ids its loop runs."""

    def __init__(self, live: dict[str, Sink]) -> None:
        self._live = live
        self.times: dict[str, float] = {}

    @hookimpl
    def pagedcore_request_admitted(self, request_id: str) -> None:
        rid = request_id.split("#", 1)[0]  # a parallel sample's sequence id is "rid#k"
        if rid in self._live and rid not in self.times:
            self.times[rid] = time.perf_counter()


class _Tokens:
    """When each sample's last token came, and the gaps between its tokens (the loop thread's view)."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, int], float] = {}
        self._gaps: dict[str, list[float]] = {}

    def add(self, request_id: str, sample: int, now: float) -> None:
        key = (request_id, sample)
        last = self._last.get(key)
        if last is not None:
            self._gaps.setdefault(request_id, []).append(now - last)
        self._last[key] = now

    def pop(self, request_id: str, num_samples: int) -> tuple[float, ...]:
        for sample in range(num_samples):
            self._last.pop((request_id, sample), None)
        return tuple(self._gaps.pop(request_id, ()))


class EngineLoop:
    """Runs an Engine's step loop on a background thread and routes its events to per-request sinks.

    Args:
        engine: the engine; from :meth:`start` on, only the loop thread touches it.
        max_queue: requests that may wait (queued here or in the scheduler) before :meth:`submit` raises
            :class:`QueueFullError`; at least 1 (0 would refuse every request).

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import Engine, SamplingParams
        >>> model = tiny_llama(num_hidden_layers=1)
        >>> events, done = [], threading.Event()
        >>> def sink(event):
        ...     events.append(event)
        ...     if isinstance(event, Finished):
        ...         done.set()
        >>> with Engine(model, num_blocks=16, block_size=8) as engine:
        ...     loop = EngineLoop(engine)
        ...     loop.start()
        ...     ids = loop.submit([Request([1, 2, 3], SamplingParams(max_new_tokens=3))], sink)
        ...     _ = done.wait(60)
        ...     loop.stop()
        >>> events[-1].completion_tokens, events[-1].finish_reasons
        ((3,), ('length',))
    """

    def __init__(self, engine: Engine, *, max_queue: int = 512) -> None:
        max_queue = integer("max_queue", max_queue, minimum=1, error=ConfigError)  # 0 would answer every 429
        self._engine = engine
        self._max_queue = max_queue
        self._cond = threading.Condition(threading.Lock())
        self._commands: list[_Add | _Abort] = []
        self._num_pending = 0  # _Add commands not yet applied
        self._num_waiting = 0  # the scheduler's waiting requests, as of the last publish
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._live: dict[str, Sink] = {}  # the sinks of the requests the engine runs; loop thread only
        self._admissions = _Admissions(self._live)
        self._tokens = _Tokens()
        self._listeners: list[Callable[[float], None]] = []
        self._num_prompt_tokens = 0
        self._num_failed_steps = 0
        self._stats = self._snapshot()

    # ------------------------------------------------------------------ any thread
    @property
    def engine(self) -> Engine:
        """The engine (touch it only through the loop once it runs)."""
        return self._engine

    @property
    def max_queue(self) -> int:
        """Bound on waiting requests."""
        return self._max_queue

    @property
    def stats(self) -> LoopStats:
        """The latest published :class:`LoopStats`, with the number of waiting requests as of now."""
        with self._cond:
            waiting = self._num_pending + self._num_waiting
        return replace(self._stats, num_waiting=waiting)

    @property
    def is_running(self) -> bool:
        """Whether the loop thread is alive and not stopping."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def add_step_listener(self, listener: Callable[[float], None]) -> None:
        """Call ``listener(seconds)`` on the loop thread after every engine step (e.g. a histogram)."""
        self._listeners.append(listener)

    def prepare_structured(self, spec: StructuredOutput) -> StructuredOutput:
        """Parse and compile a structured-output spec with the engine's compiler, in the calling thread (a
        server's worker): see :meth:`Engine.prepare_structured <pagedcore.engine.Engine.prepare_structured>`. A
        request whose params carry the spec this returns is neither parsed nor held on the loop thread."""
        return self._engine.prepare_structured(spec)

    def max_new_tokens(self, prompt_tokens: int) -> int | None:
        """The most new tokens a request with a prompt of this length can be given: what the engine's context leaves
        and its pool can ever hold for one sequence (:meth:`Engine.max_new_tokens
        <pagedcore.engine.Engine.max_new_tokens>`, one exact query); what a chat request without ``max_tokens``
        is clamped to. Safe from any thread (it reads what does not change)."""
        return self._engine.max_new_tokens(prompt_tokens)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix now (:meth:`Engine.reset_prefix_cache`, safe while the loop steps): a later
        request computes its prompt again. Running requests finish on their own blocks. Returns the cached blocks
        forgotten."""
        return int(self._engine.reset_prefix_cache())

    def submit(self, requests: Sequence[Request], sink: Sink) -> list[str]:
        """Queue requests (all or none); returns the ids the loop gave them (a request's own ``request_id`` is not
        used: ids are unique per process). Each gets :class:`Started` or a :class:`Finished`
        with an error, then its deltas and one :class:`Finished`, all through ``sink`` on the loop thread.

        Raises :class:`QueueFullError` when they would take the waiting requests over ``max_queue``, and
        :class:`LoopClosedError` after :meth:`stop`.
        """
        with self._cond:
            if self._stopping:
                raise LoopClosedError("the server is shutting down")
            waiting = self._num_pending + self._num_waiting
            if waiting + len(requests) > self._max_queue:
                raise QueueFullError(
                    f"{waiting} requests are waiting; {len(requests)} more would exceed the queue bound of "
                    f"{self._max_queue}: retry later"
                )
            ids = [f"req-{next(_REQUEST_IDS)}" for _ in requests]
            self._commands.extend((replace(request, request_id=rid), sink) for rid, request in zip(ids, requests))
            self._num_pending += len(requests)
            self._cond.notify()
        return ids

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown or finished ids are ignored). Its blocks go back before the next
        step; its sink gets a :class:`Finished` with ``error_kind="aborted"``."""
        with self._cond:
            if self._stopping:
                return
            self._commands.append(_Abort(request_id))
            self._cond.notify()

    def start(self) -> None:
        """Start the loop thread."""
        with self._cond:
            if self._thread is not None or self._stopping:
                raise LoopClosedError("an EngineLoop starts once")
            self._engine.runner.plugins.register(self._admissions, name=f"pagedcore-serve-admissions-{id(self)}")
            self._thread = threading.Thread(target=self._run, name="pagedcore-engine-loop", daemon=True)
            self._thread.start()

    def stop(self, *, wait: bool = True, timeout: float | None = 30.0) -> None:
        """Stop taking requests; every pending and running request ends with an error ("shutdown"). With
        ``wait``, join the thread (it finishes its current step first)."""
        with self._cond:
            first = not self._stopping
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is None:
            if first:
                self._shutdown()  # never started: fail what was queued, here
            return
        if wait and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("pagedcore: the engine loop did not stop within %s s", timeout)

    # ------------------------------------------------------------------ loop thread
    def _run(self) -> None:
        idle_after_failure = False
        while True:
            busy = self._engine.has_unfinished() and not idle_after_failure
            with self._cond:
                while not self._commands and not self._stopping and not busy:
                    self._cond.wait()
                if self._stopping:
                    break
                commands, self._commands = self._commands, []
            if commands:
                idle_after_failure = False
                self._apply(commands)
            if self._engine.has_unfinished() and not idle_after_failure:
                idle_after_failure = not self._step()
            self._publish()
        self._shutdown()

    def _apply(self, commands: list[_Add | _Abort]) -> None:
        for command in commands:
            if isinstance(command, _Abort):
                self._abort(command.request_id)
            else:
                self._add(*command)

    def _add(self, request: Request, sink: Sink) -> None:
        rid = str(request.request_id)
        try:
            self._engine.add_request(request)
        except PagedCoreError as exc:
            _send(sink, Finished(rid, 0, (), (), str(exc), "invalid", error_param=exc.param))
        except Exception as exc:  # a broken tokenizer or engine: this request fails, the loop goes on
            logger.exception("pagedcore: add_request failed")
            _send(sink, Finished(rid, 0, (), (), f"{type(exc).__name__}: {exc}", "failed"))
        else:
            self._live[rid] = sink
            _send(sink, Started(rid))
        finally:
            with self._cond:
                self._num_pending -= 1

    def _abort(self, request_id: str, error: str = "aborted", kind: str = "aborted") -> None:
        sink = self._live.pop(request_id, None)
        if sink is None:
            return
        output: RequestOutput | None
        try:
            output = self._engine.abort(request_id)
        except Exception:  # already gone from the engine: nothing holds its blocks
            output = None
        self._end(sink, request_id, output, error, kind)

    def _step(self) -> bool:
        started = time.perf_counter()
        try:
            result = self._engine.step_events()
        except Exception as exc:
            logger.exception("pagedcore: an engine step failed; failing its requests and serving on")
            self._num_failed_steps += 1
            for request_id in list(self._live):
                self._abort(request_id, f"the engine step failed: {type(exc).__name__}: {exc}", "failed")
            return False
        now = time.perf_counter()
        elapsed = now - started
        for listener in self._listeners:
            try:
                listener(elapsed)
            except Exception:
                logger.exception("pagedcore: a step listener failed")
        for event in result.events:
            self._route(event, now)
        for output in result.finished:
            sink = self._live.pop(output.request_id, None)
            if sink is not None:
                kind = None if not output.error else "invalid" if output.client_error else "failed"
                self._end(sink, output.request_id, output, output.error, kind)
        return True

    def _route(self, event: TokenEvent, now: float) -> None:
        """An engine token event becomes a :class:`Delta` (every token, and the end of a sample)."""
        sink = self._live.get(event.request_id)
        reason = event.finish_reason
        if sink is None or reason in ("abort", "error"):
            return  # an abort or a failure is reported by the request's Finished
        tokens: tuple[int, ...] = ()
        if event.token_id is not None:
            tokens = (event.token_id,)
            self._tokens.add(event.request_id, event.sample, now)
        if tokens or reason is not None:
            delta = Delta(
                event.request_id,
                event.sample,
                event.text or "",
                reason,
                tokens,
                event.logprobs,
                event.prompt_logprobs,
                event.stop_reason,
            )
            _send(sink, delta)

    def _end(
        self, sink: Sink, request_id: str, output: RequestOutput | None, error: str | None, kind: str | None
    ) -> None:
        samples = output.samples if output is not None else []
        ok = ("stop", "length") if error is None else ()
        reasons = tuple(s.finish_reason if s.finish_reason in ok else None for s in samples)
        tokens = tuple(len(s.token_ids) for s in samples)
        prompt_tokens = len(output.prompt_token_ids) if output is not None else 0
        cached = output.metrics.num_cached_tokens if output is not None else 0
        self._num_prompt_tokens += prompt_tokens
        timings = self._timings(request_id, output)
        _send(sink, Finished(request_id, prompt_tokens, tokens, reasons, error, kind, cached, timings))

    def _timings(self, request_id: str, output: RequestOutput | None) -> RequestTimings | None:
        admitted = self._admissions.times.pop(request_id, None)
        gaps = self._tokens.pop(request_id, len(output.samples) if output is not None else 0)
        if output is None:
            return None
        metrics = output.metrics
        arrival, first = metrics.arrival_time, metrics.first_token_time
        end = metrics.finish_time if metrics.finish_time is not None else time.perf_counter()
        return RequestTimings(
            queued=None if admitted is None else admitted - arrival,
            first_token=None if first is None else first - arrival,
            prefill=None if first is None or admitted is None else first - admitted,
            decode=None if first is None else end - first,
            total=end - arrival,
            inter_token=gaps,
        )

    def _publish(self) -> None:
        self._stats = self._snapshot()

    def _snapshot(self) -> LoopStats:
        engine = self._engine
        waiting = engine.scheduler.num_waiting
        with self._cond:
            self._num_waiting = waiting
            pending = self._num_pending
        return LoopStats(
            engine=engine.stats(),
            num_waiting=pending + waiting,
            num_running=engine.scheduler.num_running,
            num_used_blocks=engine.runner.kv.num_used_blocks,
            num_blocks=engine.runner.kv.num_blocks * len(engine.runner.kv.groups),
            num_prompt_tokens=self._num_prompt_tokens,
            num_failed_steps=self._num_failed_steps,
        )

    def _shutdown(self) -> None:
        with self._cond:
            commands, self._commands = self._commands, []
        for command in commands:
            if not isinstance(command, _Abort):
                request, sink = command
                _send(sink, Finished(str(request.request_id), 0, (), (), "the server is shutting down", "shutdown"))
                with self._cond:
                    self._num_pending -= 1
        for request_id in list(self._live):
            self._abort(request_id, "the server is shutting down", "shutdown")
        self._publish()
        try:
            self._engine.runner.plugins.unregister(self._admissions)
        except PagedCoreError:  # never registered (the loop never started)
            pass


def _send(sink: Sink, event: LoopEvent) -> None:
    try:
        sink(event)
    except Exception:  # e.g. the client's event loop is closed: its request is over anyway
        logger.debug("pagedcore: a request's sink failed", exc_info=True)
