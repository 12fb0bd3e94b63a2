"""Engine(compile="cudagraphs"): decode steps captured per bucket from the eager step (issue 33 item 5).

A CUDA graph cannot be captured on the CPU, so here the capture is a stand-in that records the function and replays
it by calling it again on the same static tensors (``decode_graphs.CAPTURE``): what these tests check is everything
around the capture — buckets, static inputs copied per step, outputs copied out of the graph's buffer, graphs dropped
when the weights or the pool move, a failing capture turning graphs off — and that the captured function never
reads a tensor's value on the host or builds a tensor from host data (under capture on CUDA the first raises, the
second would replay a copy from memory the host has since reused). tests/test_cuda_backends.py runs the real capture
against the CPU Engine on a GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hybrid_models import hybrid_model
from models import tiny_model
from test_engine_compile import PROMPTS, assert_same, run
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from variant_models import variant_model

from pagedcore import ConfigError
from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers import decode_graphs as graphs_module
from pagedcore.adapters.transformers.compiled import DecodeInputs, attend_blocks
from pagedcore.adapters.transformers.decode_graphs import ReplayCapture
from pagedcore.plugins.torch_backend import attend_rows, gather_blocks

pytestmark = pytest.mark.usefixtures("one_thread")


class CountingReplay(ReplayCapture):
    """The stand-in (:class:`~pagedcore.adapters.transformers.decode_graphs.ReplayCapture`), counting captures."""

    captures = 0
    made = 0

    def __init__(self) -> None:
        CountingReplay.made += 1

    def capture(self, function: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        CountingReplay.captures += 1
        return super().capture(function)


@pytest.fixture
def replay(monkeypatch):
    CountingReplay.captures = CountingReplay.made = 0
    monkeypatch.setattr(graphs_module, "CAPTURE", CountingReplay)


# ---------------------------------------------------------------------------------------------------- the option
def test_cudagraphs_is_refused_without_cuda_before_anything_changes():
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match='compile="cudagraphs" needs a CUDA device; the model is on cpu'):
        Engine(model, num_blocks=16, compile="cudagraphs")
    assert model.config._attn_implementation == "sdpa"


def test_cudagraphs_is_refused_for_a_model_with_recurrent_states(replay):
    with pytest.raises(ConfigError, match="compile='cudagraphs': 'qwen3_next' keeps recurrent states"):
        Engine(hybrid_model("qwen3_next"), num_blocks=32, compile="cudagraphs")


# ---------------------------------------------------------------------------------------------------- equality
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gemma3"])
def test_replayed_decode_equals_the_eager_engine(family, replay):
    model = tiny_model(family)
    reference, _ = run(model, False)
    outputs, stats = run(model, "cudagraphs")
    assert stats.compiled_steps > 0 and stats.compile_failures == 0
    assert stats.compiled_graphs == stats.compiled_buckets == CountingReplay.captures  # one capture per bucket
    assert_same(outputs, reference)


def test_replayed_decode_across_preemption_forks_and_prefix_hits(replay):
    model = tiny_model("llama")
    kwargs = {"num_blocks": 14, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16}
    greedy = SamplingParams(max_new_tokens=16, return_logits=True)
    reference, _ = run(model, False, params=greedy, **kwargs)
    outputs, stats = run(model, "cudagraphs", params=greedy, **kwargs)
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0 and stats.compiled_steps > 0
    assert_same(outputs, reference)
    forks = SamplingParams(max_new_tokens=10, n=3, temperature=1.0, seed=3, return_logits=True)
    reference, _ = run(model, False, prompts=PROMPTS[:2], params=forks)
    outputs, _ = run(model, "cudagraphs", prompts=PROMPTS[:2], params=forks)
    assert_same(outputs, reference)


def test_a_bucket_replays_the_steps_inputs_not_its_first_ones(replay):
    """Two rows over 7 steps share one bucket (rows 2, width 4): one capture, then six replays whose tokens,
    positions and slots are copied into the graph's static tensors."""
    model = tiny_model("llama")
    prompts = [PROMPTS[0], PROMPTS[2]]
    params = SamplingParams(max_new_tokens=8, return_logits=True)
    reference, _ = run(model, False, prompts=prompts, params=params, block_size=8)
    outputs, stats = run(model, "cudagraphs", prompts=prompts, params=params, block_size=8)
    assert stats.compiled_steps == 7 and stats.compiled_buckets == 1 and CountingReplay.captures == 1
    assert_same(outputs, reference)


def test_logits_returned_are_not_the_graphs_buffer(replay):
    model = tiny_model("llama")
    with Engine(model, num_blocks=32, block_size=4, compile="cudagraphs") as engine:
        graphs = engine.runner._decode
        assert isinstance(graphs, graphs_module.DecodeGraphs)
        engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=3), use_tqdm=False)
        (graph,) = graphs._graphs.values()
        step = graph.inputs
        first = graphs(step)
        kept = first.clone()
        other = dataclasses.replace(step, input_ids=step.input_ids + 1)  # other logits into the same buffer
        second = graphs(other)
        assert torch.equal(first, kept) and not torch.equal(first, second)


# ---------------------------------------------------------------------------------------------------- invalidation
def test_a_weight_update_drops_the_graphs_and_the_next_steps_see_the_new_weights(replay):
    model = tiny_model("llama")
    params = SamplingParams(max_new_tokens=8, return_logits=True)
    with Engine(model, num_blocks=64, block_size=4, compile="cudagraphs") as engine:
        engine.generate(PROMPTS[:2], params, use_tqdm=False)
        captured = CountingReplay.captures
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # in place: an optimizer step's kind of update
        outputs = engine.generate(PROMPTS[:2], params, use_tqdm=False)
        assert engine.runner._decode.dropped == 1
        assert CountingReplay.captures > captured
        assert CountingReplay.made == 2  # the graphs after the update in a capture (a memory pool) of their own
    reference, _ = run(model, False, prompts=PROMPTS[:2], params=params)
    assert_same(outputs, reference)


def test_a_moved_pool_tensor_drops_the_graphs(replay):
    model = tiny_model("llama")
    with Engine(model, num_blocks=32, block_size=4, compile="cudagraphs") as engine:
        engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=3), use_tqdm=False)
        graphs = engine.runner._decode
        stamp = graphs._current_stamp()
        key_cache = engine.pool.layer_tensors(0)[0]
        with pytest.MonkeyPatch.context() as patch:
            moved = key_cache.clone()
            real = engine.pool.layer_tensors
            patch.setattr(engine.pool, "layer_tensors", lambda i: (moved, real(i)[1]) if i == 0 else real(i))
            assert graphs._current_stamp() != stamp


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0}, {"type": "dynamic", "factor": 2.0}])
def test_cudagraphs_is_refused_for_a_rotary_embedding_that_reads_positions_on_the_host(replay, rope):
    """Regression (a review against torch's capture rules): transformers' dynamic_rope_update compares
    ``max(position_ids) + 1`` with a bound on the host at every forward, which a capture refuses, part-way.
    ``longrope`` chooses its frequencies on the device: served."""
    model = tiny_model("llama")
    model.config.rope_parameters = {"rope_theta": 10000.0, **rope}
    with pytest.raises(ConfigError, match=r"rotary embedding .* compares the positions with a bound on the host"):
        Engine(model, num_blocks=16, compile="cudagraphs")
    assert model.config._attn_implementation == "sdpa"
    model.config.rope_parameters = {"rope_theta": 10000.0, "rope_type": "longrope"}
    graphs_module.refuse_graphs(model)


def test_cudagraphs_is_refused_for_weights_on_two_devices():
    model = tiny_model("llama")
    model.lm_head.to("meta")  # a model split over devices (device_map): a graph is captured on one
    with pytest.raises(ConfigError, match="weights lie on cpu, meta"):
        graphs_module.refuse_graphs(model)


def test_after_a_capture_failed_part_way_no_engine_of_the_process_captures(monkeypatch):
    """Regression: a capture that fails part-way leaves torch < 2.12's caching allocator in capture mode, so the
    next capture (another Engine's) would assert; it is refused with the first failure's reason instead."""
    monkeypatch.setattr(graphs_module.CudaGraphCapture, "failed", "RuntimeError: operation not permitted")
    with pytest.raises(ConfigError, match=r"capture of this process failed part-way .RuntimeError"):
        graphs_module.resolve_compile("cudagraphs", torch.device("cuda"))
    assert graphs_module.resolve_compile(False, torch.device("cuda")) is None


def test_closing_the_engine_lets_its_graphs_go(replay):
    import gc
    import weakref

    with Engine(tiny_model("llama"), num_blocks=32, block_size=4, compile="cudagraphs") as engine:
        engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=3), use_tqdm=False)
        graphs = weakref.ref(engine.runner._decode)
        assert engine.stats().compiled_steps == 2
    gc.collect()
    assert graphs() is None and engine.stats().compiled_steps == 2  # the counts stay


def test_a_failing_capture_turns_graphs_off_and_runs_eagerly(monkeypatch):
    class Refusing:
        def capture(self, function):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs_module, "CAPTURE", Refusing)
    model = tiny_model("llama")
    reference, _ = run(model, False)
    outputs, stats = run(model, "cudagraphs")
    assert stats.compile_failures == 1 and stats.num_failed == 0 and stats.compiled_steps == 0
    assert_same(outputs, reference)


# ---------------------------------------------------------------------------------------------------- capture safety
HOST_OPS = (
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.lift_fresh",
    "aten.masked_select",
    "aten.item",
    "aten.is_nonzero",
)
"""Ops a captured step must not run: a value read on the host (.item(), bool(), int() of a tensor, nonzero's
size) waits on the GPU, which a capture refuses; a tensor built from host data (``torch.tensor(...)``) would be
copied in at capture time only."""


HOST_METHODS = ("tolist", "cpu", "numpy", "item", "__bool__", "__int__", "__float__", "__index__", "synchronize")
"""Tensor methods that hand a value to the host (they do not all dispatch an aten op: ``tolist`` reads the data)."""


class HostMethods(TorchFunctionMode):
    """Records the names of the torch functions and tensor methods called while active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class HostOps(TorchDispatchMode):
    """Records every op dispatched while active (a custom op's own body is not entered: it runs as one op)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "family", ["llama", "qwen3", "mistral", "gemma2", "gemma3", "llama4", "deepseek_v3", "gpt_oss"]
)
def test_the_captured_step_reads_no_value_on_the_host(family, replay, monkeypatch):
    recorded: list[HostOps] = []
    called: list[HostMethods] = []

    class Watching(CountingReplay):
        def capture(self, function):
            mode, methods = HostOps(), HostMethods()
            with methods, mode:
                function()
            recorded.append(mode)
            called.append(methods)
            return super().capture(function)

    monkeypatch.setattr(graphs_module, "CAPTURE", Watching)
    model = variant_model(family) if family in ("llama4", "deepseek_v3", "gpt_oss") else tiny_model(family)
    _, stats = run(model, "cudagraphs", prompts=PROMPTS[:2], params=SamplingParams(max_new_tokens=4))
    assert stats.compiled_steps > 0 and stats.compile_failures == 0 and recorded
    for mode in recorded:
        assert "pagedcore.attend_blocks" in mode.ops
        assert not [op for op in mode.ops if op in HOST_OPS], sorted(set(mode.ops) & set(HOST_OPS))
    for methods in called:
        assert methods.names and not set(methods.names) & set(HOST_METHODS), set(methods.names) & set(HOST_METHODS)


@pytest.mark.parametrize(
    "family", ["llama", "qwen3", "mistral", "gemma2", "gemma3", "llama4", "deepseek_v3", "gpt_oss"]
)
def test_replaying_the_recorded_ops_equals_the_eager_engine(family, monkeypatch):
    """What a real graph replays: the ops of the captured run with every Python value frozen
    (:class:`~pagedcore.adapters.transformers.decode_graphs.TraceCapture`), over later steps' inputs: a number or a
    branch the step's Python would compute otherwise at a later step (a length, a position) would give other tokens
    here, which the stand-in that runs the Python again cannot show."""
    monkeypatch.setattr(graphs_module, "CAPTURE", graphs_module.TraceCapture)
    model = variant_model(family) if family in ("llama4", "deepseek_v3", "gpt_oss") else tiny_model(family)
    params = SamplingParams(max_new_tokens=10, return_logits=True)
    reference, _ = run(model, False, prompts=PROMPTS[:3], params=params)
    outputs, stats = run(model, "cudagraphs", prompts=PROMPTS[:3], params=params)
    assert stats.compiled_steps > stats.compiled_graphs > 0 and stats.compile_failures == 0  # graphs replayed
    assert_same(outputs, reference)


def test_the_host_op_watch_sees_a_value_read_on_the_host():
    mode, methods = HostOps(), HostMethods()
    with methods, mode:
        tensor = torch.tensor([3, 4])
        int(tensor[0]), bool(tensor.any()), tensor.nonzero(), tensor.tolist(), tensor.cpu()
    assert {"aten.lift_fresh", "aten._local_scalar_dense", "aten.nonzero"} <= set(mode.ops)
    assert {"__int__", "__bool__", "tolist", "cpu"} <= set(methods.names)


def test_attend_blocks_on_cuda_runs_no_host_op():
    """attend_blocks' body on CUDA (its CPU-only column trimming aside): the gathers and the attention."""
    cache = torch.randn(5, 4, 2, 8)
    tables = torch.tensor([[0, 1, 4, 4], [2, 4, 4, 4]])
    mask = torch.ones(2, 1, 1, 16, dtype=torch.bool)
    query = torch.randn(2, 4, 1, 8)
    mode = HostOps()
    with mode:
        keys, values = gather_blocks(cache, tables), gather_blocks(cache, tables)
        attend_rows(query, keys, values, mask, 0.3, None, None)
    assert mode.ops and not [op for op in mode.ops if op in HOST_OPS]
    assert attend_blocks(query, cache, cache, tables, mask, 4, 0.3, None, None).shape == (2, 4, 1, 8)


def test_decode_inputs_are_what_a_bucket_copies():
    inputs = DecodeInputs(
        torch.tensor([7, 0]), torch.tensor([5, 0]), (torch.zeros(2, 4, dtype=torch.long),), (torch.tensor([5, 0]),),
        (torch.tensor([0, 0]),), real=1,
    )  # fmt: skip
    static = DecodeInputs(*(torch.zeros_like(t) for t in (inputs.input_ids, inputs.positions)),
                          (torch.ones(2, 4, dtype=torch.long),), (torch.zeros(2, dtype=torch.long),),
                          (torch.ones(2, dtype=torch.long),), real=2)  # fmt: skip
    graphs_module._copy_inputs(static, inputs)
    assert static.input_ids.tolist() == [7, 0] and static.positions.tolist() == [5, 0]
    assert static.tables[0].eq(0).all() and static.slots[0].tolist() == [5, 0] and static.starts[0].eq(0).all()
