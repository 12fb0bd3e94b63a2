"""gpu-check: pagedcore's GPU check in parts, each writing its part of the report as it finishes (docs/gpu.md).

``bash scripts/gpu_run.sh OUT`` installs the carry and runs this; ``python scripts/gpu_check.py --out DIR`` runs it
where everything is installed already (``make gpu-check``); ``--verify DIR`` checks a finished run's folder.

Each part is a process of its own, with a cap, its output streamed unbuffered to a log under ``--out``. Before and
after each part ``report.md`` and ``status.json`` are rewritten whole (atomically): a run cut short at any moment
leaves every part so far, the part in flight marked "running", and the verdict "in progress". The run keeps to
``--budget`` seconds (default 300): a part gets at most what is left; one that cannot get MIN_PART_S is "not
reached".

Parts (cap in seconds), in order:

- ``setup`` (90): versions; which pagedcore is imported (the source tree from the repository root) and whether the
  carry was built from this tree; the CUDA runtimes loaded; why xformers is (not) usable; ``pagedcore plugins``;
- ``cuda-tests`` (90): tests/test_cuda_backends.py, the torch backend and the Engine on CUDA (eager, CUDA graphs,
  inductor) against the CPU;
- ``xformers-tests`` (150): tests/test_xformers_gpu.py, all must pass, none skipped; both with a 60 s per-test
  timeout;
- ``decode`` (120): a 200-step Engine decode of a random 1B Llama in bf16, twice (step times, Triton compilations),
  then the same with ``compile="cudagraphs"`` (step times against eager, graphs captured, tokens that differ);
- ``syncs`` (45): host-device synchronisations per decode step;
- ``bench-NAME`` (60 each): ``pagedcore bench --only NAME --device cuda --dtype bfloat16 --model-size 1b --quick``,
  one benchmark at a time, most telling first; ``engine`` with ``--engine-compile cudagraphs`` (the Engine's decode
  steps as CUDA graphs, against ``generate`` and transformers' ``generate_batch``).

Without CUDA the test modules skip themselves and the other GPU parts run a CPU rehearsal at a tiny scale; each then
reports "no CUDA", and such a run passes when every part did that cleanly. Seven files come back (a GPU machine
returns at most eight): report.md, status.json, install.log (from gpu_run.sh), setup.log, tests.log, engine.log,
bench.log. Exit status 0 when every part passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PARTS = ROOT / "scripts" / "gpu_parts.py"
BUDGET_S = 300
MIN_PART_S = 10.0
RESERVE_S = 3.0  # kept back for the last report
TEST_TIMEOUT_S = 60
BENCH_ORDER = ("engine", "decode", "cold", "prefix", "host", "memory", "chat", "scaling", "core")
GRAPH_BENCHES = ("engine",)  # with --engine-compile cudagraphs: the Engine as CUDA graphs vs generate, generate_batch
MAX_FILES, MAX_FILE_BYTES = 8, 16 * 2**20  # what a GPU machine sends back
GOOD_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
PYTEST_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")


@dataclass
class Part:
    """One part of the run and, once it ran, its outcome."""

    name: str
    title: str
    cap_s: float
    log: str
    optional: bool = False  # a benchmark: the budget may leave it out without failing the run
    status: str = "not started"
    ok: bool | None = None  # None once the run is over: an optional part the budget left out
    seconds: float | None = None
    lines: list[str] = field(default_factory=list)


def plan_parts(cap_scale: float = 1.0) -> list[Part]:
    """Every part, in the order they run (``cap_scale`` multiplies the caps)."""
    parts = [
        Part("setup", "Versions, the carry, xformers, `pagedcore plugins`", 90, "setup.log"),
        Part("cuda-tests", "GPU tests: torch backend and Engine on CUDA vs CPU", 90, "tests.log"),
        Part("xformers-tests", "GPU tests: the xformers backend", 150, "tests.log"),
        Part("decode", "Decode run (Engine, 200 steps, twice; then as CUDA graphs)", 120, "engine.log"),
        Part("syncs", "Host-device syncs per decode step", 45, "engine.log"),
    ]
    parts += [Part(f"bench-{name}", f"Benchmark: {name}", 60, "bench.log", optional=True) for name in BENCH_ORDER]
    for part in parts:
        part.cap_s *= cap_scale
    return parts


class Run:
    """The parts, the budget, and the two report files, rewritten whole after every change."""

    def __init__(self, out: Path, budget: float, parts: list[Part]) -> None:
        self.out = out
        self.budget = budget
        self.parts = parts
        self.started = time.monotonic()
        self.cuda: bool | None = None
        self.device = "unknown"
        self.finished = False
        self.stopped: str | None = None  # the signal that stopped the run
        self.work = Path(tempfile.mkdtemp(prefix="pagedcore-gpu-check-"))

    def left(self) -> float:
        return self.budget - RESERVE_S - (time.monotonic() - self.started)

    def verdict(self) -> str:
        if self.stopped:
            return f"cut short by {self.stopped}: the parts below are what it reached"
        if not self.finished:
            return "in progress (a run cut short stops here: the parts below are what it reached)"
        failed = [f"{p.name} ({p.status})" for p in self.parts if p.ok is False]
        left_out = [p.name for p in self.parts if p.ok is None]
        note = f"; left out by the budget: {', '.join(left_out)}" if left_out else ""
        if failed:
            return "FAILED: " + "; ".join(failed) + note
        return ("all checks passed" if self.cuda else "no CUDA: every part ran its CPU rehearsal cleanly") + note

    def write(self) -> None:
        elapsed = time.monotonic() - self.started
        head = [
            "# pagedcore gpu-check",
            "",
            f"**{self.verdict()}**",
            "",
            f"- {elapsed:.0f} s of a {self.budget:.0f} s budget; device: {self.device}; "
            f"written {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
            "",
            "| part | status | seconds | cap | log |",
            "|---|---|---|---|---|",
        ]
        for p in self.parts:
            seconds = "" if p.seconds is None else f"{p.seconds:.0f}"
            head.append(f"| {p.name} | {p.status} | {seconds} | {p.cap_s:.0f} | {p.log} |")
        body = []
        for p in self.parts:
            if p.lines:
                body += ["", f"## {p.name}: {p.title}", "", *p.lines]
        status = {
            "verdict": self.verdict(),
            "finished": self.finished,
            "cuda": self.cuda,
            "device": self.device,
            "budget_s": self.budget,
            "elapsed_s": round(elapsed, 1),
            "parts": [{k: v for k, v in asdict(p).items() if k != "lines"} for p in self.parts],
        }
        _replace(self.out / "report.md", "\n".join([*head, *body, ""]))
        _replace(self.out / "status.json", json.dumps(status, indent=2) + "\n")


def _replace(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def execute(run: Run, part: Part, command: list[str]) -> tuple[int | None, str]:
    """Run ``command`` for ``part`` under its cap, output appended to its log; ``(exit code or None, its output)``.

    None: it ran past its cap (or what was left of the budget) and was killed with everything it started."""
    timeout = min(part.cap_s, run.left())
    log = run.out / part.log
    with log.open("a") as handle:
        handle.write(f"\n== {part.name} (cap {timeout:.0f} s): {' '.join(command)}\n")
        handle.flush()
        offset = handle.tell()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        started = time.monotonic()
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code: int | None = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
            _kill(process)
        except Stopped:  # the run itself is being stopped: the part goes with it
            _kill(process)
            raise
        with contextlib.suppress(ProcessLookupError):  # what it left running (holding GPU memory) goes too
            os.killpg(process.pid, signal.SIGKILL)
        part.seconds = time.monotonic() - started
    with log.open() as handle:
        handle.seek(offset)
        return code, handle.read()


class Stopped(Exception):
    """SIGTERM or SIGINT reached the driver (the outer timeout, a person): the report says so, then it exits."""


def _stop(signum: int, frame: Any) -> None:
    raise Stopped(signal.Signals(signum).name)


def _kill(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the part's process group, SIGKILL 5 s later to whatever of it is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)


def tail(text: str, count: int = 15) -> list[str]:
    return ["```", *text.strip().splitlines()[-count:], "```"]


def timed_out(part: Part, output: str) -> None:
    part.ok = False
    part.status = f"timed out after {part.seconds:.0f} s"
    part.lines = [f"killed at its cap; the last lines of {part.log}:", *tail(output)]


# ---------------------------------------------------------------- the parts
def script_part(run: Run, part: Part, *extra: str) -> dict[str, Any] | None:
    """A part that scripts/gpu_parts.py runs: it writes ``{ok, status, lines, ...}`` to a result file."""
    result = run.work / f"{part.name}.json"
    code, output = execute(run, part, [sys.executable, str(PARTS), part.name, "--result", str(result), *extra])
    if code is None:
        timed_out(part, output)
        return None
    if not result.exists():
        part.ok, part.status = False, f"crashed (exit {code})"
        part.lines = [f"no result; the last lines of {part.log}:", *tail(output)]
        return None
    data: dict[str, Any] = json.loads(result.read_text())
    part.ok = bool(data["ok"]) and code == 0
    part.status = data["status"] if code == 0 else f"{data['status']} (exit {code})"
    part.lines = list(data["lines"])
    return data


def pytest_outcome(output: str, code: int, cuda: bool) -> tuple[bool, str]:
    """``(passed, status)`` of a GPU test module's run from pytest's output and exit code. With CUDA every test must
    pass and none be skipped; without it the module skips itself (pytest exits 5 when that leaves no test)."""
    summaries = [line for line in output.splitlines() if PYTEST_COUNTS.search(line) and " in " in line]
    summary = summaries[-1].strip("= ") if summaries else "(no summary line)"
    counts = {
        kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in PYTEST_COUNTS.findall(summary)
    }
    broken = counts.get("failed", 0) + counts.get("error", 0)
    if not cuda:
        ok = code in (0, 5) and not broken and counts.get("skipped", 0) > 0
        return ok, f"no CUDA: {summary}" if ok else f"FAILED without CUDA: {summary} (exit {code})"
    ok = code == 0 and not broken and not counts.get("skipped") and counts.get("passed", 0) > 0
    return ok, summary if ok else f"FAILED: {summary} (exit {code}; all must pass, none skipped)"


def tests_part(run: Run, part: Part, module: str) -> None:
    command = [sys.executable, "-m", "pytest", module, "-q", "-rfEs", "--color=no", "-p", "no:cacheprovider"]
    has_timeout = importlib.util.find_spec("pytest_timeout") is not None  # else the part's cap alone bounds it
    per_test = ["--timeout", str(TEST_TIMEOUT_S)] if has_timeout else []
    code, output = execute(run, part, [*command, *per_test])
    if code is None:
        timed_out(part, output)
        return
    part.ok, part.status = pytest_outcome(output, code, bool(run.cuda))
    listed = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR", "SKIPPED"))]
    how = " ".join(per_test) if has_timeout else "(no pytest-timeout here: no per-test timeout)"
    part.lines = [f"`pytest {module} {how}`: {part.status} (exit {code})", *listed[:30]]


def bench_part(run: Run, part: Part, name: str) -> None:
    """``pagedcore bench --only NAME`` on CUDA (1b, bf16, quick). Without CUDA the same command, which refuses the
    device with a ConfigError (exit 2); ``core`` runs no model and so runs (tests/test_benchmarks.py runs every quick
    workload on the CPU)."""
    folder = run.work / part.name
    settings = ["--device", "cuda", "--dtype", "bfloat16", "--model-size", "1b", "--quick", "--no-progress"]
    settings += ["--engine-compile", "cudagraphs"] if name in GRAPH_BENCHES else []
    command = [sys.executable, "-m", "pagedcore", "bench", "--only", name, *settings, "--out", str(folder)]
    code, output = execute(run, part, command)
    if code is None:
        timed_out(part, output)
        return
    results = folder / "results.md"
    part.lines = [f"`{' '.join(['pagedcore', *command[3:-2]])}`: exit {code}", ""]
    part.lines += results.read_text().splitlines() if results.exists() else tail(output, 5)
    part.ok, part.status = bench_outcome(output, code, results.exists(), bool(run.cuda))


def bench_outcome(output: str, code: int, wrote_results: bool, cuda: bool) -> tuple[bool, str]:
    """``(passed, status)`` of one ``pagedcore bench --only`` run on the GPU's settings."""
    if code == 0 and wrote_results:
        return True, "ok" if cuda else "no CUDA: ran on the CPU (it runs no model)"
    if not cuda and code == 2 and "is not available on this machine" in output:
        return True, "no CUDA: the command refused the device cleanly (exit 2)"
    return False, f"FAILED (exit {code})"


def install_lines(log: Path, code: int | None) -> tuple[bool, list[str]]:
    if code is None:
        return True, ["not run: gpu_check.py was started directly, not by scripts/gpu_run.sh"]
    text = log.read_text() if log.exists() else "(no install.log)"
    return code == 0, [f"carry install: exit {code}; the end of install.log:", *tail(text, 8)]


def probe_cuda(run: Run) -> None:
    """Whether CUDA is there, where the setup part could not say."""
    code = "import torch; print(int(torch.cuda.is_available()))"
    try:
        answer = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
        run.cuda = answer.stdout.strip().endswith("1")
    except subprocess.TimeoutExpired:
        run.cuda = False
    run.device = "CUDA (probed)" if run.cuda else "no CUDA (probed)"


def run_part(run: Run, part: Part, args: argparse.Namespace) -> None:
    if part.name == "setup":
        data = script_part(run, part, "--carry", str(args.carry))
        ok, lines = install_lines(run.out / "install.log", args.install_exit)
        part.lines = [*lines, "", *part.lines]
        part.ok = bool(part.ok) and ok
        if not ok:
            part.status = f"carry install failed; {part.status}"
        if data is not None and "cuda" in data:
            run.cuda, run.device = bool(data["cuda"]), str(data["device"])
        else:
            probe_cuda(run)
    elif part.name.endswith("-tests"):
        module = "tests/test_cuda_backends.py" if part.name == "cuda-tests" else "tests/test_xformers_gpu.py"
        tests_part(run, part, module)
    elif part.name.startswith("bench-"):
        bench_part(run, part, part.name.removeprefix("bench-"))
    else:
        script_part(run, part, *(["--steps", str(args.steps)] if part.name == "decode" else []))


def run_parts(run: Run, args: argparse.Namespace) -> None:
    for part in run.parts:
        if run.left() < MIN_PART_S:
            part.ok = None if part.optional else False
            part.status = f"not reached: {run.budget:.0f} s budget spent"
            continue
        part.status = f"running (started at {time.monotonic() - run.started:.0f} s)"
        run.write()
        try:
            run_part(run, part, args)
        except Stopped:
            part.ok, part.status = False, f"stopped (started at {part.status.split('at ', 1)[1]}"
            raise
        except Exception as exc:  # the driver's own fault: the part fails, the run goes on
            part.ok, part.status = False, f"driver error: {type(exc).__name__}: {exc}"
        print(f"gpu-check: {part.name}: {part.status} ({part.seconds or 0:.0f} s)", flush=True)
        run.write()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-check", help="folder for the report and the logs")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for the whole run ({BUDGET_S})")
    parser.add_argument("--steps", type=int, default=200, help="engine steps per decode pass (default 200)")
    parser.add_argument("--parts", default=None, help="comma-separated subset of the parts (default: all)")
    parser.add_argument("--carry", type=Path, default=ROOT / "carry", help="the carry folder (its MANIFEST.json)")
    parser.add_argument("--cap-scale", type=float, default=1.0, help="multiply every part's cap (a slow CPU rehearsal)")
    parser.add_argument("--install-exit", type=int, default=None, help=argparse.SUPPRESS)  # from gpu_run.sh
    parser.add_argument("--verify", type=Path, default=None, help="check a finished run's folder instead")
    args = parser.parse_args(argv)
    if args.verify is not None:
        problems = verify(args.verify)
        print("\n".join(problems) if problems else f"{args.verify}: complete, every part passed or had no CUDA")
        return 1 if problems else 0
    parts = plan_parts(args.cap_scale)
    if args.parts:
        wanted = set(args.parts.split(","))
        parts = [p for p in parts if p.name in wanted or p.name == "setup"]
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args.out, args.budget, parts)
    run.write()
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        run_parts(run, args)
    except Stopped as exc:
        run.stopped = f"{exc} after {time.monotonic() - run.started:.0f} s"
        run.write()
        print(f"gpu-check: {run.verdict()}; report: {args.out / 'report.md'}", flush=True)
        return 1
    finally:  # a caller's own handlers (pytest's, when a test runs main()) come back
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    run.finished = True
    run.write()
    print(f"gpu-check: {run.verdict()}; report: {args.out / 'report.md'}", flush=True)
    return 1 if any(p.ok is False for p in parts) else 0


def verify(out: Path) -> list[str]:
    """What is wrong with a finished run's folder (empty: nothing): every part must have passed or, without CUDA,
    run its CPU rehearsal cleanly; the report must be whole; the files must be what a GPU machine sends back."""
    status_file = out / "status.json"
    if not status_file.exists():
        return [f"{status_file}: missing"]
    status = json.loads(status_file.read_text())
    problems = [] if status["finished"] else [f"the run did not finish (verdict: {status['verdict']})"]
    names = [p["name"] for p in status["parts"]]
    if names != [p.name for p in plan_parts()]:
        problems.append(f"parts {names}, expected {[p.name for p in plan_parts()]}")
    problems += [f"part {p['name']}: {p['status']}" for p in status["parts"] if not p["ok"]]  # all must have run
    report = (out / "report.md").read_text() if (out / "report.md").exists() else ""
    problems += [f"report.md has no section for {name}" for name in names if f"\n## {name}: " not in report]
    files = [p for p in out.rglob("*") if p.is_file()]
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files under {out}: a GPU machine sends back {MAX_FILES}")
    for path in files:
        relative = path.relative_to(out)
        if len(relative.parts) > 3 or not all(GOOD_NAME.match(piece) for piece in relative.parts):
            problems.append(f"{relative}: too deep, or a name a GPU machine does not send back")
        if path.stat().st_size > MAX_FILE_BYTES:
            problems.append(f"{relative}: over {MAX_FILE_BYTES // 2**20} MiB")
    return problems


if __name__ == "__main__":
    sys.exit(main())
