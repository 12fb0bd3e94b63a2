"""Engine(compile=...): decode-only steps as a compiled graph over power-of-two buckets (issue 23.1).

Outputs must be the eager Engine's: greedy tokens equal and fp32 logits within 1e-4, across preemption, forks,
prefix hits and sliding-window / softcapped models. Compiling costs seconds per bucket, so what CI runs is bounded:
the bucketed decode function's arithmetic run uncompiled (``compiled.BACKEND = None``) on every case, one captured
graph (dynamo's ``eager`` backend: the whole forward as one graph, no code generated) on one bucket; inductor, the
500-step bucket count and the CUDA-graph code path are marked slow.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from models import tiny_model

from pagedcore import ConfigError
from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers import compiled as compiled_module
from pagedcore.adapters.transformers.compiled import DecodeInputs

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25], [5, 6, 7, 8, 30]]


def run(model, compile, prompts=PROMPTS, params=None, **kwargs):
    params = params or SamplingParams(max_new_tokens=14, return_logits=True)
    sizing = {"num_blocks": 64, "block_size": 4, **kwargs}
    with Engine(model, compile=compile, **sizing) as engine:
        outputs = engine.generate(prompts, params, use_tqdm=False)
        stats = engine.stats()
        engine.pool.kv.check_invariants()
    return outputs, stats


def assert_same(outputs, reference, atol=1e-4):
    for out, ref in zip(outputs, reference):
        for a, b in zip(out.samples, ref.samples):
            assert a.token_ids == b.token_ids
            assert a.logits is not None and b.logits is not None and len(a.logits) == len(b.logits) > 0
            for x, y in zip(a.logits, b.logits):
                assert torch.allclose(x, y, atol=atol, rtol=0), (x - y).abs().max()


@pytest.fixture
def uncompiled(monkeypatch):
    monkeypatch.setattr(compiled_module, "BACKEND", None)


# ---------------------------------------------------------------------------------------------------- the option
def test_compile_option_is_checked_before_anything_changes():
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match='compile must be True, False, "auto" or "cudagraphs", got \'always\''):
        Engine(model, num_blocks=16, compile="always")
    assert model.config._attn_implementation == "sdpa"
    with Engine(model, num_blocks=16) as engine:  # auto: eager on the CPU
        assert engine.stats().compiled_steps == 0


def test_serve_compile_flag_reaches_the_engine(monkeypatch):
    from pagedcore.adapters import transformers as adapter
    from pagedcore.cli.common import UsageError
    from pagedcore.serve import cli

    seen = []

    class Stop(Exception):
        pass

    def engine(*args, **kwargs):
        seen.append(kwargs["config"].compile)
        raise Stop

    monkeypatch.setattr(adapter, "Engine", engine)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    for argv in ([], ["--compile"], ["--no-compile"], ["--cuda-graphs"]):
        with pytest.raises(Stop):
            cli._build(parser.parse_args(["--num-blocks", "16", *argv]), UsageError)
    assert seen == ["auto", True, False, "cudagraphs"]


# ---------------------------------------------------------------------------------------------------- buckets
def test_decode_inputs_pad_rows_and_tables_to_buckets(uncompiled):
    model = tiny_model("llama")
    captured = []
    real = DecodeInputs.from_batch

    def spy(batch, pool, device):
        inputs = real(batch, pool, device)
        captured.append((batch.num_tokens, [m.block_tables.shape[1] for m in batch.metadata], inputs))
        return inputs

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecodeInputs, "from_batch", staticmethod(spy))
        _, stats = run(model, True, prompts=PROMPTS[:3])
    assert captured and stats.compiled_steps == len(captured)
    for n, widths, inputs in captured:
        rows = inputs.input_ids.shape[0]
        assert rows >= n and rows & (rows - 1) == 0 and inputs.real == n
        for width, table in zip(widths, inputs.tables):
            columns = table.shape[1]
            assert columns >= max(width, compiled_module.MIN_WIDTH) and columns & (columns - 1) == 0
            assert (table[n:] == 64).all() and (table[:n, width:] == 64).all()  # the pad block: num_blocks
        assert inputs.input_ids[n:].eq(0).all() and inputs.positions[n:].eq(0).all()


# ---------------------------------------------------------------------------------------------------- equality
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma2", "gemma3"])
def test_bucketed_decode_equals_the_eager_engine(family, uncompiled):
    model = tiny_model(family)
    reference, _ = run(model, False)
    outputs, stats = run(model, True)
    assert stats.compiled_steps > 0 and stats.compile_failures == 0
    assert_same(outputs, reference)


def test_bucketed_decode_across_preemption_forks_and_prefix_hits(uncompiled):
    model = tiny_model("llama")
    kwargs = {"num_blocks": 14, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16}
    greedy = SamplingParams(max_new_tokens=16, return_logits=True)
    reference, ref_stats = run(model, False, params=greedy, **kwargs)
    outputs, stats = run(model, True, params=greedy, **kwargs)
    assert ref_stats.num_preemptions > 0 and stats.num_preemptions > 0
    assert stats.prefix_hit_tokens > 0 and stats.compiled_steps > 0
    assert_same(outputs, reference)
    forks = SamplingParams(max_new_tokens=10, n=3, temperature=1.0, seed=3, return_logits=True)
    reference, _ = run(model, False, prompts=PROMPTS[:2], params=forks)
    outputs, stats = run(model, True, prompts=PROMPTS[:2], params=forks)
    assert stats.compiled_steps > 0
    assert_same(outputs, reference)


def test_a_failing_compiled_step_turns_compiling_off_and_runs_eagerly(monkeypatch):
    model = tiny_model("llama")
    reference, _ = run(model, False)

    def broken(self, inputs):
        raise RuntimeError("inductor: no C++ compiler")

    monkeypatch.setattr(compiled_module.CompiledDecode, "__call__", broken)
    outputs, stats = run(model, True)
    assert stats.compile_failures == 1 and stats.num_failed == 0 and stats.compiled_steps == 0
    assert_same(outputs, reference)


# ---------------------------------------------------------------------------------------------------- compiled
def test_one_captured_graph_per_bucket(monkeypatch):
    monkeypatch.setattr(compiled_module, "BACKEND", "eager")  # dynamo captures the whole forward (fullgraph=True)
    model = tiny_model("llama")
    prompts = [PROMPTS[0], PROMPTS[2]]  # 2 rows; contexts of 8-19 tokens: 1-3 blocks of 8, the 4-block bucket
    params = SamplingParams(max_new_tokens=8, return_logits=True)
    reference, _ = run(model, False, prompts=prompts, params=params, block_size=8)
    outputs, stats = run(model, True, prompts=prompts, params=params, block_size=8)
    assert stats.compile_failures == 0 and stats.compiled_steps == 7
    assert stats.compiled_buckets == 1 and stats.compiled_graphs == 1 and stats.recompilations == 0
    assert_same(outputs, reference)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_500_steps_of_varying_batch_and_growing_contexts_compile_once_per_bucket(backend, monkeypatch):
    monkeypatch.setattr(compiled_module, "BACKEND", backend)
    model = tiny_model("llama")
    prompts = [[5 + (i * 7 + j) % 90 for j in range(3 + (i * 5) % 20)] for i in range(20)]
    lengths = [60 + (i * 37) % 100 for i in range(20)]  # the batch varies as requests finish and join
    params = [SamplingParams(max_new_tokens=n, return_logits=True) for n in lengths]
    sizing = {"num_blocks": 512, "block_size": 16, "max_num_seqs": 4}  # contexts grow to 180 tokens: 12 blocks
    reference, _ = run(model, False, prompts=prompts, params=params, **sizing)
    outputs, stats = run(model, True, prompts=prompts, params=params, **sizing)
    assert stats.num_steps >= 500 and stats.compiled_steps > 0.9 * stats.num_steps
    assert stats.compile_failures == 0 and stats.recompilations == 0
    assert stats.compiled_graphs == stats.compiled_buckets <= 3 * 3  # rows 1, 2, 4; widths 4, 8, 16
    assert_same(outputs, reference)


@pytest.mark.slow
def test_inductor_graph_matches_eager_within_1e_4(monkeypatch):
    monkeypatch.setattr(compiled_module, "BACKEND", "inductor")
    model = tiny_model("llama")
    prompts = [PROMPTS[0], PROMPTS[2]]  # one bucket, as in test_one_captured_graph_per_bucket
    params = SamplingParams(max_new_tokens=8, return_logits=True)
    reference, _ = run(model, False, prompts=prompts, params=params, block_size=8)
    outputs, stats = run(model, True, prompts=prompts, params=params, block_size=8)
    assert stats.compile_failures == 0 and stats.compiled_steps == 7 and stats.compiled_graphs == 1
    assert_same(outputs, reference)


@pytest.mark.parametrize("where", ["module", "global"])
def test_a_hook_added_after_the_graph_was_compiled_is_applied(where, monkeypatch):
    """Regression: dynamo leaves a module's hooks out of its guards by default (``skip_nnmodule_hook_guards``), so a
    forward hook added after a bucket's graph was compiled (a steering vector) was skipped by every later compiled
    step: the first token (an eager prefill) had it, the decode tokens did not. The compiled step now guards on the
    hooks (a changed hook recompiles the bucket), and runs eagerly while a global module hook is set (no guard sees
    those)."""
    monkeypatch.setattr(compiled_module, "BACKEND", "eager")  # dynamo's guards and graph, no code generated
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[2]]
    with Engine(model, compile=True, num_blocks=64, block_size=4) as engine:
        engine.generate(prompts, params, use_tqdm=False)
        compiled = engine.stats().compiled_steps
        assert compiled > 0

        def steer(module, args, out):
            return out * 3 if module is model.model.layers[0].mlp else None

        if where == "global":
            handle = torch.nn.modules.module.register_module_forward_hook(steer)
        else:
            handle = model.model.layers[0].mlp.register_forward_hook(steer)
        try:
            fresh = [[40, 41, 42, 43, 44], [50, 51, 52]]  # no prefix hit: only the compiled step could skip the hook
            outputs = engine.generate(fresh, params, use_tqdm=False)
            want = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p) :].tolist()
                    for p in fresh]  # fmt: skip
        finally:
            handle.remove()
        assert [o.token_ids for o in outputs] == want
        grew = engine.stats().compiled_steps > compiled
        assert grew == (where == "module")  # a module hook: compiled again; a global one: eager steps


def test_the_compiled_decode_does_not_guard_on_the_weights_watch(monkeypatch):
    """Llama's forward slices its ``ModuleList`` (``self.layers[:n]``), which registers modules: the weights watch's
    registration hook ran inside the trace and dynamo guarded on the watched-modules WeakSet, whose entries die with
    their models ("Error while creating guard" on ``_EVENTS.watched.data``: a compile failure, the step ran eager;
    seen when this module ran after others). The hook ignores registrations while tracing: no guard names it."""
    import logging

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    monkeypatch.setattr(compiled_module, "BACKEND", "eager")
    handler, logger = Keep(), logging.getLogger("torch._dynamo")
    torch._logging.set_logs(guards=True)
    logger.addHandler(handler)
    try:
        _, stats = run(tiny_model("llama"), True, prompts=PROMPTS[:2], params=SamplingParams(max_new_tokens=6))
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
    assert stats.compile_failures == 0 and stats.compiled_steps > 0
    assert messages and not [m for m in messages if "_EVENTS" in m]


# ---------------------------------------------------------------------------------------------------- attention op
def test_the_compiled_graph_calls_paged_attention_as_one_opaque_op(monkeypatch):
    """Traced, the block gathers became inductor's per-element loops over the bucket's padded width (the compiled
    step 0.90x the eager one at 16 rows): the graph must call ``pagedcore::attend_blocks`` once per layer and
    gather nothing itself."""
    monkeypatch.setattr(compiled_module, "BACKEND", "eager")
    graphs: list[str] = []
    real = compiled_module.CompiledDecode._compiler

    def keep(self, graph, example_inputs):
        graphs.append(graph.code)
        return real(self, graph, example_inputs)

    monkeypatch.setattr(compiled_module.CompiledDecode, "_compiler", keep)
    model = tiny_model("llama")
    _, stats = run(model, True, prompts=PROMPTS[:2], params=SamplingParams(max_new_tokens=4), block_size=8)
    assert stats.compiled_steps > 0 and graphs
    layers = model.config.num_hidden_layers
    for code in graphs:
        assert code.count("pagedcore.attend_blocks") == layers
        assert "index_select" not in code and "scaled_dot_product_attention" not in code


def test_attend_blocks_reads_only_the_table_columns_some_row_uses(monkeypatch):
    """The bucket pads each table to a power-of-two width with the pad block; the op attends over the columns some
    row uses (the eager step's width), with the same result as over the padded width."""
    torch.manual_seed(0)
    block_size, pad = 4, 9
    key_cache, value_cache = torch.randn(10, block_size, 2, 8), torch.randn(10, block_size, 2, 8)
    key_cache[pad] = 0
    value_cache[pad] = 0
    tables = torch.tensor([[3, 5, pad, pad, pad, pad, pad, pad], [1, 2, 7, pad, pad, pad, pad, pad]])
    positions = torch.tensor([6, 9])
    mask = (torch.arange(8 * block_size)[None, :] <= positions[:, None])[:, None, None, :]
    query = torch.randn(2, 4, 1, 8)
    widths: list[int] = []
    real_gather = compiled_module.gather_blocks

    def spy(cache, blocks, stale=None):
        widths.append(blocks.shape[1])
        return real_gather(cache, blocks, stale)

    monkeypatch.setattr(compiled_module, "gather_blocks", spy)
    out = compiled_module.attend_blocks(query, key_cache, value_cache, tables, mask, pad, 0.35, None, None)
    assert widths == [3, 3]  # the second row's three blocks; not the bucket's eight
    k, v = real_gather(key_cache, tables), real_gather(value_cache, tables)
    reference = compiled_module.attend_rows(query, k, v, mask, 0.35, None, None)
    assert torch.allclose(out, reference, atol=1e-6, rtol=0)
    only_pad = torch.full_like(tables, pad)
    widths.clear()
    compiled_module.attend_blocks(query, key_cache, value_cache, only_pad, mask, pad, 0.35, None, None)
    assert widths == [1, 1]


def test_attend_blocks_adds_nothing_from_the_slots_its_mask_hides():
    """A hidden slot may hold a NaN or Inf an earlier owner of the block left (an overflowed forward): the op's
    result is the same bits as over clean blocks (a masked weight 0 times NaN would be NaN)."""
    torch.manual_seed(1)
    block_size, pad = 4, 9
    key_cache, value_cache = torch.randn(10, block_size, 2, 8), torch.randn(10, block_size, 2, 8)
    key_cache[pad], value_cache[pad] = 0, 0
    tables = torch.tensor([[3, 5, pad, pad], [1, 2, 7, pad]])
    positions = torch.tensor([6, 9])
    mask = (torch.arange(4 * block_size)[None, :] <= positions[:, None])[:, None, None, :]
    query = torch.randn(2, 4, 1, 8)
    clean = compiled_module.attend_blocks(query, key_cache, value_cache, tables, mask, pad, 0.35, None, None)
    for leftover in (float("nan"), float("inf")):
        kc, vc = key_cache.clone(), value_cache.clone()
        kc[5, 3], vc[5, 3], kc[7, 2:], vc[7, 2:] = leftover, leftover, leftover, leftover  # past each row's length
        out = compiled_module.attend_blocks(query, kc, vc, tables, mask, pad, 0.35, None, None)
        assert torch.equal(out, clean)


def test_the_bucketed_decode_attends_as_the_eager_step_does_bit_for_bit(uncompiled):
    """On the CPU the graph's attention op runs the torch backend's own forward over the step's packed metadata: one
    sequence reads its keys as a view of the pool, several share one plan per step (it gathered every bucket column
    under a mask, 2-4x slower at one row, other bits). Exact buckets (1, 2, 4 rows), so the logits are the eager
    step's to the bit."""
    model = tiny_model("llama")
    for prompts in ([PROMPTS[0]], PROMPTS[:2], PROMPTS):
        reference, _ = run(model, False, prompts=prompts)
        outputs, stats = run(model, True, prompts=prompts)
        assert stats.compiled_steps > 0 and stats.compile_failures == 0
        assert_same(outputs, reference, atol=0)


@pytest.mark.parametrize("count", [2, 3])
def test_a_compiled_greedy_step_takes_its_tokens_inside_the_head(count, monkeypatch):
    """The compiled step computed its rows' whole logits (a 32000-column head read and written per step) where the
    eager step takes an argmax-only step's tokens inside the head: the head's call is one opaque op in the graph
    (``pagedcore::argmax_head``), which does what the eager call does. 3 rows: a bucket of 4, one padding row."""
    monkeypatch.setattr(compiled_module, "BACKEND", "eager")
    model = tiny_model("llama")
    params = SamplingParams(max_new_tokens=8)  # greedy, the tokens only: argmax-only steps
    reference, _ = run(model, False, prompts=PROMPTS[:count], params=params, block_size=8)
    with Engine(model, compile=True, num_blocks=64, block_size=8) as engine:
        outputs = engine.generate(PROMPTS[:count], params, use_tqdm=False)
        stats, head = engine.stats(), engine.runner.argmax_head
    assert head is not None and stats.compiled_steps > 0 and stats.compile_failures == 0
    assert head.counts.steps > stats.num_steps - stats.compiled_steps  # compiled steps among them
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
