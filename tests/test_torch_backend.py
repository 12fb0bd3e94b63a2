"""The torch attention backend against a naive per-query reference, on random pools with shuffled block tables."""

from __future__ import annotations

import random

import pytest
import torch

from pagedcore.attention import PagedAttentionMetadata, write_kv
from pagedcore.attention_kinds import ChunkedAttention
from pagedcore.plugins import torch_backend
from pagedcore.plugins.torch_backend import TorchPagedAttention


@pytest.fixture
def no_decode_kernel(monkeypatch):
    """The backend's own ways for decoding rows too (the decode kernel, where it serves, takes them out of the
    buckets these tests look into; tests/test_decode_kernel.py tests it)."""
    monkeypatch.setattr(torch_backend, "_decode_kernel", lambda *args: None)


def plan(meta, device):
    """The backend's plan of the forward (prefills alone, buckets, the decode kernel's rows), as it kept it."""
    (kept,) = [value for key, value in meta.backend_state.items() if key[0] == "torch" and key[1] == device]
    return kept


def naive(query, keys_per_seq, values_per_seq, query_lens, seq_lens, window, scale, softcap, sinks=None, chunk=None):
    """Per query: softmax over the keys it may see (positions <= its own, inside the window or its chunk), with a
    sink logit per head (``sinks``) that takes its share of the softmax and adds no value."""
    out = []
    cursor = 0
    for keys, values, q_len, seq_len in zip(keys_per_seq, values_per_seq, query_lens, seq_lens):
        groups = query.shape[1] // keys.shape[1]
        k = keys.repeat_interleave(groups, dim=1)  # (seq_len, q_heads, d)
        v = values.repeat_interleave(groups, dim=1)
        for t in range(q_len):
            pos = seq_len - q_len + t
            lo = 0 if window is None else max(0, pos - window + 1)
            lo = lo if chunk is None else pos - pos % chunk
            q = query[cursor + t]  # (q_heads, d)
            scores = torch.einsum("hd,khd->hk", q, k[lo : pos + 1]) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            if sinks is not None:
                weights = torch.cat([scores, sinks[:, None]], dim=-1).softmax(-1)[:, :-1]
            else:
                weights = scores.softmax(-1)
            out.append(torch.einsum("hk,khd->hd", weights, v[lo : pos + 1]))
        cursor += q_len
    return torch.stack(out)


def build(seed, query_lens, seq_lens, block_size, window, kv_heads=2, q_heads=8, dim=16, contiguous=False, chunk=None):
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
        if chunk is not None:  # a chunked group: the blocks before the first query's chunk were given back
            dropped = (n - q_len) // chunk * chunk // block_size
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
        kind=None if chunk is None else ChunkedAttention(chunk),
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
    "one prompt with nothing cached": ([12], [12]),
    "prompts with nothing cached, long and short": ([70, 1, 64, 9], [70, 9, 64, 9]),
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


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 5])
def test_sinks_take_their_share_of_every_softmax(case, block_size, window):
    """gpt-oss's sink logit per head: in the single-run view, the decode and prefill buckets alike."""
    query_lens, seq_lens = CASES[case]
    query, kc, vc, meta, keys, values = build(8, query_lens, seq_lens, block_size, window)
    sinks = torch.randn(8) * 2
    got = TorchPagedAttention().forward(query, kc, vc, meta, scale=0.25, sinks=sinks)
    want = naive(query, keys, values, query_lens, seq_lens, window, 0.25, None, sinks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, naive(query, keys, values, query_lens, seq_lens, window, 0.25, None), atol=1e-3)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("chunk", [4, 8, 12])
def test_chunked_queries_see_their_own_chunk(case, block_size, chunk):
    """Llama 4's chunked layers, the finished chunks' blocks given back (aligned or not with the blocks)."""
    query_lens, seq_lens = CASES[case]
    query, kc, vc, meta, keys, values = build(9, query_lens, seq_lens, block_size, None, chunk=chunk)
    got = TorchPagedAttention().forward(query, kc, vc, meta, scale=0.25)
    want = naive(query, keys, values, query_lens, seq_lens, None, 0.25, None, chunk=chunk)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("leftover", [float("nan"), float("inf")])
def test_what_an_earlier_owner_left_in_unwritten_slots_never_reaches_the_output(case, block_size, leftover):
    """A freed block goes to its next owner with its contents; the slots that owner has not written yet (a block's
    tail past the sequence's length, the pad block) may hold a NaN or Inf from an overflowed forward. The masked
    keys must add nothing: the same bits as over a clean pool (a masked weight 0 times NaN is NaN)."""
    query_lens, seq_lens = CASES[case]
    query, kc, vc, meta, _, _ = build(10, query_lens, seq_lens, block_size, None)
    clean = TorchPagedAttention().forward(query, kc, vc, meta, scale=0.25)
    unwritten = (kc == 0).flatten(2).all(-1)  # (blocks, block_size): randn never writes an exact zero row
    assert unwritten.any()
    kc[unwritten], vc[unwritten] = leftover, leftover
    query, _, _, meta, _, _ = build(10, query_lens, seq_lens, block_size, None)  # fresh metadata, same inputs
    got = TorchPagedAttention().forward(query, kc, vc, meta, scale=0.25)
    assert torch.equal(got, clean)


def test_metadata_is_reused_across_layers():
    query, kc, vc, meta, _, _ = build(3, [1, 4], [9, 4], 4, None)
    backend = TorchPagedAttention()
    first = backend.forward(query, kc, vc, meta, scale=0.25)
    assert [key for key in meta.backend_state if key[0] == "torch"]  # the plan, kept for the next layers
    torch.testing.assert_close(backend.forward(query, kc, vc, meta, scale=0.25), first)


def build_shared(seed, query_lens, seq_lens, block_size, shared_tokens, consecutive, kv_heads=2, q_heads=8, dim=16):
    """Sequences whose first ``shared_tokens`` positions live in the same blocks (a cached common prefix)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    shared_blocks = shared_tokens // block_size
    own_blocks = [-(-n // block_size) - shared_blocks for n in seq_lens]
    num_blocks = shared_blocks + sum(own_blocks) + 2
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    prefix_ids = sorted(ids[:shared_blocks]) if consecutive else ids[:shared_blocks]
    if consecutive:  # make them truly consecutive in the pool
        prefix_ids = list(range(10, 10 + shared_blocks))
        ids = prefix_ids + [b for b in range(num_blocks + 10) if b not in prefix_ids][: num_blocks - shared_blocks]
    rest = ids[shared_blocks:]
    key_cache = torch.zeros(max(ids) + 2, block_size, kv_heads, dim)
    value_cache = torch.zeros_like(key_cache)
    pk, pv = torch.randn(shared_tokens, kv_heads, dim), torch.randn(shared_tokens, kv_heads, dim)
    keys, values, tables, slots = [], [], [], []
    cursor = 0
    for n, own, q_len in zip(seq_lens, own_blocks, query_lens):
        table = prefix_ids + rest[cursor : cursor + own]
        cursor += own
        k = torch.cat([pk, torch.randn(n - shared_tokens, kv_heads, dim)])
        v = torch.cat([pv, torch.randn(n - shared_tokens, kv_heads, dim)])
        slot = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        write_kv(key_cache, value_cache, k, v, slot)
        keys.append(k)
        values.append(v)
        tables.append(table)
        slots.append(slot[n - q_len :].tolist())
    meta = PagedAttentionMetadata.build(
        block_size=block_size,
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_offsets=[0] * len(seq_lens),
        tables=tables,
        slots=slots,
        sliding_window=None,
        pad_block=key_cache.shape[0] - 1,
    )
    return torch.randn(sum(query_lens), q_heads, dim), key_cache, value_cache, meta, keys, values


@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [([1, 1, 1, 1], [70, 81, 97, 66]), ([5, 9, 3], [72, 90, 120]), ([1, 7, 1], [65, 80, 100])],
)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize(("softcap", "sinks"), [(None, False), (30.0, False), (None, True)])
def test_shared_prefix_is_read_once_and_matches(
    query_lens, seq_lens, block_size, consecutive, softcap, sinks, no_decode_kernel
):
    query, kc, vc, meta, keys, values = build_shared(5, query_lens, seq_lens, block_size, 64, consecutive)
    backend = TorchPagedAttention()
    logits = torch.randn(8) * 2 if sinks else None  # the sink joins the merge of the two partial softmaxes
    got = backend.forward(query, kc, vc, meta, scale=0.25, softcap=softcap, sinks=logits)
    buckets = [b for b in plan(meta, query.device)[1] if len(b.blocks) > 1]
    assert buckets and all(b.shared is not None and b.shared.length == 64 for b in buckets)  # the cascade ran
    assert all((b.shared.start is not None) == consecutive for b in buckets)
    want = naive(query, keys, values, query_lens, seq_lens, None, 0.25, softcap, logits)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "why"),
    [([5, 9, 3], [72, 90, 130], "a tail (66 keys) longer than the prefix (64)"),
     ([17, 1], [90, 70], "more than 16 queries for one sequence")],
)  # fmt: skip
def test_the_shared_prefix_is_gathered_where_the_cascade_does_not_pay(query_lens, seq_lens, why, no_decode_kernel):
    query, kc, vc, meta, keys, values = build_shared(7, query_lens, seq_lens, 16, 64, True)
    got = TorchPagedAttention().forward(query, kc, vc, meta, scale=0.25)
    assert all(b.shared is None for b in plan(meta, query.device)[1]), why
    want = naive(query, keys, values, query_lens, seq_lens, None, 0.25, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_no_shared_path_when_a_query_sits_inside_the_common_blocks(no_decode_kernel):
    # The second sequence is still computing part of the common blocks: the prefix is not whole for its queries.
    query, kc, vc, meta, keys, values = build_shared(6, [1, 20], [70, 70], 4, 64, True)
    got = TorchPagedAttention().forward(query, kc, vc, meta, scale=0.25)
    assert all(b.shared is None or b.shared.length <= 50 for b in plan(meta, query.device)[1])
    torch.testing.assert_close(
        got, naive(query, keys, values, [1, 20], [70, 70], None, 0.25, None), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize(("query_len", "seq_len"), [(1, 137), (1, 500), (20, 300), (33, 33)])
@pytest.mark.parametrize("window", [None, 64])
def test_one_sequence_gets_the_same_bits_wherever_the_pool_put_its_blocks(query_len, seq_len, window):
    """A batch of one sequence attends to exactly its visible keys, read as a view of the pool when its blocks are
    consecutive and gathered when the prefix cache recycled them: the same keys, so the same bits (the scattered case
    once went through the padded, masked bucket path and differed by up to 1.2e-7)."""
    block_size, kv_heads, q_heads, dim = 16, 2, 8, 64
    num_blocks = -(-seq_len // block_size)
    torch.manual_seed(0)
    keys, values = (
        torch.randn(num_blocks * block_size, kv_heads, dim),
        torch.randn(num_blocks * block_size, kv_heads, dim),
    )
    query = torch.randn(query_len, q_heads, dim)
    outputs = []
    for table in (list(range(num_blocks)), random.Random(1).sample(range(num_blocks), num_blocks)):
        key_cache = torch.zeros(num_blocks + 1, block_size, kv_heads, dim)
        value_cache = torch.zeros_like(key_cache)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(len(keys))])
        write_kv(key_cache, value_cache, keys, values, slots)
        meta = PagedAttentionMetadata.build(
            block_size=block_size, query_lens=[query_len], seq_lens=[seq_len], block_offsets=[0], tables=[table],
            slots=[slots[seq_len - query_len : seq_len].tolist()], sliding_window=window, pad_block=num_blocks,
        )  # fmt: skip
        outputs.append(TorchPagedAttention().forward(query, key_cache, value_cache, meta, scale=dim**-0.5))
    assert torch.equal(outputs[0], outputs[1])


def test_the_attention_comparison_script_runs_its_three_ways_to_the_same_outputs():
    """``scripts/attention_vs_contiguous.py`` (docs/benchmarks.md): the paged path, transformers' padded call and the
    packed contiguous one give the same attention at a small point (its table's last column)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "attention_vs_contiguous.py"
    args = [sys.executable, str(script), "--rows", "1,3", "--contexts", "64", "--rounds", "1"]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=120).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| 64 |")]
    assert [row[1].strip() for row in rows] == ["1", "3"]
    assert all(float(row[-1]) < 1e-5 for row in rows)


@pytest.mark.parametrize("length", [16, 100, 512])
def test_a_prompt_with_nothing_cached_attends_as_sdpa_causal_does(length):
    """One sequence whose queries are all its keys (a prompt with no prefix hit, full attention): SDPA's causal rule
    instead of a mask, which skips the hidden half of the scores (a 2048-token prompt's prefill 1.26x transformers'
    time before, 0.99x after; docs/benchmarks.md) and gives the very bits of transformers' own prefill call."""
    block_size, kv_heads, q_heads, dim = 16, 2, 8, 64
    num_blocks = -(-length // block_size)
    torch.manual_seed(length)
    key_cache = torch.randn(num_blocks + 1, block_size, kv_heads, dim)
    value_cache = torch.randn_like(key_cache)
    query = torch.randn(length, q_heads, dim)
    meta = PagedAttentionMetadata.build(
        block_size=block_size, query_lens=[length], seq_lens=[length], block_offsets=[0],
        tables=[list(range(num_blocks))], slots=[list(range(length))], sliding_window=None, pad_block=num_blocks,
    )  # fmt: skip
    out = TorchPagedAttention().forward(query, key_cache, value_cache, meta, scale=dim**-0.5)
    run = meta.backend_state[("torch-run", query.device)]
    assert run.causal and run.mask is None
    keys = key_cache.view(-1, kv_heads, dim)[:length].transpose(0, 1)[None]
    values = value_cache.view(-1, kv_heads, dim)[:length].transpose(0, 1)[None]
    want = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1)[None], keys, values, is_causal=True, scale=dim**-0.5, enable_gqa=True
    )
    assert torch.equal(out, want[0].transpose(0, 1))


def test_several_prompts_with_nothing_cached_each_attend_as_their_own_prefill(no_decode_kernel):
    """Fresh prompts of 64 tokens or more batched with decoding sequences, a shorter fresh prompt and a prompt over a
    cached prefix: each fresh prompt is attended alone under SDPA's causal rule (no padding to the longest, no mask),
    so its output is the very bits of its own prefill call, whatever else shares the forward; the prompt over a cached
    prefix is attended alone under its own mask; the decoding sequence and the short prompt keep buckets (one masked
    call for the short ones costs about as much as a call each)."""
    query_lens, seq_lens = [100, 1, 17, 5, 64], [100, 30, 17, 21, 64]
    query, key_cache, value_cache, meta, keys, values = build(7, query_lens, seq_lens, 16, None, q_heads=8, dim=32)
    out = TorchPagedAttention().forward(query, key_cache, value_cache, meta, scale=32**-0.5)
    alone, buckets, _ = plan(meta, query.device)
    starts = [0, 100, 101, 118, 123]
    assert [(start, run.causal) for start, _, run in alone] == [(0, True), (118, False), (123, True)]
    assert len(buckets) == 2  # the decoding sequence's, the short prompt's
    for i in (0, 4):
        q = query[starts[i] : starts[i] + query_lens[i]].transpose(0, 1)[None]
        k, v = keys[i].transpose(0, 1)[None], values[i].transpose(0, 1)[None]
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=32**-0.5, enable_gqa=True
        )
        assert torch.equal(out[starts[i] : starts[i] + query_lens[i]], want[0].transpose(0, 1)), i
    reference = naive(query, keys, values, query_lens, seq_lens, None, 32**-0.5, None)
    assert torch.allclose(out, reference, atol=1e-5)


def test_the_prefill_attention_script_runs_its_three_ways_to_the_same_outputs():
    """``scripts/prefill_attention.py`` (docs/benchmarks.md): the backend's sequences alone, the masked bucket and
    transformers' batched call give the same attention at small points, fresh and over a cached prefix (its table's
    last column)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "prefill_attention.py"
    for extra in ([], ["--ragged", "--cached", "40"]):
        args = [sys.executable, str(script), "--points", "2x64,3x80", "--rounds", "1", *extra]
        out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=120).stdout
        rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
        assert [row[0].strip() for row in rows] == ["2 x 64", "3 x 80"], extra
        assert all(float(row[-1]) < 1e-5 for row in rows), extra


@pytest.mark.parametrize("window", [None, 24])
def test_a_prefilling_sequence_gets_the_same_bits_whatever_else_shares_its_forward(window):
    """Batch invariance for prefills: a sequence prefilling over a cached prefix (or a prompt of 64 tokens or more
    with nothing cached) is attended by itself, to its own keys under its own mask, so its output is the same bits
    in a mixed batch as in a forward of its own (before, padded into the prefill bucket, they differed)."""
    query_lens, seq_lens = [30, 1, 70, 12, 3], [90, 41, 70, 100, 50]
    query, key_cache, value_cache, meta, *_ = build(11, query_lens, seq_lens, 16, window, q_heads=8, dim=32)
    batched = TorchPagedAttention().forward(query, key_cache, value_cache, meta, scale=32**-0.5)
    starts = [0, 30, 31, 101, 113]
    for i in (0, 2, 3, 4):
        table = meta.host_tables[i, : -(-seq_lens[i] // 16) - meta.block_offsets[i]].tolist()
        own = PagedAttentionMetadata.build(
            block_size=16, query_lens=[query_lens[i]], seq_lens=[seq_lens[i]], block_offsets=[meta.block_offsets[i]],
            tables=[table], slots=[[0] * query_lens[i]], sliding_window=window, pad_block=meta.pad_block,
        )  # fmt: skip
        rows = query[starts[i] : starts[i] + query_lens[i]]
        alone = TorchPagedAttention().forward(rows, key_cache, value_cache, own, scale=32**-0.5)
        assert torch.equal(batched[starts[i] : starts[i] + query_lens[i]], alone), i
