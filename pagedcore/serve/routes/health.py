"""``GET /health`` (200 while the engine loop runs, else 503) and ``GET /metrics`` (Prometheus text); no API key.

Example:
    >>> sorted(route.path for route in router.routes)
    ['/health', '/metrics']
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ..context import Context
from ..metrics import CONTENT_TYPE

__all__ = ["router"]

router = APIRouter()


@router.get("/health", responses={503: {"description": "the engine loop is not running"}})
async def health(ctx: Context) -> Response:
    """200 ``{"status": "ok"}`` while the loop runs, else 503 ``{"status": "stopped"}``."""
    if not ctx.loop.is_running:
        return JSONResponse({"status": "stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(ctx: Context) -> Response:
    """The Prometheus text exposition of the app's metrics."""
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)
