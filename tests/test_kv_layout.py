"""The pool's memory layouts (``kv_layout``): same shape, same results; only where the bytes lie differs."""

from __future__ import annotations

import pytest
import torch
from models import FIRST_TOKEN, VOCAB, tiny_model
from paged_checks import assert_same_generation, batch, dynamic, generate, release_and_check

from pagedcore.adapters.transformers import Engine, PagedCache, PagedKVPool, SamplingParams
from pagedcore.attention import write_kv
from pagedcore.errors import ConfigError


def test_unknown_layout_raises_a_config_error_naming_it():
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="'columns'"):
        PagedKVPool(model, num_blocks=4, kv_layout="columns")
    with pytest.raises(ConfigError, match="''"):  # not taken for "auto"
        PagedCache(model, num_blocks=4, kv_layout="")
    pool = PagedKVPool(model, num_blocks=4)
    with pytest.raises(ConfigError, match="kv_layout"):
        PagedCache(model, pool=pool, kv_layout="heads")
    assert pool.kv.num_used_blocks == 0


@pytest.mark.parametrize("layout", ["slots", "heads"])
def test_layouts_keep_the_shape_and_place_each_heads_keys(layout):
    model = tiny_model("llama")
    pool = PagedKVPool(model, num_blocks=6, block_size=4, kv_layout=layout)
    cache = PagedCache(model, pool=pool)
    generate(model, cache, input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
    keys, values = pool.layer_tensors(0)
    kv_heads, dim = keys.shape[-2:]
    assert keys.shape == values.shape == (7, 4, kv_heads, dim)
    assert keys.is_contiguous() == (layout == "slots")
    if layout == "heads":  # one head over consecutive blocks is one run of memory
        assert keys.stride() == (4 * dim, dim, 7 * 4 * dim, 1)
    release_and_check(cache)


def test_private_pool_is_heads_first_on_the_cpu():
    model = tiny_model("llama")
    cache = PagedCache(model, num_blocks=8)
    assert cache.pool.kv_layout == "auto" and cache.pool.layout_on(torch.device("cpu")) == "heads"
    assert PagedKVPool(model, num_blocks=4).kv_layout == "slots"


@pytest.mark.parametrize("layout", ["slots", "heads"])
def test_write_kv_of_a_run_equals_writing_each_slot(layout):
    shape = (5, 4, 2, 3)  # 4 blocks + pad block, block size 4, 2 heads, dim 3
    make = (lambda: torch.zeros(2, 5, 4, 3).permute(1, 2, 0, 3)) if layout == "heads" else (lambda: torch.zeros(shape))
    by_slot, by_run = (make(), make()), (make(), make())
    keys, values = torch.randn(6, 2, 3), torch.randn(6, 2, 3)
    write_kv(*by_slot, keys, values, torch.arange(7, 13))
    write_kv(*by_run, keys, values, 7)
    assert torch.equal(by_slot[0], by_run[0]) and torch.equal(by_slot[1], by_run[1])
    assert torch.equal(by_run[0].reshape(-1, 2, 3)[7:13], keys)


@pytest.mark.parametrize("attn", ["sdpa", "paged"])
@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("layout", ["slots", "heads"])
def test_every_layout_generates_as_dynamic_cache(family, attn, layout):
    model = tiny_model(family)
    ids, mask = batch([0, 3], 9)
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    want = generate(model, dynamic(model), input_ids=ids, **kwargs)
    single = generate(model, dynamic(model), input_ids=ids[:1], **{**kwargs, "attention_mask": mask[:1]})
    if attn == "paged":
        model.set_attn_implementation("paged")
    pool = PagedKVPool(model, num_blocks=32, block_size=4, kv_layout=layout)
    caches = [PagedCache(model, pool=pool), PagedCache(model, pool=pool)]
    assert_same_generation(generate(model, caches[0], input_ids=ids, **kwargs), want)  # padded batch: gathers
    assert_same_generation(  # one row: views of the pool
        generate(model, caches[1], input_ids=ids[:1], **{**kwargs, "attention_mask": mask[:1]}), single
    )
    release_and_check(*caches)


def test_beam_search_copies_blocks_in_the_heads_layout():
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    kwargs = {"max_new_tokens": 5, "num_beams": 3, "do_sample": False, "output_logits": False}
    want = generate(model, dynamic(model), input_ids=ids, **kwargs)
    cache = PagedCache(model, pool=PagedKVPool(model, num_blocks=32, block_size=2, kv_layout="heads"))
    got = generate(model, cache, input_ids=ids, **kwargs)
    assert got.sequences.tolist() == want.sequences.tolist()
    release_and_check(cache)


def test_an_engine_serves_from_a_heads_layout_pool_as_from_slots():
    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(3)
    shared = torch.randint(FIRST_TOKEN, VOCAB, (80,), generator=generator).tolist()  # 20 blocks: read once (cascade)
    prompts = [shared + torch.randint(FIRST_TOKEN, VOCAB, (n,), generator=generator).tolist() for n in (3, 9, 5)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    outputs = {}
    for layout in ("slots", "heads"):
        pool = PagedKVPool(model, num_blocks=64, block_size=4, kv_layout=layout)
        with Engine(model, pool=pool, max_num_batched_tokens=16) as engine:
            engine.generate(prompts[:1], params, use_tqdm=False)  # then the others share its cached prefix
            outputs[layout] = [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        assert pool.kv.num_used_blocks == 0
        pool.check_invariants()
    assert outputs["heads"] == outputs["slots"]
