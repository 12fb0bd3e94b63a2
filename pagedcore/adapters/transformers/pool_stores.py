"""The stores below a pool (``kv_store=``): made from the pool's settings, and closed again by the pool.

A store the pool makes from a location (a directory: :class:`~pagedcore.disk_store.DiskKVStore`, or a plugin's
scheme) is the pool's: it closes it with its tiers (:meth:`~.pool.PagedKVPool.close_tiers`), when the holder that
made the pool closes or fails to build after making it, so a failed build leaves no open directory behind. A store
object given as it is (``kv_store=MemoryKVStore(...)``) is its caller's, never closed here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from pagedcore.config import PoolConfig
from pagedcore.errors import ConfigError
from pagedcore.kv_store import KVStore, check_store
from pagedcore.plugin_manager import PluginManager

__all__ = ["close_stores", "make_stores"]

_log = logging.getLogger(__name__)


def make_stores(plugins: PluginManager, config: PoolConfig) -> tuple[list[KVStore], list[KVStore]]:
    """The stores ``config.kv_store`` names, fastest first, and those of them made here from a location (the
    pool's to close). ConfigError for a bad one, before the pool uses any: the ones made before it are closed.

    Example:
        >>> import tempfile
        >>> from pagedcore.kv_store import MemoryKVStore
        >>> from pagedcore.plugin_manager import default_plugin_manager
        >>> given = MemoryKVStore(1024)
        >>> config = PoolConfig(kv_store=[given, tempfile.mkdtemp()], kv_store_bytes=1024)
        >>> stores, made = make_stores(default_plugin_manager(), config)
        >>> [store.name for store in stores], [store.name for store in made]
        (['memory', 'disk'], ['disk'])
        >>> close_stores(made)
    """
    stores: list[KVStore] = []
    made: list[KVStore] = []
    try:
        for item in config.store_items:
            if isinstance(item, (str, os.PathLike)):
                assert config.kv_store_bytes is not None  # PoolConfig checked the pair
                made.append(plugins.kv_store(os.fspath(item), config.kv_store_bytes))
                stores.append(made[-1])
            else:
                stores.append(check_store(item, repr(item)))
        names = [store.name for store in stores]
        if len(set(names)) != len(names):
            raise ConfigError(f"kv_store: two stores share a name ({', '.join(names)}); each tier needs its own")
    except BaseException:
        close_stores(made)
        raise
    return stores, made


def close_stores(stores: Sequence[KVStore]) -> None:
    """Close each store that has a ``close()`` (the disk store's closes its directory); one that raises is logged,
    the others are closed all the same.

    Example:
        >>> import tempfile
        >>> from pagedcore.disk_store import DiskKVStore
        >>> from pagedcore.kv_store import MemoryKVStore
        >>> disk = DiskKVStore(tempfile.mkdtemp(), max_bytes=1024)
        >>> close_stores([MemoryKVStore(1024), disk]), disk.closed    # a store without close() is left as it is
        (None, True)
    """
    for store in stores:
        close = getattr(store, "close", None)
        if not callable(close):
            continue
        try:
            close()
        except Exception:
            _log.exception("pagedcore: closing the KV store %r failed", store)
