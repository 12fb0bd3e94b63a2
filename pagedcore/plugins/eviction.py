"""Built-in eviction policy plugin: LRU (``name="lru"`` or the default)."""

from __future__ import annotations

from pagedcore.eviction import EvictionPolicy, LRUEvictionPolicy
from pagedcore.hookspecs import hookimpl


@hookimpl(trylast=True)
def pagedcore_eviction_policy(name: str | None) -> EvictionPolicy | None:
    """LRU when asked for it by name, or when no other plugin answered first."""
    if name in (None, "lru"):
        return LRUEvictionPolicy()
    return None
