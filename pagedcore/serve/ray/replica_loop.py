"""ReplicaLoop: the :class:`~pagedcore.serve.loop.RequestLoop` that the HTTP app runs on in a Ray ingress.

It takes the place of an :class:`~pagedcore.serve.loop.EngineLoop`: the same ``submit`` / ``abort`` contract, the
same events, so :func:`~pagedcore.serve.app.create_app` serves OpenAI's API over it unchanged. Each request becomes
a streaming call to the engine deployment (routed by prefix, see :mod:`pagedcore.serve.ray.routing`); the replica's
events come back through that stream. A replica that dies before the request produced output is retried on another
replica; after output was sent the request fails cleanly (an error event, or a 500). A stream that stays silent for
``stall_timeout`` seconds counts as a failed replica, so no request waits forever. What a client sees of a failure
is a generic message naming its request id; the replica's error (actor id, pid, node address: cluster internals)
goes to the server log under that id.

Statistics (``stats``, the app's ``/metrics``) come from the replicas' reports (:mod:`~.replica_stats`): one at the
end of each request's stream, and a poll of every live replica every ``stats_interval`` seconds, which drops
replicas that died and brings the figures up to date after a replica's last step.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import DeploymentUnavailableError

from pagedcore.engine.structured import StructuredOutput
from pagedcore.errors import ConfigError

from ..loop import Delta, Finished, LoopClosedError, LoopStats, QueueFullError, Request, Started
from ..structured import parse_only
from .replica import ReplicaReport
from .replica_stats import ReplicaStats, zero_stats
from .routing import MAX_ROUTED_BLOCKS, RoutedRequest, prefix_hashes

logger = logging.getLogger(__name__)

__all__ = ["ReplicaLoop"]

Sink = Callable[[Any], None]
_SEE_LOG = "the server log has the details under this request id"
_POLL_TIMEOUT_S = 10.0  # a statistics poll that takes longer is dropped (the figures stay as they were)


class _StreamEndedError(Exception):
    """A replica's stream ended before the request's Finished event."""


_REPLICA_FAILURES = (RayActorError, ActorUnavailableError, asyncio.TimeoutError, _StreamEndedError)


class ReplicaLoop:
    """Submits requests to engine replicas through a Ray Serve deployment handle; one asyncio task per request.

    Call :meth:`submit` and :meth:`abort` on the event loop that serves HTTP (the app's handlers do).

    Args:
        handle: the engine deployment's handle (``EngineReplica``).
        tokenizer: encodes text prompts here, so the router sees their tokens (None: text goes as it is, unrouted).
        block_size: the replicas' KV block size (prefixes are routed by whole blocks).
        max_queue: requests that may wait for a replica's first answer before new ones get :class:`QueueFullError`.
        attempts: tries per request when a replica fails before the request produced output.
        stall_timeout: seconds without an event from the replica after which it counts as failed.
        stats_interval: seconds between polls of the replicas' statistics, from the first request or ``stats``
            read on (None: only :meth:`refresh_stats` polls).

    Example:
        >>> loop = ReplicaLoop(handle=None, tokenizer=None, block_size=16)
        >>> loop.is_running, loop.stats.num_blocks
        (True, 0)
    """

    public_errors = True  # its error messages name the request and hide cluster internals (the app sends them)

    def __init__(
        self,
        handle: Any,
        tokenizer: Any,
        *,
        block_size: int,
        max_queue: int = 512,
        attempts: int = 3,
        stall_timeout: float = 600.0,
        stats_interval: float | None = 1.0,
    ) -> None:
        number = isinstance(stats_interval, (int, float)) and not isinstance(stats_interval, bool)
        if stats_interval is not None and not (number and stats_interval > 0):
            raise ConfigError(f"stats_interval must be a number > 0 or None, got {stats_interval!r}")
        self._handle = handle
        self._tokenizer = tokenizer
        self._block_size = block_size
        self._max_queue = max_queue
        self._attempts = attempts
        self._stall_timeout = stall_timeout
        self._ids = itertools.count()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._num_waiting = 0
        self._num_running = 0
        self._replicas = ReplicaStats()
        self._stats_interval = stats_interval
        self._poller: asyncio.Task[None] | None = None
        self._stopping = False
        self._listeners: list[Callable[[float], None]] = []

    @property
    def is_running(self) -> bool:
        """Whether it takes requests (until :meth:`stop`)."""
        return not self._stopping

    @property
    def stats(self) -> LoopStats:
        """The replicas' statistics as of their latest reports: gauges summed over the live replicas, counters
        over every replica that reported (see :mod:`~pagedcore.serve.ray.replica_stats`); waiting and running
        counts as this ingress sees them. The first read on an event loop (or the first request) starts the poll."""
        self._start_polling()
        merged = self._replicas.merged() or zero_stats()
        return replace(merged, num_waiting=self._num_waiting, num_running=self._num_running)

    async def refresh_stats(self) -> None:
        """Poll every live replica for its statistics now (Ray Serve's ``broadcast``); the replicas that answer
        are the live ones. Runs every ``stats_interval`` seconds once this loop serves (one small call per replica:
        the control-plane use Ray Serve's ``broadcast`` is meant for)."""
        try:
            response = self._handle.broadcast("stats")
            answers = await response.results_async(timeout_s=_POLL_TIMEOUT_S, return_exceptions=True)
        except DeploymentUnavailableError:  # no replica runs at all
            answers = []
        except Exception:  # e.g. the poll timed out: keep what the replicas reported before
            logger.debug("pagedcore: polling the engine replicas' statistics failed", exc_info=True)
            return
        self._replicas.record_poll(answer for answer in answers if isinstance(answer, ReplicaReport))

    def _start_polling(self) -> None:
        if self._poller is not None or self._stopping or self._stats_interval is None or self._handle is None:
            return
        try:
            aloop = asyncio.get_running_loop()
        except RuntimeError:  # read outside an event loop (e.g. a test): nothing to poll from
            return
        self._poller = contextvars.Context().run(aloop.create_task, self._poll())  # not in a request's context

    async def _poll(self) -> None:
        assert self._stats_interval is not None
        while True:
            await self.refresh_stats()
            await asyncio.sleep(self._stats_interval)

    def add_step_listener(self, listener: Callable[[float], None]) -> None:
        """Accepted for the app's sake; engine steps run in the replicas, so it is never called here."""
        self._listeners.append(listener)

    def max_new_tokens(self, prompt_tokens: int) -> int | None:
        """None: the ingress cannot say what the replicas' pools hold (a replica refuses a request that can never
        fit in its pool with a 400 naming the field)."""
        return None

    def prepare_structured(self, spec: StructuredOutput) -> StructuredOutput:
        """Parse a structured-output spec here, in the caller's thread (the ingress has no vocabulary to compile
        with): the spec returned carries its grammar, so no replica's step loop parses it."""
        return parse_only(spec)

    def submit(self, requests: Sequence[Request], sink: Sink) -> list[str]:
        """Start the requests (all or none); events reach ``sink`` on this event loop. Raises
        :class:`QueueFullError` over ``max_queue`` waiting requests, :class:`LoopClosedError` after :meth:`stop`."""
        if self._stopping:
            raise LoopClosedError("the server is shutting down")
        if self._num_waiting + len(requests) > self._max_queue:
            raise QueueFullError(
                f"{self._num_waiting} requests are waiting; {len(requests)} more would exceed the queue bound of "
                f"{self._max_queue}: retry later"
            )
        aloop = asyncio.get_running_loop()
        self._start_polling()
        ids = [f"req-{next(self._ids)}" for _ in requests]
        for request_id, submission in zip(ids, requests):
            self._num_waiting += 1
            # Each engine call runs in a context of its own: Ray Serve then gives it a request id of its own. In
            # the HTTP request's context every call of a batch would share that request's id, and Ray's router
            # matches routing decisions to pending calls by that id (calls sharing one were never sent).
            coroutine = self._run(request_id, self._routed(submission), sink)
            task = contextvars.Context().run(aloop.create_task, coroutine)
            self._tasks[request_id] = task
            task.add_done_callback(functools.partial(self._forget, request_id))
        return ids

    def abort(self, request_id: str) -> None:
        """Cancel a request's stream (the replica aborts it); unknown or finished ids are ignored."""
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    def count_waiting(self, change: int) -> None:
        """Requests that have not heard from a replica yet (the queue bound counts them)."""
        self._num_waiting += change

    def count_running(self, change: int) -> None:
        """Requests a replica accepted and has not finished."""
        self._num_running += change

    def _forget(self, request_id: str, task: asyncio.Task[None]) -> None:
        self._tasks.pop(request_id, None)

    def stop(self) -> None:
        """Take no new requests; running ones end with a "shutdown" error."""
        self._stopping = True
        if self._poller is not None:
            self._poller.cancel()
        for task in list(self._tasks.values()):
            task.cancel()

    def _routed(self, submission: Request) -> RoutedRequest:
        prompt = submission.prompt
        if isinstance(prompt, str):
            if self._tokenizer is None:
                return RoutedRequest(submission)
            try:
                prompt = list(self._tokenizer(prompt)["input_ids"])
            except Exception:  # the replica's engine reports it as this request's error
                return RoutedRequest(submission)
            submission = replace(submission, prompt=prompt)
        hashes = prefix_hashes(list(prompt), self._block_size, submission.namespace, max_blocks=MAX_ROUTED_BLOCKS)
        return RoutedRequest(submission, hashes)

    async def _run(self, request_id: str, request: RoutedRequest, sink: Sink) -> None:
        progress = _Progress(self, request_id, sink)
        try:
            for attempt in range(1, self._attempts + 1):
                try:
                    await self._stream(request, progress)
                    return
                except _REPLICA_FAILURES as exc:
                    # The error names cluster internals (actor id, pid, node address): the log gets it, the client
                    # a message that names its request.
                    final = progress.delivered or attempt == self._attempts
                    what = "failing it" if final else "retrying it on another replica"
                    logger.warning(
                        "pagedcore: request %s: its engine replica failed (attempt %d), %s: %s: %s",
                        request_id,
                        attempt,
                        what,
                        type(exc).__name__,
                        exc,
                    )
                    if final:
                        progress.fail(self._failure_message(request_id, exc), "failed")
                        return
        except asyncio.CancelledError:
            if self._stopping:
                progress.fail("the server is shutting down", "shutdown")
            else:
                progress.fail("aborted", "aborted")
        except Exception:  # a bug or an unexpected Ray error: this request fails, the ingress serves on
            logger.exception("pagedcore: request %s failed in the ingress", request_id)
            progress.fail(f"request {request_id} failed in the server ({_SEE_LOG})", "failed")
        finally:
            progress.end()

    def _failure_message(self, request_id: str, exc: BaseException) -> str:
        if isinstance(exc, asyncio.TimeoutError):
            what = f"sent nothing for {self._stall_timeout:g} s"
        elif isinstance(exc, _StreamEndedError):
            what = "ended its stream before the request finished"
        else:
            what = "failed"
        return f"the engine replica serving request {request_id} {what} ({_SEE_LOG})"

    async def _stream(self, request: RoutedRequest, progress: _Progress) -> None:
        stream = self._handle.options(stream=True).generate.remote(request)
        ended = False
        try:
            while True:
                try:
                    item = await asyncio.wait_for(stream.__anext__(), self._stall_timeout)
                except StopAsyncIteration:
                    ended = True
                    break
                if isinstance(item, ReplicaReport):
                    self._replicas.record(item)
                else:
                    progress.send(item)
        except _REPLICA_FAILURES:
            if not progress.finished:
                raise  # else only the replica's report is lost
        finally:
            if not ended:  # aborted, failed or stalled: the replica aborts the request
                stream.cancel()
        if not progress.finished:
            raise _StreamEndedError("the replica ended the stream without finishing the request")


class _Progress:
    """One request's state in the ingress: what its sink has seen, and the loop's waiting / running counts."""

    def __init__(self, loop: ReplicaLoop, request_id: str, sink: Sink) -> None:
        self.loop = loop
        self.request_id = request_id
        self.sink = sink
        self.state = "waiting"  # then "running", then "ended"
        self.delivered = False  # a Delta or the Finished reached the sink: no retry from here on
        self.finished = False

    def send(self, event: Started | Delta | Finished) -> None:
        if self.finished or (isinstance(event, Started) and self.delivered):
            return
        self._advance("running")
        if isinstance(event, (Delta, Finished)):
            self.delivered = True
        if isinstance(event, Finished):
            self.finished = True
            self._advance("ended")
        self.sink(replace(event, request_id=self.request_id))

    def fail(self, message: str, kind: str) -> None:
        if not self.finished:
            self.send(Finished(self.request_id, 0, (), (), message, kind))

    def end(self) -> None:
        self._advance("ended")

    def _advance(self, state: str) -> None:
        order = ("waiting", "running", "ended")
        while order.index(self.state) < order.index(state):
            if self.state == "waiting":
                self.loop.count_waiting(-1)
                self.loop.count_running(+1)
                self.state = "running"
            else:
                self.loop.count_running(-1)
                self.state = "ended"
