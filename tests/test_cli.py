"""The ``pagedcore`` command line: each subcommand on the built-in model with fast settings, bad input answered with
exit code 2 and one clear line (never a traceback), and imports kept lazy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pagedcore.benchmarks.registry import BENCHMARKS
from pagedcore.cli import main as cli

pytestmark = pytest.mark.usefixtures("one_thread")


def test_cli_generate(capsys):
    assert cli(["generate", "--max-new-tokens", "4", "--repeat", "2"]) == 0
    captured = capsys.readouterr()
    assert "built-in" in captured.err  # it says it uses the built-in model
    last = captured.out.strip().splitlines()[-1]
    assert last.startswith("prefix hit rate") and "tokens/s" in last


def test_cli_generate_leaves_the_block_size_to_the_device_default(monkeypatch, capsys):
    # --block-size defaulted to 16, overriding the pool's per-device default (64 on CUDA).
    from pagedcore.adapters.transformers import pool as pool_module

    sizes: list[int] = []
    original = pool_module.PagedKVPool.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        sizes.append(self.block_size)

    monkeypatch.setattr(pool_module, "default_block_size", lambda device: 8)
    monkeypatch.setattr(pool_module.PagedKVPool, "__init__", recording)
    assert cli(["generate", "--max-new-tokens", "2", "x"]) == 0
    assert cli(["generate", "--max-new-tokens", "2", "--block-size", "4", "x"]) == 0
    assert list(dict.fromkeys(sizes)) == [8, 4]  # (the construction-time probe's private pools take the same size)


def test_cli_generate_engine_json(capsys):
    assert cli(["generate", "--engine", "--json", "--max-new-tokens", "3", "one prompt", "another prompt"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [line["prompt"] for line in lines[:2]] == ["one prompt", "another prompt"]
    assert lines[-1]["generated_tokens"] == 6 and "prefix_hit_rate" in lines[-1]


def test_cli_generate_max_new_tokens_zero_with_the_engine(capsys):
    assert cli(["generate", "--engine", "--json", "--max-new-tokens", "0", "x"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert lines[0]["text"] == "" and lines[-1]["generated_tokens"] == 0


def test_cli_generate_reads_a_file(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first\n\nsecond\n")
    assert cli(["generate", "--json", "--max-new-tokens", "2", "-f", str(prompts), "--attn", "sdpa"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 3


@pytest.fixture
def no_cuda(monkeypatch):
    """The same answer on a GPU machine: CUDA reported missing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def paths(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("not a model\n")
    return tmp_path


# argv (with {tmp} for the temporary folder), exit code, a part of the one-line message
BAD_INPUT = [
    (["generate", "--model", "/no/such/checkpoint"], 2, "'/no/such/checkpoint': no such folder"),
    (["generate", "--model", "{tmp}/empty", "x"], 2, "the folder holds no model (no config.json)"),
    (["generate", "--model", "{tmp}/file.txt", "x"], 2, "is a file: give a model folder"),
    (["generate", "x", "--max-new-tokens", "0"], 2, "--max-new-tokens 0 needs --engine"),
    (["generate", "--device", "cuda", "x"], 2, "device 'cuda' is not available on this machine"),
    (["generate", "--device", "gpu", "x"], 2, "device 'gpu' is not a torch device"),
    (["generate", "--backend", "no-such-backend", "hi"], 3, "no plugin offers backend 'no-such-backend'"),
    (["generate", "--num-blocks", "0", "hi"], 2, "num_blocks"),
    (["generate", "--num-blocks", "-4", "hi"], 2, "num_blocks must be a positive integer, got -4"),
    (["generate", "--block-size", "-1", "hi"], 2, "block_size must be a positive integer, got -1"),
    (["generate", "--top-k", "-2", "hi"], 2, "top_k must be an integer >= -1, got -2"),
    (["generate", "--temperature", "-0.5", "hi"], 2, "temperature must be >= 0, got -0.5"),
    (["generate", "--top-p", "0", "hi"], 2, "top_p must be in (0, 1], got 0.0"),
    (["generate", "--memory-budget", "lots", "hi"], 2, "memory_budget must be a size like 8MiB"),
    (["generate", "-f", "/no/such/file"], 2, "cannot read prompts"),
    (["generate", "-f", "{tmp}/empty"], 2, "cannot read prompts from"),
    (["generate", "--repeat", "0"], 2, "--repeat must be >= 1, got 0"),
    (["generate", "--repeat", "-2"], 2, "--repeat must be >= 1, got -2"),
    (["bench", "--out", "/proc/forbidden"], 2, "cannot write to output folder '/proc/forbidden'"),
    (["bench", "--out", "{tmp}/file.txt"], 2, "is a file, not a folder"),
    (["bench", "--out", "{tmp}/file.txt/sub"], 2, "cannot write to output folder"),
    (["bench", "--threads", "0", "--out", "{tmp}/o"], 2, "threads must be a positive integer, got 0"),
    (["bench", "--threads", "-2", "--out", "{tmp}/o"], 2, "threads must be a positive integer, got -2"),
    (["bench", "--only", "prefix,nonesuch", "--out", "{tmp}/o"], 2, "unknown benchmark 'nonesuch'"),
    (["bench", "--only", ",", "--out", "{tmp}/o"], 2, "unknown benchmark (none given)"),
    (["bench", "--device", "cuda", "--out", "{tmp}/o"], 2, "device 'cuda' is not available on this machine"),
]


@pytest.mark.parametrize(("argv", "code", "message"), BAD_INPUT, ids=[" ".join(a) for a, _, _ in BAD_INPUT])
@pytest.mark.usefixtures("no_cuda")
def test_bad_input_exits_with_one_clear_line(argv, code, message, paths, capsys):
    argv = [a.replace("{tmp}", str(paths)) for a in argv]
    assert cli(argv) == code
    err = capsys.readouterr().err.replace(str(paths), "{tmp}")
    lines = [line for line in err.splitlines() if not line.startswith("note: no --model given")]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"pagedcore {argv[0]}: error: ") and message in lines[0]


@pytest.mark.usefixtures("no_cuda")
def test_bad_bench_arguments_leave_no_output_folder(paths):
    assert cli(["bench", "--device", "cuda", "--out", str(paths / "o")]) == 2
    assert not (paths / "o").exists()


def test_no_command_prints_help(capsys):
    assert cli([]) == 2
    assert "usage: pagedcore" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--max-new-tokens", "-3"],
        ["bench", "--device", "tpu"],
        ["bench", "--dtype", "float8"],
        ["bench", "--model-size", "7b"],
    ],
)
def test_bad_argument_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli(argv)
    assert info.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_cli_plugins(capsys):
    assert cli(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "pagedcore_attention_backend" in out and "cpu    float32: torch" in out
    assert cli(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["attention_backends"]["cpu"]["float32"] == "torch"
    assert {"lru", "logging", "torch", "xformers"} <= {p["name"] for p in data["plugins"]}


def test_cli_bench_quick(tmp_path, capsys):
    argv = ["bench", "--quick", "--no-progress", "--threads", "1", "--model-size", "tiny", "--out", str(tmp_path)]
    assert cli(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("# pagedcore benchmarks (quick workload)")
    assert "- Device: cpu; dtype: float32; model size: tiny" in out
    sections = [line.split(".")[0] for line in out.splitlines() if line.startswith("### ")]
    assert sections == [f"### {n}" for n in range(1, len(BENCHMARKS) + 1)]
    assert {p.name for p in tmp_path.iterdir()} == {"results.md", "engine.png", "decode.png", "scaling.png"}


def test_cli_bench_bfloat16_subset(tmp_path, capsys):
    argv = ["bench", "--quick", "--no-progress", "--model-size", "tiny", "--dtype", "bfloat16", "--device", "auto"]
    assert cli([*argv, "--only", "memory", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "dtype: bfloat16" in out and "parameters, bfloat16" in out
    assert "### 3. KV memory" in out and "### 1." not in out


def test_python_dash_m_pagedcore():
    result = subprocess.run(
        [sys.executable, "-m", "pagedcore", "--version"], capture_output=True, text=True, check=True
    )
    assert result.stdout.startswith("pagedcore ")


def test_importing_the_cli_imports_neither_torch_nor_transformers():
    code = (
        "import sys, pagedcore.cli as cli; cli._parser().parse_args(['bench', '--quick']);"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
