"""The plugin manager: pluggy over the ``pagedcore`` hooks; built-ins registered by the host, third parties found
through entry points, both lazily.

As in pluggy's own example host (eggsample), the host registers its built-in plugins itself
(:data:`BUILTIN_PLUGINS`: the LRU policy, the logging observer, the xformers and torch backends) and entry points
add third-party ones. Everything loads on first use, not at import: the built-in backends import torch, and the core
must not. Entry points load first, sorted by name so the order is the same on every machine, then the built-ins,
the torch backend (the fallback that serves any device) last. Selection hooks go through :meth:`PluginManager.select`:
every installed plugin is asked before any built-in, two installed plugins answering one call are refused, and an
implementation that raises is a :class:`PluginError` naming it. A built-in whose optional dependency is not
installed (torch, xformers) is not registered. Each plugin is checked with ``check_pending()`` so a misspelled hook
fails loudly; one that fails to load is skipped, logged and listed in ``load_errors``: one broken install must not
take the others down with it. Events go through :meth:`PluginManager.emit`, which isolates observers: one that
raises is logged and counted, and never reaches the pool or the caller. A thread that holds events
(:meth:`~PluginManager.hold_events`: the Engine, while it holds its lock) has them queued and delivered, in order,
when its outermost hold ends, so a slow observer never runs under that lock.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

from pagedcore import hookspecs
from pagedcore.errors import ConfigError, PagedCoreError, PluginError
from pagedcore.eviction import EvictionPolicy
from pagedcore.kv_store import KVStore, check_store
from pagedcore.validation import integer

if TYPE_CHECKING:
    from pagedcore.attention import AttentionBackend

logger = logging.getLogger(__name__)

__all__ = [
    "BUILTIN_PLUGINS",
    "BUILTIN_SOURCE",
    "ENTRY_POINT_GROUP",
    "BuiltinPlugin",
    "PluginInfo",
    "PluginLoadError",
    "PluginManager",
    "default_plugin_manager",
]

ENTRY_POINT_GROUP = "pagedcore"
BUILTIN_SOURCE = "built-in"


@dataclass(frozen=True)
class BuiltinPlugin:
    """A plugin the host registers itself.

    Attributes:
        name: its plugin name (reserved: an entry point cannot take it).
        module: the module that implements its hooks, imported on first use.
        requires: top-level modules it needs; when one is not installed the plugin is not registered.

    Example:
        >>> [(p.name, p.requires) for p in BUILTIN_PLUGINS][-1]
        ('torch', ('torch',))
    """

    name: str
    module: str
    requires: tuple[str, ...] = ()

    def is_installable(self) -> bool:
        """Whether every required module is installed (found without importing it)."""
        return all(_is_installed(module) for module in self.requires)


def _is_installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules without a spec (set up by hand): present
        return True


# In registration order. pluggy asks trylast implementations in the order they were registered, so the torch
# backend, which answers for any device, comes last: every other backend is asked before it.
BUILTIN_PLUGINS: tuple[BuiltinPlugin, ...] = (
    BuiltinPlugin("lru", "pagedcore.plugins.eviction"),
    BuiltinPlugin("kv-store", "pagedcore.plugins.kv_store"),
    BuiltinPlugin("logging", "pagedcore.plugins.logging_observer"),
    BuiltinPlugin("xformers", "pagedcore.plugins.xformers_backend", ("torch", "xformers")),
    BuiltinPlugin("torch", "pagedcore.plugins.torch_backend", ("torch",)),
)


@dataclass(frozen=True)
class PluginLoadError:
    """A plugin (entry point or built-in) that could not be loaded: it is skipped; the others load.

    Example:
        >>> PluginLoadError("broken", "entry point broken_plugin (broken-dist)", "ImportError: missing").name
        'broken'
    """

    name: str
    source: str
    reason: str


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
    """Hooks for attention backends, eviction policies and observers.

    Args:
        load_entrypoints: load third-party plugins from the ``pagedcore`` entry points on first use.
        builtins: register the built-in plugins (:data:`BUILTIN_PLUGINS`) on first use.

    Example:
        >>> from pagedcore import hookimpl
        >>> class Counter:
        ...     finished = 0
        ...     @hookimpl
        ...     def pagedcore_request_finished(self, request_id):
        ...         Counter.finished += 1
        >>> pm = PluginManager(load_entrypoints=False)   # the built-ins only, plus what is registered
        >>> _ = pm.register(Counter(), name="counter")
        >>> pm.emit("pagedcore_request_finished", request_id="r1", finish_reason="stop", num_output_tokens=3)
        >>> Counter.finished
        1
    """

    def __init__(self, *, load_entrypoints: bool = True, builtins: bool = True) -> None:
        self._pm = pluggy.PluginManager("pagedcore")
        self._pm.add_hookspecs(hookspecs)
        self._load_entrypoints = load_entrypoints
        self._builtins = builtins
        self._loaded = False
        self._lock = threading.Lock()
        self._sources: dict[str, str] = {}
        self.num_observer_errors = 0
        self.load_errors: list[PluginLoadError] = []
        self._holds = threading.local()  # per thread: how many holds deep (depth), whether it queued events (queued)
        self._held: deque[tuple[str, dict[str, Any]]] = deque()  # events emitted under a hold, not yet delivered
        self._delivering = threading.Lock()  # one thread delivers the queue at a time, in order

    # ------------------------------------------------------------------ registration
    def register(self, plugin: object, name: str | None = None) -> str:
        """Register a plugin object or module; returns its name.

        An unknown hook name, a wrong argument name or a wrapper on an event hook raises :class:`PluginError` and
        registers nothing.
        """
        self._ensure_loaded()
        registered = self._register(plugin, name)
        self._sources.setdefault(registered, "registered")
        return registered

    def unregister(self, plugin: object | None = None, name: str | None = None) -> None:
        """Remove a plugin (by object or by name); raises :class:`PluginError` if it is not registered."""
        self._ensure_loaded()
        if name is None and plugin is not None:
            name = self._pm.get_name(plugin)
        if name is None or self._pm.get_plugin(name) is None:
            raise PluginError(f"plugin {name or plugin!r} is not registered")
        self._pm.unregister(name=name)
        self._sources.pop(name, None)

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
        """pluggy's hook relay (plugins loaded first)."""
        self._ensure_loaded()
        return self._pm.hook

    # ------------------------------------------------------------------ selection hooks
    def attention_backend(self, device_type: str, dtype: Any = None, name: str | None = None) -> AttentionBackend:
        """The attention backend for a device and dtype; raises :class:`PluginError` when no plugin offers one."""
        plugin, backend = self.select("pagedcore_attention_backend", device_type=device_type, dtype=dtype, name=name)
        if backend is None:
            wanted = f"backend {name!r}" if name else "any attention backend"
            available = [info.name for info in self.plugins() if "pagedcore_attention_backend" in info.hooks]
            raise PluginError(
                f"no plugin offers {wanted} for device {device_type!r} and dtype {dtype}; "
                f"plugins with backends: {available or 'none'}"
            )
        if not callable(getattr(backend, "forward", None)) or not isinstance(getattr(backend, "name", None), str):
            raise PluginError(
                f"plugin {plugin!r} returned {backend!r} as attention backend: it needs a name and forward()"
            )
        return backend

    def eviction_policy(self, name: str | None = None, num_blocks: int = 0) -> EvictionPolicy:
        """A new eviction policy; raises :class:`PluginError` when no plugin offers ``name``, and
        :class:`~pagedcore.errors.ConfigError` naming ``num_blocks`` (no plugin asked) unless it is an integer >= 0."""
        num_blocks = integer(
            "eviction_policy: num_blocks", num_blocks, minimum=0, error=ConfigError, param="num_blocks"
        )
        plugin, policy = self.select("pagedcore_eviction_policy", name=name, num_blocks=num_blocks)
        if policy is None:
            raise PluginError(f"no plugin offers the eviction policy {name!r}")
        if not isinstance(policy, EvictionPolicy):
            raise PluginError(
                f"plugin {plugin!r} returned {policy!r} as eviction policy {name!r}: not an EvictionPolicy"
            )
        if len(policy) != 0:
            raise PluginError(f"the eviction policy {name!r} returned by plugin {plugin!r} is not empty")
        return policy

    def kv_store(self, location: str, max_bytes: int) -> KVStore:
        """The store for ``location`` (a directory, ``"memory://"``, or a plugin's scheme); raises
        :class:`PluginError` when no plugin answers and ConfigError for an unusable one.

        Example:
            >>> default_plugin_manager().kv_store("memory://", 1024).name
            'memory'
        """
        plugin, store = self.select("pagedcore_kv_store", location=location, max_bytes=max_bytes)
        if store is None:
            raise PluginError(f"no plugin offers a KV store for {location!r}")
        try:
            return check_store(store, location)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (returned by plugin {plugin!r})") from exc

    def select(self, hook_name: str, **kwargs: Any) -> tuple[str | None, Any]:
        """Ask a selection hook: ``(plugin name, answer)``, or ``(None, None)`` when no plugin answers.

        Every installed plugin is asked; two that answer the same call are refused (:class:`PluginError` naming
        both: which one would win would depend on the order they were loaded). Only when none answers are the
        built-ins asked, in their order, the first answer winning. An implementation that raises is a
        :class:`PluginError` naming its plugin and the hook (a :class:`~pagedcore.errors.PagedCoreError` it raises,
        such as a store's ConfigError for an unusable location, goes through as it is).
        """
        caller = self._caller(hook_name, selection=True)
        impls = list(reversed(caller.get_hookimpls()))  # pluggy's call order
        installed = [impl for impl in impls if self._sources.get(impl.plugin_name) != BUILTIN_SOURCE]
        answers = []
        for impl in installed:
            answer = _ask(impl, hook_name, kwargs)
            if answer is not None:
                answers.append((impl.plugin_name, answer))
        if len(answers) > 1:
            names = " and ".join(repr(name) for name, _ in answers)
            raise PluginError(
                f"plugins {names} both answer {hook_name}({_arguments(kwargs)}): unregister one, or ask for a "
                "backend or policy by a name only one of them answers"
            )
        if answers:
            return answers[0]
        for impl in impls:
            if impl not in installed:
                answer = _ask(impl, hook_name, kwargs)
                if answer is not None:
                    return impl.plugin_name, answer
        return None, None

    # ------------------------------------------------------------------ events
    def emit(self, hook_name: str, **kwargs: Any) -> None:
        """Call every observer of an event hook (queued instead while this thread holds events: :meth:`hold_events`).
        An observer that raises is logged and counted, never propagated.

        Every argument of the hook's spec must be given (a missing one is the caller's bug: ``TypeError``).
        """
        caller = self._caller(hook_name, selection=False)
        missing = [arg for arg in caller.spec.argnames if arg not in kwargs] if caller.spec is not None else []
        if missing:
            raise TypeError(f"emit({hook_name!r}) is missing arguments {missing}")
        if getattr(self._holds, "depth", 0):
            self._holds.queued = True
            self._held.append((hook_name, kwargs))
        else:
            self._deliver(hook_name, kwargs)

    def hold_events(self) -> None:
        """Queue this thread's events until its matching :meth:`release_events` (holds nest), e.g. while it holds a
        lock that other threads wait for: observers then run after the lock is released, in the order emitted."""
        self._holds.depth = getattr(self._holds, "depth", 0) + 1

    def release_events(self) -> None:
        """End this thread's innermost hold. At its outermost, a thread that queued events delivers the queue, every
        thread's held events in the order emitted; one that queued none (or finds another thread delivering, which
        then delivers its events too) returns at once."""
        holds = self._holds
        holds.depth -= 1
        if holds.depth or not getattr(holds, "queued", False):
            return
        holds.queued = False
        while self._held and self._delivering.acquire(blocking=False):
            try:
                while self._held:
                    self._deliver(*self._held.popleft())
            finally:
                self._delivering.release()

    def _deliver(self, hook_name: str, kwargs: dict[str, Any]) -> None:
        caller = getattr(self.hook, hook_name)
        for impl in reversed(caller.get_hookimpls()):
            try:
                impl.function(*[kwargs[arg] for arg in impl.argnames])
            except Exception:
                self.num_observer_errors += 1
                logger.exception("pagedcore: plugin %r failed in %s; ignored", impl.plugin_name, hook_name)

    # ------------------------------------------------------------------ internals
    def _caller(self, hook_name: str, *, selection: bool) -> Any:
        """The hook caller of a selection hook or of an event; PluginError for any other name."""
        caller = getattr(self.hook, hook_name, None) if hook_name.startswith("pagedcore_") else None
        kind = "selection hook" if selection else "event"
        if caller is None or caller.spec is None or bool(caller.spec.opts.get("firstresult")) != selection:
            raise PluginError(f"{hook_name!r} is not a pagedcore {kind} (pagedcore/hookspecs.py lists them)")
        return caller

    def _register(self, plugin: object, name: str | None) -> str:
        taken = self._pm.get_plugin(name) if name is not None else None
        if taken is not None or (name is not None and self._pm.is_blocked(name)):
            source = self._sources.get(name, "registered") if name is not None else ""
            raise PluginError(f"the plugin name {name!r} is taken ({source}): register under another name")
        if self._pm.is_registered(plugin):
            raise PluginError(f"{plugin!r} is already registered, as {self._pm.get_name(plugin)!r}")
        try:
            registered = self._pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {name or plugin!r} is invalid: {exc}") from exc
        except ValueError as exc:  # a name pluggy derived from the object, already taken
            raise PluginError(f"plugin {name or plugin!r} cannot be registered: its name is taken") from exc
        if registered is None:
            raise PluginError(f"plugin {name or plugin!r} is blocked or already registered")
        try:
            self._pm.check_pending()  # a misspelled hook name fails here, not silently later
            self._check_event_wrappers(registered)
        except (pluggy.PluginValidationError, PluginError) as exc:
            self._pm.unregister(name=registered)
            raise PluginError(f"plugin {registered!r} is invalid: {exc}") from exc
        return registered

    def _check_event_wrappers(self, name: str) -> None:
        """Refuse wrappers: events and selection hooks call each implementation on its own (:meth:`emit`,
        :meth:`select`), so a wrapper would wrap nothing."""
        plugin = self._pm.get_plugin(name)
        for caller in self._pm.get_hookcallers(plugin) or ():
            kind = "selection hook" if caller.spec is not None and caller.spec.opts.get("firstresult") else "event hook"
            for impl in caller.get_hookimpls():
                if impl.plugin_name == name and (impl.hookwrapper or impl.wrapper):
                    raise PluginError(f"{kind} {caller.name} cannot be implemented as a wrapper")

    def _ensure_loaded(self) -> None:
        if self._loaded:
            return
        with self._lock:  # other threads wait here until loading is complete
            if self._loaded:
                return
            if self._load_entrypoints:
                self._load_entry_points()
            if self._builtins:
                self._register_builtins()  # after the entry points: every installed plugin is asked first
            self._loaded = True

    def _load_entry_points(self) -> None:
        builtins = {plugin.name: plugin for plugin in BUILTIN_PLUGINS}
        for point in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name):
            dist = getattr(point, "dist", None)
            source = f"entry point {point.value}" + (f" ({dist.name})" if dist else "")
            builtin = builtins.get(point.name)
            if builtin is not None and point.value == builtin.module:
                continue  # metadata of an older pagedcore that still listed its built-ins: the host registers them
            if builtin is not None:
                self._load_failed(point.name, source, f"the name {point.name!r} is reserved for a built-in plugin")
                continue
            if self._pm.get_plugin(point.name) is not None or self._pm.is_blocked(point.name):
                continue
            self._load(point.name, source, point.load)

    def _register_builtins(self) -> None:
        for builtin in BUILTIN_PLUGINS:
            if self._pm.get_plugin(builtin.name) is not None or self._pm.is_blocked(builtin.name):
                continue
            if builtin.is_installable():
                self._load(builtin.name, BUILTIN_SOURCE, functools.partial(importlib.import_module, builtin.module))

    def _load(self, name: str, source: str, load: Callable[[], object]) -> None:
        try:
            self._register(load(), name)
        except Exception as exc:
            # One broken plugin must not take the others (the built-in backends included) down with it.
            self._load_failed(name, source, f"{type(exc).__name__}: {exc}")
            return
        self._sources[name] = source

    def _load_failed(self, name: str, source: str, reason: str) -> None:
        self.load_errors.append(PluginLoadError(name, source, reason))
        logger.error("pagedcore: plugin %r (%s) was not loaded: %s", name, source, reason)


def _ask(impl: Any, hook_name: str, kwargs: dict[str, Any]) -> Any:
    """One plugin's answer to a selection hook; what it raises becomes a PluginError naming it and the hook."""
    try:
        return impl.function(*[kwargs[arg] for arg in impl.argnames])
    except PagedCoreError:
        raise
    except Exception as exc:
        raise PluginError(
            f"plugin {impl.plugin_name!r} failed in {hook_name}({_arguments(kwargs)}): {type(exc).__name__}: {exc}"
        ) from exc


def _arguments(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in kwargs.items())


_default: PluginManager | None = None
_default_lock = threading.Lock()


def default_plugin_manager() -> PluginManager:
    """The process-wide manager: the built-ins and every installed plugin (created on first use).

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
