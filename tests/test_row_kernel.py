"""The few-row linear kernel (``row_kernel.py``, ``row_kernel.c``): it sums in blocks and in four lanes exactly as
documented (checked against emulations of the two orders, whatever MKL does on this CPU), the row split keeps it only
where its bits are ``F.linear``'s, the Engine's decode steps through it give stock tokens and logits, and it is
refused where it cannot serve."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from models import FIRST_TOKEN, VOCAB, tiny_model
from test_weights_engine import assert_stock, mirror, sgd_step, workload

from pagedcore import c_library
from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers import row_kernel as row_kernel_module
from pagedcore.adapters.transformers.row_kernel import (
    BLAS,
    LANES,
    LANES16,
    ONE_ROW,
    ONE_ROW16,
    WIDTHS,
    Order,
    RowKernel,
    load,
)
from pagedcore.adapters.transformers.row_split import MAX_ROWS, TRIALS, RowSplit
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


def lane_sums(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, head: int = 0) -> torch.Tensor:
    """The documented LANES order in float32: each product rounded, added into four lanes by column mod 4 from zero
    in column order (the first ``head`` all into lane 0), the lanes summed (0 + 2) + (1 + 3), then the bias."""
    products = x[:, None, :] * weight[None, :, :]  # (rows, outputs, columns), each rounded
    lanes = torch.zeros(*products.shape[:2], 4)
    for k in range(products.shape[2]):
        lanes[:, :, 0 if k < head else k % 4] += products[:, :, k]
    out = (lanes[:, :, 0] + lanes[:, :, 2]) + (lanes[:, :, 1] + lanes[:, :, 3])
    return out if bias is None else out + bias


def fma_chain(x: np.ndarray, w: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """``acc + x * w`` rounded once to float32 (an FMA: the float64 product of two float32 values is exact)."""
    return (x.astype(np.float64) * w.astype(np.float64) + acc.astype(np.float64)).astype(np.float32)


def halved(lanes: np.ndarray) -> np.ndarray:
    """The lanes (last axis) added pairwise, lane i to lane i + half, until one is left."""
    while lanes.shape[-1] > 1:
        half = lanes.shape[-1] // 2
        lanes = lanes[..., :half] + lanes[..., half:]
    return lanes[..., 0]


def sixteen_lane_sums(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The documented LANES16 order: one FMA chain per lane from zero over the columns k = lane (mod 16), the lanes
    added in four groups of four ((0-3 + 4-7) + 8-11) + 12-15, the four sums (0 + 1) + (2 + 3), then the bias."""
    xs, ws = x.numpy(), weight.numpy()
    lanes = np.zeros((xs.shape[0], ws.shape[0], 16), dtype=np.float32)
    for k in range(xs.shape[1]):
        lanes[:, :, k % 16] = fma_chain(xs[:, k, None], ws[None, :, k], lanes[:, :, k % 16])
    v = ((lanes[..., 0:4] + lanes[..., 4:8]) + lanes[..., 8:12]) + lanes[..., 12:16]
    out = torch.from_numpy((v[..., 0] + v[..., 1]) + (v[..., 2] + v[..., 3]))
    return out if bias is None else out + bias


def one_row16_sums(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The documented ONE_ROW16 order: column 0's product starts lane 0 of sixteen, columns 1 .. K - 16 are FMA'd
    into lane (k - 1) mod 16, the lanes halved to one; that sum starts lane 0 of eight, columns K - 15 .. K - 8 are
    FMA'd into them, columns K - 7 .. K - 1 added as rounded products into lanes 0-6, the eight halved, the bias."""
    xs, ws = x.numpy(), weight.numpy()
    rows, width = xs.shape
    lanes = np.zeros((rows, ws.shape[0], 16), dtype=np.float32)
    lanes[:, :, 0] = xs[:, 0, None] * ws[None, :, 0]
    for k in range(1, width - 15):
        lanes[:, :, (k - 1) % 16] = fma_chain(xs[:, k, None], ws[None, :, k], lanes[:, :, (k - 1) % 16])
    tail = np.zeros((rows, ws.shape[0], 8), dtype=np.float32)
    tail[:, :, 0] = halved(lanes)
    for lane in range(8):
        k = width - 15 + lane
        tail[:, :, lane] = fma_chain(xs[:, k, None], ws[None, :, k], tail[:, :, lane])
    for lane in range(7):
        k = width - 7 + lane
        tail[:, :, lane] += xs[:, k, None] * ws[None, :, k]
    out = torch.from_numpy(halved(tail))
    return out if bias is None else out + bias


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("width", [32, 48, 512])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_sums_in_sixteen_lanes_as_documented(rows, width, bias):
    """MKL's two orders on an Intel Xeon with AVX-512, checked against their emulations on any CPU."""
    torch.manual_seed(rows * 31 + width)
    weight, x = torch.randn(24, width), torch.randn(rows, width)
    b = torch.randn(24) if bias else None
    assert KERNEL is not None
    for threads in (1, 2):
        assert torch.equal(KERNEL.linear(x, weight, b, LANES16, threads), sixteen_lane_sums(x, weight, b))
        assert torch.equal(KERNEL.linear(x, weight, b, ONE_ROW16, threads), one_row16_sums(x, weight, b))


@needs_kernel
def test_the_sixteen_lane_orders_refuse_a_width_they_do_not_serve():
    assert KERNEL is not None
    with pytest.raises(ValueError, match="row kernel"):
        KERNEL.linear(torch.randn(2, 40), torch.randn(8, 40), None, LANES16, 1)  # 40 columns: not a multiple of 16
    with pytest.raises(ValueError, match="row kernel"):
        KERNEL.linear(torch.randn(1, 16), torch.randn(8, 16), None, ONE_ROW16, 1)  # its tail needs 32 columns
    assert Order(0, 0, 16).label(3) == "16 lanes" and Order(256, 4, 16).label(6) == "256 to row 4, 16 lanes"


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_sums_in_four_lanes_as_documented(rows, bias):
    torch.manual_seed(rows)
    weight, x = torch.randn(24, 264), torch.randn(rows, 264)
    b = torch.randn(24) if bias else None
    assert KERNEL is not None
    for threads in (1, 2):
        assert torch.equal(KERNEL.linear(x, weight, b, LANES, threads), lane_sums(x, weight, b))
        assert torch.equal(KERNEL.linear(x, weight, b, ONE_ROW, threads), lane_sums(x, weight, b, head=4))


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
        assert torch.equal(
            KERNEL.linear(x, weight, b, Order.blocks(width, rows), threads), blocked_sums(x, weight, b, width)
        )


@pytest.fixture
def wide_kernel():
    """The process's kernel with its 512-bit blocked rows on (skips where the CPU has no AVX-512F); restored after."""
    assert KERNEL is not None
    before = KERNEL.wide
    if not KERNEL.set_wide(True):
        KERNEL.set_wide(before)
        pytest.skip("no AVX-512F on this CPU: the blocked rows run in 256-bit vectors only")
    yield KERNEL
    KERNEL.set_wide(before)


@needs_kernel
@pytest.mark.parametrize("rows", [9, 12, 13, 16, 25, 64, 100])
@pytest.mark.parametrize("width", [64, 192, 384])
@pytest.mark.parametrize("bias", [False, True])
def test_the_wide_blocked_rows_sum_in_the_documented_order(rows, width, bias, wide_kernel):
    """The 512-bit path (32 outputs at a time, rows in groups of up to 12, for weights whose rows are a multiple of 32)
    and the 256-bit one give the documented blocked order's bits, so each other's, with lanes rows after the blocked
    ones too; a weight of 104 rows (not a multiple of 32) keeps the 256-bit path and its bits."""
    torch.manual_seed(rows * 3 + width)
    weight, x = torch.randn(104, 384), torch.randn(rows, 384)
    b = torch.randn(104) if bias else None
    expected = blocked_sums(x, weight, b, width)
    w96, b96 = weight[:96], None if b is None else b[:96]
    tail = lane_sums(x[rows - 2 :], w96, b96)
    for threads in (1, 2):
        for on in (True, False):
            wide_kernel.set_wide(on)
            got = wide_kernel.linear(x, w96, b96, Order.blocks(width, rows), threads)
            assert torch.equal(got, expected[:, :96]), (on, threads)
            got = wide_kernel.linear(x, w96, b96, Order(width, rows - 2), threads)
            assert torch.equal(got, torch.cat([expected[: rows - 2, :96], tail])), (on, threads)
            got = wide_kernel.linear(x, weight, b, Order.blocks(width, rows), threads)
            assert torch.equal(got, expected), (on, threads)


@needs_kernel
def test_the_wide_path_is_off_where_asked_and_reported(wide_kernel, monkeypatch):
    assert wide_kernel.set_wide(False) is False and wide_kernel.wide is False
    assert wide_kernel.set_wide(True) is True and wide_kernel.wide is True
    monkeypatch.setenv("PAGEDCORE_ROW_KERNEL_WIDE", "0")
    built = row_kernel_module._build()
    assert built is not None and built.wide is False
    assert wide_kernel.set_wide(True) is True  # a library of its own: the process's kernel kept its path


@needs_kernel
@pytest.mark.parametrize(("rows", "blocked"), [(5, 4), (7, 4), (9, 8), (11, 8), (17, 12), (3, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_past_lanes_from_are_summed_in_four_lanes(rows, blocked, bias):
    """MKL at 2 threads sums 5-7 rows as 4 in blocks and the rest in four lanes (9-11: 8 and the rest)."""
    torch.manual_seed(rows)
    weight, x = torch.randn(40, 384), torch.randn(rows, 384)
    b = torch.randn(40) if bias else None
    assert KERNEL is not None
    expected = torch.cat([blocked_sums(x, weight, b, 64)[:blocked], lane_sums(x, weight, b)[blocked:]])
    for threads in (1, 2):
        assert torch.equal(KERNEL.linear(x, weight, b, Order(64, blocked), threads), expected)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_finds_mkls_order_or_none(threads):
    """Where MKL sums in one of the kernel's orders (with MKL 2024 on Zen 4: ONE_ROW at 1 row, LANES at 2-3 rows,
    blocks of 192 from 4 rows up, and at 2 threads blocks for the first 4 or 8 of 5-7 and 9-11 rows and LANES for the
    rest; on a Xeon with AVX-512: ONE_ROW16 at 1 row, LANES16 at 2-15, blocks of 256 or 384 from 16 up) the kernel
    gives F.linear's bits; an order is reported only where they are equal."""
    assert KERNEL is not None
    torch.manual_seed(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    found = {}
    try:
        for shape in [(512, 512), (1536, 512), (512, 1536)]:
            weight = torch.randn(*shape) * 0.02
            for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 16, 64):
                x = torch.randn(rows, shape[1])
                order = KERNEL.exact_order(x, weight, None, F.linear(x, weight), threads)
                found[shape, rows] = order
                if order is not None:
                    assert order in (LANES, ONE_ROW, LANES16, ONE_ROW16) or order.width in (*WIDTHS, shape[1])
                    assert torch.equal(KERNEL.linear(x, weight, None, order, threads), F.linear(x, weight))
    finally:
        torch.set_num_threads(before)
    if all(order is None for order in found.values()):
        pytest.skip("MKL on this CPU sums in none of the kernel's orders: the kernel never serves here")


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
            KERNEL.linear(x, w, b, Order.blocks(8, 2), 1)
    # a width not a multiple of 8, none for blocked rows, lanes_from outside the rows: refused by the C code itself
    # and a head other than 0 or 4, or one with no row in lanes
    for order in (Order(-8, 2), Order(12, 2), Order(0, 1), Order(8, 3), Order(8, -1), Order(0, 0, 2), Order(8, 2, 4)):
        with pytest.raises(ValueError, match=r"in order Order\(width="):
            KERNEL.linear(torch.randn(2, 32), weight, None, order, 1)


@needs_kernel
def test_what_records_a_steps_ops_sees_the_kernels_result():
    """The CPU stand-in for CUDA graphs (``TraceCapture``) replays the ops a step dispatched. The kernel called behind
    torch's back (ctypes on an empty tensor) replayed as that empty tensor: NaN logits, which CI found in
    ``test_decode_graphs.py``; as one op it is replayed with the new inputs."""
    from pagedcore.adapters.transformers.decode_graphs import TraceCapture

    assert KERNEL is not None
    weight, x = torch.randn(16, 32), torch.randn(4, 32)
    replay, out = TraceCapture().capture(lambda: KERNEL.linear(x, weight, None, Order(8, 2), 1))
    x.copy_(torch.randn(4, 32))
    replay()
    assert torch.equal(out, torch.cat([blocked_sums(x, weight, None, 8)[:2], lane_sums(x, weight, None)[2:]]))


def test_it_is_not_built_where_it_cannot_serve(monkeypatch):
    monkeypatch.setenv("PAGEDCORE_ROW_KERNEL", "0")
    assert row_kernel_module._build() is None
    monkeypatch.delenv("PAGEDCORE_ROW_KERNEL")
    monkeypatch.setattr(c_library.shutil, "which", lambda name: None)  # no C compiler
    assert row_kernel_module._build() is None
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")  # no AVX2
    assert row_kernel_module._build() is None


def test_it_is_built_from_the_source_its_module_was_imported_with(monkeypatch, tmp_path):
    """The C code is compiled at the first Engine, maybe long after the import: a row_kernel.c changed on disk in
    between (a package upgraded in place; stop 57 edited it under a running benchmark) handed the loaded ctypes
    signatures a kernel that takes other arguments. It is now the text read at import that is built."""
    changed = tmp_path / "row_kernel.c"
    changed.write_text("int row_kernel_linear(void) { return -1; }\n")  # what a later version might hold
    monkeypatch.setattr(row_kernel_module, "_SOURCE", changed)
    built = row_kernel_module._build()
    if KERNEL is None:
        assert built is None
        return
    assert built is not None
    weight, x = torch.randn(16, 32), torch.randn(4, 32)
    assert torch.equal(built.linear(x, weight, None, Order.blocks(8, 4), 1), blocked_sums(x, weight, None, 8))


def test_a_row_count_whose_kernel_bits_differ_keeps_another_way(monkeypatch, two_threads):
    class Off(RowKernel):
        def __init__(self) -> None:
            self._widths = {}

        def linear(self, x, weight, bias, order, threads):
            return F.linear(x, weight, bias) + 1e-7

    split = RowSplit(Off())
    weight = torch.randn(256, 64)
    for _ in range(3 * TRIALS + 2):
        x = torch.randn(4, 64)
        assert torch.equal(split.linear(x, weight, None), F.linear(x, weight))
    assert split.differing("kernel") == {(256, 64, False, 4, 2, 4): {4}}
    assert "kernel" not in split.ways().values()


def test_each_row_count_of_a_bucket_keeps_its_own_order(two_threads, trial_clock):
    """MKL sums 3 rows in four lanes and 4 rows in blocks: one power-of-two bucket (3-4 rows) then holds two
    orders, and each row count is served in its own (a kernel exact in LANES below 4 rows, in blocks of 64 at 4)."""

    class TwoOrders(RowKernel):
        def __init__(self) -> None:
            self._widths = {}

        def linear(self, x, weight, bias, order, threads):
            right = LANES if x.shape[0] < 4 else Order.blocks(64, 4)
            trial_clock[0] -= 0.75  # timed, it wins
            return F.linear(x, weight, bias) + (0 if order == right else 1e-7)

    split = RowSplit(TwoOrders())
    weight = torch.randn(256, 64)
    for i in range(4 * TRIALS + 4):
        x = torch.randn(3 + i % 2, 64)
        assert torch.equal(split.linear(x, weight, None), F.linear(x, weight))
    key = (256, 64, False, 4, 2, 4)
    assert split._buckets[key].orders == {3: LANES, 4: Order.blocks(64, 4)}
    assert split.ways()[key] == "kernel" and split.differing("kernel") == {}


def mkl_order_script():
    """``scripts/mkl_order.py`` as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "mkl_order.py"
    spec = importlib.util.spec_from_file_location("mkl_order", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_kernel
def test_the_order_probe_reads_a_known_summation_tree():
    """``scripts/mkl_order.py`` found the Xeon's orders by reading F.linear's tree; run on the kernel's own orders it
    must read back what they are: a chain of 8-column blocks, and sixteen lanes added in four groups."""
    script = mkl_order_script()
    assert KERNEL is not None

    def through(order: Order):
        return lambda x, weight: KERNEL.linear(x, weight, None, order, 1)

    blocks = script.linear_tree(64, 32, 2, 0, through(Order.blocks(8, 2)))
    assert [blocks[size] for size in range(2, 9)] == [[k] for k in range(1, 8)]  # column 0's chain, in order
    assert blocks[16] == list(range(8, 16))  # the second block's sum joins the first's
    lanes = script.linear_tree(64, 64, 2, 0, through(LANES16))
    assert lanes[2] == [16] and lanes[3] == [32] and lanes[4] == [48]  # lane 0: columns 0, 16, 32, 48
    assert lanes[8] == [4, 20, 36, 52]  # then lane 4 joins it (((0-3) + (4-7)) ...)
    assert set(lanes[32]) == {k for k in range(64) if k % 4 == 1}  # the group sums: (0 + 1) + (2 + 3)
    assert set(lanes[64]) == {k for k in range(64) if k % 4 in (2, 3)}
    assert script.sum_tree(64, 0)  # torch's own row sum: read without error


needs_blas = pytest.mark.skipif(KERNEL is None or not KERNEL.blas, reason="no row kernel, or torch's BLAS is not MKL")


@needs_blas
@pytest.mark.parametrize("shape", [(512, 512), (128, 512), (1536, 512), (512, 1536), (32000, 512), (64, 128)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_blas_call_gives_f_linears_bits(shape, bias):
    """BLAS is MKL's sgemm called from C with the arguments torch's addmm passes: F.linear's bits by construction, at
    every row count and thread count (a bias copied into the rows first, added with beta = 1)."""
    assert KERNEL is not None
    torch.manual_seed(shape[0] + bias)
    weight = torch.randn(*shape) * 0.05
    b = torch.randn(shape[0]) if bias else None
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (*range(1, 18), 33, 64, 256):
                x = torch.randn(rows, shape[1])
                assert torch.equal(KERNEL.linear(x, weight, b, BLAS, threads), F.linear(x, weight, b)), (threads, rows)
    finally:
        torch.set_num_threads(before)
    assert BLAS.label(1) == "the BLAS's sgemm"


@needs_kernel
def test_the_blas_order_is_refused_where_no_sgemm_was_found():
    """A kernel built without the BLAS's address (another BLAS than MKL) answers BLAS with an error, not zeros."""
    library = c_library.build("row_kernel", row_kernel_module._SOURCE_TEXT, row_kernel_module._FLAGS)
    assert library is not None
    bare = RowKernel(library)
    assert not bare.blas
    with pytest.raises(ValueError, match="row kernel"):
        bare.linear(torch.randn(2, 64), torch.randn(16, 64), None, BLAS, 1)


@needs_kernel
@pytest.mark.parametrize("kernel_faster", [False, True])
def test_the_tape_calls_the_blas_where_f_linear_won_the_trials_and_the_kernel_where_it_did(
    kernel_faster, monkeypatch, two_threads, trial_clock
):
    """RowSplit.exact_order (the decode tape's linear): the kernel's exact order where its trials beat F.linear's,
    else the BLAS call (F.linear's own GEMM from C); the kernel's order where the BLAS is not there."""
    assert KERNEL is not None
    real = RowKernel.linear

    def timed(self: RowKernel, x: torch.Tensor, weight: torch.Tensor, bias: object, order: Order, threads: int):
        trial_clock[0] += -0.75 if kernel_faster else 0.75
        return real(self, x, weight, bias, order, threads)  # type: ignore[arg-type]

    monkeypatch.setattr(RowKernel, "linear", timed)
    split, weight = RowSplit(KERNEL), torch.randn(128, 512)
    for _ in range(3 * TRIALS + 2):
        x = torch.randn(1, 512)
        assert torch.equal(split.linear(x, weight, None), F.linear(x, weight))
    shape = (128, 512, False)
    kernel_order = split._buckets[(128, 512, False, 2, 2, 1)].orders.get(1)
    if kernel_order is None and not KERNEL.blas:
        pytest.skip("neither the kernel's orders nor the BLAS serve on this CPU")
    if kernel_faster and kernel_order is not None:
        assert split.settled(shape, 1, 2) == "kernel" and split.exact_order(shape, 1, 2) == kernel_order
    elif KERNEL.blas:
        assert split.exact_order(shape, 1, 2) == BLAS
    monkeypatch.setattr(KERNEL, "blas", False)  # a fresh split on a kernel without the BLAS: the kernel's order
    split = RowSplit(KERNEL)
    for _ in range(3 * TRIALS + 2):
        split.linear(torch.randn(1, 512), weight, None)
    assert split.exact_order(shape, 1, 2) == split._buckets[(128, 512, False, 2, 2, 1)].orders.get(1)


@needs_kernel
@pytest.mark.parametrize("seqs", [2, 3, 4, 6, 8, 11, 16])
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


@needs_kernel
def test_prefill_chunks_through_the_kernel_give_the_bits_of_f_linear(two_threads, kernel_wins):
    """Prefill calls of more than MAX_ROWS rows take the kernel where its bits are F.linear's and it timed faster:
    logits equal to the bit to the same Engine's without the kernel, tokens stock, over prompt sets whose prefill row
    counts differ every round (each count checked at its first call, that check a trial of both ways)."""
    model = tiny_model("llama", seed=31, hidden_size=128, intermediate_size=256)
    ref = mirror(model)
    rng = torch.Generator().manual_seed(31)  # 6 prompts of 60-110 tokens, nothing shared: 360-660 rows of prefill
    sizes = [[60 + 7 * r + 3 * i for i in range(6)] for r in range(4)]
    rounds = [[torch.randint(FIRST_TOKEN, VOCAB, (n,), generator=rng).tolist() for n in row] for row in sizes]
    got, plain = [], []
    for kernel, into in ((True, got), (False, plain)):
        with Engine(model, num_blocks=1024, block_size=4, max_num_seqs=8, row_kernel=kernel) as engine:
            for prompts in rounds:
                into.append(engine.generate(prompts, GREEDY, use_tqdm=False))
            ways = engine.runner.row_split_ways()
        if kernel:
            prefill = {key: way for key, way in ways.items() if key[5] > MAX_ROWS}
    for prompts, outputs, others in zip(rounds, got, plain):
        assert_stock(ref, prompts, outputs)
        for out, other in zip(outputs, others):
            assert out.token_ids == other.token_ids
            assert all(torch.equal(a, b) for a, b in zip(out.samples[0].logits, other.samples[0].logits))
    assert prefill, "no prefill chunk of more than MAX_ROWS rows reached the row split"
    if "kernel" not in prefill.values():
        pytest.skip("the kernel's bits matched F.linear's at no prefill row count on this CPU")


def test_row_kernel_false_keeps_it_out_and_the_setting_is_checked(two_threads, kernel_wins):
    model = tiny_model("llama", seed=23, hidden_size=128, intermediate_size=256)
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=8, row_kernel=False) as engine:
        engine.generate(workload(23, 8), GREEDY, use_tqdm=False)
        assert "kernel" not in engine.runner.row_split_ways().values()
    with pytest.raises(ConfigError, match="row_kernel must be True or False, got 1"):
        Engine(model, num_blocks=64, block_size=4, row_kernel=1)


def byte_product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, levels: int) -> torch.Tensor:
    """The documented integer product in torch: each row of ``x`` rounded to ``levels`` steps of its largest
    magnitude (float32 ops, ties to even), the sums exact in int64, then float32 times the two scales' product."""
    largest = x.abs().amax(dim=1)
    inverse = torch.where(largest > 0, torch.tensor(float(levels)) / largest, 0)
    steps = (x * inverse[:, None]).round().clamp(-levels, levels).to(torch.int64)
    sums = steps @ q.to(torch.int64).T
    return sums.float() * ((largest / levels)[:, None] * scales[None, :])


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 9, 16])
def test_the_byte_product_is_the_documented_integer_product(rows):
    """``byte_linear`` rounds each row to its integer steps, sums exactly in int32 and scales in float32, at each
    row grouping, an odd last panel, a row of zeros and a row at int8's and int16's extremes; bit for bit."""
    generator = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (40, 96), generator=generator, dtype=torch.int8)  # 5 panels: two pairs, one alone
    q[3] = 127
    scales = torch.rand(40, generator=generator) * 0.01
    x = torch.randn(rows, 96, generator=generator) * 3
    x[0, 5] = -50.0  # the row's largest magnitude: -levels steps
    if rows > 2:
        x[2] = 0.0
    turned = RowKernel.turned_bytes(q)
    assert turned is not None and turned.shape == (5, 48, 8, 2)
    assert turned[1, 3].tolist() == q[8:16, 6:8].tolist()  # panel 1, columns 6 and 7: outputs 8-15
    assert KERNEL is not None
    expected = byte_product(x, q, scales, RowKernel.byte_levels(96))
    for threads in (1, 2):
        assert torch.equal(KERNEL.byte_linear(x, turned, scales, threads), expected)


def test_the_byte_levels_keep_every_int32_sum_exact():
    for width in (8, 512, 516, 520, 1024, 4096, 8192, 65536):
        levels = RowKernel.byte_levels(width)
        assert 1 <= levels <= 32767 and levels * 127 * width < 2**31
        assert levels == 32767 or (levels + 1) * 127 * width >= 2**31  # the most that fits


@needs_kernel
def test_what_the_byte_product_would_misread_is_refused():
    assert KERNEL is not None
    q = torch.randint(-127, 128, (16, 32), dtype=torch.int8)
    turned, scales = RowKernel.turned_bytes(q), torch.rand(16)
    assert turned is not None and RowKernel.turned_bytes(q[:12]) is None and RowKernel.turned_bytes(q.float()) is None
    for x, copy, s in [
        (torch.randn(2, 32).double(), turned, scales),  # another dtype
        (torch.randn(2, 24), turned, scales),  # a narrower input
        (torch.randn(32, 2).t(), turned, scales),  # a transposed view
        (torch.randn(2, 32), turned.float(), scales),  # a float copy
        (torch.randn(2, 32), turned.transpose(1, 2), scales),  # not the turned layout
        (torch.randn(2, 32), q, scales),  # a plain int8 weight
        (torch.randn(2, 32), turned, scales[:8]),  # scales of another weight
        (torch.randn(2, 32), turned, scales.double()),  # scales of another dtype
    ]:
        with pytest.raises(ValueError, match="row kernel: cannot take"):
            KERNEL.byte_linear(x, copy, s, 1)
    x = torch.randn(2, 32)
    x[1, 4] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        KERNEL.byte_linear(x, turned, scales, 1)
    x = torch.randn(2, 32)
    x[1] *= 1e-34  # its step, largest / 32767, below float32's normal range
    with pytest.raises(ValueError, match="normal range"):
        KERNEL.byte_linear(x, turned, scales, 1)
    x[1] = 0.0  # a row of zeros: step zero, products zero
    assert torch.equal(KERNEL.byte_linear(x, turned, scales, 1)[1], torch.zeros(16))


@needs_kernel
def test_a_compiled_decode_step_calls_the_kernel_where_it_settled(two_threads, kernel_wins, monkeypatch):
    """A compiled step (``Engine(compile=True)``) traces each layer's settled way; a layer the kernel serves (at one
    row, where this CPU's MKL sums in one of its orders: Zen 4's and the Xeon's are known) is one opaque
    ``pagedcore::row_linear`` op in the graph, which runs the kernel, and the tokens and logits stay stock's."""
    from pagedcore.adapters.transformers import compiled as compiled_module
    from pagedcore.adapters.transformers.prepacked import ROW_LINEAR

    assert KERNEL is not None
    for shape in ((128, 128), (64, 128), (256, 128), (128, 256)):  # the model's linears at one row
        x, weight = torch.randn(1, shape[1]), torch.randn(*shape)
        if KERNEL.exact_order(x, weight, None, F.linear(x, weight), 2) is None:
            pytest.skip(f"MKL here sums one row of a {shape} weight in none of the kernel's orders")

    monkeypatch.setattr(compiled_module, "BACKEND", "eager")
    graphs = []
    compiler = compiled_module.CompiledDecode._compiler

    def capture(self, graph, example_inputs):
        graphs.append(graph)
        return compiler(self, graph, example_inputs)

    monkeypatch.setattr(compiled_module.CompiledDecode, "_compiler", capture)
    model = tiny_model("llama", seed=12, hidden_size=128, intermediate_size=256)
    ref = mirror(model)
    prompts = workload(12, 2)
    with Engine(model, num_blocks=64, block_size=4, max_num_seqs=1, compile=True) as engine:
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
        ways = engine.runner.row_split_ways()
        stats = engine.stats()
    assert stats.compiled_steps > 0 and stats.compile_failures == 0 and graphs
    kernel_layers = sum(way == "kernel" for key, way in ways.items() if key[-1] == 1)  # one-row buckets
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.model.modules())
    assert kernel_layers > 0
    ops = [[node.target for node in graph.graph.nodes if node.op == "call_function"] for graph in graphs]
    assert ops[-1].count(ROW_LINEAR) == linears and ops[-1].count(torch.bmm) == 0  # every layer: the kernel's op
    assert_stock(ref, prompts, outputs)


@needs_kernel
@pytest.mark.parametrize("seed", [0, 1])
def test_rows_that_are_not_contiguous_keep_f_linears_bits(seed, two_threads, kernel_wins):
    """F.linear hands MKL a transposed input as it lies, and MKL sums it in another order; the kernel, given a copy,
    summed it in the order checked on contiguous rows (test_linear_routes.py found it: such rows now keep F.linear)."""
    torch.manual_seed(seed)
    split, weight, bias = RowSplit(KERNEL), torch.randn(64, 64), torch.randn(64)
    for _ in range(3 * TRIALS + 3):
        x = torch.randn(3, 64)
        assert torch.equal(split.linear(x, weight, bias), F.linear(x, weight, bias))
    if "kernel" not in split.ways().values():
        pytest.skip("the kernel's bits matched F.linear's at 3 rows nowhere on this CPU")
    x = torch.randn(64, 3).t()
    assert torch.equal(split.linear(x, weight, bias), F.linear(x, weight, bias))
