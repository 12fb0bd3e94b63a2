"""The repository the tests run in: its root, and the CI scripts that tests load as modules."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_typecheck() -> ModuleType:
    """``.ci/typecheck.py`` as a module (it knows where each installed package's sources live)."""
    spec = importlib.util.spec_from_file_location("ci_typecheck", ROOT / ".ci" / "typecheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
