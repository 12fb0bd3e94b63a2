"""Several locks taken as one: the Engine holds its own lock and its pool's bookkeeping lock together."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedcore.plugin_manager import PluginManager

__all__ = ["Locks"]


class Locks:
    """Locks taken together, in order, and released in reverse (re-entrant when every one of them is). With
    ``events``, the events emitted while they are held are delivered once they are released
    (:meth:`~pagedcore.plugin_manager.PluginManager.hold_events`): observers never run under them.

    Example:
        >>> import threading
        >>> first, second = threading.RLock(), threading.Lock()
        >>> with Locks(first, second):
        ...     second.locked()
        True
        >>> second.locked()
        False
    """

    def __init__(self, *locks: Any, events: PluginManager | None = None) -> None:
        self._locks = locks
        self._events = events

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
        if self._events is not None:
            self._events.hold_events()
        return self

    def __exit__(self, *exc: object) -> None:
        for lock in reversed(self._locks):
            lock.__exit__(None, None, None)
        if self._events is not None:
            self._events.release_events()
