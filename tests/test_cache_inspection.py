"""Code that reads a cache the transformers way sees a ``PagedCache``'s keys and values (issue 17.6).

``cache.layers[i].keys`` / ``.values`` were None on a ``PagedCache``, so five of transformers' own generation tests
(which end on a ``.layers[i].keys.shape`` check), tools that inspect or copy ``past_key_values`` and transformers'
cache-equality helper (``_check_caches_are_equal``, which compared ``None == None``) saw nothing. They are now the
row-major tensors a ``DynamicCache`` layer holds after the same calls, gathered from the blocks at each access (a
copy): ``(batch, kv_heads, positions, head_dim)``, the last ``window - 1`` positions in a sliding layer; left padding
the cache did not store reads as zeros. ``copy.deepcopy`` gives a cache sharing the blocks (copy-on-write).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from models import tiny_model
from paged_checks import batch, dynamic, release_and_check

from pagedcore.adapters import transformers as pc
from pagedcore.adapters.transformers import PagedCache

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["llama", "mistral", "gemma2", "gpt_neox", "gpt2"]  # full, sliding, hybrid, no kwargs, GPT-2
PADS = [0, 3]
WIDTH, NEW = 10, 5


@functools.cache
def model_for(family: str) -> torch.nn.Module:
    return tiny_model(family)


def greedy(model, cache=None, pads=PADS, **kwargs):
    ids, mask = batch(pads, WIDTH, seed=1)
    kwargs = {"max_new_tokens": NEW, "do_sample": False, "return_dict_in_generate": True, **kwargs}
    if cache is not None:
        kwargs["cache"] = cache
    return model.generate(ids, attention_mask=mask, **kwargs), mask


def assert_holds_like(paged, reference, mask) -> None:
    """Every layer's keys and values: the reference's shape; its values at every position the mask shows (a
    stored token); zeros at the unstored padding."""
    assert len(paged.layers) == len(reference.layers)
    for i, (mine, theirs) in enumerate(zip(paged.layers, reference.layers)):
        for name in ("keys", "values"):
            got, want = getattr(mine, name), getattr(theirs, name)
            assert got.shape == want.shape, f"layer {i} {name}"
            length = want.shape[2]
            full = torch.cat([mask, torch.ones(mask.shape[0], NEW, dtype=mask.dtype)], dim=1)
            shown = full[:, : paged.get_seq_length()][:, -length:].bool()  # the positions the layer holds
            torch.testing.assert_close(got.transpose(1, 2)[shown], want.transpose(1, 2)[shown], atol=1e-5, rtol=0)
            assert not got.transpose(1, 2)[~shown].any(), f"layer {i} {name}: padding is not stored, reads as zero"


@pytest.mark.parametrize("family", FAMILIES)
def test_keys_and_values_are_what_a_dynamic_cache_holds(family):
    model = model_for(family)
    reference = dynamic(model)
    want, mask = greedy(model, reference)
    cache = PagedCache(model, num_blocks=64, block_size=4)
    got, _ = greedy(model, cache)
    assert got.sequences.tolist() == want.sequences.tolist()
    assert_holds_like(cache, reference, mask)
    keys = cache.layers[0].keys
    keys.zero_()  # a copy: writing to it changes nothing
    assert cache.layers[0].keys.any()
    release_and_check(cache)
    assert cache.layers[0].keys is None  # nothing held any more


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_keys_after_a_prefix_hit(family):
    model = model_for(family)
    reference = dynamic(model)
    want, mask = greedy(model, reference)
    pool = pc.enable(model, num_blocks=128, block_size=4)
    try:
        greedy(model)[0].cache.release()
        hits = pool.num_hit_tokens
        got, _ = greedy(model)
        assert pool.num_hit_tokens > hits
        assert got.sequences.tolist() == want.sequences.tolist()
        assert_holds_like(got.cache, reference, mask)
        got.cache.release()
    finally:
        pc.disable(model)
    assert pool.kv.num_used_blocks == 0


def caches_are_equal(cache1, cache2) -> None:
    """transformers' ``GenerationTesterMixin._check_caches_are_equal``, as its generation tests call it."""
    assert len(cache1) == len(cache2)
    for idx in range(len(cache1)):
        if cache1.layers[idx].is_initialized:
            torch.testing.assert_close(cache1.layers[idx].keys, cache2.layers[idx].keys)
            torch.testing.assert_close(cache1.layers[idx].values, cache2.layers[idx].values)


def test_transformers_cache_equality_check_sees_the_contents():
    model = model_for("llama")
    first, second, other = (PagedCache(model, num_blocks=64, block_size=4) for _ in range(3))
    greedy(model, first, pads=[0, 0])
    greedy(model, second, pads=[0, 0])
    caches_are_equal(first, second)
    reference = dynamic(model)
    greedy(model, reference, pads=[0, 0])
    caches_are_equal(first, reference)  # no padding: equal to the DynamicCache everywhere
    greedy(model, other, pads=[0, 0], max_new_tokens=NEW - 1)
    with pytest.raises(AssertionError):
        caches_are_equal(first, other)
    release_and_check(first, second, other)


def test_deepcopy_continues_like_a_copied_dynamic_cache():
    """transformers' recipe for reusing a prompt's cache: fill it once, ``copy.deepcopy`` it per continuation."""
    model = model_for("llama")
    ids, mask = batch([0, 2], WIDTH, seed=2)
    prompt = PagedCache(model, num_blocks=64, block_size=4)
    reference = dynamic(model)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=prompt)
        model(ids, attention_mask=mask, cache=reference)
    continuation = torch.cat([ids, torch.tensor([[7, 8], [9, 10]])], dim=1)
    full_mask = torch.cat([mask, torch.ones(2, 2, dtype=mask.dtype)], dim=1)
    kwargs = {"attention_mask": full_mask, "max_new_tokens": 3, "do_sample": False}
    for _ in range(2):  # twice from the same prompt cache: the first continuation must not change it
        copied = copy.deepcopy(prompt)
        want = model.generate(continuation, cache=copy.deepcopy(reference), **kwargs)
        assert model.generate(continuation, cache=copied, **kwargs).tolist() == want.tolist()
        assert prompt.get_seq_length() == WIDTH
        copied.release()
    release_and_check(prompt)
