"""Which xformers op computes which sequences of a forward, and the shape buckets its launches are padded to.

Op selection (``P`` = ``metadata.block_size``; rows = sequences with new tokens), see :func:`plan_steps`:

1. ``softcap`` given: the torch backend for the whole forward (xformers hardcodes softcap 0; decided by the backend).
2. Every row has the same query length ``L <= 16`` (decode, or short speculative rows) and ``P % 64 == 0``:
   ``triton_splitk`` over the pool, one launch (its causal mode needs equal query lengths ``<= 16``; in a
   sliding group with ``L > 1`` every query becomes its own non-causal piece).
3. Full attention (no window, no released block), ``P % 256 == 0`` and the ``flash_attn`` package installed:
   ``flash_paged`` (FA2 with a block table), one launch for any mix of decode and prefill.
4. Otherwise the batch is split: decode rows (one query each) run on ``triton_splitk`` when ``P % 64 == 0``;
   the other rows (all rows when ``P % 64 != 0``) are a "gather" step: their visible keys are gathered into a
   contiguous buffer and a non-paged bottom-right causal bias (local, in a sliding group) runs on ``flash``, or
   else ``cutlass``.

Buckets: ``triton_splitk`` compiles one kernel per value of its ``tl.constexpr`` arguments, among them the number
of bias rows (``Z``) and the block-table width (``kv_cache_blocks_per_row``, and ``N_CTX_K = width * P``). Both change
with every batch and every page a decode grows by, so a paged step pads them to :func:`bucket` sizes: rows to a
power of two (at least :data:`MIN_ROWS`), with padding rows that attend to one key of the always-zero pad block, and
the table width to a power of two (at least :data:`MIN_WIDTH` pages). A long decode then compiles a few kernels, not
one per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedcore.attention import PagedAttentionMetadata, bucket

__all__ = [
    "FLASH_PAGE_MULTIPLE",
    "MIN_ROWS",
    "MIN_WIDTH",
    "SPLITK_MAX_CAUSAL_QUERIES",
    "SPLITK_PAGE_MULTIPLE",
    "Piece",
    "Step",
    "bucket",
    "pieces",
    "plan_steps",
]

SPLITK_PAGE_MULTIPLE = 64  # triton_splitk reads pages in BLOCK_N = 64 key tiles
SPLITK_MAX_CAUSAL_QUERIES = 16  # triton_splitk's causal mode: equal query lengths, at most its smallest BLOCK_M
FLASH_PAGE_MULTIPLE = 256  # FA2 with a block table needs pages of a multiple of 256 (not checked by xformers)
MIN_ROWS = 8  # smallest row bucket of a paged launch
MIN_WIDTH = 4  # smallest block-table width bucket of a paged launch, in pages


@dataclass(frozen=True)
class Step:
    """One kernel launch of a forward.

    Attributes:
        op: ``"triton_splitk"`` or ``"flash_paged"`` (paged, over the pool) or ``"gather"`` (contiguous keys).
        rows: the metadata rows (sequences) this step computes.
        per_query: build the paged bias with one piece per query (see :func:`pieces`).

    Example:
        >>> meta = PagedAttentionMetadata.build(block_size=64, query_lens=[1, 1], seq_lens=[70, 9],
        ...     block_offsets=[0, 0], tables=[[0, 1], [2]], slots=[[69], [136]], sliding_window=None, pad_block=3)
        >>> [(step.op, step.rows) for step in plan_steps(meta, flash_paged=False)]
        [('triton_splitk', (0, 1))]
    """

    op: str
    rows: tuple[int, ...]
    per_query: bool = False

    @property
    def paged(self) -> bool:
        """Whether the step reads the pool through block tables (else it gathers keys)."""
        return self.op != "gather"


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
    rows = rows_with_queries(metadata)
    if not rows:
        return []
    page = metadata.block_size
    gappy = is_gappy(metadata, rows)
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


@dataclass(frozen=True)
class Piece:
    """One row of a paged bias: consecutive queries of one sequence and the key range they all see.

    Attributes:
        row: metadata row whose block-table row the piece reads.
        num_queries: consecutive queries of the row, the last of them at row-local position ``key_end - 1``.
        key_start: first row-local key position (row-local 0 = the row's first live block).
        key_end: one past the last row-local key position.

    Example:
        >>> meta = PagedAttentionMetadata.build(block_size=4, query_lens=[2], seq_lens=[10], block_offsets=[1],
        ...     tables=[[5, 2]], slots=[[8, 9]], sliding_window=3, pad_block=8)
        >>> pieces(meta, [0], per_query=False)   # queries 8 and 9 see keys 6..8 and 7..9 (row-local: from 4)
        [Piece(row=0, num_queries=1, key_start=2, key_end=5), Piece(row=0, num_queries=1, key_start=3, key_end=6)]
    """

    row: int
    num_queries: int
    key_start: int
    key_end: int


def pieces(meta: PagedAttentionMetadata, rows: list[int], per_query: bool) -> list[Piece]:
    """The bias rows that compute ``rows``' queries.

    Full attention: one causal piece per row. A sliding window or released blocks: the queries of a row that all
    reach back to its first live key share one causal piece; each later query (whose window starts after that key)
    is its own piece. ``per_query``: one piece per query, each with its exact key range.

    Example:
        >>> meta = PagedAttentionMetadata.build(block_size=4, query_lens=[3], seq_lens=[7], block_offsets=[0],
        ...     tables=[[2, 0]], slots=[[4, 5, 6]], sliding_window=None, pad_block=3)
        >>> [(p.num_queries, p.key_start, p.key_end) for p in pieces(meta, [0], per_query=False)]
        [(3, 0, 7)]
        >>> [(p.num_queries, p.key_start, p.key_end) for p in pieces(meta, [0], per_query=True)]
        [(1, 0, 5), (1, 0, 6), (1, 0, 7)]
    """
    out = []
    kind = meta.kind
    for i in rows:
        seq_len = meta.seq_lens[i]
        first_query = seq_len - meta.query_lens[i]
        live = meta.block_offsets[i] * meta.block_size
        last_seeing_live = kind.last_query_seeing(live)  # queries up to it all see keys from `live` on
        if per_query:
            shared = 0
        elif last_seeing_live is None:
            shared = meta.query_lens[i]
        else:
            shared = max(0, min(seq_len, last_seeing_live + 1) - first_query)
        if shared:
            out.append(Piece(i, shared, 0, first_query + shared - live))
        for position in range(first_query + shared, seq_len):
            out.append(Piece(i, 1, first_key(meta, i, position) - live, position + 1 - live))
    return out


def rows_with_queries(meta: PagedAttentionMetadata) -> list[int]:
    """Rows that have new tokens this forward."""
    return [i for i, n in enumerate(meta.query_lens) if n > 0]


def is_gappy(meta: PagedAttentionMetadata, rows: list[int]) -> bool:
    """Whether some row's keys do not start at position 0 (a window, a chunk, or released leading blocks)."""
    return meta.kind.is_sliding or any(meta.block_offsets[i] > 0 for i in rows)


def segments(meta: PagedAttentionMetadata, i: int) -> list[tuple[int, int]]:
    """Row ``i``'s queries as ``(first query position, query count)`` runs whose keys start at the same position:
    the whole row, or, where that start depends on the query's absolute position (chunked attention), one run per
    chunk. Each run then sees ``first_key .. its last query``, bottom-right causal (a window's own rule aside).

    Example:
        >>> from pagedcore.attention_kinds import ChunkedAttention
        >>> meta = PagedAttentionMetadata.build(block_size=4, query_lens=[6], seq_lens=[10], block_offsets=[0],
        ...     tables=[[0, 1, 2]], slots=[[4, 5, 6, 7, 8, 9]], sliding_window=None, pad_block=3,
        ...     kind=ChunkedAttention(8))
        >>> segments(meta, 0)
        [(4, 4), (8, 2)]
    """
    first, end = meta.seq_lens[i] - meta.query_lens[i], meta.seq_lens[i]
    if meta.kind.is_relative:
        return [(first, end - first)]
    out = []
    while first < end:
        last = meta.kind.last_query_seeing(first)  # the last query whose keys start where this one's do
        count = min(end, (end if last is None else last + 1)) - first
        out.append((first, count))
        first += count
    return out


def num_live_blocks(meta: PagedAttentionMetadata, i: int) -> int:
    """Blocks row ``i`` holds (its table's length before padding)."""
    return -(-meta.seq_lens[i] // meta.block_size) - meta.block_offsets[i]


def first_key(meta: PagedAttentionMetadata, i: int, position: int) -> int:
    """The first key position the query at ``position`` of row ``i`` sees (never one in a released block)."""
    return max(meta.block_offsets[i] * meta.block_size, meta.kind.first_visible(position))
