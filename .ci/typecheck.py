"""Run mypy over the package as it installs, straight from the source tree.

``[tool.setuptools] package-dir`` maps top-level folders into the ``pagedcore`` package (``adapters/`` ->
``pagedcore.adapters``, ``plugins/`` -> ``pagedcore.plugins``, and any folder added there later). mypy's command line
cannot express that mapping: it names a module after its path (``adapters.transformers.cache``), and it has no
``package_dir`` setting (python/mypy#10564). So this script reads the mapping from ``pyproject.toml`` and hands mypy
every file with the module name it installs under, through mypy's build API (``BuildSource(path, module)``): nothing
is copied, errors point at the real files, and every folder in ``package-dir`` is checked automatically. Options come
from ``[tool.mypy]`` as for the command line.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mypy import build
from mypy.errors import CompileError
from mypy.main import process_options
from mypy.modulefinder import BuildSource

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: mypy itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"


def package_dirs(pyproject: Path = PYPROJECT) -> dict[str, Path]:
    """``[tool.setuptools] package-dir``: installed package name -> source folder."""
    setuptools = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]
    return {package: pyproject.parent / folder for package, folder in setuptools["package-dir"].items()}


def sources(mapping: dict[str, Path]) -> list[BuildSource]:
    """Every module of every mapped folder (regular packages: folders with an ``__init__.py``), named as installed."""
    found: dict[str, Path] = {}
    for package, folder in mapping.items():
        for path in sorted(folder.rglob("*.py")):
            relative = path.relative_to(folder)
            if "__pycache__" in relative.parts or not all(
                (folder.joinpath(*relative.parts[:depth]) / "__init__.py").is_file()
                for depth in range(len(relative.parts))
            ):
                continue  # not inside a regular package: setuptools would not install it either
            parts = [*package.split("."), *relative.with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            module = ".".join(parts)
            if module in found and found[module] != path:
                raise SystemExit(f"typecheck: {module} comes from both {found[module]} and {path}")
            found[module] = path
    return [BuildSource(str(path), module) for module, path in sorted(found.items())]


def main() -> int:
    _, options = process_options(["--config-file", str(PYPROJECT)], require_targets=False)
    targets = sources(package_dirs())
    try:
        result = build.build(targets, options)
    except CompileError as exc:  # a blocking error (e.g. a syntax error)
        print("\n".join(exc.messages), file=sys.stderr)
        return 2
    for line in result.errors:
        print(line)
    errors = [line for line in result.errors if ": error:" in line]
    if errors:
        files = len({line.split(":", 1)[0] for line in errors})
        print(f"Found {len(errors)} errors in {files} files (checked {len(targets)} source files)")
        return 1
    print(f"Success: no issues found in {len(targets)} source files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
