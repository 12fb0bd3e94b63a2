"""A decode step's few-row linear calls split across the CPU's threads, for the Engine's forwards (issue 33.2).

Why: with one row ``F.linear`` is a matrix-vector product that MKL computes on one thread whatever torch's thread
count, and with a few rows its GEMM shares the threads badly (``python scripts/row_split.py``: a 65 MB head weight
took 6.2 ms at 1 and at 2 threads, 10 GB/s of a machine that streams 35; a 1536 x 512 weight at 16 rows 0.49 ms).
:func:`split_linear` multiplies the same rows by the weight's row blocks as one ``torch.bmm`` over a view (no copy):
MKL's batched GEMM gives each thread its blocks (0.28 and 0.36 ms there).

Exactness first: each output is one input row times one weight row, and the batched call sums it with the same kernel
as the whole call (each block starts at a row boundary, so each weight row keeps its alignment): the suite checks it
on the benchmark's shapes. Where that does not hold, the first call of each shape and row count (weight shape, bias,
blocks, threads, rows) computes both and compares them bit for bit: a row count whose bits differ keeps ``F.linear``
(MKL's GEMM takes another path for 5-7 and 9-11 rows, here). Per power-of-two bucket of row counts the next
:data:`TRIALS` calls each way are timed, and the faster way serves the bucket from then on, so the split runs only
where it is exact and faster. Calls of more than :data:`MAX_ROWS` rows (prefill chunks) are never split; they take
the kernel below where it is exact and timed faster, else ``F.linear``.

A third way joins where the process has one: :mod:`.row_kernel`'s C kernel, which sums in MKL's own orders straight
from the weight's rows. Its bits are checked at the same first call (it is tried in each order until one matches;
the order is kept per row count, since which rows MKL sums in which of its two orders depends on the row count),
and the same trials time it; a bucket keeps the fastest of the ways exact at its row counts. The same first call
also checks the BLAS's own ``sgemm`` called from C as ``F.linear`` calls it (:data:`.row_kernel.BLAS`): not a way of
the trials (it is ``F.linear``'s GEMM), but what the decode tape calls for a layer that settled on ``F.linear``
(:meth:`RowSplit.exact_order`).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .row_kernel import BLAS, Order, RowKernel

__all__ = ["MAX_ROWS", "MIN_BLOCK_ROWS", "TRIALS", "WAYS", "RowSplit", "split_blocks", "split_linear"]

TRIALS = 3  # timed calls each way before a bucket keeps the faster
MIN_BLOCK_ROWS = 64  # weight rows per block at least: smaller blocks cost more in the call than they save
MAX_ROWS = 256  # input rows at most (scripts/row_split.py: the split's gain ends between 128 and 256 rows)
_clock = time.perf_counter  # the trials' clock (a test drives its own)
_Key = tuple[int, int, bool, int, int, int]  # weight rows, width, bias, blocks, threads, power-of-two row bucket
WAYS = ("plain", "split", "kernel")  # F.linear, the batched product over the weight's row blocks, row_kernel.py


def split_blocks(out_features: int, threads: int) -> int | None:
    """Row blocks for a weight of ``out_features`` rows at ``threads`` threads: two per thread (the threads' shares
    even out), else one; None where no such count divides the rows into blocks of :data:`MIN_BLOCK_ROWS` or more, or
    with one thread (nothing to share).

    Example:
        >>> split_blocks(1536, 2), split_blocks(1538, 2), split_blocks(1537, 2), split_blocks(1536, 1)
        (4, 2, None, None)
    """
    if threads < 2:
        return None
    for blocks in (2 * threads, threads):
        if out_features % blocks == 0 and out_features // blocks >= MIN_BLOCK_ROWS:
            return blocks
    return None


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocks: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as one batched product of ``x``'s rows with ``blocks`` blocks of the weight's
    rows (a view of a contiguous weight).

    Example:
        >>> weight, x = torch.randn(256, 32), torch.randn(1, 3, 32)
        >>> split_linear(x, weight, None, 2).shape, torch.allclose(split_linear(x, weight, None, 2), x @ weight.T)
        (torch.Size([1, 3, 256]), True)
    """
    rows, width = weight.shape
    per = rows // blocks
    flat = x.reshape(-1, width)
    left = flat.unsqueeze(0).expand(blocks, *flat.shape)  # (blocks, n, width): the same rows for every block
    parts = weight.view(blocks, per, width).transpose(1, 2)  # (blocks, width, per): each block's rows, transposed
    # With a bias: baddbmm, as F.linear's addmm adds it inside the GEMM.
    out = torch.bmm(left, parts) if bias is None else torch.baddbmm(bias.view(blocks, 1, per), left, parts)
    if flat.shape[0] > 1:
        out = out.transpose(0, 1)  # (n, blocks, per)
    return out.reshape(*x.shape[:-1], rows)


@dataclass
class _Bucket:
    checked: set[int] = field(default_factory=set)  # row counts whose bits were compared
    exact: dict[str, set[int]] = field(default_factory=lambda: {"split": set(), "kernel": set()})  # equal bits
    orders: dict[int, Order] = field(default_factory=dict)  # by row count: the kernel's (RowKernel.exact_order)
    blas: set[int] = field(default_factory=set)  # row counts whose BLAS call (row_kernel.BLAS) gave equal bits
    times: dict[str, list[float]] = field(default_factory=lambda: {way: [] for way in WAYS})
    way: str | None = None  # decided: "plain", "split" or "kernel"

    def exact_ways(self, rows: int) -> list[str]:
        """The ways whose bits equal ``F.linear``'s at ``rows`` rows (plain first)."""
        return ["plain", *(way for way, counts in self.exact.items() if rows in counts)]


class RowSplit:
    """The few-row linear calls of a runner's forwards (see the module docstring): :meth:`linear` is ``F.linear``'s
    result, computed the faster exact way per shape and bucket of row counts: ``F.linear`` ("plain"), split across
    the threads ("split"), or the C kernel of :mod:`.row_kernel` where one is given ("kernel").

    Example:
        >>> split = RowSplit()
        >>> weight, x = torch.randn(256, 32), torch.randn(1, 32)
        >>> with torch.inference_mode():
        ...     outs = [split.linear(x, weight, None, threads=2) for _ in range(8)]
        >>> all(torch.equal(out, F.linear(x, weight)) for out in outs), list(split.ways())   # the way: timed
        (True, [(256, 32, False, 4, 2, 1)])
    """

    def __init__(self, kernel: RowKernel | None = None) -> None:
        self._buckets: dict[_Key, _Bucket] = {}
        self._lock = threading.Lock()
        self._kernel = kernel

    def ways(self) -> dict[_Key, str | None]:
        """Each bucket's way (``"plain"``, ``"split"``, ``"kernel"``, or None while timed), by (weight rows, width,
        bias, blocks (0: no split), threads, power-of-two bucket of input rows)."""
        return {key: bucket.way for key, bucket in self._buckets.items()}

    def differing(self, way: str = "split") -> dict[_Key, set[int]]:
        """The row counts whose bits differed from ``F.linear``'s the ``way`` way, by bucket (where it was tried)."""
        out = {}
        for key, bucket in self._buckets.items():
            tried = key[3] > 0 if way == "split" else self._kernel is not None
            if tried and (differ := bucket.checked - bucket.exact[way]):
                out[key] = differ
        return out

    def settled(self, shape: tuple[int, int, bool], rows: int, threads: int) -> str | None:
        """The way every later call of ``rows`` rows through a contiguous weight of ``shape`` (rows, width, bias)
        takes at ``threads`` threads: ``"split"`` or ``"kernel"`` (its bits checked equal and the bucket timed
        faster), ``"plain"`` (``F.linear``: bits that differ, a bucket timed slower, or a call no other way serves),
        or None while its bits or times are still to be measured. A decided way never changes, so a compiled step
        can trace it (:meth:`.prepacked.PrepackedLinears.linear`).

        Example:
            >>> split = RowSplit()
            >>> weight, x = torch.randn(256, 32), torch.randn(1, 32)
            >>> print(split.settled((256, 32, False), 1, 2))
            None
            >>> with torch.inference_mode():
            ...     _ = [split.linear(x, weight, None, threads=2) for _ in range(1 + 2 * TRIALS)]
            >>> split.settled((256, 32, False), 1, 2) in ("split", "plain"), split.settled((256, 32, False), 512, 2)
            (True, 'plain')
        """
        blocks = _blocks(shape[0], threads, rows)
        kernel = self._kernel is not None and self._kernel.fits_shape(shape[0], shape[1])
        if (blocks is None and not kernel) or rows <= 0:
            return "plain"
        bucket = self._buckets.get(_key(shape, rows, threads))
        if bucket is None:
            return None
        checked = rows in bucket.checked
        if bucket.way == "plain" or (checked and bucket.exact_ways(rows) == ["plain"]):
            return "plain"
        if bucket.way is None or not checked:
            return None
        return bucket.way if bucket.way in bucket.exact_ways(rows) else "plain"

    def kernel_order(self, shape: tuple[int, int, bool], rows: int, threads: int) -> Order | None:
        """The kernel's order for ``rows`` rows through a contiguous weight of ``shape`` at ``threads`` threads where
        the way :meth:`settled` on is the kernel's, else None (a layer's route then calls the kernel directly:
        :mod:`.linear_routes`)."""
        if self._kernel is None or self.settled(shape, rows, threads) != "kernel":
            return None
        return self._buckets[_key(shape, rows, threads)].orders[rows]

    def exact_order(self, shape: tuple[int, int, bool], rows: int, threads: int) -> Order | None:
        """A C call with ``F.linear``'s bits for ``rows`` rows through a contiguous weight of ``shape`` at
        ``threads`` threads, whichever way the bucket's trials chose (the decode tape's question: on it a call costs
        its C time alone, and a Python way would break the tape): of the kernel's order and :data:`.row_kernel.BLAS`,
        those whose bits were found equal at this row count, the kernel where the trials timed it faster than
        ``F.linear`` (the BLAS's GEMM), else the BLAS; None where neither was found equal."""
        if self._kernel is None:
            return None
        bucket = self._buckets.get(_key(shape, rows, threads))
        if bucket is None:
            return None
        kernel, blas = rows in bucket.exact["kernel"], rows in bucket.blas
        if kernel and blas:
            times = bucket.times
            faster = bucket.way == "kernel" or (
                len(times["kernel"]) > 0
                and len(times["plain"]) > 0
                and statistics.median(times["kernel"]) < statistics.median(times["plain"])
            )
            return bucket.orders[rows] if faster else BLAS
        return bucket.orders[rows] if kernel else BLAS if blas else None

    @property
    def kernel(self) -> RowKernel | None:
        """The C kernel this split may take (None: none)."""
        return self._kernel

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int | None = None
    ) -> torch.Tensor:
        """``F.linear(x, weight, bias)``: split or through the kernel where that is exact and faster."""
        rows = x.numel() // x.shape[-1]
        threads = torch.get_num_threads() if threads is None else threads
        blocks = _blocks(weight.shape[0], threads, rows)
        kernel = self._kernel if self._kernel is not None and RowKernel.fits_shape(*weight.shape) else None
        if (blocks is None and kernel is None) or rows <= 0 or not contiguous(weight, bias):
            return F.linear(x, weight, bias)
        if not x.is_contiguous():  # F.linear hands MKL such rows as they lie (transposed: another order): its own
            return F.linear(x, weight, bias)
        key = _bucket((weight.shape[0], weight.shape[1], bias is not None), blocks, threads, rows)
        bucket = self._buckets.get(key)
        if bucket is None:
            with self._lock:
                bucket = self._buckets.setdefault(key, _Bucket())
        if bucket.way == "plain":
            return F.linear(x, weight, bias)
        if rows not in bucket.checked:  # this row count's first call: the bits of every way compared
            start = _clock()
            plain = F.linear(x, weight, bias)
            plain_time = _clock() - start
            if blocks is not None and torch.equal(plain, split_linear(x, weight, bias, blocks)):
                bucket.exact["split"].add(rows)
            if kernel is not None and kernel.fits(x, weight, bias):
                start = _clock()
                order = kernel.exact_order(x, weight, bias, plain, threads)
                kernel_time = _clock() - start
                if order is not None:
                    bucket.orders[rows] = order
                    bucket.exact["kernel"].add(rows)
                    if rows > MAX_ROWS and bucket.way is None:  # a prefill chunk's row counts seldom repeat: its
                        bucket.times["plain"].append(plain_time / rows)  # check is a trial of both ways (the
                        bucket.times["kernel"].append(kernel_time / rows)  # kernel's time with every order tried)
                        self._decide(bucket)
            if (
                kernel is not None
                and kernel.blas
                and rows <= MAX_ROWS  # the tape's question: a decode step's rows, never a prefill chunk's
                and kernel.fits(x, weight, bias)
                and torch.equal(kernel.linear(x, weight, bias, BLAS, threads), plain)
            ):
                bucket.blas.add(rows)
            bucket.checked.add(rows)
            return plain
        if bucket.way is not None:  # decided (not "plain"): its way where this row count's bits matched
            way = bucket.way if rows in bucket.exact[bucket.way] else "plain"
            return self._run(way, bucket, rows, x, weight, bias, threads)
        ways = bucket.exact_ways(rows)
        times = bucket.times
        way = min(ways, key=lambda w: len(times[w]))  # the exact way timed least so far
        start = _clock()
        out = self._run(way, bucket, rows, x, weight, bias, threads)
        times[way].append((_clock() - start) / rows)
        self._decide(bucket)
        return out

    @staticmethod
    def _decide(bucket: _Bucket) -> None:
        """The bucket's way, once every way exact at some row count of it has :data:`TRIALS` times: the fastest."""
        times = bucket.times
        tried = [w for w in WAYS if w == "plain" or bucket.exact[w]]  # the ways exact at some row count here
        if len(tried) > 1 and all(len(times[w]) >= TRIALS for w in tried):  # (plain alone: no way to choose yet)
            bucket.way = min(tried, key=lambda w: statistics.median(times[w]))

    def _run(
        self,
        way: str,
        bucket: _Bucket,
        rows: int,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        threads: int,
    ) -> torch.Tensor:
        if way == "split":
            blocks = split_blocks(weight.shape[0], threads)
            assert blocks is not None
            return split_linear(x, weight, bias, blocks)
        if way == "kernel":
            assert self._kernel is not None
            return self._kernel.linear(x, weight, bias, bucket.orders[rows], threads)
        return F.linear(x, weight, bias)


def _key(shape: tuple[int, int, bool], rows: int, threads: int) -> _Key:
    """The bucket of ``rows`` rows through a weight of ``shape`` (rows, width, bias) at ``threads`` threads."""
    return _bucket(shape, _blocks(shape[0], threads, rows), threads, rows)


def _blocks(out_features: int, threads: int, rows: int) -> int | None:
    """The split's row blocks for a call of ``rows`` rows: :func:`split_blocks` up to :data:`MAX_ROWS` rows; None
    past them (a prefill chunk: the kernel or ``F.linear``, the split's gain ends there)."""
    return split_blocks(out_features, threads) if rows <= MAX_ROWS else None


def _bucket(shape: tuple[int, int, bool], blocks: int | None, threads: int, rows: int) -> _Key:
    """:func:`_key` where the caller has the weight's row blocks already (the split's own call, once per linear)."""
    return (*shape, blocks or 0, threads, 1 << (rows - 1).bit_length())


def contiguous(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the split can view ``weight`` (and ``bias``) in blocks: both contiguous (an internal helper of
    :class:`RowSplit` and the compiled step's linears)."""
    return weight.is_contiguous() and (bias is None or bias.is_contiguous())
