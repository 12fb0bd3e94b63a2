"""The tensors a forward hands xformers' kernels: attention biases, gathered-key slots, query indices.

Everything is derived on the host, from the metadata's host block tables and plain lists, and copied to the device
with :func:`pagedcore.attention.to_device` (pinned memory, no wait for the GPU): building them never stalls the
queue of kernels the previous layers launched. :func:`prepare_steps` builds all of a forward's tensors once; every
layer of the KV group reuses them.

Layout: queries are packed ``[1, num_tokens, Hq, D]``; the pool ``(num_blocks + 1, P, Hkv, D)`` is seen as
``[1, (num_blocks + 1) * P, Hkv, D]``; with GQA both become 5-D ``[1, L, Hkv, Hq // Hkv, D]``, the pool's
heads-per-group dim expanded at stride 0, so no key or value is copied. xformers' paged biases:

- full attention uses ``PagedBlockDiagonalCausalWithOffsetPaddedKeysMask`` (bottom-right causal: a sequence's
  queries are its last positions, so decode rows and prefill rows over a cached prefix mix in one bias);
- a sliding-window or chunked group (or a row whose leading blocks were released) uses the gappy paged biases,
  whose per-sequence key start expresses the window, the chunk and the released blocks (see :func:`~.plan.pieces`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedcore.attention import PagedAttentionMetadata, to_device

from .plan import (
    MIN_ROWS,
    MIN_WIDTH,
    Piece,
    Step,
    bucket,
    first_key,
    is_gappy,
    num_live_blocks,
    pieces,
    rows_with_queries,
    segments,
)
from .runtime import import_xformers

__all__ = ["GatheredKeys", "PreparedStep", "build_attn_bias", "build_gathered_keys", "prepare_steps"]


def build_attn_bias(
    metadata: PagedAttentionMetadata,
    device: torch.device | str,
    *,
    rows: list[int] | None = None,
    per_query: bool = False,
    pad: bool = False,
) -> Any:
    """The xformers paged attention bias that computes ``rows``' attention over the pool.

    - Full attention, no released block: ``PagedBlockDiagonalCausalWithOffsetPaddedKeysMask``, one bias row per
      sequence, keys ``0 .. seq_len - 1``, causal from the bottom right.
    - A sliding window or released leading blocks: ``PagedBlockDiagonalCausalWithOffsetGappyKeysMask``, whose rows
      start at a key offset inside the block-table row (whose column 0 is logical block ``block_offsets[i]``).
    - ``per_query=True``: ``PagedBlockDiagonalGappyKeysMask`` (not causal) with one piece per query, each with
      its exact key range; every piece has one query, which ``triton_splitk`` accepts in any batch.

    Args:
        metadata: the forward's metadata (one KV group).
        device: where the bias's tensors live (the queries' device).
        rows: the metadata rows to compute (default: every row with queries).
        per_query: one piece per query, as above.
        pad: pad the bias rows and the table width to their buckets (:func:`~.plan.bucket`): the extra rows, after
            the real ones, each hold as many queries as a real piece and attend to the zero pad block. The padded
            query count is ``bias.q_seqinfo.seqstart_py[-1]``.

    Returns:
        An ``xformers.ops.fmha.attn_bias`` paged bias; ``.materialize`` turns it into a dense mask (see the tests).

    Example:
        >>> meta = PagedAttentionMetadata.build(block_size=4, query_lens=[1, 3], seq_lens=[6, 7],
        ...     block_offsets=[0, 0], tables=[[3, 5], [1, 0]], slots=[[21], [0, 1, 2]],
        ...     sliding_window=None, pad_block=8)
        >>> bias = build_attn_bias(meta, "cpu")
        >>> type(bias).__name__, bias.k_seqinfo.seqlen_py
        ('PagedBlockDiagonalCausalWithOffsetPaddedKeysMask', [6, 7])
        >>> decode = PagedAttentionMetadata.build(block_size=4, query_lens=[1, 1], seq_lens=[6, 7],
        ...     block_offsets=[0, 0], tables=[[3, 5], [1, 0]], slots=[[21], [2]], sliding_window=None, pad_block=8)
        >>> padded = build_attn_bias(decode, "cpu", pad=True)   # 2 rows -> 8, width 2 -> 4 pages
        >>> padded.k_seqinfo.seqlen_py, tuple(padded.block_tables.shape)
        ([6, 7, 1, 1, 1, 1, 1, 1], (8, 4))
    """
    xb = import_xformers("xformers.ops.fmha.attn_bias")
    device = torch.device(device)
    rows = rows_with_queries(metadata) if rows is None else rows
    if not rows:
        raise ValueError("build_attn_bias: no sequence in the metadata has queries")
    parts = pieces(metadata, rows, per_query)
    num_real = len(parts)
    width = max(num_live_blocks(metadata, p.row) for p in parts)
    num_rows = num_real
    if pad:
        num_rows, width = bucket(num_real, MIN_ROWS), bucket(width, MIN_WIDTH)
    spans = _Spans.of(parts, num_rows, width * metadata.block_size)
    block_tables = to_device(_bias_tables(metadata, [p.row for p in parts], num_rows, width), device)
    if per_query or is_gappy(metadata, rows):
        return _gappy_bias(xb, spans, block_tables, metadata.block_size, per_query, device)
    bias_cls = xb.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask
    return bias_cls.from_seqlens(spans.q_lens, spans.ends, block_tables, metadata.block_size, device=device)


def _bias_tables(metadata: PagedAttentionMetadata, rows: list[int], num_rows: int, width: int) -> torch.Tensor:
    """The bias's block tables on the host: ``rows``' host tables cut or padded to ``width`` pages, then padding
    rows (``num_rows`` in all) of the pad block."""
    host = metadata.host_tables
    columns = min(width, host.shape[1])
    tables = torch.full((num_rows, width), metadata.pad_block, dtype=torch.int32)  # (bias rows, pages)
    tables[: len(rows), :columns] = host.index_select(0, torch.tensor(rows))[:, :columns]
    return tables


@dataclass(frozen=True)
class _Spans:
    """Each bias row's query count and key range, and the width of a notional unpaged row in keys."""

    q_lens: list[int]
    starts: list[int]
    ends: list[int]
    row_width: int

    @staticmethod
    def of(parts: list[Piece], num_rows: int, row_width: int) -> _Spans:
        """The real pieces' spans, then padding rows up to ``num_rows``: each holds as many queries as a real
        piece (a padded launch has pieces of one query length, see ``plan_steps``) and sees the zero pad block."""
        pad, extra = parts[0].num_queries, num_rows - len(parts)
        return _Spans(
            q_lens=[p.num_queries for p in parts] + [pad] * extra,
            starts=[p.key_start for p in parts] + [0] * extra,
            ends=[p.key_end for p in parts] + [pad] * extra,
            row_width=row_width,
        )


def _gappy_bias(
    xb: Any, spans: _Spans, block_tables: torch.Tensor, block_size: int, per_query: bool, device: torch.device
) -> Any:
    """A paged gappy bias (per-query pieces, or causal rows whose keys start inside the table row).

    xformers 0.0.35's ``Paged*GappyKeysMask.from_seqlens`` rejects every input (it wants as many key starts as
    lengths, then one more), so the bias is built unpaged, each piece in its own notional row of ``row_width``
    keys, and made paged by ``make_paged``, which subtracts the notional row starts again."""
    if per_query:
        unpaged_cls, paged_cls = xb.BlockDiagonalGappyKeysMask, xb.PagedBlockDiagonalGappyKeysMask
    else:
        unpaged_cls = xb.BlockDiagonalCausalWithOffsetGappyKeysMask
        paged_cls = xb.PagedBlockDiagonalCausalWithOffsetGappyKeysMask
    num_rows = len(spans.q_lens)
    unpaged = unpaged_cls.from_seqlens(
        q_seqlen=spans.q_lens,
        kv_seqstarts=[n * spans.row_width + s for n, s in enumerate(spans.starts)] + [num_rows * spans.row_width],
        kv_seqlen=[e - s for s, e in zip(spans.starts, spans.ends)],
        device=device,
    )
    return unpaged.make_paged(block_tables, block_size, spans.row_width, paged_cls)


@dataclass(frozen=True)
class GatheredKeys:
    """Keys gathered out of the pool for a non-paged kernel.

    Attributes:
        slots: ``int64 (num_keys,)``: the pool slot of each gathered key, sequence after sequence; each sequence's
            keys are the contiguous positions from the first one any of its queries sees to ``seq_len - 1`` (in a
            chunked group, once per chunk its queries fall in: that chunk's keys up to its last query).
        bias: ``BlockDiagonalCausalFromBottomRightMask`` over the packed queries and gathered keys, or
            ``BlockDiagonalCausalLocalAttentionFromBottomRightMask`` (the window) in a sliding group.

    Example:
        >>> meta = PagedAttentionMetadata.build(block_size=4, query_lens=[2], seq_lens=[6], block_offsets=[0],
        ...     tables=[[3, 1]], slots=[[5, 6]], sliding_window=None, pad_block=4)
        >>> build_gathered_keys(meta, "cpu").slots.tolist()
        [12, 13, 14, 15, 4, 5]
    """

    slots: torch.Tensor
    bias: Any


def build_gathered_keys(
    metadata: PagedAttentionMetadata, device: torch.device | str, *, rows: list[int] | None = None
) -> GatheredKeys:
    """The keys to gather and the non-paged bias for ``rows`` (default: every row with queries).

    Example:
        >>> meta = PagedAttentionMetadata.build(block_size=4, query_lens=[2], seq_lens=[10], block_offsets=[1],
        ...     tables=[[5, 2]], slots=[[8, 9]], sliding_window=3, pad_block=8)
        >>> gathered = build_gathered_keys(meta, "cpu")  # keys 6..9: block 1 (physical 5) and block 2 (physical 2)
        >>> gathered.slots.tolist(), type(gathered.bias).__name__
        ([22, 23, 8, 9], 'BlockDiagonalCausalLocalAttentionFromBottomRightMask')
    """
    xb = import_xformers("xformers.ops.fmha.attn_bias")
    device = torch.device(device)
    rows = rows_with_queries(metadata) if rows is None else rows
    if not rows:
        raise ValueError("build_gathered_keys: no sequence in the metadata has queries")
    bs = metadata.block_size
    # One run of keys per query segment (a row; a chunk of a row in a chunked group): its first key to its last query.
    runs = [(i, first_key(metadata, i, start), start + count, count) for i in rows for start, count in segments(
        metadata, i)]  # fmt: skip
    kv_lens = [end - first for _, first, end, _ in runs]
    # Each gathered key's position, and the block-table cell that holds it (looked up in the host tables).
    position = torch.cat([torch.arange(first, end) for _, first, end, _ in runs])
    row_of = torch.repeat_interleave(torch.tensor([i for i, *_ in runs]), torch.tensor(kv_lens))  # (num_keys,)
    column = position // bs - torch.tensor(metadata.block_offsets)[row_of]
    blocks = metadata.host_tables[row_of, column].to(torch.int64)
    slots = to_device(blocks * bs + position % bs, device)
    mask = xb.BlockDiagonalMask.from_seqlens([count for *_, count in runs], kv_lens, device=device)
    if metadata.sliding_window is None:
        bias = mask.make_causal_from_bottomright()
    else:
        bias = mask.make_local_attention_from_bottomright(metadata.sliding_window)
    return GatheredKeys(slots, bias)


@dataclass
class PreparedStep:
    """One step of a forward with its device tensors, built once and shared by every layer of the KV group.

    Attributes:
        step: the planned step.
        bias: the paged bias (a paged step) or the gathered keys' bias (a gather step).
        num_queries: the step's real queries.
        token_index: ``int64`` packed positions of the step's queries on the device; None = all of them, in order.
        gathered: the gathered keys (a gather step; for a paged step built on first need, when no paged kernel
            takes its inputs).
        resolved: per query dtype and shapes, the op that runs this step (filled by the backend).

    Example:
        >>> meta = PagedAttentionMetadata.build(block_size=64, query_lens=[1, 5], seq_lens=[70, 5],
        ...     block_offsets=[0, 0], tables=[[3, 5], [1]], slots=[[325], [64, 65, 66, 67, 68]],
        ...     sliding_window=None, pad_block=8)
        >>> from pagedcore.plugins.xformers.plan import plan_steps
        >>> [(p.step.op, p.num_queries, p.padded_queries) for p in prepare_steps(meta, plan_steps(meta,
        ...     flash_paged=False), "cpu")]
        [('triton_splitk', 1, 8), ('gather', 5, 5)]
    """

    step: Step
    bias: Any
    num_queries: int
    token_index: torch.Tensor | None
    gathered: GatheredKeys | None = None
    resolved: dict[tuple[Any, ...], str] = field(default_factory=dict)

    @property
    def padded_queries(self) -> int:
        """Queries the bias holds: ``num_queries`` plus the bucket padding of a paged launch."""
        return int(self.bias.q_seqinfo.seqstart_py[-1])


def prepare_steps(
    metadata: PagedAttentionMetadata, steps: list[Step], device: torch.device | str
) -> list[PreparedStep]:
    """The device tensors of every step: ``triton_splitk`` steps padded to their buckets, the others exact.

    Example:
        >>> meta = PagedAttentionMetadata.build(block_size=64, query_lens=[1, 5], seq_lens=[70, 5],
        ...     block_offsets=[0, 0], tables=[[3, 5], [1]], slots=[[325], [64, 65, 66, 67, 68]],
        ...     sliding_window=None, pad_block=8)
        >>> steps = prepare_steps(meta, [Step("triton_splitk", (0,)), Step("gather", (1,))], "cpu")
        >>> [s.token_index.tolist() for s in steps], steps[1].gathered.slots.tolist()
        ([[0], [1, 2, 3, 4, 5]], [64, 65, 66, 67, 68])
    """
    device = torch.device(device)
    every = rows_with_queries(metadata)
    starts = metadata.query_start_loc
    out = []
    for step in steps:
        rows = list(step.rows)
        num_queries = sum(metadata.query_lens[i] for i in rows)
        index = None
        if rows != every:
            positions = [t for i in rows for t in range(starts[i], starts[i + 1])]
            index = to_device(torch.tensor(positions, dtype=torch.int64), device)
        if step.paged:
            pad = step.op == "triton_splitk"
            bias = build_attn_bias(metadata, device, rows=rows, per_query=step.per_query, pad=pad)
            out.append(PreparedStep(step, bias, num_queries, index))
        else:
            gathered = build_gathered_keys(metadata, device, rows=rows)
            out.append(PreparedStep(step, gathered.bias, num_queries, index, gathered))
    return out
