"""Every attention mask ``generate`` accepts gives ``DynamicCache``'s tokens, in all three modes (issue 17.3).

The cache used to decide a row's padding from ``position_ids`` alone, which cannot tell left padding from a token
followed by masked positions: a 7-token row with mask ``[1, 0, 0, 0, 0, 0, 0]`` (row 0 of transformers' testers'
``torch.tril`` masks) has positions ``[0, 0, 0, 0, 0, 0, 0]`` and read as 6 padding positions, so the cache kept the
row's last token at position 0 and dropped its real first token. Now the model's forward pre-hook tells the cache
each forward's 2-D mask: left-padded rows store their real tokens, every other row is stored densely and the
standard mask hides what it hides.

The inputs are built the way transformers' ``GenerationTesterMixin`` builds them (``tests/generation/test_utils.py``
and the model testers' ``prepare_config_and_inputs``): token ids drawn over the whole vocabulary (special tokens
included), masks from ``torch.tril(torch.ones_like(input_ids))``, and, for GPT-2-like testers, no mask with
``pad_token_id = eos_token_id`` and ``eos_token_id`` unset, where ``generate`` infers ``[1, 0, 1, ...]`` from a
prompt whose second token is the pad token. Each case is compared with stock ``generate`` on a ``DynamicCache``
(sdpa, or eager where sdpa is unavailable) on the same inputs and random state: greedy tokens equal, fp32 per-step
logits within 1e-4; and seeded sampling.
"""

from __future__ import annotations

import functools

import pytest
import torch
from models import EOS, PAD, VOCAB, tiny_model
from paged_checks import assert_same_generation, dynamic, release_and_check

from pagedcore.adapters import transformers as pc
from pagedcore.adapters.transformers import PagedCache
from pagedcore.errors import InvalidRequestError

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["llama", "mistral", "qwen2", "gemma2", "phi3", "gpt2", "gpt_neox", "opt"]
MODES = ["paged_cache", "enable", "paged_attention"]
NEW_TOKENS = 4
WIDTH = 7  # the testers' seq_length
# One row per mask shape that is not plain left padding, and two that are (a full row, a left-padded one).
MASK_ROWS = {
    "tril_row_0": [1, 0, 0, 0, 0, 0, 0],  # torch.tril(ones)[0]: read as 6 pads before the fix
    "tril_row_1": [1, 1, 0, 0, 0, 0, 0],
    "hole": [1, 0, 1, 1, 0, 1, 1],
    "right_padding": [1, 1, 1, 1, 1, 0, 0],
    "left_then_hole": [0, 0, 1, 1, 0, 1, 1],
    "left_padding": [0, 0, 0, 1, 1, 1, 1],
    "full": [1, 1, 1, 1, 1, 1, 1],
}


@functools.cache
def stock(family: str) -> torch.nn.Module:
    """The reference: the family's stock attention (same weights as the other modes' models)."""
    return tiny_model(family)


@functools.cache
def paged(family: str) -> torch.nn.Module:
    return tiny_model(family, attn_implementation="paged")


def inputs_like_testers(seed: int) -> torch.Tensor:
    """Token ids as the testers' ``ids_tensor`` draws them: uniform over the whole vocabulary."""
    return torch.randint(0, VOCAB, (len(MASK_ROWS), WIDTH), generator=torch.Generator().manual_seed(seed))


def run(family: str, mode: str, **kwargs):
    """``generate`` in ``mode``; returns the output and the cache to release (or None)."""
    kwargs = {"max_new_tokens": NEW_TOKENS, "return_dict_in_generate": True, "output_logits": True, **kwargs}
    seed = kwargs.pop("seed", None)
    if mode == "enable":
        model = stock(family)
        pool = pc.enable(model, num_blocks=128, block_size=4)
        try:
            if seed is not None:
                torch.manual_seed(seed)
            out = model.generate(**kwargs)
        finally:
            pc.disable(model)
        if out.cache is not None:
            out.cache.release()
        assert pool.kv.num_used_blocks == 0
        pool.check_invariants()
        return out
    model = stock(family) if mode == "paged_cache" else paged(family)
    cache = PagedCache(model, num_blocks=128, block_size=4)
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(cache=cache, **kwargs)
    release_and_check(cache)
    return out


def reference(family: str, **kwargs):
    kwargs = {"max_new_tokens": NEW_TOKENS, "return_dict_in_generate": True, "output_logits": True, **kwargs}
    seed = kwargs.pop("seed", None)
    model = stock(family)
    if seed is not None:
        torch.manual_seed(seed)
    return model.generate(cache=dynamic(model), **kwargs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_mask_shape_matches_dynamic_cache(family, mode):
    ids = inputs_like_testers(seed=1)
    mask = torch.tensor(list(MASK_ROWS.values()))
    want = reference(family, input_ids=ids, attention_mask=mask, do_sample=False)
    got = run(family, mode, input_ids=ids, attention_mask=mask, do_sample=False)
    assert_same_generation(got, want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_testers_tril_mask_with_sampling_matches_dynamic_cache(family, mode):
    """``GenerationTesterMixin``'s batch of 2: the first two rows of a ``torch.tril`` mask, seeded sampling."""
    ids = inputs_like_testers(seed=2)[:2]
    mask = torch.tril(torch.ones_like(ids))
    kwargs = {"input_ids": ids, "attention_mask": mask, "do_sample": True, "top_k": 10, "seed": 0}
    assert_same_generation(run(family, mode, **kwargs), reference(family, **kwargs))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_mask_inferred_from_a_pad_token_inside_the_prompt(family, mode):
    """No mask, ``pad_token_id = eos`` and no eos (the testers' set-up): ``generate`` infers ``[1, 0, 1, ...]``
    because the prompt's second token is the pad token."""
    ids = inputs_like_testers(seed=3)[:2].clamp(min=EOS + 1)
    ids[:, 1] = EOS
    kwargs = {"input_ids": ids, "pad_token_id": EOS, "eos_token_id": None, "do_sample": False}
    assert_same_generation(run(family, mode, **kwargs), reference(family, **kwargs))


def test_the_tril_row_is_stored_densely_and_the_left_padded_row_without_its_padding():
    model = stock("llama")
    ids = inputs_like_testers(seed=4)[[0, 5]]
    mask = torch.tensor([MASK_ROWS["tril_row_0"], MASK_ROWS["left_padding"]])
    cache = PagedCache(model, num_blocks=32, block_size=4)
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, cache=cache)
    stored = WIDTH + 2 - 1
    assert cache.row_padding() == [0, 3]  # each row decided by its own mask
    assert cache.row_tokens() == [stored, stored - 3]
    release_and_check(cache)


def test_a_mask_that_shows_unstored_padding_as_tokens_is_refused():
    """Continuing a cache with a mask that calls a left-out padding position a token would attend to keys that were
    never stored: a typed error, the cache unchanged."""
    model = stock("llama")
    ids = torch.tensor([[PAD, PAD, 5, 6, 7]])
    cache = PagedCache(model, num_blocks=32, block_size=4)
    model(ids, attention_mask=torch.tensor([[0, 0, 1, 1, 1]]), cache=cache)
    assert cache.row_padding() == [2]
    with pytest.raises(InvalidRequestError, match="left positions 0-1 of that row out as padding"):
        model(torch.tensor([[8]]), attention_mask=torch.ones(1, 6, dtype=torch.long), cache=cache)
    assert cache.get_seq_length() == 5 and cache.row_tokens() == [3]
    release_and_check(cache)
