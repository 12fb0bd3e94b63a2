"""A low-precision screen of the LM head for greedy steps on the CPU: which vocabulary columns can hold a row's
maximum, from a quarter or half of the head's bytes; only those columns' logits are then computed exactly.

Why: at 1-16 rows the LM head is a matrix-vector product bound by memory (the small benchmark model's head is 62.5
MiB of its 154.5 MiB of weights), and a greedy step needs only each row's argmax. Two approximate products:

- where the process has :mod:`.row_kernel`'s C kernel, an int8 copy of the weight (each row in 127 steps of its
  largest magnitude, 15.6 MiB, laid out by :meth:`~.row_kernel.RowKernel.turned_bytes` to be read front to back),
  multiplied by the input rows rounded to int16 steps, the sums exact in int32
  (:meth:`~.row_kernel.RowKernel.byte_linear`): 0.88 against the float16 copy's 1.35 ms at one row, 2.25 against
  2.88 at eight, the same at 64, with the caches evicted (``scripts/head_screen_bench.py``, 2 threads;
  docs/benchmarks.md, "The screen in bytes");
- elsewhere a float16 copy (31 MiB) in fbgemm's GEMM (``torch.ops.quantized.linear_dynamic_fp16``: float32 inputs
  and sums): 2.7 ms at one row against ``F.linear``'s 5.3, 4.9 against 14.6 at eight, with the caches evicted
  (docs/benchmarks.md, "The greedy choice screened in half precision").

Exactness: the tokens are the argmax of the head's own ``F.linear`` over the step's rows, bit for bit, because

1. each approximate logit is within a bound of the exact one, per row ``r``: with ``Q`` the copy's values (float16's,
   or ``s_n * q_n`` for the int8 copy: exact in float64), ``|approx - exact| <= B_r = ||x_r||_2 * max_n ||W_n -
   Q_n||_2 + sqrt(K) * max |x_r| / L * max_n ||Q_n||_2 + (K + 8) * 2^-23 * ||x_r||_1 * max |W|``:
   the first term is the copy's own error (Cauchy-Schwarz on ``x_r (W_n - Q_n)``, the differences computed
   exactly; float16 values below its normal range are set to zero in its copy, so a GEMM that flushes them computes
   the same); the second the int8 product's rounding of the input row to ``L`` steps of its largest magnitude
   (:meth:`~.row_kernel.RowKernel.byte_levels`: each value moves by at most about half a step, counted as a whole
   one; Cauchy-Schwarz again; none for fbgemm, whose inputs stay float32); the third covers the float32 rounding of
   both products, in any order of summation (``K * 2^-24`` of the absolute sum each, with room; the int8 product's
   sums are exact, three roundings after them);
2. so a column whose approximate logit is below the row's approximate maximum less ``2 B_r`` cannot hold the exact
   maximum, and every column that can (ties included) is a candidate;
3. the candidates of all rows (padded to a multiple of :data:`COLUMNS` with other columns, so few GEMM shapes occur)
   are computed with ``F.linear`` on the gathered weight rows, whose bits the caller checks against the whole GEMM
   for each shape before it trusts them, together with the bound itself (every approximate logit within ``B_r`` of
   the whole GEMM's); the first maximal candidate of each row is its token.

A step whose input or candidates are not finite, whose weight is not finite (in float16, for its copy), whose int8
product's scales would leave float32's normal range (a CPU that flushes such values would compute zeros), or whose
candidates would be a large share of the vocabulary (:data:`MAX_SHARE`) is not screened (None: the caller takes the
argmax another way). The copy is made from the weight as it is and made again when the weight changes (same tensor,
version counter and data pointer: :class:`~.prepacked.WeightStamp`, as the prepacked linears check), so a training
step is seen at the next greedy step. It costs a quarter (int8) or half (float16) of the head's bytes in memory.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedcore.adapters.transformers.prepacked import WeightStamp
from pagedcore.adapters.transformers.row_kernel import RowKernel

__all__ = ["COLUMNS", "MAX_SHARE", "HeadScreen", "Screened", "available"]

COLUMNS = 256  # the exact columns come in multiples of this many: few GEMM shapes to check
MAX_SHARE = 0.25  # candidates beyond this share of the vocabulary: the screen saves too little, not used
_CHUNK = 1024  # rows of the head per pass of the int8 copy's making (a multiple of 8: the layout's panels)
_SMALLEST = 2.0**-14  # float16's smallest normal value: smaller weights are zero in the copy (module docstring)
_NORMAL = 2.0**-125  # twice float32's smallest normal value: the int8 product's scales stay above it (with room)
logger = logging.getLogger(__name__)
_ENGINE = "fbgemm"  # the quantized engine whose float16 GEMM the screen runs
_PACKING = threading.Lock()  # the engine is a process-wide setting: set only around a prepack, one at a time


def available() -> bool:
    """Whether this torch has fbgemm's float16-weight GEMM (x86 CPUs).

    Example:
        >>> isinstance(available(), bool)
        True
    """
    quantized = torch.ops.quantized
    return _ENGINE in torch.backends.quantized.supported_engines and hasattr(quantized, "linear_dynamic_fp16")


@dataclass
class Screened:
    """One screened step: the exact logits of ``columns`` (``(rows, len(columns))``, ``F.linear``'s), the
    approximate logits and each row's bound (for the caller's checks), and the tokens (None: some row could not be
    screened).

    Example:
        >>> weight, x = torch.randn(600, 32), torch.randn(2, 32)
        >>> step = HeadScreen().screen(x, weight)
        >>> step.exact.shape == (2, len(step.columns)), bool((abs(step.approx - F.linear(x, weight)) <= 1e-2).all())
        (True, True)
    """

    columns: np.ndarray
    exact: torch.Tensor
    approx: torch.Tensor
    bound: np.ndarray
    tokens: list[int] | None


@dataclass
class _Copy:
    """The low-precision copy of a weight and what it was made from."""

    stamp: WeightStamp
    packed: object | None  # None: this weight cannot be screened (not finite in float16, or the packing failed)
    apart: float  # max_n ||W_n - Q_n||_2 (Q: the copy's values)
    largest: float  # max |W|
    turned: bool = False  # packed is the kernel's int8 copy and its row scales (RowKernel.turned_bytes), not fbgemm's
    spread: float = 0.0  # max_n ||Q_n||_2 where the kernel rounds the input rows (the int8 copy), else 0
    levels: int = 1  # the integer steps the kernel rounds each input row to (RowKernel.byte_levels)
    finest: float = 0.0  # the int8 copy's smallest nonzero row scale (the step's scale products must stay normal)


class HeadScreen:
    """The screen of one head weight (float32, CPU, no bias; see the module docstring); its approximate product by
    ``kernel`` (:mod:`.row_kernel`) where one is given and the weight's shape fits it, else by fbgemm.

    Example:
        >>> weight = torch.randn(1000, 64)
        >>> screen = HeadScreen()
        >>> x = torch.randn(3, 64)
        >>> step = screen.screen(x, weight)
        >>> step.tokens == F.linear(x, weight).argmax(-1).tolist(), len(step.columns) % COLUMNS
        (True, 0)
    """

    def __init__(self, kernel: RowKernel | None = None) -> None:
        self._copy: _Copy | None = None
        self._kernel = kernel

    def screen(self, x: torch.Tensor, weight: torch.Tensor) -> Screened | None:
        """The step's candidate columns and their exact logits for ``x`` ``(rows, K)``; None when the screen does
        not apply (non-finite input or weight, too many candidates)."""
        copy = self._fresh_copy(weight)
        if copy.packed is None:
            return None
        k = x.shape[-1]
        x = x.reshape(-1, k).contiguous()
        wide = x.detach().numpy().astype(np.float64)  # numpy: a few small torch ops cost more right after a forward
        size = np.abs(wide)
        l2, l1 = np.sqrt((wide * wide).sum(axis=1)), size.sum(axis=1)
        step = size.max(axis=1) / copy.levels  # each row's int16 step where the int8 copy is used
        rounded = np.sqrt(k) * step * copy.spread if copy.turned else 0.0
        bound = (l2 * copy.apart + rounded + (k + 8) * 2.0**-23 * l1 * copy.largest) * (1.0 + 1e-6)  # rounded up
        if not np.isfinite(bound).all():  # a NaN or an infinity in the input
            return None
        if copy.turned and not ((step == 0) | ((step >= _NORMAL) & (step * copy.finest >= _NORMAL))).all():
            return None  # a row so small that its scale times a weight row's would leave float32's normal range
        if copy.turned:
            assert self._kernel is not None and isinstance(copy.packed, tuple)
            turned, scales = copy.packed
            approx = self._kernel.byte_linear(x, turned, scales, torch.get_num_threads())
        else:
            approx = torch.ops.quantized.linear_dynamic_fp16(x, copy.packed)
        values = approx.numpy()
        top = values.max(axis=1)
        if not np.isfinite(top).all():
            return None
        floor = top - 2.0 * bound  # float64; as float32 rounded down, so no candidate is lost to the rounding
        floor32 = floor.astype(np.float32)
        floor32 = np.where(floor32 > floor, np.nextafter(floor32, np.float32(-np.inf)), floor32)
        candidates = (values >= floor32[:, None]).any(axis=0)
        vocab = weight.shape[0]
        count = int(np.count_nonzero(candidates))
        if count > MAX_SHARE * vocab:
            return None
        columns = _padded(candidates, count, vocab)
        exact = F.linear(x, weight.index_select(0, torch.from_numpy(columns)))
        chosen = exact.numpy()
        best = chosen.argmax(axis=1)  # the first maximal candidate: columns are in order
        finite = np.isfinite(chosen[np.arange(len(best)), best]).all()
        tokens = columns[best].tolist() if finite else None
        return Screened(columns, exact, approx, bound, tokens)

    def prepare(self, weight: torch.Tensor) -> None:
        """Make the copy of ``weight`` (int8 where the row kernel takes its shape, else fbgemm's float16) now if it is
        missing or stale (the next :meth:`screen` would)."""
        self._fresh_copy(weight)

    def _fresh_copy(self, weight: torch.Tensor) -> _Copy:
        copy = self._copy
        if copy is not None and copy.stamp.fresh(weight):
            return copy
        self._copy = None
        stamp = WeightStamp.of(weight)
        turned = self._kernel is not None and RowKernel.fits_shape(*weight.shape)
        try:
            copy = (_in_bytes if turned else _in_half)(weight.detach(), stamp)
        except Exception:  # a torch without the packing op it had at import, or another failure: not screened
            logger.warning("pagedcore: the screen could not make the head weight's copy", exc_info=True)
            copy = _Copy(stamp, None, 0.0, 0.0)
        self._copy = copy
        return copy


def _in_half(weight: torch.Tensor, stamp: WeightStamp) -> _Copy:
    """fbgemm's packed float16 copy of ``weight``; not packed for a weight that is not finite in float16."""
    with torch.no_grad():
        half = weight.to(torch.float16)
        if not bool(torch.isfinite(half).all()):
            return _Copy(stamp, None, 0.0, 0.0)
        copy = half.float()
        copy[copy.abs() < _SMALLEST] = 0.0  # subnormal in float16: zero, whether or not the kernel flushes them
        apart = float((weight.double() - copy.double()).norm(dim=1).max())
        largest = float(weight.abs().max())
        with _PACKING:
            before = torch.backends.quantized.engine
            torch.backends.quantized.engine = _ENGINE
            try:
                packed = torch.ops.quantized.linear_prepack_fp16(copy, None)
            finally:
                torch.backends.quantized.engine = before
    return _Copy(stamp, packed, apart, largest)


def _in_bytes(weight: torch.Tensor, stamp: WeightStamp) -> _Copy:
    """The row kernel's int8 copy of ``weight``: each row rounded to 127 steps of its largest magnitude (scale
    ``s_n``, float32), laid out by :meth:`~.row_kernel.RowKernel.turned_bytes`; ``apart`` and ``spread`` of the
    values ``s_n * q_n`` themselves (exact in float64). Not packed for a weight that is not finite.

    Made again at each weights epoch (a training step), so made fast: :data:`_CHUNK` rows at a time, each chunk's
    float64 temporaries held in the caches; finiteness read from the rows' largest magnitudes (a NaN or an infinity
    is its row's); no ``where`` for zero rows (their steps are zeros divided by the smallest normal scale: zeros); and
    the layout's column pairs moved as int16 (the same bytes ``turned_bytes`` writes). 115 against 833 ms for the
    benchmark model's 32000 x 512 head, the same bytes and figures (2 threads, AMD EPYC)."""
    rows, width = weight.shape
    with torch.no_grad():
        scales = torch.empty(rows, dtype=torch.float32)  # float32: what the kernel multiplies by
        pairs = torch.empty(rows // 8, width // 2, 8, dtype=torch.int16)  # turned_bytes' layout, a column pair each
        tiny = torch.finfo(torch.float32).tiny
        apart = spread = largest = 0.0
        for start in range(0, rows, _CHUNK):
            w = weight[start : start + _CHUNK]
            size = w.abs().amax(dim=1)  # NaN where the row holds one (amax propagates it)
            if not bool(torch.isfinite(size).all()):
                return _Copy(stamp, None, 0.0, 0.0)
            s = torch.div(size, 127, out=scales[start : start + _CHUNK])
            q = (w / s.clamp_min(tiny)[:, None]).round_().clamp_(-127, 127).to(torch.int8).contiguous()
            turned = q.view(torch.int16).view(-1, 8, width // 2).transpose(1, 2)
            pairs[start // 8 : (start + len(q)) // 8].copy_(turned)
            values = s.double()[:, None] * q.double()  # exact: a float32 times an integer of 7 bits
            apart = max(apart, float((w.double() - values).norm(dim=1).max()))
            spread = max(spread, float(values.norm(dim=1).max()))
            largest = max(largest, float(size.max()))
        used = scales[scales > 0]
        finest = float(used.min()) if used.numel() else 1.0
        if finest < _NORMAL:  # a row below float32's normal range: a CPU that flushes it would compute zeros
            return _Copy(stamp, None, 0.0, 0.0)
        levels = RowKernel.byte_levels(width)
    packed = pairs.view(torch.int8).view(rows // 8, width // 2, 8, 2)
    return _Copy(stamp, (packed, scales), apart, largest, True, spread, levels, finest)


def _padded(candidates: np.ndarray, count: int, vocab: int) -> np.ndarray:
    """The candidate columns, in order, with the first other columns added up to a multiple of :data:`COLUMNS`
    (at most the vocabulary)."""
    width = min(-(-max(count, 1) // COLUMNS) * COLUMNS, vocab)
    chosen = np.flatnonzero(candidates)
    if width <= count:
        return chosen
    # the first width - count other columns all lie below width (at most count candidates do): only that prefix
    # is read (a copy and two passes over the whole vocabulary were 70 us a step at 32000)
    others = np.flatnonzero(~candidates[:width])[: width - count]
    return np.sort(np.concatenate((chosen, others)))
