"""Every example script runs on the built-in model with fast settings (the CLI: tests/test_cli.py)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedcore import PluginManager

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("name", "argv"),
    [
        ("quickstart", ["--max-new-tokens", "4"]),
        ("quickstart", ["--max-new-tokens", "4", "--attn", "paged"]),
        ("chat_prefix_cache", ["--max-new-tokens", "3", "--users", "2"]),
        ("engine_many_requests", ["--requests", "6", "--max-new-tokens", "4", "--no-progress"]),
        ("device_map", ["--max-new-tokens", "4"]),
        ("plugin_observer", ["--max-new-tokens", "2"]),
        ("bench_core", ["--quick"]),
        ("bench_hybrid", ["--quick", "--intervals", "1"]),
        ("structured_throughput", ["--quick", "--builtin"]),
        ("weights_check_cost", ["--quick"]),
        ("probe_cost", ["--quick"]),
        ("host_memory", ["namespaces", "--count", "200"]),
        ("host_memory", ["blocks", "--sizes", "1000", "--touch"]),
        ("variant_memory", ["--tokens", "24"]),
        ("grpo_trl", ["--quick"]),
    ],
)
def test_example_runs(name, argv, capsys):
    assert load(name).main(argv) == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.slow
def test_the_kv_store_benchmark_runs_its_three_configurations_and_the_restart(capsys):
    assert load("bench_kv_store").main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "replies identical to recompute and 4x pool: True" in out and "same tokens: True" in out


def test_chat_example_hits_the_cache(capsys):
    load("chat_prefix_cache").main(["--max-new-tokens", "2", "--users", "1"])
    out = capsys.readouterr().out
    assert "0 from the cache" in out.splitlines()[0]  # the first turn is cold
    assert "prefix hit rate over the session" in out and "prefix hit rate over the session: 0.0%" not in out


def test_third_party_plugin_installs_and_loads_from_its_entry_point(tmp_path, monkeypatch):
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(EXAMPLES / "prefix_logger_plugin"),
        ],
        check=True,
    )
    monkeypatch.syspath_prepend(str(target))
    sys.modules.pop("pagedcore_prefix_logger", None)  # load it fresh, from the installed copy
    try:
        pm = PluginManager()
        info = {i.name: i for i in pm.plugins()}["prefix-logger"]
        assert info.source == "entry point pagedcore_prefix_logger (pagedcore-prefix-logger)"
        assert info.hooks == ("pagedcore_prefix_hit",)
        import pagedcore_prefix_logger

        assert pagedcore_prefix_logger.__file__.startswith(str(target))
        pm.emit(
            "pagedcore_prefix_hit",
            request_id="r",
            num_query_tokens=10,
            num_hit_tokens=8,
            namespace=None,
            block_ids=([0, 1],),
        )
        assert pagedcore_prefix_logger.TALLY == {"lookups": 1, "query_tokens": 10, "hit_tokens": 8}
    finally:
        sys.modules.pop("pagedcore_prefix_logger", None)


SCRIPTS = sorted(path.stem for path in EXAMPLES.glob("*.py"))
_OPTIONAL = (EXAMPLES.parent / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
EXTRAS = set(re.findall(r"^([\w-]+) = \[", _OPTIONAL, re.M))  # pyproject's extras (no tomllib on Python 3.10)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_example_says_what_it_needs_and_has_a_quick_run(name):
    """Its first lines say which extras it needs (a newcomer ran one that needed a package no extra installed), and
    ``--quick`` is a short run of it (``test_every_example_runs_quick`` runs them all)."""
    source = (EXAMPLES / f"{name}.py").read_text()
    head = "\n".join((ast.get_docstring(ast.parse(source)) or "").splitlines()[:6])
    assert "Needs:" in head, f"examples/{name}.py: its docstring's first lines do not say what it needs"
    named = set(re.findall(r"`([\w-]+)` extra|pagedcore\[([\w,-]+)\]", head))
    extras = {extra for pair in named for group in pair for extra in group.split(",") if extra}
    assert extras <= EXTRAS, f"examples/{name}.py names extras pyproject.toml lacks: {extras - EXTRAS}"
    assert '"--quick"' in source or re.search(r"script_main\(|\[\"bench\", ", source)  # pagedcore bench's own --quick


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_every_example_runs_quick(name, tmp_path):
    """``python examples/NAME.py --quick`` finishes, within 2 minutes on a quiet 2-core machine (the cap here is
    twice that, for a busy one)."""
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent)}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--quick"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "it printed nothing"
    print(f"examples/{name}.py --quick: {time.monotonic() - started:.0f} s")
