"""The torch attention backend against a naive per-query reference, on random pools with shuffled block tables."""

from __future__ import annotations

import random

import pytest
import torch

from pagedcore.attention import PagedAttentionMetadata, write_kv
from pagedcore.plugins.torch_backend import TorchPagedAttention


def naive(query, keys_per_seq, values_per_seq, query_lens, seq_lens, window, scale, softcap):
    """Per query: softmax over the keys it may see (positions <= its own, inside the window)."""
    out = []
    cursor = 0
    for keys, values, q_len, seq_len in zip(keys_per_seq, values_per_seq, query_lens, seq_lens):
        groups = query.shape[1] // keys.shape[1]
        k = keys.repeat_interleave(groups, dim=1)  # (seq_len, q_heads, d)
        v = values.repeat_interleave(groups, dim=1)
        for t in range(q_len):
            pos = seq_len - q_len + t
            lo = 0 if window is None else max(0, pos - window + 1)
            q = query[cursor + t]  # (q_heads, d)
            scores = torch.einsum("hd,khd->hk", q, k[lo : pos + 1]) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v[lo : pos + 1]))
        cursor += q_len
    return torch.stack(out)


def build(seed, query_lens, seq_lens, block_size, window, kv_heads=2, q_heads=8, dim=16, contiguous=False):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    ids = list(range(num_blocks))
    if not contiguous:
        rng.shuffle(ids)
    key_cache = torch.zeros(num_blocks + 1, block_size, kv_heads, dim)
    value_cache = torch.zeros_like(key_cache)
    keys, values, tables, offsets, slots = [], [], [], [], []
    cursor = 0
    for n, count, q_len in zip(seq_lens, blocks_per_seq, query_lens):
        table = ids[cursor : cursor + count]
        cursor += count
        k, v = torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
        slot = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        write_kv(key_cache, value_cache, k, v, slot)
        # In a sliding group, blocks before the window of the first query may have been released.
        dropped = 0 if window is None else max(0, n - q_len - window + 1) // block_size
        keys.append(k)
        values.append(v)
        tables.append(table[dropped:])
        offsets.append(dropped)
        slots.append(slot[n - q_len :].tolist())
    meta = PagedAttentionMetadata.build(
        block_size=block_size,
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_offsets=offsets,
        tables=tables,
        slots=slots,
        sliding_window=window,
        pad_block=num_blocks,
    )
    query = torch.randn(sum(query_lens), q_heads, dim)
    return query, key_cache, value_cache, meta, keys, values


CASES = {
    "decode": ([1, 1, 1], [5, 17, 33]),
    "prefill": ([7, 12], [7, 12]),
    "prefill over a cached prefix": ([5, 3], [21, 9]),
    "mixed": ([1, 6, 1, 4], [40, 6, 3, 19]),
    "one decoding sequence": ([1], [37]),
    "one prefilling sequence": ([9], [30]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("contiguous", [False, True])
def test_matches_naive_attention(case, block_size, window, softcap, contiguous):
    query_lens, seq_lens = CASES[case]
    query, kc, vc, meta, keys, values = build(7, query_lens, seq_lens, block_size, window, contiguous=contiguous)
    scale = 16**-0.5
    got = TorchPagedAttention().forward(query, kc, vc, meta, scale=scale, softcap=softcap)
    want = naive(query, keys, values, query_lens, seq_lens, window, scale, softcap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_metadata_is_reused_across_layers():
    query, kc, vc, meta, _, _ = build(3, [1, 4], [9, 4], 4, None)
    backend = TorchPagedAttention()
    first = backend.forward(query, kc, vc, meta, scale=0.25)
    assert ("torch", query.device) in meta.backend_state
    torch.testing.assert_close(backend.forward(query, kc, vc, meta, scale=0.25), first)
