"""Few-row linear calls split across the CPU's threads in the Engine's forwards (``row_split.py``): the split gives
``F.linear``'s bits on the benchmark's shapes at decode row counts, a row count whose bits would differ keeps
``F.linear``, the trials keep the faster way, and decode at batch 1 and 16 gives stock tokens and logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import tiny_model
from test_weights_engine import assert_stock, mirror, sgd_step, workload

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers import row_split as row_split_module
from pagedcore.adapters.transformers.row_kernel import RowKernel, load
from pagedcore.adapters.transformers.row_split import MAX_ROWS, TRIALS, RowSplit, split_blocks, split_linear
from pagedcore.errors import ConfigError

GREEDY = SamplingParams(max_new_tokens=6, return_logits=True)


# The benchmark Llama's weights (hidden 512, 8 heads, 2 KV heads, MLP 1536, vocabulary 32000), a 1B model's, and
# Qwen2's 151936-token head.
SHAPES = [(512, 512), (128, 512), (1536, 512), (512, 1536), (32000, 512), (2048, 2048), (5632, 2048), (151936, 896)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_the_split_gives_the_bits_of_f_linear(shape, bias, two_threads):
    """Exact at decode row counts up to 12 on both CPUs this project has met; from 16 rows MKL on a Xeon with
    AVX-512 sums a split of 1536 columns or more another way (2048 x 2048 at 16-64 rows, 512 x 1536 at 64), which
    :class:`RowSplit` finds at the row count's first call and answers with F.linear's own bits."""
    torch.manual_seed(0)
    weight = torch.randn(*shape) * 0.02
    b = torch.randn(shape[0]) if bias else None
    blocks = split_blocks(shape[0], 2)
    assert blocks is not None
    for rows in (1, 1, 2, 3, 4, 8, 12) if shape[0] * shape[1] < 10**7 else (1, 3):
        x = torch.randn(1, rows, shape[1])
        assert torch.equal(split_linear(x, weight, b, blocks), F.linear(x, weight, b)), rows
    split = RowSplit()
    for rows in (16, 33, 64) if shape[0] * shape[1] < 10**7 else ():
        for _ in range(2 * TRIALS + 2):
            x = torch.randn(1, rows, shape[1])
            assert torch.equal(split.linear(x, weight, b), F.linear(x, weight, b)), rows


def test_row_counts_whose_bits_differ_keep_f_linear(two_threads):
    """MKL's GEMM sums 5-7 and 9-11 rows another way when the weight is split (on this machine): those counts are
    found at their first call and keep F.linear; the bucket's other counts are still split."""
    split = RowSplit()
    weight = torch.randn(512, 512) * 0.02
    for _ in range(2 * TRIALS + 2):
        for rows in range(1, 17):
            x = torch.randn(rows, 512)
            assert torch.equal(split.linear(x, weight, None), F.linear(x, weight)), rows
    differ = set().union(*split.differing().values()) if split.differing() else set()
    assert differ <= {5, 6, 7, 9, 10, 11}


def test_a_shape_whose_bits_differ_keeps_f_linear(monkeypatch, two_threads):
    split = RowSplit()
    monkeypatch.setattr(row_split_module, "split_linear", lambda x, w, b, n: F.linear(x, w, b) + 1e-7)
    weight = torch.randn(256, 64)
    for _ in range(2 * TRIALS + 2):
        x = torch.randn(1, 64)
        assert torch.equal(split.linear(x, weight, None), F.linear(x, weight))
    assert split.ways() == {(256, 64, False, 4, 2, 1): None} and split.differing() == {(256, 64, False, 4, 2, 1): {1}}


@pytest.mark.parametrize(("split_seconds", "kept"), [(1.0, "plain"), (0.25, "split")])
def test_each_shape_keeps_the_faster_way(split_seconds, kept, monkeypatch, two_threads):
    """After the bits check, TRIALS calls each way are timed (the clock driven here); the lower median is kept."""
    split = RowSplit()
    real = row_split_module.split_linear
    now = [0.0]
    monkeypatch.setattr(row_split_module, "_clock", lambda: now[0])

    def slow_split(x, w, b, n):
        now[0] += split_seconds
        return real(x, w, b, n)

    monkeypatch.setattr(row_split_module, "split_linear", slow_split)
    real_linear = F.linear

    def plain(x, w, b=None):
        now[0] += 0.5
        return real_linear(x, w, b)

    monkeypatch.setattr(row_split_module.F, "linear", plain)
    weight = torch.randn(256, 64)
    for _ in range(1 + 2 * TRIALS):
        split.linear(torch.randn(1, 64), weight, None)
    assert split.ways() == {(256, 64, False, 4, 2, 1): kept}


def test_each_row_count_is_checked_and_each_bucket_timed(two_threads):
    """Rows 3 and 4 share a bucket (4), each row count's bits checked at its first call; more than MAX_ROWS rows
    (a prefill chunk) are not split at all."""
    split = RowSplit()
    weight = torch.randn(256, 64)
    for rows in (3, 4, 3, 4, 3, 4, 3, 4, 3, 4, MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        assert torch.equal(split.linear(x, weight, None), F.linear(x, weight))
    assert list(split.ways()) == [(256, 64, False, 4, 2, 4)]


@pytest.mark.parametrize("kernel_faster", [False, True])
def test_a_prefill_chunks_first_call_is_a_trial_of_the_kernel(kernel_faster, two_threads, trial_clock, monkeypatch):
    """Past MAX_ROWS rows only F.linear and the kernel are tried; each row count's first call (its bit check) times
    both, so a bucket whose counts never repeat still settles after TRIALS of them; every result F.linear's bits."""
    kernel = load()
    if kernel is None:
        pytest.skip("no row kernel on this machine")
    real = RowKernel.linear

    def timed(self, x, weight, bias, order, threads):
        trial_clock[0] -= 0.75 if kernel_faster else -2.0  # the kernel's calls a quarter as long, or three times
        return real(self, x, weight, bias, order, threads)

    monkeypatch.setattr(RowKernel, "linear", timed)
    split = RowSplit(kernel)
    weight = torch.randn(256, 64)
    for rows in range(MAX_ROWS + 1, MAX_ROWS + 1 + TRIALS):  # novel counts only: each call a check
        x = torch.randn(rows, 64)
        assert torch.equal(split.linear(x, weight, None), F.linear(x, weight))
    bucket = (256, 64, False, 0, 2, 2 * MAX_ROWS)  # no split blocks past MAX_ROWS
    if kernel.exact_order(x, weight, None, F.linear(x, weight), 2) is None:
        pytest.skip("the kernel's bits matched F.linear's at no prefill row count on this CPU")
    assert split.ways() == {bucket: "kernel" if kernel_faster else "plain"}
    x = torch.randn(MAX_ROWS + 1, 64)
    assert torch.equal(split.linear(x, weight, None), F.linear(x, weight))
    assert split.settled((256, 64, False), MAX_ROWS + 1, 2) == ("kernel" if kernel_faster else "plain")


def test_one_thread_or_an_uneven_weight_is_not_split():
    assert split_blocks(512, 1) is None and split_blocks(100, 2) is None and split_blocks(96, 2) is None
    assert split_blocks(256, 2) == 4 and split_blocks(129, 2) is None and split_blocks(192, 2) == 2


@pytest.fixture
def split_wins(monkeypatch, trial_clock):
    """The trials' clock made to find the split faster (on the tiny weights the call's cost decides): the decode
    steps then run split, and must still give stock's bits."""
    real = row_split_module.split_linear

    def split(x, w, b, n):
        trial_clock[0] -= 0.5  # every timed split call looks half as long
        return real(x, w, b, n)

    monkeypatch.setattr(row_split_module, "split_linear", split)


def test_batch_one_decode_gives_stock_tokens_and_logits(two_threads, split_wins):
    model = tiny_model("llama", seed=5, hidden_size=128, intermediate_size=256)
    ref = mirror(model)
    prompts = workload(4, 3)
    with Engine(model, num_blocks=64, block_size=4, max_num_seqs=1) as engine:  # one row per decode step
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
        ways = engine.runner.row_split_ways()
    assert "split" in ways.values()  # the decoder's 128- and 256-row weights at the decode steps' one row
    assert_stock(ref, prompts, outputs)
    assert not any("forward" in vars(m) for m in model.modules() if m is not model.lm_head)


def test_batch_sixteen_decode_gives_stock_tokens_and_logits(two_threads, split_wins):
    model = tiny_model("llama", seed=7, hidden_size=128, intermediate_size=256)
    ref = mirror(model)
    prompts = workload(7, 16)
    with Engine(model, num_blocks=256, block_size=4) as engine:
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
        buckets = {key[-1] for key, way in engine.runner.row_split_ways().items() if way == "split"}
    assert 16 in buckets  # the decode steps' 16 rows
    assert_stock(ref, prompts, outputs)


def test_a_training_step_between_decode_steps_is_seen(two_threads, split_wins):
    """The split reads the weight at each call: an optimizer step mid-run gives the new weights' tokens."""
    model = tiny_model("llama", seed=6, hidden_size=128, intermediate_size=256)
    first, second = workload(5, 2), workload(6, 2)
    with Engine(model, num_blocks=96, block_size=4, max_num_seqs=1) as engine:
        engine.generate(first, GREEDY, use_tqdm=False)
        sgd_step(model, first)
        ref = mirror(model)
        outputs = engine.generate(second, GREEDY, use_tqdm=False)
        assert "split" in engine.runner.row_split_ways().values()
    assert_stock(ref, second, outputs)


def test_split_rows_false_keeps_f_linear_and_the_setting_is_checked(two_threads):
    model = tiny_model("llama", seed=8, hidden_size=128, intermediate_size=256)
    with Engine(model, num_blocks=64, block_size=4, split_rows=False) as engine:
        engine.generate(workload(8, 2), GREEDY, use_tqdm=False)
        assert engine.runner.row_split_ways() == {}
    with Engine(model, num_blocks=64, block_size=4, split_rows=False, prepack=True) as engine:
        engine.generate(workload(8, 2), GREEDY, use_tqdm=False)
        assert engine.runner.row_split_ways() == {}
    with pytest.raises(ConfigError, match="split_rows must be True or False, got 'no'"):
        Engine(model, num_blocks=64, block_size=4, split_rows="no")


def test_the_head_is_split_when_no_fused_head_took_it(two_threads, split_wins):
    """With the fused greedy head the head's GEMM goes through its own call of the split; without it (a LoRA, a
    state model, fused_argmax=False) the split takes the head as it takes the other layers: sampled steps gain too."""
    model = tiny_model("llama", seed=9, hidden_size=128, intermediate_size=256)
    ref = mirror(model)
    prompts = workload(9, 2)
    with Engine(model, num_blocks=64, block_size=4, max_num_seqs=1, fused_argmax=False) as engine:
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
        ways = engine.runner.row_split_ways()
        assert "forward" in vars(model.lm_head)
    assert ways[(model.config.vocab_size, 128, False, 4, 2, 1)] == "split"
    assert_stock(ref, prompts, outputs)
    assert "forward" not in vars(model.lm_head)


@pytest.mark.parametrize(
    ("settled", "backend"),
    [(True, "eager"), (False, "eager"), pytest.param(True, "inductor", marks=pytest.mark.slow)],
)
def test_a_compiled_decode_step_splits_its_rows_as_the_eager_one(settled, backend, two_threads, split_wins,
                                                                 monkeypatch):  # fmt: skip
    """The compiled step (``Engine(compile=True)``) called ``F.linear`` in its graph (one thread for a one-row GEMV
    whatever torch's count). Each linear layer's way for the graph's row count is now measured before its first
    graph (``CompiledDecode.settle``: the bucket's step run uncompiled) and traced, the split's batched product over
    views of the weight with no op deciding per call (an op per layer cost the compiled step ~2.5 ms at batch 1); a
    row count not yet measured (``settled=False``) keeps one opaque op per layer (``pagedcore::row_linear``) whose
    way is decided when the graph runs, as in the eager forward. Stock tokens and logits either way."""
    from pagedcore.adapters.transformers import compiled as compiled_module
    from pagedcore.adapters.transformers.prepacked import ROW_LINEAR

    monkeypatch.setattr(compiled_module, "BACKEND", backend)  # inductor: its generated code calls the split's bmm
    if not settled:
        monkeypatch.setattr(compiled_module, "SETTLE_STEPS", 0)
    inside, split, graphs = [False], [], []
    step, linear = compiled_module.CompiledDecode.__call__, RowSplit.linear
    compiler = compiled_module.CompiledDecode._compiler

    def compiled_step(self, inputs):
        inside[0] = True
        try:
            return step(self, inputs)
        finally:
            inside[0] = False

    def spy(self, x, weight, bias, threads=None):
        split.extend([weight.shape] if inside[0] else [])
        return linear(self, x, weight, bias, threads)

    def capture(self, graph, example_inputs):
        graphs.append(graph)
        return compiler(self, graph, example_inputs)

    monkeypatch.setattr(compiled_module.CompiledDecode, "__call__", compiled_step)
    monkeypatch.setattr(compiled_module.CompiledDecode, "_compiler", capture)
    monkeypatch.setattr(RowSplit, "linear", spy)
    model = tiny_model("llama", seed=10, hidden_size=128, intermediate_size=256)
    ref = mirror(model)
    prompts = workload(10, 2)
    # without the row kernel: this test is the split's (test_row_kernel.py has the kernel's compiled step)
    with Engine(model, num_blocks=64, block_size=4, max_num_seqs=1, compile=True, row_kernel=False) as engine:
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
        stats = engine.stats()
    assert stats.compiled_steps > 0 and stats.compile_failures == 0 and graphs
    layers = model.config.num_hidden_layers
    linears = [m for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear)]
    splits = sum(split_blocks(m.out_features, 2) is not None for m in linears) * layers  # k and v: 64 rows, none
    ops = [[node.target for node in graph.graph.nodes if node.op == "call_function"] for graph in graphs]
    if settled:  # the layers' ways traced: no op decides them; only the head's GEMM calls the split, in its op
        assert all(targets.count(ROW_LINEAR) == 0 and targets.count(torch.bmm) == splits > 0 for targets in ops)
        assert len(split) == stats.compiled_steps
    else:  # the first graph decides in its ops; one compiled after they settled (a wider table) traces them
        served = splits
        assert ops[0].count(ROW_LINEAR) == served > 0 and ops[0].count(torch.bmm) == 0
        assert len(ops) > 1 and all(t.count(ROW_LINEAR) == 0 and t.count(torch.bmm) == splits for t in ops[1:])
        assert len(split) > stats.compiled_steps
    assert_stock(ref, prompts, outputs)
