"""``GET /v1/models`` and ``GET /v1/models/{id}``: the served model, and the LoRA adapters loaded (vLLM's cards: an
adapter's ``root`` is its folder, its ``parent`` the base model's name).

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
    """The served model, once per name it is served under, then each LoRA adapter loaded."""
    ctx.authorize(request)
    return JSONResponse({"object": "list", "data": ctx.model_cards()})


@router.get("/v1/models/{model_id:path}", responses=_ERRORS)
async def retrieve_model(model_id: str, request: Request, ctx: Context) -> Response:
    """The served model or a loaded adapter, or 404 for any other name."""
    ctx.authorize(request)
    ctx.check_model(model_id)
    return JSONResponse(ctx.model_card(model_id))
