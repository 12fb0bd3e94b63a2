"""Built-in KV stores below the pool: ``"memory://"`` (in-process) and a directory (:mod:`pagedcore.disk_store`)."""

from __future__ import annotations

from pagedcore.disk_store import DiskKVStore
from pagedcore.errors import ConfigError
from pagedcore.hookspecs import hookimpl
from pagedcore.kv_store import KVStore, MemoryKVStore


@hookimpl(trylast=True)
def pagedcore_kv_store(location: str, max_bytes: int) -> KVStore | None:
    """``"memory://"``: a :class:`~pagedcore.kv_store.MemoryKVStore`; a path or ``file://`` path: a directory."""
    if location == "memory://":
        return MemoryKVStore(max_bytes)
    if "://" in location and not location.startswith("file://"):
        return None  # another plugin's scheme
    directory = location.removeprefix("file://")
    if not directory:  # not the current directory by accident
        raise ConfigError(
            f"kv_store={location!r} names no directory: give its path (the current one as '.')", param="kv_store"
        )
    return DiskKVStore(directory, max_bytes)
