"""The performance-round benchmarks (decode, chat, host, scaling), the compute floor and the profiling tools: each runs
its small workload on the tiny model, its correctness checks (greedy outputs compared across caches and peers)
really run and catch a difference, its counts are right and its report has the structure the docs describe.

Nothing here asserts on timings; figures come from ``pagedcore bench`` on a quiet machine.
"""

from __future__ import annotations

import pytest
import torch
from bench_helpers import ctx, wrong_tokens
from transformers import AutoModelForCausalLM

from pagedcore.benchmarks import (
    BenchOptions,
    chat,
    common,
    decode,
    engine,
    host,
    peers,
    profiles,
    run_benchmarks,
    scaling,
)
from pagedcore.benchmarks.floor import ModelShape, compute_floor, segments_flops
from pagedcore.benchmarks.peers import EnginePeer, EngineSession
from pagedcore.benchmarks.report import Header
from pagedcore.benchmarks.runner import TokenStamps
from pagedcore.benchmarks.steps import Forward, ForwardLog, logging_forwards

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    return common.bench_model(size="tiny")


# ---------------------------------------------------------------------------------------------------- compute floor
def test_floor_counts_the_models_own_matmuls():
    """The FLOPs per token are twice the multiply-adds of the model's own linear layers."""
    config = common.bench_config(size="small")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_config(config)
    layer_weights = sum(
        module.weight.numel()
        for name, module in model.model.layers.named_modules()
        if isinstance(module, torch.nn.Linear)
    )
    assert shape.linear_flops_per_token == 2 * layer_weights
    assert shape.head_flops == 2 * model.lm_head.weight.numel()
    # attention: the token at position p attends to p + 1 keys, in every layer and head
    per_key = 4 * shape.layers * shape.heads * shape.head_dim
    assert shape.attention_flops(100, 7) == per_key * sum(p + 1 for p in range(100, 107))


def test_floor_of_the_engine_workload_counts_every_computed_position_once(tiny):
    prefix_len, prompts, news, _ = engine.shared_prefix_workload(True, tiny.config.vocab_size)
    own = [len(p) - prefix_len for p in prompts]
    segments = engine.shared_prefix_segments(prefix_len, own, news)
    assert sum(s.count for s in segments) == prefix_len + sum(own) + sum(n - 1 for n in news)
    assert sum(s.logits for s in segments) == sum(news)  # one row of logits per generated token
    floor = compute_floor(tiny, segments, rows=16, repeats=1)
    assert floor.tokens == prefix_len + sum(own) + sum(n - 1 for n in news)
    assert floor.flops == segments_flops(ModelShape.from_config(tiny.config), segments)
    assert floor.seconds > 0 and "GFLOP/s" in floor.describe()


def test_engine_report_shows_the_floor_ratio():
    peers = [engine.PeerResult(name, wall=6.0, generated_tokens=8) for name in engine.AIM_ENGINE_SPEEDUP]
    peers.append(engine.PeerResult(engine.ENGINE, wall=3.0, generated_tokens=8))
    result = engine.EngineResult(Header(True, "Llama", "laptop"), 16, [4], [8], peers, "", "",
                                 floor=engine.ComputeFloor(flops=2e9, rate=1e9, rows=512, tokens=27))  # fmt: skip
    assert result.floor_ratio() == 1.5
    text = result.markdown()
    assert "| Engine wall / compute floor (2.00 s) | 1.50x | ≤ 1.7x | met |" in text
    assert "- Compute floor: the FLOPs of the positions" in text


# ---------------------------------------------------------------------------------------------------- decode
def test_narrow_model_is_the_small_models_16k_variant():
    with torch.device("meta"):
        small = AutoModelForCausalLM.from_config(common.bench_config(size="small"))
    config = decode.narrow_model(common.bench_model(size="tiny")).config
    assert (config.num_hidden_layers, config.vocab_size) == (1, 256)
    assert max(1, small.config.num_hidden_layers * 3 // 4) == 6 and small.config.vocab_size // 2 == 16000


def test_decode_benchmark_runs_every_cache_on_both_models(tiny):
    result = decode.run(ctx(tiny, quick=False), contexts=(48, 80), new_tokens=4, repeats=2)
    assert [(p.model, p.context) for p in result.points] == [
        ("2 layers, vocab 512", 48),
        ("2 layers, vocab 512", 80),
        ("1 layers, vocab 256", 48),
        ("1 layers, vocab 256", 80),
    ]
    for point in result.points:
        assert all(len(point.times[v]) == 2 and min(point.times[v]) > 0 for v in decode.VARIANTS)
        assert all(point.identical.values()), point
    text = result.markdown()
    assert text.startswith("### 6. Decode time per token")
    assert text.count("| context | DynamicCache | StaticCache |") == 2
    assert text.count("| yes (all four) |") == 4
    (chart,) = result.section().line_charts
    title, panels = chart.title, chart.panels
    assert chart.file == "decode.png"
    assert [len(p.curves) for p in panels] == [4, 4] and "batch 1" in title
    assert [c.xs for c in panels[0].curves] == [[48, 80]] * 4
    assert tiny.config._attn_implementation == "sdpa"  # restored


def test_decode_benchmark_reports_differing_outputs(tiny, monkeypatch):
    real = peers.greedy

    def paged_differs(model, ids, new, **kwargs):
        out = real(model, ids, new, **kwargs)
        return wrong_tokens(out) if isinstance(kwargs.get("cache"), peers.PagedCache) else out

    monkeypatch.setattr(peers, "greedy", paged_differs)
    result = decode.run(ctx(tiny, quick=False), contexts=(48,), new_tokens=4, repeats=1)
    for point in result.points:
        assert point.identical == {decode.DYNAMIC: True, decode.STATIC: True, decode.PAGED_SDPA: False,
                                   decode.PAGED_ATTN: False}  # fmt: skip
    assert result.markdown().count(f"**no**: {decode.PAGED_SDPA}, {decode.PAGED_ATTN}") == 2


def test_decode_time_is_per_decode_step():
    stamps = TokenStamps()
    stamps.put("prompt")
    assert stamps.stamps == []
    for t in range(3):
        stamps.put(t)
    assert len(stamps.stamps) == 3
    stamps.stamps = [10.0, 10.5, 11.0]
    assert stamps.per_decode_step() == 0.5
    with pytest.raises(ValueError, match="two generated tokens"):
        TokenStamps().per_decode_step()


# ---------------------------------------------------------------------------------------------------- chat
def test_chat_benchmark_reuses_earlier_turns_and_matches_the_padded_batch(tiny):
    result = chat.run(ctx(tiny))
    w = result.workload
    assert result.mismatches() == []
    padded, served = result.run(chat.PADDED), result.run(chat.ENGINE)
    assert len(padded.walls) == len(served.walls) == result.repeats
    # the padded batch computes every prompt of every turn
    replies = padded.replies
    for t in range(w.turns):
        assert padded.prefill_per_turn[t] == sum(len(w.prompt(c, t, replies[c])) for c in range(w.conversations))
    # the Engine computes the system prompt once and, later, what no earlier turn computed, up to a partial block
    assert served.prefill_per_turn[0] == len(w.system) + sum(len(w.users[c][0]) for c in range(w.conversations))
    for t in range(1, w.turns):
        new = sum(len(w.users[c][t]) + 1 for c in range(w.conversations))
        assert new <= served.prefill_per_turn[t] <= new + (common.BLOCK_SIZE - 1) * w.conversations
    assert all(len(r) == n for conv, lens in zip(replies, w.replies) for r, n in zip(conv, lens))
    # exactly the unique tokens: a turn continuing the previous reply inside a block reuses that block's cached
    # positions (token-granular prefix reuse), so the previous turns' partly filled last blocks are not computed again
    assert w.partial_block_tokens(served.replies, common.BLOCK_SIZE) > 0  # the workload has such blocks
    assert sum(served.prefill_per_turn) == w.unique_prompt_tokens
    text = result.markdown()
    assert "| Engine prefill positions / unique prompt tokens | 1.000 |" in text
    assert text.startswith("### 7. Multi-turn chat (quick workload)")
    assert "| replies identical to the padded batch's | yes | all | met |" in text
    for t in range(w.turns):
        assert f"| {t} | {padded.prefill_per_turn[t]} | {served.prefill_per_turn[t]} |" in text


def test_chat_benchmark_keeps_one_engine_and_meets_each_round_with_no_cached_prefix(tiny, monkeypatch):
    """One Engine for the section, warmed on the chat itself, its cached prefixes forgotten before each round (as the
    peers section's): a new Engine per round timed its first steps' trials, and with --engine-compile the compiler,
    in every round."""
    built, prefills = [], []
    real_engine, real_serve = EnginePeer.engine, EngineSession.serve
    monkeypatch.setattr(EnginePeer, "engine", lambda self, model: built.append(1) or real_engine(self, model))
    monkeypatch.setattr(EngineSession, "serve", lambda self, batch: prefills.append(real_serve(self, batch)) or
                        prefills[-1])  # fmt: skip
    result = chat.run(ctx(tiny), repeats=2)
    assert built == [1] and result.mismatches() == []
    turns = result.workload.turns
    per_run = [[s.prefill for s in prefills[i : i + turns]] for i in range(0, len(prefills), turns)]
    # the warm-up on the chat itself, then two timed rounds: each computes the same positions as a new Engine would
    assert len(per_run) == 3 and per_run[0] == per_run[1] == per_run[2] == result.run(chat.ENGINE).prefill_per_turn


def test_chat_report_names_the_first_differing_reply():
    workload = chat.ChatWorkload(system=[5] * 4, users=[[[6], [7]], [[8], [9]]], replies=[[1, 1], [1, 1]])
    padded = chat.ChatRun(chat.PADDED, [2.0], [[[3], [4]], [[5], [6]]], [10, 12])
    served = chat.ChatRun(chat.ENGINE, [1.0], [[[3], [4]], [[5], [7]]], [6, 4])
    text = chat.ChatResult(Header(False, "Llama", "laptop"), workload, [padded, served], 1, "").markdown()
    assert "| replies identical to the padded batch's | no: 1 differ | all | **missed** |" in text
    assert "First differing reply: conversation 1, turn 1." in text


# ---------------------------------------------------------------------------------------------------- host
@pytest.fixture(scope="module")
def host_result(tiny):
    return host.run(ctx(tiny), contexts=(64,), seqs=(1, 4), timed_steps=3)


def test_host_benchmark_times_decode_steps_of_both_peers(host_result):
    assert [(p.context, p.seqs) for p in host_result.points] == [(64, 1), (64, 4)]
    for point in host_result.points:
        assert set(point.times) == {host.ENGINE, host.HF}, point.skipped
        for times in point.times.values():
            assert times.steps >= 3 and min(times.host) > 0 and min(times.forward) > 0
        assert point.identical() is True
        engine = point.times[host.ENGINE]
        assert set(engine.stages) == {"schedule", "prepare", "forward", "sample", "record"}
        assert all(len(values) == engine.steps for values in engine.stages.values()) and engine.stages_host_ms > 0
    text = host_result.markdown()
    assert text.startswith("### 8. Host overhead per decode step (quick workload)")
    assert text.count("| 64 | ") == 2 and "| yes |" in text


def test_host_benchmark_skips_transformers_where_it_is_too_slow(tiny, monkeypatch):
    monkeypatch.setattr(host, "HF_LIMIT", 1 * 1 * 64)
    result = host.run(ctx(tiny, quick=False), contexts=(64,), seqs=(1, 2), timed_steps=2)
    one, two = result.points
    assert set(one.times) == {host.ENGINE, host.HF}
    assert set(two.times) == {host.ENGINE} and two.skipped[host.HF] == "not run (2² x 64 > 64² x 512)"
    assert two.identical() is None
    assert "| not run (2² x 64 > 64² x 512) |" in result.markdown()


def test_host_benchmark_runs_at_the_models_full_context(tiny):
    """A context equal to the model's 4096 positions: the prompts leave room for the decode steps."""
    assert tiny.config.max_position_embeddings == 4096
    result = host.run(ctx(tiny, quick=False), contexts=(4096,), seqs=(2,), timed_steps=2, with_transformers=False)
    (point,) = result.points
    assert point.skipped == {} and point.times[host.ENGINE].steps >= 2


def test_host_report_flags_a_missed_aim():
    slow = host.HostPoint(512, 64, {host.ENGINE: host.StepTimes([0.1] * 3, [0.002] * 3)})
    result = host.HostResult(Header(False, "Llama", "laptop"), [slow], 3, 2, "")
    assert result.missed() == ["64 sequences at 512: 2.00 ms"]
    assert "| ≤ 1 ms | **missed** |" in result.markdown()


def test_forward_log_finds_consecutive_decode_steps(tiny):
    log = ForwardLog(tiny)
    log.close()
    # prefill (10 positions from 0), then decode steps of 2 sequences from position 10 on, one mixed step
    log.forwards = [Forward(0.0, 1.0, 10, 0), Forward(1.1, 1.2, 2, 10), Forward(1.5, 1.6, 2, 11),
                    Forward(1.8, 1.9, 3, 9), Forward(2.0, 2.1, 2, 12), Forward(2.2, 2.3, 2, 13)]  # fmt: skip
    times = log.decode_steps(2, from_position=10)
    assert times.host == pytest.approx([0.3, 0.1]) and times.forward == pytest.approx([0.1, 0.1])
    assert log.decode_steps(2, from_position=10, skip=1).steps == 1
    with logging_forwards(tiny) as live, torch.inference_mode():
        tiny(torch.tensor([[5, 6]]), position_ids=torch.tensor([[7, 8]]))
    assert [(f.tokens, f.first_position) for f in live.forwards] == [(2, 7)]


# ---------------------------------------------------------------------------------------------------- scaling
def test_scaling_benchmark_measures_every_point(tiny):
    result = scaling.run(ctx(tiny))
    assert [(p.sweep, p.requests, p.prompt) for p in result.points] == [
        *[(scaling.REQUESTS, n, 32) for n in (4, 8, 16, 32)],
        *[(scaling.PROMPTS, 4, n) for n in (32, 64, 128, 256)],
    ]
    for p in result.points:
        assert p.wall is not None and p.steps > 0 and 0 < p.busy < p.wall
        stored = p.requests * (p.prompt + p.new - 1) * result.kv_bytes_per_token
        assert stored <= p.kv_peak <= stored + p.requests * common.BLOCK_SIZE * result.kv_bytes_per_token
    text = result.markdown()
    assert text.startswith("### 9. Scaling: requests and prompt length (quick workload)")
    assert text.count("| requests | ") == 4 + 1 and text.count("| prompt length | ") == 4
    assert [(c.file, len(c.panels)) for c in result.section().line_charts] == [("scaling.png", 8)]


def test_scaling_prompts_stop_at_the_models_positions(tiny):
    """A 4096-token prompt point on a model of 4096 positions runs with room for its new tokens."""
    result = scaling.run(ctx(tiny, quick=False), requests=(2,), prompt_lens=(256, 4096))
    assert [(p.sweep, p.requests, p.prompt) for p in result.points] == [
        (scaling.REQUESTS, 2, 128),
        (scaling.PROMPTS, 8, 256),
        (scaling.PROMPTS, 8, 4096 - 16),
    ]
    assert all(p.wall is not None for p in result.points), [p.skipped for p in result.points]


def test_scaling_point_that_fails_keeps_its_row(tiny, monkeypatch):
    def refuse(model, point, prompts):
        raise RuntimeError("2 requests failed: out of blocks")

    monkeypatch.setattr(scaling, "_run_point", refuse)
    result = scaling.run(ctx(tiny), requests=(2,), prompt_lens=(32,))
    assert [p.skipped for p in result.points] == ["n/a (RuntimeError: 2 requests failed: out of blocks)"] * 2
    assert result.markdown().count("| n/a (RuntimeError: 2 requests failed: out of blocks) |") == 2


def test_scaling_benchmark_skips_points_over_its_budget(tiny):
    result = scaling.run(ctx(tiny), point_budget=0.0)
    assert all(p.wall is None and p.skipped.startswith("skipped: about") for p in result.points)
    assert result.markdown().count("| skipped: about ") == len(result.points)
    panels = result.section().line_charts[0].panels
    assert all(c.points() == [] for panel in panels for c in panel.curves)


# ---------------------------------------------------------------------------------------------------- profiles
def test_profile_summary_of_pyspy_raw_output(tmp_path, capsys):
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "<module> (pagedcore/benchmarks/profiles.py:9);generate (transformers/generation/utils.py:2);"
        "update (/x/pagedcore/pagedcore/adapters/transformers/cache.py:250);index_copy (libtorch_cpu.so) 30\n"
        "<module> (pagedcore/benchmarks/profiles.py:9);generate (transformers/generation/utils.py:2);"
        "_prefill (transformers/generation/utils.py:4283) 50\n"
        "<module> (pagedcore/benchmarks/profiles.py:9);generate (transformers/generation/utils.py:2) 10\n"
    )
    assert profiles.main(["summarize", str(raw), "--exclude", "_prefill"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("40 samples")
    assert "| `pagedcore/adapters/transformers/cache.py:update` | 75.0% | 75.0% |" in out
    assert "| `transformers/generation/utils.py:generate` | 25.0% | 100.0% |" in out
    assert "_prefill" not in out


def test_profile_scenarios_run(tiny, capsys):
    assert profiles.main(["run", "engine-decode", "--model-size", "tiny", "--seqs", "3", "--context", "64",
                          "--steps", "4"]) == 0  # fmt: skip
    assert capsys.readouterr().out.strip() == "engine-decode: 6 steps"
    tokens = {c: profiles.decode_scenario(tiny, c, 48, 4) for c in profiles.CACHES}
    assert all(t == tokens["dynamic"] and len(t) == 4 for t in tokens.values())


# ---------------------------------------------------------------------------------------------------- the run
def test_run_writes_the_line_charts(tmp_path, tiny):
    options = BenchOptions(quick=True, progress=False, only=("scaling", "decode"), model_size="tiny")
    markdown = run_benchmarks(options, tmp_path, model=tiny)
    sections = [line.split(".")[0] for line in markdown.splitlines() if line.startswith("### ")]
    assert sections == ["### 6", "### 9"]
    assert "![decode time per token](decode.png)" in markdown and "![scaling](scaling.png)" in markdown
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode.png", "results.md", "scaling.png"]
    assert min(p.stat().st_size for p in tmp_path.iterdir()) > 0
