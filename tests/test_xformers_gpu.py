"""The xformers backend on a GPU: which xformers op runs each case, and its output against the torch backend.

Without CUDA the module is skipped, with the reason :func:`xformers_status` gives. With CUDA every test **fails**
(an error in its setup) when xformers' kernels cannot run, with the reason and what to install, unless
``PAGEDCORE_ALLOW_NO_XFORMERS=1`` turns that into a skip: a GPU machine must not pass by testing nothing.

Cases: random pools with shuffled block tables, metadata built on the CPU and moved as the caches move it; fp16 and
bf16; GQA 32/8 with head dim 128, MHA 8/8 with head dim 64, head dims 80/96/256; decode, prefill over a cached
prefix, both in one batch, equal short query lengths (speculative rows); full attention and sliding windows whose
leading blocks were released; 1 to 256 sequences; contexts up to 8k tokens; pages of 16, 64 and 256. Each output is
compared with the torch backend in float32 (the reference). Expected ops: ``triton_splitk`` for decode at pages of
64 and 256 (head dims it takes: 16..512 powers of two), ``flash`` (gathered keys) for prefill and for what splitk
does not take, ``flash_paged`` where the ``flash_attn`` package is installed (pages of 256, full attention).

Run: ``pytest -m gpu tests/test_xformers_gpu.py``; ``python tests/test_xformers_gpu.py`` prints per-layer timings
of both backends (a report, not a test).
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

import pytest
import torch

from pagedcore.attention import AttentionBackend, PagedAttentionMetadata
from pagedcore.plugins.torch_backend import TorchPagedAttention
from pagedcore.plugins.xformers_backend import XFormersPagedAttention, xformers_status

STATUS = xformers_status()
if not torch.cuda.is_available():
    pytest.skip(f"needs a CUDA device: {STATUS.reason}", allow_module_level=True)
ALLOW_NO_XFORMERS = os.environ.get("PAGEDCORE_ALLOW_NO_XFORMERS") == "1"
if not STATUS.available and ALLOW_NO_XFORMERS:
    pytest.skip(f"PAGEDCORE_ALLOW_NO_XFORMERS=1 and xformers cannot run: {STATUS.reason}", allow_module_level=True)

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 4e-2}  # atol = rtol, against a float32 torch reference
SPLITK_HEAD_DIMS = {16, 32, 64, 128, 256, 512}
GQA, MHA = (32, 8, 128), (8, 8, 64)  # (query heads, KV heads, head dim)


@pytest.fixture(autouse=True)
def _xformers_must_run() -> None:
    if not STATUS.available:
        pytest.fail(f"CUDA is present but the xformers backend cannot run: {STATUS.reason}", pytrace=False)


@dataclass
class Case:
    query: torch.Tensor  # (num_tokens, q_heads, head_dim)
    key_cache: torch.Tensor  # (num_blocks + 1, page, kv_heads, head_dim), last block zero
    value_cache: torch.Tensor
    meta: PagedAttentionMetadata  # on the GPU, moved from the CPU as a cache moves it (host tables kept)


def make_case(
    seed: int,
    page: int,
    rows: list[tuple[int, int]],
    window: int | None,
    *,
    heads: tuple[int, int, int] = GQA,
    dtype: torch.dtype = torch.float16,
) -> Case:
    """Random pool and metadata for ``rows`` of ``(query_len, seq_len)``; shuffled blocks; in a sliding group the
    blocks that left the first query's window are released."""
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
    ).to(torch.device("cuda", torch.cuda.current_device()))
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


def expected_ops(page: int, name: str, head_dim: int, sliding: bool, flash_paged: bool) -> tuple[str, ...]:
    """The ops each step runs, written out from the rule in ``pagedcore.plugins.xformers.plan``."""
    splitk = page % 64 == 0 and head_dim in SPLITK_HEAD_DIMS
    paged_flash = flash_paged and not sliding and page % 256 == 0
    if page % 64 == 0 and name in ("decode", "spec"):
        return ("triton_splitk",) if splitk else ("flash",)
    if paged_flash:
        return ("flash_paged",)
    if page % 64 == 0 and name == "mixed":
        return ("triton_splitk" if splitk else "flash", "flash")
    return ("flash",)


def fresh(meta: PagedAttentionMetadata) -> PagedAttentionMetadata:
    return PagedAttentionMetadata(**{**vars(meta), "backend_state": {}})


def check(case: Case, expected: tuple[str, ...], *, softcap: float | None = None) -> XFormersPagedAttention:
    """Run the xformers backend on ``case``: the ops it ran must be ``expected``, its output the torch backend's."""
    scale = case.query.shape[-1] ** -0.5
    backend = XFormersPagedAttention()
    out = backend.forward(case.query, case.key_cache, case.value_cache, case.meta, scale=scale, softcap=softcap)
    torch.cuda.synchronize()
    assert backend.stats.kernel_failures == 0, "a kernel raised (see the WARNING log)"
    assert backend.last_ops == expected
    tol = TOLERANCE[case.query.dtype]
    want = TorchPagedAttention().forward(
        case.query.float(),
        case.key_cache.float(),
        case.value_cache.float(),
        fresh(case.meta),
        scale=scale,
        softcap=softcap,
    )
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    return backend


def test_status_names_the_ops_that_run() -> None:
    assert STATUS.available and "triton_splitk" in STATUS.ops and "flash" in STATUS.ops, STATUS


CASES = [
    (page, name, window, heads, dtype)
    for dtype in (torch.float16, torch.bfloat16)
    for heads in (GQA, MHA)
    for page in (16, 64, 256)
    for name in ("decode", "prefill", "mixed", "spec")
    for window in (None, "sliding")
    if heads == GQA or (dtype == torch.float16 and name != "spec")
]


@pytest.mark.parametrize(
    ("page", "name", "window", "heads", "dtype"),
    CASES,
    ids=[f"p{p}-{n}-{w or 'full'}-{h[0]}x{h[1]}x{h[2]}-{str(d)[6:]}" for p, n, w, h, d in CASES],
)
def test_ops_and_outputs(
    page: int, name: str, window: str | None, heads: tuple[int, int, int], dtype: torch.dtype
) -> None:
    sliding = 2 * page + 7 if window else None
    case = make_case(page + len(name), page, scenario(name, page), sliding, heads=heads, dtype=dtype)
    flash_paged = XFormersPagedAttention().flash_paged
    check(case, expected_ops(page, name, heads[2], sliding is not None, flash_paged))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [80, 96, 256])
@pytest.mark.parametrize("name", ["decode", "mixed", "prefill"])
def test_head_dims(head_dim: int, name: str, dtype: torch.dtype) -> None:
    case = make_case(head_dim, 64, scenario(name, 64), None, heads=(16, 4, head_dim), dtype=dtype)
    check(case, expected_ops(64, name, head_dim, False, XFormersPagedAttention().flash_paged))


@pytest.mark.parametrize("page", [64, 256])
@pytest.mark.parametrize("name", ["decode", "mixed", "spec"])
def test_sliding_window_with_released_blocks(page: int, name: str) -> None:
    rows = [(q, s + 4 * page) for q, s in scenario(name, page)]  # long enough that leading blocks were released
    case = make_case(5, page, rows, page + 9, dtype=torch.bfloat16)
    assert sum(case.meta.block_offsets) >= len(rows) // 2
    check(case, expected_ops(page, name, GQA[2], True, XFormersPagedAttention().flash_paged))


@pytest.mark.parametrize(
    ("num_seqs", "max_context", "page"),
    [(1, 8192, 64), (1, 8192, 256), (7, 8192, 64), (64, 4096, 64), (256, 2048, 64), (256, 1024, 256)],
)
def test_batches_and_long_contexts(num_seqs: int, max_context: int, page: int) -> None:
    rng = random.Random(num_seqs)
    rows = [(1, rng.randint(1, max_context)) for _ in range(num_seqs - 1)] + [(1, max_context)]
    case = make_case(num_seqs, page, rows, None, dtype=torch.bfloat16)
    backend = check(case, ("triton_splitk",))
    (launch,) = backend.stats.launch_shapes
    assert launch[1] >= num_seqs and launch[1] & (launch[1] - 1) == 0  # rows padded to a power of two


def test_long_prefill_over_a_cached_prefix() -> None:
    case = make_case(3, 64, [(512, 8192), (300, 300), (1, 5000)], None, dtype=torch.bfloat16)
    check(case, ("triton_splitk", "flash"))


def test_softcap_runs_on_torch() -> None:
    case = make_case(3, 64, scenario("decode", 64), None)
    check(case, ("torch",), softcap=30.0)


# ---------------------------------------------------------------- timings (a report, not a test)
def time_forward(backend: AttentionBackend, case: Case, iters: int = 20) -> float:
    """Milliseconds per forward (one layer) of ``backend`` on ``case``, plan and biases already cached."""
    scale = case.query.shape[-1] ** -0.5
    for _ in range(3):
        backend.forward(case.query, case.key_cache, case.value_cache, case.meta, scale=scale)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        backend.forward(case.query, case.key_cache, case.value_cache, case.meta, scale=scale)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def print_timings(dtype: torch.dtype = torch.bfloat16) -> None:
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
