"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's bodies and answers): LoRA adapters
loaded and unloaded while the server runs.

As vLLM, they are served only when the operator allows it (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``, for a server
started with ``--enable-lora``): a load reads a folder on the server's disk (safetensors only: no pickle is ever
loaded). With API keys they need one, and act for every tenant (adapter names are the server's; each tenant's
prefixes stay its own).

- load ``{"lora_name": ..., "lora_path": ..., "load_inplace": false}``: the adapter is read and checked off the
  event loop (:meth:`LoraAdapters.load <pagedcore.adapters.transformers.lora.LoraAdapters.load>`); answers 200 with
  vLLM's text ``Success: LoRA adapter 'NAME' added successfully.``; a name already loaded is a 400 unless
  ``load_inplace`` (a new version: requests already running finish on the old one), a folder without an adapter a
  404, one that cannot be served (rank over ``--max-lora-rank``, DoRA, embeddings, another base model's) a 400 saying
  why;
- unload ``{"lora_name": ...}``: 200 ``Success: LoRA adapter 'NAME' removed successfully.``, 404 for a name not
  loaded; requests using it finish with it first. vLLM's ``lora_int_id`` is refused: adapters have no integer ids
  here.

Example:
    >>> sorted(route.path for route in router.routes)
    ['/v1/load_lora_adapter', '/v1/unload_lora_adapter']
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from pagedcore.errors import AdapterError, AdapterNotFoundError

from ..body import read_body
from ..context import Context
from ..lora_bodies import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from ..openapi import ERROR_RESPONSES, json_body
from ..pipeline import off_loop
from ..protocol import ApiError, parse_body

__all__ = ["router"]

router = APIRouter()
_ERRORS: dict[int | str, dict[str, Any]] = {status: ERROR_RESPONSES[status] for status in (400, 401, 404)}


@router.post("/v1/load_lora_adapter", responses=_ERRORS, openapi_extra=json_body(LoadLoRAAdapterRequest))
async def load_lora_adapter(request: Request, ctx: Context) -> Response:
    """Load an adapter (see the module docstring)."""
    ctx.authorize(request)
    body = parse_body(LoadLoRAAdapterRequest, await read_body(request, ctx.limits, ctx.admission))
    if not body.lora_name.strip() or not body.lora_path.strip():
        raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
    if body.lora_name in ctx.model_names:
        raise ApiError(400, f"{body.lora_name!r} is the served model's name", param="lora_name")
    try:
        await off_loop(ctx.adapters.load, body.lora_name, body.lora_path, replace=body.load_inplace)
    except AdapterError as exc:
        raise _error(exc) from exc
    request.app.openapi_schema = None  # the document names the models served: built again when asked
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", responses=_ERRORS, openapi_extra=json_body(UnloadLoRAAdapterRequest))
async def unload_lora_adapter(request: Request, ctx: Context) -> Response:
    """Unload an adapter (see the module docstring)."""
    ctx.authorize(request)
    body = parse_body(UnloadLoRAAdapterRequest, await read_body(request, ctx.limits, ctx.admission))
    if body.lora_int_id is not None:
        raise ApiError(400, "lora_int_id: adapters are named by lora_name here (no integer ids)", param="lora_int_id")
    try:
        ctx.adapters.unload(body.lora_name)
    except AdapterError as exc:
        raise _error(exc) from exc
    request.app.openapi_schema = None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _error(exc: AdapterError) -> ApiError:
    """vLLM's statuses: 404 for an adapter that is not there, 400 for one that cannot be served."""
    status = 404 if isinstance(exc, AdapterNotFoundError) else 400
    param = exc.param if exc.param in ("lora_name", "lora_path") else None
    return ApiError(status, str(exc), param=param, code="lora_not_found" if status == 404 else None)
