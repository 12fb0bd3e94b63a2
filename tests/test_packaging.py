"""Packaging: one distribution whose source tree is laid out as it installs (pagedcore.adapters is
pagedcore/adapters/, in a regular wheel as in the editable install; the top-level adapters/ and plugins/ are links
into it); the built-in plugins are registered by the host, not through entry points (so never twice). What the core
imports: tests/test_imports.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from repo import ROOT, source_modules


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
    # the C kernels' sources, built at first use (c_library.py)
    kernels = ("adapters/transformers/row_kernel.c", "adapters/transformers/direct_kernel.c", "plugins/decode_kernel.c")
    assert {f"pagedcore/{name}" for name in kernels} <= set(names)
    assert not [n for n in names if n.split("/")[0] in ("adapters", "plugins", "tests", "examples")]
    # The source tree holds exactly the modules the wheel installs, at the paths their names say.
    installed = {n.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for n in names if n.endswith(".py")}
    assert set(source_modules()) == installed
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[pagedcore]" not in text  # the host registers its built-ins itself
    assert "pagedcore = pagedcore.cli:entry" in text
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
    builtins = [(name, "built-in") for name in ("kv-store", "logging", "lru", "torch", "xformers")]
    assert lines[2] == str(builtins)
    assert lines[3].startswith(str(target))  # the built-in backend came from the installed wheel


def test_the_top_level_layer_folders_lead_to_the_package():
    for name in ("adapters", "plugins"):
        link = ROOT / name
        assert link.is_symlink() and link.resolve() == (ROOT / "pagedcore" / name).resolve()
