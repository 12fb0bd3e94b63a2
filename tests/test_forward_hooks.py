"""The model's forward hooks that reserve a ``PagedCache``'s forward before layer 0 (``forward_hooks.py``).

The reservation moved out of the first layer (issue 17.19), so a forward that fails before any layer stores its keys
must give it back (the cache as it was, no block held), and a forward whose layers see another shape than the hook
did (a model that changes its input inside ``forward``) must still work.
"""

from __future__ import annotations

import pytest
import torch
from models import tiny_model
from paged_checks import batch, dynamic, release_and_check
from transformers import DynamicCache

from pagedcore.adapters.transformers import PagedCache, PagedKVPool
from pagedcore.adapters.transformers.forward_hooks import watched

pytestmark = pytest.mark.usefixtures("one_thread")


def test_one_pair_of_hooks_per_model_and_only_for_paged_caches():
    model = tiny_model("llama")
    assert not watched(model)
    caches = [PagedCache(model, num_blocks=16, block_size=4) for _ in range(3)]
    assert watched(model)
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    ids, mask = batch([0, 2], 6, seed=1)
    out = model(ids, mask, cache=DynamicCache(config=model.config))  # positional mask, another cache: untouched
    assert out.logits.shape[:2] == (2, 6)
    model(ids, mask, cache=caches[0])  # the mask given positionally is read too
    assert caches[0].row_padding() == [0, 2]
    release_and_check(*caches)


def test_a_forward_that_fails_before_any_layer_stores_leaves_the_cache_as_it_was(monkeypatch):
    model = tiny_model("llama")
    ids, mask = batch([0, 2], 6, seed=2)
    cache = PagedCache(model, num_blocks=16, block_size=4)
    original = PagedKVPool.layer_kv

    def failing(self, *args, **kwargs):
        raise RuntimeError("out of memory, say")

    monkeypatch.setattr(PagedKVPool, "layer_kv", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        model(ids, attention_mask=mask, cache=cache)
    assert cache.get_seq_length() == 0 and cache.batch_size == -1
    assert cache.pool.kv.num_used_blocks == 0
    monkeypatch.setattr(PagedKVPool, "layer_kv", original)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, cache=dynamic(model))
    got = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, cache=cache)
    assert got.tolist() == want.tolist()
    release_and_check(cache)


def test_layers_that_see_another_shape_than_the_hook_reserve_what_they_see():
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8]])
    cache = PagedCache(model, num_blocks=16, block_size=4)
    cache.before_forward(input_ids=torch.zeros(1, 9, dtype=torch.long))  # what an outer wrapper might announce
    model.model(ids[:, :3], cache=cache)  # the decoder is called directly with 3 tokens: no hook, other shape
    assert cache.get_seq_length() == 3 and cache.row_tokens() == [3]
    got = model(ids[:, 3:], cache=cache).logits[:, -1]
    reference = dynamic(model)
    want = model(ids, cache=reference).logits[:, -1]
    torch.testing.assert_close(cache.layers[0].keys, reference.layers[0].keys, atol=1e-5, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    release_and_check(cache)
