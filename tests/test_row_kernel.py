"""The few-row linear kernel (``row_kernel.py``, ``row_kernel.c``): it sums in blocks exactly as documented (checked
against a float64 emulation of the FMA chains, whatever MKL does on this CPU), the row split keeps it only where its
bits are ``F.linear``'s, the Engine's decode steps through it give stock tokens and logits, and it is refused where
it cannot serve."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from models import tiny_model
from test_weights_engine import assert_stock, mirror, sgd_step, workload

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers import row_kernel as row_kernel_module
from pagedcore.adapters.transformers.row_kernel import WIDTHS, RowKernel, load
from pagedcore.adapters.transformers.row_split import TRIALS, RowSplit
from pagedcore.errors import ConfigError

GREEDY = SamplingParams(max_new_tokens=6, return_logits=True)
KERNEL = load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler or no AVX2 on this machine")


def blocked_sums(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, width: int) -> torch.Tensor:
    """The documented order in float64 (each FMA's product is exact there; the sum rounded to float32 once more):
    per block of ``width`` columns one chain from zero in column order, the block sums added in order to the bias."""
    xs, ws = x.double().numpy(), weight.double().numpy()
    out = None if bias is None else np.broadcast_to(bias.double().numpy(), (xs.shape[0], ws.shape[0])).copy()
    for start in range(0, xs.shape[1], width):
        acc = np.zeros((xs.shape[0], ws.shape[0]))
        for k in range(start, min(start + width, xs.shape[1])):
            acc = (np.outer(xs[:, k], ws[:, k]) + acc).astype(np.float32).astype(np.float64)
        out = acc if out is None else (out + acc).astype(np.float32).astype(np.float64)
    assert out is not None
    return torch.from_numpy(out.astype(np.float32))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 9, 17])
@pytest.mark.parametrize("width", [8, 64, 192])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_sums_in_the_documented_order(rows, width, bias):
    torch.manual_seed(rows * 7 + width)
    weight, x = torch.randn(24, 384), torch.randn(rows, 384)
    b = torch.randn(24) if bias else None
    assert KERNEL is not None
    for threads in (1, 2):
        assert torch.equal(KERNEL.linear(x, weight, b, width, threads), blocked_sums(x, weight, b, width))


@needs_kernel
def test_the_kernel_finds_mkls_width_or_none():
    """Where MKL sums in one of WIDTHS (192 with MKL 2024 on Zen 4, from 4 rows up) the kernel gives F.linear's
    bits; a width is reported only where they are equal."""
    assert KERNEL is not None
    torch.manual_seed(0)
    found = {}
    for shape in [(512, 512), (1536, 512), (512, 1536)]:
        weight = torch.randn(*shape) * 0.02
        for rows in (1, 4, 8, 16, 64):
            x = torch.randn(rows, shape[1])
            width = KERNEL.exact_width(x, weight, None, F.linear(x, weight), 1)
            found[shape, rows] = width
            if width is not None:
                assert width in (*WIDTHS, shape[1])
                assert torch.equal(KERNEL.linear(x, weight, None, width, 1), F.linear(x, weight))
    if all(w is None for w in found.values()):
        pytest.skip("MKL on this CPU sums in none of the kernel's widths: the kernel never serves here")


def test_a_shape_or_tensor_the_kernel_cannot_take_is_not_its():
    assert RowKernel.fits_shape(512, 512) and not RowKernel.fits_shape(500, 512) and not RowKernel.fits_shape(8, 12)
    weight = torch.randn(16, 32)
    assert RowKernel.fits(torch.randn(2, 32), weight, None)
    assert not RowKernel.fits(torch.randn(2, 32).double(), weight.double(), None)
    assert not RowKernel.fits(torch.randn(2, 32), weight.t().contiguous().t(), None)  # a transposed view
    assert not RowKernel.fits(torch.randn(2, 32), weight, torch.randn(8))


@needs_kernel
def test_what_the_c_code_would_misread_is_refused():
    assert KERNEL is not None
    weight = torch.randn(16, 32)
    for x, w, b in [
        (torch.randn(2, 32).double(), weight, None),  # another dtype: half or twice the bytes
        (torch.randn(2, 24), weight, None),  # a narrower input: read past its end
        (torch.randn(2, 32), weight.t().contiguous().t(), None),  # a transposed view
        (torch.randn(2, 32), weight, torch.randn(8)),  # a short bias
    ]:
        with pytest.raises(ValueError, match="row kernel: cannot take"):
            KERNEL.linear(x, w, b, 8, 1)


@needs_kernel
def test_what_records_a_steps_ops_sees_the_kernels_result():
    """The CPU stand-in for CUDA graphs (``TraceCapture``) replays the ops a step dispatched. The kernel called behind
    torch's back (ctypes on an empty tensor) replayed as that empty tensor: NaN logits, which CI found in
    ``test_decode_graphs.py``; as one op it is replayed with the new inputs."""
    from pagedcore.adapters.transformers.decode_graphs import TraceCapture

    assert KERNEL is not None
    weight, x = torch.randn(16, 32), torch.randn(4, 32)
    replay, out = TraceCapture().capture(lambda: KERNEL.linear(x, weight, None, 8, 1))
    x.copy_(torch.randn(4, 32))
    replay()
    assert torch.equal(out, blocked_sums(x, weight, None, 8))


def test_it_is_not_built_where_it_cannot_serve(monkeypatch):
    monkeypatch.setenv("PAGEDCORE_ROW_KERNEL", "0")
    assert row_kernel_module._build() is None
    monkeypatch.delenv("PAGEDCORE_ROW_KERNEL")
    monkeypatch.setattr(row_kernel_module.shutil, "which", lambda name: None)  # no C compiler
    assert row_kernel_module._build() is None
    monkeypatch.setattr(row_kernel_module.torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")  # no AVX2
    assert row_kernel_module._build() is None


@pytest.fixture
def kernel_wins(monkeypatch, trial_clock):
    """The trials' clock made to find the kernel fastest (on tiny weights the call's cost decides), so the decode
    steps run through it wherever its bits are F.linear's, and must still give stock's bits."""
    real = RowKernel.linear

    def fast(self, x, weight, bias, width, threads):
        trial_clock[0] -= 0.75  # every timed kernel call looks a quarter as long
        return real(self, x, weight, bias, width, threads)

    monkeypatch.setattr(RowKernel, "linear", fast)


def test_a_row_count_whose_kernel_bits_differ_keeps_another_way(monkeypatch, two_threads):
    class Off(RowKernel):
        def __init__(self) -> None:
            self._widths = {}

        def linear(self, x, weight, bias, width, threads):
            return F.linear(x, weight, bias) + 1e-7

    split = RowSplit(Off())
    weight = torch.randn(256, 64)
    for _ in range(3 * TRIALS + 2):
        x = torch.randn(4, 64)
        assert torch.equal(split.linear(x, weight, None), F.linear(x, weight))
    assert split.differing("kernel") == {(256, 64, False, 4, 2, 4): {4}}
    assert "kernel" not in split.ways().values()


@needs_kernel
@pytest.mark.parametrize("seqs", [4, 8, 16])
def test_decode_through_the_kernel_gives_stock_tokens_and_logits(seqs, two_threads, kernel_wins):
    model = tiny_model("llama", seed=11 + seqs, hidden_size=128, intermediate_size=256)
    ref = mirror(model)
    prompts = workload(11 + seqs, seqs)
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=seqs) as engine:
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
        ways = engine.runner.row_split_ways()
    assert_stock(ref, prompts, outputs)
    if "kernel" not in ways.values():
        pytest.skip("the kernel's bits matched F.linear's at no decode row count on this CPU")


@needs_kernel
def test_a_training_step_between_decode_steps_is_seen_by_the_kernel(two_threads, kernel_wins):
    model = tiny_model("llama", seed=21, hidden_size=128, intermediate_size=256)
    first, second = workload(21, 8), workload(22, 8)
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=8) as engine:
        engine.generate(first, GREEDY, use_tqdm=False)
        sgd_step(model, first)
        ref = mirror(model)
        outputs = engine.generate(second, GREEDY, use_tqdm=False)
        ways = engine.runner.row_split_ways()
    assert_stock(ref, second, outputs)
    if "kernel" not in ways.values():
        pytest.skip("the kernel's bits matched F.linear's at no decode row count on this CPU")


def test_row_kernel_false_keeps_it_out_and_the_setting_is_checked(two_threads, kernel_wins):
    model = tiny_model("llama", seed=23, hidden_size=128, intermediate_size=256)
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=8, row_kernel=False) as engine:
        engine.generate(workload(23, 8), GREEDY, use_tqdm=False)
        assert "kernel" not in engine.runner.row_split_ways().values()
    with pytest.raises(ConfigError, match="row_kernel must be True or False, got 1"):
        Engine(model, num_blocks=64, block_size=4, row_kernel=1)
