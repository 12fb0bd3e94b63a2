"""Transparent huge pages turned on by ``pagedcore generate`` and ``serve`` before torch loads
(``pagedcore/cli/huge_pages.py``, issue 33.2): torch's own switch, ``THP_MEM_ALLOC_ENABLE``, set where the environment
has not chosen, the kernel offers them and torch has not loaded yet; stated in the start-up line; and a real command
line's later tensors land on huge pages."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedcore.cli.huge_pages import ENV, HugePagesChoice, huge_pages

ROOT = Path(__file__).resolve().parents[1]
MADVISE = "always [madvise] never"


@pytest.mark.parametrize(
    ("env", "mode", "loaded", "want"),
    [
        ({}, MADVISE, False, HugePagesChoice(True, "")),
        ({}, "[always] madvise never", False, HugePagesChoice(True, "")),
        ({ENV: "0"}, MADVISE, False, HugePagesChoice(False, "THP_MEM_ALLOC_ENABLE=0 is set")),
        ({ENV: "1"}, MADVISE, True, HugePagesChoice(True, "THP_MEM_ALLOC_ENABLE=1 is set")),
        ({}, "always madvise [never]", False, HugePagesChoice(False, "the kernel's transparent huge pages are off")),
        ({}, "", False, HugePagesChoice(False, "the kernel offers no transparent huge pages")),
        ({}, MADVISE, True, HugePagesChoice(False, f"torch was loaded first; set {ENV}=1 before it loads")),
    ],
)
def test_the_choice(env, mode, loaded, want):
    before = dict(env)
    assert huge_pages(env, kernel_mode=mode, torch_loaded=loaded) == want
    assert env == ({**before, ENV: "1"} if want == HugePagesChoice(True, "") else before)  # set only when chosen


def _kernel_mode() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""


# The command line in-process, then a 64 MiB tensor: how much of this process is on huge pages.
PROBE = textwrap.dedent(
    """
    import sys
    from pagedcore.cli import main
    code = main(sys.argv[1:])
    import torch
    x = torch.ones(16 << 20)
    huge = [int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages:")]
    print(code, huge[0] if huge else 0)
    """
)


@pytest.mark.skipif("[madvise]" not in _kernel_mode(), reason="the kernel's THP mode is not madvise")
@pytest.mark.parametrize("setting", [None, "0"])
def test_generate_puts_later_tensors_on_huge_pages_unless_told_not_to(setting):
    env = {k: v for k, v in os.environ.items() if k != ENV} | {"PYTHONPATH": str(ROOT)}
    if setting is not None:
        env[ENV] = setting
    command = [sys.executable, "-c", PROBE, "generate", "--max-new-tokens", "1", "--threads", "1", "hi"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    code, huge_kib = done.stdout.split()[-2:]
    assert code == "0", done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("pagedcore generate: ")]
    if setting is None:
        assert line.endswith("huge pages for tensors of 2 MiB+ (THP_MEM_ALLOC_ENABLE=0 turns them off)"), line
        assert int(huge_kib) >= 32 << 10  # most of the 64 MiB tensor
    else:
        assert line.endswith("no huge pages (THP_MEM_ALLOC_ENABLE=0 is set)"), line
        assert int(huge_kib) == 0


def test_bench_leaves_torchs_default_for_its_peers(tmp_path):
    """Its peers share its process; huge pages made the padded generate batch 1.07x slower (docs/benchmarks.md,
    Allocators), so `pagedcore bench` neither sets the variable nor claims huge pages."""
    env = {k: v for k, v in os.environ.items() if k != ENV} | {"PYTHONPATH": str(ROOT)}
    probe = f"import os, sys; from pagedcore.cli import main; print(main(sys.argv[1:]), os.environ.get({ENV!r}))"
    command = [sys.executable, "-c", probe, "bench", "--only", "core", "--quick", "--threads", "1", "--no-progress"]
    done = subprocess.run([*command, "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert done.stdout.split()[-2:] == ["0", "None"], done.stdout[-500:] + done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("pagedcore bench: ")]
    assert line.endswith("no huge pages (torch's default; THP_MEM_ALLOC_ENABLE=1 turns them on)"), line
