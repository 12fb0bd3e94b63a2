"""Every example script and every CLI subcommand runs on the built-in model with fast settings."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedcore import PluginManager
from pagedcore.cli import main as cli

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
        ("host_memory", ["namespaces", "--count", "200"]),
        ("host_memory", ["blocks", "--sizes", "1000", "--touch"]),
    ],
)
def test_example_runs(name, argv, capsys):
    assert load(name).main(argv) == 0
    assert capsys.readouterr().out.strip()


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
        pm.emit("pagedcore_prefix_hit", request_id="r", num_query_tokens=10, num_hit_tokens=8, namespace=None)
        assert pagedcore_prefix_logger.TALLY == {"lookups": 1, "query_tokens": 10, "hit_tokens": 8}
    finally:
        sys.modules.pop("pagedcore_prefix_logger", None)


def test_cli_generate(capsys):
    assert cli(["generate", "--max-new-tokens", "4", "--repeat", "2"]) == 0
    captured = capsys.readouterr()
    assert "built-in" in captured.err  # it says it uses the built-in model
    last = captured.out.strip().splitlines()[-1]
    assert last.startswith("prefix hit rate") and "tokens/s" in last


def test_cli_generate_engine_json(capsys):
    assert cli(["generate", "--engine", "--json", "--max-new-tokens", "3", "one prompt", "another prompt"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [line["prompt"] for line in lines[:2]] == ["one prompt", "another prompt"]
    assert lines[-1]["generated_tokens"] == 6 and "prefix_hit_rate" in lines[-1]


def test_cli_generate_reads_a_file(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first\n\nsecond\n")
    assert cli(["generate", "--json", "--max-new-tokens", "2", "-f", str(prompts), "--attn", "sdpa"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 3


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["generate", "--model", "/no/such/checkpoint"], 2, "cannot load model"),
        (["generate", "--backend", "no-such-backend", "hi"], 3, "no plugin offers backend 'no-such-backend'"),
        (["generate", "--num-blocks", "0", "hi"], 2, "num_blocks"),
        (["generate", "-f", "/no/such/file"], 2, "cannot read prompts"),
        (["generate", "--repeat", "0"], 2, "--repeat"),
        ([], 2, ""),
    ],
)
def test_cli_errors_have_clear_messages_and_exit_codes(argv, code, message, capsys):
    assert cli(argv) == code
    assert message in capsys.readouterr().err


def test_cli_bad_argument_is_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli(["generate", "--max-new-tokens", "-3"])
    assert info.value.code == 2
    assert "must be >= 0" in capsys.readouterr().err


def test_cli_plugins(capsys):
    assert cli(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "pagedcore_attention_backend" in out and "cpu    float32: torch" in out
    assert cli(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["attention_backends"]["cpu"]["float32"] == "torch"
    assert {"lru", "logging", "torch", "xformers"} <= {p["name"] for p in data["plugins"]}


def test_cli_bench_quick(tmp_path, capsys):
    torch.manual_seed(0)
    assert cli(["bench", "--quick", "--no-progress", "--threads", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pagedcore benchmarks (quick workload)" in out
    assert (tmp_path / "results.md").exists() and (tmp_path / "engine.png").exists()


def test_python_dash_m_pagedcore():
    result = subprocess.run(
        [sys.executable, "-m", "pagedcore", "--version"], capture_output=True, text=True, check=True
    )
    assert result.stdout.startswith("pagedcore ")
