"""Built-in attention backend: xformers' paged attention kernels on CUDA (fp16/bf16).

The backend reads keys and values straight from the pool through xformers' paged attention biases:

- queries are packed ``[1, num_tokens, Hq, D]``; the pool ``(num_blocks + 1, P, Hkv, D)`` is seen as
  ``[1, (num_blocks + 1) * P, Hkv, D]``; with GQA both become 5-D ``[1, L, Hkv, Hq // Hkv, D]``, the pool's
  heads-per-group dim expanded at stride 0, so no key or value is copied;
- full attention uses ``PagedBlockDiagonalCausalWithOffsetPaddedKeysMask`` (bottom-right causal: a sequence's
  queries are its last positions, so decode rows and prefill rows over a cached prefix mix in one bias);
- a sliding-window group (or a row whose leading blocks were released) uses the gappy paged biases, whose
  per-sequence key start expresses both the window and the released blocks. A start is per sequence, not per
  query, so the queries of one row that see different windows become separate bias rows ("pieces") over the same
  block-table row; see :func:`build_attn_bias`.

Op selection (``P`` = ``metadata.block_size``; rows = sequences with new tokens), see :func:`plan_steps`:

1. ``softcap`` given: the torch backend for the whole forward (xformers has no softcapping).
2. Every row has the same query length ``L <= 16`` (decode, or short speculative rows) and ``P % 64 == 0``:
   ``triton_splitk`` over the pool, one launch (its causal mode needs equal query lengths ``<= 16``; in a
   sliding group with ``L > 1`` every query becomes its own non-causal piece).
3. Full attention (no window, no released block), ``P % 256 == 0`` and the ``flash_attn`` package installed:
   ``flash_paged`` (FA2 with a block table), one launch for any mix of decode and prefill.
4. Otherwise the batch is split: decode rows (one query each) run on ``triton_splitk`` when ``P % 64 == 0``;
   the other rows (all rows when ``P % 64 != 0``) are a "gather" step: their visible keys are gathered into a
   contiguous buffer and a non-paged bottom-right causal bias (local, in a sliding group) runs on ``flash``, or
   else ``cutlass``.

xformers' dispatcher is never used: it tries FA2 first, which fails at run time on small pages. Each step's op is
checked against xformers' own ``not_supported_reasons`` the first time a metadata meets a tensor shape and dtype:
a paged step no kernel accepts (head dim, GPU generation) runs as a gather step, and a gather step no kernel
accepts runs on the torch backend. ``XFormersPagedAttention.last_ops`` names what the last forward ran.

xformers is imported lazily, so importing this module never fails on a machine without it; the plugin hook only
offers the backend for CUDA tensors in fp16/bf16 when a small xformers call has run on the GPU.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from pagedcore.attention import AttentionBackend, PagedAttentionMetadata
from pagedcore.hookspecs import hookimpl
from pagedcore.plugins.torch_backend import TorchPagedAttention

logger = logging.getLogger(__name__)

__all__ = [
    "AttentionKernels",
    "GatheredKeys",
    "Step",
    "XFormersKernels",
    "XFormersPagedAttention",
    "build_attn_bias",
    "build_gathered_keys",
    "pagedcore_attention_backend",
    "plan_steps",
    "xformers_available",
]

SPLITK_PAGE_MULTIPLE = 64  # triton_splitk reads pages in BLOCK_N = 64 key tiles
SPLITK_MAX_CAUSAL_QUERIES = 16  # triton_splitk's causal mode: equal query lengths, at most its smallest BLOCK_M
FLASH_PAGE_MULTIPLE = 256  # FA2 with a block table needs pages of a multiple of 256 (not checked by xformers)

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_XFORMERS_OP_MODULE = {"triton_splitk": "triton_splitk", "flash_paged": "flash", "flash": "flash", "cutlass": "cutlass"}
_GATHER_OPS = ("flash", "cutlass")


# ---------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Step:
    """One kernel launch of a forward.

    Attributes:
        op: ``"triton_splitk"`` or ``"flash_paged"`` (paged, over the pool) or ``"gather"`` (contiguous keys).
        rows: the metadata rows (sequences) this step computes.
        per_query: build the paged bias with one piece per query (see :func:`build_attn_bias`).

    Example:
        >>> meta = PagedAttentionMetadata.build(block_size=64, query_lens=[1, 1], seq_lens=[70, 9],
        ...     block_offsets=[0, 0], tables=[[0, 1], [2]], slots=[[69], [136]], sliding_window=None, pad_block=3)
        >>> [(step.op, step.rows) for step in plan_steps(meta, flash_paged=False)]
        [('triton_splitk', (0, 1))]
    """

    op: str
    rows: tuple[int, ...]
    per_query: bool = False


def plan_steps(metadata: PagedAttentionMetadata, *, flash_paged: bool) -> list[Step]:
    """The steps a forward over ``metadata`` runs, by the rule in the module docstring.

    Args:
        metadata: the forward's metadata (one KV group).
        flash_paged: whether FA2's paged kernel may be used (the ``flash_attn`` package is installed).

    Example:
        >>> meta = PagedAttentionMetadata.build(block_size=64, query_lens=[1, 5], seq_lens=[70, 5],
        ...     block_offsets=[0, 0], tables=[[3, 5], [1]], slots=[[325], [64, 65, 66, 67, 68]],
        ...     sliding_window=None, pad_block=8)
        >>> [(s.op, s.rows) for s in plan_steps(meta, flash_paged=False)]
        [('triton_splitk', (0,)), ('gather', (1,))]
    """
    rows = _rows_with_queries(metadata)
    if not rows:
        return []
    page = metadata.block_size
    gappy = _is_gappy(metadata, rows)
    query_lens = {metadata.query_lens[i] for i in rows}
    splitk = page % SPLITK_PAGE_MULTIPLE == 0
    if splitk and len(query_lens) == 1 and max(query_lens) <= SPLITK_MAX_CAUSAL_QUERIES:
        return [Step("triton_splitk", tuple(rows), per_query=gappy and max(query_lens) > 1)]
    if flash_paged and not gappy and page % FLASH_PAGE_MULTIPLE == 0:
        return [Step("flash_paged", tuple(rows))]
    decode = tuple(i for i in rows if metadata.query_lens[i] == 1)
    if splitk and decode:
        prefill = tuple(i for i in rows if metadata.query_lens[i] > 1)
        return [Step("triton_splitk", decode), Step("gather", prefill)]
    return [Step("gather", tuple(rows))]


# ---------------------------------------------------------------- biases
@dataclass(frozen=True)
class _Piece:
    row: int  # metadata row whose block-table row the piece reads
    num_queries: int  # consecutive queries of the row, the last of them at position key_end - 1 (row-local)
    key_start: int  # row-local key positions [key_start, key_end); row-local 0 = the row's first live block
    key_end: int


def build_attn_bias(metadata: PagedAttentionMetadata, device: torch.device | str, *, per_query: bool = False) -> Any:
    """The xformers paged attention bias that computes ``metadata``'s attention over the pool (cached per device).

    Rows without queries are left out; the bias's queries are the packed queries in order.

    - Full attention, no released block: ``PagedBlockDiagonalCausalWithOffsetPaddedKeysMask``, one bias row per
      sequence, keys ``0 .. seq_len - 1``, causal from the bottom right.
    - A sliding window or released leading blocks: ``PagedBlockDiagonalCausalWithOffsetGappyKeysMask``, whose rows
      start at a key offset inside the block-table row (whose column 0 is logical block ``block_offsets[i]``).
      The queries of a row that all reach back to its first live key share one causal piece; each later query
      (whose window starts after that key) is its own one-query piece reading the same block-table row.
    - ``per_query=True``: ``PagedBlockDiagonalGappyKeysMask`` (not causal) with one piece per query, each with
      its exact key range; every piece has one query, which ``triton_splitk`` accepts in any batch.

    Args:
        metadata: the forward's metadata (one KV group).
        device: where the bias's tensors live (the queries' device).
        per_query: one piece per query, as above.

    Returns:
        An ``xformers.ops.fmha.attn_bias`` paged bias; ``.materialize`` turns it into a dense mask (see the tests).

    Example:
        >>> meta = PagedAttentionMetadata.build(block_size=4, query_lens=[1, 3], seq_lens=[6, 7],
        ...     block_offsets=[0, 0], tables=[[3, 5], [1, 0]], slots=[[21], [0, 1, 2]],
        ...     sliding_window=None, pad_block=8)
        >>> bias = build_attn_bias(meta, "cpu")
        >>> type(bias).__name__, bias.k_seqinfo.seqlen_py
        ('PagedBlockDiagonalCausalWithOffsetPaddedKeysMask', [6, 7])
    """
    device = torch.device(device)
    key = ("xformers.paged_bias", device, per_query)
    cached = metadata.backend_state.get(key)
    if cached is not None:
        return cached
    from xformers.ops.fmha import attn_bias as xb

    rows = _rows_with_queries(metadata)
    if not rows:
        raise ValueError("build_attn_bias: no sequence in the metadata has queries")
    pieces = _pieces(metadata, rows, per_query)
    width = min(metadata.block_tables.shape[1], max(_num_live_blocks(metadata, i) for i in rows))
    piece_rows = torch.tensor([p.row for p in pieces], device=metadata.block_tables.device)
    tables = metadata.block_tables[:, :width].index_select(0, piece_rows).to(device)  # int32 (pieces, width)
    q_lens = [p.num_queries for p in pieces]
    if per_query or _is_gappy(metadata, rows):
        # xformers 0.0.35's Paged*GappyKeysMask.from_seqlens rejects every input (it wants as many key starts as
        # lengths, then one more), so the gappy bias is built unpaged, each piece in its own notional row of
        # width * page_size keys, and made paged by make_paged, which subtracts the notional row starts again.
        if per_query:
            unpaged_cls, paged_cls = xb.BlockDiagonalGappyKeysMask, xb.PagedBlockDiagonalGappyKeysMask
        else:
            unpaged_cls = xb.BlockDiagonalCausalWithOffsetGappyKeysMask
            paged_cls = xb.PagedBlockDiagonalCausalWithOffsetGappyKeysMask
        row_width = width * metadata.block_size
        unpaged = unpaged_cls.from_seqlens(
            q_seqlen=q_lens,
            kv_seqstarts=[n * row_width + p.key_start for n, p in enumerate(pieces)] + [len(pieces) * row_width],
            kv_seqlen=[p.key_end - p.key_start for p in pieces],
            device=device,
        )
        bias = unpaged.make_paged(tables, metadata.block_size, row_width, paged_cls)
    else:
        bias = xb.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
            q_seqlen=q_lens,
            kv_seqlen=[p.key_end for p in pieces],
            block_tables=tables,
            page_size=metadata.block_size,
            device=device,
        )
    metadata.backend_state[key] = bias
    return bias


@dataclass(frozen=True)
class GatheredKeys:
    """Keys gathered out of the pool for a non-paged kernel.

    Attributes:
        slots: ``int64 (num_keys,)``: the pool slot of each gathered key, sequence after sequence; each sequence's
            keys are the contiguous positions from the first one any of its queries sees to ``seq_len - 1``.
        bias: ``BlockDiagonalCausalFromBottomRightMask`` over the packed queries and gathered keys, or
            ``BlockDiagonalCausalLocalAttentionFromBottomRightMask`` (the window) in a sliding group.

    Example:
        >>> meta = PagedAttentionMetadata.build(block_size=4, query_lens=[2], seq_lens=[6], block_offsets=[0],
        ...     tables=[[3, 1]], slots=[[5, 6]], sliding_window=None, pad_block=4)
        >>> build_gathered_keys(meta, "cpu").slots.tolist()  # doctest: +SKIP
        [12, 13, 14, 15, 4, 5]
    """

    slots: torch.Tensor
    bias: Any


def build_gathered_keys(metadata: PagedAttentionMetadata, device: torch.device | str) -> GatheredKeys:
    """The keys to gather and the non-paged bias for ``metadata``'s rows with queries (cached per device).

    Example:
        >>> meta = PagedAttentionMetadata.build(block_size=4, query_lens=[2], seq_lens=[10], block_offsets=[1],
        ...     tables=[[5, 2]], slots=[[8, 9]], sliding_window=3, pad_block=8)
        >>> gathered = build_gathered_keys(meta, "cpu")  # keys 6..9: block 1 (physical 5) and block 2 (physical 2)
        >>> gathered.slots.tolist(), type(gathered.bias).__name__
        ([22, 23, 8, 9], 'BlockDiagonalCausalLocalAttentionFromBottomRightMask')
    """
    device = torch.device(device)
    key = ("xformers.gathered", device)
    cached = metadata.backend_state.get(key)
    if cached is not None:
        return cached
    from xformers.ops.fmha import attn_bias as xb

    rows = _rows_with_queries(metadata)
    if not rows:
        raise ValueError("build_gathered_keys: no sequence in the metadata has queries")
    bs = metadata.block_size
    firsts = [_first_key(metadata, i, metadata.seq_lens[i] - metadata.query_lens[i]) for i in rows]
    kv_lens = [metadata.seq_lens[i] - first for i, first in zip(rows, firsts)]
    # Each gathered key's position, and the block-table cell that holds it (looked up on the tables' device).
    position = torch.cat([torch.arange(first, metadata.seq_lens[i]) for i, first in zip(rows, firsts)])
    row_of = torch.repeat_interleave(torch.tensor(rows), torch.tensor(kv_lens))  # (num_keys,)
    column = position // bs - torch.tensor(metadata.block_offsets)[row_of]
    tables_device = metadata.block_tables.device
    blocks = metadata.block_tables[row_of.to(tables_device), column.to(tables_device)].to(device, torch.int64)
    slots = blocks * bs + (position % bs).to(device)
    mask = xb.BlockDiagonalMask.from_seqlens([metadata.query_lens[i] for i in rows], kv_lens, device=device)
    if metadata.sliding_window is None:
        bias = mask.make_causal_from_bottomright()
    else:
        bias = mask.make_local_attention_from_bottomright(metadata.sliding_window)
    gathered = GatheredKeys(slots, bias)
    metadata.backend_state[key] = gathered
    return gathered


def _rows_with_queries(meta: PagedAttentionMetadata) -> list[int]:
    return [i for i, n in enumerate(meta.query_lens) if n > 0]


def _is_gappy(meta: PagedAttentionMetadata, rows: list[int]) -> bool:
    return meta.sliding_window is not None or any(meta.block_offsets[i] > 0 for i in rows)


def _num_live_blocks(meta: PagedAttentionMetadata, i: int) -> int:
    return -(-meta.seq_lens[i] // meta.block_size) - meta.block_offsets[i]


def _first_key(meta: PagedAttentionMetadata, i: int, position: int) -> int:
    """The first key position the query at ``position`` of row ``i`` sees (never one in a released block)."""
    live = meta.block_offsets[i] * meta.block_size
    if meta.sliding_window is None:
        return live
    return max(live, position - meta.sliding_window + 1)


def _pieces(meta: PagedAttentionMetadata, rows: list[int], per_query: bool) -> list[_Piece]:
    pieces = []
    for i in rows:
        seq_len = meta.seq_lens[i]
        first_query = seq_len - meta.query_lens[i]
        live = meta.block_offsets[i] * meta.block_size
        if per_query:
            shared = 0
        elif meta.sliding_window is None:
            shared = meta.query_lens[i]
        else:  # queries at positions < live + window all see keys from `live` on
            shared = max(0, min(seq_len, live + meta.sliding_window) - first_query)
        if shared:
            pieces.append(_Piece(i, shared, 0, first_query + shared - live))
        for position in range(first_query + shared, seq_len):
            pieces.append(_Piece(i, 1, _first_key(meta, i, position) - live, position + 1 - live))
    return pieces


# ---------------------------------------------------------------- kernels
@runtime_checkable
class AttentionKernels(Protocol):
    """Runs one xformers op (``"triton_splitk"``, ``"flash"``, ``"cutlass"``) on prepared inputs.

    Queries are ``[1, T, Hq, D]`` or ``[1, T, Hkv, Hq // Hkv, D]``, keys and values the same layout over the pool or
    the gathered keys; the result has the queries' shape with the values' head dim. Injected into
    :class:`XFormersPagedAttention` so that tests can run the whole plan on CPU against a dense reference.

    Example:
        >>> isinstance(XFormersKernels(), AttentionKernels)
        True
    """

    def supports(
        self, op: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Any, scale: float
    ) -> bool:
        """Whether ``op`` accepts these inputs."""
        ...

    def run(
        self, op: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Any, scale: float
    ) -> torch.Tensor:
        """``op``'s attention output."""
        ...


class XFormersKernels:
    """The real kernels: ``xformers.ops.fmha.memory_efficient_attention_forward`` with an explicit ``op``.

    Example:
        >>> backend = XFormersPagedAttention(XFormersKernels())  # what the plugin hook returns on a GPU
        >>> backend.name
        'xformers'
    """

    def supports(
        self, op: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Any, scale: float
    ) -> bool:
        from xformers.ops import fmha

        try:
            fw_op = _xformers_op(op)
        except ImportError as exc:
            logger.debug("pagedcore: xformers op %s cannot be imported: %s", op, exc)
            return False
        inputs = fmha.Inputs(query=query, key=key, value=value, attn_bias=bias, scale=scale)
        reasons = fw_op.not_supported_reasons(inputs)
        if reasons:
            logger.debug("pagedcore: xformers op %s declines %s: %s", op, type(bias).__name__, "; ".join(reasons))
        return not reasons

    def run(
        self, op: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Any, scale: float
    ) -> torch.Tensor:
        from xformers.ops import fmha

        out: torch.Tensor = fmha.memory_efficient_attention_forward(
            query, key, value, attn_bias=bias, scale=scale, op=_xformers_op(op)
        )
        return out


def _xformers_op(op: str) -> Any:
    return importlib.import_module(f"xformers.ops.fmha.{op}").FwOp


# ---------------------------------------------------------------- the backend
@dataclass
class _Prepared:
    step: Step
    meta: PagedAttentionMetadata  # the step's rows only (the forward's own metadata when the step has every row)
    token_index: torch.Tensor | None  # packed positions of the step's queries; None = all of them, in order
    resolved: dict[tuple[Any, ...], str] = field(default_factory=dict)  # (dtype, shapes) -> op that runs


class XFormersPagedAttention:
    """Paged attention with xformers' kernels (CUDA, fp16/bf16); same results as the torch backend.

    Args:
        kernels: what runs an xformers op (default :class:`XFormersKernels`; tests pass a dense CPU reference).
        flash_paged: allow FA2's paged kernel; default: whether the ``flash_attn`` package is installed.

    Attributes:
        last_ops: the ops the last forward ran, one per step: ``"triton_splitk"``, ``"flash_paged"``, ``"flash"``,
            ``"cutlass"`` or ``"torch"`` (diagnostics; not synchronised between threads).

    Example (needs a GPU):
        >>> backend = XFormersPagedAttention()  # doctest: +SKIP
        >>> out = backend.forward(query, key_cache, value_cache, meta, scale=head_dim**-0.5)  # doctest: +SKIP
        >>> backend.last_ops  # doctest: +SKIP
        ('triton_splitk',)
    """

    name = "xformers"

    def __init__(self, kernels: AttentionKernels | None = None, *, flash_paged: bool | None = None) -> None:
        self.kernels: AttentionKernels = kernels if kernels is not None else XFormersKernels()
        self._flash_paged = flash_paged
        self._torch = TorchPagedAttention()
        self.last_ops: tuple[str, ...] = ()

    @property
    def flash_paged(self) -> bool:
        """Whether FA2's paged kernel may be planned."""
        return _flash_attn_installed() if self._flash_paged is None else self._flash_paged

    def plan(self, metadata: PagedAttentionMetadata) -> list[Step]:
        """The steps a forward over ``metadata`` runs (before each op's support check)."""
        return plan_steps(metadata, flash_paged=self.flash_paged)

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: PagedAttentionMetadata,
        *,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if softcap is not None:
            self.last_ops = ("torch",)
            return self._torch.forward(query, key_cache, value_cache, metadata, scale=scale, softcap=softcap)
        num_tokens, q_heads, _ = query.shape
        if num_tokens != metadata.num_tokens:
            raise ValueError(f"query has {num_tokens} tokens but the metadata has {metadata.num_tokens}")
        out: torch.Tensor | None = None
        ops = []
        for prepared in self._prepare(metadata, query.device):
            if prepared.token_index is None:
                out, op = self._run(prepared, query, key_cache, value_cache, scale)
            else:
                o, op = self._run(prepared, query.index_select(0, prepared.token_index), key_cache, value_cache, scale)
                if out is None:
                    out = query.new_zeros(num_tokens, q_heads, value_cache.shape[-1])
                out.index_copy_(0, prepared.token_index, o)
            ops.append(op)
        self.last_ops = tuple(ops)
        return query.new_zeros(0, q_heads, value_cache.shape[-1]) if out is None else out

    def _prepare(self, meta: PagedAttentionMetadata, device: torch.device) -> list[_Prepared]:
        key = ("xformers.plan", device, self.flash_paged)
        cached = meta.backend_state.get(key)
        if cached is None:
            every = _rows_with_queries(meta)
            cached = []
            for step in self.plan(meta):
                if list(step.rows) == every:
                    cached.append(_Prepared(step, meta, None))
                else:
                    sub, index = _select_rows(meta, list(step.rows))
                    cached.append(_Prepared(step, sub, index.to(device)))
            meta.backend_state[key] = cached
        return cached

    def _run(
        self,
        prepared: _Prepared,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, str]:
        num_tokens, q_heads, _ = query.shape
        q = _split_heads(query, key_cache.shape[2])
        shapes = (query.dtype, query.shape[1:], key_cache.shape, value_cache.shape)
        op = prepared.resolved.get(shapes)
        paged = prepared.step.op
        if paged != "gather" and op in (None, paged):
            bias = build_attn_bias(prepared.meta, query.device, per_query=prepared.step.per_query)
            k, v = _pool_view(key_cache, q_heads), _pool_view(value_cache, q_heads)
            if op is None and self.kernels.supports(_XFORMERS_OP_MODULE[paged], q, k, v, bias, scale):
                op = prepared.resolved[shapes] = paged
            if op == paged:
                out = self.kernels.run(_XFORMERS_OP_MODULE[paged], q, k, v, bias, scale)
                return out.reshape(num_tokens, q_heads, -1), op
        if op != "torch":
            gathered = build_gathered_keys(prepared.meta, query.device)
            k = _gathered_view(key_cache, gathered.slots, q_heads)
            v = _gathered_view(value_cache, gathered.slots, q_heads)
            if op is None:
                usable = (o for o in _GATHER_OPS if self.kernels.supports(o, q, k, v, gathered.bias, scale))
                op = prepared.resolved[shapes] = next(usable, "torch")
            if op != "torch":
                out = self.kernels.run(op, q, k, v, gathered.bias, scale)
                return out.reshape(num_tokens, q_heads, -1), op
        return self._torch.forward(query, key_cache, value_cache, prepared.meta, scale=scale), "torch"


def _select_rows(meta: PagedAttentionMetadata, rows: list[int]) -> tuple[PagedAttentionMetadata, torch.Tensor]:
    """Metadata for ``rows`` only, and the packed positions of their queries."""
    starts = meta.query_start_loc
    token_index = torch.tensor([t for i in rows for t in range(starts[i], starts[i + 1])], dtype=torch.long)
    width = min(meta.block_tables.shape[1], max(_num_live_blocks(meta, i) for i in rows))
    row_index = torch.tensor(rows, device=meta.block_tables.device)
    sub = PagedAttentionMetadata(
        block_size=meta.block_size,
        query_lens=[meta.query_lens[i] for i in rows],
        seq_lens=[meta.seq_lens[i] for i in rows],
        block_offsets=[meta.block_offsets[i] for i in rows],
        block_tables=meta.block_tables[:, :width].index_select(0, row_index),
        slot_mapping=meta.slot_mapping[token_index.to(meta.slot_mapping.device)],
        sliding_window=meta.sliding_window,
        pad_block=meta.pad_block,
    )
    return sub, token_index


def _split_heads(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(T, Hq, D)`` -> ``[1, T, Hq, D]``, or ``[1, T, Hkv, Hq // Hkv, D]`` with GQA (query head h uses h // R)."""
    num_tokens, q_heads, dim = query.shape
    if q_heads == kv_heads:
        return query.unsqueeze(0)
    return query.reshape(1, num_tokens, kv_heads, q_heads // kv_heads, dim)


def _expand_heads(kv: torch.Tensor, q_heads: int) -> torch.Tensor:
    """``[1, L, Hkv, D]`` -> itself, or with GQA ``[1, L, Hkv, Hq // Hkv, D]`` expanded at stride 0 (no copy)."""
    _, length, kv_heads, dim = kv.shape
    if q_heads == kv_heads:
        return kv
    return kv.unsqueeze(3).expand(1, length, kv_heads, q_heads // kv_heads, dim)


def _pool_view(cache: torch.Tensor, q_heads: int) -> torch.Tensor:
    num_blocks, block_size, kv_heads, dim = cache.shape
    return _expand_heads(cache.view(1, num_blocks * block_size, kv_heads, dim), q_heads)  # (1, slots, Hkv[, R], D)


def _gathered_view(cache: torch.Tensor, slots: torch.Tensor, q_heads: int) -> torch.Tensor:
    kv_heads, dim = cache.shape[2:]
    return _expand_heads(cache.view(-1, kv_heads, dim).index_select(0, slots).unsqueeze(0), q_heads)


# ---------------------------------------------------------------- availability and the hook
@functools.cache
def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


@functools.cache
def xformers_available() -> bool:
    """Whether CUDA is present and xformers' kernels run on it (checked once, with a tiny attention call).

    Example:
        >>> xformers_available() if not torch.cuda.is_available() else False
        False
    """
    if not torch.cuda.is_available():
        return False
    try:
        from xformers.ops import fmha

        probe = torch.zeros(1, 2, 1, 64, device="cuda", dtype=torch.float16)
        fmha.memory_efficient_attention_forward(probe, probe, probe)
    except Exception as exc:
        logger.info("pagedcore: the xformers backend is unavailable: %s", exc)
        return False
    return True


_BACKEND = XFormersPagedAttention()


@hookimpl(trylast=True)
def pagedcore_attention_backend(device_type: str, dtype: Any, name: str | None) -> AttentionBackend | None:
    """The xformers backend for CUDA tensors in fp16/bf16 when xformers' kernels work; otherwise None.

    Example:
        >>> pagedcore_attention_backend(device_type="cpu", dtype=torch.float16, name=None) is None
        True
    """
    if name not in (None, "xformers") or device_type != "cuda" or dtype not in _HALF_DTYPES:
        return None
    if not xformers_available():
        return None
    return _BACKEND
