"""The xformers backend's construction, checked on CPU against the torch backend; its install checks and defaults.

xformers' kernels need CUDA, but its attention biases work on CPU and ``.materialize()`` turns one into a dense
additive mask. So every bias the backend builds is checked by dense float32 attention of the packed queries over the
pool (or over the gathered keys) with the materialized mask, against ``TorchPagedAttention``. The whole forward
(the plan, the shape buckets, the GQA views, the gathers and the output scatter) runs with :class:`DenseKernels`
standing in for the kernels. Cases: random pools with shuffled block tables, shared prefix blocks, GQA 8/2, decode and
prefill rows with a cached prefix in one batch, several page sizes, full attention and sliding windows with released
leading blocks. Then: the shapes a long decode hands ``triton_splitk`` (few, for few compiles), one metadata build
per forward of a multi-layer model, the fallback when a kernel raises, the install diagnosis, the CUDA runtime
preload, and the default block size per device.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from models import tiny_model
from paged_checks import assert_same_generation, dynamic, generate, release_and_check
from transformers import LlamaForCausalLM

from pagedcore import PluginError, PluginManager, default_plugin_manager
from pagedcore.adapters.transformers import Engine, PagedCache, PagedKVPool, enable
from pagedcore.adapters.transformers import disable as disable_prefix_caching
from pagedcore.attention import CPU_BLOCK_SIZE, CUDA_BLOCK_SIZE, PagedAttentionMetadata, default_block_size
from pagedcore.attention_kinds import ChunkedAttention
from pagedcore.hookspecs import hookimpl
from pagedcore.plugins import xformers_backend
from pagedcore.plugins.torch_backend import TorchPagedAttention
from pagedcore.plugins.xformers import runtime
from pagedcore.plugins.xformers.plan import MIN_ROWS, MIN_WIDTH, SPLITK_PAGE_MULTIPLE, bucket
from pagedcore.plugins.xformers.runtime import PreloadResult, elf_dependencies
from pagedcore.plugins.xformers.status import PROBE_CASES, Environment, diagnose, environment, install_plan
from pagedcore.plugins.xformers_backend import (
    Step,
    XFormersPagedAttention,
    build_attn_bias,
    build_gathered_keys,
    pagedcore_attention_backend,
    plan_steps,
    xformers_status,
)

if importlib.util.find_spec("xformers") is None:  # not importorskip: importing xformers first defeats the preload
    pytest.skip("xformers is not installed (make install EXTRAS=xformers)", allow_module_level=True)

Q_HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16
TOL = 1e-5
ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- random cases
@dataclass
class Case:
    query: torch.Tensor  # (num_tokens, Q_HEADS, HEAD_DIM)
    key_cache: torch.Tensor  # (num_blocks + 1, block_size, KV_HEADS, HEAD_DIM), last block zero
    value_cache: torch.Tensor
    meta: PagedAttentionMetadata


def make_case(
    seed: int,
    block_size: int,
    rows: list[tuple[int, int]],
    window: int | None = None,
    *,
    lag: bool = False,
    share_prefix: bool = False,
    chunk: int | None = None,
) -> Case:
    """A random pool and metadata for ``rows`` of ``(query_len, seq_len)``.

    Physical blocks are shuffled. In a sliding group each row has released the blocks that left the window of its
    first query (``lag``: one block fewer, as between two release points). ``share_prefix``: the second row reads the
    first row's full blocks before both rows' queries, as after a prefix-cache hit.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    offsets = []
    for q_len, seq_len in rows:
        offset = 0 if window is None else max(0, seq_len - q_len - window + 1) // block_size
        if chunk is not None:  # the blocks before the first query's chunk were given back
            offset = (seq_len - q_len) // chunk * chunk // block_size
        offsets.append(max(0, offset - 1) if lag else offset)
    live = [-(-seq_len // block_size) - off for (_, seq_len), off in zip(rows, offsets)]
    num_blocks = sum(live) + 3  # a few blocks no table holds
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in live]
    if share_prefix and len(rows) > 1 and offsets[0] == offsets[1] == 0:
        full = min(rows[0][1] - rows[0][0], rows[1][1] - rows[1][0]) // block_size
        tables[1][:full] = tables[0][:full]
    slots = [
        [tables[r][p // block_size - offsets[r]] * block_size + p % block_size for p in range(seq_len - q_len, seq_len)]
        for r, (q_len, seq_len) in enumerate(rows)
    ]
    meta = PagedAttentionMetadata.build(
        block_size=block_size,
        query_lens=[q for q, _ in rows],
        seq_lens=[s for _, s in rows],
        block_offsets=offsets,
        tables=tables,
        slots=slots,
        sliding_window=window,
        pad_block=num_blocks,
        kind=None if chunk is None else ChunkedAttention(chunk),
    )
    shape = (num_blocks + 1, block_size, KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=gen)
    value_cache = torch.randn(shape, generator=gen)
    key_cache[num_blocks] = 0
    value_cache[num_blocks] = 0
    query = torch.randn(meta.num_tokens, Q_HEADS, HEAD_DIM, generator=gen)
    return Case(query, key_cache, value_cache, meta)


def scenario(name: str, bs: int) -> list[tuple[int, int]]:
    """Rows ``(query_len, seq_len)`` scaled to the page size, so that windows release whole blocks."""
    return {
        "decode": [(1, 2 * bs + 5), (1, 5), (1, 3 * bs), (1, bs + 1)],
        "prefill": [(7, 2 * bs + 3), (12, 12), (bs + 2, 2 * bs + 9)],
        "mixed": [(1, 3 * bs + 5), (9, 2 * bs + 1), (1, 3), (16, bs + 17), (1, bs)],
        "spec": [(4, 2 * bs + 6), (4, 4), (4, bs + 3)],  # equal short query lengths (speculative decoding)
    }[name]


def fresh(meta: PagedAttentionMetadata) -> PagedAttentionMetadata:
    """The same metadata without anything a backend derived from it."""
    return PagedAttentionMetadata(**{**vars(meta), "backend_state": {}})


def reference(case: Case, softcap: float | None = None) -> torch.Tensor:
    scale = HEAD_DIM**-0.5
    return TorchPagedAttention().forward(
        case.query, case.key_cache, case.value_cache, fresh(case.meta), scale=scale, softcap=softcap
    )


# ---------------------------------------------------------------- the dense oracle
def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Float32 attention of ``q (T, Hq, D)`` over ``k, v (L, Hkv, D)`` with an additive ``mask (T, L)``."""
    groups = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(groups, dim=1)
    v = v.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,lhd->htl", q.float(), k) * scale + mask
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), v)


def materialize(bias: Any, num_keys: int) -> torch.Tensor:
    """The dense ``(num_queries, num_keys)`` mask of a paged bias (columns = pool slots) or a non-paged one."""
    num_queries = bias.q_seqinfo.seqstart_py[-1]
    if not hasattr(bias, "block_tables"):
        return bias.materialize((num_queries, num_keys))
    tables = bias.block_tables
    mask = bias.materialize((num_queries, tables.shape[0] * tables.shape[1] * bias.page_size))
    full = torch.full((num_queries, num_keys), -math.inf)
    full[:, : mask.shape[1]] = mask  # materialize stops at the highest block a table holds
    return full


def flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(-1, *cache.shape[2:])  # (slots, Hkv, D)


class DenseKernels:
    """Stands in for xformers' kernels on CPU: materializes the bias and runs dense attention.

    Also checks the layout the backend hands a kernel: with GQA, 5-D views whose heads-per-group dim has stride 0.
    ``reject``: ops whose ``supports`` says no; ``fail``: ops whose ``run`` raises (a kernel failing at run time).
    """

    def __init__(self, reject: tuple[str, ...] = (), fail: tuple[str, ...] = ()) -> None:
        self.reject = set(reject)
        self.fail = set(fail)
        self.calls: list[tuple[str, str, tuple[int, ...]]] = []
        self.checks: list[str] = []

    def supports(self, op: str, query: Any, key: Any, value: Any, bias: Any, scale: float) -> bool:
        self.checks.append(op)
        return op not in self.reject

    def run(self, op: str, query: Any, key: Any, value: Any, bias: Any, scale: float) -> torch.Tensor:
        self.calls.append((op, type(bias).__name__, tuple(query.shape)))
        if op in self.fail:
            raise RuntimeError(f"triton: out of resources in {op} (a stand-in failure)")
        if query.dim() == 5:  # GQA: [1, T, Hkv, R, D], keys expanded over R, not copied
            assert key.dim() == 5 and key.stride(3) == 0 and value.stride(3) == 0
            q, k, v = query[0].flatten(1, 2), key[0, :, :, 0], value[0, :, :, 0]
        else:
            q, k, v = query[0], key[0], value[0]
        out = dense_attention(q, k, v, materialize(bias, k.shape[0]), scale)
        return out.reshape(*query.shape[:-1], value.shape[-1]).to(query.dtype)


# ---------------------------------------------------------------- the biases against the torch backend
BIAS_CASES = [
    (bs, name, window)
    for bs in (4, 16, 64)
    for name in ("decode", "prefill", "mixed")
    for window in (None, "short", "long")
]


def window_for(kind: str | None, bs: int) -> int | None:
    return {None: None, "short": 5, "long": bs + 3}[kind]


def attend_with_bias(case: Case, bias: Any) -> torch.Tensor:
    """Dense attention of the case's queries (zero-padded to the bias's query count) under ``bias``; real rows only."""
    padded = bias.q_seqinfo.seqstart_py[-1]
    query = torch.cat([case.query, case.query.new_zeros(padded - case.meta.num_tokens, *case.query.shape[1:])])
    mask = materialize(bias, flat(case.key_cache).shape[0])
    out = dense_attention(query, flat(case.key_cache), flat(case.value_cache), mask, HEAD_DIM**-0.5)
    return out[: case.meta.num_tokens]


@pytest.mark.parametrize("per_query", [False, True])
@pytest.mark.parametrize(("bs", "name", "window"), BIAS_CASES)
def test_paged_bias_matches_torch_backend(bs: int, name: str, window: str | None, per_query: bool) -> None:
    case = make_case(bs * 7 + len(name), bs, scenario(name, bs), window_for(window, bs), share_prefix=True)
    out = attend_with_bias(case, build_attn_bias(case.meta, "cpu", per_query=per_query))
    torch.testing.assert_close(out, reference(case), atol=TOL, rtol=TOL)


@pytest.mark.parametrize(("bs", "name", "window"), [c for c in BIAS_CASES if c[1] == "decode"])
def test_padded_bias_matches_torch_backend(bs: int, name: str, window: str | None) -> None:
    """Bucket padding adds rows that attend to the zero pad block and widens the tables; the real rows are exact."""
    case = make_case(bs + 3, bs, scenario(name, bs), window_for(window, bs))
    bias = build_attn_bias(case.meta, "cpu", pad=True)
    assert bias.q_seqinfo.seqstart_py[-1] == MIN_ROWS and bias.block_tables.shape[1] == MIN_WIDTH
    assert bias.block_tables[case.meta.num_seqs :].unique().tolist() == [case.meta.pad_block]
    torch.testing.assert_close(attend_with_bias(case, bias), reference(case), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("lag", [False, True])
@pytest.mark.parametrize("bs", [4, 16])
def test_sliding_bias_with_released_blocks(bs: int, lag: bool) -> None:
    case = make_case(3 + bs, bs, scenario("mixed", bs), bs + 3, lag=lag)
    assert any(case.meta.block_offsets)
    for per_query in (False, True):
        out = attend_with_bias(case, build_attn_bias(case.meta, "cpu", per_query=per_query))
        torch.testing.assert_close(out, reference(case), atol=TOL, rtol=TOL)


@pytest.mark.parametrize(("bs", "name", "window"), BIAS_CASES)
def test_gathered_keys_match_torch_backend(bs: int, name: str, window: str | None) -> None:
    case = make_case(bs * 5 + len(name), bs, scenario(name, bs), window_for(window, bs))
    gathered = build_gathered_keys(case.meta, "cpu")
    keys = flat(case.key_cache)[gathered.slots]
    values = flat(case.value_cache)[gathered.slots]
    mask = materialize(gathered.bias, len(gathered.slots))
    out = dense_attention(case.query, keys, values, mask, HEAD_DIM**-0.5)
    torch.testing.assert_close(out, reference(case), atol=TOL, rtol=TOL)


def test_bias_types_and_pieces() -> None:
    bs = 4
    full = make_case(0, bs, [(1, 9), (3, 7)]).meta
    bias = build_attn_bias(full, "cpu")
    assert type(bias).__name__ == "PagedBlockDiagonalCausalWithOffsetPaddedKeysMask"
    assert bias.k_seqinfo.seqlen_py == [9, 7] and bias.q_seqinfo.seqstart_py == [0, 1, 4]

    # Window 4, row (5, 14): queries 9..13, one block released (keys 4.. are live): query 9 sees 6..9, and so on.
    sliding = make_case(0, bs, [(1, 10), (5, 14)], window=4).meta
    assert sliding.block_offsets == [1, 1]
    bias = build_attn_bias(sliding, "cpu")
    assert type(bias).__name__ == "PagedBlockDiagonalCausalWithOffsetGappyKeysMask"
    assert bias.q_seqinfo.seqstart_py == [0, 1, 2, 3, 4, 5, 6]  # the decode row, then one piece per query
    assert bias.k_seqinfo.seqstart_py[:-1] == [2, 2, 3, 4, 5, 6]  # row-local starts (position - 4)
    assert bias.k_seqinfo.seqlen_py == [6, 6, 7, 8, 9, 10]  # row-local ends

    # Queries within the window of the first key share one causal piece.
    early = make_case(0, bs, [(6, 6), (2, 9)], window=8).meta
    bias = build_attn_bias(early, "cpu")
    assert bias.q_seqinfo.seqstart_py == [0, 6, 7, 8]  # row 1: query 7 shares keys 0..7, query 8 sees 1..8
    assert bias.k_seqinfo.seqstart_py[:-1] == [0, 0, 1]

    per_query = build_attn_bias(full, "cpu", per_query=True)
    assert type(per_query).__name__ == "PagedBlockDiagonalGappyKeysMask"
    assert per_query.q_seqinfo.max_seqlen == 1 and per_query.q_seqinfo.seqstart_py[-1] == 4


def test_rows_without_queries_are_left_out() -> None:
    case = make_case(1, 4, [(0, 6), (2, 9), (0, 3), (1, 5)], window=6)
    bias = build_attn_bias(case.meta, "cpu")
    assert bias.q_seqinfo.seqstart_py[-1] == case.meta.num_tokens == 3
    backend = XFormersPagedAttention(DenseKernels(), flash_paged=False)
    out = backend.forward(case.query, case.key_cache, case.value_cache, case.meta, scale=HEAD_DIM**-0.5)
    torch.testing.assert_close(out, reference(case), atol=TOL, rtol=TOL)


# ---------------------------------------------------------------- the plan
def steps(
    bs: int, name: str, window: int | None = None, flash: bool = False
) -> list[tuple[str, tuple[int, ...], bool]]:
    meta = make_case(0, bs, scenario(name, bs), window).meta
    return [(s.op, s.rows, s.per_query) for s in plan_steps(meta, flash_paged=flash)]


def test_plan_rule() -> None:
    splitk, flash, gather = "triton_splitk", "flash_paged", "gather"
    # Small pages: no paged op applies.
    assert steps(16, "decode") == [(gather, (0, 1, 2, 3), False)]
    assert steps(16, "mixed", flash=True) == [(gather, (0, 1, 2, 3, 4), False)]
    # Pages of 64: triton_splitk for decode (and equal short query lengths); mixed batches are split.
    assert steps(64, "decode") == [(splitk, (0, 1, 2, 3), False)]
    assert steps(64, "decode", window=40) == [(splitk, (0, 1, 2, 3), False)]
    assert steps(64, "spec") == [(splitk, (0, 1, 2), False)]
    assert steps(64, "spec", window=40) == [(splitk, (0, 1, 2), True)]  # one piece per query: not causal
    assert steps(64, "mixed") == [(splitk, (0, 2, 4), False), (gather, (1, 3), False)]
    assert steps(64, "prefill") == [(gather, (0, 1, 2), False)]
    # Pages of 256: FA2 paged for full attention when flash_attn is installed; never for windows.
    assert steps(256, "mixed", flash=True) == [(flash, (0, 1, 2, 3, 4), False)]
    assert steps(256, "prefill", flash=True) == [(flash, (0, 1, 2), False)]
    assert steps(256, "decode", flash=True) == [(splitk, (0, 1, 2, 3), False)]
    assert steps(256, "mixed") == [(splitk, (0, 2, 4), False), (gather, (1, 3), False)]
    assert steps(256, "mixed", window=300, flash=True) == [(splitk, (0, 2, 4), False), (gather, (1, 3), False)]
    assert Step("gather", (1,)).per_query is False


def test_bucket_sizes() -> None:
    assert [bucket(n, 8) for n in (1, 7, 8, 9, 16, 17, 200)] == [8, 8, 8, 16, 16, 32, 256]
    assert [bucket(n, 1) for n in (1, 2, 3, 5)] == [1, 2, 4, 8]


# ---------------------------------------------------------------- the whole forward, with dense kernels
FORWARD_CASES = [
    (bs, name, window, flash)
    for bs, flash in ((4, False), (64, False), (256, True))
    for name in ("decode", "mixed", "spec")
    for window in (None, "long")
]


@pytest.mark.parametrize(("bs", "name", "window", "flash"), FORWARD_CASES)
def test_forward_matches_torch_backend(bs: int, name: str, window: str | None, flash: bool) -> None:
    case = make_case(bs + len(name), bs, scenario(name, bs), window_for(window, bs), share_prefix=True)
    kernels = DenseKernels()
    backend = XFormersPagedAttention(kernels, flash_paged=flash)
    out = backend.forward(case.query, case.key_cache, case.value_cache, case.meta, scale=HEAD_DIM**-0.5)
    torch.testing.assert_close(out, reference(case), atol=TOL, rtol=TOL)
    planned = [s.op for s in backend.plan(case.meta)]
    assert list(backend.last_ops) == [op if op != "gather" else "flash" for op in planned]
    assert [op for op, _, _ in kernels.calls] == list(backend.last_ops)
    for op, _, shape in kernels.calls:  # triton_splitk launches are padded to a bucket of rows
        if op == "triton_splitk":
            assert shape[1] in {bucket(n, MIN_ROWS) * q for n in range(1, 40) for q in (1, 4)}
    # A second layer reuses the plan, the biases and the gathers, and asks no kernel whether it supports anything.
    state = dict(case.meta.backend_state)
    checks = len(kernels.checks)
    backend.forward(case.query, case.key_cache, case.value_cache, case.meta, scale=HEAD_DIM**-0.5)
    assert all(case.meta.backend_state[k] is v for k, v in state.items())
    assert len(kernels.checks) == checks and backend.stats.metadata_builds == 1


@pytest.mark.parametrize(
    ("reject", "expected"),
    [
        (("triton_splitk",), ("flash", "flash")),  # the paged step falls back to a gather
        (("triton_splitk", "flash"), ("cutlass", "cutlass")),
        (("triton_splitk", "flash", "cutlass"), ("torch",)),
    ],
)
def test_unsupported_ops_fall_back(reject: tuple[str, ...], expected: tuple[str, ...]) -> None:
    case = make_case(11, 64, scenario("mixed", 64), 67)
    backend = XFormersPagedAttention(DenseKernels(reject), flash_paged=False)
    out = backend.forward(case.query, case.key_cache, case.value_cache, case.meta, scale=HEAD_DIM**-0.5)
    assert backend.last_ops == expected
    torch.testing.assert_close(out, reference(case), atol=TOL, rtol=TOL)


def test_softcap_delegates_to_torch() -> None:
    case = make_case(5, 16, scenario("mixed", 16))
    kernels = DenseKernels()
    backend = XFormersPagedAttention(kernels, flash_paged=False)
    out = backend.forward(case.query, case.key_cache, case.value_cache, case.meta, scale=HEAD_DIM**-0.5, softcap=5.0)
    assert backend.last_ops == ("torch",) and kernels.calls == []
    torch.testing.assert_close(out, reference(case, softcap=5.0), atol=TOL, rtol=TOL)


CHUNK_CASES = [(bs, name, chunk) for bs in (4, 16, 64) for name in ("decode", "prefill", "mixed") for chunk in (8, 24)]


@pytest.mark.parametrize(("bs", "name", "chunk"), CHUNK_CASES)
def test_chunked_attention_biases_and_gathers_match_torch_backend(bs: int, name: str, chunk: int) -> None:
    """Llama 4's chunks: the paged biases' per-sequence key starts, and a gather step's queries cut at their chunk
    boundaries (chunks aligned with the pages or not)."""
    chunk = chunk if bs < chunk else bs * 2
    case = make_case(bs * 3 + chunk, bs, scenario(name, bs), chunk=chunk)
    want = reference(case)
    for per_query in (False, True):
        out = attend_with_bias(case, build_attn_bias(case.meta, "cpu", per_query=per_query))
        torch.testing.assert_close(out, want, atol=TOL, rtol=TOL)
    gathered = build_gathered_keys(case.meta, "cpu")
    mask = materialize(gathered.bias, len(gathered.slots))
    keys, values = flat(case.key_cache)[gathered.slots], flat(case.value_cache)[gathered.slots]
    torch.testing.assert_close(
        dense_attention(case.query, keys, values, mask, HEAD_DIM**-0.5), want, atol=TOL, rtol=TOL
    )
    backend = XFormersPagedAttention(DenseKernels(), flash_paged=True)
    out = backend.forward(case.query, case.key_cache, case.value_cache, case.meta, scale=HEAD_DIM**-0.5)
    torch.testing.assert_close(out, want, atol=TOL, rtol=TOL)
    assert "torch" not in backend.last_ops and "flash_paged" not in backend.last_ops  # FA2 paged has no key starts


@pytest.mark.parametrize(("bs", "name"), [(4, "mixed"), (64, "decode"), (64, "mixed")])
def test_an_mla_latent_pool_matches_torch_backend(bs: int, name: str) -> None:
    """An MLA layer's pool as paged attention hands it over: one KV head whose keys are the latent rows (latent +
    rotary key) and whose values are a view of their latent part (strided, narrower than the keys)."""
    rows = scenario(name, bs)
    case = make_case(bs + 17, bs, rows)
    latent = torch.randn(case.key_cache.shape[0], bs, 1, 24, generator=torch.Generator().manual_seed(bs))
    latent[case.meta.pad_block] = 0
    keys, values = latent, latent[..., :16]
    query = torch.randn(case.meta.num_tokens, Q_HEADS, 24)
    backend = XFormersPagedAttention(DenseKernels(), flash_paged=False)
    out = backend.forward(query, keys, values, case.meta, scale=24**-0.5)
    want = TorchPagedAttention().forward(query, keys, values, fresh(case.meta), scale=24**-0.5)
    assert out.shape == (case.meta.num_tokens, Q_HEADS, 16) and "torch" not in backend.last_ops
    torch.testing.assert_close(out, want, atol=TOL, rtol=TOL)


def test_sinks_delegate_to_torch() -> None:
    """xformers' kernels have no sink logit: a gpt-oss layer's forward runs on the torch backend, counted."""
    case = make_case(6, 64, scenario("decode", 64))
    kernels = DenseKernels()
    backend = XFormersPagedAttention(kernels, flash_paged=False)
    sinks = torch.randn(Q_HEADS)
    out = backend.forward(case.query, case.key_cache, case.value_cache, case.meta, scale=HEAD_DIM**-0.5, sinks=sinks)
    assert backend.last_ops == ("torch",) and kernels.calls == [] and backend.stats.torch_forwards == 1
    want = TorchPagedAttention().forward(
        case.query, case.key_cache, case.value_cache, fresh(case.meta), scale=HEAD_DIM**-0.5, sinks=sinks
    )
    torch.testing.assert_close(out, want, atol=TOL, rtol=TOL)
    assert not torch.allclose(out, reference(case), atol=1e-3)


def test_forward_checks_the_token_count() -> None:
    case = make_case(2, 4, scenario("decode", 4))
    backend = XFormersPagedAttention(DenseKernels(), flash_paged=False)
    with pytest.raises(ValueError, match="tokens"):
        backend.forward(case.query[:-1], case.key_cache, case.value_cache, case.meta, scale=1.0)


# ---------------------------------------------------------------- Triton compiles: shape buckets over a long decode
class ShapeKernels:
    """Kernels that only record what they are handed (fast: a 1000-step decode)."""

    def __init__(self) -> None:
        self.shapes: set[tuple[Any, ...]] = set()

    def supports(self, op: str, query: Any, key: Any, value: Any, bias: Any, scale: float) -> bool:
        return True

    def run(self, op: str, query: Any, key: Any, value: Any, bias: Any, scale: float) -> torch.Tensor:
        # triton_splitk's tl.constexpr arguments: Z (bias rows), the table width (and N_CTX_K = width * page),
        # N_CTX_Q (from the query shape); the rest are fixed by the model.
        rows = len(bias.k_seqinfo.seqlen_py)
        self.shapes.add((op, rows, bias.block_tables.shape[1], tuple(query.shape)))
        return query.new_zeros(*query.shape[:-1], value.shape[-1])


def test_a_long_decode_hands_triton_few_shapes() -> None:
    """1000 decode steps, the batch between 1 and 40 sequences that come and go, contexts growing to ~1600 tokens:
    unpadded, the (rows, table width) pairs would number in the hundreds (one Triton compile each)."""
    rng = random.Random(0)
    page, num_blocks = SPLITK_PAGE_MULTIPLE, 2000
    key_cache = torch.zeros(num_blocks + 1, page, KV_HEADS, HEAD_DIM)
    kernels = ShapeKernels()
    backend = XFormersPagedAttention(kernels, flash_paged=False)
    running: list[list[int]] = []  # per sequence: [seq_len, steps left]
    target, unpadded = 1, set()
    for _ in range(1000):
        target = min(40, max(1, target + rng.choice((-3, -1, 0, 1, 3))))
        while len(running) < target:
            running.append([rng.randint(1, 600), rng.randint(50, 1000)])
        running = [seq for seq in running if seq[1] > 0][:target] or [[rng.randint(1, 600), 100]]
        for seq in running:
            seq[0], seq[1] = seq[0] + 1, seq[1] - 1
        tables = [[rng.randrange(num_blocks) for _ in range(-(-n // page))] for n, _ in running]
        meta = PagedAttentionMetadata.build(
            block_size=page,
            query_lens=[1] * len(running),
            seq_lens=[n for n, _ in running],
            block_offsets=[0] * len(running),
            tables=tables,
            slots=[[t[-1] * page + (n - 1) % page] for t, (n, _) in zip(tables, running)],
            sliding_window=None,
            pad_block=num_blocks,
        )
        query = torch.zeros(len(running), Q_HEADS, HEAD_DIM)
        backend.forward(query, key_cache, key_cache, meta, scale=1.0)
        assert backend.last_ops == ("triton_splitk",)
        unpadded.add((len(running), max(len(t) for t in tables)))
    rows = {shape[1] for shape in kernels.shapes}
    widths = {shape[2] for shape in kernels.shapes}
    assert rows <= {8, 16, 32, 64} and widths <= {4, 8, 16, 32}
    assert len(kernels.shapes) <= 12 < 100 < len(unpadded)
    assert len(backend.stats.launch_shapes) == len(kernels.shapes)
    assert backend.stats.support_checks == 1 and backend.stats.metadata_builds == 1000


# ---------------------------------------------------------------- one metadata build per forward, in a real model
class OfferBackend:
    """A plugin offering one backend instance for every device and dtype."""

    def __init__(self, backend: XFormersPagedAttention) -> None:
        self.backend = backend

    @hookimpl
    def pagedcore_attention_backend(self, device_type: str, dtype: Any, name: str | None) -> Any:
        return self.backend


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family", ["llama", "mistral"])  # full attention; a sliding window that releases blocks
def test_multi_layer_forward_builds_metadata_once(family: str) -> None:
    kernels = DenseKernels()
    backend = XFormersPagedAttention(kernels, flash_paged=False)
    manager = PluginManager()
    manager.register(OfferBackend(backend), name="dense-xformers")
    layers, new_tokens = 4, 12
    model = tiny_model(family, attn_implementation="paged", num_hidden_layers=layers)
    reference_model = tiny_model(family, num_hidden_layers=layers)
    ids = torch.randint(3, 256, (1, 21), generator=torch.Generator().manual_seed(1))
    pool = PagedKVPool(model, num_blocks=8, block_size=64, plugins=manager)
    cache = PagedCache(model, pool=pool)
    # the construction-time probe (probe.py) ran its own forwards through the backend: count from here
    builds, calls, checks = backend.stats.metadata_builds, len(kernels.calls), len(kernels.checks)
    got = generate(model, cache, input_ids=ids, max_new_tokens=new_tokens, do_sample=False)
    want = generate(
        reference_model, dynamic(reference_model), input_ids=ids, max_new_tokens=new_tokens, do_sample=False
    )
    assert_same_generation(got, want)
    forwards = new_tokens  # the prompt, then one decode step per further token
    assert backend.stats.metadata_builds - builds == forwards * len(pool.kv.groups)
    launched = kernels.calls[calls:]
    assert len(launched) == forwards * layers  # one launch per layer: prefill on flash, decode on triton_splitk
    assert {op for op, _, _ in launched} == {"flash", "triton_splitk"}
    assert backend.stats.support_checks == len(kernels.checks)
    assert len(kernels.checks) - checks <= 2 * len(pool.kv.groups)
    release_and_check(cache)


# ---------------------------------------------------------------- a failing kernel
def test_a_failing_kernel_falls_back_to_torch_and_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    case = make_case(21, 64, scenario("decode", 64))
    kernels = DenseKernels(fail=("triton_splitk",))
    backend = XFormersPagedAttention(kernels, flash_paged=False)
    scale = HEAD_DIM**-0.5
    with caplog.at_level(logging.DEBUG, logger="pagedcore.plugins.xformers.backend"):
        out = backend.forward(case.query, case.key_cache, case.value_cache, case.meta, scale=scale)
        torch.testing.assert_close(out, reference(case), atol=TOL, rtol=TOL)
        assert backend.last_ops == ("torch",) and backend.stats.kernel_failures == 1
        # The next layer of the same forward goes straight to torch.
        calls = len(kernels.calls)
        backend.forward(case.query, case.key_cache, case.value_cache, case.meta, scale=scale)
        assert len(kernels.calls) == calls and backend.last_ops == ("torch",)
        # The next forward does not retry the op for inputs of this shape: its step gathers and runs flash.
        out = backend.forward(case.query, case.key_cache, case.value_cache, fresh(case.meta), scale=scale)
        assert backend.last_ops == ("flash",) and backend.stats.kernel_failures == 1
        torch.testing.assert_close(out, reference(case), atol=TOL, rtol=TOL)
        # Another failure is counted, and logged at DEBUG only.
        kernels.fail.add("flash")
        out = backend.forward(case.query, case.key_cache, case.value_cache, fresh(case.meta), scale=scale)
        torch.testing.assert_close(out, reference(case), atol=TOL, rtol=TOL)
    assert backend.stats.kernel_failures == 2 and backend.stats.torch_forwards == 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "triton_splitk" in warnings[0].getMessage()


def test_out_of_memory_is_not_swallowed() -> None:
    class OutOfMemory(DenseKernels):
        def run(self, op: str, *args: Any) -> torch.Tensor:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (a stand-in)")

    case = make_case(22, 64, scenario("decode", 64))
    backend = XFormersPagedAttention(OutOfMemory(), flash_paged=False)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        backend.forward(case.query, case.key_cache, case.value_cache, case.meta, scale=1.0)


# ---------------------------------------------------------------- the plugin hook
def test_hook_declines_cpu_other_names_and_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pagedcore_attention_backend(device_type="cpu", dtype=torch.float16, name=None) is None
    assert pagedcore_attention_backend(device_type="cpu", dtype=torch.float16, name="xformers") is None
    monkeypatch.setattr(xformers_backend, "xformers_available", lambda: True)
    assert pagedcore_attention_backend(device_type="cuda", dtype=torch.float16, name="torch") is None
    assert pagedcore_attention_backend(device_type="cuda", dtype=torch.float32, name=None) is None
    backend = pagedcore_attention_backend(device_type="cuda", dtype=torch.bfloat16, name="xformers")
    assert isinstance(backend, XFormersPagedAttention) and backend.name == "xformers"


def test_hook_declines_cuda_without_working_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(xformers_backend, "xformers_available", lambda: False)
    assert pagedcore_attention_backend(device_type="cuda", dtype=torch.float16, name=None) is None


def test_plugin_manager_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_plugin_manager().attention_backend("cpu", torch.float32).name == "torch"
    assert default_plugin_manager().attention_backend("cpu", torch.float16).name == "torch"
    with pytest.raises(PluginError, match="xformers"):
        default_plugin_manager().attention_backend("cpu", torch.float16, name="xformers")
    monkeypatch.setattr(xformers_backend, "xformers_available", lambda: True)  # as on a GPU with xformers
    pm = PluginManager()
    assert pm.attention_backend("cuda", torch.float16, name="xformers").name == "xformers"
    assert pm.attention_backend("cuda", torch.float16, name="torch").name == "torch"
    assert pm.attention_backend("cuda", torch.float32).name == "torch"
    assert pm.attention_backend("cuda", torch.float16).name == "xformers"


def test_module_imports_without_touching_xformers() -> None:
    code = "import sys, pagedcore.plugins.xformers_backend; print('xformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# ---------------------------------------------------------------- why xformers is (not) usable, and the install
def env(**changes: Any) -> Environment:
    """A CUDA 13 machine with xformers 0.0.35 and triton but without the CUDA 12 runtime wheel."""
    base = Environment(
        torch_version="2.13.0",
        torch_cuda="13.0",
        cuda_devices=1,
        device_name="NVIDIA H200",
        capability=(9, 0),
        triton_version="3.6.0",
        xformers_version="0.0.35",
        xformers_built_for="torch 2.10.0+cu128, CUDA 12.8",
        needed_runtime="libcudart.so.12",
        runtime_wheel=None,
        flash_attn_version=None,
    )
    return Environment(**{**vars(base), **changes})


def test_this_machine_says_precisely_why_xformers_is_unavailable() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: tests/test_xformers_gpu.py checks the status there")
    status = xformers_status()
    assert not status.available and status.ops == ()
    if torch.version.cuda is None:
        assert (
            status.reason
            == f"torch {torch.__version__} is a CPU build (torch.version.cuda is None): xformers needs CUDA"
        )
    else:
        assert status.reason.startswith("no CUDA device is visible")
    assert not xformers_backend.xformers_available()


def test_the_status_probe_plans_a_splitk_decode_and_a_gather_prefill() -> None:
    """Regression (the first GPU run): the probe's prefill had 5 queries, which triton_splitk takes, so the status
    read "prefill: triton_splitk" and never ran flash, the op real prefills use."""
    plans = {}
    for name, (query_lens, seq_lens, tables, slots) in PROBE_CASES.items():
        meta = PagedAttentionMetadata.build(
            block_size=64, query_lens=query_lens, seq_lens=seq_lens, block_offsets=[0] * len(tables),
            tables=tables, slots=slots, sliding_window=None, pad_block=5,
        )  # fmt: skip
        for row, (table, row_slots) in enumerate(zip(tables, slots, strict=True)):
            first = seq_lens[row] - query_lens[row]
            positions = range(first, seq_lens[row])
            assert row_slots == [table[p // 64] * 64 + p % 64 for p in positions]
        plans[name] = [step.op for step in plan_steps(meta, flash_paged=False)]
    assert plans == {"decode": ["triton_splitk"], "prefill": ["gather"]}


def test_the_installed_wheel_needs_the_cuda_12_runtime() -> None:
    """The finding behind the preload, read from the installed xformers: its library needs libcudart.so.12."""
    facts = environment()
    library = runtime.xformers_library_path()
    assert library is not None and facts.xformers_version is not None
    if facts.xformers_version == "0.0.35":
        assert facts.needed_runtime == "libcudart.so.12"
        assert facts.xformers_built_for == "torch 2.10.0+cu128, CUDA 12.8"
    if shutil.which("readelf"):
        out = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
        needed = [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]
        assert list(elf_dependencies(library).needed) == needed


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, ["pip install nvidia-cuda-runtime-cu12"]),
        ({"runtime_wheel": "/site/nvidia/cuda_runtime/lib/libcudart.so.12"}, []),
        ({"torch_cuda": "12.8"}, []),  # a CUDA 12 torch loads the runtime itself
        ({"torch_cuda": None, "cuda_devices": 0}, ["install a CUDA build of torch", "with a torch built for another"]),
        (
            {"xformers_version": None, "needed_runtime": None},
            ["make install EXTRAS=gpu in the pagedcore checkout"],
        ),
        ({"triton_version": None, "torch_cuda": "12.8"}, ["pip install triton"]),
    ],
)
def test_install_plan(changes: dict[str, Any], expected: list[str]) -> None:
    steps = install_plan(env(**changes))
    assert len(steps) == len(expected) and all(s.startswith(e) for s, e in zip(steps, expected)), steps


def test_the_gpu_install_pair_provides_what_the_wheel_needs() -> None:
    """The ``gpu`` extra pins the xformers whose library was read, with the CUDA runtime wheel that library needs,
    and ``make EXTRAS=all,gpu install`` installs it after the chosen torch."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert "xformers==0.0.35" in extra
    facts = environment()
    if facts.xformers_version == "0.0.35":
        major = facts.needed_runtime.rsplit(".", 1)[-1] if facts.needed_runtime else None
        assert any(req.startswith(f"nvidia-cuda-runtime-cu{major}") for req in extra), (facts.needed_runtime, extra)
    dry_run = subprocess.run(
        ["make", "-n", "install", "EXTRAS=all,gpu", "TORCH=torch==2.13.0"], cwd=ROOT, capture_output=True, text=True
    )
    if dry_run.returncode == 0:  # `make` present
        lines = dry_run.stdout.splitlines()
        torch_line = next(i for i, line in enumerate(lines) if '"torch==2.13.0"' in line)
        assert torch_line < next(i for i, line in enumerate(lines) if '-e ".[all,gpu]"' in line)


def test_diagnosis_names_the_cause_and_the_fix() -> None:
    error = "OSError: libcudart.so.12: cannot open shared object file: No such file or directory"
    status = diagnose(env(), load_error=error, preload=PreloadResult("libcudart.so.12", "not found"))
    assert not status.available
    assert "libcudart.so.12: cannot open" in status.reason and "refuses CUDA tensors" in status.reason
    assert "fix: pip install nvidia-cuda-runtime-cu12" in status.reason
    late = PreloadResult(None, "skipped", error="xformers was imported before pagedcore's xformers backend")
    status = diagnose(env(runtime_wheel="/x/libcudart.so.12"), load_error=error, preload=late)
    assert "imported before" in status.reason and "import pagedcore's xformers backend before xformers" in status.reason
    assert diagnose(env(xformers_version=None)).reason.startswith("xformers is not installed")
    assert diagnose(env(cuda_devices=0)).reason == "no CUDA device is visible (torch 2.13.0, CUDA 13.0)"
    ok = diagnose(env(), probe={"decode": ("triton_splitk",), "prefill": ("flash",)})
    assert (
        ok.available and ok.ops == ("triton_splitk", "flash") and ok.reason == "decode: triton_splitk, prefill: flash"
    )
    partly = diagnose(env(), probe={"decode": ("torch",), "prefill": ("flash",)})
    assert partly.available and partly.reason.startswith("partly")
    assert not diagnose(env(), probe={"decode": ("torch",), "prefill": ("torch",)}).available
    assert "failed its check" in diagnose(env(), probe_error="AssertionError: mismatch").reason


def test_cli_plugins_prints_the_xformers_line(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedcore.cli import main

    assert main(["plugins"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("xformers: "))
    assert xformers_status().reason in line and "softcap models (Gemma2) always use the torch backend" in line


FAKE_GPU_PLUGIN = """
import torch
torch.cuda.is_available = lambda: True  # collection only: every test fails in its fixture before touching CUDA
from pagedcore.plugins import xformers_backend
from pagedcore.plugins.xformers.status import XFormersStatus
xformers_backend.xformers_status = lambda: XFormersStatus(False, "stand-in: libcudart.so.12 did not load")
"""


@pytest.mark.parametrize("allow", [False, True])
def test_gpu_tests_fail_rather_than_skip_when_xformers_cannot_run(tmp_path: Path, allow: bool) -> None:
    """On a CUDA machine where xformers' kernels do not run, the GPU test module fails every test with the reason
    (it used to skip itself, green); PAGEDCORE_ALLOW_NO_XFORMERS=1 turns that into one skip with the reason."""
    (tmp_path / "fake_gpu_machine.py").write_text(FAKE_GPU_PLUGIN)
    environ = {**os.environ, "PYTHONPATH": str(tmp_path), "PAGEDCORE_ALLOW_NO_XFORMERS": "1" if allow else "0"}
    command = [sys.executable, "-m", "pytest", "tests/test_xformers_gpu.py", "-q", "-rs", "-p", "fake_gpu_machine"]
    command += ["-p", "no:cacheprovider", "-k", "status or softcap or head_dims"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=environ)
    summary = result.stdout.strip().splitlines()[-1]
    if allow:
        assert result.returncode in (0, 5) and "1 skipped" in summary and "failed" not in summary, result.stdout
        assert "PAGEDCORE_ALLOW_NO_XFORMERS=1 and xformers cannot run: stand-in" in result.stdout
    else:
        assert result.returncode == 1 and "skipped" not in summary, result.stdout
        failed = sum(int(n) for n in re.findall(r"(\d+) (?:failed|errors?)\b", summary))  # fails in setup: errors
        assert failed >= 10 and "passed" not in summary
        assert "the xformers backend cannot run: stand-in: libcudart.so.12 did not load" in result.stdout


FAKE_RUNTIME = "int fake_cudart(void) { return 12; }\n"


@pytest.fixture
def fake_cuda_runtime(tmp_path: Path) -> Path:
    """An import path entry holding ``nvidia/cuda_runtime/lib/libcudart.so.12`` (a stand-in with that soname), laid
    out as the nvidia-cuda-runtime-cu12 wheel lays it out."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a stand-in libcudart.so.12")
    lib = tmp_path / "nvidia" / "cuda_runtime" / "lib"
    lib.mkdir(parents=True)
    source = tmp_path / "fake.c"
    source.write_text(FAKE_RUNTIME)
    target = lib / "libcudart.so.12"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-Wl,-soname,libcudart.so.12", "-o", str(target), str(source)], check=True
    )
    assert elf_dependencies(target).soname == "libcudart.so.12"
    return tmp_path


def run_import(search: Path, *, xformers_first: bool = False) -> list[str]:
    """In a fresh interpreter that pretends torch is a CUDA 13 build: import xformers through pagedcore with
    ``search`` on the import path; print the preload's action and the innermost library load error."""
    code = f"""
import sys, torch
sys.path.insert(0, {str(search)!r})
torch.version.cuda = "13.0"
{"import xformers" if xformers_first else ""}
from pagedcore.plugins.xformers.runtime import import_xformers, preload_result
from pagedcore.plugins.xformers.status import _load_error
import_xformers("xformers")  # the top-level import loads its library
print(preload_result().action)
print(_load_error())
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return result.stdout.splitlines()


@pytest.mark.skipif(torch.version.cuda is not None, reason="the CPU build of torch lacks libc10_cuda.so, on purpose")
def test_preloading_the_runtime_satisfies_the_libcudart_dependency(fake_cuda_runtime: Path, tmp_path: Path) -> None:
    """xformers' real library, loaded by xformers' real import: without a runtime wheel the loader stops at
    libcudart.so.12; with the preload it gets past it to the next library (libc10_cuda.so, which a CUDA build of
    torch provides and this CPU build does not)."""
    action, error = run_import(tmp_path / "empty")
    assert action == "not found" and "libcudart.so.12: cannot open shared object file" in error
    action, error = run_import(fake_cuda_runtime)
    assert action == "loaded" and "libcudart.so.12" not in error and "libc10_cuda.so" in error
    action, error = run_import(fake_cuda_runtime, xformers_first=True)  # too late: nothing loaded
    assert action == "skipped" and "libcudart.so.12: cannot open shared object file" in error


# ---------------------------------------------------------------- the default block size per device
def test_default_block_size_per_device_and_backend() -> None:
    assert default_block_size("cpu") == default_block_size("cpu", "xformers") == CPU_BLOCK_SIZE == 16
    assert default_block_size("cuda") == default_block_size("cuda:1", "xformers") == CUDA_BLOCK_SIZE == 64
    assert default_block_size(torch.device("cuda"), "torch") == CPU_BLOCK_SIZE  # the torch backend gathers
    assert CUDA_BLOCK_SIZE % SPLITK_PAGE_MULTIPLE == 0  # triton_splitk reads the pool in place


@pytest.mark.usefixtures("one_thread")
def test_pools_take_the_block_size_of_the_models_device() -> None:
    model = tiny_model("llama")
    assert PagedKVPool(model, num_blocks=4).block_size == CPU_BLOCK_SIZE
    assert PagedKVPool(model.config, num_blocks=4).block_size == CPU_BLOCK_SIZE  # a config: no device, the CPU's
    assert PagedKVPool(model, num_blocks=4, block_size=8).block_size == 8
    assert PagedCache(model, num_blocks=4).pool.block_size == CPU_BLOCK_SIZE
    with mock.patch.object(LlamaForCausalLM, "device", new=torch.device("cuda")):  # pools allocate lazily
        assert PagedKVPool(model, num_blocks=4).block_size == CUDA_BLOCK_SIZE
        assert PagedCache(model, num_blocks=4).pool.block_size == CUDA_BLOCK_SIZE
        engine = Engine(model, num_blocks=4)
        assert engine.pool.block_size == CUDA_BLOCK_SIZE
        engine.close()
        assert enable(model, num_blocks=4).block_size == CUDA_BLOCK_SIZE
        disable_prefix_caching(model)
