"""PoolLock: the one re-entrant lock over a :class:`~pagedcore.adapters.transformers.PagedKVPool`'s blocks, and the
releases that garbage collection defers to a safe moment."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from types import TracebackType

__all__ = ["PoolLock"]

_log = logging.getLogger(__name__)


class PoolLock:
    """The pool's re-entrant bookkeeping lock (``with pool.lock:``), plus releases deferred to a safe moment.

    It is the one lock over the pool's block state: every holder (caches, ``enable()``d calls, an Engine, whose own
    lock takes it) changes blocks only while holding it, so holders in different threads can share a pool.

    A cache dropped without :meth:`PagedCache.release` gives its blocks back from a garbage-collection finalizer,
    which may run at any allocation, even in the middle of a bookkeeping call of this very thread. Such releases
    go through :meth:`call_soon`: run at once when no bookkeeping call is in progress, else when the outermost one
    in progress (of any thread) ends.

    Example:
        >>> lock = PoolLock()
        >>> done = []
        >>> with lock:
        ...     lock.call_soon(lambda: done.append(1))   # inside a bookkeeping call: deferred
        ...     print(done)
        []
        >>> done
        [1]
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0  # nested holds by the owning thread (only touched while holding the lock)
        self._holder: int | None = None  # the owning thread's id while held
        self._pending: deque[Callable[[], None]] = deque()

    def __enter__(self) -> PoolLock:
        self._lock.acquire()
        self._depth += 1
        self._holder = threading.get_ident()
        if self._depth == 1 and self._pending:
            self._drain()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._depth == 1:
                self._drain()
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._holder = None
            self._lock.release()

    def is_held(self) -> bool:
        """Whether the calling thread holds the lock (for assertions: every change to a pool's blocks holds it).

        Example:
            >>> lock = PoolLock()
            >>> with lock:
            ...     print(lock.is_held())
            True
            >>> lock.is_held()
            False
        """
        return self._holder == threading.get_ident()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` under the lock now if no bookkeeping call is in progress, else when the current one ends."""
        self._pending.append(fn)
        if self._lock.acquire(blocking=False):
            try:
                if self._depth == 0:  # not inside a bookkeeping call of this thread
                    self._depth = 1
                    self._holder = threading.get_ident()
                    try:
                        self._drain()
                    finally:
                        self._depth = 0
                        self._holder = None
            finally:
                self._lock.release()

    def _drain(self) -> None:
        while self._pending:
            try:
                fn = self._pending.popleft()
            except IndexError:  # another thread's call_soon appended and drained concurrently
                return
            try:
                fn()
            except Exception:  # a finalizer's release must never break the call that happened to run it
                _log.exception("pagedcore: a deferred release failed")
