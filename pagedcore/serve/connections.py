"""Connections before they are requests: a header timeout, a bound on header bytes and a per-client connection cap.

uvicorn times out an idle keep-alive connection, and the server times out a slow body (``--body-timeout``), but
nothing bounds a connection that sends half a header block and waits: a few hundred of them hold every file
descriptor the process may open, and every other client is locked out until they leave. :func:`guarded_protocol`
wraps uvicorn's HTTP protocol so that

- a connection must complete its request line and headers within ``header_timeout`` seconds of opening (or of its
  previous response ending), else it gets ``408`` and is closed;
- the header block may hold ``max_header_bytes`` at most (else ``431``, closed);
- one client address holds at most ``max_per_client`` connections at once; one more is answered ``429`` and closed
  at once (its descriptor comes back), so one client cannot take the descriptors every other client needs. The
  default is a quarter of the process's descriptor limit (``ulimit -n``), at least 8 and at most 4096.

A client behind a proxy shares the proxy's address: raise ``--max-connections-per-client`` (or 0: no cap) when one
proxy carries many clients.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pagedcore.errors import ConfigError

__all__ = ["ConnectionLimits", "default_max_per_client", "guarded_protocol"]

logger = logging.getLogger("pagedcore.serve")

_CLOSE = b"Connection: close\r\nContent-Length: 0\r\n\r\n"
_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\n" + _CLOSE
_TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\n" + _CLOSE
_TOO_MANY = b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\n" + _CLOSE


def default_max_per_client() -> int:
    """A quarter of this process's file descriptor limit, within 8 .. 4096.

    Example:
        >>> 8 <= default_max_per_client() <= 4096
        True
    """
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 256
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(8, min(4096, soft // 4))


@dataclass(frozen=True)
class ConnectionLimits:
    """What a connection may do before its request is complete (see the module docstring).

    Attributes:
        header_timeout: seconds from a connection's start (or its previous response's end) to its complete headers.
        max_header_bytes: bytes a request line and header block may take.
        max_per_client: connections one client address may hold at once (0: no cap); default
            :func:`default_max_per_client`.

    Example:
        >>> ConnectionLimits(header_timeout=5).header_timeout
        5
        >>> ConnectionLimits(header_timeout=0)
        Traceback (most recent call last):
        ...
        pagedcore.errors.ConfigError: --header-timeout must be a number of seconds > 0, got 0
    """

    header_timeout: float = 10.0
    max_header_bytes: int = 64 * 1024
    max_per_client: int = field(default_factory=default_max_per_client)

    def __post_init__(self) -> None:
        if not self.header_timeout > 0 or self.header_timeout == float("inf"):
            raise ConfigError(f"--header-timeout must be a number of seconds > 0, got {self.header_timeout}")
        if type(self.max_header_bytes) is not int or self.max_header_bytes < 1024:
            raise ConfigError(f"max_header_bytes must be an integer >= 1024, got {self.max_header_bytes!r}")
        if type(self.max_per_client) is not int or self.max_per_client < 0:
            raise ConfigError(f"--max-connections-per-client must be >= 0, got {self.max_per_client!r}")


class _Guard(asyncio.Protocol):
    """What :func:`guarded_protocol` adds to uvicorn's protocol (before it in the method order)."""

    guard_limits: ClassVar[ConnectionLimits]
    guard_counts: ClassVar[Counter[str]]  # open connections per client address, this server's
    guard_refusing: ClassVar[set[str]]  # addresses over the cap, logged once until they are under it again
    # uvicorn's protocol attributes read here
    client: tuple[str, int] | None
    cycle: Any
    transport: Any
    loop: asyncio.AbstractEventLoop

    _guard_timer: asyncio.TimerHandle | None = None
    _guard_host: str | None = None
    _guard_bytes = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        host = self.client[0] if self.client else None
        if host is not None:
            counts, cap = self.guard_counts, self.guard_limits.max_per_client
            self._guard_host = host
            counts[host] += 1
            if cap and counts[host] > cap:
                if host not in self.guard_refusing:
                    self.guard_refusing.add(host)
                    logger.warning("pagedcore: %s holds %d connections: more are refused", host, counts[host] - 1)
                self._refuse(_TOO_MANY)
                return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        host, self._guard_host = self._guard_host, None
        if host is not None:
            counts = self.guard_counts
            counts[host] -= 1
            if counts[host] <= self.guard_limits.max_per_client:
                self.guard_refusing.discard(host)
            if counts[host] <= 0:
                del counts[host]
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._awaiting_headers():
            self._guard_bytes = 0
            return
        self._guard_bytes += len(data)
        if self._guard_bytes > self.guard_limits.max_header_bytes:
            self._refuse(_TOO_LARGE)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]  # uvicorn's protocols have it
        self._arm()  # the next request's headers are due within the timeout too

    def _awaiting_headers(self) -> bool:
        cycle = self.cycle
        return cycle is None or bool(cycle.response_complete)

    def _arm(self) -> None:
        self._disarm()
        self._guard_bytes = 0
        self._guard_timer = self.loop.call_later(self.guard_limits.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._guard_timer is not None:
            self._guard_timer.cancel()
            self._guard_timer = None

    def _expire(self) -> None:
        self._guard_timer = None
        if self._awaiting_headers():
            self._refuse(_REQUEST_TIMEOUT)

    def _refuse(self, answer: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(answer)
            transport.close()


def guarded_protocol(limits: ConnectionLimits, base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (``base``; default the one uvicorn picks) with ``limits`` enforced; give it
    to ``uvicorn.Config(http=...)``. Each call makes a new class with its own per-client counts (one per server).

    Example:
        >>> from uvicorn.protocols.http.auto import AutoHTTPProtocol
        >>> cls = guarded_protocol(ConnectionLimits())
        >>> issubclass(cls, AutoHTTPProtocol), cls.__name__ == "Guarded" + AutoHTTPProtocol.__name__
        (True, True)
    """
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    state = {"guard_limits": limits, "guard_counts": Counter(), "guard_refusing": set()}
    return type(f"Guarded{base.__name__}", (_Guard, base), state)
