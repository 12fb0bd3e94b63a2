"""Admission while the server runs and while it drains for a graceful shutdown.

On SIGTERM the server stops admitting: new generation requests get 503 with ``Retry-After`` (another replica can
take them), ``/health`` says 503 (load balancers stop sending), and the requests being answered go on until they
end or ``--shutdown-timeout`` passes (:mod:`pagedcore.serve.server` then stops the engine loop, which ends the rest
with an error). :class:`Admission` counts the requests being answered so the server knows when it is idle.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .protocol import ApiError

__all__ = ["RETRY_AFTER_SECONDS", "Admission"]

RETRY_AFTER_SECONDS = {429: 1, 503: 5}
"""The ``Retry-After`` of an answer with that status (a full queue drains fast; a restart takes longer)."""


class Admission:
    """Whether new generation requests are taken, and how many are being answered.

    Example:
        >>> admission = Admission()
        >>> leave = admission.enter()
        >>> admission.active, admission.is_open
        (1, True)
        >>> admission.close()
        >>> admission.check()
        Traceback (most recent call last):
        ...
        pagedcore.serve.protocol.ApiError: the server is shutting down: send the request again (to another replica)
        >>> leave(); leave()  # idempotent
        >>> admission.active
        0
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = True
        self._active = 0

    @property
    def is_open(self) -> bool:
        """Whether new requests are taken."""
        return self._open

    @property
    def active(self) -> int:
        """Requests being answered (admitted, not yet done)."""
        return self._active

    def close(self) -> None:
        """Stop taking new requests (the ones being answered go on)."""
        self._open = False

    def check(self) -> None:
        """Raise :class:`ApiError` 503 unless new requests are taken."""
        if not self._open:
            raise ApiError(
                503,
                "the server is shutting down: send the request again (to another replica)",
                type="server_error",
                code="shutting_down",
            )

    def enter(self) -> Callable[[], None]:
        """Admit one request (503 when closed); returns the function that says it is done (call it once or more)."""
        with self._lock:
            self.check()
            self._active += 1
        done = False

        def leave() -> None:
            nonlocal done
            with self._lock:
                if not done:
                    done = True
                    self._active -= 1

        return leave
