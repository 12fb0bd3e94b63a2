"""gpu-check: everything a person with one GPU runs to check pagedcore's GPU path, in under 8 minutes.

``make gpu-check`` (or ``python scripts/gpu_check.py [--out gpu-check]``) writes ``gpu-check/report.md``:

1. versions (torch, CUDA, triton, xformers, flash_attn), why xformers is or is not usable, and the install plan;
2. ``tests/test_xformers_gpu.py``: every test must pass, none skipped;
3. a 200-step Engine decode of a random 1B Llama (bf16) with a varying batch and growing contexts, run twice with
   the same shapes: per-step times, steps over 100 ms, Triton compilations per pass (the second pass must compile
   nothing: shape buckets), the backend's counters (fallbacks, metadata builds);
4. host-device synchronisations of a decode step under ``torch.cuda.set_sync_debug_mode("warn")``, by source line,
   and those inside the first layer's attention;
5. ``pagedcore bench --device cuda --dtype bfloat16 --model-size 1b --out gpu-check/bench`` (Engine vs
   ``generate_batch`` vs padded ``generate``, PagedCache vs DynamicCache / StaticCache, TTFT on a cached prefix).

Without CUDA it prints and writes the parts a CPU can check (versions, the xformers diagnosis, the install plan)
and a clear "no CUDA" verdict, and exits 0. With CUDA it exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 8 * 60
SLOW_STEP_MS = 100.0
POOL_MEMORY = "24GiB"  # KV pool of the decode run (a 1B model in bf16 leaves most of an H200 free)
AIMS = [
    "Engine >= 2x transformers' generate_batch tokens/s on the shared-prefix workload (bench)",
    "PagedCache decode within 5% of DynamicCache (bench)",
    "paged attention decode faster than DynamicCache at 4k context (bench)",
    "0 Triton compilations after warm-up (section: decode run)",
    "<= 2 host-device syncs per decode step (section: syncs)",
]


class Report:
    """Sections of markdown, and the checks that failed."""

    def __init__(self) -> None:
        self.sections: list[tuple[str, list[str]]] = []
        self.failures: list[str] = []
        self.started = time.monotonic()

    def add(self, title: str, lines: list[str]) -> None:
        self.sections.append((title, lines))
        print(f"\n== {title}")
        for line in lines:
            print(f"   {line}")

    def fail(self, what: str) -> None:
        self.failures.append(what)
        print(f"   FAILED: {what}")

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def write(self, path: Path, verdict: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        out = ["# pagedcore gpu-check", "", f"**{verdict}** (took {self.elapsed():.0f} s)", ""]
        for title, lines in self.sections:
            out += [f"## {title}", ""]
            out += [line if line.lstrip().startswith(("|", "#", "- ")) else f"- {line}" for line in lines]
            out.append("")
        path.write_text("\n".join(out))
        print(f"\nwrote {path}")


# ---------------------------------------------------------------- 1. versions and the xformers diagnosis
def check_versions(report: Report) -> None:
    from pagedcore.plugins.xformers.runtime import preload_result
    from pagedcore.plugins.xformers.status import environment, install_plan, xformers_status

    env = environment()
    status = xformers_status()
    preload = preload_result()
    lines = [*env.lines(), f"python: {sys.version.split()[0]}"]
    lines.append(f"xformers backend: {'available' if status.available else 'unavailable'}: {status.reason}")
    if preload is not None:
        lines.append(
            f"CUDA runtime preload: {preload.needed or '-'}: {preload.action} {preload.path or preload.error or ''}"
        )
    plan = install_plan(env)
    lines += ["install plan: nothing to install"] if not plan else ["install plan:", *[f"  - {step}" for step in plan]]
    report.add("Versions and xformers", lines)
    if env.cuda_devices and not status.available:
        report.fail(f"xformers cannot run on this GPU: {status.reason}")


# ---------------------------------------------------------------- 2. the GPU tests
def run_gpu_tests(report: Report, timeout: float) -> None:
    command = [sys.executable, "-m", "pytest", "tests/test_xformers_gpu.py", "-q", "-rs", "-p", "no:cacheprovider"]
    started = time.monotonic()
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        report.add("GPU tests", [f"timed out after {timeout:.0f} s"])
        report.fail("GPU tests timed out")
        return
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "(no output)"
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", summary)}
    lines = [f"{' '.join(command[2:])}: {summary} ({time.monotonic() - started:.0f} s)"]
    lines += [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR", "SKIPPED"))][:30]
    report.add("GPU tests", lines)
    if result.returncode != 0 or counts.get("skipped", 0) or not counts.get("passed", 0):
        report.fail(f"GPU tests: {summary} (exit {result.returncode}; 0 skipped and 0 failed required)")


# ---------------------------------------------------------------- 3. the decode run
@contextlib.contextmanager
def triton_compiles() -> Iterator[Counter[str]]:
    """Count Triton JIT compilations (kernel specialisations built in this process) by kernel name."""
    counts: Counter[str] = Counter()

    def hook(*args: Any, **kwargs: Any) -> bool:
        fn = kwargs.get("fn")
        counts[str(getattr(fn, "name", None) or getattr(fn, "__name__", "?"))] += 1
        return False  # never claims the compile (a True from a pre-compile hook would skip it)

    try:
        import triton
    except ImportError:  # no Triton, nothing to count
        triton = None
    if triton is None:
        yield counts
        return
    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if knobs is not None and hasattr(knobs, "jit_post_compile_hook"):
        owner, attr = knobs, "jit_post_compile_hook"
    else:
        from triton.runtime.jit import JITFunction

        owner, attr = JITFunction, "compiled_hook" if hasattr(JITFunction, "compiled_hook") else "cache_hook"
    previous = getattr(owner, attr)
    setattr(owner, attr, hook)
    try:
        yield counts
    finally:
        setattr(owner, attr, previous)


def llama_1b(dtype: torch.dtype) -> Any:
    """A random Llama with Llama-3.2-1B's shapes (16 layers, hidden 2048, GQA 32/8, head dim 64), on the GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def schedule(steps: int, seed: int) -> list[list[tuple[int, int]]]:
    """Per step, the requests ``(prompt length, new tokens)`` that arrive: waves that grow and shrink the batch."""
    import random

    rng = random.Random(seed)
    arrivals: list[list[tuple[int, int]]] = [[] for _ in range(steps)]
    for step in range(0, steps, 25):
        for _ in range(rng.choice((1, 4, 12, 24, 40))):
            arrivals[step + rng.randrange(5)].append((rng.randint(64, 1500), rng.randint(30, 180)))
    return arrivals


def decode_pass(engine: Any, arrivals: list[list[tuple[int, int]]], token_seed: int) -> list[tuple[float, int, int]]:
    """Run the schedule; per step ``(milliseconds, running sequences, Triton compilations)``."""
    from pagedcore.adapters.transformers import SamplingParams

    generator = torch.Generator().manual_seed(token_seed)
    rows = []
    with triton_compiles() as compiles:
        for wave in arrivals:
            for prompt_len, new_tokens in wave:
                prompt = torch.randint(10, 120000, (prompt_len,), generator=generator).tolist()
                engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
            before = sum(compiles.values())
            start = time.perf_counter()
            engine.step()
            elapsed = (time.perf_counter() - start) * 1e3
            rows.append((elapsed, engine.scheduler.num_running, sum(compiles.values()) - before))
    while engine.has_unfinished():
        engine.step()
    return rows


def check_decode(report: Report, steps: int) -> Any:
    from pagedcore.adapters.transformers import Engine

    started = time.monotonic()
    model = llama_1b(torch.bfloat16)
    engine = Engine(
        model, memory_budget=POOL_MEMORY, max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False
    )
    backend = engine.pool.attention_backend(torch.device("cuda"), torch.bfloat16)
    arrivals = schedule(steps, seed=0)
    lines = [f"model: random Llama 1B shapes, bf16; pool block size {engine.pool.block_size}; backend {backend.name}"]
    passes = {}
    for name, token_seed in (("warm-up", 1), ("measured", 2)):
        rows = decode_pass(engine, arrivals, token_seed)
        passes[name] = rows
        times = sorted(ms for ms, _, _ in rows)
        slow = [(i, ms, n) for i, (ms, n, _) in enumerate(rows) if ms > SLOW_STEP_MS]
        compiles = sum(c for _, _, c in rows)
        lines.append(
            f"{name}: {len(rows)} steps, batch {min(n for _, n, _ in rows)}-{max(n for _, n, _ in rows)}, "
            f"median {times[len(times) // 2]:.1f} ms, p90 {times[int(len(times) * 0.9)]:.1f} ms, "
            f"max {times[-1]:.1f} ms; "
            f"{len(slow)} steps over {SLOW_STEP_MS:.0f} ms; {compiles} Triton compilations"
        )
        lines += [f"  slow step {i}: {ms:.1f} ms, {n} running" for i, ms, n in slow[:10]]
    stats = getattr(backend, "stats", None)
    if stats is not None:
        lines.append(
            f"backend stats: {stats.metadata_builds} metadata builds, {stats.support_checks} support checks, "
            f"{stats.kernel_failures} kernel failures, {stats.torch_forwards} torch forwards, "
            f"{len(stats.launch_shapes)} paged launch shapes"
        )
        if stats.kernel_failures:
            report.fail(f"{stats.kernel_failures} xformers kernel failures fell back to torch")
    lines.append(f"({time.monotonic() - started:.0f} s)")
    report.add("Decode run (Engine, 1B, bf16)", lines)
    measured_compiles = sum(c for _, _, c in passes["measured"])
    if measured_compiles:
        report.fail(f"{measured_compiles} Triton compilations after warm-up (aim: 0)")
    return engine


# ---------------------------------------------------------------- 4. host-device syncs
def check_syncs(report: Report, engine: Any, decode_steps: int = 3) -> None:
    from pagedcore.adapters.transformers import SamplingParams

    for n in range(8):
        engine.add_request(list(range(100 + n, 400 + n)), SamplingParams(max_new_tokens=16, ignore_eos=True))
    for _ in range(4):  # the prompts (2400 tokens: two steps), then decode steps whose shapes are warm
        engine.step()
    backend = engine.pool.attention_backend(torch.device("cuda"), torch.bfloat16)
    original = backend.forward
    per_call: list[int] = []  # syncs during each attention call of the current step
    first_layer: list[int] = []
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")

        def counting_forward(*args: Any, **kwargs: Any) -> Any:
            before = len(records)
            out = original(*args, **kwargs)
            per_call.append(len(records) - before)
            return out

        backend.forward = counting_forward
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(decode_steps):
                per_call.clear()
                engine.step()
                first_layer.append(per_call[0] if per_call else -1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            del backend.forward
    syncs = [w for w in records if "synchroniz" in str(w.message).lower()]
    per_line = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    per_step = len(syncs) / decode_steps
    lines = [f"{per_step:.1f} syncs per decode step ({len(syncs)} over {decode_steps} steps, 8 sequences)"]
    lines.append(f"inside the first layer's attention, per step: {first_layer}")
    lines += [f"  {where}: {count}" for where, count in per_line.most_common(12)]
    report.add("Host-device syncs", lines)
    if per_step > 2:
        report.fail(f"{per_step:.1f} host-device syncs per decode step (aim: <= 2)")
    while engine.has_unfinished():
        engine.step()


# ---------------------------------------------------------------- 5. the benchmarks
def run_bench(report: Report, out: Path, timeout: float) -> None:
    command = [sys.executable, "-m", "pagedcore", "bench", "--device", "cuda", "--dtype", "bfloat16"]
    command += ["--model-size", "1b", "--out", str(out / "bench")]
    started = time.monotonic()
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        report.add("Benchmarks", [f"{' '.join(command[2:])}: timed out after {timeout:.0f} s"])
        report.fail("benchmarks timed out")
        return
    lines = [f"{' '.join(command[2:])}: exit {result.returncode} ({time.monotonic() - started:.0f} s)"]
    results = out / "bench" / "results.md"
    if results.exists():
        lines += [f"tables: {results}", *results.read_text().splitlines()]
    else:
        lines += (result.stdout + result.stderr).strip().splitlines()[-25:]
    lines += ["aims to read off the tables (one H200, 1b, bf16):", *[f"  - {aim}" for aim in AIMS]]
    report.add("Benchmarks", lines)
    if result.returncode != 0:
        report.fail(f"pagedcore bench exited {result.returncode}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-check", help="directory for report.md and the benchmark tables")
    parser.add_argument("--steps", type=int, default=200, help="engine steps per decode pass")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out)
    report = Report()
    check_versions(report)
    if not torch.cuda.is_available():
        report.add(
            "GPU checks", ["no CUDA: the GPU tests, the decode run, the sync count and the benchmarks did not run"]
        )
        report.write(out / "report.md", "no CUDA: only the CPU-visible parts ran")
        return 0
    if not args.skip_tests:
        run_gpu_tests(report, timeout=240)
    try:
        engine = check_decode(report, args.steps)
        check_syncs(report, engine)
        engine.close()
    except Exception as exc:  # report it with everything else
        report.add("Decode run", [f"{type(exc).__name__}: {exc}"])
        report.fail(f"the decode run raised {type(exc).__name__}")
    torch.cuda.empty_cache()
    if not args.skip_bench:
        run_bench(report, out, timeout=BUDGET_S - 15 - report.elapsed())
    verdict = "all checks passed" if not report.failures else "FAILED: " + "; ".join(report.failures)
    report.write(out / "report.md", verdict)
    return 0 if not report.failures else 1


if __name__ == "__main__":
    sys.exit(main())
