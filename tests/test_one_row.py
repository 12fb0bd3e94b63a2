"""One-row linear layers split across the CPU's threads in the Engine's forwards (``adapters/transformers/one_row.py``):
the split gives ``F.linear``'s bits on the shapes the benchmarks and the tiny families use, a shape whose bits would
differ keeps ``F.linear``, the trials keep the faster way, and batch-1 decode gives stock tokens and logits."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from models import tiny_model
from test_weights_engine import assert_stock, sgd_step, workload

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers import one_row as one_row_module
from pagedcore.adapters.transformers.one_row import TRIALS, OneRowSplit, split_blocks, split_linear

GREEDY = SamplingParams(max_new_tokens=6, return_logits=True)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """The split needs threads to share: two, as this machine has."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


# The benchmark Llama's weights (hidden 512, 8 heads, 2 KV heads, MLP 1536, vocabulary 32000), a 1B model's, and
# Qwen2's 151936-token head.
SHAPES = [(512, 512), (128, 512), (1536, 512), (512, 1536), (32000, 512), (2048, 2048), (5632, 2048), (151936, 896)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_the_split_gives_the_bits_of_f_linear(shape, bias, two_threads):
    torch.manual_seed(0)
    weight = torch.randn(*shape) * 0.02
    b = torch.randn(shape[0]) if bias else None
    blocks = split_blocks(shape[0], 2)
    assert blocks is not None
    for _ in range(3):
        x = torch.randn(1, 1, shape[1])
        assert torch.equal(split_linear(x, weight, b, blocks), F.linear(x, weight, b))


def test_a_shape_whose_bits_differ_keeps_f_linear(monkeypatch, two_threads):
    split = OneRowSplit()
    monkeypatch.setattr(one_row_module, "split_linear", lambda x, w, b, n: F.linear(x, w, b) + 1e-7)
    weight = torch.randn(256, 64)
    for _ in range(2 * TRIALS + 2):
        x = torch.randn(1, 64)
        assert torch.equal(split.linear(x, weight, None), F.linear(x, weight))
    assert split.ways() == {(256, 64, False, 4, 2): "plain"}


@pytest.mark.parametrize(("split_seconds", "kept"), [(1.0, "plain"), (0.25, "split")])
def test_each_shape_keeps_the_faster_way(split_seconds, kept, monkeypatch, two_threads):
    """After the bits check, TRIALS calls each way are timed (the clock driven here); the lower median is kept."""
    split = OneRowSplit()
    real = one_row_module.split_linear
    now = [0.0]
    monkeypatch.setattr(one_row_module, "_clock", lambda: now[0])

    def slow_split(x, w, b, n):
        now[0] += split_seconds
        return real(x, w, b, n)

    monkeypatch.setattr(one_row_module, "split_linear", slow_split)
    real_linear = F.linear

    def plain(x, w, b=None):
        now[0] += 0.5
        return real_linear(x, w, b)

    monkeypatch.setattr(one_row_module.F, "linear", plain)
    weight = torch.randn(256, 64)
    for _ in range(1 + 2 * TRIALS):
        split.linear(torch.randn(1, 64), weight, None)
    assert split.ways() == {(256, 64, False, 4, 2): kept}


def test_one_thread_or_an_uneven_weight_is_not_split():
    assert split_blocks(512, 1) is None and split_blocks(100, 2) is None and split_blocks(96, 2) is None
    assert split_blocks(256, 2) == 4 and split_blocks(129, 2) is None and split_blocks(192, 2) == 2


@pytest.fixture
def split_wins(monkeypatch):
    """The trials' clock made to find the split faster (on the tiny weights the call's cost decides): the decode
    steps then run split, and must still give stock's bits."""
    now = [0.0]

    def clock():
        now[0] += 1.0
        return now[0]

    monkeypatch.setattr(one_row_module, "_clock", clock)
    real = one_row_module.split_linear

    def split(x, w, b, n):
        now[0] -= 0.5  # every timed split call looks half as long
        return real(x, w, b, n)

    monkeypatch.setattr(one_row_module, "split_linear", split)


def test_batch_one_decode_gives_stock_tokens_and_logits(two_threads, split_wins):
    model = tiny_model("llama", seed=5, hidden_size=128, intermediate_size=256)
    ref = mirror_of(model)
    prompts = workload(4, 3)
    with Engine(model, num_blocks=64, block_size=4, max_num_seqs=1) as engine:  # one row per decode step
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
        ways = engine.runner.one_row_ways()
    assert set(ways.values()) == {"split"}  # the decoder's 128- and 256-row weights
    assert_stock(ref, prompts, outputs)
    assert not any("forward" in vars(m) for m in model.modules() if m is not model.lm_head)


def test_a_training_step_between_decode_steps_is_seen(two_threads, split_wins):
    """The split reads the weight at each call: an optimizer step mid-run gives the new weights' tokens."""
    model = tiny_model("llama", seed=6, hidden_size=128, intermediate_size=256)
    first, second = workload(5, 2), workload(6, 2)
    with Engine(model, num_blocks=96, block_size=4, max_num_seqs=1) as engine:
        engine.generate(first, GREEDY, use_tqdm=False)
        sgd_step(model, first)
        ref = mirror_of(model)
        outputs = engine.generate(second, GREEDY, use_tqdm=False)
        assert set(engine.runner.one_row_ways().values()) == {"split"}
    assert_stock(ref, second, outputs)


def mirror_of(model: torch.nn.Module) -> torch.nn.Module:
    """``mirror`` for a model of other sizes than the default tiny Llama's."""
    ref = tiny_model("llama", seed=99, hidden_size=model.config.hidden_size,
                     intermediate_size=model.config.intermediate_size)  # fmt: skip
    ref.load_state_dict(model.state_dict())
    return ref
