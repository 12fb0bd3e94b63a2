"""The low-precision screen of the LM head (pagedcore/adapters/transformers/head_screen.py): the greedy tokens are
the argmax of the head's own F.linear, bit for bit, whatever the rows, outliers, ties or weights; the bound it relies
on holds; and where a check fails (a bound, the exact columns' bits) the Engine still answers generate's tokens."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from test_argmax_head import PROMPTS, model, stock, tokens

from pagedcore.adapters.transformers import Engine, argmax_head, head_screen, row_kernel
from pagedcore.adapters.transformers.argmax_head import ArgmaxHead
from pagedcore.adapters.transformers.head_screen import COLUMNS, HeadScreen

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not head_screen.available(), reason="fbgemm's float16 GEMM (x86 CPUs) is not in this torch"),
]


@pytest.fixture(params=["fbgemm", "kernel"])
def product(request):
    """The screen's approximate product: fbgemm's float16 GEMM, or the row kernel's int8 one (RowKernel.byte_linear)."""
    if request.param == "fbgemm":
        return None
    kernel = row_kernel.load()
    if kernel is None:
        pytest.skip("no row kernel on this machine (no C compiler or no AVX2)")
    return kernel


def test_screened_tokens_are_the_argmax_of_f_linear_and_the_bound_holds(product):
    generator = torch.Generator().manual_seed(0)
    screen = HeadScreen(product)
    served = 0
    for trial in range(60):
        vocab, k = (3000, 64) if trial % 2 else (1200, 256)
        weight = torch.randn(vocab, k, generator=generator) * (0.02 + 0.5 * (trial % 3))
        if trial % 7 == 0:
            weight *= 1e-4  # values under float16's normal range: zero in the copy, the bound counts them
        weight[:, 0] *= 1 + 10 * (trial % 4 == 0)  # an outlier feature in some weights
        rows = 1 + trial % 9
        x = torch.randn(rows, k, generator=generator)
        if trial % 3 == 0:
            x[:, 3] *= 30  # an outlier activation: a coarse step for the whole step's rows
        if trial % 5 == 0:  # row 0's maximum in two columns (a tie): the first must win
            weight[7] = weight[vocab // 2] = x[0].sign() * weight.abs().max()
        step = screen.screen(x, weight)
        exact = F.linear(x, weight)
        if step is None:
            continue
        served += 1
        assert step.tokens == exact.argmax(-1).tolist()  # torch's argmax: the first maximal column
        assert len(step.columns) % COLUMNS == 0 or len(step.columns) == vocab
        assert torch.equal(step.exact.view(torch.int32), exact[:, torch.from_numpy(step.columns)].view(torch.int32))
        apart = (step.approx.double() - exact.double()).abs().amax(dim=1).numpy()
        assert (apart <= step.bound).all()
        if trial % 5 == 0:
            assert step.tokens[0] == 7 and vocab // 2 in step.columns
    assert served >= 45  # the rest: weights under float16's normal range leave too many candidates


def test_a_weight_that_is_a_transposed_view_is_screened(product):
    """A head weight replaced by a transposed view (``nn.Parameter(w.t())``) is screened like a contiguous one."""
    weight = (torch.randn(64, 1000) * 0.05).t()
    x = torch.randn(3, 64)
    step = HeadScreen(product).screen(x, weight)
    assert step is not None and step.tokens == F.linear(x, weight).argmax(-1).tolist()


def test_the_bound_counts_the_int8_products_rounding_of_the_input():
    """The int8 copy is exact here (each row 2^-7 times integers up to 127), so the copy's own term is zero and only
    the rounding of the input rows to int16 steps (an outlier makes each step coarse) moves the approximate logits:
    they stay within the bound, and not within it without that term."""
    kernel = row_kernel.load()
    if kernel is None:
        pytest.skip("no row kernel on this machine (no C compiler or no AVX2)")
    generator = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (1000, 64), generator=generator)
    q[:, 0] = 127
    weight = q.float() * 2.0**-7
    x = torch.rand(4, 64, generator=generator) * 0.9 + 0.05
    x[:, 3] = 3000.0  # each row's step: 3000 / 32767, so every other value moves by up to half of it
    step = HeadScreen(kernel).screen(x, weight)
    assert step is not None and step.tokens == F.linear(x, weight).argmax(-1).tolist()
    copy = HeadScreen(kernel)._fresh_copy(weight)  # the bound's terms
    assert copy.apart == 0.0 and copy.spread > 0
    apart = (step.approx.double() - F.linear(x.double(), weight.double())).abs().amax(dim=1).numpy()
    size = x.double().abs()
    without = (64 + 8) * 2.0**-23 * size.sum(dim=1).numpy() * copy.largest * (1 + 1e-6)
    assert (apart <= step.bound).all() and (apart > without).all()


def test_scales_below_float32s_normal_range_are_not_screened():
    """The int8 product scales each sum by a row's step times a weight row's scale: where either (or the product)
    would fall below float32's normal range, a CPU that flushes such values would compute zeros outside the bound,
    so the step or the weight is left to the caller; and the kernel is never handed such a row."""
    kernel = row_kernel.load()
    if kernel is None:
        pytest.skip("no row kernel on this machine (no C compiler or no AVX2)")
    weight, x = torch.randn(1000, 64), torch.randn(3, 64)
    screen = HeadScreen(kernel)
    assert screen.screen(x, weight) is not None
    tiny = x.clone()
    tiny[1] *= 1e-35  # a row whose step (largest / 32767) is subnormal
    assert screen.screen(tiny, weight) is None
    small = x.clone()
    small[2] *= 1e-32  # its step is normal; times the smallest weight row scale (about 0.02) it is not
    assert screen.screen(small, weight) is None
    faint = weight.clone()
    faint[7] *= 1e-37  # a weight row whose scale is subnormal: no int8 copy
    assert screen.screen(x, faint) is None


def plain_int8_copy(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, float, float]:
    """The int8 copy as its definition reads, over the whole weight at once (what ``_in_bytes`` made before it went
    chunk by chunk): the turned bytes, the row scales, and ``apart``, ``spread`` and ``largest``."""
    scales = (weight.abs().amax(dim=1) / 127).contiguous()
    steps = torch.where(scales[:, None] > 0, weight / scales.clamp_min(torch.finfo(torch.float32).tiny)[:, None], 0)
    q = steps.round().clamp(-127, 127).to(torch.int8)
    values = scales.double()[:, None] * q.double()
    apart = float((weight.double() - values).norm(dim=1).max())
    turned = row_kernel.RowKernel.turned_bytes(q)
    assert turned is not None
    return turned, scales, apart, float(values.norm(dim=1).max()), float(weight.abs().max())


@pytest.mark.parametrize("rows", [8, 1024, 2056, 4096])
def test_the_int8_copy_made_chunk_by_chunk_is_the_whole_weights_to_the_bit(rows):
    """A training step makes the copy again at the next greedy step: 833 ms for the benchmark head made over the
    whole weight, 115 chunk by chunk. Chunks, the finiteness read from the row maxima, zero rows without ``where``
    and the column pairs moved as int16 give the same bytes and figures (rows: one chunk, two, a partial one)."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(rows, 64, generator=generator) * torch.rand(rows, 1, generator=generator)
    weight[rows // 2] = 0.0  # a zero row: scale 0, steps 0
    weight[-1, :3] = -0.0
    copy = head_screen._in_bytes(weight, head_screen.WeightStamp.of(weight))
    assert copy.turned and isinstance(copy.packed, tuple)
    turned, scales, apart, spread, largest = plain_int8_copy(weight)
    assert torch.equal(copy.packed[0], turned) and copy.packed[0].is_contiguous()
    assert torch.equal(copy.packed[1], scales)
    assert (copy.apart, copy.spread, copy.largest) == (apart, spread, largest)
    for bad in (float("nan"), float("inf")):
        spoiled = weight.clone()
        spoiled[rows - 1, 7] = bad  # in the last chunk
        assert head_screen._in_bytes(spoiled, head_screen.WeightStamp.of(spoiled)).packed is None


def test_what_cannot_be_screened_is_left_to_the_caller(product):
    screen = HeadScreen(product)
    x = torch.randn(2, 64)
    assert screen.screen(x, torch.zeros(1000, 64)) is None  # every logit ties: every column a candidate
    weight = torch.randn(1000, 64)
    weight[3, 5] = float("nan")
    assert screen.screen(x, weight) is None  # a weight that is not finite
    assert screen.screen(x, torch.full((1000, 64), 1e5)) is None  # a weight float16 cannot hold
    x[1, 2] = float("inf")
    assert screen.screen(x, torch.randn(1000, 64)) is None  # an input that is not finite


@pytest.fixture
def screen_only(monkeypatch):
    init = ArgmaxHead.__init__  # every ArgmaxHead made takes the screen at every step

    def forced(self: ArgmaxHead, module: torch.nn.Linear, way: str = "auto", kernel=None, model=None) -> None:
        init(self, module, way="screen", kernel=kernel, model=model)

    monkeypatch.setattr(ArgmaxHead, "__init__", forced)


@pytest.mark.parametrize("kernel", [True, False])
def test_the_engine_serves_generates_tokens_through_the_screen_across_a_weights_update(screen_only, kernel):
    """With the row kernel (the default where it builds) the screen's product is the kernel's; without, fbgemm's."""
    net, reference = model(), model()
    with Engine(net, num_blocks=128, block_size=4, max_num_batched_tokens=16, row_kernel=kernel) as engine:
        head = engine.runner.argmax_head
        assert head._screen._kernel is (row_kernel.load() if kernel else None)
        assert tokens(engine, PROMPTS) == stock(reference, PROMPTS)
        assert tokens(engine, PROMPTS[:2] * 3) == stock(reference, PROMPTS[:2]) * 3
        assert 0 < head.counts.screened <= head.counts.steps  # the others: a new shape's check (the whole GEMM's)
        before = head.counts.screened
        with torch.no_grad():  # an optimizer step's in-place change: the float16 copy is made again
            for layer in (net, reference):
                layer.lm_head.weight.mul_(-1.0)
        assert tokens(engine, PROMPTS) == stock(reference, PROMPTS)
        assert head.counts.screened > before


def test_a_bound_that_fails_turns_the_screen_off_and_tokens_stay_generates(screen_only, monkeypatch, caplog):
    screen = HeadScreen.screen

    def too_tight(self, x, weight):
        step = screen(self, x, weight)
        if step is not None:
            step.bound[:] = 0.0  # a bound the approximate logits exceed
        return step

    monkeypatch.setattr(HeadScreen, "screen", too_tight)
    net = model()
    with caplog.at_level(logging.WARNING), Engine(net, num_blocks=128, block_size=4) as engine:
        assert tokens(engine, PROMPTS) == stock(model(), PROMPTS)
        head = engine.runner.argmax_head
        assert head.counts.screened == 0 and head.counts.steps > 0  # served by the chunks from then on
    assert "the head screen's bound failed" in caplog.text


def test_exact_columns_whose_bits_differ_are_not_trusted(screen_only, monkeypatch):
    class Shifted:  # a BLAS that sums the gathered columns' GEMM in another order
        @staticmethod
        def linear(x, weight, bias=None):
            out = torch.nn.functional.linear(x, weight, bias)
            return torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(head_screen, "F", Shifted)
    net = model()
    with Engine(net, num_blocks=128, block_size=4) as engine:
        assert tokens(engine, PROMPTS) == stock(model(), PROMPTS)
        head = engine.runner.argmax_head
        assert head.counts.screened == 0 and head.counts.steps > 0 and head.counts.checks > 0
    assert argmax_head.WAYS[-1] == "screen"


def test_the_benchmark_script_reports_each_row_count(monkeypatch, capsys):
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "head_screen_bench.py"
    argv = [str(script), "--size", "tiny", "--rows", "1,3", "--rounds", "1", "--evict-mib", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(script), run_name="__main__")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 1 |", "| 3 |"))]
    assert len(lines) == 2 and all(line.endswith("| True / True |") for line in lines)  # both screens, exact


@pytest.mark.parametrize("vocab", [1, 7, 255, 256, 257, 1000, 32000])
def test_the_padded_columns_are_the_candidates_and_then_the_first_other_columns(vocab):
    """_padded reads only the vocabulary's first columns for the filler: the same columns as the plain definition
    (every candidate, then the first non-candidates up to a multiple of COLUMNS, in order), at every density."""
    import numpy as np

    rng = np.random.default_rng(vocab)
    for density in (0.0, 0.001, 0.01, 0.2, 0.6, 1.0):
        for _ in range(5):
            candidates = rng.random(vocab) < density
            count = int(candidates.sum())
            width = min(-(-max(count, 1) // COLUMNS) * COLUMNS, vocab)
            plain = candidates.copy()
            plain[np.flatnonzero(~plain)[: width - count]] = True
            got = head_screen._padded(candidates, count, vocab)
            assert got.tolist() == np.flatnonzero(plain).tolist()
            assert len(got) == max(width, count) and candidates[got].sum() == count
