"""The xformers backend on a GPU: its forward against the torch backend in fp16 and bf16, and the ops it runs.

Skipped without CUDA, or where xformers' kernels do not run. Run with ``pytest -m gpu tests/test_xformers_gpu.py``;
``python tests/test_xformers_gpu.py`` prints timings of both backends (a report, not a test).
Cases: random pools with shuffled block tables, GQA (32/8, head dim 128) and MHA (8/8, head dim 64), decode, prefill
over a cached prefix, both in one batch, short equal query lengths, full attention and sliding windows with released
leading blocks, page sizes 16, 64 and 256.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("xformers.ops.fmha", reason="xformers is not installed")

from pagedcore.attention import AttentionBackend, PagedAttentionMetadata
from pagedcore.plugins.torch_backend import TorchPagedAttention
from pagedcore.plugins.xformers_backend import XFormersPagedAttention, xformers_available

if not xformers_available():
    pytest.skip("xformers' kernels do not run on this GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 4e-2}  # atol = rtol, against a float32 torch reference


@dataclass
class Case:
    query: torch.Tensor  # (num_tokens, q_heads, head_dim)
    key_cache: torch.Tensor  # (num_blocks + 1, page, kv_heads, head_dim), last block zero
    value_cache: torch.Tensor
    meta: PagedAttentionMetadata


def make_case(
    seed: int,
    page: int,
    rows: list[tuple[int, int]],
    window: int | None,
    *,
    heads: tuple[int, int, int] = (32, 8, 128),
    dtype: torch.dtype = torch.float16,
) -> Case:
    """Random pool and metadata for ``rows`` of ``(query_len, seq_len)``; shuffled blocks; in a sliding group the
    blocks that left the first query's window are released. ``heads`` = (query heads, KV heads, head dim)."""
    q_heads, kv_heads, head_dim = heads
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    offsets = [0 if window is None else max(0, s - q - window + 1) // page for q, s in rows]
    live = [-(-s // page) - off for (_, s), off in zip(rows, offsets)]
    num_blocks = sum(live) + 2
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in live]
    slots = [
        [tables[r][p // page - offsets[r]] * page + p % page for p in range(s - q, s)] for r, (q, s) in enumerate(rows)
    ]
    meta = PagedAttentionMetadata.build(
        block_size=page,
        query_lens=[q for q, _ in rows],
        seq_lens=[s for _, s in rows],
        block_offsets=offsets,
        tables=tables,
        slots=slots,
        sliding_window=window,
        pad_block=num_blocks,
        device="cuda",
    )
    shape = (num_blocks + 1, page, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    value_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    key_cache[num_blocks] = 0
    value_cache[num_blocks] = 0
    query = torch.randn(meta.num_tokens, q_heads, head_dim, generator=gen, device="cuda", dtype=dtype)
    return Case(query, key_cache, value_cache, meta)


def scenario(name: str, page: int) -> list[tuple[int, int]]:
    return {
        "decode": [(1, 3 * page + 5), (1, 7), (1, 2 * page), (1, page + 1)],
        "prefill": [(37, 2 * page + 40), (20, 20), (page + 2, 2 * page + 9)],
        "mixed": [(1, 3 * page + 5), (9, 2 * page + 1), (1, 3), (16, page + 17), (1, page)],
        "spec": [(4, 2 * page + 6), (4, 4), (4, page + 3)],
    }[name]


def expected_plan(page: int, name: str, sliding: bool, flash_paged: bool) -> list[str]:
    """The module docstring's rule, written out per page size and phase."""
    if page % 64 == 0 and name in ("decode", "spec"):
        return ["triton_splitk"]
    if flash_paged and not sliding and page % 256 == 0:
        return ["flash_paged"]
    if page % 64 == 0 and name == "mixed":
        return ["triton_splitk", "gather"]
    return ["gather"]


def fresh(meta: PagedAttentionMetadata) -> PagedAttentionMetadata:
    return PagedAttentionMetadata(**{**vars(meta), "backend_state": {}})


CASES = [
    (page, name, window)
    for page in (16, 64, 256)
    for name in ("decode", "prefill", "mixed", "spec")
    for window in (None, "sliding")
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("page", "name", "window"), CASES)
def test_forward_matches_torch_backend(page: int, name: str, window: str | None, dtype: torch.dtype) -> None:
    sliding = page + 7 if window else None
    case = make_case(page + len(name), page, scenario(name, page), sliding, dtype=dtype)
    scale = case.query.shape[-1] ** -0.5
    backend = XFormersPagedAttention()
    out = backend.forward(case.query, case.key_cache, case.value_cache, case.meta, scale=scale)
    torch.cuda.synchronize()

    # The ops: the planned ones, and no paged step fell back (a gather step runs on flash or cutlass).
    planned = [step.op for step in backend.plan(case.meta)]
    assert planned == expected_plan(page, name, sliding is not None, backend.flash_paged)
    for step_op, ran in zip(planned, backend.last_ops):
        assert ran in (("flash", "cutlass") if step_op == "gather" else (step_op,)), backend.last_ops

    tol = TOLERANCE[dtype]
    full = TorchPagedAttention().forward(
        case.query.float(), case.key_cache.float(), case.value_cache.float(), fresh(case.meta), scale=scale
    )
    torch.testing.assert_close(out.float(), full, atol=tol, rtol=tol)
    same_dtype = TorchPagedAttention().forward(
        case.query, case.key_cache, case.value_cache, fresh(case.meta), scale=scale
    )
    torch.testing.assert_close(out, same_dtype, atol=2 * tol, rtol=2 * tol)


@pytest.mark.parametrize("page", [16, 64, 256])
def test_mha_and_released_blocks(page: int) -> None:
    case = make_case(7, page, scenario("mixed", page), 2 * page + 3, heads=(8, 8, 64))
    assert any(case.meta.block_offsets)
    scale = 0.125
    backend = XFormersPagedAttention()
    out = backend.forward(case.query, case.key_cache, case.value_cache, case.meta, scale=scale)
    assert "torch" not in backend.last_ops
    full = TorchPagedAttention().forward(
        case.query.float(), case.key_cache.float(), case.value_cache.float(), fresh(case.meta), scale=scale
    )
    torch.testing.assert_close(out.float(), full, atol=5e-3, rtol=5e-3)


def test_softcap_runs_on_torch() -> None:
    case = make_case(3, 64, scenario("decode", 64), None)
    backend = XFormersPagedAttention()
    out = backend.forward(case.query, case.key_cache, case.value_cache, case.meta, scale=0.1, softcap=30.0)
    expected = TorchPagedAttention().forward(
        case.query, case.key_cache, case.value_cache, fresh(case.meta), scale=0.1, softcap=30.0
    )
    assert backend.last_ops == ("torch",)
    torch.testing.assert_close(out, expected)


# ---------------------------------------------------------------- timings (a report, not a test)
def time_forward(backend: AttentionBackend, case: Case, iters: int = 20) -> float:
    """Milliseconds per forward (one layer) of ``backend`` on ``case``, plan and biases already cached."""
    forward = backend.forward
    scale = case.query.shape[-1] ** -0.5
    for _ in range(3):
        forward(case.query, case.key_cache, case.value_cache, case.meta, scale=scale)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        forward(case.query, case.key_cache, case.value_cache, case.meta, scale=scale)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def print_timings(dtype: torch.dtype = torch.float16) -> None:
    """Print per-layer forward times of the torch and xformers backends for each page size and phase."""
    print(f"{'page':>5} {'phase':>8} {'window':>7} {'torch ms':>9} {'xformers ms':>12}  ops")
    for page in (16, 64, 256):
        for name in ("decode", "prefill", "mixed"):
            for window in (None, page + 7):
                rows = [(q, s * 8) for q, s in scenario(name, page)]  # longer contexts than the tests
                case = make_case(0, page, rows, window, dtype=dtype)
                xformers = XFormersPagedAttention()
                t_torch = time_forward(TorchPagedAttention(), Case(**{**vars(case), "meta": fresh(case.meta)}))
                t_xformers = time_forward(xformers, case)
                ops = ",".join(xformers.last_ops)
                print(f"{page:>5} {name:>8} {window or '-'!s:>7} {t_torch:>9.3f} {t_xformers:>12.3f}  {ops}")


if __name__ == "__main__":
    print_timings()
