"""A C kernel for the few-row linear calls of the Engine's decode steps on the CPU (issue 33.2): ``F.linear``'s bits,
the weight read once, straight from its rows.

Why: MKL's ``sgemm`` behind ``F.linear`` copies the weight into its blocked layout inside every call, so a decode
step of a few rows moves the weight two or three times over; the row split (:mod:`.row_split`) shares that work
between the threads but keeps it. This kernel (``row_kernel.c``) reads each 8 x 8 tile of the weight once, turns it
in registers and multiplies it into the rows (AVX2 + FMA; the threads share the weight's rows through the OpenMP
runtime torch itself loaded).

Exactness first: MKL's ``sgemm`` sums each output in blocks of the inner dimension (192 columns with MKL 2024 on an
AMD Zen 4, from 4 rows up: one FMA chain per block from zero, in column order, then the block sums added in order to
the bias), and so does the kernel, with the block width as an argument. The width is found, never assumed: at a
row count's first call :meth:`RowKernel.exact_width` runs the kernel with each of :data:`WIDTHS` and keeps the first
whose bits equal ``F.linear``'s on the call's own rows; a row count none matches keeps the other ways
(:class:`~.row_split.RowSplit` owns that choice and the timing). One row is a matrix-vector product MKL sums
another way: no width matches it.

Built at first use (:func:`load`) with the system's C compiler into a private temporary folder, loaded, and the file
removed (nothing is read from a folder another user could write). None where it cannot serve: not Linux on x86-64,
a CPU without AVX2 and FMA (torch's own CPU check), no C compiler, a failed build, or ``PAGEDCORE_ROW_KERNEL=0``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from .graph_ops import graph_op

__all__ = ["KERNEL_LINEAR", "WIDTHS", "RowKernel", "load"]

logger = logging.getLogger(__name__)

WIDTHS = (192, 256, 128, 384, 512, 64, 96, 320)  # block widths tried, most likely first (192: MKL 2024 on Zen 4)
_SOURCE = Path(__file__).with_name("row_kernel.c")
# -ffp-contract=off: the compiler fuses no multiply and add the source does not spell (the order is the bits)
_FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
_LOCK = threading.Lock()
_LOADED: list[RowKernel | None] = []  # the process's kernel once load() ran (None: it cannot serve here)


class RowKernel:
    """The loaded kernel: :meth:`linear` computes ``F.linear`` for a weight :meth:`fits`, in blocks of a width
    :meth:`exact_width` found bit-identical.

    Example:
        >>> kernel = load()
        >>> weight, x = torch.randn(64, 512), torch.randn(4, 512)
        >>> kernel is None or kernel.exact_width(x, weight, None, torch.nn.functional.linear(x, weight), 1) in WIDTHS
        True
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = library.row_kernel_linear
        pointer, size = ctypes.c_void_p, ctypes.c_long
        self._function.argtypes = [pointer, pointer, pointer, pointer, size, size, size, size, ctypes.c_int]
        self._function.restype = ctypes.c_int
        self._widths: dict[tuple[int, int, bool], int] = {}  # by weight shape and bias: the width found

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
            weight.dim() == 2
            and cls.fits_shape(int(weight.shape[0]), int(weight.shape[1]))
            and x.dtype is torch.float32
            and weight.dtype is torch.float32
            and x.shape[-1] == weight.shape[1]
            and weight.is_contiguous()
            and (bias is None or (bias.dtype is torch.float32 and bias.numel() == weight.shape[0]))
            and x.device.type == "cpu"
            and weight.device.type == "cpu"
        )

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, width: int, threads: int
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` summed in blocks of ``width`` columns on ``threads`` threads (a weight that
        :meth:`fits`; ``width`` a multiple of 8). Under a dispatch mode it is one op, :data:`KERNEL_LINEAR`:
        what records the ops a step dispatched (the CPU stand-in for CUDA graphs) or traces them then sees the
        kernel's result made, not an empty tensor written behind its back. The C code reads raw memory, so what it
        would misread is refused here, each call (a ``ValueError``; about a microsecond)."""
        if not self.fits(x, weight, bias):
            raise ValueError(f"row kernel: cannot take x {tuple(x.shape)} {x.dtype} with weight {tuple(weight.shape)}")
        if torch._C._len_torch_dispatch_stack():  # noqa: SLF001 (a mode records or traces the ops: one op for it)
            return KERNEL_LINEAR(x, weight, bias, width, threads)
        return self._call(x, weight, bias, width, threads)  # nothing records: the C call (6 us less than the op)

    def _call(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, width: int, threads: int
    ) -> torch.Tensor:
        """The C call itself (:data:`KERNEL_LINEAR`'s kernel; :meth:`linear` checked what it reads)."""
        rows = x.reshape(-1, weight.shape[1]).contiguous()
        bias = None if bias is None else bias.contiguous()
        out = torch.empty((rows.shape[0], weight.shape[0]), dtype=torch.float32)
        code = self._function(
            rows.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows.shape[0],
            weight.shape[0],
            weight.shape[1],
            width,
            threads,
        )
        if code:
            raise ValueError(f"row kernel: shapes {tuple(rows.shape)} x {tuple(weight.shape)} with width {width}")
        return out.view(*x.shape[:-1], weight.shape[0])

    def exact_width(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, expected: torch.Tensor, threads: int
    ) -> int | None:
        """The block width whose result has ``expected``'s bits (the same call's ``F.linear``), else None: for a
        shape whose width an earlier call found, that width alone (a row count it misses is one MKL sums another
        way; trying every width again would read the weight up to nine more times); else the first of
        :data:`WIDTHS` and the whole inner dimension that matches."""
        shape = (int(weight.shape[0]), int(weight.shape[1]), bias is not None)
        known = self._widths.get(shape)
        for width in (known,) if known is not None else dict.fromkeys((*WIDTHS, shape[1])):
            if width % 8 == 0 and torch.equal(self.linear(x, weight, bias, width, threads), expected):
                self._widths[shape] = width
                return width
        return None


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
    if os.environ.get("PAGEDCORE_ROW_KERNEL", "1") == "0":
        return None
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None or not _SOURCE.is_file():
        logger.debug("pagedcore: no C compiler or kernel source: few-row linears keep F.linear and the row split")
        return None
    with tempfile.TemporaryDirectory(prefix="pagedcore-kernel-") as folder:  # mode 0700, this user's
        library = Path(folder) / "row_kernel.so"
        command = [compiler, *_FLAGS, "-o", str(library), str(_SOURCE)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            logger.debug("pagedcore: the row kernel did not build: %s", exc)
            return None
        if done.returncode != 0:
            logger.debug("pagedcore: the row kernel did not build: %s", done.stderr[-2000:])
            return None
        return RowKernel(ctypes.CDLL(str(library)))


def _kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, width: int, threads: int
                   ) -> torch.Tensor:  # fmt: skip
    kernel = load()
    if kernel is None:
        raise RuntimeError("row kernel: not built in this process")
    return kernel._call(x, weight, bias, width, threads)  # noqa: SLF001 (the op is the kernel's own entry)


def _kernel_linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, width: int, threads: int
                         ) -> torch.Tensor:  # fmt: skip
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


KERNEL_LINEAR = graph_op(
    "row_kernel_linear(Tensor x, Tensor weight, Tensor? bias, int width, int threads) -> Tensor",
    _kernel_linear,
    _kernel_linear_shape,
)
"""The kernel as a ``pagedcore::row_kernel_linear`` op (:func:`~.graph_ops.graph_op`)."""
