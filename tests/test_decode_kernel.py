"""The decode attention kernel (pagedcore.plugins.decode_kernel) against a naive per-query reference, alone and as
the torch backend runs it: head counts and sizes, block sizes, windows, chunks, dropped blocks, scattered tables,
batch invariance, leftovers in the pool, the Engine's tokens, and where it does not serve."""

from __future__ import annotations

import pytest
import torch
from models import tiny_model
from test_torch_backend import build, naive, plan

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.plugins import decode_kernel as decode_kernel_module
from pagedcore.plugins import torch_backend
from pagedcore.plugins.decode_kernel import DecodeKernel, DecodeRows, load
from pagedcore.plugins.torch_backend import TorchPagedAttention

KERNEL = load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the decode kernel is not built here")


def decoding(seed, seq_lens, block_size, window=None, kv_heads=2, q_heads=8, dim=64, chunk=None):
    """A decode step (one query per sequence) over shuffled blocks, with its naive reference."""
    query_lens = [1] * len(seq_lens)
    query, kc, vc, meta, keys, values = build(
        seed, query_lens, seq_lens, block_size, window, kv_heads, q_heads, dim, chunk=chunk
    )
    scale = dim**-0.5
    want = naive(query, keys, values, query_lens, seq_lens, window, scale, None, chunk=chunk)
    return query, kc, vc, meta, scale, want


@needs_kernel
@pytest.mark.parametrize(
    ("kv_heads", "q_heads", "dim"),
    [(2, 8, 64), (1, 1, 64), (4, 4, 128), (1, 12, 32), (2, 6, 24), (1, 16, 8), (3, 24, 80), (2, 4, 256)],
)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_the_kernel_matches_the_naive_reference(kv_heads, q_heads, dim, block_size):
    """Grouped, multi-head and one-head layouts (query heads per KV head a multiple of four, or not: 1, 3, 4, 8, 12,
    16), head sizes multiples of 8 with and without a 16 in them, lengths that are and are not multiples of the
    block size and of 8."""
    seq_lens = [1, 7, 8, 9, 33, 130, 517]
    query, kc, vc, meta, scale, want = decoding(3, seq_lens, block_size, None, kv_heads, q_heads, dim)
    out = torch.empty_like(query)
    KERNEL.attend(query, kc, vc, DecodeRows.of(meta, list(range(len(seq_lens)))), scale, out)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize(("window", "chunk"), [(5, None), (64, None), (None, 16), (None, 48)])
def test_the_kernel_reads_only_the_window_or_the_chunk(window, chunk):
    """A sliding window's or a chunk's first visible key, with the blocks before it given back (block offsets)."""
    query, kc, vc, meta, scale, want = decoding(4, [3, 40, 97, 300], 16, window, chunk=chunk)
    assert any(meta.block_offsets)  # dropped blocks: the tables start later
    out = torch.empty_like(query)
    KERNEL.attend(query, kc, vc, DecodeRows.of(meta, [0, 1, 2, 3]), scale, out)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)


@needs_kernel
def test_values_of_another_size_than_the_keys():
    """Value heads of another size (MLA-like layouts): 64-column passes and a remainder of 8."""
    torch.manual_seed(0)
    block_size, seq_lens, dim, dv = 4, [5, 23, 70], 32, 72
    blocks = [-(-n // block_size) for n in seq_lens]
    kc = torch.randn(sum(blocks) + 1, block_size, 2, dim)
    vc = torch.randn(sum(blocks) + 1, block_size, 2, dv)
    ids = torch.randperm(sum(blocks)).tolist()
    tables, start = [], 0
    for count in blocks:
        tables.append(ids[start : start + count])
        start += count
    from pagedcore.attention import PagedAttentionMetadata

    meta = PagedAttentionMetadata.build(
        block_size=block_size, query_lens=[1, 1, 1], seq_lens=seq_lens, block_offsets=[0, 0, 0], tables=tables,
        slots=[[0]] * 3, sliding_window=None, pad_block=sum(blocks),
    )  # fmt: skip
    query = torch.randn(3, 8, dim)
    out = torch.empty(3, 8, dv)
    KERNEL.attend(query, kc, vc, DecodeRows.of(meta, [0, 1, 2]), 0.2, out)
    for i, (table, n) in enumerate(zip(tables, seq_lens)):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        k = kc.view(-1, 2, dim)[slots].transpose(0, 1)  # (kv_heads, n, dim)
        v = vc.view(-1, 2, dv)[slots].transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(query[i][:, None], k, v, scale=0.2, enable_gqa=True)
        torch.testing.assert_close(out[i], want[:, 0], atol=2e-6, rtol=1e-5)


@needs_kernel
def test_the_backend_runs_it_for_decoding_rows_beside_prefills():
    """A forward of decoding sequences and prefills: the decoding rows go to the kernel (they join no bucket), the
    others keep the backend's ways, and every row matches the reference."""
    query_lens, seq_lens = [1, 6, 1, 4, 70, 1], [40, 6, 3, 19, 70, 200]
    query, kc, vc, meta, keys, values = build(5, query_lens, seq_lens, 16, None, dim=64)
    out = TorchPagedAttention().forward(query, kc, vc, meta, scale=0.125)
    _, buckets, rows = plan(meta, query.device)
    assert rows is not None and rows.rows.tolist() == [0, 7, 82]  # the decoding rows' packed positions
    assert all(not set(bucket.out_index.tolist()) & {0, 7, 82} for bucket in buckets)
    want = naive(query, keys, values, query_lens, seq_lens, None, 0.125, None)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)


@needs_kernel
def test_a_row_gets_the_same_bits_whatever_shares_the_step_and_wherever_its_blocks_are():
    """Each (sequence, KV head) is one task that reads its keys in position order: batch invariance, and no
    dependence on where the pool put the blocks."""
    query, kc, vc, meta, scale, _ = decoding(6, [90, 13, 250], 16)
    backend = TorchPagedAttention()
    together = backend.forward(query, kc, vc, meta, scale=scale)
    for i, n in enumerate([90, 13, 250]):
        table = meta.host_tables[i, : -(-n // 16)].tolist()
        from pagedcore.attention import PagedAttentionMetadata

        alone = PagedAttentionMetadata.build(
            block_size=16, query_lens=[1], seq_lens=[n], block_offsets=[0], tables=[table], slots=[[0]],
            sliding_window=None, pad_block=meta.pad_block,
        )  # fmt: skip
        assert torch.equal(backend.forward(query[i : i + 1], kc, vc, alone, scale=scale), together[i : i + 1]), i
        moved_k, moved_v = torch.zeros_like(kc), torch.zeros_like(vc)
        fresh = list(range(len(table)))  # the same keys in other (consecutive) blocks
        moved_k[fresh], moved_v[fresh] = kc[table], vc[table]
        there = PagedAttentionMetadata.build(
            block_size=16, query_lens=[1], seq_lens=[n], block_offsets=[0], tables=[fresh], slots=[[0]],
            sliding_window=None, pad_block=meta.pad_block,
        )  # fmt: skip
        moved = backend.forward(query[i : i + 1], moved_k, moved_v, there, scale=scale)
        assert torch.equal(moved, together[i : i + 1]), i


@needs_kernel
def test_what_the_pool_holds_past_a_rows_length_is_never_read():
    """A block's slots past the sequence's length and the pad block may hold an earlier owner's NaN or Inf: the
    kernel reads exactly the visible keys, so they change nothing."""
    query, kc, vc, meta, scale, want = decoding(7, [5, 21, 30], 16)
    for i, n in enumerate([5, 21, 30]):
        last = int(meta.host_tables[i, (n - 1) // 16])
        kc[last, n % 16 :] = float("nan")
        vc[last, n % 16 :] = float("inf")
    kc[meta.pad_block], vc[meta.pad_block] = float("nan"), float("nan")
    out = TorchPagedAttention().forward(query, kc, vc, meta, scale=scale)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)


@needs_kernel
def test_a_nan_in_a_visible_key_or_value_makes_its_rows_output_nan_as_sdpa_does():
    """A NaN the model wrote into a visible key or value is not skipped: that row's output is NaN, as SDPA's (and
    transformers' generate's) would be; the other rows are untouched."""
    for where in ("key", "value"):
        query, kc, vc, meta, scale, want = decoding(10, [20, 35], 4)
        cache = kc if where == "key" else vc
        cache[int(meta.host_tables[0, 2]), 1, 0, 3] = float("nan")  # position 9 of the first row
        out = TorchPagedAttention().forward(query, kc, vc, meta, scale=scale)
        assert out[0].isnan().any(), where
        torch.testing.assert_close(out[1], want[1], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "case", ["float64", "softcap", "sinks", "heads-first pool", "head size 12", "autograd", "dispatch mode"]
)
def test_where_it_does_not_serve_the_backend_keeps_its_own_ways(case, monkeypatch):
    """Each case the kernel does not serve runs the gather-and-SDPA way, with the reference's numbers."""
    dim = 12 if case == "head size 12" else 16
    query, kc, vc, meta, keys, values = build(8, [1, 1], [30, 45], 4, None, dim=dim)
    softcap = 5.0 if case == "softcap" else None
    sinks = torch.randn(8) if case == "sinks" else None
    if case == "float64":
        query, kc, vc = query.double(), kc.double(), vc.double()
        keys, values = [k.double() for k in keys], [v.double() for v in values]
    if case == "heads-first pool":  # a permuted view, as kv_layout="heads" stores it
        kc = kc.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
        vc = vc.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    if case == "autograd":
        query.requires_grad_(True)
    used = []
    monkeypatch.setattr(DecodeKernel, "attend", lambda *args: used.append(1))
    want = naive(query.detach(), keys, values, [1, 1], [30, 45], None, dim**-0.5, softcap, sinks)
    backend = TorchPagedAttention()
    if case == "dispatch mode":
        from torch.utils._python_dispatch import TorchDispatchMode

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        with Record():
            out = backend.forward(query, kc, vc, meta, scale=dim**-0.5, softcap=softcap, sinks=sinks)
    else:
        out = backend.forward(query, kc, vc, meta, scale=dim**-0.5, softcap=softcap, sinks=sinks)
    assert not used
    torch.testing.assert_close(out.detach(), want, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_the_engine_decodes_through_it_with_transformers_tokens():
    """The Engine's decode steps (one sequence, and several) go through the kernel and give the greedy tokens of
    transformers' own generate."""
    model = tiny_model("llama", seed=4)
    calls = []
    attend = DecodeKernel.attend

    def counted(self, *args, **kwargs):
        calls.append(1)
        return attend(self, *args, **kwargs)

    prompts = [[5, 9, 2, 7, 1, 3], [8, 8, 1], [4] * 20]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecodeKernel, "attend", counted)
        engine = Engine(model, num_blocks=32, block_size=4)
        outs = engine.generate(prompts, params, use_tqdm=False)
        alone = engine.generate(prompts[:1], params, use_tqdm=False)
    assert calls
    for prompt, out in zip(prompts + prompts[:1], outs + alone):
        ids = torch.tensor([prompt])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        assert out.outputs[0].token_ids == want[0, len(prompt) :].tolist()


def test_it_is_not_built_where_it_cannot_serve(monkeypatch):
    monkeypatch.setattr(decode_kernel_module, "_LOADED", [])
    monkeypatch.setenv("PAGEDCORE_DECODE_KERNEL", "0")
    assert load() is None
    monkeypatch.setattr(decode_kernel_module, "_LOADED", [])
    monkeypatch.delenv("PAGEDCORE_DECODE_KERNEL")
    from pagedcore import c_library

    monkeypatch.setattr(c_library.shutil, "which", lambda name: None)  # no C compiler
    assert load() is None
    monkeypatch.setattr(torch_backend, "load_decode_kernel", lambda: None)
    query, kc, vc, meta, keys, values = build(9, [1], [20], 4, None)
    out = TorchPagedAttention().forward(query, kc, vc, meta, scale=0.25)  # the backend's own way
    torch.testing.assert_close(out, naive(query, keys, values, [1], [20], None, 0.25, None), atol=1e-5, rtol=1e-5)
