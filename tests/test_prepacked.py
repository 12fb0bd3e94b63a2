"""Prepacked linear weights in the Engine's forwards (issue 33.2, ``adapters/transformers/prepacked.py``): the
runner's forwards use oneDNN-packed copies of the float32 linear weights, tokens stay stock ``generate``'s, a
training step between decode steps is seen (the packs are rebuilt from the new weights), and nothing else that runs
the model touches the packs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import tiny_model
from test_weights_engine import assert_stock, mirror, sgd_step, workload

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers.prepacked import PrepackedLinears, resolve_prepack
from pagedcore.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_new_tokens=6, return_logits=True)


def test_the_engine_packs_its_linears_and_gives_stock_tokens():
    model = tiny_model("llama", seed=3)
    ref = mirror(model)
    prompts = workload(1, 4)
    with Engine(model, num_blocks=64, block_size=4, prepack=True) as engine:
        packs = engine.runner.prepacked
        assert packs is not None and packs.num_packed == 0
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
        assert packs.num_packed == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        assert packs.packed_bytes > 0
    assert_stock(ref, prompts, outputs)
    assert not any("forward" in vars(m) for m in model.modules())  # close() gave every layer its forward back


def test_an_optimizer_step_between_decode_steps_gives_stock_tokens_on_the_new_weights():
    """The RL loop: requests decode step by step, a training step changes the weights in place mid-run, and a request
    admitted after it computes with the new weights, exactly (no stale pack serves it)."""
    model = tiny_model("llama", seed=4)
    first, second = workload(2, 3), workload(3, 3)
    with Engine(model, num_blocks=96, block_size=4, prepack=True) as engine:
        ids = [engine.add_request(p, GREEDY) for p in first]
        for _ in range(3):  # prefill + decode steps: the packs are built and used
            engine.step()
        assert engine.runner.prepacked.num_packed > 0
        before = [m.weight.detach().clone() for m in model.modules() if isinstance(m, torch.nn.Linear)]
        sgd_step(model, first)
        after = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert all(not torch.equal(a, b) for a, b in zip(before, after))
        ref = mirror(model)
        done = {}
        while len(done) < len(ids):
            done.update((o.request_id, o) for o in engine.step())
        outputs = engine.generate(second, GREEDY, use_tqdm=False)
    assert_stock(ref, second, outputs)


def test_a_stale_pack_is_never_used_even_without_a_weights_check():
    """Inside the runner's forward a layer whose weight changed since it was packed computes with the new weight."""
    model = tiny_model("llama", seed=5)
    packs = PrepackedLinears(model)
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(1, 5, layer.in_features)
    with torch.inference_mode(), packs.active():
        layer(x)
    assert packs.num_packed == 1
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # in place: the version counter moves, the tensor and its pointer do not
    with torch.inference_mode(), packs.active():
        got = layer(x)
    torch.testing.assert_close(got, F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)
    layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight))  # a replaced parameter
    with torch.inference_mode(), packs.active():
        got = layer(x)
    torch.testing.assert_close(got, F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)
    packs.close()


def test_other_users_of_the_model_run_the_stock_layer():
    """Outside the runner's forward (plain generate, a training step with autograd) the layer is ``F.linear``,
    bit for bit, and gradients flow."""
    model = tiny_model("llama", seed=6)
    ids = torch.tensor([workload(4, 1)[0]])
    with torch.inference_mode():
        want = model(ids).logits
    with Engine(model, num_blocks=32, block_size=4, prepack=True) as engine:
        engine.generate([ids[0].tolist()], GREEDY, use_tqdm=False)
        model.set_attn_implementation("sdpa")  # the Engine's paged attention aside, the same forward as before
        with torch.inference_mode():
            assert torch.equal(model(ids).logits, want)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert model.model.layers[0].mlp.up_proj.weight.grad is not None
        model.set_attn_implementation("paged")


def test_prepack_settings():
    cpu = torch.device("cpu")
    assert resolve_prepack("auto", cpu, torch.float32) is torch.backends.mkldnn.is_available()
    assert resolve_prepack("auto", cpu, torch.bfloat16) is False
    assert resolve_prepack(False, cpu, torch.float32) is False
    with pytest.raises(ConfigError, match="prepack must be"):
        resolve_prepack("yes", cpu, torch.float32)
    from pagedcore.adapters.transformers.runner import TransformersRunner

    runner = TransformersRunner(tiny_model("llama", seed=7), prepack=False)
    assert runner.prepacked is None
    runner.close()


def test_a_weights_update_that_forgets_no_prefix_still_drops_the_packs():
    """The runner refreshes the packs with the pool's weights version: after the prepack and LoRA merges it passed
    the count of forgotten prefixes instead, so an update with nothing cached (prefix caching off) kept every pack."""
    model = tiny_model("llama", seed=5)
    with Engine(model, num_blocks=64, block_size=4, enable_prefix_caching=False, prepack=True) as engine:
        engine.generate(workload(1, 2), GREEDY, use_tqdm=False)
        packs = engine.runner.prepacked
        assert packs is not None and packs.num_packed > 0
        with torch.no_grad():
            next(m for m in model.modules() if isinstance(m, torch.nn.Linear)).weight.add_(0.01)
        assert engine.runner.check_weights() == 0  # nothing cached: no prefix forgotten
        assert packs.num_packed == 0


def test_prepacking_is_off_by_default():
    """The packed GEMM sums in another order: logits within 2e-6 of ``F.linear``'s, but in ``pagedcore bench --only
    engine`` (2 threads) a greedy near-tie (margin 8e-7) gave one request of 32 another token than ``generate``.
    Exact ties by default; ``prepack=True`` is the opt-in."""
    model = tiny_model("llama", seed=6)
    with Engine(model, num_blocks=16, block_size=4) as engine:
        assert engine.runner.prepacked is None


def test_a_second_engine_open_on_the_same_model_says_it_runs_without_its_own_layer_forwards(caplog):
    """Two Engines open on one model share its modules: the second finds the first one's split linears and fused
    head installed and cannot install its own. It serves the same tokens, slower, and says so when it is built, once
    per other Engine; once the first is closed, a new Engine installs its own and says nothing."""
    model = tiny_model("llama", seed=5)
    ref = mirror(model)
    prompts = workload(1, 3)
    logger = "pagedcore.adapters.transformers.runner"
    with caplog.at_level("WARNING", logger=logger), Engine(model, num_blocks=64, block_size=4) as first:
        assert not caplog.records
        with Engine(model, num_blocks=64, block_size=4) as second:
            outputs = second.generate(prompts, GREEDY, use_tqdm=False)
        (record,) = caplog.records
        assert "already run another open Engine's forwards" in record.getMessage()
        assert "give each Engine its own copy of the model" in record.getMessage()
        assert_stock(ref, prompts, first.generate(prompts, GREEDY, use_tqdm=False))  # the second's close left its own
    assert_stock(ref, prompts, outputs)
    caplog.clear()
    with caplog.at_level("WARNING", logger=logger), Engine(model, num_blocks=64, block_size=4):
        assert not caplog.records
        with Engine(model, num_blocks=64, block_size=4):  # another pair: warned again, for its other Engine
            assert len(caplog.records) == 1


def test_a_linear_the_model_drops_is_freed_while_the_engine_is_open():
    """Regression: the runner's linears kept every layer they gave a forward in a list, so a linear the model
    dropped (``torch.ao.quantization.quantize_dynamic(model, inplace=True)`` writes each new layer into its parent's
    ``_modules``; here the same write by hand) stayed alive with its weight until the Engine closed: its memory was
    never given back, and the weights watch, which reads tensors dying as a change, saw none."""
    import gc
    import weakref

    model = tiny_model("llama")
    with Engine(model, num_blocks=64, block_size=4) as engine:
        engine.generate(workload(41, 2), SamplingParams(max_new_tokens=3), use_tqdm=False)
        attention = model.model.layers[0].self_attn
        old, weight = weakref.ref(attention.q_proj), weakref.ref(attention.q_proj.weight)
        new = torch.nn.Linear(attention.q_proj.in_features, attention.q_proj.out_features, bias=False)
        attention._modules["q_proj"] = new  # no registration: what torch's quantization and fusion do
        gc.collect()
        assert old() is None and weight() is None
        assert engine.runner.pool.weights.check()  # a tensor gone: walked again, the structure changed
