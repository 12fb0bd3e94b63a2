"""The Makefile's set-up: ``make demo`` installs only what the demo needs, ``make test`` everything, and the two work
in either order in one checkout (each set of extras has its own stamp). Read with ``make -n``: nothing installs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def planned(target: str, venv: Path, *args: str) -> str:
    command = ["make", "-n", "--no-print-directory", "-C", str(ROOT), target, f"VENV={venv}", *args]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return done.stdout


def installs(plan: str) -> list[str]:
    return [line.split("-e ", 1)[1].strip() for line in plan.splitlines() if "pip install" in line and "-e " in line]


def made_stamp(venv: Path, name: str) -> None:
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "python").touch()
    (venv / f".installed-{name}").touch()  # newer than pyproject.toml: up to date


def test_demo_installs_only_what_it_needs_and_test_everything(tmp_path):
    venv = tmp_path / "venv"
    demo = planned("demo", venv)
    assert installs(demo) == ['".[transformers]"'] and f"{venv}/bin/pagedcore generate\n" in demo
    assert demo.strip().endswith(
        f'echo "next: . {venv}/bin/activate puts pagedcore on PATH; make install EXTRAS=serve for pagedcore serve"'
    )
    assert "-m venv" in demo and "torch==" in demo  # a fresh venv, torch's pinned build first
    assert installs(planned("test", venv)) == ['".[all]"']
    assert installs(planned("install", venv, "EXTRAS=serve,structured")) == ['".[serve,structured]"']


def test_demo_then_test_installs_the_rest_and_test_then_demo_reinstalls_nothing_big(tmp_path):
    venv = tmp_path / "venv"
    made_stamp(venv, "transformers")  # `make demo` ran
    assert installs(planned("demo", venv)) == []
    assert installs(planned("test", venv)) == ['".[all]"']  # the demo's stamp is not the test's
    made_stamp(venv, "all")  # `make test` ran too
    assert installs(planned("test", venv)) == [] and installs(planned("demo", venv)) == []
    fresh = tmp_path / "other"
    made_stamp(fresh, "all")  # `make test` first, then `make demo`: only the demo's (already satisfied) extras
    assert installs(planned("demo", fresh)) == ['".[transformers]"']
