"""Paged attention: the per-forward metadata and the backend interface that plugins implement.

Layout shared by every backend:

- a layer's pool is two tensors ``(num_blocks + 1, block_size, kv_heads, head_dim)`` for keys and values; the last
  block (``pad_block``) is never handed out and stays zero, so padded block tables and padded gathers can point at it.
  They may be permuted views (the adapter pool's ``kv_layout="heads"`` stores head after head): backends index them
  and ``view`` their first two dimensions together, never assume them contiguous;
- queries are packed: ``(num_tokens, q_heads, head_dim)``, sequence after sequence, only real tokens;
- a sequence's queries are its last ``query_lens[i]`` positions of ``seq_lens[i]``; which keys a query sees is its
  group's attention kind's rule (:attr:`PagedAttentionMetadata.kind`: causal, and within the window in a sliding
  group).

Metadata is built once per forward and KV group and shared by all of the group's layers; a backend keeps whatever
it derives from it (index tensors, attention biases) in ``metadata.backend_state``. Moving it to a GPU
(:meth:`PagedAttentionMetadata.to`, :func:`to_device`) copies from pinned memory without waiting for the GPU, and the
moved metadata keeps the host copy of its block tables, so a backend derives its per-step tensors on the CPU.

The block size is chosen by :func:`default_block_size` when a pool is created without one.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from pagedcore.attention_kinds import AttentionKind, attention_kind

__all__ = [
    "CPU_BLOCK_SIZE",
    "CUDA_BLOCK_SIZE",
    "AttentionBackend",
    "PagedAttentionMetadata",
    "bucket",
    "contiguous_start",
    "default_block_size",
    "eager_attention",
    "long_tensor",
    "stack_block_tables",
    "to_device",
    "write_kv",
]

CPU_BLOCK_SIZE = 16  # the torch backend gathers whole blocks: small blocks waste less and give finer prefix hits
CUDA_BLOCK_SIZE = 64  # xformers' triton_splitk reads the pool in place only for pages of a multiple of 64 tokens


def bucket(n: int, minimum: int = 1) -> int:
    """The launch size ``n`` is padded to: the next power of two, at least ``minimum`` (compiled decode graphs and
    xformers' paged launches, one graph or bias per bucket).

    Example:
        >>> [bucket(n) for n in (1, 2, 3, 5, 16, 17)], bucket(3, minimum=4)
        ([1, 2, 4, 8, 16, 32], 4)
    """
    return max(minimum, 1 << max(0, n - 1).bit_length())


def default_block_size(device: torch.device | str, backend: str | None = None) -> int:
    """Tokens per block for a pool whose model runs on ``device`` with the attention backend ``backend``.

    On CUDA, with the xformers backend (the plugins' choice there, ``backend=None``), 64: xformers' ``triton_splitk``
    reads keys and values straight from the pool only for pages of a multiple of 64 tokens; with smaller pages every
    step gathers them into a contiguous copy first. 64, not 256 (what the ``flash_attn`` package's paged kernel needs),
    because prefix hits are whole blocks: pass ``block_size=256`` yourself for long prompts with ``flash_attn``.
    Elsewhere (CPU, or ``backend="torch"``) 16: the torch backend gathers whole blocks, so small blocks waste less.

    Args:
        device: the device the model (its first layer) runs on.
        backend: the attention backend name requested (None: the plugins' choice).

    Example:
        >>> default_block_size("cpu"), default_block_size("cuda"), default_block_size("cuda", "torch")
        (16, 64, 16)
    """
    if torch.device(device).type == "cuda" and backend in (None, "xformers"):
        return CUDA_BLOCK_SIZE
    return CPU_BLOCK_SIZE


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` (on the CPU) on ``device``, copied from pinned memory without waiting for the GPU.

    A plain ``.to("cuda")`` of a pageable CPU tensor waits until the GPU has finished all work queued before it; a
    non-blocking copy from pinned memory does not (torch keeps the pinned buffer alive until the copy is done).

    Example:
        >>> to_device(torch.tensor([1, 2]), "cpu").tolist()
        [1, 2]
    """
    device = torch.device(device)
    if tensor.device == device:
        return tensor
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def long_tensor(values: Sequence[int]) -> torch.Tensor:
    """``values`` (Python ints) as a 1-D int64 CPU tensor, through numpy: ``torch.tensor`` of a list converts it one
    element at a time (70 µs for 256 ints on the AMD box, 35 with ``dtype`` given, against 8 this way), and a step of
    hundreds of rows makes several such tensors (the token ids, their positions, the rows to keep, the slots).

    Example:
        >>> long_tensor([3, 1, 2]), long_tensor([]).shape
        (tensor([3, 1, 2]), torch.Size([0]))
    """
    return torch.from_numpy(np.array(values, dtype=np.int64))


def stack_block_tables(tables: Sequence[Sequence[int]], pad_block: int) -> torch.Tensor:
    """Block tables of several sequences as one ``int32 (len(tables), width)`` tensor, each row padded with
    ``pad_block`` to the longest (width at least 1): how every forward's metadata pads its tables (the Engine's packed
    steps and a ``PagedCache``'s forwards alike). Rows may be lists or ``array('i')`` buffers
    (:meth:`~pagedcore.block_tables.BlockTables.table_array`), copied without a per-block Python loop.

    Example:
        >>> stack_block_tables([array("i", [3, 5]), [1]], pad_block=8).tolist()
        [[3, 5], [1, 8]]
    """
    width = max((len(row) for row in tables), default=0) or 1
    pad = array("i", [pad_block]) * width
    buffer = array("i")
    for row in tables:
        buffer.extend(row)
        if len(row) < width:
            buffer += pad[: width - len(row)]
    if not buffer:
        return torch.full((len(tables), width), pad_block, dtype=torch.int32)
    return torch.frombuffer(buffer, dtype=torch.int32).clone().view(len(tables), width)


@dataclass
class PagedAttentionMetadata:
    """Where each sequence's queries and keys are, for one KV group in one forward.

    Attributes:
        block_size: tokens per block.
        query_lens: new tokens per sequence, in packed order.
        seq_lens: keys per sequence after this forward (positions ``0 .. seq_len - 1``; the queries are the last).
        block_offsets: per sequence, the logical index of its first live block (blocks before it left a window).
        block_tables: ``int32 (num_seqs, max_blocks)``: physical block of logical block ``block_offsets[i] + j``,
            padded with ``pad_block``.
        slot_mapping: ``int64 (num_tokens,)``: the slot each new token's key and value are written to.
        sliding_window: the group's window, or None for full (or chunked) attention.
        pad_block: the zero block used for padding.
        host_block_tables: the CPU copy of ``block_tables`` when they live on another device (set by :meth:`to`), so
            that backends derive per-step tensors on the host; None when ``block_tables`` are on the CPU.
        group_kind: the group's attention kind when it is not given by the window alone (chunked attention); see
            :attr:`kind`.

    Example:
        >>> meta = PagedAttentionMetadata.build(
        ...     block_size=4, query_lens=[2, 1], seq_lens=[6, 3], block_offsets=[0, 0],
        ...     tables=[[3, 5], [1]], slots=[[21, 22], [10]], sliding_window=None, pad_block=8)
        >>> meta.block_tables.tolist(), meta.query_start_loc
        ([[3, 5], [1, 8]], [0, 2, 3])
    """

    block_size: int
    query_lens: list[int]
    seq_lens: list[int]
    block_offsets: list[int]
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    sliding_window: int | None
    pad_block: int
    backend_state: dict[Any, Any] = field(default_factory=dict, repr=False)
    host_block_tables: torch.Tensor | None = field(default=None, repr=False)
    group_kind: AttentionKind | None = None

    @classmethod
    def build(
        cls,
        *,
        block_size: int,
        query_lens: list[int],
        seq_lens: list[int],
        block_offsets: list[int],
        tables: list[list[int]],
        slots: list[list[int]],
        sliding_window: int | None,
        pad_block: int,
        device: torch.device | str = "cpu",
        kind: AttentionKind | None = None,
    ) -> PagedAttentionMetadata:
        """Metadata from plain lists (one entry per sequence); the tables are padded by :func:`stack_block_tables`.
        ``kind``: the group's attention kind when the window alone does not say it (chunked attention)."""
        flat_slots = [s for row in slots for s in row]
        return cls(
            block_size=block_size,
            query_lens=list(query_lens),
            seq_lens=list(seq_lens),
            block_offsets=list(block_offsets),
            block_tables=stack_block_tables(tables, pad_block).to(device),
            slot_mapping=long_tensor(flat_slots).to(device),
            sliding_window=sliding_window,
            pad_block=pad_block,
            group_kind=kind,
        )

    @property
    def kind(self) -> AttentionKind:
        """The group's attention kind: which keys each query sees (ask it rather than the window).

        Example:
            >>> meta = PagedAttentionMetadata.build(block_size=4, query_lens=[1], seq_lens=[9], block_offsets=[0],
            ...     tables=[[0, 1, 2]], slots=[[8]], sliding_window=4, pad_block=5)
            >>> meta.kind.first_visible(8)
            5
        """
        return self.group_kind if self.group_kind is not None else attention_kind(self.sliding_window)

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch."""
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        """Packed query tokens."""
        return sum(self.query_lens)

    @property
    def query_start_loc(self) -> list[int]:
        """Cumulative query lengths (``num_seqs + 1`` entries, starting at 0)."""
        out = [0]
        for n in self.query_lens:
            out.append(out[-1] + n)
        return out

    @property
    def host_tables(self) -> torch.Tensor:
        """The block tables on the CPU: kept by :meth:`to`; for metadata built on a device, copied once (a wait)."""
        if self.host_block_tables is None and self.block_tables.device.type != "cpu":
            self.host_block_tables = self.block_tables.cpu()
        return self.block_tables if self.host_block_tables is None else self.host_block_tables

    def to(self, device: torch.device) -> PagedAttentionMetadata:
        """The same metadata with its tensors on ``device`` (cached: layers split over devices share it).

        The copy does not wait for the GPU (see :func:`to_device`); the moved metadata keeps the host tables.
        """
        if self.block_tables.device == device:
            return self
        key = ("to", device)
        moved = self.backend_state.get(key)
        if moved is None:
            moved = PagedAttentionMetadata(
                self.block_size,
                self.query_lens,
                self.seq_lens,
                self.block_offsets,
                to_device(self.block_tables, device),
                to_device(self.slot_mapping, device),
                self.sliding_window,
                self.pad_block,
                host_block_tables=self.host_tables,
                group_kind=self.group_kind,
            )
            self.backend_state[key] = moved
        return moved


@runtime_checkable
class AttentionBackend(Protocol):
    """Computes attention over a paged pool. Implemented by plugins (see ``pagedcore.plugins``).

    Example:
        >>> from pagedcore import default_plugin_manager
        >>> backend = default_plugin_manager().attention_backend("cpu", torch.float32)
        >>> backend.name
        'torch'
    """

    name: str

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: PagedAttentionMetadata,
        *,
        scale: float,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of packed ``query (num_tokens, q_heads, head_dim)`` over the pool; returns
        ``(num_tokens, q_heads, v_head_dim)``. The new tokens' keys and values are already written. ``sinks``
        ``(q_heads,)``: a learned logit per head in every query's softmax denominator (gpt-oss), or None. A
        backend written before sinks existed is called without the keyword when a layer has none."""
        ...


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor | int,
) -> None:
    """Store packed ``key``/``value`` ``(num_tokens, kv_heads, head_dim)`` at their slots in the pool.

    ``slot_mapping`` is the slot of every token, or an ``int``: the first of ``num_tokens`` consecutive slots (a
    sequence growing inside its blocks, as every decode step of one sequence does), written as one slice.

    Example:
        >>> kc, vc = torch.zeros(3, 2, 1, 1), torch.zeros(3, 2, 1, 1)
        >>> write_kv(kc, vc, torch.ones(1, 1, 1), torch.ones(1, 1, 1), torch.tensor([3]))
        >>> write_kv(kc, vc, torch.full((2, 1, 1), 2.0), torch.ones(2, 1, 1), 4)   # slots 4 and 5
        >>> kc.flatten().tolist()
        [0.0, 0.0, 0.0, 1.0, 2.0, 2.0]
    """
    for cache, new in ((key_cache, key), (value_cache, value)):
        if torch.compiler.is_compiling() and not isinstance(slot_mapping, int) and cache.dim() == 4:
            # Traced: index the pool tensor itself. Inductor functionalizes a write through a flattened view of it
            # into a copy of the layer's whole pool, twice, every step (6x slower at a 2k context).
            block_size = cache.shape[1]
            cache.index_put_((slot_mapping // block_size, slot_mapping % block_size), new.to(cache.dtype))
            continue
        flat = cache.view(-1, *cache.shape[-2:])
        if isinstance(slot_mapping, int):
            flat[slot_mapping : slot_mapping + new.shape[0]] = new
        else:
            flat.index_copy_(0, slot_mapping, new.to(cache.dtype))


def contiguous_start(
    table: Sequence[int], start: int, length: int, block_size: int, first_block: int = 0
) -> int | None:
    """The slot of position ``start`` when positions ``start .. start + length - 1`` lie in consecutive blocks of
    ``table`` (whose first entry is logical block ``first_block``), else None. Then those positions' keys are one
    run of the pool's slots, and attention can read them as a view instead of gathering them.

    Example:
        >>> contiguous_start([4, 5, 9], start=2, length=5, block_size=4), contiguous_start([4, 5, 9], 2, 8, 4)
        (18, None)
    """
    lo = start // block_size - first_block
    hi = (start + length - 1) // block_size - first_block
    if length < 1 or lo < 0 or hi >= len(table) or table[hi] - table[lo] != hi - lo:
        return None
    if any(table[i + 1] != table[i] + 1 for i in range(lo, hi)):
        return None
    return table[lo] * block_size + start % block_size


def eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention computed step by step (for what SDPA cannot do: logit softcapping, as Gemma2 needs; attention
    sinks, as gpt-oss has).

    ``query (..., q_heads, q_len, d)``, ``key``/``value (..., kv_heads, k_len, d)`` (GQA expanded here); ``mask``
    broadcasts to the scores: boolean (True = attend) or additive, None = every query sees every key. ``sinks``
    ``(q_heads,)``: a logit per head that joins every query's softmax with a zero value (the weights then sum to
    less than one). Returns ``(..., q_heads, q_len, dv)``.

    Example:
        >>> q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
        >>> eager_attention(q, k, v, None, scale=8 ** -0.5, softcap=30.0).shape
        torch.Size([1, 4, 2, 8])
        >>> quiet = eager_attention(q, k, v, None, scale=8 ** -0.5, sinks=torch.full((4,), 50.0))
        >>> bool(quiet.abs().max() < 1e-6)   # a sink far above every score takes all the weight
        True
    """
    groups = query.shape[-3] // key.shape[-3]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    elif mask is not None:
        scores = scores + mask
    if sinks is not None:
        column = sinks.to(scores.dtype).reshape(-1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], dim=-1)
        scores = scores - scores.amax(dim=-1, keepdim=True)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :-1].to(query.dtype)
        return torch.matmul(probs, value)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value)
