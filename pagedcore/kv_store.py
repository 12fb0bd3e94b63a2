"""Stores below the pool: the protocol a tier implements, and the in-process memory store.

A :class:`KVStore` keeps opaque byte strings by key, within a byte budget, forgetting its least recently used
entries first. It knows nothing of blocks, models or namespaces: :mod:`pagedcore.kv_tiers` owns the keys (namespace,
token chain, model fingerprint), frames each block with a checksum (:mod:`pagedcore.kv_frame`) and decides what is
written and loaded. A store only has to be honest about bytes: ``get`` returns what one ``put`` stored, or None.

A third-party tier (Redis, S3, a Ray object store) is one file: a class with the methods below and a plugin
implementing the ``pagedcore_kv_store`` hook (see :mod:`pagedcore.hookspecs`) that answers for its scheme::

    from pagedcore import hookimpl

    class RedisStore:
        name = "redis"
        def __init__(self, url, max_bytes): ...
        def put(self, key, data): ...          # -> bool: stored
        def get(self, key): ...                # -> bytes | None
        def contains(self, key): ...
        def delete(self, key): ...
        def stats(self): ...                   # -> dict[str, int]; "bytes" at least

    @hookimpl
    def pagedcore_kv_store(location, max_bytes):
        return RedisStore(location, max_bytes) if location.startswith("redis://") else None

Stores are called from two threads: the writer thread (``put``) and the thread that loads blocks (``get``,
``contains``, ``delete``); they must be thread-safe. A store may also have a ``close()`` (a connection, an open
folder): a pool calls it on the stores it made from a location when the holder that made the pool closes, or fails to
build after making it (:mod:`pagedcore.adapters.transformers.pool_stores`); a store object passed in is never closed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Protocol, runtime_checkable

from pagedcore.errors import ConfigError

__all__ = ["KVStore", "MemoryKVStore", "check_store"]


@runtime_checkable
class KVStore(Protocol):
    """Bytes by key within a byte budget, least recently used first out. Thread-safe.

    Example:
        >>> isinstance(MemoryKVStore(1024), KVStore)
        True
    """

    name: str

    def put(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key`` (replacing nothing if present). False when it was not stored (too large,
        no room, disk full); never raises for such faults."""

    def get(self, key: str) -> bytes | None:
        """What was stored under ``key`` (and mark it recently used), or None."""

    def contains(self, key: str) -> bool:
        """Whether ``key`` is stored (no side effects)."""

    def delete(self, key: str) -> None:
        """Forget ``key`` (a no-op when absent)."""

    def stats(self) -> dict[str, int]:
        """Counters and gauges; ``"bytes"`` (held now) and ``"max_bytes"`` at least."""


class MemoryKVStore:
    """An in-process store: a dict in LRU order within ``max_bytes``. The host-memory tier of a CPU machine (where
    it only saves recomputation, not a copy), tests, and the shortest example of a tier.

    Example:
        >>> store = MemoryKVStore(max_bytes=8)
        >>> store.put("a", b"1234"), store.put("b", b"5678"), store.get("a")
        (True, True, b'1234')
        >>> store.put("c", b"9999"), store.contains("b"), store.contains("a")   # b was least recently used
        (True, False, True)
        >>> store.put("huge", b"x" * 9), store.stats()["bytes"]
        (False, 8)
    """

    name = "memory"

    def __init__(self, max_bytes: int) -> None:
        if type(max_bytes) is not int or max_bytes < 0:
            raise ConfigError(f"kv_store_bytes must be a non-negative number of bytes, got {max_bytes!r}")
        self._max = max_bytes
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._evicted = 0
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes) -> bool:
        size = len(data)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return True
            if size > self._max:
                return False
            while self._bytes + size > self._max:
                _, old = self._items.popitem(last=False)
                self._bytes -= len(old)
                self._evicted += 1
            self._items[key] = bytes(data)
            self._bytes += size
            return True

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._items.get(key)
            if data is not None:
                self._items.move_to_end(key)
            return data

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def delete(self, key: str) -> None:
        with self._lock:
            data = self._items.pop(key, None)
            if data is not None:
                self._bytes -= len(data)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"bytes": self._bytes, "max_bytes": self._max, "entries": len(self._items), "evicted": self._evicted}

    def __repr__(self) -> str:
        return f"MemoryKVStore(bytes={self._bytes}, max_bytes={self._max})"


def check_store(store: object, location: str) -> KVStore:
    """``store`` as a :class:`KVStore`, or :class:`~pagedcore.errors.ConfigError` naming what it lacks.

    Example:
        >>> check_store(object(), "x://")
        Traceback (most recent call last):
        ...
        pagedcore.errors.ConfigError: the KV store for 'x://' (object) lacks name, put, get, contains, delete, stats
    """
    missing = [m for m in ("name", "put", "get", "contains", "delete", "stats") if not hasattr(store, m)]
    if missing:
        raise ConfigError(f"the KV store for {location!r} ({type(store).__name__}) lacks {', '.join(missing)}")
    assert isinstance(store, KVStore)
    return store
