"""Built-in attention backend: xformers paged attention on CUDA (fp16/bf16). Work in progress in this commit."""

from __future__ import annotations

from typing import Any

from pagedcore.hookspecs import hookimpl


@hookimpl(trylast=True)
def pagedcore_attention_backend(device_type: str, dtype: Any, name: str | None) -> Any:
    """Declines for now: the xformers backend lands in a later commit."""
    return None
