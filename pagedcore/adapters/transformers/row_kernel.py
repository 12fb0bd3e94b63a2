"""A C kernel for the few-row linear calls of the Engine's decode steps on the CPU (issue 33.2): ``F.linear``'s bits,
the weight read once, straight from its rows.

Why: MKL's ``sgemm`` behind ``F.linear`` copies the weight into its blocked layout inside every call, so a decode
step of a few rows moves the weight two or three times over; the row split (:mod:`.row_split`) shares that work
between the threads but keeps it. This kernel (``row_kernel.c``) reads each 8 x 8 tile of the weight once, turns it
in registers and multiplies it into the rows (AVX2 + FMA; the threads share the weight's rows through the OpenMP
runtime torch itself loaded).

Exactness first: MKL's ``sgemm`` sums each output in one of two orders (MKL 2024 on an AMD Zen 4): in blocks of the
inner dimension (192 columns: one FMA chain per block from zero, in column order, then the block sums added in order
to the bias), or with each product rounded and added into four lanes by column mod 4, the lanes summed
(0 + 2) + (1 + 3), then the bias. Which rows take which depends on the row count (and the threads): one row the four
lanes with its first four products all in lane 0, in order (:data:`ONE_ROW`: MKL's matrix-vector product); 2-3 rows
all four lanes; from 4 rows up all blocks, except that at 2 threads 5-7 and 9-11 rows take blocks for their first 4
or 8 rows and four lanes for the rest. On an Intel Xeon with AVX-512 the same MKL sums 2-15 rows in sixteen FMA
chains (:data:`LANES16`: lane ``k mod 16``, the lanes added in four groups of four, then the four sums pairwise),
one row in a variant of those (:data:`ONE_ROW16`: column 0 starts lane 0, a 15-column tail in eight lanes), and from
16 rows up in blocks of 256 columns (found with ``scripts/mkl_order.py``, which reveals the summation tree of
``F.linear`` on this CPU). The kernel sums in any of these, per row, as an :class:`Order` says. The order is
found, never assumed: at a row count's first call :meth:`RowKernel.exact_order` runs the kernel in each candidate
order and keeps the first whose bits equal ``F.linear``'s on the call's own rows; a row count none matches keeps the
other ways (:class:`~.row_split.RowSplit` owns that choice and the timing).

One more :class:`Order` is no order of the kernel's: :data:`BLAS` calls the BLAS's own ``sgemm`` (MKL's, inside
libtorch_cpu) with the arguments torch's ``addmm`` passes it for ``F.linear``, so its bits are ``F.linear``'s by
construction, and checked all the same. The decode tape (:mod:`.decode_tape`) calls a layer whose trials settled on
``F.linear`` that way, from C, at MKL's speed (on a Xeon with AVX-512 MKL's product streams a weight 2-2.5x faster than
this AVX2 kernel); :meth:`RowKernel.exact_order` never returns it (the kernel is what the trials time against
``F.linear``).

Where the CPU has AVX-512F, the rows summed in blocks run in 512-bit vectors, 32 outputs at a time (the same
chains, so the same bits: :meth:`RowKernel.set_wide`; ``PAGEDCORE_ROW_KERNEL_WIDE=0`` keeps them in 256-bit ones).
MKL on an AMD Zen 5 multiplies in 256-bit vectors though the CPU's FMA units are 512 bits wide, so there the kernel
can do twice the FMAs a cycle that ``F.linear`` does, with its bits.

Built at first use (:func:`load`) with the system's C compiler into a private temporary folder, loaded, and the file
removed (nothing is read from a folder another user could write). None where it cannot serve: not Linux on x86-64,
a CPU without AVX2 and FMA (torch's own CPU check), no C compiler, a failed build, or ``PAGEDCORE_ROW_KERNEL=0``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from pagedcore.c_library import build, can_build_avx2

from .graph_ops import graph_op

__all__ = [
    "BLAS",
    "KERNEL_LINEAR",
    "LANES",
    "LANES16",
    "ONE_ROW",
    "ONE_ROW16",
    "WIDTHS",
    "Order",
    "PreparedCall",
    "RowKernel",
    "load",
]

logger = logging.getLogger(__name__)

BLOCKS_FIRST = 256  # past this many rows exact_order() tries the blocked orders before the lanes
WIDTHS = (192, 256, 128, 384, 512, 64, 96, 320)  # block widths tried, most likely first (MKL 2024: 192 Zen 4, 256 Xeon)
_SOURCE = Path(__file__).with_name("row_kernel.c")
# Read with this module: the C code built at the first Engine, maybe much later, must be the one these ctypes
# signatures were written for (a package upgraded in place in between once handed it other arguments: stop 57's run).
_SOURCE_TEXT = _SOURCE.read_text() if _SOURCE.is_file() else None
# -ffp-contract=off: the compiler fuses no multiply and add the source does not spell (the order is the bits)
_FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
_LOCK = threading.Lock()
_LOADED: list[RowKernel | None] = []  # the process's kernel once load() ran (None: it cannot serve here)


class Order(NamedTuple):
    """How the kernel sums a call's rows: rows ``0 .. lanes_from - 1`` in blocks of ``width`` columns (a multiple of
    8), the rest in lanes as ``head`` says: 0 four lanes, 4 four lanes with the first four products all in lane 0,
    16 sixteen FMA lanes, 17 their one-row variant (the module docstring gives the orders; 16 and 17 need an inner
    dimension that is a multiple of 16, 17 at least 32 columns); 32 (:data:`BLAS`, with no blocked rows) is not a
    summation of the kernel's but the BLAS's own ``sgemm``.

    Example:
        >>> Order.blocks(192, 6), Order.blocks(192, 6).label(6), LANES.label(3), Order(192, 4).label(6)
        (Order(width=192, lanes_from=6, head=0), '192', 'lanes', '192 to row 4, lanes')
        >>> ONE_ROW.label(1)
        'lanes, first 4 in lane 0'
    """

    width: int
    lanes_from: int
    head: int = 0

    @classmethod
    def blocks(cls, width: int, rows: int) -> Order:
        """Every one of ``rows`` rows in blocks of ``width`` columns."""
        return cls(width, rows)

    def label(self, rows: int) -> str:
        """A short name at ``rows`` rows (for reports)."""
        if self.head == 32:
            return "the BLAS's sgemm"
        lanes = {0: "lanes", 4: "lanes, first 4 in lane 0", 16: "16 lanes", 17: "16 lanes, one-row form"}[self.head]
        if self.lanes_from == 0:
            return lanes
        return str(self.width) if self.lanes_from >= rows else f"{self.width} to row {self.lanes_from}, {lanes}"


LANES = Order(0, 0)  # every row in four lanes (MKL 2024's sgemm at 2-3 rows on Zen 4)
ONE_ROW = Order(0, 0, 4)  # four lanes, the first four products in lane 0 (MKL 2024's one-row product on Zen 4)
LANES16 = Order(0, 0, 16)  # sixteen FMA lanes (MKL 2024's sgemm at 2-15 rows on a Xeon with AVX-512)
ONE_ROW16 = Order(0, 0, 17)  # their one-row form (MKL 2024's one-row product on that Xeon)
BLAS = Order(0, 0, 32)  # not the kernel's: the BLAS's sgemm, called as F.linear calls it (RowKernel.blas)


class RowKernel:
    """The loaded kernel: :meth:`linear` computes ``F.linear`` for a weight :meth:`fits`, in an :class:`Order`
    :meth:`exact_order` found bit-identical.

    Example:
        >>> kernel = load()
        >>> weight, x = torch.randn(64, 512), torch.randn(4, 512)
        >>> expected = torch.nn.functional.linear(x, weight)
        >>> order = None if kernel is None else kernel.exact_order(x, weight, None, expected, 1)
        >>> order is None or torch.equal(kernel.linear(x, weight, None, order, 1), expected)
        True
    """

    blas = False  # whether BLAS serves (set where the address of torch's BLAS sgemm_ was found at the build)
    wide = False  # whether the blocked rows run in 512-bit vectors (set_wide())

    def __init__(self, library: ctypes.CDLL, sgemm: int | None = None, wide: bool = True) -> None:
        self._function = library.row_kernel_linear
        if sgemm:
            library.row_kernel_set_sgemm.argtypes = [ctypes.c_void_p]
            library.row_kernel_set_sgemm(sgemm)
        self.blas = bool(sgemm)
        self._set_wide = library.row_kernel_set_wide
        self._set_wide.argtypes = [ctypes.c_int]
        self._set_wide.restype = ctypes.c_int
        self.set_wide(wide)
        pointer, size = ctypes.c_void_p, ctypes.c_long
        self._function.argtypes = [pointer, pointer, pointer, pointer, size, size, size, size, size, size, ctypes.c_int]
        self._function.restype = ctypes.c_int
        self._bytes = library.byte_linear
        self._bytes.argtypes = [pointer, pointer, pointer, pointer, size, size, size, ctypes.c_int, ctypes.c_int]
        self._bytes.restype = ctypes.c_int
        self._widths: dict[tuple[int, int, bool], int] = {}  # by weight shape and bias: the block width found

    def set_wide(self, on: bool) -> bool:
        """Whether the rows summed in blocks run in 512-bit vectors (``on``, where the CPU has AVX-512F) or in
        256-bit ones: the same chains, so the same bits either way (the suite checks both against the documented
        order); twice the FMAs a cycle where the FMA units are 512 bits wide (an AMD Zen 5, an Intel Xeon). Returns
        the path now taken (False where the CPU has no AVX-512F). Process-wide: every caller of this kernel, the
        decode tape's included, takes it from the next call."""
        self.wide = bool(self._set_wide(1 if on else 0))
        return self.wide

    @staticmethod
    def fits_shape(out_features: int, width: int) -> bool:
        """Whether the kernel serves a weight of this shape: both sizes positive multiples of 8."""
        return out_features > 0 and width > 0 and out_features % 8 == 0 and width % 8 == 0

    @classmethod
    def fits(cls, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether the kernel can compute ``F.linear(x, weight, bias)``: float32 on the CPU, a contiguous 2-D weight
        of a shape it serves (:meth:`fits_shape`), a bias of its rows (about a microsecond: :meth:`linear` checks
        it at every call, since the C code would misread anything else)."""
        return (
            x.dtype is torch.float32
            and weight.dtype is torch.float32
            and weight.dim() == 2
            and x.shape[-1] == weight.shape[1]
            and cls.fits_shape(weight.shape[0], weight.shape[1])
            and weight.is_contiguous()
            and (bias is None or (bias.dtype is torch.float32 and bias.numel() == weight.shape[0]))
            and x.is_cpu
            and weight.is_cpu
        )

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, order: Order, threads: int
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` summed in ``order`` on ``threads`` threads, for a weight that :meth:`fits`. Under
        a dispatch mode it is one op, :data:`KERNEL_LINEAR`: what records the ops a step dispatched (the CPU
        stand-in for CUDA graphs) or traces them then sees the kernel's result made, not an empty tensor written
        behind its back. The C code reads raw memory, so what it would misread is refused here, each call (a
        ``ValueError``; about a microsecond)."""
        if not self.fits(x, weight, bias):
            raise ValueError(f"row kernel: cannot take x {tuple(x.shape)} {x.dtype} with weight {tuple(weight.shape)}")
        if torch._C._len_torch_dispatch_stack():  # noqa: SLF001 (a mode records or traces the ops: one op for it)
            return KERNEL_LINEAR(x, weight, bias, order.width, order.lanes_from, order.head, threads)
        # nothing records: the C call (6 us less than the op)
        return self._call(x, weight, bias, order.width, order.lanes_from, order.head, threads)

    def _call(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        width: int,
        lanes_from: int,
        head: int,
        threads: int,
    ) -> torch.Tensor:
        """The C call itself (:data:`KERNEL_LINEAR`'s kernel; :meth:`linear` checked what it reads). Each torch call
        here costs microseconds against the kernel's tens: the output made in its final shape, the input reshaped
        only where it is not contiguous."""
        rows = x if x.is_contiguous() else x.contiguous()
        if bias is not None and not bias.is_contiguous():
            bias = bias.contiguous()
        out, count = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32), x.numel() // x.shape[-1]
        code = self._function(
            rows.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            count,
            weight.shape[0],
            weight.shape[1],
            width,
            lanes_from,
            head,
            threads,
        )
        if code:
            raise ValueError(
                f"row kernel: {count} rows x weight {tuple(weight.shape)} in order {Order(width, lanes_from, head)}"
            )
        return out

    def prepared(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, order: Order, threads: int
    ) -> PreparedCall:
        """A call of this kernel for inputs of ``x``'s shape with this ``weight`` and ``bias`` (which must
        :meth:`fits` them now), summed in ``order`` on ``threads`` threads: what :meth:`_call` works out at each call
        worked out once (a layer's settled route: :mod:`.linear_routes`)."""
        if not self.fits(x, weight, bias):
            raise ValueError(f"row kernel: cannot take x {tuple(x.shape)} with weight {tuple(weight.shape)}")
        return PreparedCall(self._function, tuple(x.shape), weight, order, threads)

    @staticmethod
    def byte_levels(width: int) -> int:
        """The integer steps :meth:`byte_linear` rounds each input row to (its largest magnitude is ``levels``
        steps) at inner dimension ``width``: the most that keeps every int32 sum exact (``levels * 127 * width <
        2^31``), at most int16's 32767.

        Example:
            >>> RowKernel.byte_levels(512), RowKernel.byte_levels(4096)
            (32767, 4128)
        """
        return min(32767, (2**31 - 1) // (127 * max(width, 1)))

    @staticmethod
    def turned_bytes(q: torch.Tensor) -> torch.Tensor | None:
        """An int8 copy ``q`` (N, K) of a weight laid out for :meth:`byte_linear`: by panels of 8 rows, each
        column pair by column pair, so the product reads it front to back; None where N or K is not a multiple of 8.

        Example:
            >>> q = torch.arange(32, dtype=torch.int8).view(8, 4).repeat(2, 2)
            >>> turned = RowKernel.turned_bytes(q)
            >>> turned.shape, turned[0, 1, 0].tolist(), RowKernel.turned_bytes(q[:12])
            (torch.Size([2, 4, 8, 2]), [2, 3], None)
        """
        rows, width = q.shape
        if q.dtype is not torch.int8 or not RowKernel.fits_shape(rows, width):
            return None
        return q.reshape(rows // 8, 8, width // 2, 2).transpose(1, 2).contiguous()

    def byte_linear(self, x: torch.Tensor, turned: torch.Tensor, scales: torch.Tensor, threads: int) -> torch.Tensor:
        """``x (rows, K) @ (scales * Q).T`` for the int8 copy ``Q`` that :meth:`turned_bytes` laid out, with each
        row of ``x`` first rounded to :meth:`byte_levels` integer steps of its largest magnitude (a screen's
        approximate logits, :mod:`.head_screen`: the sums are exact in int32, then scaled in float32). Refuses what
        the C code would misread, a non-finite input and a row whose step (largest magnitude / levels) is below
        float32's normal range (a ``ValueError``)."""
        if turned.dim() != 4:
            raise ValueError(f"row kernel: cannot take x {tuple(x.shape)} {x.dtype} with copy {tuple(turned.shape)}")
        panels, pairs, eight, two = turned.shape
        width = 2 * pairs
        if not (
            x.dtype is torch.float32
            and turned.dtype is torch.int8
            and scales.dtype is torch.float32
            and (eight, two) == (8, 2)
            and x.dim() == 2
            and x.shape[1] == width
            and scales.shape == (panels * 8,)
            and x.is_contiguous()
            and turned.is_contiguous()
            and scales.is_contiguous()
            and x.is_cpu
            and turned.is_cpu
            and scales.is_cpu
        ):
            raise ValueError(f"row kernel: cannot take x {tuple(x.shape)} {x.dtype} with copy {tuple(turned.shape)}")
        out = torch.empty((x.shape[0], panels * 8), dtype=torch.float32)
        code = self._bytes(
            x.data_ptr(), turned.data_ptr(), scales.data_ptr(), out.data_ptr(), x.shape[0], panels * 8, width,
            self.byte_levels(width), threads,
        )  # fmt: skip
        if code:
            raise ValueError(
                f"row kernel: {x.shape[0]} rows x copy {tuple(turned.shape)} (a non-finite input, or a row whose step "
                "is below float32's normal range?)"
            )
        return out

    def exact_order(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, expected: torch.Tensor, threads: int
    ) -> Order | None:
        """The order whose result has ``expected``'s bits (the same call's ``F.linear``), else None. Tried in turn:
        :data:`LANES` then :data:`LANES16` (one row: :data:`ONE_ROW` and :data:`ONE_ROW16` first; the sixteen lanes
        where the inner dimension is a multiple of 16); then per block width every row in blocks, and (past 4 rows,
        where the rows are not a multiple of 4) the rows up to the last multiple of 4 in blocks and the rest in lanes
        (past :data:`BLOCKS_FIRST` rows the blocked orders before the lanes). The widths: the one an earlier call of
        this shape found, alone (trying every width again would read the weight up to nine more times at each row count
        MKL sums another way), else each of :data:`WIDTHS` and the whole inner dimension."""
        shape = (int(weight.shape[0]), int(weight.shape[1]), bias is not None)
        rows = x.numel() // x.shape[-1]
        known = self._widths.get(shape)
        widths = (known,) if known is not None else dict.fromkeys((*WIDTHS, shape[1]))
        tail = rows % 4 if rows > 4 else 0
        sixteen = shape[1] % 16 == 0
        orders = [ONE_ROW, *([ONE_ROW16] if sixteen and shape[1] >= 32 else [])] if rows == 1 else []
        orders += [LANES, *([LANES16] if sixteen else [])]
        for width in widths:
            if width % 8 == 0:
                orders += [Order.blocks(width, rows), *([Order(width, rows - tail)] if tail else [])]
        if rows > BLOCKS_FIRST:  # a prefill chunk's rows: MKL's blocks first (a lanes pass over them costs a call)
            orders.sort(key=lambda order: order.lanes_from == 0)
        for order in orders:
            if torch.equal(self.linear(x, weight, bias, order, threads), expected):
                if order.lanes_from:
                    self._widths[shape] = order.width
                return order
        return None


class PreparedCall:
    """:meth:`RowKernel.prepared`'s call: ``F.linear(x, weight, bias)`` for a contiguous float32 CPU ``x`` of the
    prepared shape and the prepared weight and bias (still contiguous, of their shapes: the caller checks what the C
    code would misread, :meth:`.linear_routes.Route.serves`), about 12 microseconds less than :meth:`RowKernel.linear`
    on the benchmark box, outside any dispatch mode (a mode that records ops needs :data:`KERNEL_LINEAR`).

    Example:
        >>> kernel, weight, x = load(), torch.randn(64, 32), torch.randn(2, 32)
        >>> call = None if kernel is None else kernel.prepared(x, weight, None, Order.blocks(32, 2), 1)
        >>> call is None or torch.equal(call(x, weight, None), kernel.linear(x, weight, None, Order.blocks(32, 2), 1))
        True
    """

    __slots__ = ("_args", "_function", "_out")

    def __init__(
        self,
        function: Callable[..., int],
        shape: tuple[int, ...],
        weight: torch.Tensor,
        order: Order,
        threads: int,
    ) -> None:
        out_features, width = int(weight.shape[0]), int(weight.shape[1])
        self._function = function
        self._out = (*shape[:-1], out_features)
        count = 1
        for size in shape[:-1]:
            count *= size
        self._args = (count, out_features, width, order.width, order.lanes_from, order.head, threads)

    def c_call(self) -> tuple[int, tuple[int, ...]]:
        """The C function's address and the arguments after its four pointers (x, weight, bias, out): what a caller
        in C makes of this call (the direct layers' decode tape, :mod:`.decode_tape`)."""
        return int(ctypes.cast(self._function, ctypes.c_void_p).value or 0), self._args  # type: ignore[arg-type]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty(self._out, dtype=torch.float32)
        bias_pointer = None if bias is None else bias.data_ptr()
        if self._function(x.data_ptr(), weight.data_ptr(), bias_pointer, out.data_ptr(), *self._args):
            raise ValueError(f"row kernel: x {tuple(x.shape)} x weight {tuple(weight.shape)}: {self._args}")
        return out


def load() -> RowKernel | None:
    """The process's kernel, built at the first call (about a second); None where it cannot serve (the module
    docstring says where).

    Example:
        >>> load() is load()
        True
    """
    with _LOCK:
        if not _LOADED:
            _LOADED.append(_build())
        return _LOADED[0]


def _build() -> RowKernel | None:
    if not can_build_avx2("PAGEDCORE_ROW_KERNEL"):
        return None
    library = build("row_kernel", _SOURCE_TEXT, _FLAGS)
    if library is None:
        logger.debug("pagedcore: few-row linears keep F.linear and the row split")
        return None
    return RowKernel(library, _torch_sgemm(), wide=os.environ.get("PAGEDCORE_ROW_KERNEL_WIDE", "1") != "0")


def _torch_sgemm() -> int | None:
    """The address of the Fortran ``sgemm_`` torch's CPU GEMMs call (MKL's, linked into libtorch_cpu), else None
    (another BLAS, or none exported: :data:`BLAS` then never serves)."""
    if not torch.backends.mkl.is_available():
        return None
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        library = ctypes.CDLL(str(path))  # loaded already: the same handle
        return ctypes.cast(library.sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def _kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, width: int, lanes_from: int,
                   head: int, threads: int) -> torch.Tensor:  # fmt: skip
    kernel = load()
    if kernel is None:
        raise RuntimeError("row kernel: not built in this process")
    return kernel._call(x, weight, bias, width, lanes_from, head, threads)  # noqa: SLF001 (the op is the kernel's own entry)


def _kernel_linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, width: int,
                         lanes_from: int, head: int, threads: int) -> torch.Tensor:  # fmt: skip
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


KERNEL_LINEAR = graph_op(
    "row_kernel_linear(Tensor x, Tensor weight, Tensor? bias, int width, int lanes_from, int head, int threads) "
    "-> Tensor",
    _kernel_linear,
    _kernel_linear_shape,
)
"""The kernel as a ``pagedcore::row_kernel_linear`` op (:func:`~.graph_ops.graph_op`)."""
