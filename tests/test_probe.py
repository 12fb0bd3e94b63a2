"""No silent wrong output, by construction: the probe an Engine, a PagedCache and enable() run on a model first.

The families here broke the paged path in their own code, silently: StableLM and Nemotron's decoder layers call
their attention without the model's keyword arguments (the Engine's context never reached it: wrong tokens from the
first decode, and from the first token after a prefill chunk), JetMoE and DiffLlama change their keys or values after
``cache.update`` returned them (paged attention read the pool's untouched keys: wrong tokens with a PagedCache),
Falcon, Bloom and GPT-Neo attend in their own code (the Engine refused them). Each is now exact, on the path the
probe found exact; a model no path serves exactly is refused when the cache, enable() or the Engine is set up.
"""

from __future__ import annotations

import logging

import pytest
import torch
from family_configs import tiny_family
from models import tiny_model
from paged_checks import assert_same_generation, batch, dynamic, generate, release_and_check
from transformers import DynamicCache

import pagedcore.adapters.transformers as pc
from pagedcore import UnsupportedModelError
from pagedcore.adapters.transformers.probe import ProbeTrace, verdicts

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 9, 30, 41, 7, 8, 100, 12, 13, 14, 60, 22, 91], [77, 78, 79], list(range(20, 41))]
NEW = 10


def alone(model, prompt):
    cache = DynamicCache(config=model.config)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, cache=cache,
                         return_dict_in_generate=True, output_logits=True)  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), [x[0].float() for x in out.logits]


def engine_matches_generate(model, **engine_kwargs) -> str:
    """Runs the Engine on PROMPTS (chunked prefill: 5 tokens per step) and checks every token and logit against
    ``generate`` alone; returns the Engine's path."""
    with pc.Engine(model, num_blocks=64, block_size=4, max_num_batched_tokens=5, **engine_kwargs) as engine:
        outs = engine.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, output_logits=True, use_tqdm=False)
        stats = engine.stats()
        assert engine.pool.kv.num_used_blocks == 0
        engine.pool.check_invariants()
    assert stats.compiled_steps == 0 or engine_kwargs.get("compile")
    for prompt, out in zip(PROMPTS, outs):
        tokens, logits = alone(model, prompt)
        assert out.error is None, out.error
        assert out.token_ids == tokens
        for got, want in zip(out.samples[0].logits, logits):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    return next(v.path for v in verdicts(model) if v.kind == "engine")


@pytest.mark.parametrize("family", ["stablelm", "nemotron"])
def test_layers_that_drop_the_models_kwargs_get_the_engines_context_through_update(family):
    model = tiny_family(family)
    assert engine_matches_generate(model) == "paged"


@pytest.mark.parametrize(("family", "compiled"), [("stablelm", False), ("nemotron", False), ("llama", True)])
def test_the_compiled_decode_runs_only_where_the_context_reaches_every_layer_from_the_top(
    family, compiled, monkeypatch
):
    # The compiled step hands its attention the context as a top-level keyword only: a layer that drops the model's
    # kwargs would never see it. The decode function runs uncompiled here (BACKEND None), the same arithmetic.
    from pagedcore.adapters.transformers import compiled as compiled_module

    monkeypatch.setattr(compiled_module, "BACKEND", None)
    model = tiny_family(family) if family != "llama" else tiny_model("llama")
    with pc.Engine(model, num_blocks=64, block_size=4, compile=True) as engine:
        outs = engine.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, use_tqdm=False)
        steps = engine.stats().compiled_steps
    assert [o.token_ids for o in outs] == [alone(model, p)[0] for p in PROMPTS]
    assert (steps > 0) == compiled
    check = next(v for v in verdicts(model) if v.kind == "engine").check("paged")
    assert check is not None and check.exact and check.injected != compiled


@pytest.mark.parametrize("family", ["jetmoe", "diffllama", "falcon", "bloom", "gpt_neo"])
def test_models_whose_keys_the_paged_path_cannot_read_run_exactly_on_the_compatible_path(family, caplog):
    model = tiny_family(family) if family in ("jetmoe", "diffllama") else tiny_model(family)
    before = model.config._attn_implementation
    with caplog.at_level(logging.WARNING, logger="pagedcore.adapters.transformers.probe"):
        assert engine_matches_generate(model) == "padded"
    assert "compatible path" in caplog.text
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("family", ["jetmoe", "diffllama"])
def test_paged_attention_with_a_paged_cache_reads_gathered_keys_for_models_that_change_them(family):
    ids, mask = batch([0, 3], 12, seed=2)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": NEW, "do_sample": False}
    stock = tiny_family(family)
    want = generate(stock, dynamic(stock), **kwargs)
    model = tiny_family(family, attn_implementation="paged")
    cache = pc.PagedCache(model, num_blocks=64, block_size=4)
    assert_same_generation(generate(model, cache, **kwargs), want)
    release_and_check(cache)
    verdict = next(v for v in verdicts(model) if v.kind == "cache")
    assert verdict.path == "gathered"
    assert "other keys or values than its cache returned" in verdict.check("paged").reason


def _off_by_a_little(model):
    """Make ``model`` answer differently with any cache but a DynamicCache: what no path can serve exactly."""
    layer = model.model.layers[0].self_attn
    forward = layer.forward

    def shifted(*args, **kwargs):
        out, weights = forward(*args, **kwargs)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        return (out if isinstance(cache, DynamicCache) else out + 0.5), weights

    layer.forward = shifted


def test_a_model_no_path_serves_exactly_is_refused_where_it_is_set_up():
    model = tiny_model("llama")
    _off_by_a_little(model)
    with pytest.raises(UnsupportedModelError, match=r"in the Engine .*paged path: its logits differ.*padded path"):
        pc.Engine(model, num_blocks=32, block_size=4)
    assert model.config._attn_implementation == "sdpa"  # left as it was
    with pytest.raises(UnsupportedModelError, match=r"with a PagedCache .*gathered path: its logits differ"):
        pc.PagedCache(model, num_blocks=32, block_size=4)
    with pytest.raises(UnsupportedModelError, match="with a PagedCache"):
        pc.enable(model, num_blocks=32, block_size=4)
    assert not pc.is_enabled(model)


def test_the_probe_runs_in_eval_mode_whatever_the_models_mode():
    """A model in train() with dropout was probed with dropout on: its two forwards drew different masks, it was
    refused, and the refusal stayed after ``.eval()``. The verdict is about the model's code: probed in eval mode,
    and every module's own mode given back."""
    model = tiny_model("llama", attention_dropout=0.5, seed=1)
    model.train()
    model.model.layers[0].eval()  # a mixed state, given back as it was
    modes = [m.training for m in model.modules()]
    pc.PagedCache(model, num_blocks=32, block_size=4).release()
    assert [m.training for m in model.modules()] == modes
    model.eval()
    pc.PagedCache(model, num_blocks=32, block_size=4).release()
    pc.enable(model, num_blocks=32, block_size=4)
    pc.disable(model)


def test_the_probe_runs_once_per_model_and_setting():
    model = tiny_model("llama")
    forwards = [0]
    model.register_forward_pre_hook(lambda module, args: forwards.__setitem__(0, forwards[0] + 1))
    pc.PagedCache(model, num_blocks=32, block_size=4).release()
    probed = forwards[0]
    assert probed == 6  # three forwards with a DynamicCache, three with the PagedCache
    pc.PagedCache(model, num_blocks=32, block_size=4).release()
    pc.PagedCache(model, num_blocks=64, block_size=4).release()
    assert forwards[0] == probed  # same setting: the verdict is kept
    pc.PagedCache(model, num_blocks=32, block_size=8).release()
    assert forwards[0] == 2 * probed  # another block size is probed again
    assert [v.kind for v in verdicts(model)] == ["cache", "cache"]


def test_the_trace_names_what_it_saw():
    trace = ProbeTrace()
    k, v = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4)
    trace.stored(0, k, v, returns_new=True, injected=False)
    trace.read(0, k, v.contiguous())  # the same tensors (contiguous() of a contiguous tensor is itself)
    trace.read(1, k, v)  # a layer that attends without storing (KV sharing)
    trace.stored(2, k, v, returns_new=False, injected=False)  # returns gathered keys: reading nothing is fine
    assert trace.problems() == ["layer 1 reads the pool without storing its own keys"]


def test_a_model_whose_attention_ignores_its_configured_window_is_not_reused_or_packed():
    # Moshi's config names a sliding window (so transformers' caches keep one) that its attention never applies: its
    # prefill attends past the window, its decode steps do not. A prefix hit, or the Engine's window-keeping paged
    # attention, gave other tokens; both are refused now, and a PagedCache serves it as generate does.
    model = tiny_family("moshi")
    with pytest.raises(UnsupportedModelError, match="8-token window attend past it"):
        pc.Engine(model, num_blocks=64, block_size=4)
    with pytest.raises(UnsupportedModelError, match=r"enable\(\) cannot reuse"):
        pc.enable(model, num_blocks=64, block_size=4)
    ids, mask = batch([0, 3], 12, seed=2)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": NEW, "do_sample": False}
    want = generate(model, dynamic(model), **kwargs)
    cache = pc.PagedCache(model, num_blocks=64, block_size=4)
    assert_same_generation(generate(model, cache, **kwargs), want)
    release_and_check(cache)


def test_the_engine_refuses_a_state_model_whose_scan_drops_a_cached_state(monkeypatch):
    """Mamba's layers start a scan of several tokens from a zero state, whatever the cache holds: the Engine's state
    steps (pieces cut at snapshot points continue a state) gave other tokens from the first one for prompts of 7 or
    more tokens. state_spec now knows Mamba as token-by-token; a family it does not know is refused by the probe
    (a chunked Engine run on a private pool against one forward), never answered wrongly."""
    from pagedcore.adapters.transformers import state_spec

    model = tiny_family("mamba")
    prompt = [5, 9, 30, 41, 7, 8, 100, 12, 13, 14, 60, 22]
    with pc.Engine(model, num_blocks=64, block_size=4) as engine:  # known: one token per forward on a state
        out = engine.generate([prompt], max_new_tokens=4, do_sample=False, use_tqdm=False)[0]
    ids = torch.tensor([prompt])
    stock = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert out.token_ids == stock[0, len(prompt) :].tolist()

    monkeypatch.setattr(state_spec, "_TOKEN_BY_TOKEN", frozenset({"jamba"}))
    fresh = tiny_family("mamba")
    with pytest.raises(UnsupportedModelError, match="cannot serve this model exactly in the Engine"):
        pc.Engine(fresh, num_blocks=64, block_size=4)
