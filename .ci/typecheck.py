"""Run mypy over the package as it installs: ``adapters/`` and ``plugins/`` become ``pagedcore.adapters`` and
``pagedcore.plugins`` (setuptools ``package-dir``), a layout mypy cannot see in the source tree, so lay it out in
``build/typecheck`` first."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "typecheck"


def main() -> int:
    shutil.rmtree(OUT, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "pagedcore", OUT / "pagedcore", ignore=ignore)
    shutil.copytree(ROOT / "adapters", OUT / "pagedcore" / "adapters", ignore=ignore)
    shutil.copytree(ROOT / "plugins", OUT / "pagedcore" / "plugins", ignore=ignore)
    shutil.copytree(ROOT / "serve", OUT / "pagedcore" / "serve", ignore=ignore)
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "pagedcore"]
    return subprocess.call(command, cwd=OUT)


if __name__ == "__main__":
    sys.exit(main())
