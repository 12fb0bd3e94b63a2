"""``enable()`` passes every model input a call was given to the prompt's shared prefill (issue 17.4).

With ``num_return_sequences > 1`` or ``num_beams > 1`` an enabled ``generate`` computes the prompt once for the
unexpanded batch (``prefix_caching._prefill_once``) and forks the rows. That prefill passed the model only
``input_ids``, ``attention_mask`` and ``position_ids``: the ``token_type_ids`` of the GPT-2 family (GPT-2, GPT-Neo,
CTRL: the families of ``tests/models.py`` whose forward takes an input beyond those) were dropped, and the prompt's
keys were computed without their type embeddings (logits ~1.8e-2 off, other tokens). Each case compares greedy
tokens and fp32 logits with stock ``generate`` on a ``DynamicCache``; also with left padding and a prefix hit.
"""

from __future__ import annotations

import functools

import pytest
import torch
from models import FIRST_TOKEN, PAD, VOCAB, tiny_model
from paged_checks import assert_same_generation, dynamic

pytestmark = pytest.mark.usefixtures("one_thread")
ENABLE_DEFAULTS = {"num_blocks": 128, "block_size": 4}

TOKEN_TYPE_FAMILIES = ["gpt2", "gpt_neo", "ctrl"]
EXPANSIONS = {"num_return_sequences": {"num_return_sequences": 2, "do_sample": True}, "beams": {"num_beams": 2}}


@functools.cache
def model_for(family: str) -> torch.nn.Module:
    return tiny_model(family)


def inputs(seed: int, pads: tuple[int, ...] = (0, 3)) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_TOKEN, VOCAB, (len(pads), 10), generator=generator)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        ids[row, :pad] = PAD
        mask[row, :pad] = 0
    token_types = torch.randint(0, VOCAB, ids.shape, generator=generator)  # GPT-2 embeds them with its tokens
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": token_types}


def generate(model, cache=None, **kwargs):
    torch.manual_seed(0)
    kwargs = {"max_new_tokens": 4, "return_dict_in_generate": True, "output_logits": True, **kwargs}
    if cache is not None:
        kwargs["cache"] = cache
    out = model.generate(**kwargs)
    if cache is None and out.cache is not None:
        out.cache.release()
    return out


@pytest.mark.parametrize("expansion", list(EXPANSIONS))
@pytest.mark.parametrize("family", TOKEN_TYPE_FAMILIES)
def test_token_type_ids_reach_the_shared_prefill(family, expansion, enabled):
    model = model_for(family)
    kwargs = {**inputs(seed=1), **EXPANSIONS[expansion]}
    want = generate(model, dynamic(model), **kwargs)
    pool = enabled(model)
    assert_same_generation(generate(model, **kwargs), want)
    # Again, now with the prompt's blocks in the prefix cache: the hit is served, the rest prefilled with its types.
    hits = pool.num_hit_tokens
    assert_same_generation(generate(model, **kwargs), want)
    assert pool.num_hit_tokens > hits


@pytest.mark.parametrize("family", TOKEN_TYPE_FAMILIES)
def test_token_type_ids_without_expansion_match_stock_generate(family, enabled):
    model = model_for(family)
    kwargs = inputs(seed=2)
    want = generate(model, dynamic(model), do_sample=False, **kwargs)
    enabled(model)
    assert_same_generation(generate(model, do_sample=False, **kwargs), want)
