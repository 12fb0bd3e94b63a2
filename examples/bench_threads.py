"""The command line's default torch threads against torch's own default, side by side.

Needs: pagedcore with the ``transformers`` extra (what ``make demo`` installs).

Runs ``pagedcore generate`` on the built-in model (its three default questions) as a fresh process, once with the
default threads (``pagedcore.cli.threads``: the CPUs this process may use, less those other work keeps busy) and once
with torch's own default (one thread per core: ``torch.get_num_threads()`` in a fresh interpreter), alternating, for
``--rounds`` rounds; with ``--bench`` also ``pagedcore bench --quick`` both ways (each capped at ``--bench-timeout``
seconds). Prints one line per run with the load average at its start, and the ratio of the medians. On a quiet
machine the two choices are the same; on a busy one torch's default waits for descheduled threads.

    python examples/bench_threads.py                     # 3 rounds of generate (32 new tokens per question)
    python examples/bench_threads.py --bench             # and bench --quick both ways (minutes to tens of minutes)
    python examples/bench_threads.py --quick             # 1 round, 4 new tokens
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def torch_default_threads() -> int:
    """What torch chooses by itself, in a fresh interpreter without OMP_NUM_THREADS."""
    code = "import torch; print(torch.get_num_threads())"
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, check=True)
    return int(done.stdout)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def run(argv: list[str], timeout: float) -> tuple[float | None, str]:
    """Seconds a ``pagedcore`` command took (None past ``timeout``) and its threads line."""
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pagedcore", *argv], env=_env(), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None, "(timed out)"
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"pagedcore {' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    line = next((x for x in done.stderr.splitlines() if "torch thread" in x), "")
    generated = re.search(r"(\d+) tokens in ([\d.]+)s", done.stdout)
    if generated:  # generate's own clock: the tokens, without the start-up
        return float(generated.group(2)), line
    return elapsed, line


def compare(name: str, argv: list[str], torch_threads: int, rounds: int, timeout: float) -> None:
    times: dict[str, list[float]] = {"default": [], "torch": []}
    for round_ in range(1, rounds + 1):
        for mode, extra in (("default", []), ("torch", ["--threads", str(torch_threads)])):
            load = os.getloadavg()[0]
            seconds, line = run([*argv, *extra], timeout)
            shown = "did not finish" if seconds is None else f"{seconds:.2f} s"
            print(f"{name} round {round_} {mode:7} load {load:4.1f}: {shown:>15}  {line.split(': ', 1)[-1]}")
            times[mode].append(float("inf") if seconds is None else seconds)
    default, torch_ = statistics.median(times["default"]), statistics.median(times["torch"])
    ratio = "torch's did not finish" if torch_ == float("inf") else f"{torch_ / default:.1f}x the default's time"
    print(f"{name}: median {default:.2f} s with the default threads, torch's {torch_threads} threads {ratio}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--bench", action="store_true", help="also pagedcore bench --quick, both ways")
    parser.add_argument("--bench-timeout", type=float, default=1200.0)
    parser.add_argument("--quick", action="store_true", help="one round of generate with 4 new tokens")
    args = parser.parse_args(argv)
    rounds, tokens = (1, 4) if args.quick else (args.rounds, args.max_new_tokens)
    threads = torch_default_threads()
    print(f"{os.cpu_count()} CPUs; torch's own default: {threads} threads")
    compare("generate", ["generate", "--max-new-tokens", str(tokens)], threads, rounds, timeout=600)
    if args.bench:
        bench = ["bench", "--quick", "--no-progress", "--out", str(ROOT / "bench-out" / "threads")]
        compare("bench --quick", bench, threads, 1, timeout=args.bench_timeout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
