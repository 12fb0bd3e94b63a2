"""Smoke test of the benchmark module: every benchmark runs its quick workload on a tiny model and reports.

Nothing here asserts on timings: only that each benchmark runs, counts what it should and renders its markdown.
The real figures come from ``examples/bench_*.py`` on a quiet machine.
"""

from __future__ import annotations

import pytest

from pagedcore.adapters.transformers import benchmarks as bench

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 512,
}


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny ops on a machine shared with other jobs: one torch thread avoids spinning on descheduled peers.
    with bench.torch_threads(1):
        yield


@pytest.fixture(scope="module")
def tiny():
    return bench.bench_model(quick=True, **TINY)


def test_bench_model_sizes():
    config = bench.bench_config()
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads, config.vocab_size) == (
        512,
        8,
        2,
        32000,
    )
    quick = bench.bench_config(quick=True)
    assert quick.num_hidden_layers < config.num_hidden_layers


def test_prefix_benchmark_counts_prefill_tokens(tiny):
    result = bench.prefix_benchmark(quick=True, progress=False, model=tiny)
    assert result.prefill_plain == result.system_tokens * len(result.question_tokens) + sum(result.question_tokens)
    # Block-aligned system prompt: every question after the first reuses all of it.
    assert result.prefill_enabled == result.unique_tokens
    assert len(result.ttft_plain) == len(result.ttft_enabled) == len(result.question_tokens)
    text = result.markdown()
    assert "quick workload" in text
    assert "TTFT speedup" in text


def test_cold_benchmark_runs_every_variant(tiny):
    result = bench.cold_benchmark(quick=True, progress=False, model=tiny, repeats=1)
    assert set(result.times) == {bench.COLD_DYNAMIC, bench.COLD_PAGED, bench.COLD_PAGED_ATTN}
    assert all(len(t) == 1 for t in result.times.values())
    assert "time / DynamicCache" in result.markdown()
    assert tiny.config._attn_implementation == "sdpa"  # restored


def test_memory_benchmark_bytes(tiny):
    result = bench.memory_benchmark(quick=True, progress=False, model=tiny)
    paged, dynamic, static = (result.ratio(r.cache) for r in result.rows)
    assert 1.0 <= paged <= 1.0 + bench.BLOCK_SIZE * len(result.prompt_lengths) / result.stored_tokens
    assert dynamic > paged
    assert static >= dynamic
    assert "reserved / real" in result.markdown()


@pytest.mark.slow  # transformers' continuous batching starts and stops a thread per run (a few seconds)
def test_engine_benchmark_reports_every_peer(tiny, tmp_path):
    result = bench.engine_benchmark(quick=True, progress=False, model=tiny)
    names = [p.name for p in result.peers]
    assert names == [bench.ONE_AT_A_TIME, bench.PADDED_BATCH, bench.HF_CONTINUOUS, bench.ENGINE]
    engine = result.peer(bench.ENGINE)
    assert engine.error is None
    assert engine.generated_tokens == sum(result.new_tokens)
    assert result.peer(bench.ONE_AT_A_TIME).prefill_computed == result.prompt_tokens
    hf = result.peer(bench.HF_CONTINUOUS)
    assert hf.error is None or hf.error.startswith("n/a (")
    text = result.markdown()
    assert "Engine speedup vs" in text
    bench.write_chart(tmp_path / "engine.png", result)
    assert (tmp_path / "engine.png").stat().st_size > 0
    assert tiny.config._attn_implementation == "sdpa"  # the Engine and the continuous batching run restored it
