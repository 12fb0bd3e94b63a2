"""The command line's first seconds and last: bad paths and devices refused before torch and transformers load, the
torch threads chosen from the CPUs this process may use (and stated), and an idle server that exits at once on
SIGTERM. Real subprocesses: what a user types."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from pagedcore.cli.common import torch_build
from pagedcore.cli.threads import ThreadChoice, cgroup_cpu_limit, choose_threads, default_threads

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

# Runs the command line in-process and prints the exit code and which heavy libraries were imported by then.
PROBE = textwrap.dedent(
    """
    import sys
    from pagedcore.cli import main
    code = main(sys.argv[1:])
    print(code, sorted(m for m in ("torch", "transformers", "fastapi", "uvicorn") if m in sys.modules))
    """
)
CPU_TORCH = (torch_build() or {}).get("cuda") is None and (torch_build() or {}).get("hip") is None

EARLY = [
    (["generate", "--model", "./no-such-model"], "--model './no-such-model': no such folder"),
    (["generate", "--model", "{tmp}/file.txt", "x"], "is a file: give a model folder"),
    (["generate", "--model", "{tmp}", "x"], "the folder holds no model (no config.json)"),
    (["generate", "--device", "gpu", "x"], "device 'gpu' is not a torch device"),
    (["generate", "--num-blocks", "0", "x"], "num_blocks must be a positive integer, got 0"),
    (["serve", "--model", "./no-such-model"], "--model './no-such-model': no such folder"),
    (["serve", "--device", "tpu:0"], "device 'tpu:0' is not a torch device"),
]
if CPU_TORCH:
    EARLY += [
        (["generate", "--device", "cuda"], "device 'cuda' is not available on this machine"),
        (["serve", "--device", "cuda:0"], "device 'cuda:0' is not available on this machine"),
    ]


@pytest.mark.parametrize(("argv", "message"), EARLY, ids=[" ".join(a) for a, _ in EARLY])
def test_bad_paths_and_devices_are_refused_before_torch_or_transformers_load(argv, message, tmp_path):
    (tmp_path / "file.txt").write_text("not a model\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=ENV, timeout=120)
    assert done.stdout.strip() == "2 []", done.stdout + done.stderr  # exit code 2, nothing heavy imported
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"pagedcore {argv[0]}: error: ") and message in line


def test_the_default_threads_leave_busy_cpus_to_others():
    assert default_threads(2, 0.0, 2) == 2  # a quiet 2-core machine: both
    assert default_threads(2, 0.7, 2) == 1  # a core's worth busy: one
    assert default_threads(2, 10.0, 2) == 1  # never fewer than one
    assert default_threads(4, 32.0, 64) == 2  # a container's 4 CPUs on a half-busy 64-core host
    assert default_threads(1.5, None, 8) == 1  # a quota of 1.5 CPUs: one whole thread
    assert default_threads(8, None, 8) == 8


def test_the_cgroup_quota_is_read_from_v2_and_v1_files_along_the_path(tmp_path):
    (tmp_path / "cpu.max").write_text("max 100000\n")
    nested = tmp_path / "kubepods" / "pod1"
    nested.mkdir(parents=True)
    (nested / "cpu.max").write_text("250000 100000\n")
    membership = tmp_path / "cgroup"
    membership.write_text("0::/kubepods/pod1\n")
    assert cgroup_cpu_limit(tmp_path, str(membership)) == 2.5
    (nested / "cpu.max").write_text("max 100000\n")
    (tmp_path / "kubepods" / "cpu.max").write_text("50000 100000\n")  # a parent's quota bounds its children
    assert cgroup_cpu_limit(tmp_path, str(membership)) == 0.5
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "docker").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "docker" / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu,cpuacct" / "docker" / "cpu.cfs_period_us").write_text("100000\n")
    membership.write_text("12:memory:/docker\n4:cpu,cpuacct:/docker\n")
    assert cgroup_cpu_limit(v1, str(membership)) == 3.0
    (v1 / "cpu,cpuacct" / "docker" / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert cgroup_cpu_limit(v1, str(membership)) is None


def test_threads_come_from_the_flag_then_the_environment_then_the_default(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads(5).threads == 5 and choose_threads(5).source == "--threads"
    assert (choose_threads().threads, choose_threads().source) == (3, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    choice = choose_threads()
    assert choice.source == "default" and 1 <= choice.threads <= choice.usable
    assert ThreadChoice(1, "default", 2, 9.8, 2).describe().startswith("1 torch thread (2 CPUs usable, load 9.8")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="needs 2 CPUs")
def test_an_affinity_mask_of_one_cpu_gives_one_thread():
    code = (
        "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]});"
        "from pagedcore.cli.threads import choose_threads, usable_cpus; print(usable_cpus(), choose_threads().threads)"
    )
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.split() == ["1", "1"]


def test_generate_states_its_threads_in_the_start_up_line():
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    command = [sys.executable, "-m", "pagedcore", "generate", "--max-new-tokens", "1", "hi"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("pagedcore generate: ")]
    assert "torch thread" in line and "CPUs usable" in line
    assert "glibc's malloc defaults (PAGEDCORE_MALLOC=tuned keeps freed memory)" in line  # pagedcore/cli/malloc.py
    env["PAGEDCORE_MALLOC"] = "tuned"
    done = subprocess.run([*command, "--threads", "1"], capture_output=True, text=True, env=env, timeout=300)
    want = "pagedcore generate: 1 torch thread (--threads); malloc keeps freed memory (PAGEDCORE_MALLOC=tuned); "
    assert any(line.startswith(want) for line in done.stderr.splitlines()), done.stderr


def test_an_idle_server_exits_at_once_on_sigterm():
    """An idle server took 15-19 s to exit after SIGTERM (5-7 s on a load of 5): the interpreter's exit ran full
    garbage collections over torch, transformers and the model. ``pagedcore.cli.entry`` freezes the heap first.

    The start-up heap is frozen before the first request too, and said (``pagedcore/cli/gc_heap.py``): a full
    collection while serving walked it all, 239-335 ms with every stream stopped (``scripts/gc_pauses.py``)."""
    command = [sys.executable, "-m", "pagedcore", "serve", "--port", "0", "--threads", "1", "--num-blocks", "64"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=ENV)
    said: list[str] = []
    try:
        assert process.stderr is not None
        for line in process.stderr:
            said.append(line)
            if line.startswith("pagedcore serve: model"):
                break
        assert "1 torch thread (--threads)" in line, line
        (frozen,) = [line for line in said if line.startswith("pagedcore serve: start-up heap frozen (")]
        assert int(frozen.split("(", 1)[1].split(" ", 1)[0]) > 100_000, frozen  # torch, transformers, the model
        url = line.split(" at ", 1)[1].split("/v1", 1)[0]
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        took = time.monotonic() - started
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
    assert process.returncode == 0
    assert took < 2.0, f"the idle server took {took:.1f} s to exit after SIGTERM"


def test_a_local_folder_name_without_a_dot_slash_is_said_to_be_no_folder_here(tmp_path):
    """Regression (an outside audit): ``--model ckpt_typo`` (a folder name typed without ``./``) is tried as a hub
    name, and the error spoke only of the hub; it now says there is no such folder here either."""
    env = {**ENV, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")}
    argv = ["generate", "--model", "ckpt_typo", "x"]
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, timeout=120,
                          cwd=tmp_path)  # fmt: skip
    (line,) = [line for line in done.stderr.strip().splitlines() if "error" in line]
    assert "cannot load model 'ckpt_typo' (no such folder here; tried as a hub name)" in line, done.stderr
