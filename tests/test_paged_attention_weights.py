"""``attn_implementation="paged"`` with ``output_attentions=True`` returns the attention weights (issue 17.5).

It used to return none, silently, and assisted / prompt-lookup decoding then raised ``IndexError`` inside
transformers (which indexes the weights). A layer asked for its weights now runs the model's own eager attention
(its modeling file's ``eager_attention_forward``) over the keys gathered from the pool, so tokens, logits and every
step's weights equal those of the same model loaded with ``attn_implementation="eager"`` on a ``DynamicCache``
(fp32 within 1e-4; the weights of unstored padding are 0 in both: the mask hides it).
"""

from __future__ import annotations

import functools

import pytest
import torch
from models import FIRST_TOKEN, VOCAB, tiny_model
from paged_checks import ATOL, assert_same_generation, batch, dynamic, release_and_check

from pagedcore.adapters import transformers as pc
from pagedcore.adapters.transformers import PagedCache

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["llama", "mistral", "gemma2", "gpt2"]  # plain, sliding window, softcap + sliding, GPT-2's own eager


@functools.cache
def model_for(family: str, attn: str) -> torch.nn.Module:
    return tiny_model(family, attn_implementation=attn)


def assert_same_attentions(got, want) -> None:
    assert len(got.attentions) == len(want.attentions)
    for step, (g_layers, w_layers) in enumerate(zip(got.attentions, want.attentions)):
        assert len(g_layers) == len(w_layers) > 0
        for layer, (g, w) in enumerate(zip(g_layers, w_layers)):
            assert g is not None, f"step {step} layer {layer}: no weights"
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0, msg=lambda m, s=step, i=layer: f"{s}/{i}: {m}")


def kwargs_for(ids, mask, **extra):
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "max_new_tokens": 4,
        "do_sample": False,
        "return_dict_in_generate": True,
        "output_logits": True,
        "output_attentions": True,
        **extra,
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_equal_eager_attention(family):
    ids, mask = batch([0, 3], 10, seed=1)
    eager = model_for(family, "eager")
    want = eager.generate(cache=dynamic(eager), **kwargs_for(ids, mask))
    model = model_for(family, "paged")
    cache = PagedCache(model, num_blocks=64, block_size=4)
    got = model.generate(cache=cache, **kwargs_for(ids, mask))
    assert_same_generation(got, want)
    assert_same_attentions(got, want)
    assert cache.row_padding() == [0, 3]  # the padding still is not stored
    release_and_check(cache)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_weights_with_enable(family):
    ids, mask = batch([0, 2], 10, seed=2)
    eager = model_for(family, "eager")
    want = eager.generate(cache=dynamic(eager), **kwargs_for(ids, mask))
    model = model_for(family, "paged")
    pool = pc.enable(model, num_blocks=64, block_size=4)
    try:
        for _ in range(2):  # cold, then with the prompt's blocks cached (attentions still cover the whole prompt)
            got = model.generate(**kwargs_for(ids, mask))
            got.cache.release()
            assert_same_generation(got, want)
            assert_same_attentions(got, want)
    finally:
        pc.disable(model)
    assert pool.kv.num_used_blocks == 0


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_prompt_lookup_decoding_with_attentions(family):
    """Stock sdpa raises ``IndexError`` here (transformers indexes the missing weights); paged attention returns
    them, so the call gives what eager attention gives."""
    prompt = torch.randint(FIRST_TOKEN, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([prompt, prompt[:, :4]], dim=1)  # a repeat for prompt lookup to find
    mask = torch.ones_like(ids)
    extra = {"prompt_lookup_num_tokens": 2}
    eager = model_for(family, "eager")
    want = eager.generate(cache=dynamic(eager), **kwargs_for(ids, mask, **extra))
    model = model_for(family, "paged")
    cache = PagedCache(model, num_blocks=64, block_size=4)
    got = model.generate(cache=cache, **kwargs_for(ids, mask, **extra))
    assert got.sequences.tolist() == want.sequences.tolist()
    assert_same_attentions(got, want)
    release_and_check(cache)
