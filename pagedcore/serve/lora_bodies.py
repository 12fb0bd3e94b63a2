"""The bodies of ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's fields; any other field is
a 400 naming it), served by :mod:`pagedcore.serve.routes.lora`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["LoadLoRAAdapterRequest", "UnloadLoRAAdapterRequest"]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's load body.

    Example:
        >>> LoadLoRAAdapterRequest(lora_name="sql", lora_path="/adapters/sql").load_inplace
        False
    """

    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's unload body.

    Example:
        >>> UnloadLoRAAdapterRequest(lora_name="sql").lora_int_id is None
        True
    """

    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str
    lora_int_id: int | None = None
