"""Scopes of namespaces: which adapter versions' prefixes may be served and registered now.

A namespace of an adapter (:class:`~pagedcore.block_keys.AdapterNamespace`) belongs to a *scope*, the adapter
version it was computed with (:func:`~pagedcore.block_keys.namespace_scope`); every tenant's namespace of that version
shares it. When that version's weights change in place, everything computed with them is stale, and so is every
request still carrying that version: :class:`NamespaceScopes` is the rule the pool applies then.

- **closing** a scope: nothing of it may be matched or registered any more (the pool forgets its cached blocks
  when it closes it), so a sequence that carries the old version, running or still waiting, neither reads nor files
  keys and values under a version they no longer are;
- **opening** it again (the weights are that version once more, e.g. an adapter loaded again from the same files):
  a sequence that started filling before the reopening still never registers (it may have computed with other
  weights meanwhile); sequences that start afterwards do.

Base-model namespaces have no scope: only the pool's epoch (``KVPool.reset_prefix_cache``) governs them, so closing
an adapter's scope changes nothing for the base model or for other adapters.

"""

from __future__ import annotations

from collections.abc import Hashable

from pagedcore.block_keys import namespace_scope

__all__ = ["NamespaceScopes"]


class NamespaceScopes:
    """The closed scopes and when each scope was last opened again (see the module docstring).

    Example:
        >>> from pagedcore.block_keys import AdapterNamespace
        >>> scopes, tuned = NamespaceScopes(), AdapterNamespace("tenant", "sql", "v1")
        >>> before = scopes.clock
        >>> scopes.close(("adapter", "sql", "v1")), scopes.is_closed(tuned), scopes.may_register(before, "tenant")
        (True, True, True)
        >>> scopes.open(("adapter", "sql", "v1")), scopes.may_register(before, tuned)
        (True, False)
        >>> scopes.may_register(scopes.clock, tuned)     # a sequence that starts now
        True
    """

    def __init__(self) -> None:
        self._clock = 0  # bumped at every reopening
        self._opened: dict[Hashable, int] = {}  # scope -> the clock at its last reopening
        self._closed: set[Hashable] = set()

    @property
    def clock(self) -> int:
        """What a sequence's blocks record when they start filling (compared by :meth:`may_register`)."""
        return self._clock

    @property
    def num_closed(self) -> int:
        """Scopes closed now."""
        return len(self._closed)

    def is_closed(self, namespace: Hashable) -> bool:
        """Whether ``namespace`` belongs to a closed scope (nothing of it may be matched)."""
        scope = namespace_scope(namespace)
        return scope is not None and scope in self._closed

    def may_register(self, started: int, namespace: Hashable) -> bool:
        """Whether blocks that started filling at clock ``started`` may be registered in ``namespace``: always for a
        base-model namespace; for an adapter's, while its scope is open and was not reopened since."""
        scope = namespace_scope(namespace)
        if scope is None:
            return True
        return scope not in self._closed and self._opened.get(scope, 0) <= started

    def close(self, scope: Hashable) -> bool:
        """Close ``scope``; False when it was closed already."""
        if scope in self._closed:
            return False
        self._closed.add(scope)
        return True

    def open(self, scope: Hashable) -> bool:
        """Open a closed ``scope`` again, from now on; False (nothing changes) when it was open."""
        if scope not in self._closed:
            return False
        self._closed.discard(scope)
        self._clock += 1
        self._opened[scope] = self._clock
        return True
