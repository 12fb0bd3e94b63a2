"""Packaging: one distribution whose adapters/ and plugins/ install as pagedcore.adapters / pagedcore.plugins (in a
regular wheel as in the editable install); the built-in plugins are registered by the host, not through entry points
(so never twice); the type check covers what installs. What the core imports: tests/test_imports.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from repo import ROOT, load_typecheck


def test_wheel_layout_and_builtin_plugins(tmp_path):
    # Build from a copy of the tracked tree: setuptools reuses a checkout's build/ folder, whose stale modules (e.g.
    # of a module since moved) would end up in the wheel and make this test depend on the checkout's history.
    source = tmp_path / "source"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("pagedcore-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "pagedcore/adapters/transformers/cache.py" in names
    assert "pagedcore/plugins/torch_backend.py" in names
    assert "pagedcore/py.typed" in names
    assert not [n for n in names if n.split("/")[0] in ("adapters", "plugins", "tests", "examples")]
    # The type check (.ci/typecheck.py) sees exactly the modules the wheel installs, under their installed names.
    installed = {n.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for n in names if n.endswith(".py")}
    typecheck = load_typecheck()
    assert {source.module for source in typecheck.sources(typecheck.package_dirs())} == installed
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[pagedcore]" not in text  # the host registers its built-ins itself
    assert "pagedcore = pagedcore.cli:main" in text
    # A regular (non-editable) install of the wheel imports the mapped packages and loads the built-in plugins.
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
    )
    code = (
        "import sys, pagedcore, pagedcore.adapters.transformers as t;"
        "from pagedcore import default_plugin_manager as d;"
        "print(pagedcore.__file__); print(t.__file__); print(sorted((i.name, i.source) for i in d().plugins()));"
        "print(sys.modules['pagedcore.plugins.torch_backend'].__file__)"
    )
    result = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); {code}"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    lines = result.stdout.splitlines()
    assert lines[0].startswith(str(target)) and lines[1].startswith(str(target))
    builtins = [(name, "built-in") for name in ("logging", "lru", "torch", "xformers")]
    assert lines[2] == str(builtins)
    assert lines[3].startswith(str(target))  # the built-in backend came from the installed wheel


def test_typecheck_covers_every_folder_in_package_dir(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "pkg" = "src", "pkg.serve" = "serve" }\npackages = ["pkg", "pkg.serve"]\n'
    )
    for path in ("src/__init__.py", "src/core.py", "serve/__init__.py", "serve/app.py", "serve/sub/__init__.py",
                 "serve/sub/x.py", "serve/scripts/not_a_package.py"):  # fmt: skip
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    typecheck = load_typecheck()
    sources = typecheck.sources(typecheck.package_dirs(tmp_path / "pyproject.toml"))
    found = {source.module: Path(source.path).relative_to(tmp_path).as_posix() for source in sources}
    assert found == {
        "pkg": "src/__init__.py",
        "pkg.core": "src/core.py",
        "pkg.serve": "serve/__init__.py",
        "pkg.serve.app": "serve/app.py",
        "pkg.serve.sub": "serve/sub/__init__.py",
        "pkg.serve.sub.x": "serve/sub/x.py",
    }
