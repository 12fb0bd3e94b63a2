"""Rotary embeddings whose frequencies depend on the largest position of each forward (``rope_type`` ``"dynamic"``
and ``"longrope"``): transformers picks them per forward, so the Engine's packed, chunked and prefix-cached forwards
gave other tokens than stock ``generate`` on each request once a sequence crossed the threshold (an outside audit).
The Engine serves such a model up to the threshold (a longer ``max_model_len`` is refused, saying why), and an
``enable()``d call that may cross it runs as stock; below it, both stay exact and keep their prefix hits."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from family_configs import tiny_family
from transformers import DynamicCache

import pagedcore.adapters.transformers as pc
from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.errors import ConfigError, InvalidRequestError

pytestmark = pytest.mark.usefixtures("one_thread")

THRESHOLD = 16
NEW = 6


def rope_model(kind: str) -> torch.nn.Module:
    if kind == "longrope":
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0],
                "original_max_position_embeddings": THRESHOLD}  # fmt: skip
        return tiny_family(
            "phi3", max_position_embeddings=128, original_max_position_embeddings=THRESHOLD, rope_parameters=rope
        )
    rope = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    return tiny_family("llama", max_position_embeddings=THRESHOLD, rope_parameters=rope)


def stock(model: torch.nn.Module, prompt: list[int], new: int = NEW) -> list[int]:
    fresh = copy.deepcopy(model)  # dynamic RoPE keeps what the last forward chose
    out = fresh.generate(
        torch.tensor([prompt]), max_new_tokens=new, do_sample=False, cache=DynamicCache(config=fresh.config)
    )
    return out[0, len(prompt) :].tolist()


RNG = random.Random(0)
SHORT = [RNG.randrange(3, 256) for _ in range(6)]
LONG = [RNG.randrange(3, 256) for _ in range(24)]


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_the_engine_serves_up_to_where_the_frequencies_change(kind):
    model = rope_model(kind)
    pristine = copy.deepcopy(model)
    with pytest.raises(ConfigError, match=f"rope_type '{kind}' picks its frequencies"):
        Engine(model, num_blocks=64, block_size=4, max_model_len=THRESHOLD + 1)
    with Engine(model, num_blocks=64, block_size=4, max_num_batched_tokens=5) as engine:
        assert engine.context.limit == THRESHOLD
        short, long = engine.generate([SHORT, LONG], SamplingParams(max_new_tokens=NEW), use_tqdm=False)
        assert short.error is None and short.token_ids == stock(pristine, SHORT)
        assert long.error is not None and "over the context of 16 tokens" in long.error
        with pytest.raises(InvalidRequestError, match="over the context"):
            engine.add_request(LONG, SamplingParams(max_new_tokens=NEW))
        assert engine.pool.kv.num_used_blocks == 0


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_an_enabled_call_that_may_cross_the_threshold_runs_as_stock(kind):
    model = rope_model(kind)
    pristine = copy.deepcopy(model)
    pool = pc.enable(model, num_blocks=64, block_size=4)
    try:
        hits = []
        # the prompt decides (its prefill is one forward either way; decode steps are the same forwards): 8 + 6
        # positions stay below 16, 8 + 12 cross it while decoding and still hit, the long prompt would have hit 7
        for prompt, new in ((LONG[:8], NEW), (LONG[:8], NEW), (LONG[:8], 2 * NEW), (LONG, NEW)):
            before = pool.num_hit_tokens
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
            assert out[0, len(prompt) :].tolist() == stock(pristine, prompt, new)
            hits.append(pool.num_hit_tokens - before)
        assert hits == [0, 7, 7, 0]
    finally:
        pc.disable(model)


def test_the_ray_ingress_reads_the_same_context_as_its_replicas(tmp_path):
    """Regression (review): the Ray ingress took max_position_embeddings (128 here) while its replicas' Engines
    serve 16: default max_tokens and length checks disagreed with what the replicas accept."""
    from pagedcore.serve.ray.model_spec import ModelSpec

    rope_model("longrope").save_pretrained(tmp_path / "longrope")
    assert ModelSpec(str(tmp_path / "longrope")).context_length() == THRESHOLD
