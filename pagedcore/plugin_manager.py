"""The plugin manager: pluggy over the ``pagedcore`` hooks, entry points loaded lazily.

Built-in plugins (``pagedcore.plugins.*``) are registered through the same ``pagedcore`` entry-point group a third
party uses. Entry points load on first use, sorted by name so the order is the same on every machine (the torch
backend, the fallback that serves any device, last), then
``check_pending()`` makes a misspelled hook fail loudly. Events go through :meth:`PluginManager.emit`, which
isolates observers: one that raises is logged and counted, and never reaches the pool or the caller.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

from pagedcore import hookspecs
from pagedcore.errors import PluginError

if TYPE_CHECKING:
    from pagedcore.attention import AttentionBackend
    from pagedcore.eviction import EvictionPolicy
    from pagedcore.prefix_trie import BlockHasher

logger = logging.getLogger(__name__)

__all__ = ["ENTRY_POINT_GROUP", "PluginInfo", "PluginManager", "default_plugin_manager"]

ENTRY_POINT_GROUP = "pagedcore"
_FALLBACKS = frozenset({"torch"})  # built-in plugins that must answer selection hooks last


@dataclass(frozen=True)
class PluginInfo:
    """A registered plugin: its name, where it came from and the hooks it implements.

    Example:
        >>> [info.name for info in default_plugin_manager().plugins() if "pagedcore_eviction_policy" in info.hooks]
        ['lru']
    """

    name: str
    source: str
    hooks: tuple[str, ...]


class PluginManager:
    """Hooks for backends, eviction policies, block hashing and observers.

    Args:
        load_entrypoints: load the ``pagedcore`` entry points on first use (built-ins included).

    Example:
        >>> from pagedcore import hookimpl
        >>> class Counter:
        ...     finished = 0
        ...     @hookimpl
        ...     def pagedcore_request_finished(self, request_id):
        ...         Counter.finished += 1
        >>> pm = PluginManager(load_entrypoints=False)
        >>> _ = pm.register(Counter(), name="counter")
        >>> pm.emit("pagedcore_request_finished", request_id="r1", finish_reason="stop", num_output_tokens=3)
        >>> Counter.finished
        1
    """

    def __init__(self, *, load_entrypoints: bool = True) -> None:
        self._pm = pluggy.PluginManager("pagedcore")
        self._pm.add_hookspecs(hookspecs)
        self._load_entrypoints = load_entrypoints
        self._loaded = False
        self._lock = threading.Lock()
        self._sources: dict[str, str] = {}
        self.num_observer_errors = 0

    # ------------------------------------------------------------------ registration
    def register(self, plugin: object, name: str | None = None) -> str:
        """Register a plugin object or module; returns its name. Unknown hook names raise :class:`PluginError`."""
        self._ensure_loaded()
        try:
            registered = self._pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {name or plugin!r} is invalid: {exc}") from exc
        except ValueError as exc:  # name already taken
            raise PluginError(str(exc)) from exc
        if registered is None:
            raise PluginError(f"plugin {name or plugin!r} is blocked or already registered")
        self._check(registered)
        self._sources.setdefault(registered, "registered")
        return registered

    def unregister(self, plugin: object | None = None, name: str | None = None) -> None:
        """Remove a plugin (by object or by name)."""
        removed = self._pm.unregister(plugin=plugin, name=name)
        if removed is not None:
            self._sources.pop(self._pm.get_name(removed) or name or "", None)

    @contextmanager
    def plugin(self, plugin: object, name: str | None = None) -> Iterator[str]:
        """Register ``plugin`` for the duration of a ``with`` block (handy in tests)."""
        registered = self.register(plugin, name=name)
        try:
            yield registered
        finally:
            self.unregister(name=registered)

    def plugins(self) -> list[PluginInfo]:
        """Every registered plugin with the hooks it implements, sorted by name."""
        self._ensure_loaded()
        infos = []
        for name, plugin in self._pm.list_name_plugin():
            hooks = tuple(sorted(h.name for h in self._pm.get_hookcallers(plugin) or ()))
            infos.append(PluginInfo(name, self._sources.get(name, "registered"), hooks))
        return sorted(infos, key=lambda info: info.name)

    @property
    def hook(self) -> Any:
        """pluggy's hook relay (entry points loaded first)."""
        self._ensure_loaded()
        return self._pm.hook

    # ------------------------------------------------------------------ selection hooks
    def attention_backend(self, device_type: str, dtype: Any = None, name: str | None = None) -> AttentionBackend:
        """The attention backend for a device and dtype; raises :class:`PluginError` when no plugin offers one."""
        backend = self.hook.pagedcore_attention_backend(device_type=device_type, dtype=dtype, name=name)
        if backend is None:
            wanted = f"backend {name!r}" if name else "any attention backend"
            available = [info.name for info in self.plugins() if "pagedcore_attention_backend" in info.hooks]
            raise PluginError(
                f"no plugin offers {wanted} for device {device_type!r} and dtype {dtype}; "
                f"plugins with backends: {available or 'none'}"
            )
        return backend

    def eviction_policy(self, name: str | None = None, num_blocks: int = 0) -> EvictionPolicy:
        """A new eviction policy; raises :class:`PluginError` when no plugin offers ``name``."""
        policy = self.hook.pagedcore_eviction_policy(name=name, num_blocks=num_blocks)
        if policy is None:
            raise PluginError(f"no plugin offers the eviction policy {name!r}")
        if len(policy) != 0:
            raise PluginError(f"the eviction policy {name!r} returned by a plugin is not empty")
        return policy

    def block_hasher(self) -> BlockHasher | None:
        """A plugin's block hash function, or None for the default."""
        return self.hook.pagedcore_block_hasher()

    # ------------------------------------------------------------------ events
    def emit(self, hook_name: str, **kwargs: Any) -> None:
        """Call every observer of an event hook. An observer that raises is logged and counted, never propagated."""
        caller = getattr(self.hook, hook_name)
        for impl in reversed(caller.get_hookimpls()):
            try:
                impl.function(*[kwargs[arg] for arg in impl.argnames])
            except Exception:
                self.num_observer_errors += 1
                logger.exception("pagedcore: plugin %r failed in %s; ignored", impl.plugin_name, hook_name)

    # ------------------------------------------------------------------ internals
    def _ensure_loaded(self) -> None:
        if self._loaded or not self._load_entrypoints:
            return
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            # pluggy asks trylast implementations in registration order, so the universal fallbacks register
            # last: every other backend (built-in or installed) is asked before the torch backend.
            points = sorted(
                importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
                key=lambda ep: (ep.name in _FALLBACKS, ep.name),
            )
            for point in points:
                if self._pm.get_plugin(point.name) is not None or self._pm.is_blocked(point.name):
                    continue
                try:
                    plugin = point.load()
                except Exception as exc:
                    raise PluginError(
                        f"the pagedcore plugin {point.name!r} ({point.value}) failed to import: {exc}"
                    ) from exc
                self._pm.register(plugin, name=point.name)
                dist = getattr(point, "dist", None)
                self._sources[point.name] = f"entry point {point.value}" + (f" ({dist.name})" if dist else "")
            self._check(None)

    def _check(self, name: str | None) -> None:
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            if name is not None:
                self._pm.unregister(name=name)
            raise PluginError(f"plugin validation failed: {exc}") from exc


_default: PluginManager | None = None
_default_lock = threading.Lock()


def default_plugin_manager() -> PluginManager:
    """The process-wide manager with every installed plugin (created on first use).

    Example:
        >>> default_plugin_manager() is default_plugin_manager()
        True
    """
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = PluginManager()
    return _default
