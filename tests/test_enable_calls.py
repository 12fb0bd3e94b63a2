"""enable(): calls that must compute the whole prompt, a model converted after use, the model's context, bad
input tensors and the explicit default namespace. Each bad call raises a typed error and changes nothing in the
pool; each good one matches stock ``generate`` on a DynamicCache."""

from __future__ import annotations

import warnings

import pytest
import torch
from models import FIRST_TOKEN, PAD, VOCAB, tiny_model
from paged_checks import assert_same_generation, dynamic
from transformers import DynamicCache

from pagedcore import InvalidBlockError, InvalidRequestError, OutOfBlocksError, PoolMismatchError
from pagedcore.adapters import transformers as pc
from pagedcore.adapters.transformers import PagedCache

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4


def tokens(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(FIRST_TOKEN, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def pool_state(pool) -> tuple[int, int, int, int]:
    return pool.kv.num_used_blocks, pool.kv.num_cached_blocks, pool.num_query_tokens, pool.num_hit_tokens


ENABLE_DEFAULTS = {"num_blocks": 256, "block_size": BLOCK}


# ------------------------------------------------------------------------------- calls that compute the whole prompt
FULL = {"max_new_tokens": 4, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}


@pytest.mark.parametrize("output", ["output_attentions", "output_hidden_states"])
def test_attentions_and_hidden_states_cover_the_whole_prompt_on_a_warm_pool(enabled, output):
    model = tiny_model("llama", attn_implementation="eager")  # attentions need eager attention
    ids = tokens(14, seed=1)
    want = model.generate(ids, cache=dynamic(model), **FULL, **{output: True})
    pool = enabled(model)
    model.generate(ids, max_new_tokens=2)  # warm: all 14 prompt tokens are cached (a hit would serve 13)
    before = pool_state(pool)
    got = model.generate(ids, **FULL, **{output: True})
    assert_same_generation(got, want)
    name = "attentions" if output == "output_attentions" else "hidden_states"
    for step_got, step_want in zip(getattr(got, name), getattr(want, name)):  # step 0 covers all 14 prompt positions
        for layer_got, layer_want in zip(step_got, step_want):
            assert layer_got.shape == layer_want.shape
            torch.testing.assert_close(layer_got, layer_want, atol=1e-4, rtol=0)
    assert pool.num_query_tokens == before[2]  # no lookup was made
    got.cache.release()
    model.generate(ids, max_new_tokens=2)  # its blocks were registered all the same
    assert pool.num_hit_tokens - before[3] == 13


def test_hidden_states_with_num_return_sequences(enabled):
    model = tiny_model("llama")
    ids = tokens(10, seed=2)
    kwargs = {**FULL, "do_sample": True, "num_return_sequences": 3, "output_hidden_states": True}
    torch.manual_seed(5)
    want = model.generate(ids, cache=dynamic(model), **kwargs)
    enabled(model)
    model.generate(ids, max_new_tokens=2)
    torch.manual_seed(5)
    got = model.generate(ids, **kwargs)
    assert_same_generation(got, want)
    assert [h.shape for h in got.hidden_states[0]] == [h.shape for h in want.hidden_states[0]]
    got.cache.release()


def test_a_positional_generation_config_is_planned_as_a_keyword_one(enabled):
    """``generate(ids, config)``: the config is generate's second parameter. The call was planned with the model's
    defaults: a warm call's hidden states covered 1 prompt position (a prefix hit), beams x num_return_sequences
    crashed, and the reservation was sized for 20 new tokens, not the config's."""
    from transformers import GenerationConfig

    model = tiny_model("llama")
    ids = tokens(14, seed=3)
    hidden = GenerationConfig(**FULL, output_hidden_states=True, pad_token_id=PAD)
    want = model.generate(ids, hidden, cache=dynamic(model))
    beams = GenerationConfig(max_new_tokens=5, num_beams=2, num_return_sequences=2, pad_token_id=PAD)
    want_beams = model.generate(ids, beams, cache=dynamic(model))
    pool = enabled(model)
    model.generate(ids, max_new_tokens=2)  # warm
    got = model.generate(ids, hidden)
    assert_same_generation(got, want)
    assert [h.shape for h in got.hidden_states[0]] == [h.shape for h in want.hidden_states[0]]
    got.cache.release()
    assert torch.equal(model.generate(ids, beams), want_beams)
    small = tiny_model("llama")
    small_pool = pc.enable(small, num_blocks=6, block_size=8)  # room for 48 tokens
    with pytest.raises(OutOfBlocksError, match="this generate call needs up to 8 blocks of 8"):  # before any forward
        small.generate(ids[:, :5], GenerationConfig(max_new_tokens=60, pad_token_id=PAD))
    assert small_pool.kv.num_used_blocks == small_pool.kv.num_cached_blocks == pool.kv.num_used_blocks == 0


def test_calls_in_train_mode_with_dropout_run_as_stock(enabled):
    """In train() with dropout each forward draws its own masks: a second seeded call that reused the first call's
    cached keys gave other tokens than stock. Such calls compute their whole prompt and cache nothing; without
    dropout, training mode reuses prefixes as eval mode does."""
    dropping = tiny_model("llama", attention_dropout=0.3, seed=2).train()
    ids = tokens(12, seed=4)

    def seeded(model):
        torch.manual_seed(1)
        return model.generate(ids, max_new_tokens=8, do_sample=False)

    want = seeded(dropping)
    pool = enabled(dropping)
    assert torch.equal(seeded(dropping), want) and torch.equal(seeded(dropping), want)
    assert pool.num_query_tokens == 0 and pool.kv.num_cached_blocks == 0
    plain = tiny_model("llama", seed=2).train()
    want = seeded(plain)
    pool = enabled(plain)
    assert torch.equal(seeded(plain), want) and torch.equal(seeded(plain), want)
    assert pool.num_hit_tokens > 0


def test_draws_dropout_sees_a_submodule_in_train_mode_and_a_class_level_probability():
    """draws_dropout's cheap walk (each module's mode first, its own attributes from its __dict__) finds what the
    full walk found: a submodule alone in train(), a dropout probability its class gives, a tied (shared) module."""
    from pagedcore.adapters.transformers.generate_call import draws_dropout

    model = tiny_model("gpt2", resid_pdrop=0.1, embd_pdrop=0.0, attn_pdrop=0.0)
    assert not draws_dropout(model)
    model.transformer.h[1].mlp.train()
    assert draws_dropout(model)
    model.eval()

    class Attention(torch.nn.Module):
        attention_dropout = 0.2  # a class attribute, not in the module's __dict__

    model.transformer.h[0].extra = Attention().eval()
    assert not draws_dropout(model)
    model.transformer.h[0].extra.train()
    assert draws_dropout(model)
    model.transformer.h[0].extra.attention_dropout = 0.0  # the module's own value wins
    assert not draws_dropout(model)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_refused_call_counts_no_lookup(enabled, family):
    """A call whose reservation the pool refuses leaves its statistics as they were: its rows' lookups (made to size
    the reservation) were counted in num_query_tokens / num_hit_tokens before the refusal."""
    from hybrid_models import hybrid_model

    model = tiny_model("llama") if family == "llama" else hybrid_model(family)
    pool = enabled(model, num_blocks=8, block_size=BLOCK)
    ids = tokens(12, seed=5)
    model.generate(ids, max_new_tokens=2)  # warm: the refused call below would hit 8+ of its tokens
    before = pool_state(pool)
    with pytest.raises(OutOfBlocksError, match="this generate call needs up to"):
        model.generate(ids, max_new_tokens=64)
    assert pool_state(pool) == before
    model.generate(ids, max_new_tokens=2)
    assert pool.num_query_tokens == before[2] + 12 and pool.num_hit_tokens > before[3]


def test_prompt_lookup_decoding_on_a_warm_pool(enabled):
    """transformers 5.24's candidate decoding is wrong after a pre-filled cache (a DynamicCache too); a warm enabled
    call used to hand it one and generated other tokens."""
    model = tiny_model("llama")
    pattern = torch.tensor([[11, 12, 13, 14, 15]])
    ids = torch.cat([pattern, pattern, pattern[:, :3]], 1)
    kwargs = {**FULL, "max_new_tokens": 16, "prompt_lookup_num_tokens": 3}
    want = model.generate(ids, cache=dynamic(model), **kwargs)
    pool = enabled(model)
    for _ in range(2):
        got = model.generate(ids, **kwargs)
        assert_same_generation(got, want)
        got.cache.release()
    assert pool.num_hit_tokens == 0 and pool.kv.num_cached_blocks > 0


# ------------------------------------------------------------------------------------------- a converted model
def test_converting_the_model_rebuilds_an_idle_pool(enabled):
    model = tiny_model("llama")
    ids = tokens(13, seed=3)
    pool = enabled(model)
    for _ in range(2):
        model.generate(ids, max_new_tokens=3)
    assert pool.num_hit_tokens == 12 and pool.layer_tensors(0)[0].dtype == torch.float32
    capacity = pool.memory_stats().capacity_bytes
    model.to(torch.bfloat16)
    want = model.generate(ids, max_new_tokens=3, do_sample=False, cache=DynamicCache(config=model.config))
    got = model.generate(ids, max_new_tokens=3, do_sample=False)  # used to fail inside SDPA (float vs bfloat16)
    assert torch.equal(got, want)
    assert pool.num_hit_tokens == 12  # the fp32 prefixes were dropped, not served
    assert pool.layer_tensors(0)[0].dtype == torch.bfloat16
    model.generate(ids, max_new_tokens=3)
    assert pool.num_hit_tokens == 24  # and the new ones are served
    assert pool.memory_stats().capacity_bytes == capacity // 2  # the same blocks, half the bytes


def test_converting_the_model_while_a_cache_is_kept_raises_until_it_is_released(enabled):
    model = tiny_model("llama")
    ids = tokens(13, seed=4)
    pool = enabled(model)
    out = model.generate(ids, max_new_tokens=3, return_dict_in_generate=True)
    model.to(torch.bfloat16)
    before = pool_state(pool)
    with pytest.raises(PoolMismatchError, match=r"torch.bfloat16.*release"):
        model.generate(ids, max_new_tokens=3)
    with pytest.raises(PoolMismatchError, match="release"):
        model.generate(out.sequences, max_new_tokens=3, cache=out.cache)
    assert pool_state(pool) == before
    assert pool.layer_tensors(0)[0].dtype == torch.float32
    out.cache.release()
    want = model.generate(ids, max_new_tokens=3, do_sample=False, cache=DynamicCache(config=model.config))
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), want)


def test_a_paged_cache_on_the_pool_of_a_converted_model_raises_then_rebuild_serves_it():
    model = tiny_model("llama")
    pool = pc.PagedKVPool(model, num_blocks=64, block_size=BLOCK)
    ids = tokens(9, seed=5)
    first = PagedCache(model, pool=pool)
    model.generate(ids, max_new_tokens=2, cache=first)
    model.to(torch.bfloat16)
    cache = PagedCache(model, pool=pool)
    with pytest.raises(PoolMismatchError, match=r"torch.bfloat16.*pool.rebuild\(\)"):
        model.generate(ids, max_new_tokens=2, cache=cache)
    assert cache.get_seq_length() == 0 and cache.row_tokens() == []  # nothing reserved before the check
    with pytest.raises(InvalidBlockError, match="held"):
        pool.rebuild()  # the first cache still holds blocks
    first.release()
    pool.rebuild()
    cache = PagedCache(model, pool=pool)
    want = model.generate(ids, max_new_tokens=2, do_sample=False, cache=DynamicCache(config=model.config))
    assert torch.equal(model.generate(ids, max_new_tokens=2, do_sample=False, cache=cache), want)
    cache.release()
    assert pool.kv.num_used_blocks == 0
    pool.check_invariants()


# ----------------------------------------------------------------------------------------------- the model's context
@pytest.mark.parametrize("family", ["llama", "gpt2", "opt", "gpt_neox"])
def test_prompt_and_new_tokens_over_the_context_raise(enabled, family):
    model = tiny_model(family)  # 512 positions
    pool = enabled(model)
    model.generate(tokens(20), max_new_tokens=2)
    before = pool_state(pool)
    for length, new in ((520, 2), (500, 13)):
        with pytest.raises(InvalidRequestError, match=f"has {length} tokens and asks for {new} more: .* 512 tokens"):
            model.generate(tokens(length), max_new_tokens=new)  # GPT-2 used to raise IndexError, Llama to run on
    assert pool_state(pool) == before
    assert model.generate(tokens(500), max_new_tokens=12).shape == (1, 512)


def test_padding_takes_no_position(enabled):
    model = tiny_model("gpt2")
    enabled(model)
    ids = torch.cat([torch.full((1, 8), PAD), tokens(505)], 1)  # 513 wide, 505 real tokens
    mask = (ids != PAD).long()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, cache=dynamic(model))
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False), want)


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("bloom", {}),  # ALiBi: no position table
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    ],
)
def test_models_without_a_hard_limit_may_go_past_it(enabled, family, overrides):
    # Two copies of the same weights: dynamic NTK rope keeps state from the longest sequence it saw.
    reference, model = tiny_model(family, **overrides), tiny_model(family, **overrides)
    enabled(model)
    ids = tokens(520)
    want = reference.generate(ids, max_new_tokens=2, do_sample=False, cache=dynamic(reference))
    assert torch.equal(model.generate(ids, max_new_tokens=2, do_sample=False), want)


# ------------------------------------------------------------------------------------------------ bad input tensors
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda ids: ids.float(), "torch.float32"),
        (lambda ids: ids.bool(), "torch.bool"),
        (lambda ids: ids.to(torch.uint8), "torch.uint8"),
        (lambda ids: ids[0], "2-D"),
    ],
    ids=["float", "bool", "uint8", "1-D"],
)
def test_input_ids_that_are_not_token_ids_raise(enabled, make, match):
    model = tiny_model("llama")
    pool = enabled(model)
    model.generate(tokens(9), max_new_tokens=2)
    before = pool_state(pool)
    with pytest.raises(InvalidRequestError, match=match):
        model.generate(make(tokens(9)), max_new_tokens=2)  # used to reach the model and fail inside it
    assert pool_state(pool) == before
    assert model.generate(tokens(9).int(), max_new_tokens=2).shape == (1, 11)  # int32 ids are token ids


# -------------------------------------------------------------------------------------------------------- namespaces
def test_an_explicit_none_is_the_shared_default_namespace(enabled):
    model = tiny_model("llama")
    pool = enabled(model, namespace="model-default")
    ids = tokens(13, seed=6)
    model.generate(ids, max_new_tokens=2, pagedcore_namespace=None)  # caches 12 tokens in the shared namespace
    hits = pool.num_hit_tokens
    with pc.namespace("tenant-x"):
        model.generate(ids, max_new_tokens=2)
        assert pool.num_hit_tokens == hits  # tenant-x sees nothing of it
        model.generate(ids, max_new_tokens=2, pagedcore_namespace=None)
        assert pool.num_hit_tokens == hits + 12  # None: the shared default namespace, not "unset"
        with pc.namespace(None):
            model.generate(ids, max_new_tokens=2)
            assert pool.num_hit_tokens == hits + 24
    model.generate(ids, max_new_tokens=2)  # the model's own default namespace is another one
    assert pool.num_hit_tokens == hits + 24


def test_kept_caches_continue_registering_only_in_a_namespace_of_the_same_type(enabled):
    model = tiny_model("llama")
    pool = enabled(model)
    ids = tokens(9, seed=7)
    out = model.generate(ids, max_new_tokens=4, return_dict_in_generate=True, pagedcore_namespace=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        more = model.generate(
            out.sequences, max_new_tokens=8, return_dict_in_generate=True, cache=out.cache, pagedcore_namespace=True
        )
    assert pool.kv.match(more.sequences[0].tolist(), 1).num_tokens == 12  # True is not 1: nothing more registered
    more.cache.release()
