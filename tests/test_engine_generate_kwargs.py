"""The Engine in transformers' words: ``generate``'s keyword arguments and ``GenerationConfig``, with the model's
``generation_config`` as the default, give what ``model.generate`` gives on each prompt alone."""

from __future__ import annotations

import pytest
import torch
from models import tiny_model
from test_engine import workload
from transformers import DynamicCache, GenerationConfig

from pagedcore import InvalidRequestError
from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers.generate_kwargs import merge_generation_config, to_sampling_params


@pytest.fixture
def model():
    return tiny_model("llama")  # fresh per test: tests change its generation_config


def hf(model, prompt: list[int], seed: int | None = None, **kwargs) -> list[int]:
    """``model.generate`` on one prompt (seeded through torch's global generator, as transformers users do)."""
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(torch.tensor([prompt]), cache=DynamicCache(config=model.config), **kwargs)
    return out[0, len(prompt) :].tolist()


def test_generate_kwargs_greedy_equal_model_generate(model):
    prompts = workload(30, 3)
    with Engine(model, num_blocks=96, block_size=4) as engine:
        outs = engine.generate(prompts, max_new_tokens=6, use_tqdm=False)
        streamed = [e.token_id for e in engine.stream([prompts[0]], max_new_tokens=6) if e.token_id is not None]
        rid = engine.add_request(prompts[1], max_new_tokens=6, do_sample=False, temperature=0.7)  # greedy anyway
        added = {}
        while engine.has_unfinished():
            added.update({o.request_id: o for o in engine.step()})
    want = [hf(model, p, max_new_tokens=6, do_sample=False) for p in prompts]
    assert [o.token_ids for o in outs] == want
    assert streamed == want[0] and added[rid].token_ids == want[1]


def test_the_default_is_the_models_generation_config(model):
    prompt = workload(31, 1)[0]
    with Engine(model, num_blocks=96, block_size=4) as engine:
        default = engine.generate([prompt], use_tqdm=False)[0]  # transformers' default: 20 new tokens
        model.generation_config.max_new_tokens = 7
        seven = engine.generate([prompt], use_tqdm=False)[0]
        model.generation_config.max_new_tokens = None
        model.generation_config.max_length = len(prompt) + 3  # a total length, as in transformers
        three = engine.generate([prompt], use_tqdm=False)[0]
    model.generation_config.max_length = None
    assert default.token_ids == hf(model, prompt) and len(default.token_ids) == 20
    model.generation_config.max_new_tokens = 7
    assert seven.token_ids == hf(model, prompt) and len(seven.token_ids) == 7
    assert len(three.token_ids) == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.8, "top_k": 40, "top_p": 0.9},
        {"temperature": 1.3},
        {"top_k": 5},
        {},  # transformers' sampling defaults: temperature 1.0, top_k 50
    ],
)
def test_seeded_sampling_equals_model_generate(model, kwargs):
    prompt = workload(32, 1)[0]
    with Engine(model, num_blocks=96, block_size=4) as engine:
        out = engine.generate([prompt], max_new_tokens=8, do_sample=True, seed=11, use_tqdm=False, **kwargs)[0]
    assert out.token_ids == hf(model, prompt, seed=11, max_new_tokens=8, do_sample=True, **kwargs)


def test_the_models_sampling_defaults_apply_when_sampling(model):
    prompt = workload(33, 1)[0]
    model.generation_config.do_sample = True
    model.generation_config.temperature = 0.6
    model.generation_config.top_k = 12
    model.generation_config.top_p = 0.85
    with Engine(model, num_blocks=96, block_size=4) as engine:
        sampled = engine.generate([prompt], max_new_tokens=8, seed=5, use_tqdm=False)[0]
        greedy = engine.generate([prompt], max_new_tokens=8, do_sample=False, use_tqdm=False)[0]
    assert sampled.token_ids == hf(model, prompt, seed=5, max_new_tokens=8)
    assert greedy.token_ids == hf(model, prompt, max_new_tokens=8, do_sample=False)


def test_eos_and_min_new_tokens_as_in_transformers(model):
    prompt = workload(34, 1)[0]
    plain = hf(model, prompt, max_new_tokens=8, do_sample=False)
    eos = plain[1]
    with Engine(model, num_blocks=96, block_size=4) as engine:
        stopped = engine.generate([prompt], max_new_tokens=8, eos_token_id=eos, use_tqdm=False)[0]
        held = engine.generate([prompt], max_new_tokens=8, eos_token_id=[eos], min_new_tokens=4, use_tqdm=False)[0]
        model.generation_config.eos_token_id = eos
        default_eos = engine.generate([prompt], max_new_tokens=8, use_tqdm=False)[0]
    assert stopped.token_ids == hf(model, prompt, max_new_tokens=8, eos_token_id=eos) == plain[:2]
    assert stopped.finish_reason == "stop" and default_eos.token_ids == plain[:2]
    # min_new_tokens: the eos cannot be chosen before it (transformers masks it), so the continuation differs
    assert held.token_ids == hf(model, prompt, max_new_tokens=8, eos_token_id=[eos], min_new_tokens=4)


def test_generation_config_object_and_num_return_sequences(model):
    prompt = workload(35, 1)[0]
    config = GenerationConfig(max_new_tokens=5, do_sample=False)
    with Engine(model, num_blocks=96, block_size=4, max_num_seqs=8) as engine:
        out = engine.generate([prompt], generation_config=config, use_tqdm=False)[0]
        several = engine.generate(
            [prompt], max_new_tokens=5, do_sample=True, num_return_sequences=3, seed=1, use_tqdm=False
        )[0]
    assert out.token_ids == hf(model, prompt, generation_config=config)
    assert len(several.samples) == 3 and all(len(s.token_ids) == 5 for s in several.samples)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_beams": 4}, "num_beams"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),  # supported now, but > 0
        ({"no_repeat_ngram_size": 2}, "no_repeat_ngram_size"),
        ({"sequence_bias": {(5, 6): 1.0}}, "sequence_bias"),  # one-token sequences only
        ({"output_scores": True}, "output_scores"),
        ({"streamer": object()}, "streamer"),
        ({"no_such_argument": 1}, "no_such_argument"),
        ({"generation_config": GenerationConfig(num_beams=2)}, "num_beams"),
        ({"generation_config": {"max_new_tokens": 3}}, "GenerationConfig"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"do_sample": True, "temperature": 0.0}, "temperature"),
        ({"num_return_sequences": 2}, "num_return_sequences"),  # greedy: transformers refuses it too
        ({"eos_token_id": "x"}, "'x'"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_unsupported_or_bad_kwargs_are_refused_by_name(model, kwargs, match):
    with Engine(model, num_blocks=32, block_size=4) as engine:
        with pytest.raises(InvalidRequestError, match=match):
            engine.generate([[5, 6, 7]], use_tqdm=False, **kwargs)
        with pytest.raises(InvalidRequestError, match=match):
            engine.add_request([5, 6, 7], **kwargs)
        with pytest.raises(InvalidRequestError, match=match):
            engine.stream([[5, 6, 7]], **kwargs)
        assert not engine.has_unfinished()


def test_neutral_values_of_unsupported_options_are_accepted(model):
    with Engine(model, num_blocks=32, block_size=4) as engine:
        out = engine.generate(
            [[5, 6, 7]], max_new_tokens=2, num_beams=1, repetition_penalty=1.0, pad_token_id=0, use_tqdm=False
        )[0]
    assert out.error is None and len(out.token_ids) == 2


@pytest.mark.parametrize("name", ["suppress_tokens", "begin_suppress_tokens", "bad_words_ids"])
def test_an_empty_token_list_is_neutral_and_a_full_one_refused(model, name):
    """``suppress_tokens=[]`` suppresses nothing (Whisper-style generation configs carry empty lists)."""
    with Engine(model, num_blocks=32, block_size=4) as engine:
        out = engine.generate([[5, 6, 7]], max_new_tokens=2, use_tqdm=False, **{name: []})[0]
        assert out.error is None and len(out.token_ids) == 2
        config = GenerationConfig(**{name: []})
        assert engine.generate([[5, 6, 7]], max_new_tokens=2, generation_config=config, use_tqdm=False)[0].error is None
        with pytest.raises(InvalidRequestError, match=name):
            engine.generate([[5, 6, 7]], max_new_tokens=2, use_tqdm=False, **{name: [[5]] if "words" in name else [5]})


def test_mixing_sampling_params_and_kwargs_is_refused(model):
    with Engine(model, num_blocks=32, block_size=4) as engine:
        with pytest.raises(InvalidRequestError, match="not both"):
            engine.generate([[5, 6]], SamplingParams(max_new_tokens=2), max_new_tokens=3, use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="not both"):
            engine.add_request([5, 6], {"max_new_tokens": 2}, temperature=0.5)
        assert not engine.has_unfinished()


def test_a_prompt_longer_than_max_length_fails_alone(model):
    with Engine(model, num_blocks=64, block_size=4) as engine:
        outs = engine.generate([[5] * 12, [5, 6]], max_length=8, use_tqdm=False)
    assert "max_length" in outs[0].error and outs[1].error is None and len(outs[1].token_ids) == 6


def test_translation_unit():
    model_config = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, eos_token_id=[2, 9])
    config, extras = merge_generation_config(model_config, {"max_new_tokens": 4, "seed": 3})
    assert extras == {"seed": 3}
    params = to_sampling_params(config, prompt_length=10, **extras)
    assert params == SamplingParams(
        max_new_tokens=4, temperature=0.7, top_k=50, top_p=0.9, seed=3, stop_token_ids=(2, 9)
    )
    config, _ = merge_generation_config(model_config, {"do_sample": False, "eos_token_id": None})
    greedy = to_sampling_params(config, prompt_length=10, max_positions=25)
    assert greedy.is_greedy and greedy.max_new_tokens == 15 and greedy.stop_token_ids == ()
    assert model_config.max_new_tokens is None  # the model's config is never modified
