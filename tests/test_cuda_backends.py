"""The torch attention backend, PagedCache, enable() and the Engine on CUDA give what they give on the CPU.

Ungated by xformers: everything here runs wherever CUDA is, whether or not xformers' kernels can load (the Engine
and the paged attention are asked for the torch backend by name, and fp32 never goes to xformers). Without CUDA
the module skips. ``PAGEDCORE_CUDA_TESTS_DEVICE=cpu`` runs it with the CPU standing in for CUDA: a rehearsal of
this code on a machine without a GPU (``make gpu-rehearsal``), which proves nothing about CUDA.

The CPU is the reference: fp32 outputs and logits within 1e-4 of it, and greedy tokens equal (the workload's
greedy choices are checked, on the CPU, to be clear of near-ties, so a 1e-6 difference cannot flip one; fp32 matrix
products run without TF32). The Engines' pools have blocks of 64 on CUDA and 16 on the CPU, so the layouts differ too.
"""

from __future__ import annotations

import os

import pytest
import torch
from models import FIRST_TOKEN, VOCAB, tiny_model
from paged_checks import assert_same_generation, dynamic, generate, release_and_check
from test_engine import workload
from test_torch_backend import CASES, build

from pagedcore.adapters.transformers import Engine, PagedCache, SamplingParams, disable, enable
from pagedcore.attention import PagedAttentionMetadata
from pagedcore.plugins.torch_backend import TorchPagedAttention

DEVICE = torch.device(os.environ.get("PAGEDCORE_CUDA_TESTS_DEVICE", "cuda"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (PAGEDCORE_CUDA_TESTS_DEVICE=cpu rehearses the code)", allow_module_level=True)

pytestmark = pytest.mark.gpu

ATOL = 1e-4
HALF_TOL = {torch.float16: 5e-3, torch.bfloat16: 4e-2}
MIN_MARGIN = 1e-3  # top-1 minus top-2 logit of every greedy choice in the reference


@pytest.fixture(autouse=True)
def _full_fp32_matmuls():
    """fp32 matrix products in full precision on CUDA (no TF32), as on the CPU, whatever a library set before."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


def fresh(meta: PagedAttentionMetadata) -> PagedAttentionMetadata:
    return PagedAttentionMetadata(**{**vars(meta), "backend_state": {}})


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_backend_on_cuda_equals_cpu(case, block_size, window, dtype):
    query_lens, seq_lens = CASES[case]
    query, key_cache, value_cache, meta, _, _ = build(11, query_lens, seq_lens, block_size, window)
    scale = 16**-0.5
    want = TorchPagedAttention().forward(query, key_cache, value_cache, fresh(meta), scale=scale)
    on_device = [t.to(DEVICE, dtype) for t in (query, key_cache, value_cache)]
    got = TorchPagedAttention().forward(*on_device, fresh(meta).to(DEVICE), scale=scale)
    assert got.device.type == DEVICE.type and got.dtype == dtype
    tol = HALF_TOL.get(dtype, ATOL)
    torch.testing.assert_close(got.cpu().float(), want, atol=tol, rtol=tol)


def margins(logits: list[torch.Tensor]) -> float:
    """The smallest gap between the best and second-best logit over the steps."""
    return min(float(step.float().topk(2).values.diff().abs().min()) for step in logits)


def engine_outputs(model, prompts, params, **engine_args):
    with Engine(model, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, **engine_args) as engine:
        outputs = engine.generate(prompts, params, use_tqdm=False)
        assert engine.pool.kv.num_used_blocks == 0, "blocks leaked"
        engine.pool.check_invariants()
        stats = engine.stats()
    for out in outputs:
        assert out.error is None, out.error
    if engine_args.get("compile", False) is not False:  # the decode steps ran as graphs, not eagerly after a failure
        assert stats.compile_failures == 0 and stats.compiled_steps > 0, stats
    return outputs


@pytest.mark.parametrize(
    ("backend", "compile"),
    [("torch", False), (None, False), ("torch", "cudagraphs"), (None, "cudagraphs"), (None, True)],
    ids=["torch", "default", "torch-cudagraphs", "default-cudagraphs", "default-inductor"],
)
def test_engine_on_cuda_equals_the_engine_on_cpu(backend, compile, monkeypatch):
    if DEVICE.type == "cpu" and compile == "cudagraphs":
        from pagedcore.adapters.transformers import decode_graphs

        monkeypatch.setattr(decode_graphs, "CAPTURE", decode_graphs.ReplayCapture)  # the rehearsal: no CUDA here
    if DEVICE.type == "cpu" and compile is True:
        pytest.skip("inductor on the CPU: tests/test_engine_compile.py's slow tests")
    prompts = workload(3, 6)
    params = SamplingParams(max_new_tokens=10, return_logits=True)
    want = engine_outputs(tiny_model("llama"), prompts, params, block_size=16)
    assert min(margins(out.samples[0].logits) for out in want) > MIN_MARGIN, "a near-tie: choose another workload"
    model = tiny_model("llama").to(DEVICE)
    got = engine_outputs(model, prompts, params, block_size=64, attention_backend=backend, compile=compile)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for got_step, want_step in zip(g.samples[0].logits, w.samples[0].logits):
            torch.testing.assert_close(got_step.cpu().float(), want_step.float(), atol=ATOL, rtol=0)


HOST_READ_SCRIPT = """
import sys, torch
sys.path.insert(0, TESTS)
from models import tiny_model
from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers.decode_graphs import CudaGraphCapture

model = tiny_model("llama").cuda()
norm = model.model.norm
forward = norm.forward


def reading(x):
    if float(x.abs().max()) > 1e30:  # a value read on the host: a capture refuses it
        x = x * 1
    return forward(x)


params, prompt = SamplingParams(max_new_tokens=6), [[5, 6, 7, 8, 9]]
with Engine(model, num_blocks=32, block_size=16) as engine:
    want = [o.token_ids for o in engine.generate(prompt, params, use_tqdm=False)]
norm.forward = reading
with Engine(model, num_blocks=32, block_size=16, compile="cudagraphs") as engine:
    got = [o.token_ids for o in engine.generate(prompt, params, use_tqdm=False)]
    stats = engine.stats()
assert got == want, (got, want)
assert stats.compile_failures == 1 and stats.compiled_steps == 0, stats
assert CudaGraphCapture.failed is None, CudaGraphCapture.failed  # refused before anything was captured
assert torch.cuda.current_stream() == torch.cuda.default_stream()
torch.cuda.empty_cache()  # torch < 2.12 asserts here after a capture that failed part-way
norm.forward = forward
with Engine(model, num_blocks=32, block_size=16, compile="cudagraphs") as engine:
    again = [o.token_ids for o in engine.generate(prompt, params, use_tqdm=False)]
    assert engine.stats().compiled_steps > 0
assert again == want, (again, want)
print("ok")
"""


def test_a_step_that_reads_a_value_on_the_host_is_refused_before_its_capture():
    """On CUDA: a decode step that reads a tensor's value on the host fails in the last warm-up, which runs with
    CUDA's sync check as an error, before anything is captured; the Engine runs eagerly, with the same tokens, and
    the process still frees memory and captures (after a capture failed part-way, torch < 2.12 asserts). In a
    process of its own, so that no failure reaches the other tests."""
    if DEVICE.type != "cuda":
        pytest.skip("needs CUDA: the sync check and a real capture")
    import subprocess
    import sys
    from pathlib import Path

    script = HOST_READ_SCRIPT.replace("TESTS", repr(str(Path(__file__).parent)))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.parametrize("attn", ["sdpa", "paged"])
def test_paged_cache_on_cuda_equals_dynamic_cache_on_cuda(attn):
    model = tiny_model("llama").to(DEVICE)
    model.set_attn_implementation(attn)
    ids = torch.tensor([workload(5, 1)[0] + [7, 8, 9]], device=DEVICE)
    want = generate(model, dynamic(model), input_ids=ids, max_new_tokens=12, do_sample=False)
    cache = PagedCache(model, num_blocks=16)
    got = generate(model, cache, input_ids=ids, max_new_tokens=12, do_sample=False)
    assert got.sequences.device.type == DEVICE.type
    assert_same_generation(got, want)
    release_and_check(cache)


def test_enable_on_cuda_reuses_the_prefix_and_equals_dynamic_cache():
    model = tiny_model("llama").to(DEVICE)
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(FIRST_TOKEN, VOCAB, (1, 150), generator=generator).to(DEVICE)  # whole blocks of 16 or 64
    want = model.generate(ids, max_new_tokens=8, do_sample=False, cache=dynamic(model))
    pool = enable(model, num_blocks=32)
    try:
        first = model.generate(ids, max_new_tokens=8, do_sample=False)
        again = model.generate(ids, max_new_tokens=8, do_sample=False)
        assert pool.num_hit_tokens > 0  # the second call reused the first one's prompt blocks
    finally:
        disable(model)
    assert first.tolist() == want.tolist() == again.tolist()
    assert pool.kv.num_used_blocks == 0
