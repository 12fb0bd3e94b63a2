"""TableRows: a KV group's block tables as the rows of one ``int32`` buffer, kept from step to step.

Why: every decode step hands the attention one ``(sequences, width)`` tensor of block tables. Copying each sequence's
table buffer into a fresh tensor every step reads as many scattered buffers as there are sequences, right after the
forward has evicted the caches (0.09 ms at 64 sequences of 512 positions, 0.15 ms at 4096: docs/benchmarks.md, "Block
tables kept between steps"), while a sequence's table changes once per ``block_size`` tokens. Here each sequence
holds a row that is written only when its table changed, and a step gathers its rows from one buffer.

Who owns what: the :class:`~pagedcore.kv_pool.KVPool` makes one ``TableRows`` per group
(:attr:`KVGroup.rows <pagedcore.kv_pool.KVGroup.rows>`); a :class:`~pagedcore.block_tables.BlockTables` takes,
writes and gives back its rows (:meth:`~pagedcore.block_tables.BlockTables.table_row`, freed by its ``release``);
the packer gathers the rows of a step (:meth:`TableRows.gather`). Padding is the pool's ``num_blocks``, as
:func:`~pagedcore.attention.stack_block_tables` pads, so both give the same tensor.

The buffer is a flat ``array('i')`` (the core needs neither numpy nor torch); :meth:`TableRows.gather`, called by a
torch runner's packer, reads it through numpy without a copy and imports both when first called.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Sequence
from typing import Any

__all__ = ["TableRows"]


class TableRows:
    """Rows of block ids padded with ``pad_block``; the buffer grows (doubling) in rows and width as needed.

    Example:
        >>> rows = TableRows(pad_block=9)
        >>> a, b = rows.acquire(), rows.acquire()
        >>> rows.write(a, array("i", [3, 5, 7])); rows.write(b, array("i", [1]))
        >>> rows.gather([b, a]).tolist()
        [[1, 9, 9], [3, 5, 7]]
        >>> rows.write(a, array("i", [3]))          # a shorter table: the tail is padding again
        >>> rows.gather([a, b]).tolist(), rows.num_used
        ([[3], [1]], 2)
        >>> rows.release(a); rows.release(b); rows.num_used
        0
    """

    def __init__(self, pad_block: int, rows: int = 64, width: int = 16) -> None:
        self._pad = pad_block
        self._rows, self._width = max(rows, 1), max(width, 1)
        self._buffer = array("i", [pad_block]) * (self._rows * self._width)
        self._lengths = [0] * self._rows
        self._free = list(range(self._rows - 1, -1, -1))
        self._lock = threading.Lock()  # acquire / release / growth (a step's writes and gathers run under its lock)

    @property
    def num_used(self) -> int:
        """Rows held by some table now."""
        return self._rows - len(self._free)

    def acquire(self) -> int:
        """A free row (empty: all padding), taken until :meth:`release`."""
        with self._lock:
            if not self._free:
                self._grow(2 * self._rows, self._width)
            return self._free.pop()

    def release(self, row: int) -> None:
        """Give ``row`` back (padded again)."""
        with self._lock:
            start = row * self._width
            self._buffer[start : start + self._lengths[row]] = array("i", [self._pad]) * self._lengths[row]
            self._lengths[row] = 0
            self._free.append(row)

    def write(self, row: int, table: array[int]) -> None:
        """Make ``row`` hold ``table`` (an ``array('i')``), padding what a longer table left past its end."""
        n, before = len(table), self._lengths[row]
        if n > self._width:
            with self._lock:
                self._grow(self._rows, max(n, 2 * self._width))
        start = row * self._width
        self._buffer[start : start + n] = table
        if before > n:
            self._buffer[start + n : start + before] = array("i", [self._pad]) * (before - n)
        self._lengths[row] = n

    def gather(self, rows: Sequence[int]) -> Any:
        """The tables of ``rows``, in that order, as a new ``torch.int32 (len(rows), width)`` tensor padded to the
        longest (width at least 1): what :func:`~pagedcore.attention.stack_block_tables` makes of the same tables."""
        import numpy as np
        import torch

        index = np.fromiter(rows, dtype=np.int64, count=len(rows))
        width = max((self._lengths[r] for r in rows), default=0) or 1
        view = np.frombuffer(self._buffer, dtype=np.int32).reshape(self._rows, self._width)
        return torch.from_numpy(view[index, :width])  # fancy indexing copies: later writes leave it alone

    def _grow(self, rows: int, width: int) -> None:
        """Enlarge the buffer (under the lock) to ``rows`` rows of ``width`` columns, keeping every row."""
        buffer = array("i", [self._pad]) * (rows * width)
        for r in range(self._rows):
            n = self._lengths[r]
            if n:
                old = r * self._width
                buffer[r * width : r * width + n] = self._buffer[old : old + n]
        self._free[:0] = range(rows - 1, self._rows - 1, -1)  # the new rows, popped after the free ones
        self._lengths += [0] * (rows - self._rows)
        self._buffer, self._rows, self._width = buffer, rows, width
