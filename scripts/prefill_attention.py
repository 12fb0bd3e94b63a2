"""Prefill attention of several sequences in one forward, per layer call (issue 33: "prefill no slower than
transformers'").

For the benchmark model's attention shapes (8 query heads, 2 KV heads, head dim 64, float32, block size 16) and
``N`` sequences computing ``L`` new tokens each (with ``--ragged``, each ``L_i`` drawn from ``[L / 2, L]``, seeded)
after ``--cached C`` positions already in the cache (0: prompts with nothing cached), the time of one layer's
attention, three ways:

- ``alone``: :class:`~pagedcore.plugins.torch_backend.TorchPagedAttention` (the Engine's torch backend): each
  prefilling sequence attends by itself to exactly its keys, under SDPA's causal rule when nothing of it is cached
  (no padding, no mask), else under its own mask; prompts with nothing cached under 64 tokens stay in a bucket;
- ``masked bucket``: what the backend ran for them before: every sequence's blocks gathered into one batch padded
  to the longest, and one SDPA call under a boolean mask (:func:`~pagedcore.plugins.torch_backend.attend_rows` over
  the bucket of ``_bucket``);
- ``transformers``: what transformers' ``sdpa_attention_forward`` runs on the same sequences as one batch over
  contiguous tensors (no gathers): with no padding and nothing cached, SDPA with ``is_causal`` and ``enable_gqa``;
  otherwise a left-padded batch whose mask makes it ``repeat_kv`` the keys to every query head and take SDPA's
  masked path.

The pool's blocks are shuffled, as after the prefix cache recycled them. Medians of ``--rounds`` calls, the three
alternating, after one call that builds the forward's plan (built once per forward, then reused by every layer);
the largest difference from ``transformers`` is reported.

    python scripts/prefill_attention.py [--points 4x512,16x128,2x1024,8x256] [--ragged] [--cached C] [--rounds 9]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedcore.attention import PagedAttentionMetadata
from pagedcore.plugins.torch_backend import TorchPagedAttention, _bucket, attend_rows, gather_blocks

HEADS, KV_HEADS, DIM, BLOCK = 8, 2, 64, 16


def _case(n: int, length: int, seed: int, ragged: bool, cached: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The three ways for ``n`` sequences of ``length`` new tokens (or of counts drawn from ``[length / 2, length]``)
    after ``cached`` positions, each a callable returning the packed ``(tokens, heads, dim)`` output."""
    rng = random.Random(seed)
    news = [rng.randint(length // 2, length) if ragged else length for _ in range(n)]
    totals = [cached + count for count in news]
    per = [-(-total // BLOCK) for total in totals]
    order = list(range(sum(per)))
    rng.shuffle(order)
    tables, start = [], 0
    for count in per:
        tables.append(order[start : start + count])
        start += count
    slots = [[t[p // BLOCK] * BLOCK + p % BLOCK for p in range(total)] for t, total in zip(tables, totals)]
    key_cache = torch.randn(sum(per) + 1, BLOCK, KV_HEADS, DIM)
    value_cache = torch.randn_like(key_cache)
    query = torch.randn(sum(news), HEADS, DIM)
    starts = [sum(news[:i]) for i in range(n + 1)]
    scale = DIM**-0.5

    def meta() -> PagedAttentionMetadata:
        return PagedAttentionMetadata.build(
            block_size=BLOCK, query_lens=news, seq_lens=totals, block_offsets=[0] * n, tables=tables,
            slots=[row[cached:] for row in slots], sliding_window=None, pad_block=sum(per),
        )  # fmt: skip

    backend, paged_meta = TorchPagedAttention(), meta()
    bucket = _bucket(meta(), list(range(n)), starts, query.device)
    width, most = max(totals), max(news)  # transformers' batch: left-padded to the longest, zeros at the padding
    keys = query.new_zeros(n, KV_HEADS, width, DIM)
    values = query.new_zeros(n, KV_HEADS, width, DIM)
    queries = query.new_zeros(n, HEADS, most, DIM)
    for i, (row, total, count) in enumerate(zip(slots, totals, news)):
        index = torch.tensor(row)
        keys[i, :, width - total :] = key_cache.view(-1, KV_HEADS, DIM)[index].transpose(0, 1)
        values[i, :, width - total :] = value_cache.view(-1, KV_HEADS, DIM)[index].transpose(0, 1)
        queries[i, :, most - count :] = query[starts[i] : starts[i + 1]].transpose(0, 1)
    key_at = torch.arange(width)[None, None, :]
    query_at = (width - most + torch.arange(most))[None, :, None]  # the key index of each query row's own position
    first = torch.tensor([width - total for total in totals])[:, None, None]
    mask = (key_at <= query_at) & (key_at >= first)  # (n, most, width); padded query rows see a padded key: no NaN
    mask = mask[:, None]
    plain = not ragged and not cached
    groups = HEADS // KV_HEADS

    def alone() -> torch.Tensor:
        return backend.forward(query, key_cache, value_cache, paged_meta, scale=scale)

    def masked_bucket() -> torch.Tensor:  # the backend's bucket path, step by step as its forward runs it
        out = query.new_zeros(query.shape[0], HEADS, DIM)
        padded_query = torch.cat([query, query.new_zeros(1, HEADS, DIM)])
        q = padded_query.index_select(0, bucket.query_index.reshape(-1))
        q = q.view(*bucket.query_index.shape, HEADS, DIM).transpose(1, 2)
        k, v = gather_blocks(key_cache, bucket.blocks), gather_blocks(value_cache, bucket.blocks)
        o = attend_rows(q, k, v, bucket.mask, scale, None)
        o = o.transpose(1, 2).reshape(-1, HEADS, DIM)[bucket.valid]
        return out.index_copy_(0, bucket.out_index, o)

    def transformers() -> torch.Tensor:
        if plain:
            out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            k = keys[:, :, None].expand(n, KV_HEADS, groups, width, DIM).reshape(n, HEADS, width, DIM)
            v = values[:, :, None].expand(n, KV_HEADS, groups, width, DIM).reshape(n, HEADS, width, DIM)
            out = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, scale=scale)
        rows = out.transpose(1, 2)  # (n, most, heads, dim): the real rows are each sequence's last ones
        return torch.cat([rows[i, most - count :] for i, count in enumerate(news)])

    alone()  # the forward's plan, built once and reused by every layer
    return {"alone": alone, "masked bucket": masked_bucket, "transformers": transformers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default="4x512,16x128,2x1024,8x256", help="NxL: N sequences of L new tokens")
    parser.add_argument("--ragged", action="store_true", help="prompt lengths drawn from [L / 2, L] (seeded)")
    parser.add_argument(
        "--cached", type=int, default=0, help="positions already cached before each sequence's new ones"
    )
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lengths = "drawn from [L / 2, L]" if args.ragged else "all L"
    print(f"{HEADS} query heads, {KV_HEADS} KV heads, head dim {DIM}, float32, block size {BLOCK}, new tokens "
          f"{lengths} after {args.cached} cached, {args.threads} torch thread(s); ms per layer call, medians of "
          f"{args.rounds}\n")  # fmt: skip
    print("| sequences x new tokens (L) | alone | masked bucket | transformers | alone / masked | alone / "
          "transformers | largest difference |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---|")
    for point in args.points.split(","):
        n, length = (int(x) for x in point.split("x"))
        ways = _case(n, length, seed=n * length, ragged=args.ragged, cached=args.cached)
        times: dict[str, list[float]] = {name: [] for name in ways}
        outputs: dict[str, torch.Tensor] = {}
        for r in range(args.rounds):
            for name in list(ways) if r % 2 == 0 else list(reversed(ways)):
                start = time.perf_counter()
                outputs[name] = ways[name]()
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        diff = max(float((outputs[name] - outputs["transformers"]).abs().max()) for name in ways)
        print(f"| {n} x {length} | {ms['alone']:.2f} | {ms['masked bucket']:.2f} | {ms['transformers']:.2f} | "
              f"{ms['alone'] / ms['masked bucket']:.2f}x | {ms['alone'] / ms['transformers']:.2f}x | "
              f"{diff:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
