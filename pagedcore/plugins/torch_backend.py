"""Built-in attention backend: plain torch, on any device. The reference every other backend is tested against.

Decoding sequences (one query each) share a bucket, as do short prompts (below); a bucket gathers its sequences'
blocks into a padded ``(num_seqs, kv_heads, keys, head_dim)`` batch and runs one ``scaled_dot_product_attention``
with a boolean mask that encodes causality (bottom-right aligned), the sliding window and the padding. GQA is not
expanded. Index tensors and masks are built once per forward and group and reused by every layer.

Shared prefixes ("cascade" attention): when every sequence of a bucket starts with the same blocks (a common
system prompt served from the prefix cache) and all of its queries come after them, those blocks are read once —
as a view of the pool when they are consecutive — for all queries together, each sequence gathers only its own
tail, and the two partial softmaxes are merged with their log-sum-exp. The same numbers, without copying the
prefix once per sequence and layer. It is used where that copy is what costs (up to 16 queries per sequence and a
prefix at least as long as the longest own tail: decode steps under a long system prompt); elsewhere the fused SDPA
over the gathered keys is faster on CPU.

A single sequence, and every prefilling sequence of a larger batch, attends by itself to exactly its visible keys
(a view when they are consecutive, else its own blocks gathered) under its own mask, or under SDPA's causal rule when
nothing of it is cached (no mask, the hidden half of the scores skipped): no padding to the longest sequence, and the
same bits whatever else shares the forward. Prompts with nothing cached under ``_FRESH_ALONE`` tokens, and
sequences whose shared prefix the cascade reads once, stay in buckets.

Decoding sequences on the CPU go to the decode kernel where it serves (:mod:`.decode_kernel`: float32, this slot-major
pool, no softcap or sinks, nothing recording or tracing): it reads each sequence's keys where the pool holds them,
so they join no bucket, and a shared prefix is read from the cache by every row instead of merged by the cascade.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pagedcore.attention import PagedAttentionMetadata, contiguous_start, eager_attention
from pagedcore.attention_kinds import FullAttention
from pagedcore.hookspecs import hookimpl

from .decode_kernel import DecodeKernel, DecodeRows
from .decode_kernel import load as load_decode_kernel

__all__ = ["TorchPagedAttention", "attend_rows", "gather_blocks", "pagedcore_attention_backend"]


@dataclass
class _Bucket:
    query_index: torch.Tensor  # (n, max_q) into the packed queries, padded with num_tokens (a zero row)
    valid: torch.Tensor  # (n * max_q,) bool: which padded query rows are real
    out_index: torch.Tensor  # (num valid,) packed position of each real row
    blocks: torch.Tensor  # (n, num_blocks) physical blocks to gather, padded with pad_block
    mask: torch.Tensor  # (n, 1, max_q, num_blocks * block_size) bool, True = attend
    shared: _Shared | None = None  # leading blocks every sequence shares (then ``blocks`` holds only the tails)
    tail_hidden: torch.Tensor | None = None  # the cascade's tail mask, inverted and laid out for its scores
    stale: torch.Tensor | None = None  # flat gathered slots past each row's length (zeroed: see gather_blocks)


@dataclass
class _Shared:
    start: int | None  # first slot when the shared blocks are consecutive in the pool (a view), else None
    blocks: torch.Tensor  # (count,) the shared blocks, to gather once when they are not consecutive
    length: int  # keys in the shared part


class TorchPagedAttention:
    """The torch reference backend (varlen, GQA, decode and prefill over a cached prefix, sliding window, softcap).

    Example:
        >>> backend = TorchPagedAttention()
        >>> kc = torch.randn(3, 4, 1, 8); vc = torch.randn(3, 4, 1, 8)   # 2 blocks of 4 + the pad block
        >>> meta = PagedAttentionMetadata.build(block_size=4, query_lens=[1], seq_lens=[5], block_offsets=[0],
        ...     tables=[[0, 1]], slots=[[4]], sliding_window=None, pad_block=2)
        >>> backend.forward(torch.randn(1, 2, 8), kc, vc, meta, scale=8 ** -0.5).shape
        torch.Size([1, 2, 8])
    """

    name = "torch"

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
        kernel = _decode_kernel(query, key_cache, value_cache, softcap, sinks)
        num_tokens, q_heads, _ = query.shape
        # one decoding sequence goes to the kernel too, through the plan below (a plan of only its row)
        run = None if kernel is not None and num_tokens == 1 else self._single_run(metadata, query.device)
        if run is not None:  # one sequence: attend to exactly its visible keys, no padding, no mask for one query
            k, v = run.keys(key_cache), run.keys(value_cache)
            q = query.transpose(0, 1).unsqueeze(0)  # (1, q_heads, q_len, d)
            return attend_rows(q, k, v, run.mask, scale, softcap, sinks, causal=run.causal)[0].transpose(0, 1)
        alone, buckets, decoding = self._plan(metadata, query.device, kernel is not None)
        if decoding is not None and not alone and not buckets:  # a decode step: every row is the kernel's
            out = query.new_empty(num_tokens, q_heads, value_cache.shape[-1])
        else:
            out = query.new_zeros(num_tokens, q_heads, value_cache.shape[-1])
        if decoding is not None:
            assert kernel is not None
            kernel.attend(query, key_cache, value_cache, decoding, scale, out)
        for start, q_len, run in alone:  # a prefilling sequence by itself: its own keys, no padding
            k, v = run.keys(key_cache), run.keys(value_cache)
            q = query[start : start + q_len].transpose(0, 1).unsqueeze(0)
            o = attend_rows(q, k, v, run.mask, scale, softcap, sinks, causal=run.causal)
            out[start : start + q_len] = o[0].transpose(0, 1)
        if not buckets:
            return out
        padded_query = torch.cat([query, query.new_zeros(1, *query.shape[1:])])  # row num_tokens = padding
        for bucket in buckets:
            q = padded_query.index_select(0, bucket.query_index.reshape(-1))
            q = q.view(*bucket.query_index.shape, *query.shape[1:]).transpose(1, 2)  # (n, q_heads, max_q, d)
            k = gather_blocks(key_cache, bucket.blocks, bucket.stale)  # (n, kv_heads, keys, d)
            v = gather_blocks(value_cache, bucket.blocks, bucket.stale)
            if bucket.shared is None:
                o = attend_rows(q, k, v, bucket.mask, scale, softcap, sinks)  # (n, q_heads, max_q, dv)
                o = o.transpose(1, 2).reshape(-1, q_heads, o.shape[-1])[bucket.valid]
            else:
                rows = query.index_select(0, bucket.out_index)  # the real queries, unpadded
                o = _cascade(q, rows, k, v, bucket, key_cache, value_cache, scale, softcap, sinks)
            out.index_copy_(0, bucket.out_index, o)
        return out

    def decode_rows(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: PagedAttentionMetadata
    ) -> DecodeRows | None:
        """The decode kernel's rows where :meth:`forward` of these arguments (no softcap, no sinks) is that kernel's
        one call over every row and nothing else (every sequence decoding), else None: what a caller that makes the
        kernel's call itself (the direct layers' decode tape, ``adapters/transformers/decode_tape.py``) stands for.

        Example:
            >>> meta = PagedAttentionMetadata.build(block_size=4, query_lens=[1, 1], seq_lens=[3, 5],
            ...     block_offsets=[0, 0], tables=[[0], [1, 2]], slots=[[2], [8]], sliding_window=None, pad_block=3)
            >>> pool = torch.zeros(4, 4, 2, 8)
            >>> rows = TorchPagedAttention().decode_rows(torch.zeros(2, 4, 8), pool, pool, meta)
            >>> rows is None or rows.length.tolist() == [3, 5]
            True
        """
        if _decode_kernel(query, key_cache, value_cache, None, None) is None:
            return None
        if query.shape[0] != 1 and self._single_run(metadata, query.device) is not None:
            return None
        alone, buckets, decoding = self._plan(metadata, query.device, True)
        return decoding if not alone and not buckets else None

    def _single_run(self, meta: PagedAttentionMetadata, device: torch.device) -> _Run | None:
        """The keys of a batch of one sequence (a view when they are one run of slots, else its blocks to gather),
        or None for a batch of several. Decided once per forward from the block table."""
        key = ("torch-run", device)
        if key not in meta.backend_state:
            meta.backend_state[key] = _single_sequence(meta, device)
        run: _Run | None = meta.backend_state[key]
        return run

    def _plan(
        self, meta: PagedAttentionMetadata, device: torch.device, kernel: bool = False
    ) -> tuple[list[_Alone], list[_Bucket], DecodeRows | None]:
        """The forward's prefilling sequences attended one by one (packed start, query count and keys of each), its
        buckets and, with ``kernel``, its decoding sequences' rows for the decode kernel (:mod:`.decode_kernel`:
        they then join no bucket), once per forward (every layer reuses them).

        A prefilling sequence attends by itself, to exactly its keys under its own mask (or the causal rule when
        nothing of it is cached): padded into a bucket, each would pay for the longest's queries and keys. Two kinds
        stay in buckets: prompts with nothing cached under ``_FRESH_ALONE`` tokens (one call for them all costs
        about as much as a call each), and sequences whose cached prefix a shared-prefix bucket reads once for all.
        """
        key = ("torch", device, kernel)
        cached: tuple[list[_Alone], list[_Bucket], DecodeRows | None] | None = meta.backend_state.get(key)
        if cached is None:
            starts, q_lens = meta.query_start_loc, meta.query_lens
            full = isinstance(meta.kind, FullAttention)
            decode = [i for i, n in enumerate(q_lens) if n == 1]
            prefill = [i for i, n in enumerate(q_lens) if n > 1]
            short = [i for i in prefill if full and meta.seq_lens[i] == q_lens[i] and q_lens[i] < _FRESH_ALONE]
            rest = [i for i in prefill if i not in short]
            decoding = DecodeRows.of(meta, decode) if kernel and decode else None
            bucketed = [] if decoding is not None else decode
            groups, alone = [bucketed, short], rest
            if rest and _shared_blocks(meta, rest):  # their shared prefix is read once for all: one bucket
                groups, alone = [bucketed, rest, short], []
            runs = [(starts[i], q_lens[i], _sequence_run(meta, i, device)) for i in alone]
            cached = runs, [_bucket(meta, rows, starts, device) for rows in groups if rows], decoding
            meta.backend_state[key] = cached
        return cached


# Prompts with nothing cached of at least this many tokens are attended one by one under the causal rule (as every
# prefilling sequence over a cached prefix is); shorter ones stay in the masked prefill bucket, where one call for all
# of them costs about as much as a call each
# (scripts/prefill_attention.py, per layer call against the bucket: 16 x 64 0.91-1.01x, 16 x 128 0.73-0.76x; with
# no threshold 32 x 32 took 1.13x one by one).
_FRESH_ALONE = 64
_CASCADE_MAX_QUERIES = 16  # queries per sequence up to which a shared prefix is attended once (see _shared_blocks)


def _shared_blocks(meta: PagedAttentionMetadata, rows: list[int]) -> int:
    """Leading blocks every row of a bucket holds in common and all of their queries see whole (0 if not worth it)."""
    if len(rows) < 2 or meta.kind.is_sliding or any(meta.block_offsets[i] for i in rows):
        return 0
    bs = meta.block_size
    limit = min((meta.seq_lens[i] - meta.query_lens[i]) // bs for i in rows)  # before every row's first query
    if limit * bs < 64:
        return 0
    host = meta.host_tables  # the CPU copy when the tables live on a GPU: no device sync
    picked = host[rows[0] : rows[-1] + 1] if rows == list(range(rows[0], rows[-1] + 1)) else host[rows]
    same = (picked[:, :limit] == picked[:1, :limit]).all(dim=0)  # one comparison for all rows, not a Python loop
    count = limit if bool(same.all()) else int((~same).to(torch.uint8).argmax())
    length = count * bs
    if length < 64:
        return 0  # a short prefix is cheaper to gather than to merge
    # Measured on CPU (docs/benchmarks.md, Profiles): the cascade pays when copying the prefix once per sequence
    # would dominate, i.e. few queries per sequence and a prefix at least as long as the longest own tail; with
    # more queries the attention's FLOPs dominate and one fused SDPA call over the gathered keys is faster.
    if max(meta.query_lens[i] for i in rows) > _CASCADE_MAX_QUERIES:
        return 0
    if max(meta.seq_lens[i] for i in rows) - length > length:
        return 0
    return count


def _bucket(meta: PagedAttentionMetadata, rows: list[int], starts: list[int], device: torch.device) -> _Bucket:
    bs = meta.block_size
    num_tokens = starts[-1]
    max_q = max(meta.query_lens[i] for i in rows)
    shared_count = _shared_blocks(meta, rows)
    # Gather only the blocks a query can see: from the window's first block (or the first live block) on, and
    # after the shared leading blocks, which are read once for the whole bucket.
    kind = meta.kind
    first: list[int] = []
    count: list[int] = []
    for i in rows:
        q_start = meta.seq_lens[i] - meta.query_lens[i]
        first_block = max(kind.first_needed_block(q_start, bs), meta.block_offsets[i], shared_count)
        first.append(first_block)
        count.append(-(-meta.seq_lens[i] // bs) - first_block)
    width = max(count)
    tables = meta.block_tables.to(device=device, dtype=torch.long)
    row_index = torch.tensor(rows, device=device)
    column = torch.arange(width, device=device)
    skip = torch.tensor([f - meta.block_offsets[i] for f, i in zip(first, rows)], device=device)
    table_column = (skip[:, None] + column[None, :]).clamp(max=tables.shape[1] - 1)
    blocks = tables[row_index[:, None], table_column]
    blocks = torch.where(column[None, :] < torch.tensor(count, device=device)[:, None], blocks, meta.pad_block)

    # Positions: keys are block-aligned from `first`; queries are the last query_len positions.
    key_pos = torch.tensor(first, device=device)[:, None] * bs + torch.arange(width * bs, device=device)[None, :]
    q_len = torch.tensor([meta.query_lens[i] for i in rows], device=device)
    seq_len = torch.tensor([meta.seq_lens[i] for i in rows], device=device)
    t = torch.arange(max_q, device=device)
    q_pos = (seq_len - q_len)[:, None] + t[None, :]  # (n, max_q)
    written = key_pos < seq_len[:, None]  # (n, width * bs): the rest is a block's unwritten tail or the pad block
    mask = kind.sees(q_pos[:, :, None], key_pos[:, None, :]) & written[:, None, :]
    real = t[None, :] < q_len[:, None]  # (n, max_q)
    mask[:, :, 0] |= ~real  # padded query rows attend one key (no NaN); their output is dropped
    starts_t = torch.tensor([starts[i] for i in rows], device=device)
    query_index = torch.where(real, starts_t[:, None] + t[None, :], num_tokens)
    valid = real.reshape(-1)
    shared = None
    if shared_count:
        ids = meta.host_tables[rows[0], :shared_count].tolist()
        consecutive = all(ids[j + 1] == ids[j] + 1 for j in range(shared_count - 1))
        shared = _Shared(
            ids[0] * bs if consecutive else None,
            torch.tensor(ids, dtype=torch.long, device=device),
            shared_count * bs,
        )
    stale = (~written).reshape(-1).nonzero().squeeze(1)
    return _Bucket(query_index, valid, query_index.reshape(-1)[valid], blocks, mask[:, None], shared, stale=stale)


def _cascade(
    q: torch.Tensor,
    rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bucket: _Bucket,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over (shared prefix + own tail) keys, the prefix computed once for all sequences; merged exactly
    through the two parts' log-sum-exp (and the sink's, ``sinks (q_heads,)``, a third part with no value). ``q (n,
    q_heads, max_q, d)`` the bucket's padded queries, ``rows (R, q_heads, d)`` its real query rows in the order of
    ``bucket.valid``, ``k``/``v`` the gathered tails. Returns ``(R, q_heads, dv)``.

    Every real query sees every shared key, so the prefix part runs on the real rows only (no padding: a prefill
    bucket's queries are padded to its longest); the tail part runs padded, with its mask. Scores are scaled
    through the (smaller) queries, and softmax numerators are formed in place.
    """
    shared = bucket.shared
    assert shared is not None
    n, q_heads, max_q, dim = q.shape
    num_rows = rows.shape[0]
    kv_heads = k.shape[1]
    groups = q_heads // kv_heads
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    if shared.start is not None:
        kp = key_cache.view(-1, *key_cache.shape[2:])[shared.start : shared.start + shared.length]
        vp = value_cache.view(-1, *value_cache.shape[2:])[shared.start : shared.start + shared.length]
    else:
        kp = gather_blocks(key_cache, shared.blocks[None]).transpose(1, 2)[0]  # (shared, kv_heads, d)
        vp = gather_blocks(value_cache, shared.blocks[None]).transpose(1, 2)[0]

    # Prefix part: (kv_heads, R * groups, d) @ (kv_heads, d, shared) in one matmul per KV head.
    qp = (rows.to(work) * scale).view(num_rows, kv_heads, groups, dim).transpose(0, 1)
    sp = torch.matmul(qp.reshape(kv_heads, num_rows * groups, dim), kp.to(work).permute(1, 2, 0))
    mp, lp, op = _partial_softmax(sp, None, vp.to(work).transpose(0, 1), softcap)  # (kv_heads, R * groups, ...)

    # Tail part: each sequence's own keys, masked (causal, padding): (n, kv_heads, groups * max_q, ...).
    qt = (q.to(work) * scale).reshape(n, kv_heads, groups * max_q, dim)
    st = torch.matmul(qt, k.to(work).transpose(-1, -2))
    if bucket.tail_hidden is None:  # once per forward, for every layer: keys each tail score row must not see
        bucket.tail_hidden = ~bucket.mask.expand(n, groups, max_q, -1).reshape(n, 1, groups * max_q, -1)
    mt, lt, ot = _partial_softmax(st, bucket.tail_hidden, v.to(work), softcap)

    # Both parts in the real rows' layout (R, kv_heads, groups, ...), merged.
    def prefix_rows(x: torch.Tensor) -> torch.Tensor:
        return x.view(kv_heads, num_rows, groups, x.shape[-1]).transpose(0, 1)

    def tail_rows(x: torch.Tensor) -> torch.Tensor:
        x = x.view(n, kv_heads, groups, max_q, x.shape[-1]).permute(0, 3, 1, 2, 4)
        return x.reshape(n * max_q, kv_heads, groups, x.shape[-1])[bucket.valid]

    prefix = (prefix_rows(mp), prefix_rows(lp), prefix_rows(op))
    out = _merge(prefix, (tail_rows(mt), tail_rows(lt), tail_rows(ot)), sinks)
    return out.reshape(num_rows, q_heads, -1).to(q.dtype)


_Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (max, sum of exponentials, weighted values) of a softmax


def _merge(prefix: _Part, tail: _Part, sinks: torch.Tensor | None) -> torch.Tensor:
    """The attention output of two partial softmaxes ``(R, kv_heads, groups, ...)``, and of the sink logits
    ``(q_heads,)`` (a third part with no value) when given."""
    (mp, lp, op), (mt, lt, ot) = prefix, tail
    m = torch.maximum(mp, mt)
    sink = None
    if sinks is not None:  # the sink: a logit of its own in every row's denominator
        sink = sinks.to(m.dtype).view(1, *mp.shape[1:3], 1)
        m = torch.maximum(m, sink)
    wp, wt = torch.exp(mp - m), torch.exp(mt - m)
    denominator = lp * wp + lt * wt
    if sink is not None:
        denominator = denominator + torch.exp(sink - m)
    return (op * wp + ot * wt) / denominator


def _partial_softmax(
    scores: torch.Tensor, hidden: torch.Tensor | None, values: torch.Tensor, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(max, sum of exp(score - max), exp(score - max) @ values)`` over the last axis of scaled ``scores`` (which
    it overwrites), ``hidden`` (True = masked out) applied first."""
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    if hidden is not None:
        scores = scores.masked_fill_(hidden, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    numerators = scores.sub_(top).exp_()
    return top, numerators.sum(dim=-1, keepdim=True), torch.matmul(numerators, values)


_Alone = tuple[int, int, "_Run"]  # a sequence attended by itself: its first packed query, its query count, its keys


@dataclass
class _Run:
    """The keys one sequence's queries see: positions ``first .. first + length - 1``, read as a view of the pool
    from ``slot`` when they lie in consecutive blocks, else gathered from ``blocks`` (from ``offset`` in the first).
    Either way the attention sees the same keys, so the outputs do not depend on where the pool put the blocks."""

    slot: int | None
    blocks: torch.Tensor | None  # (1, count) the blocks holding the keys, when not consecutive
    offset: int
    length: int
    mask: torch.Tensor | None  # (q_len, length) for several queries; None: one query sees every key
    causal: bool = False  # the queries are all the keys, under full attention: the causal rule, no mask

    def keys(self, cache: torch.Tensor) -> torch.Tensor:
        """``(1, heads, length, dim)``: this sequence's visible rows of one pool tensor."""
        if self.blocks is None:
            assert self.slot is not None
            return cache.view(-1, *cache.shape[2:])[self.slot : self.slot + self.length].transpose(0, 1).unsqueeze(0)
        return gather_blocks(cache, self.blocks)[:, :, self.offset : self.offset + self.length]


def _single_sequence(meta: PagedAttentionMetadata, device: torch.device) -> _Run | None:
    return _sequence_run(meta, 0, device) if meta.num_seqs == 1 else None


def _sequence_run(meta: PagedAttentionMetadata, row: int, device: torch.device) -> _Run:
    """The keys sequence ``row`` of the forward sees, and the mask or rule its queries see them under."""
    bs = meta.block_size
    kind = meta.kind
    seq_len, q_len = meta.seq_lens[row], meta.query_lens[row]
    q_start = seq_len - q_len
    dropped = meta.block_offsets[row]
    first = max(kind.first_visible(q_start), dropped * bs)
    length = seq_len - first
    table = meta.host_tables[row].tolist()
    slot = contiguous_start(table, first, length, bs, dropped)
    blocks = None
    if slot is None:  # blocks the prefix cache recycled: gather just this sequence's, a few blocks per layer
        lo, hi = first // bs - dropped, (seq_len - 1) // bs - dropped
        if hi >= len(table):  # a shorter table would gather fewer keys than the sequence has
            raise ValueError(f"block table of {len(table)} blocks for {seq_len} positions (block size {bs})")
        blocks = torch.tensor([table[lo : hi + 1]], dtype=torch.long, device=device)
    mask = None
    causal = q_len > 1 and length == q_len and isinstance(kind, FullAttention)  # a prompt with nothing cached
    if q_len > 1 and not causal:  # a single query sees every key from `first` on (first >= its first visible key)
        key_pos = torch.arange(first, seq_len, device=device)
        q_pos = torch.arange(q_start, seq_len, device=device)
        mask = kind.sees(q_pos[:, None], key_pos[None, :])
    return _Run(slot, blocks, first % bs, length, mask, causal)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, stale: torch.Tensor | None = None) -> torch.Tensor:
    """``(n, heads, width * block_size, dim)``: the blocks ``(n, width)`` of each row, one after the other.
    (``index_select`` over whole blocks: several times faster than advanced indexing on CPU.)

    ``stale`` (flat indices into the ``n * width * block_size`` gathered slots) are zeroed in the copy: slots no
    query may see that the pool has not written for this sequence (a block's tail past its length, the pad block)
    can hold what an earlier owner of the block left, and a masked key's weight 0 times a NaN or Inf left there is
    NaN. Zeroed, a masked slot adds exactly nothing, so finite leftovers give the same bits either way.

    Example:
        >>> cache = torch.arange(12.0).view(3, 2, 1, 2)   # 3 blocks of 2 slots, 1 head, dim 2
        >>> gather_blocks(cache, torch.tensor([[2, 0]]))[0, 0].tolist()
        [[8.0, 9.0], [10.0, 11.0], [0.0, 1.0], [2.0, 3.0]]
        >>> cache[0, 1] = float("nan")   # slot 3 of the gather, past this row's length
        >>> gather_blocks(cache, torch.tensor([[2, 0]]), torch.tensor([3]))[0, 0].tolist()
        [[8.0, 9.0], [10.0, 11.0], [0.0, 1.0], [0.0, 0.0]]
    """
    n, width = blocks.shape
    num_blocks, bs, heads, dim = cache.shape
    if cache.is_contiguous():  # the slot-major pool
        flat = cache.view(num_blocks, -1).index_select(0, blocks.reshape(-1))
        if stale is not None and stale.numel():
            flat.view(n * width * bs, heads * dim).index_fill_(0, stale, 0)
        return flat.view(n, width * bs, heads, dim).transpose(1, 2)
    # a heads-first pool (a permuted view of (heads, blocks, block_size, dim)): select along its physical block axis
    physical = cache.permute(2, 0, 1, 3)
    picked = physical.index_select(1, blocks.reshape(-1))  # (heads, n * width, block_size, dim)
    if stale is not None and stale.numel():
        picked.view(heads, n * width * bs, dim).index_fill_(1, stale, 0)
    return picked.view(heads, n, width * bs, dim).transpose(0, 1)


def attend_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    *,
    causal: bool = False,
) -> torch.Tensor:
    """Attention with a boolean mask (True = attend); no mask means every query sees every key; ``sinks`` (a logit
    per query head in the softmax, gpt-oss) and ``softcap`` run the step-by-step :func:`eager_attention`.
    ``causal`` (with no mask): query ``i`` sees keys ``0 .. i``, as SDPA's ``is_causal`` (which skips the hidden
    half of the scores; transformers' own prefill calls it so).

    One query per sequence (decode) with grouped KV heads: the ``groups`` query heads of a KV head become that head's
    ``groups`` query rows (``(n, kv_heads, groups, d)``), so each KV head's keys are read once for all of its query
    heads (one matrix product instead of ``groups`` vector products: 2-3x faster on the CPU than ``enable_gqa``).
    Exact: every row sees the same keys, which is what the mask says when it does not vary by head or query.

    Example:
        >>> q, k, v = torch.randn(2, 8, 1, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
        >>> mask = torch.tensor([[True] * 5, [False, True, True, True, True]])[:, None, None, :]
        >>> packed = attend_rows(q, k, v, mask, 0.25, None)
        >>> plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
        >>> packed.shape, torch.allclose(packed, plain, atol=1e-6)
        (torch.Size([2, 8, 1, 16]), True)
    """
    n, q_heads, q_len, _ = q.shape
    kv_heads = k.shape[1]
    groups = q_heads // kv_heads
    if causal:
        if softcap is None and sinks is None:
            return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True, enable_gqa=groups > 1)
        mask = torch.ones(q_len, k.shape[2], dtype=torch.bool, device=q.device).tril()
    if softcap is None and sinks is None:
        if groups > 1 and q_len == 1 and (mask is None or (mask.dim() == 4 and mask.shape[1:3] == (1, 1))):
            packed = q.reshape(n, kv_heads, groups, q.shape[-1])
            out = F.scaled_dot_product_attention(packed, k, v, attn_mask=mask, scale=scale)
            return out.reshape(n, q_heads, 1, out.shape[-1])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=groups > 1)
    return eager_attention(q, k, v, mask, scale=scale, softcap=softcap, sinks=sinks)


def _decode_kernel(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> DecodeKernel | None:
    """The decode kernel where it serves this layer call (:meth:`DecodeKernel.fits`), else None."""
    if not DecodeKernel.fits(query, key_cache, value_cache, softcap, sinks):
        return None
    return load_decode_kernel()


_BACKEND = TorchPagedAttention()


@hookimpl(trylast=True)
def pagedcore_attention_backend(name: str | None) -> Any:
    """The torch backend, for any device, when asked for by name or when nothing better answered.

    Example:
        >>> pagedcore_attention_backend(name=None).name, pagedcore_attention_backend(name="other")
        ('torch', None)
    """
    if name in (None, "torch"):
        return _BACKEND
    return None
