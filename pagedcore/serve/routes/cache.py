"""``POST /reset_prefix_cache`` (vLLM's): forget every cached prefix now, e.g. after a weight update the weights
watch cannot see (RL loops call it after each update; writes the watch sees reset the cache by themselves). A
request that follows computes its prompt again; requests running keep their blocks, which are never cached
afterwards. It needs the API key when the server has keys; it resets every tenant's prefixes (one pool).

The tiers below the pool (``--kv-store``) are keyed by the weights' content: after a weight update they miss by
themselves, and what they hold for unchanged weights stays valid (delete the directory to empty it).

Example:
    >>> sorted(route.path for route in router.routes)
    ['/reset_prefix_cache']
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..context import Context
from ..openapi import ERROR_RESPONSES
from ..pipeline import off_loop
from ..protocol import ApiError

__all__ = ["router"]

router = APIRouter()
_ERRORS: dict[int | str, dict[str, Any]] = {
    401: ERROR_RESPONSES[401],
    501: {"description": "this server's request loop cannot reset its engines' caches"},
}


@router.post("/reset_prefix_cache", responses=_ERRORS)
async def reset_prefix_cache(request: Request, ctx: Context) -> Response:
    """``{"status": "ok", "forgotten_blocks": N}``: the cached blocks forgotten (summed over KV groups)."""
    ctx.authorize(request)
    reset = getattr(ctx.loop, "reset_prefix_cache", None)
    if not callable(reset):
        raise ApiError(501, "this server's request loop cannot reset its engines' prefix caches", type="server_error")
    forgotten = await off_loop(reset)
    return JSONResponse({"status": "ok", "forgotten_blocks": int(forgotten)})
