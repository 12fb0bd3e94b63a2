"""The repository the tests run in: its root, and the modules its source tree holds.

The source tree is laid out as it installs: a module's name is its path under the root (``pagedcore/adapters/
transformers/cache.py`` is ``pagedcore.adapters.transformers.cache``), so the names here are the names a user
imports; tests/test_packaging.py checks that the wheel installs exactly these.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pagedcore"


def source_modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package's regular subpackages (folders with an ``__init__.py``), by dotted name.

    ``rglob`` does not follow symbolic links (the top-level ``adapters``/``plugins`` links), so each file is found
    once, at its real path.
    """
    found: dict[str, Path] = {}
    root = package.parent
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(root)
        folders = range(1, len(relative.parts))
        if "__pycache__" in relative.parts or not all(
            (root.joinpath(*relative.parts[:depth]) / "__init__.py").is_file() for depth in folders
        ):
            continue  # not inside a regular package: setuptools would not install it either
        parts = list(relative.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found
