"""Several locks taken as one: the Engine holds its own lock and its pool's bookkeeping lock together."""

from __future__ import annotations

from typing import Any

__all__ = ["Locks"]


class Locks:
    """Locks taken together, in order, and released in reverse (re-entrant when every one of them is).

    Example:
        >>> import threading
        >>> first, second = threading.RLock(), threading.Lock()
        >>> with Locks(first, second):
        ...     second.locked()
        True
        >>> second.locked()
        False
    """

    def __init__(self, *locks: Any) -> None:
        self._locks = locks

    def __enter__(self) -> Locks:
        taken = []
        try:
            for lock in self._locks:
                lock.__enter__()
                taken.append(lock)
        except BaseException:
            for lock in reversed(taken):
                lock.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for lock in reversed(self._locks):
            lock.__exit__(None, None, None)
