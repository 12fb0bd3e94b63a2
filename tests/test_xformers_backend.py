"""The xformers backend's construction, checked on CPU against the torch backend.

xformers' kernels need CUDA, but its attention biases work on CPU and ``.materialize()`` turns one into a dense
additive mask. So every bias the backend builds is checked by dense float32 attention of the packed queries over the
pool (or over the gathered keys) with the materialized mask, against ``TorchPagedAttention``. The whole forward
(the plan, the GQA views, the gathers and the output scatter) runs with :class:`DenseKernels` standing in for the
kernels. Cases: random pools with shuffled block tables, shared prefix blocks, GQA 8/2, decode and prefill rows with
a cached prefix in one batch, several page sizes, full attention and sliding windows with released leading blocks.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("xformers.ops.fmha", reason="xformers is not installed")

from pagedcore import PluginError, PluginManager, default_plugin_manager
from pagedcore.attention import PagedAttentionMetadata
from pagedcore.plugins import xformers_backend
from pagedcore.plugins.torch_backend import TorchPagedAttention
from pagedcore.plugins.xformers_backend import (
    Step,
    XFormersPagedAttention,
    build_attn_bias,
    build_gathered_keys,
    pagedcore_attention_backend,
    plan_steps,
)

Q_HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16
TOL = 1e-5


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


def reference(case: Case, softcap: float | None = None) -> torch.Tensor:
    scale = HEAD_DIM**-0.5
    meta = PagedAttentionMetadata(**{**vars(case.meta), "backend_state": {}})  # no shared cache with the tested side
    return TorchPagedAttention().forward(
        case.query, case.key_cache, case.value_cache, meta, scale=scale, softcap=softcap
    )


# ---------------------------------------------------------------- the dense oracle
def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Float32 attention of ``q (T, Hq, D)`` over ``k, v (L, Hkv, D)`` with an additive ``mask (T, L)``."""
    groups = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(groups, dim=1)
    v = v.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,lhd->htl", q.float(), k) * HEAD_DIM**-0.5 + mask
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

    Also checks the layout the backend hands a kernel: 5-D GQA views whose heads-per-group dim has stride 0.
    """

    def __init__(self, reject: tuple[str, ...] = ()) -> None:
        self.reject = set(reject)
        self.calls: list[tuple[str, str]] = []

    def supports(self, op: str, query: Any, key: Any, value: Any, bias: Any, scale: float) -> bool:
        return op not in self.reject

    def run(self, op: str, query: Any, key: Any, value: Any, bias: Any, scale: float) -> torch.Tensor:
        assert scale == HEAD_DIM**-0.5
        self.calls.append((op, type(bias).__name__))
        assert query.shape[:3] == (1, query.shape[1], KV_HEADS) and query.dim() == 5
        assert key.dim() == 5 and key.stride(3) == 0 and value.stride(3) == 0  # GQA expanded, not copied
        q = query[0].reshape(query.shape[1], Q_HEADS, HEAD_DIM)
        out = dense_attention(q, key[0, :, :, 0], value[0, :, :, 0], materialize(bias, key.shape[1]))
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


@pytest.mark.parametrize("per_query", [False, True])
@pytest.mark.parametrize(("bs", "name", "window"), BIAS_CASES)
def test_paged_bias_matches_torch_backend(bs: int, name: str, window: str | None, per_query: bool) -> None:
    case = make_case(bs * 7 + len(name), bs, scenario(name, bs), window_for(window, bs), share_prefix=True)
    bias = build_attn_bias(case.meta, "cpu", per_query=per_query)
    mask = materialize(bias, flat(case.key_cache).shape[0])
    out = dense_attention(case.query, flat(case.key_cache), flat(case.value_cache), mask)
    torch.testing.assert_close(out, reference(case), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("lag", [False, True])
@pytest.mark.parametrize("bs", [4, 16])
def test_sliding_bias_with_released_blocks(bs: int, lag: bool) -> None:
    case = make_case(3 + bs, bs, scenario("mixed", bs), bs + 3, lag=lag)
    assert any(case.meta.block_offsets)
    for per_query in (False, True):
        bias = build_attn_bias(case.meta, "cpu", per_query=per_query)
        mask = materialize(bias, flat(case.key_cache).shape[0])
        out = dense_attention(case.query, flat(case.key_cache), flat(case.value_cache), mask)
        torch.testing.assert_close(out, reference(case), atol=TOL, rtol=TOL)


@pytest.mark.parametrize(("bs", "name", "window"), BIAS_CASES)
def test_gathered_keys_match_torch_backend(bs: int, name: str, window: str | None) -> None:
    case = make_case(bs * 5 + len(name), bs, scenario(name, bs), window_for(window, bs))
    gathered = build_gathered_keys(case.meta, "cpu")
    keys = flat(case.key_cache)[gathered.slots]
    values = flat(case.value_cache)[gathered.slots]
    out = dense_attention(case.query, keys, values, materialize(gathered.bias, len(gathered.slots)))
    torch.testing.assert_close(out, reference(case), atol=TOL, rtol=TOL)


def test_bias_types_and_pieces() -> None:
    bs = 4
    full = make_case(0, bs, [(1, 9), (3, 7)]).meta
    bias = build_attn_bias(full, "cpu")
    assert type(bias).__name__ == "PagedBlockDiagonalCausalWithOffsetPaddedKeysMask"
    assert bias.k_seqinfo.seqlen_py == [9, 7] and bias.q_seqinfo.seqstart_py == [0, 1, 4]
    assert build_attn_bias(full, "cpu") is bias  # cached on the metadata

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
    assert [op for op, _ in kernels.calls] == [xformers_backend._XFORMERS_OP_MODULE[op] for op in backend.last_ops]
    # A second layer reuses the plan, the biases and the gathers.
    state = dict(case.meta.backend_state)
    backend.forward(case.query, case.key_cache, case.value_cache, case.meta, scale=HEAD_DIM**-0.5)
    assert all(case.meta.backend_state[k] is v for k, v in state.items())


@pytest.mark.parametrize(
    ("reject", "expected"),
    [
        (("triton_splitk",), ("flash", "flash")),  # the paged step falls back to a gather
        (("triton_splitk", "flash"), ("cutlass", "cutlass")),
        (("triton_splitk", "flash", "cutlass"), ("torch", "torch")),
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


def test_forward_checks_the_token_count() -> None:
    case = make_case(2, 4, scenario("decode", 4))
    backend = XFormersPagedAttention(DenseKernels(), flash_paged=False)
    with pytest.raises(ValueError, match="tokens"):
        backend.forward(case.query[:-1], case.key_cache, case.value_cache, case.meta, scale=1.0)


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


def test_plugin_manager_prefers_xformers_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(xformers_backend, "xformers_available", lambda: True)
    assert PluginManager().attention_backend("cuda", torch.float16).name == "xformers"


def test_module_imports_without_touching_xformers() -> None:
    import subprocess
    import sys

    code = "import sys, pagedcore.plugins.xformers_backend; print('xformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
