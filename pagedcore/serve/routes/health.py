"""``/health`` (GET and HEAD: 200 while the engine loop runs and the server admits requests, else 503), ``/ping``
(the same, vLLM's and SageMaker's name), ``/version`` and ``/metrics`` (Prometheus text); no API key.

Example:
    >>> sorted({route.path for route in router.routes})
    ['/health', '/metrics', '/ping', '/version']
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pagedcore import __version__

from ..context import Context
from ..metrics import CONTENT_TYPE

__all__ = ["router"]

router = APIRouter()

_UNHEALTHY: dict[int | str, dict[str, Any]] = {
    503: {"description": "the engine loop is not running, or the server is shutting down"}
}


@router.get("/health", responses=_UNHEALTHY)
@router.head("/health", responses=_UNHEALTHY)
async def health(ctx: Context) -> Response:
    """200 ``{"status": "ok"}`` while the loop runs and requests are admitted, else 503 (``stopped`` or
    ``draining``: load balancers stop sending)."""
    if not ctx.loop.is_running:
        return JSONResponse({"status": "stopped"}, status_code=503)
    if not ctx.admission.is_open:
        return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "5"})
    return JSONResponse({"status": "ok"})


@router.get("/ping", responses=_UNHEALTHY)
@router.post("/ping", responses=_UNHEALTHY)
async def ping(ctx: Context) -> Response:
    """As ``/health`` (vLLM's ``/ping``)."""
    return await health(ctx)


@router.get("/version")
async def version() -> Response:
    """``{"version": ...}``: pagedcore's version."""
    return JSONResponse({"version": __version__})


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(ctx: Context) -> Response:
    """The Prometheus text exposition of the app's metrics."""
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)
