"""The roofline floor of ``pagedcore bench`` (``benchmarks/roofline.py``): the steps a workload needs, the bytes each
step must move, the machine's two limits, and the sections that report Engine figures as ratios to it. Nothing here
asserts on timings."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedcore.benchmarks import chat, common, engine, native
from pagedcore.benchmarks import roofline as roofline_module
from pagedcore.benchmarks.floor import ModelShape, Segment, segments_flops
from pagedcore.benchmarks.peers import Batch
from pagedcore.benchmarks.report import Header
from pagedcore.benchmarks.roofline import (
    MachineLimits,
    Request,
    machine_limits,
    memory_bandwidth,
    roofline,
    serving_steps,
    step_bytes,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    return common.bench_model(size="tiny")


def test_a_step_moves_every_linear_weight_once_but_not_the_embedding():
    """The weights a step reads are the model's own linear layers and LM head (counted from the real modules)."""
    config = common.bench_config(size="small")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    shape = ModelShape.from_config(config)
    kv_per_position = config.num_hidden_layers * 2 * config.num_key_value_heads * shape.head_dim * 4
    empty = step_bytes(shape, [Segment(0, 0, 0)])
    assert empty == 4 * linear  # the lm_head is a Linear; the embedding is only looked up
    # one decode row at position 99: its 100 keys and values read, one row of float32 logits written
    assert step_bytes(shape, [Segment(99, 1, 1)]) == 4 * linear + 100 * kv_per_position + 4 * config.vocab_size


def test_serving_steps_compute_each_position_once_and_decode_one_row_per_request_and_token():
    requests = [Request(544, 64), *[Request(520 + i, 16 + i, cached=512) for i in range(31)]]
    steps = serving_steps(requests, budget=512)
    computed = sum(s.count for step in steps for s in step)
    assert computed == sum(r.uncached for r in requests) + sum(r.new - 1 for r in requests)
    assert sum(s.logits for step in steps for s in step) == sum(r.new for r in requests)
    assert all(sum(s.count for s in step) <= 512 for step in steps)
    assert steps[0] == [Segment(0, 512, 0)]  # the prompts come first, in budget-sized chunks
    decode = steps[-63:]
    assert [len(step) for step in decode[:1]] == [32] and len(decode[-1]) == 1  # the longest request alone at the end


def test_roofline_is_the_larger_limit_per_step(tiny):
    shape = ModelShape.from_config(tiny.config)
    requests = [Request(64, 8)] * 4
    steps = serving_steps(requests)
    flops = sum(segments_flops(shape, s) for s in steps)
    moved = sum(step_bytes(shape, s) for s in steps)
    slow_memory = roofline(tiny, requests, MachineLimits(rate=1e15, bandwidth=1.0, rows=512))
    slow_compute = roofline(tiny, requests, MachineLimits(rate=1.0, bandwidth=1e15, rows=512))
    assert slow_memory.seconds == pytest.approx(moved) and slow_memory.memory_bound == len(steps)
    assert slow_compute.seconds == pytest.approx(flops) and slow_compute.memory_bound == 0
    both = roofline(tiny, requests, MachineLimits(rate=1e9, bandwidth=1e9, rows=512))
    assert max(both.compute_seconds, both.memory_seconds) <= both.seconds <= both.compute_seconds + both.memory_seconds


def test_machine_limits_are_measured(tiny):
    limits = machine_limits(tiny, rows=16, repeats=1)
    assert limits.rate > 0 and limits.bandwidth > 0
    assert memory_bandwidth(mib=4, repeats=1) > 0
    assert "GFLOP/s" in limits.describe() and "GB/s" in limits.describe()


def test_machine_limits_are_timed_with_the_clock_given(tiny):
    """``clock`` (wall time by default, ``time.thread_time`` in scripts/roofline_check.py on a loaded machine) times
    every pass: with a clock that advances one second per reading, each timed pass takes exactly one second."""

    class Ticks:
        now = 0.0

        def __call__(self) -> float:
            self.now += 1.0
            return self.now

    shape = ModelShape.from_config(tiny.config)
    flops = sum(2 * 16 * out * inp for out, inp in shape.weight_shapes())
    limits = machine_limits(tiny, rows=16, repeats=1, clock=Ticks())
    assert limits.rate == pytest.approx(flops)
    assert memory_bandwidth(mib=4, repeats=1, clock=Ticks()) == pytest.approx(2 * 4 * 2**20)


def test_peers_report_engine_and_ctranslate2_over_the_floor():
    aim = native.Aim(1.2, fmt="{:g}x")
    w = native.PeerWorkload("batch 1", Batch([[5, 6]], [3]), Batch([[7, 8]], [2]), floor_aim=aim)
    runs = {name: native.PeerRuns(name, [2.0 if name == native.ENGINE else 1.0]) for name in native.PEERS}
    floor = roofline(common.bench_model(size="tiny"), w.requests(), MachineLimits(1e9, 1e9, 512))
    row = native.WorkloadRuns(w, runs, floor=floor)
    result = native.PeersResult(Header(True, "Llama", "laptop"), [row], repeats=1, threads=1)
    text = result.markdown()
    assert "**Roofline floor**" in text and "Roofline floor: the workload's steps" in text
    assert row.floor_ratio() == pytest.approx(2.0 / floor.seconds)
    assert any(r[0] == "Engine wall / roofline floor: batch 1" for r in result.aim_rows())


def test_shared_prefix_workload_counts_the_prefix_once():
    w = native.workloads(True, 512)[3]
    requests = w.requests()
    assert requests[0].cached == 0 and {r.cached for r in requests[1:]} == {64}


def test_engine_and_chat_sections_show_the_roofline_ratio(tiny):
    peers = [engine.PeerResult(name, wall=6.0, generated_tokens=8) for name in engine.AIM_ENGINE_SPEEDUP]
    peers.append(engine.PeerResult(engine.ENGINE, wall=3.0, generated_tokens=8))
    limits = MachineLimits(1e9, 1e9, 512)
    floor = roofline(tiny, [Request(20, 8), Request(20, 8, cached=16)], limits)
    result = engine.EngineResult(Header(True, "Llama", "laptop"), 16, [4, 4], [8, 8], peers, "", "", roofline=floor)
    assert f"| Engine wall / roofline floor ({floor.seconds:.2f} s) |" in result.markdown()
    workload = chat.ChatWorkload(system=[5] * 4, users=[[[6], [7, 7]], [[8], [9]]], replies=[[2, 3], [2, 2]])
    floors = [roofline(tiny, workload.turn_requests(t), limits) for t in range(workload.turns)]
    runs = [chat.ChatRun(chat.PADDED, [3.0], [[[1, 2], [3, 4, 5]], [[1, 1], [2, 2]]], [10, 18]),
            chat.ChatRun(chat.ENGINE, [1.0], [[[1, 2], [3, 4, 5]], [[1, 1], [2, 2]]], [7, 4])]  # fmt: skip
    result = chat.ChatResult(Header(True, "Llama", "laptop"), workload, runs, 1, "", floors=floors)
    assert result.floor_ratio() == pytest.approx(1.0 / sum(f.seconds for f in floors))
    assert "wall / roofline floor" in result.markdown()


def test_the_bandwidth_is_also_measured_over_arrays_the_size_of_the_weights(tiny, monkeypatch):
    # a last-level cache that holds the weights between steps streams them faster than memory: a floor timed at
    # memory speed alone was beaten by CTranslate2 (docs/benchmarks.md); the floor takes the better of both sizes
    asked: list[int] = []

    def measured(device, *, mib, repeats, clock):
        asked.append(mib)
        return {roofline_module.COPY_MIB: 1e9}.get(mib, 3e9)

    monkeypatch.setattr(roofline_module, "memory_bandwidth", measured)
    shape = ModelShape.from_config(tiny.config)
    weights_mib = -(-step_bytes(shape, []) // 2**20)
    limits = machine_limits(tiny, rows=16, repeats=1)
    assert asked == [roofline_module.COPY_MIB, weights_mib] and limits.bandwidth == 3e9
    assert limits.sizes_mib == (roofline_module.COPY_MIB, weights_mib)
    assert f"of arrays of {roofline_module.COPY_MIB} MiB and {weights_mib} MiB" in limits.describe()


def test_the_section10_walls_script_times_a_kept_engine_on_a_workload():
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "section10_walls.py"
    walls = runpy.run_path(str(script), run_name="section10_walls")
    w = native.PeerWorkload("batch 2", Batch([[5] * 20, [6] * 12], [3, 3]), Batch([[7] * 20, [8] * 12], [2, 2]))
    seconds = walls["wall"](common.bench_model(size="tiny"), w, 2)
    assert 0 < seconds < 60


def test_the_floors_rate_is_the_faster_of_f_linear_and_the_exact_kernel(monkeypatch):
    """Where the row kernel serves, matmul_rate times a second kind of pass through it (in each weight's exact order)
    and keeps the faster: a kernel made to look slower leaves F.linear's rate; one that looks faster sets the rate."""
    from pagedcore.adapters.transformers.row_kernel import Order, RowKernel, load
    from pagedcore.benchmarks import floor

    if load() is None:
        pytest.skip("no row kernel on this machine")
    shape = ModelShape(layers=1, hidden=64, intermediate=128, heads=2, kv_heads=1, head_dim=32, vocab=512)

    class Clock:
        now, kernel_cost = 0.0, 0.0

        def __call__(self) -> float:
            self.now += 1.0
            return self.now

    clock = Clock()
    real = RowKernel.linear

    def linear(self, *args, **kwargs):
        clock.now += clock.kernel_cost
        return real(self, *args, **kwargs)

    monkeypatch.setattr(RowKernel, "linear", linear)
    # every weight found an order (which one does not matter to the timing; the kernel's own tests check the bits)
    monkeypatch.setattr(RowKernel, "exact_order", lambda self, x, w, b, expected, threads: Order.blocks(32, 16))
    flops = sum(2 * 16 * out * inp for out, inp in shape.weight_shapes())
    clock.kernel_cost = 1.0  # each kernel call a second longer: its passes are slower than the plain ones
    assert floor.matmul_rate(shape, rows=16, repeats=1, clock=clock) == pytest.approx(flops)
    clock.kernel_cost = -0.1  # each a tenth of a second shorter: its pass is the faster
    calls = sum(1 for _ in shape.weight_shapes())
    assert floor.matmul_rate(shape, rows=16, repeats=1, clock=clock) == pytest.approx(flops / (1 - 0.1 * calls))
