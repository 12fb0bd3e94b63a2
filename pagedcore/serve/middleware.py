"""Two pure ASGI middlewares of vLLM's flags (streamed answers go through them too): ``--enable-request-id-headers``
(every answer carries ``X-Request-Id``, the client's own when its request had one, a proxy's trace id, else a new
one) and ``--root-path`` (the prefix a path-routing proxy serves the app under).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["RequestIdHeaders", "RootPath"]

_HEADER = b"x-request-id"
_VALID = re.compile(rb"[\x21-\x7e]{1,256}")  # printable ASCII without spaces: never a header injection


class RequestIdHeaders:
    """Adds ``X-Request-Id`` to every HTTP answer of ``app``.

    Example:
        >>> RequestIdHeaders(app=None).id_of({"headers": [(b"x-request-id", b"trace-1")]})
        b'trace-1'
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    @staticmethod
    def id_of(scope: Scope) -> bytes:
        """The request's id: its ``X-Request-Id`` header when it is a sane one, else a new uuid."""
        for name, value in scope.get("headers", []):
            if name.lower() == _HEADER and _VALID.fullmatch(value):
                return bytes(value)
        return uuid.uuid4().hex.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = self.id_of(scope)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers: list[Any] = [h for h in message.get("headers", []) if h[0].lower() != _HEADER]
                message = {**message, "headers": [*headers, (_HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class RootPath:
    """``--root-path``: the app is served under this prefix by a path-routing proxy. Each request's ``root_path``
    says so (what FastAPI's deprecated ``root_path`` parameter did), so routes answer under the prefix and without
    it, and the OpenAPI document names it in ``servers``.

    Example:
        >>> RootPath(app=None, root_path="/api").root_path
        '/api'
    """

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)
