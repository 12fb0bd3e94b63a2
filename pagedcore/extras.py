"""How to install one of the distribution's extras, said the same way by every message that needs one.

pagedcore is installed from its checkout (it is not on a package index), so the hint names the checkout's
``make install`` and the ``pip install -e`` it runs.

Example:
    >>> install_hint("serve")
    "make install EXTRAS=serve in the pagedcore checkout, or pip install -e '.[serve]' there"
"""

from __future__ import annotations

__all__ = ["install_hint"]


def install_hint(extra: str) -> str:
    """The command that installs ``extra`` (see the module docstring).

    Example:
        >>> install_hint("rl").split(" in ")[0]
        'make install EXTRAS=rl'
    """
    return f"make install EXTRAS={extra} in the pagedcore checkout, or pip install -e '.[{extra}]' there"
