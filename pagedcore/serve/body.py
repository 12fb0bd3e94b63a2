"""Reading a request's body, bounded in size and in time.

The body is read message by message as it arrives, never buffered past ``max_bytes`` (a ``Content-Length`` over it
is refused before one byte is read: 413), and the whole of it must arrive within ``timeout`` seconds (else 408), so a
client that sends slowly or stops half-way holds nothing for long. A client that leaves before its body is complete
raises :class:`ClientGone`: the app counts it as a disconnect and logs one line.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from .protocol import ApiError

if TYPE_CHECKING:
    from .admission import Admission

__all__ = ["DEFAULT_BODY_TIMEOUT", "DEFAULT_MAX_REQUEST_BYTES", "BodyLimits", "ClientGone", "body_limits", "read_body"]

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
DEFAULT_BODY_TIMEOUT = 30.0


@dataclass(frozen=True)
class BodyLimits:
    """How large a request body may be and how long it may take to arrive.

    Args:
        max_bytes: the most bytes a body may have (``--max-request-bytes``); larger ones get 413.
        timeout: seconds from the start of the body to its end (``--body-timeout``); slower ones get 408.

    Example:
        >>> BodyLimits().max_bytes == 8 * 2**20, BodyLimits(timeout=5).timeout
        (True, 5)
    """

    max_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    timeout: float = DEFAULT_BODY_TIMEOUT

    def __post_init__(self) -> None:
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise ValueError(f"max_bytes must be an integer >= 1, got {self.max_bytes!r}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {self.timeout!r}")


def body_limits(args: argparse.Namespace) -> BodyLimits:
    """The limits of ``pagedcore serve``'s ``--max-request-bytes`` (already a number of bytes) and
    ``--body-timeout``.

    Example:
        >>> body_limits(argparse.Namespace(max_request_bytes=1000, body_timeout=2.5))
        BodyLimits(max_bytes=1000, timeout=2.5)
    """
    return BodyLimits(max_bytes=args.max_request_bytes, timeout=args.body_timeout)


class ClientGone(Exception):
    """The client disconnected before its request body was complete (``received`` bytes had arrived)."""

    def __init__(self, received: int) -> None:
        super().__init__(f"the client left after sending {received} bytes of its request body")
        self.received = received


async def read_body(request: Request, limits: BodyLimits, admission: Admission | None = None) -> bytes:
    """The whole body of ``request``; raises :class:`ApiError` 413 (too large), 408 (too slow) or, once
    ``admission`` closes for a shutdown while it arrives, 503 (else uvicorn would cancel the read at its own
    graceful timeout, past ``--shutdown-timeout``, with a traceback); or :class:`ClientGone`.

    Example:
        >>> import asyncio
        >>> messages = [{"type": "http.request", "body": b'{"a": ', "more_body": True},
        ...             {"type": "http.request", "body": b"1}"}]
        >>> async def receive():
        ...     return messages.pop(0)
        >>> request = Request({"type": "http", "method": "POST", "headers": []}, receive)
        >>> asyncio.run(read_body(request, BodyLimits()))
        b'{"a": 1}'
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_bytes:
        raise _too_large(limits, f"its Content-Length is {int(declared)}")
    clock = asyncio.get_running_loop().time
    deadline = clock() + limits.timeout
    chunks: list[bytes] = []
    size = 0
    receiving: asyncio.Future[Any] | None = None
    try:
        while True:
            if admission is not None:
                admission.check()  # shutting down: 503 now
            if receiving is None:
                receiving = asyncio.ensure_future(request.receive())
            left = max(deadline - clock(), 0.0)
            done, _ = await asyncio.wait({receiving}, timeout=left if admission is None else min(left, _POLL))
            if not done:
                if clock() < deadline:
                    continue
                raise ApiError(
                    408,
                    f"the request body did not arrive within {limits.timeout:g} s ({size} bytes came)",
                    code="request_timeout",
                )
            message, receiving = receiving.result(), None
            if message["type"] == "http.disconnect":
                raise ClientGone(size)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limits.max_bytes:
                raise _too_large(limits, f"{size} bytes came so far")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
    finally:
        if receiving is not None:
            receiving.cancel()


_POLL = 0.2  # seconds between two looks at the admission while a body arrives


def _too_large(limits: BodyLimits, what: str) -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than this server's limit of {limits.max_bytes} bytes ({what})",
        code="request_too_large",
    )
