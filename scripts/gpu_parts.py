"""The parts of the GPU check that are pagedcore code rather than a command: setup, decode, syncs.

``python scripts/gpu_parts.py PART --result FILE`` runs one and writes ``{"ok", "status", "lines", ...}`` to FILE,
which scripts/gpu_check.py (the driver: caps, budget, report) turns into that part's section. Printed lines go to
the part's log as they happen. Run from anywhere: the repository root goes first on sys.path, so the source tree is
what is imported, as it is for the tests and ``python -m pagedcore`` started from the root.

Without CUDA, ``decode`` and ``syncs`` run the same code on the CPU with a tiny model and a short schedule (a
rehearsal of the code path) and say "no CUDA".
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the source tree, as from the repository root (not scripts/, which Python put first)

import torch  # noqa: E402

SLOW_STEP_MS = 100.0
CPU_STEPS = 26  # without CUDA: two waves of the schedule, on a tiny model


class Result:
    """A part's lines (printed as they come) and failures."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.failures: list[str] = []
        self.extra: dict[str, Any] = {}

    def add(self, *lines: str) -> None:
        """Lines of the section: a bullet each, indented ones (details) as they are."""
        for line in lines:
            print(line, flush=True)
            self.lines.append(line if line.startswith("  ") else f"- {line}")

    def block(self, lines: list[str]) -> None:
        """A fenced block of verbatim lines (a command's output)."""
        print("\n".join(lines), flush=True)
        self.lines += ["", "```", *lines, "```", ""]

    def fail(self, what: str) -> None:
        print(f"FAILED: {what}", flush=True)
        self.failures.append(what)


def cuda() -> bool:
    return torch.cuda.is_available()


# ---------------------------------------------------------------- setup
def loaded_cuda_runtimes() -> list[str]:
    """The CUDA runtime libraries (libcudart) this process has loaded, from /proc/self/maps."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ["(no /proc/self/maps)"]
    return sorted({line.split()[-1] for line in maps.splitlines() if "libcudart.so" in line})


def check_tree(result: Result, carry: Path) -> None:
    """Which pagedcore is imported, which transformers, and whether the carry was built from this tree."""
    import transformers
    from gpu_carry import run_requirements, tree_digest

    import pagedcore

    source = Path(pagedcore.__file__).resolve().parent
    where = "the source tree at the repository root" if source == ROOT / "pagedcore" else "NOT the source tree"
    result.add(f"pagedcore {pagedcore.__version__}: {source} ({where}; working directory {os.getcwd()})")
    if source != ROOT / "pagedcore":
        result.fail(f"pagedcore was imported from {source}, not from the tree at {ROOT}")
    (needed,) = [r for r in run_requirements() if r.name == "transformers"]
    result.add(f"transformers {transformers.__version__}: {Path(transformers.__file__).parent}; pyproject: {needed}")
    if not needed.specifier.contains(transformers.__version__, prereleases=True):
        result.fail(f"transformers {transformers.__version__} is not {needed.specifier}: carry pyproject's floor")
    manifest_file = carry / "MANIFEST.json"
    if not manifest_file.exists():
        result.add(f"carry: no {manifest_file} (nothing carried, or not built by make gpu-carry)")
        return
    manifest = json.loads(manifest_file.read_text())
    fresh = manifest["tree_sha256"] == tree_digest(ROOT)
    result.add(
        f"carry: {', '.join(manifest['wheels'])}; built from commit {manifest.get('commit')} "
        f"(dirty: {manifest.get('dirty')}): {'this tree' if fresh else 'ANOTHER tree: stale'}"
    )
    if not fresh:
        result.fail("the carry was built from another tree than this one: rerun make gpu-carry")


def part_setup(result: Result, args: argparse.Namespace) -> str:
    result.add(f"python: {sys.version.split()[0]} ({sys.executable})")
    if cuda():
        torch.cuda.init()
    result.add(f"CUDA runtimes loaded once torch is imported: {', '.join(loaded_cuda_runtimes()) or 'none'}")
    check_tree(result, args.carry)
    from pagedcore.cli import main as cli
    from pagedcore.plugins.xformers.runtime import preload_result
    from pagedcore.plugins.xformers.status import environment, install_plan, xformers_status

    env = environment()
    status = xformers_status()
    result.add(*env.lines(), f"xformers backend: {'available' if status.available else 'unavailable'}: {status.reason}")
    preload = preload_result()
    if preload is not None:
        what = preload.path or preload.error or ""
        result.add(f"pagedcore's CUDA runtime preload: {preload.needed or '-'}: {preload.action} {what}")
    result.add(f"CUDA runtimes loaded after xformers' import: {', '.join(loaded_cuda_runtimes()) or 'none'}")
    plan = install_plan(env)
    result.add("install plan: nothing to install" if not plan else "install plan:", *[f"  - {step}" for step in plan])
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        code = cli(["plugins"])
    result.add(f"`pagedcore plugins`: exit {code}")
    result.block(output.getvalue().rstrip().splitlines())
    if code != 0:
        result.fail(f"pagedcore plugins exited {code}")
    if cuda() and not status.available:
        result.fail(f"xformers cannot run on this GPU: {status.reason}")
    result.extra = {"cuda": cuda(), "device": env.device_name or "CPU (no CUDA)"}
    return "ok" if cuda() else "ok (no CUDA)"


# ---------------------------------------------------------------- the decode run
class Compiles:
    """Triton JIT compilations (kernel specialisations built or first loaded in this process) by kernel name;
    ``error`` says why they could not be counted (no Triton, or a Triton without the hook)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.error: str | None = None

    def total(self) -> int:
        return sum(self.counts.values())

    def hook(self, *args: Any, **kwargs: Any) -> bool:
        fn = kwargs.get("fn")
        self.counts[str(getattr(fn, "name", None) or getattr(fn, "__name__", "?"))] += 1
        return False  # never claims the compile (a True from a pre-compile hook would skip it)


@contextlib.contextmanager
def triton_compiles() -> Iterator[Compiles]:
    """Count Triton's compilations while the block runs (``knobs.runtime.jit_post_compile_hook`` from Triton 3.3,
    ``JITFunction.compiled_hook`` / ``cache_hook`` before)."""
    compiles = Compiles()
    try:
        import triton

        knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
        if knobs is not None and hasattr(knobs, "jit_post_compile_hook"):
            owner, attr = knobs, "jit_post_compile_hook"
        else:
            from triton.runtime.jit import JITFunction

            owner, attr = JITFunction, "compiled_hook" if hasattr(JITFunction, "compiled_hook") else "cache_hook"
        previous = getattr(owner, attr)
        setattr(owner, attr, compiles.hook)
    except Exception as exc:  # counting is a measurement: its absence is reported, not fatal
        compiles.error = f"{type(exc).__name__}: {exc}"
        yield compiles
        return
    try:
        yield compiles
    finally:
        setattr(owner, attr, previous)


def build_model() -> tuple[Any, torch.device, torch.dtype]:
    """On CUDA a random Llama with Llama-3.2-1B's shapes in bf16 (built on the GPU); on the CPU a tiny one in fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda() else (torch.device("cpu"), torch.float32)
    shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32)
    shape.update(num_key_value_heads=8, head_dim=64, vocab_size=128256)
    if not cuda():
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        shape.update(num_key_value_heads=2, head_dim=16, vocab_size=1000)
    config = LlamaConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=True)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    return model, device, dtype


def engine_of(model: Any, compile: bool | str = "auto") -> Any:
    """The check's Engine over ``model`` (``compile``: the Engine's option)."""
    from pagedcore.adapters.transformers import Engine

    budget = "24GiB" if cuda() else "64MiB"  # a 1B model in bf16 leaves most of an H200 free
    return Engine(
        model,
        memory_budget=budget,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        compile=compile,
    )


def model_and_engine() -> tuple[Any, torch.device, torch.dtype]:
    """:func:`build_model` and its Engine (the default ``compile``)."""
    model, device, dtype = build_model()
    return engine_of(model), device, dtype


def schedule(steps: int, seed: int) -> list[list[tuple[int, int]]]:
    """Per step, the requests ``(prompt length, new tokens)`` that arrive: waves that grow and shrink the batch."""
    rng = random.Random(seed)
    longest, most, waves = (1500, 180, (1, 4, 12, 24, 40)) if cuda() else (40, 12, (1, 2, 4, 6, 8))
    arrivals: list[list[tuple[int, int]]] = [[] for _ in range(steps)]
    for step in range(0, steps, 25):
        for _ in range(rng.choice(waves)):
            arrivals[min(steps - 1, step + rng.randrange(5))].append((rng.randint(16, longest), rng.randint(8, most)))
    return arrivals


def decode_pass(
    engine: Any, arrivals: list[list[tuple[int, int]]], token_seed: int
) -> tuple[list[Any], Compiles, dict[int, list[int]]]:
    """Run the schedule, then until every request finished; per scheduled step ``(milliseconds, running sequences,
    Triton compilations)``, the pass's compilations (the steps that finish the requests count too), and each
    request's tokens by arrival order."""
    from pagedcore.adapters.transformers import SamplingParams

    generator = torch.Generator().manual_seed(token_seed)
    rows = []
    order: dict[str, int] = {}
    tokens: dict[int, list[int]] = {}

    def keep(finished: list[Any]) -> None:
        for out in finished:
            tokens[order[out.request_id]] = list(out.token_ids)

    with triton_compiles() as compiles:
        for wave in arrivals:
            for prompt_len, new_tokens in wave:
                prompt = torch.randint(10, 1000, (prompt_len,), generator=generator).tolist()
                request_id = engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
                order[str(request_id)] = len(order)
            before = compiles.total()
            start = time.perf_counter()
            keep(engine.step())
            if cuda():
                torch.cuda.synchronize()
            rows.append(((time.perf_counter() - start) * 1e3, engine.scheduler.num_running, compiles.total() - before))
        while engine.has_unfinished():
            keep(engine.step())
    return rows, compiles, tokens


def two_passes(
    result: Result, engine: Any, arrivals: list[list[tuple[int, int]]], prefix: str
) -> tuple[list[Any], Compiles, dict[int, list[int]]]:
    """The warm-up pass and the measured one (other prompts, same shapes), each reported with its seconds; the
    measured pass's rows, compilations and tokens."""
    for name, token_seed in (("warm-up", 1), ("measured", 2)):
        started = time.perf_counter()
        rows, compiles, tokens = decode_pass(engine, arrivals, token_seed)
        line, slow = pass_line(f"{prefix}{name}", rows, compiles)
        result.add(f"{line} ({time.perf_counter() - started:.1f} s)", *slow)
    return rows, compiles, tokens


def median_ms(rows: list[tuple[float, int, int]]) -> float:
    """The median step time of a pass."""
    times = sorted(ms for ms, _, _ in rows)
    return times[len(times) // 2]


def pass_line(name: str, rows: list[tuple[float, int, int]], compiles: Compiles) -> tuple[str, list[str]]:
    """One line of a pass's step times and compilations, and the slow steps (over SLOW_STEP_MS)."""
    times = sorted(ms for ms, _, _ in rows)
    slow = [(i, ms, n) for i, (ms, n, _) in enumerate(rows) if ms > SLOW_STEP_MS]
    line = (
        f"{name}: {len(rows)} steps, batch {min(n for _, n, _ in rows)}-{max(n for _, n, _ in rows)}, "
        f"median {times[len(times) // 2]:.1f} ms, p90 {times[int(len(times) * 0.9)]:.1f} ms, max {times[-1]:.1f} ms; "
        f"{len(slow)} steps over {SLOW_STEP_MS:.0f} ms; "
        + (
            f"{compiles.total()} Triton compilations"
            if compiles.error is None
            else f"compilations not counted ({compiles.error})"
        )
    )
    return line, [f"  - slow step {i}: {ms:.1f} ms, {n} running" for i, ms, n in slow[:10]]


def part_decode(result: Result, args: argparse.Namespace) -> str:
    steps = args.steps if cuda() else min(args.steps, CPU_STEPS)
    began = time.perf_counter()
    model, device, dtype = build_model()
    built = time.perf_counter()
    engine = engine_of(model)
    backend = engine.pool.attention_backend(device, dtype)
    result.add(f"model: random Llama ({'1B shapes, bf16' if cuda() else 'tiny, fp32, CPU'}); {steps} steps a pass")
    result.add(
        f"model built in {built - began:.1f} s, Engine in {time.perf_counter() - built:.1f} s; pool block size "
        f"{engine.pool.block_size}; attention backend {backend.name}; decode steps eager (compile='auto')"
    )
    arrivals = schedule(steps, seed=0)
    with engine:
        rows, compiles, eager_tokens = two_passes(result, engine, arrivals, "")
        eager_median = median_ms(rows)
        stats = getattr(backend, "stats", None)
        if stats is not None:
            result.add(stats_line(stats))
            if stats.kernel_failures:
                result.fail(f"{stats.kernel_failures} xformers kernel failures fell back to torch")
        if engine.pool.kv.num_used_blocks:
            result.fail(f"{engine.pool.kv.num_used_blocks} blocks still used after every request finished")
    if compiles.total():
        result.fail(f"{compiles.total()} Triton compilations after warm-up (aim: 0): {dict(compiles.counts)}")
    graphs_status = decode_graphs_passes(result, model, arrivals, eager_median, eager_tokens)
    status = "ok" if cuda() else "no CUDA: rehearsed on CPU (tiny model)"
    status = status if compiles.error is None or not cuda() else f"{status}; Triton compilations not counted"
    return f"{status}; {graphs_status}"


def decode_graphs_passes(
    result: Result, model: Any, arrivals: list[list[tuple[int, int]]], eager_median: float,
    eager_tokens: dict[int, list[int]],
) -> str:  # fmt: skip
    """The same schedule with ``compile="cudagraphs"`` (decode steps replayed as CUDA graphs): a pass that captures
    the buckets, then the measured one; step times against the eager pass, the graphs' counters, and how many
    requests' tokens differ from the eager pass's (bf16: the graphs' attention is the torch backend's arithmetic,
    the eager steps' xformers', so a few near-ties may go the other way; reported, not failed)."""
    if not cuda():  # nothing to capture: this code runs with a stand-in that replays by calling the step again
        from pagedcore.adapters.transformers import decode_graphs

        decode_graphs.CAPTURE = decode_graphs.ReplayCapture
    started = time.perf_counter()
    engine = engine_of(model, "cudagraphs")
    with engine:
        rows, _, tokens = two_passes(result, engine, arrivals, "graphs ")
        counts = engine.stats()
        if engine.pool.kv.num_used_blocks:
            result.fail(f"CUDA graphs: {engine.pool.kv.num_used_blocks} blocks still used at the end")
    differing = sum(tokens.get(i) != eager_tokens.get(i) for i in set(tokens) | set(eager_tokens))
    result.add(
        f"CUDA graphs: median step {median_ms(rows):.1f} ms vs eager {eager_median:.1f} ms "
        f"({eager_median / max(median_ms(rows), 1e-9):.2f}x); {counts.compiled_graphs} graphs captured for "
        f"{counts.compiled_buckets} buckets, {counts.compiled_steps} steps replayed, {counts.compile_failures} "
        f"capture failures; requests whose tokens differ from the eager pass: {differing} of {len(eager_tokens)}; "
        f"{time.perf_counter() - started:.1f} s in all"
    )
    if not cuda():
        return "CUDA graphs rehearsed with a stand-in capture (no CUDA)"
    if counts.compile_failures or not counts.compiled_steps:
        result.fail("CUDA graphs: the capture failed, the steps ran eagerly (see engine.log)")
        return "CUDA graphs FAILED"
    return f"CUDA graphs {eager_median / max(median_ms(rows), 1e-9):.2f}x eager"


def stats_line(stats: Any) -> str:
    """The xformers backend's counters (:class:`~pagedcore.plugins.xformers.backend.XFormersStats`)."""
    return (
        f"backend stats: {stats.metadata_builds} metadata builds, {stats.support_checks} support checks, "
        f"{stats.kernel_failures} kernel failures, {stats.torch_forwards} torch forwards, "
        f"{len(stats.launch_shapes)} paged launch shapes"
    )


# ---------------------------------------------------------------- host-device syncs
def count_syncs(engine: Any, backend: Any, steps: int) -> tuple[list[warnings.WarningMessage], list[int]]:
    """Warnings of ``torch.cuda.set_sync_debug_mode("warn")`` over ``steps`` engine steps, and per step the syncs
    inside the first attention call."""
    original = backend.forward
    per_call: list[int] = []
    first_layer: list[int] = []
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")

        def counting_forward(*args: Any, **kwargs: Any) -> Any:
            before = len(records)
            out = original(*args, **kwargs)
            per_call.append(len(records) - before)
            return out

        backend.forward = counting_forward
        if cuda():
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                per_call.clear()
                engine.step()
                first_layer.append(per_call[0] if per_call else -1)
        finally:
            if cuda():
                torch.cuda.set_sync_debug_mode("default")
            del backend.forward
    return [w for w in records if "synchroniz" in str(w.message).lower()], first_layer


def part_syncs(result: Result, args: argparse.Namespace) -> str:
    from pagedcore.adapters.transformers import SamplingParams

    engine, device, dtype = model_and_engine()
    backend = engine.pool.attention_backend(device, dtype)
    steps = 3
    with engine:
        for n in range(8):
            engine.add_request(list(range(100 + n, 400 + n)), SamplingParams(max_new_tokens=16, ignore_eos=True))
        for _ in range(4):  # the prompts (2400 tokens: two steps), then decode steps whose shapes are warm
            engine.step()
        syncs, first_layer = count_syncs(engine, backend, steps)
        while engine.has_unfinished():
            engine.step()
    per_step = len(syncs) / steps
    result.add(f"{per_step:.1f} syncs per decode step ({len(syncs)} over {steps} steps, 8 sequences, {backend.name})")
    result.add(f"inside the first layer's attention, per step: {first_layer}")
    per_line = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    result.add(*[f"  - {where}: {count}" for where, count in per_line.most_common(12)])
    if not cuda():
        return "no CUDA: rehearsed on CPU (no syncs to count)"
    if per_step > 2:
        result.fail(f"{per_step:.1f} host-device syncs per decode step (aim: <= 2)")
    return "ok"


PARTS = {"setup": part_setup, "decode": part_decode, "syncs": part_syncs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=list(PARTS))
    parser.add_argument("--result", type=Path, required=True, help="where to write the part's outcome (JSON)")
    parser.add_argument("--carry", type=Path, default=ROOT / "carry")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    result = Result()
    try:
        status = PARTS[args.part](result, args)
    except Exception as exc:  # the part's outcome, with everything it printed so far
        import traceback

        traceback.print_exc()
        result.fail(f"{type(exc).__name__}: {exc}")
        status = "raised"
    if result.failures:
        status = "FAILED: " + "; ".join(result.failures)
    outcome = {"ok": not result.failures, "status": status, "lines": result.lines, **result.extra}
    args.result.write_text(json.dumps(outcome, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
