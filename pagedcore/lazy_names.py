"""Lazy attributes for packages whose names live in modules with heavy imports, and the old paths of modules that
moved (one owner of those rules).

A package lists where each public name lives (``{name: submodule}``) and sets its module ``__getattr__`` to
:func:`lazy_getattr`'s result: ``import package`` then costs nothing, and the first use of a name imports its
submodule. Unknown names raise :class:`AttributeError` as a plain module would.

Example:
    >>> getattr_ = lazy_getattr("pagedcore", {"BlockManager": "block_manager"})
    >>> getattr_("BlockManager").__name__
    'BlockManager'
    >>> getattr_("Nope")
    Traceback (most recent call last):
        ...
    AttributeError: module 'pagedcore' has no attribute 'Nope'

A module that moved keeps its old path with :func:`keep_old_paths`: ``import package.old`` and ``from package.old
import name`` give the module at its new home (the same module object, so its classes are the same classes).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``package.<homes[name]>`` on first use of ``name``."""
    table = dict(homes)

    def module_getattr(name: str) -> Any:
        home = table.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{home}"), name)

    return module_getattr


def keep_old_paths(package: str, moved: Mapping[str, str]) -> None:
    """Make ``package.<old>`` the module now at ``moved[old]`` (imported here), for every ``old``: call it from
    ``package``'s ``__init__`` so that its old submodule paths keep working after the modules moved elsewhere.

    Example:
        >>> import types
        >>> sys.modules["pagedcore_demo"] = types.ModuleType("pagedcore_demo")
        >>> keep_old_paths("pagedcore_demo", {"rules": "pagedcore.validation"})
        >>> from pagedcore_demo.rules import integer
        >>> integer.__module__
        'pagedcore.validation'
    """
    parent = sys.modules[package]
    for old, new in moved.items():
        module = importlib.import_module(new)
        sys.modules.setdefault(f"{package}.{old}", module)
        setattr(parent, old, module)
