"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one served model.

Example:
    >>> sorted(route.path for route in router.routes)
    ['/v1/models', '/v1/models/{model_id:path}']
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..context import Context
from ..openapi import ERROR_RESPONSES

__all__ = ["router"]

router = APIRouter()
_ERRORS: dict[int | str, dict[str, Any]] = {status: ERROR_RESPONSES[status] for status in (401, 404)}


@router.get("/v1/models", responses=_ERRORS)
async def list_models(request: Request, ctx: Context) -> Response:
    """The served model, as a list."""
    ctx.authorize(request)
    return JSONResponse({"object": "list", "data": [ctx.model_card()]})


@router.get("/v1/models/{model_id:path}", responses=_ERRORS)
async def retrieve_model(model_id: str, request: Request, ctx: Context) -> Response:
    """The served model, or 404 for any other name."""
    ctx.authorize(request)
    ctx.check_model(model_id)
    return JSONResponse(ctx.model_card())
