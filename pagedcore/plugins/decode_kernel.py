"""Decode attention straight from the paged pool on the CPU (``decode_kernel.c``): the torch backend's way for
sequences that compute one query each, where the kernel serves.

Why: the torch backend's decode bucket gathers every sequence's blocks into a padded copy (``index_select``), zeroes
the copy's stale slots and runs SDPA under a padding mask; at 16 sequences of 128-256 keys that was about 1 ms per
layer call on the AMD box, the gathers alone half of it (``scripts/decode_attention.py``). The kernel reads each
sequence's keys and values where the pool holds them, one task per (sequence, KV head) shared by the threads (a
sequence's heads taken together, so one thread reads its whole pool rows), and
writes the outputs in place: no copy, no padding, no mask.

Exactness: not SDPA's bits (another order of the same sums, outputs within about 1e-6 of it), the same bits
whatever else shares the forward and wherever the pool put the blocks (each task reads its keys in position order).
Tokens are checked against transformers' own attention as every path's are.

Where it serves (:meth:`DecodeKernel.fits`): float32 on the CPU, the slot-major pool (contiguous), head sizes that
are multiples of 8, no softcap or sink logits, nothing recording or tracing the ops (autograd, ``torch.compile``, a
dispatch mode), and a kernel built here (:func:`load`: Linux on x86-64 with AVX2 and FMA and a C compiler;
``PAGEDCORE_DECODE_KERNEL=0`` turns it off). Elsewhere the backend's own ways run.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from pagedcore.attention import PagedAttentionMetadata, long_tensor
from pagedcore.c_library import build, can_build_avx2

__all__ = ["DecodeKernel", "DecodeRows", "load"]

_SOURCE = Path(__file__).with_name("decode_kernel.c")
_SOURCE_TEXT = _SOURCE.read_text() if _SOURCE.is_file() else None  # read with this module (see c_library)
_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
_LOCK = threading.Lock()
_LOADED: list[DecodeKernel | None] = []
_MAX_GROUPS = 64  # query heads per KV head the C code holds a softmax sum for


@dataclass
class DecodeRows:
    """The decode rows of one forward and KV group, as the kernel reads them (built once per forward, used by every
    layer of the group): each row's packed query index, its block table's row, its first visible key position and
    key count, and the logical blocks dropped before its table.

    Example:
        >>> meta = PagedAttentionMetadata.build(block_size=4, query_lens=[1, 3, 1], seq_lens=[6, 3, 9],
        ...     block_offsets=[0, 0, 1], tables=[[1, 0], [2], [4, 5]], slots=[[1], [8, 9, 10], [20]],
        ...     sliding_window=None, pad_block=6)
        >>> rows = DecodeRows.of(meta, [0, 2])   # the two decoding sequences
        >>> rows.rows.tolist(), rows.first.tolist(), rows.length.tolist(), rows.dropped.tolist()
        ([0, 4], [0, 4], [6, 5], [0, 1])
    """

    rows: torch.Tensor  # int64 (n,)
    table_rows: torch.Tensor  # int64 (n,)
    first: torch.Tensor  # int64 (n,)
    length: torch.Tensor  # int64 (n,)
    dropped: torch.Tensor  # int64 (n,)
    tables: torch.Tensor  # int32 (sequences, width), contiguous, on the CPU
    max_length: int

    @classmethod
    def of(cls, meta: PagedAttentionMetadata, seqs: list[int]) -> DecodeRows:
        """The rows of sequences ``seqs`` of ``meta`` (each with one query)."""
        bs, kind, starts = meta.block_size, meta.kind, meta.query_start_loc
        first, length = [], []
        for i in seqs:
            seq_len = meta.seq_lens[i]
            start = max(kind.first_visible(seq_len - 1), meta.block_offsets[i] * bs)
            first.append(start)
            length.append(seq_len - start)
        tables = meta.host_tables.to(torch.int32).contiguous()  # as stack_block_tables makes them: no copy
        return cls(
            long_tensor([starts[i] for i in seqs]),
            long_tensor(seqs),
            long_tensor(first),
            long_tensor(length),
            long_tensor([meta.block_offsets[i] for i in seqs]),
            tables,
            max(length),
        )


class DecodeKernel:
    """The built kernel (:func:`load`).

    Example:
        >>> from pagedcore.attention import PagedAttentionMetadata
        >>> kc, vc = torch.randn(3, 4, 1, 8), torch.randn(3, 4, 1, 8)   # 2 blocks of 4 + the pad block
        >>> meta = PagedAttentionMetadata.build(block_size=4, query_lens=[1], seq_lens=[6], block_offsets=[0],
        ...     tables=[[1, 0]], slots=[[1]], sliding_window=None, pad_block=2)
        >>> query, kernel = torch.randn(1, 2, 8), load()
        >>> if kernel is not None:
        ...     out = torch.empty(1, 2, 8)
        ...     kernel.attend(query, kc, vc, DecodeRows.of(meta, [0]), 8 ** -0.5, out)
        ...     k = torch.cat([kc[1], kc[0]])[:6].transpose(0, 1)   # (heads, keys, dim)
        ...     v = torch.cat([vc[1], vc[0]])[:6].transpose(0, 1)
        ...     want = torch.nn.functional.scaled_dot_product_attention(query.transpose(0, 1), k, v, scale=8 ** -0.5,
        ...                                                             enable_gqa=True)
        ...     assert torch.allclose(out.transpose(0, 1), want, atol=1e-6)
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = library.paged_decode
        p, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self._function.argtypes = [p, p, p, p, i, p, p, p, p, p, i, i, i, i, i, i, f, p, p, i, ctypes.c_int]
        self._function.restype = None

    @staticmethod
    def fits(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> bool:
        """Whether the kernel serves this layer call (the module docstring says where)."""
        q_heads, kv_heads = query.shape[1], key_cache.shape[2]
        return (
            softcap is None
            and sinks is None
            and query.dtype is torch.float32
            and key_cache.dtype is torch.float32
            and value_cache.dtype is torch.float32
            and query.is_cpu
            and key_cache.is_cpu
            and value_cache.is_cpu
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
            and query.shape[2] % 8 == 0
            and value_cache.shape[3] % 8 == 0
            and query.shape[2] == key_cache.shape[3]
            and q_heads % kv_heads == 0
            and q_heads // kv_heads <= _MAX_GROUPS
            and not (torch.is_grad_enabled() and query.requires_grad)
            and not torch.compiler.is_compiling()
            and _get_current_dispatch_mode() is None
        )

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        rows: DecodeRows,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Write the attention of ``rows``' queries (rows of ``query (tokens, q_heads, d)``) into the same rows of
        ``out (tokens, q_heads, dv)`` (contiguous float32)."""
        q = query.contiguous()
        q_heads, dim = q.shape[1], q.shape[2]
        kv_heads, block_size, dv = key_cache.shape[2], key_cache.shape[1], value_cache.shape[3]
        threads = torch.get_num_threads()
        scratch = torch.empty(threads * (q_heads // kv_heads) * rows.max_length)
        self._function(
            q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), rows.tables.data_ptr(), rows.tables.shape[1],
            rows.rows.data_ptr(), rows.table_rows.data_ptr(), rows.first.data_ptr(), rows.length.data_ptr(),
            rows.dropped.data_ptr(), len(rows.rows), q_heads, kv_heads, dim, dv, block_size, scale, out.data_ptr(),
            scratch.data_ptr(), rows.max_length, threads,
        )  # fmt: skip


def load() -> DecodeKernel | None:
    """The process's kernel, built at the first call; None where it cannot serve (the module docstring says where).

    Example:
        >>> load() is load()
        True
    """
    with _LOCK:
        if not _LOADED:
            built = build("decode_kernel", _SOURCE_TEXT, _FLAGS) if can_build_avx2("PAGEDCORE_DECODE_KERNEL") else None
            _LOADED.append(DecodeKernel(built) if built is not None else None)
        return _LOADED[0]
