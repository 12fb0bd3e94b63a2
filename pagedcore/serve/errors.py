"""How the server answers what went wrong: OpenAI's error body for every error, the outcome each one is counted
as, and no internals in a 5xx.

A server error (a failed engine step, a bug) reaches the client as a generic message with a request id; what
happened, with that id, goes to the server's log (``pagedcore.serve`` logger). 4xx messages name the client's
mistake and are sent as they are.
"""

from __future__ import annotations

import json
import logging
import unicodedata
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match

from .admission import RETRY_AFTER_SECONDS
from .body import ClientGone
from .protocol import ApiError

__all__ = [
    "ErrorResponse",
    "install_error_handlers",
    "log_context",
    "loggable",
    "outcome",
    "public_error",
    "request_id",
]

logger = logging.getLogger("pagedcore.serve")

_OUTCOMES = {
    400: "invalid",
    401: "unauthorized",
    404: "invalid",
    408: "timed_out",
    413: "invalid",
    429: "overloaded",
    503: "unavailable",
}


def outcome(error: ApiError) -> str:
    """The ``pagedcore_requests_total`` status a request that ended with ``error`` is counted as.

    Example:
        >>> outcome(ApiError(413, "too large")), outcome(ApiError(500, "boom", type="server_error"))
        ('invalid', 'failed')
    """
    return _OUTCOMES.get(error.status, "failed")


def public_error(error: ApiError, request_id: str, context: str = "") -> ApiError:
    """``error`` as the client may see it: a server error (5xx other than 503) is logged with ``request_id`` (the
    server's own, unique) and ``context`` (what the client named it), and answered with a generic message naming
    that id; anything else is returned as it is.

    Example:
        >>> public_error(ApiError(500, "step failed: CUDA error at 0x7f..", type="server_error"), "req-1").message
        'the server failed on this request (request id req-1; the server log has the details)'
    """
    if error.status < 500 or error.status == 503:
        return error
    logger.error("pagedcore: request %s%s failed: %s", request_id, context, loggable(error.message))
    message = f"the server failed on this request (request id {request_id}; the server log has the details)"
    return ApiError(error.status, message, type=error.type, code=error.code)


def loggable(text: str) -> str:
    """``text`` with every control, format or line-separator character escaped: a client's words in a log line can
    neither start a forged line nor move the terminal's cursor.

    Example:
        >>> loggable("ok" + chr(10) + "FORGED" + chr(27) + "[2K")
        'ok\\\\nFORGED\\\\x1b[2K'
    """
    return "".join(
        ascii(char)[1:-1] if unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp") else char for char in text
    )


def log_context(request: Request) -> str:
    """What the log line of a request's error adds to its server id: the answer's id and the client's own
    ``request_id`` (escaped), when it has them.

    Example:
        >>> request = Request({"type": "http", "method": "GET", "headers": []})
        >>> request.state.response_id, request.state.client_request_id = "cmpl-a" + chr(10), "a" + chr(10)
        >>> log_context(request)
        " (response cmpl-a\\\\n, client request_id 'a\\\\n')"
    """
    state = request.state
    parts = []
    response_id = getattr(state, "response_id", None)
    if response_id is not None:
        parts.append(f"response {loggable(str(response_id))}")
    client_id = getattr(state, "client_request_id", None)
    if client_id is not None:
        parts.append(f"client request_id '{loggable(str(client_id))}'")
    return f" ({', '.join(parts)})" if parts else ""


class ErrorResponse(JSONResponse):
    """OpenAI's error body for an :class:`ApiError`, as ASCII JSON (a client's lone surrogate in a message cannot
    break it); 408 and 413 close the connection, whose unread body is of no use; 429 and 503 say when to retry
    (``Retry-After``).

    Example:
        >>> response = ErrorResponse(ApiError(413, "too large"))
        >>> response.status_code, response.headers["connection"]
        (413, 'close')
        >>> ErrorResponse(ApiError(429, "queue full")).headers["retry-after"]
        '1'
    """

    def __init__(self, error: ApiError) -> None:
        headers = {"Connection": "close"} if error.status in (408, 413) else {}
        if error.status in RETRY_AFTER_SECONDS:
            headers["Retry-After"] = str(RETRY_AFTER_SECONDS[error.status])
        super().__init__(error.body(), status_code=error.status, headers=headers or None)

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` with OpenAI's error body and count it in ``app.state.serve.metrics``.

    Example:
        >>> app = FastAPI()
        >>> install_error_handlers(app)
        >>> ApiError in app.exception_handlers and ClientGone in app.exception_handlers
        True
    """
    app.add_exception_handler(ApiError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(ClientGone, _client_gone)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)


def _count(request: Request, status: str) -> None:
    request.app.state.serve.metrics.count(status)


def request_id(request: Request) -> str:
    """The server's own id of ``request`` in logs and server-error messages: unique (made at first use), never the
    client's ``request_id`` (which :func:`log_context` shows beside it).

    Example:
        >>> request = Request({"type": "http", "method": "GET", "headers": []})
        >>> request_id(request) == request_id(request) and request_id(request).startswith("req-")
        True
    """
    state = request.state
    if getattr(state, "request_id", None) is None:
        state.request_id = f"req-{uuid.uuid4().hex}"
    return str(state.request_id)


async def _api_error(request: Request, exc: ApiError) -> Response:
    _count(request, outcome(exc))
    public = request.app.state.serve.loop_errors_are_public
    return ErrorResponse(exc if public else public_error(exc, request_id(request), log_context(request)))


async def _client_gone(request: Request, exc: ClientGone) -> Response:
    _count(request, "disconnected")
    logger.info("pagedcore: %s %s: %s", request.method, loggable(request.url.path), exc)
    return Response(status_code=499)  # nobody reads it: the connection is gone


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:  # unknown path, method
    response = ErrorResponse(ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code)))
    response.headers.update(exc.headers or {})
    if exc.status_code == 405:  # Allow: every method the path takes (RFC 9110), not one route's
        response.headers["Allow"] = ", ".join(_allowed_methods(request))
    return response


def _allowed_methods(request: Request) -> list[str]:
    methods: set[str] = set()
    scope = {**request.scope, "method": "OPTIONS"}
    for route in _leaf_routes(request.app.router.routes):
        if route.matches(scope)[0] != Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


def _leaf_routes(routes: Any) -> Any:
    """The app's routes, the included routers' opened (the app includes them without a prefix)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        yield from _leaf_routes(inner.routes) if inner is not None else (route,)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:  # FastAPI's own checks
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(part) for part in first.get("loc", ()))
    return await _api_error(request, ApiError(400, f"{where}: {first.get('msg', 'invalid request')}"))


async def _unexpected(request: Request, exc: Exception) -> Response:  # a bug: still OpenAI's error shape
    _count(request, "failed")  # Starlette raises it again once answered: uvicorn logs its traceback
    error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
    return ErrorResponse(public_error(error, request_id(request), log_context(request)))
