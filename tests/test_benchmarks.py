"""The benchmark package: every benchmark runs its quick workload on the tiny model and reports, its correctness
checks (greedy outputs compared across peers) really run, and a run writes the report the docs describe.

Nothing here asserts on timings: only that each benchmark runs, counts what it should and renders its markdown.
The real figures come from ``pagedcore bench`` on a quiet machine.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_helpers import ctx, wrong_tokens
from transformers import AutoModelForCausalLM

from pagedcore.benchmarks import BENCHMARKS, BenchOptions, cold, common, engine, memory, peers, prefix, run_benchmarks
from pagedcore.benchmarks.context import BenchContext
from pagedcore.benchmarks.peers import ENGINE, HF_CONTINUOUS, ONE_AT_A_TIME, PADDED_BATCH
from pagedcore.benchmarks.suite import prepare_out_dir
from pagedcore.cli.devices import resolve_device, resolve_dtype
from pagedcore.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    return common.bench_model(size="tiny")


# ---------------------------------------------------------------------------------------------------- models
def test_model_sizes():
    small = common.bench_config(size="small")
    assert (small.hidden_size, small.num_hidden_layers, small.num_attention_heads, small.num_key_value_heads) == (
        512,
        8,
        8,
        2,
    )
    assert small.vocab_size == 32000
    assert common.bench_config().to_dict() == small.to_dict()  # the default is the small model
    quick = common.bench_config(quick=True)
    assert quick.num_hidden_layers < small.num_hidden_layers
    big = common.bench_config(size="1b")
    assert (big.hidden_size, big.num_hidden_layers, big.num_attention_heads, big.num_key_value_heads) == (
        2048,
        16,
        32,
        8,
    )
    with torch.device("meta"):  # count the parameters without allocating 4 GB
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(big).parameters())
    assert 1.0e9 < params < 1.2e9


def test_bench_model_dtype_and_device(tiny):
    half = common.bench_model(size="tiny", dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.device.type == "cpu"
    # the same weights in every dtype: drawn in float32, then converted
    assert torch.equal(half.model.embed_tokens.weight, tiny.model.embed_tokens.weight.to(torch.bfloat16))
    assert common.kv_bytes_per_token(half) * 2 == common.kv_bytes_per_token(tiny)


# ---------------------------------------------------------------------------------------------------- benchmarks
def test_prefix_benchmark_counts_prefill_tokens(tiny):
    result = prefix.run(ctx(tiny))
    assert result.prefill_plain == result.system_tokens * len(result.question_tokens) + sum(result.question_tokens)
    # Block-aligned system prompt: every question after the first reuses all of it.
    assert result.prefill_enabled == result.unique_tokens
    assert len(result.ttft_plain) == len(result.ttft_enabled) == len(result.question_tokens)
    assert result.mismatches == []
    text = result.markdown()
    assert "quick workload" in text and "TTFT speedup" in text
    assert f"identical for all {len(result.question_tokens)} questions" in text


def test_prefix_benchmark_reports_differing_outputs(tiny, monkeypatch):
    real = peers.greedy

    def enabled_differs(model, ids, new, **kwargs):
        out = real(model, ids, new, **kwargs)
        return out if "cache" in kwargs else wrong_tokens(out)  # the enabled mode passes no cache

    monkeypatch.setattr(peers, "greedy", enabled_differs)
    result = prefix.run(ctx(tiny))
    assert result.mismatches == list(range(len(result.question_tokens)))
    assert "**differ** for questions" in result.markdown()


def test_cold_benchmark_runs_every_variant(tiny):
    result = cold.run(ctx(tiny), repeats=1)
    assert set(result.times) == {cold.COLD_DYNAMIC, cold.COLD_PAGED, cold.COLD_PAGED_ATTN}
    assert all(len(t) == 1 for t in result.times.values())
    assert all(result.identical.values())
    assert "time / DynamicCache" in result.markdown()
    assert tiny.config._attn_implementation == "sdpa"  # restored


def test_cold_benchmark_reports_differing_outputs(tiny, monkeypatch):
    real = peers.greedy

    def paged_differs(model, ids, new, **kwargs):
        out = real(model, ids, new, **kwargs)
        return wrong_tokens(out) if isinstance(kwargs.get("cache"), peers.PagedCache) else out

    monkeypatch.setattr(peers, "greedy", paged_differs)
    result = cold.run(ctx(tiny), repeats=1)
    assert result.identical == {cold.COLD_DYNAMIC: True, cold.COLD_PAGED: False, cold.COLD_PAGED_ATTN: False}
    assert result.markdown().count("| **no** |") == 2


def test_memory_benchmark_bytes(tiny):
    result = memory.run(ctx(tiny))
    paged, dynamic, static = (result.ratio(r.cache) for r in result.rows)
    assert 1.0 <= paged <= 1.0 + common.BLOCK_SIZE * len(result.prompt_lengths) / result.stored_tokens
    assert dynamic > paged
    assert static >= dynamic
    assert all(r.identical for r in result.rows)
    assert "reserved / real" in result.markdown()


def test_memory_benchmark_peers_use_the_model_dtype(tiny):
    """The peers' caches follow the model's dtype: half the bytes of float32 in bfloat16."""
    half = common.bench_model(size="tiny", dtype=torch.bfloat16)
    full, low = (memory.run(ctx(m)) for m in (tiny, half))
    assert low.bytes_per_token * 2 == full.bytes_per_token
    for a, b in zip(full.rows, low.rows):
        assert a.reserved_bytes == 2 * b.reserved_bytes, a.cache
    assert "bfloat16" in low.head.model


def test_engine_benchmark_reports_every_peer(tiny, tmp_path, monkeypatch):
    built = []
    real_engine = peers.EnginePeer.engine
    monkeypatch.setattr(peers.EnginePeer, "engine", lambda self, model: built.append(1) or real_engine(self, model))
    result = engine.run(ctx(tiny))
    assert built == [1]  # one Engine for the section, warmed on the workload, as a server keeps one
    names = [p.name for p in result.peers]
    assert names == [ONE_AT_A_TIME, PADDED_BATCH, HF_CONTINUOUS, ENGINE]
    served = result.peer(ENGINE)
    assert served.error is None
    assert served.generated_tokens == sum(result.new_tokens)
    assert served.mismatches == []
    assert served.prefill_computed == result.unique_tokens  # the shared prefix computed once
    assert result.peer(ONE_AT_A_TIME).prefill_computed == result.prompt_tokens
    hf = result.peer(HF_CONTINUOUS)
    assert hf.error is None or hf.error.startswith("n/a (")
    text = result.markdown()
    assert "Engine speedup vs" in text
    assert result.floor is not None and result.floor.tokens == result.unique_tokens + sum(result.new_tokens) - len(
        result.new_tokens
    )
    assert "| Engine wall / compute floor (" in text
    titles = [p.title for p in result.section().panels]
    assert titles == ["wall time (lower is better)", "generated tokens/s (higher is better)"]
    assert tiny.config._attn_implementation == "sdpa"  # the Engine and the continuous batching run restored it


def test_engine_benchmark_reports_a_failing_peer_and_mismatches(tiny, monkeypatch):
    def broken(self, model):
        raise RuntimeError("no GPU kernel for this")

    real = peers.EngineSession.session  # the section's one Engine, kept (peers.kept_engine)

    @contextlib.contextmanager
    def engine_differs(self, model):
        with real(self, model) as serve:

            def differs(batch):
                served = serve(batch)
                served.tokens = [wrong_tokens(t) if i == 3 else t for i, t in enumerate(served.tokens)]
                return served

            yield differs

    monkeypatch.setattr(peers.ContinuousBatching, "session", broken)
    monkeypatch.setattr(peers.EngineSession, "session", engine_differs)
    result = engine.run(ctx(tiny))
    assert result.peer(HF_CONTINUOUS).error == "n/a (RuntimeError: no GPU kernel for this)"
    assert result.peer(ENGINE).mismatches == [3]
    text = result.markdown()
    assert "| transformers continuous batching | n/a (RuntimeError: no GPU kernel for this) |" in text
    assert "greedy tokens differ from one-at-a-time for requests [3]" in text
    assert result.section().panels[0].bar_texts()[2] == "n/a"


def test_core_benchmark_report():
    from pagedcore.benchmarks import core

    result = core.core_benchmark(quick=True, num_seqs=8, seq_tokens=64)
    text = result.markdown()
    assert text.startswith("### 5. Bookkeeping core: blocks, prefix trie, scheduler (quick workload)")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == len(result.figures) == 16
    assert ("Every aim met." in text) == (not result.missed)


# ---------------------------------------------------------------------------------------------------- the package
def test_every_registered_benchmark_has_a_module_with_run():
    for bench in BENCHMARKS.values():
        module = importlib.import_module(f"pagedcore.benchmarks.{bench.module}")
        assert callable(module.run), bench.name


def test_options_check_their_values():
    assert BenchOptions(only=("core", "prefix")).names == ("prefix", "core")
    assert BenchOptions().model_size_name == "small" and BenchOptions(quick=True).model_size_name == "quick"
    assert not BenchOptions(only=("core",)).needs_torch
    for bad, match in [
        ({"threads": 0}, "threads"),
        ({"dtype": "float8"}, "float8"),
        ({"model_size": "7b"}, "7b"),
        ({"only": ("prefix", "nonesuch")}, "nonesuch"),
        ({"only": ()}, "none given"),
        ({"engine_compile": "reduce-overhead"}, "engine compile 'reduce-overhead' is not one of auto, eager"),
    ]:
        with pytest.raises(ConfigError, match=match):
            BenchOptions(**bad)


def test_device_and_dtype_errors_are_config_errors(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="'cuda' is not available"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="not a torch device"):
        resolve_device("gpu")
    assert resolve_device("auto") == torch.device("cpu")

    def unsupported(*args, **kwargs):
        raise RuntimeError("\"baddbmm\" not implemented for 'Half'\nmore detail")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", unsupported)
    with pytest.raises(ConfigError, match='dtype float16 does not compute on cpu: "baddbmm" not implemented'):
        resolve_dtype("float16", torch.device("cpu"))


def test_out_dir_is_checked_before_running(tmp_path):
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "file", tmp_path / "file" / "sub", Path("/proc/pagedcore-bench")):
        with pytest.raises(ConfigError, match=str(bad)):
            prepare_out_dir(bad)
    assert prepare_out_dir(tmp_path / "a" / "b").is_dir()


def test_engine_compile_reaches_every_engine_of_the_run_and_only_that_run(tmp_path, tiny, monkeypatch):
    seen = []
    real = peers.Engine

    def recording(*args, **kwargs):
        seen.append(kwargs["compile"])
        return real(*args, **kwargs)

    monkeypatch.setattr(peers, "Engine", recording)
    options = BenchOptions(quick=True, progress=False, only=("engine",), model_size="tiny", engine_compile="eager")
    markdown = run_benchmarks(options, tmp_path, model=tiny)
    assert seen and set(seen) == {False}
    assert "the Engines' decode steps: eager (`--engine-compile eager`)" in markdown
    assert peers.ENGINE_COMPILE.get() == "auto"  # reset after the run
    with pytest.raises(ConfigError, match="--engine-compile cudagraphs needs CUDA; the run's device is cpu"):
        run_benchmarks(BenchOptions(quick=True, progress=False, only=("prefix",), engine_compile="cudagraphs"))


def test_run_writes_the_report(tmp_path, tiny):
    options = BenchOptions(quick=True, progress=False, only=("memory", "prefix", "core"), model_size="tiny")
    markdown = run_benchmarks(options, tmp_path, model=tiny)
    lines = markdown.splitlines()
    assert lines[0] == "# pagedcore benchmarks (quick workload)"
    assert lines[2].startswith("Run on ") and "torch 2" in lines[2] and "transformers " in lines[2]
    assert lines[4] == (
        "- Device: cpu; dtype: float32; model size: tiny (Llama, random weights: hidden 64, 2 layers, 2 heads / 1 KV "
        "heads, vocab 512); the Engines' decode steps: the Engine's default (eager) (`--engine-compile auto`)"
    )
    assert lines[5] == "- Benchmarks: prefix, memory, core"
    sections = [line for line in lines if line.startswith("### ")]
    assert [s.split(".")[0] for s in sections] == ["### 1", "### 3", "### 5"]
    assert lines[-1] == "![](engine.png)"  # the prefix benchmark's panel
    assert (tmp_path / "results.md").read_text() == markdown
    assert (tmp_path / "engine.png").stat().st_size > 0


def test_the_reports_first_line_gives_the_load_average_at_the_start(tmp_path, monkeypatch):
    """The header says "load average ... at start": read before the sections run (it was read after them, so a run
    that loaded the machine reported its own load as the start's)."""
    from pagedcore.benchmarks import report

    readings = iter(float(n) for n in range(1, 100))
    monkeypatch.setattr(report, "load_average", lambda: next(readings))
    markdown = run_benchmarks(BenchOptions(quick=True, progress=False, only=("core",)), tmp_path)
    assert "; load average 1.00 at start;" in markdown.splitlines()[2]


def test_run_without_chart_panels_writes_no_chart(tmp_path):
    markdown = run_benchmarks(BenchOptions(quick=True, progress=False, only=("core",)), tmp_path)
    assert "- Device, dtype, model: none" in markdown and "engine.png" not in markdown
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.md"]


def test_context_builds_one_model_lazily():
    ctx = BenchContext(BenchOptions(quick=True, model_size="tiny", dtype="bfloat16"))
    assert ctx.model() is ctx.model()
    assert ctx.model().dtype == torch.bfloat16


def test_core_only_run_imports_no_torch(tmp_path):
    code = (
        "import sys; from pagedcore.benchmarks import BenchOptions, run_benchmarks;"
        f"run_benchmarks(BenchOptions(quick=True, progress=False, only=('core',)), {str(tmp_path)!r});"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["bench_memory", "bench_all"])
def test_bench_examples_run(name, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--quick", "--no-progress", "--model-size", "tiny", "--out", str(tmp_path / "out.md")]
    if name == "bench_all":
        argv[-1] = str(tmp_path)
        argv += ["--only", "memory"]
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    assert "### 3. KV memory of a mixed-length batch (quick workload)" in out
    assert (tmp_path / ("results.md" if name == "bench_all" else "out.md")).exists()
