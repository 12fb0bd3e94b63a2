"""The GPU check's tooling on the CPU: what the carry holds, how the run keeps to its caps and leaves its report.

scripts/gpu_carry.py must carry only what the GPU image lacks (not its pytest, pluggy or packaging) and refuse a
carried wheel whose dependency the image does not have; scripts/gpu_check.py must kill a part at its cap with
everything it started, stream each part's output to its log as it comes, leave a whole report (every part, the one
in flight "running", the verdict "in progress") when the run itself is killed, and stop starting parts when the
budget is spent. The whole rehearsal (``make gpu-rehearsal``, scripts/gpu_rehearsal.sh) runs these scripts for real.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_carry  # noqa: E402
import gpu_check  # noqa: E402


# ---------------------------------------------------------------- the carry
def test_the_carry_holds_only_what_the_image_lacks():
    image = gpu_carry.read_image()
    carry, kept = gpu_carry.plan(gpu_carry.run_requirements(), image)
    (transformers,) = [r for r in gpu_carry.run_requirements() if r.name == "transformers"]
    assert carry == {
        "transformers": gpu_carry.floor(transformers),  # pyproject's floor: what CI rehearses
        "xformers": "0.0.35",
        "nvidia-cuda-runtime-cu12": "12.8.90",
    }
    assert image["transformers"].version == "5.17.0" and not transformers.specifier.contains("5.17.0")
    assert not {"pytest", "pluggy", "packaging", "torch", "accelerate"} & set(carry)  # the image's own are kept
    assert any(line.startswith("pytest") for line in kept)


def test_an_image_with_the_floor_carries_no_transformers():
    image = gpu_carry.read_image()
    image["transformers"] = gpu_carry.ImagePackage("transformers", "5.24.0", "=")
    carry, _ = gpu_carry.plan(gpu_carry.run_requirements(), image)
    assert "transformers" not in carry and "xformers" in carry


def test_a_missing_package_without_a_pin_is_refused_by_name():
    image = gpu_carry.read_image()
    del image["pluggy"]
    with pytest.raises(SystemExit, match=r"the image lacks pluggy>=1\.3"):
        gpu_carry.plan(gpu_carry.run_requirements(), image)


def fake_wheel(folder: Path, name: str, requires: list[str]) -> Path:
    path = folder / f"{name}-1.0-py3-none-any.whl"
    metadata = "\n".join(
        ["Metadata-Version: 2.1", f"Name: {name}", "Version: 1.0", *(f"Requires-Dist: {r}" for r in requires)]
    )
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-1.0.dist-info/METADATA", metadata + "\n")
    return path


def test_a_carried_wheel_needing_what_the_image_lacks_is_refused(tmp_path):
    fake_wheel(
        tmp_path, "needy", ["numpy>=1", "fastapi>=0.1", "rich; extra == 'cli'", "tomli; python_version < '3.11'"]
    )
    image = gpu_carry.read_image()
    with pytest.raises(SystemExit, match=r"needs fastapi>=0\.1: not on the image, not carried") as raised:
        gpu_carry.check_dependencies(tmp_path, image, {})
    assert "rich" not in str(raised.value) and "tomli" not in str(raised.value)  # extras and markers do not apply
    (tmp_path / "needy-1.0-py3-none-any.whl").unlink()
    fake_wheel(tmp_path, "fine", ["numpy>=1", "huggingface-hub>=1.31"])
    assert len(gpu_carry.check_dependencies(tmp_path, image, {})) == 2


def test_the_rehearsal_installs_the_images_versions_and_none_of_what_it_lacks():
    wanted = [Requirement(spec) for spec in gpu_carry.rehearsal_requirements(gpu_carry.read_image())]
    names = {r.name for r in wanted}
    assert "transformers==5.17.0" in {str(r) for r in wanted}
    assert not names & {"xformers", "fastapi", "uvicorn", "ray", "openai", "mypy", "triton", "python"}


def test_the_tree_digest_changes_with_a_source_file(tmp_path):
    (tmp_path / "pagedcore" / "sub").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    module = tmp_path / "pagedcore" / "sub" / "m.py"
    module.write_text("x = 1\n")
    before = gpu_carry.tree_digest(tmp_path)
    (tmp_path / "pagedcore" / "sub" / "notes.txt").write_text("not in a wheel")
    assert gpu_carry.tree_digest(tmp_path) == before
    module.write_text("x = 2\n")
    assert gpu_carry.tree_digest(tmp_path) != before


# ---------------------------------------------------------------- the run
def test_everything_the_run_writes_comes_back_from_a_gpu_machine():
    logs = {part.log for part in gpu_check.plan_parts()}
    assert len(logs | {"report.md", "status.json", "install.log"}) <= gpu_check.MAX_FILES
    assert all(gpu_check.GOOD_NAME.match(name) for name in logs)


def test_a_part_past_its_cap_is_killed_with_its_children_and_its_output_kept(tmp_path):
    part = gpu_check.Part("slow", "a part that hangs", 3, "slow.log")
    run = gpu_check.Run(tmp_path, 120, [part])
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print('child', child.pid)\n"  # no flush: the part's output is unbuffered all the same
        "time.sleep(120)\n"
    )
    started = time.monotonic()
    exit_code, output = gpu_check.execute(run, part, [sys.executable, "-c", code])
    assert exit_code is None and time.monotonic() - started < 60
    child = int(output.split("child ")[1].split()[0])
    assert "child" in (tmp_path / "slow.log").read_text()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the part's child outlived its cap"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


KILLED_RUN = """
import sys, time
sys.path.insert(0, {scripts!r})
import gpu_check

def run_part(run, part, args):
    if part.name == "setup":
        part.ok, part.status, part.lines = True, "ok", ["- fine"]
        run.cuda = True
    else:  # a part that hangs, in a process of its own
        code = "import os, time; print('part', os.getpid(), flush=True); time.sleep(120)"
        gpu_check.execute(run, part, [sys.executable, "-c", code])

gpu_check.run_part = run_part
gpu_check.main(["--out", {out!r}, "--budget", "300"])
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "terminated"])
def test_a_run_stopped_in_a_part_leaves_a_whole_report(tmp_path, sig):
    code = KILLED_RUN.format(scripts=str(ROOT / "scripts"), out=str(tmp_path))
    process = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 120
        log = tmp_path / "tests.log"
        while time.monotonic() < deadline and not (log.exists() and "part " in log.read_text()):
            time.sleep(0.1)
        part_pid = int(log.read_text().split("part ")[1].split()[0])
        process.send_signal(sig)  # SIGKILL: a machine taken back; SIGTERM: gpu_run.sh's outer timeout
        process.wait(30)
        if sig == signal.SIGTERM:  # the driver stopped the part before it exited
            assert not _alive(part_pid), "the part outlived the stopped run"
    finally:
        if process.poll() is None:
            process.kill()
        with contextlib.suppress(ProcessLookupError, UnboundLocalError):
            os.killpg(part_pid, signal.SIGKILL)  # a killed driver cannot stop its part: the machine goes anyway
    status = _status(tmp_path)
    assert status is not None and not status["finished"]
    second = "running" if sig == signal.SIGKILL else "stopped"
    assert [p["status"].split(" ")[0] for p in status["parts"][:3]] == ["ok", second, "not"]
    report = (tmp_path / "report.md").read_text()
    assert f"| cuda-tests | {second} (started at" in report and "## setup: " in report
    verdict = "**in progress" if sig == signal.SIGKILL else "**cut short by SIGTERM after"
    assert verdict in report
    assert any(p.startswith("the run did not finish") for p in gpu_check.verify(tmp_path))


def _status(out: Path) -> dict | None:
    try:
        return json.loads((out / "status.json").read_text())
    except (OSError, ValueError):
        return None


def test_parts_the_budget_cannot_hold_are_not_reached(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "run_part", lambda run, part, args: pytest.fail("no part should start"))
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert gpu_check.main(["--out", str(tmp_path), "--budget", "5"]) == 1
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # the caller's, back
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["finished"] and status["verdict"].startswith("FAILED: setup (not reached: 5 s budget spent)")
    assert all(p["status"] == "not reached: 5 s budget spent" for p in status["parts"])
    # the checks fail; the benchmarks are left out (no failure of their own), and the verdict names them
    assert {p["name"] for p in status["parts"] if p["ok"] is False} == {
        "setup",
        "cuda-tests",
        "xformers-tests",
        "decode",
        "syncs",
    }
    assert "left out by the budget: bench-engine, bench-decode" in status["verdict"]


def test_benchmarks_the_budget_leaves_out_do_not_fail_a_run(tmp_path, monkeypatch):
    def run_part(run, part, args):
        part.ok, part.status, part.seconds = True, "ok", 0.0
        run.cuda = True
        if part.name == "bench-cold":  # the budget runs out here
            monkeypatch.setattr(run, "left", lambda: 0.0)

    monkeypatch.setattr(gpu_check, "run_part", run_part)
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["verdict"].startswith("all checks passed; left out by the budget: bench-prefix, bench-host")
    assert gpu_check.verify(tmp_path)  # the rehearsal, which must reach every part, would say so


@pytest.mark.parametrize(
    ("output", "code", "cuda", "ok"),
    [
        ("1 skipped in 0.3s", 5, False, True),  # no CUDA: the module skipped itself
        ("1 skipped in 0.3s", 5, True, False),  # CUDA: a skip is a failure
        ("98 passed in 40.1s", 0, True, True),
        ("97 passed, 1 skipped in 40.1s", 0, True, False),
        ("1 failed, 97 passed in 40.1s", 1, True, False),
        ("1 error in 2.0s", 2, False, False),  # no CUDA, but the module did not import
        ("Timeout (0:01:00)!", 1, True, False),  # no summary line
    ],
)
def test_the_gpu_tests_pass_only_when_all_pass_and_none_skip(output, code, cuda, ok):
    assert gpu_check.pytest_outcome(output, code, cuda)[0] is ok


def test_a_benchmark_passes_when_it_ran_or_refused_the_missing_gpu_cleanly():
    refused = "pagedcore bench: error: ConfigError: device 'cuda' is not available on this machine (torch 2.13.0+cpu)"
    assert gpu_check.bench_outcome("", 0, True, True) == (True, "ok")
    assert gpu_check.bench_outcome(refused, 2, False, False)[0]
    assert not gpu_check.bench_outcome(refused, 2, False, True)[0]  # on a GPU that is a failure
    assert not gpu_check.bench_outcome("Traceback ...", 1, False, False)[0]


def test_verify_checks_what_a_gpu_machine_sends_back(tmp_path):
    run = gpu_check.Run(tmp_path, 300, gpu_check.plan_parts())
    for part in run.parts:
        part.ok, part.status, part.lines = True, "no CUDA: fine", ["- fine"]
    run.finished = True
    run.write()
    assert gpu_check.verify(tmp_path) == []
    for index in range(7):
        (tmp_path / f"extra{index}.log").write_text("x")
    (tmp_path / "bad name.log").write_text("x")
    problems = gpu_check.verify(tmp_path)
    assert any("10 files" in p for p in problems) and any("bad name.log" in p for p in problems)
    os.remove(tmp_path / "report.md")
    assert any("no section for setup" in p for p in gpu_check.verify(tmp_path))
