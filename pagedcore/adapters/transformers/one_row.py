"""One-row linear layers split across the CPU's threads, for the Engine's batch-1 decode steps (issue 33.2).

Why: a one-row ``F.linear`` is a matrix-vector product, and MKL computes it on one thread whatever torch's thread
count (``scripts/one_row_split.py``: a 65 MB weight took 6.2 ms at 1 and at 2 threads, 10 GB/s of a machine that
streams 35). :func:`split_linear` multiplies the same row by the weight's row blocks as one ``torch.bmm`` over a view
(no copy): MKL's batched GEMM gives each thread its blocks.

Exactness first: each output is one weight row times the input, and the batched call sums it with the same kernel as
the whole call does (every block starts at a row boundary, so each row keeps its alignment), which the suite checks on
the benchmark's shapes. On a machine where that does not hold, the first call of each shape (weight shape, bias,
blocks, threads) computes both and compares them bit for bit: a shape whose bits differ keeps ``F.linear``. Then its
next :data:`TRIALS` calls each way are timed, and the faster way serves the shape from then on, so the split is used
only where it is exact and faster.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

__all__ = ["MIN_BLOCK_ROWS", "TRIALS", "OneRowSplit", "split_blocks", "split_linear"]

TRIALS = 3  # timed calls each way before a shape keeps the faster
MIN_BLOCK_ROWS = 64  # weight rows per block at least: smaller blocks cost more in the call than they save
_clock = time.perf_counter  # the trials' clock (a test drives its own)


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
    """``F.linear(x, weight, bias)`` for one row ``x`` (any leading shape of one element), as one batched product of
    the row with ``blocks`` blocks of the weight's rows (a view of a contiguous weight).

    Example:
        >>> weight, x = torch.randn(256, 32), torch.randn(1, 1, 32)
        >>> split_linear(x, weight, None, 2).shape, torch.allclose(split_linear(x, weight, None, 2), x @ weight.T)
        (torch.Size([1, 1, 256]), True)
    """
    rows, width = weight.shape
    per = rows // blocks
    row = x.reshape(1, 1, width).expand(blocks, 1, width)
    parts = weight.view(blocks, per, width).transpose(1, 2)  # (blocks, width, per): each block's rows, transposed
    # With a bias: baddbmm, as F.linear's addmm adds it inside the GEMM.
    out = torch.bmm(row, parts) if bias is None else torch.baddbmm(bias.view(blocks, 1, per), row, parts)
    return out.reshape(*x.shape[:-1], rows)


@dataclass
class _Shape:
    exact: bool
    times: dict[str, list[float]] = field(default_factory=lambda: {"plain": [], "split": []})
    way: str | None = None  # decided: "plain" or "split"


class OneRowSplit:
    """The one-row linear calls of a runner's forwards (see the module docstring): :meth:`linear` is ``F.linear``'s
    result, computed the faster exact way per shape.

    Example:
        >>> split = OneRowSplit()
        >>> weight, x = torch.randn(256, 32), torch.randn(1, 32)
        >>> with torch.inference_mode():
        ...     outs = [split.linear(x, weight, None, threads=2) for _ in range(8)]
        >>> all(torch.equal(out, F.linear(x, weight)) for out in outs), list(split.ways())   # the way: timed
        (True, [(256, 32, False, 4, 2)])
    """

    def __init__(self) -> None:
        self._shapes: dict[tuple[int, int, bool, int, int], _Shape] = {}
        self._lock = threading.Lock()

    def ways(self) -> dict[tuple[int, int, bool, int, int], str | None]:
        """Each shape's way (``"plain"``, ``"split"``, or None while timed), by (rows, width, bias, blocks,
        threads)."""
        return {key: ("plain" if not shape.exact else shape.way) for key, shape in self._shapes.items()}

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int | None = None
    ) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for one row ``x``: split where that is exact and faster."""
        threads = torch.get_num_threads() if threads is None else threads
        blocks = split_blocks(weight.shape[0], threads)
        if blocks is None or not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
            return F.linear(x, weight, bias)
        key = (weight.shape[0], weight.shape[1], bias is not None, blocks, threads)
        shape = self._shapes.get(key)
        if shape is None:  # the first call: the bits of both ways compared
            plain = F.linear(x, weight, bias)
            with self._lock:
                self._shapes[key] = _Shape(torch.equal(plain, split_linear(x, weight, bias, blocks)))
            return plain
        if not shape.exact or shape.way == "plain":
            return F.linear(x, weight, bias)
        if shape.way == "split":
            return split_linear(x, weight, bias, blocks)
        way = "split" if len(shape.times["split"]) <= len(shape.times["plain"]) else "plain"
        start = _clock()
        out = split_linear(x, weight, bias, blocks) if way == "split" else F.linear(x, weight, bias)
        shape.times[way].append(_clock() - start)
        if min(len(t) for t in shape.times.values()) >= TRIALS:
            faster = statistics.median(shape.times["split"]) < statistics.median(shape.times["plain"])
            shape.way = "split" if faster else "plain"
        return out
