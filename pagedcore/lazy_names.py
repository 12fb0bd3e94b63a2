"""Lazy attributes for packages whose names live in modules with heavy imports (one owner of that rule).

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
"""

from __future__ import annotations

import importlib
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
