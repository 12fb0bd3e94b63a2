"""InFlight: the requests a router has assigned to each replica and not yet seen complete.

The prefix router's imbalance guard needs each replica's load at the moment it decides. Ray Serve's queue-length
cache cannot give it: it changes only when a request has been sent (after the decision, a hop later) or when a
probe answers, so a burst of requests routed together all see the same stale figure and pile onto one replica.
This table changes at the decision itself: a request counts on the replica chosen for it from the moment it is
chosen until Ray Serve reports it completed (or failed, or cancelled before it was sent), so the next decision,
even in the same burst, sees it.

A routing attempt is identified by the request's id and its ``PendingRequest.future``: re-ranking the same attempt
moves its count, the future's result (the replica Ray actually used, which may be a fallback rank) corrects it, and
a future cancelled before it was resolved (the caller gave up) drops it. Bounded: at most ``max_requests`` requests
are remembered, the oldest forgotten first, so a completion Ray never reports cannot grow it for ever.
"""

from __future__ import annotations

import functools
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from pagedcore.errors import ConfigError

__all__ = ["InFlight"]


@dataclass(frozen=True)
class _Assignment:
    replica: Hashable
    future: Any  # the attempt's asyncio.Future (None: the request came without one)


class InFlight:
    """Requests assigned per replica, as a router decided them.

    Args:
        max_requests: requests remembered at most (the oldest forgotten first).

    Example:
        >>> table = InFlight()
        >>> table.assign("req-1", "r0")
        >>> table.assign("req-2", "r0")
        >>> table.assign("req-2", "r1")  # the same request re-ranked: it counts once, where it is now
        >>> table.load("r0"), table.load("r1"), table.load("r1", excluding="req-2")
        (1, 1, 0)
        >>> table.complete("req-1", "r0")
        >>> table.load("r0"), len(table)
        (0, 1)
    """

    def __init__(self, max_requests: int = 1 << 16) -> None:
        if isinstance(max_requests, bool) or not isinstance(max_requests, int) or max_requests < 1:
            raise ConfigError(f"max_requests must be an integer >= 1, got {max_requests!r}")
        self._max_requests = max_requests
        self._by_request: OrderedDict[str, _Assignment] = OrderedDict()
        self._counts: Counter[Hashable] = Counter()

    def __len__(self) -> int:
        return len(self._by_request)

    def load(self, replica: Hashable, *, excluding: str | None = None) -> int:
        """Requests assigned to ``replica``, not counting request ``excluding`` (the one being routed again)."""
        count = self._counts[replica]
        mine = self._by_request.get(excluding) if excluding is not None else None
        return count - 1 if mine is not None and mine.replica == replica else count

    def assign(self, request_id: str, replica: Hashable, future: Any = None) -> None:
        """Count ``request_id`` on ``replica`` (replacing where it counted before). With the attempt's ``future``:
        its result moves the count to the replica Ray used, its cancellation drops it."""
        previous = self._by_request.get(request_id)
        self._drop(request_id)
        self._by_request[request_id] = _Assignment(replica, future)
        self._counts[replica] += 1
        if future is not None and (previous is None or previous.future is not future):
            future.add_done_callback(functools.partial(self._settled, request_id))
        while len(self._by_request) > self._max_requests:
            self._drop(next(iter(self._by_request)))

    def complete(self, request_id: str, replica: Hashable) -> None:
        """The request finished (or failed) on ``replica``: it no longer counts. A completion of an earlier attempt
        (e.g. one the replica rejected, retried elsewhere) leaves the current attempt counted."""
        assignment = self._by_request.get(request_id)
        if assignment is not None and replica in (assignment.replica, _used_replica(assignment.future)):
            self._drop(request_id)

    def forget_replica(self, replica: Hashable) -> None:
        """A replica died or left: nothing counts on it any more."""
        self.retain_replicas(lambda r: r != replica)

    def retain_replicas(self, keep: Callable[[Hashable], bool]) -> None:
        """Forget the requests on every replica for which ``keep`` is false (the replicas that left)."""
        for request_id in [r for r, a in self._by_request.items() if not keep(a.replica)]:
            self._drop(request_id)

    def _settled(self, request_id: str, future: Any) -> None:
        assignment = self._by_request.get(request_id)
        if assignment is None or assignment.future is not future:
            return  # completed already, or superseded by a later attempt
        if future.cancelled() or future.exception() is not None:  # the caller gave up: it was never sent
            self._drop(request_id)
            return
        used = _used_replica(future)
        if used is not None and used != assignment.replica:  # Ray fell back to a lower rank
            self._counts[assignment.replica] -= 1
            self._counts[used] += 1
            self._by_request[request_id] = _Assignment(used, future)

    def _drop(self, request_id: str) -> None:
        assignment = self._by_request.pop(request_id, None)
        if assignment is not None:
            self._counts[assignment.replica] -= 1
            if self._counts[assignment.replica] <= 0:
                del self._counts[assignment.replica]


def _used_replica(future: Any) -> Hashable | None:
    """The replica id a resolved routing future carries, else None (pending, cancelled or failed)."""
    if future is None or not future.done() or future.cancelled() or future.exception() is not None:
        return None
    return getattr(future.result(), "replica_id", None)
