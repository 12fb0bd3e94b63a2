"""enable()/disable(): automatic prefix caching for plain model.generate."""

from __future__ import annotations

import copy
import io
import pickle
import threading

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

from pagedcore import ConfigError, OutOfBlocksError, PoolMismatchError
from pagedcore.adapters import transformers as pc

SYSTEM = torch.arange(3, 40)[None]  # 37 tokens: 9 full blocks of 4 and one token over


def llama(seed: int = 0, attn: str = "sdpa", **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    settings = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 128,
        "initializer_range": 0.5,
        "pad_token_id": 0,
    }
    config = LlamaConfig(**{**settings, **overrides})
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation(attn)
    return model


def prompt(*question: int) -> torch.Tensor:
    return torch.cat([SYSTEM, torch.tensor([question])], dim=1)


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.shape[1] for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - row.shape[1] :] = row[0]
        mask[i, width - row.shape[1] :] = 1
    return ids, mask


GREEDY = {"max_new_tokens": 6, "do_sample": False, "return_dict_in_generate": True, "output_scores": True}


def assert_same(ref, out) -> None:
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref.scores, out.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("attn", ["sdpa", "paged"])
def test_prefix_hit_equals_cold_generate(enabled, attn):
    model = llama(attn=attn)
    prompts = [prompt(50, 51, 52), prompt(60), prompt(70, 71, 72, 73, 74, 75)]
    refs = [model.generate(p, cache=DynamicCache(config=model.config), **GREEDY) for p in prompts]
    pool = enabled(model, num_blocks=128, block_size=4)
    for _ in range(2):
        outs = [model.generate(p, **GREEDY) for p in prompts]
        for ref, out in zip(refs, outs):
            assert_same(ref, out)
            out.cache.release()  # the outputs carry their caches, which hold blocks until released or dropped
        assert pool.kv.num_used_blocks == 0
    # Round 1: prompts 2 and 3 reuse the system prompt's 37 tokens (9 full blocks and, to the token, the first
    # position of the first prompt's 10th block). Round 2: every position of every prompt is cached (prompt and
    # generated tokens were registered, the partly filled last block too); the last prompt token is always
    # recomputed.
    assert pool.num_query_tokens == 2 * sum(p.shape[1] for p in prompts)
    assert pool.num_hit_tokens == 2 * 37 + sum(p.shape[1] - 1 for p in prompts)


@pytest.mark.parametrize("attn", ["sdpa", "paged"])
def test_batched_left_padded_hit_uses_the_part_safe_for_all_rows(enabled, attn):
    model = llama(attn=attn)
    ids, mask = left_padded([prompt(50, 51, 52, 53, 54), prompt(60), prompt(70, 71, 72)])
    ref = model.generate(ids, attention_mask=mask, **GREEDY)
    pool = enabled(model, num_blocks=128, block_size=4)
    model.generate(SYSTEM, max_new_tokens=1)  # warm the system prompt only
    hits_before = pool.num_hit_tokens
    out = model.generate(ids, attention_mask=mask, **GREEDY)
    assert_same(ref, out)
    # Rows have 0, 4 and 2 pads; each has the 37 cached system tokens (to the token): the shared rectangular prefix
    # is min(pad + 37) = 37, so the rows reuse 37, 33 and 35 tokens.
    assert pool.num_hit_tokens - hits_before == 37 + 33 + 35


def test_num_return_sequences_and_beams_share_the_prompt(enabled):
    model = llama()
    ids, mask = left_padded([prompt(50, 51), prompt(60)])
    torch.manual_seed(3)
    ref_sample = model.generate(ids, attention_mask=mask, do_sample=True, num_return_sequences=3, max_new_tokens=5)
    ref_beam = model.generate(ids, attention_mask=mask, num_beams=3, num_return_sequences=2, max_new_tokens=5)
    enabled(model, num_blocks=128, block_size=4)
    torch.manual_seed(3)
    out_sample = model.generate(ids, attention_mask=mask, do_sample=True, num_return_sequences=3, max_new_tokens=5)
    out_beam = model.generate(ids, attention_mask=mask, num_beams=3, num_return_sequences=2, max_new_tokens=5)
    assert torch.equal(ref_sample, out_sample)
    assert torch.equal(ref_beam, out_beam)


def test_forked_rows_hold_the_prompt_once(enabled):
    model = llama()
    pool = enabled(model, num_blocks=256, block_size=4)
    peak: list[int] = []

    class Watch(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            peak.append(pool.kv.num_used_blocks)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model.generate(
        prompt(1),
        do_sample=True,
        num_return_sequences=4,
        max_new_tokens=2,
        stopping_criteria=StoppingCriteriaList([Watch()]),
    )
    # 39 prompt tokens stored once (10 blocks), each of the 4 samples owns one block for its tail.
    assert max(peak) <= 10 + 4


def test_namespaces_never_share(enabled):
    model = llama()
    pool = enabled(model, num_blocks=128, block_size=4)
    with pc.namespace("tenant-a"):
        model.generate(prompt(5), max_new_tokens=2)
    with pc.namespace("tenant-b"):
        model.generate(prompt(5), max_new_tokens=2)
    assert pool.num_hit_tokens == 0
    model.generate(prompt(5), max_new_tokens=2, pagedcore_namespace="tenant-a")  # per-call override
    assert pool.num_hit_tokens == 37  # the 38-token prompt but its last token (always recomputed)
    model.generate(prompt(5), max_new_tokens=2)  # the default namespace is separate too
    assert pool.num_hit_tokens == 37


def test_disable_restores_generate_and_keeps_the_pool(enabled):
    model = llama()
    original = type(model).generate
    pool = enabled(model, num_blocks=64, block_size=4)
    assert pc.prefix_pool(model) is pool
    with pytest.raises(ConfigError, match="already enabled"):
        pc.enable(model)
    assert pc.disable(model) is pool
    assert "generate" not in vars(model) and type(model).generate is original
    with pytest.raises(ConfigError, match="not enabled"):
        pc.disable(model)


def test_pool_too_small_raises_before_generation_and_changes_nothing(enabled):
    model = llama()
    pool = enabled(model, num_blocks=8, block_size=4)
    model.generate(prompt(1)[:, :20], max_new_tokens=2)  # leaves cached blocks behind
    before = (pool.kv.num_used_blocks, pool.kv.num_cached_blocks, pool.num_hit_tokens)
    with pytest.raises(OutOfBlocksError, match="needs up to"):
        model.generate(prompt(1, 2, 3), max_new_tokens=50)
    assert pool.kv.num_used_blocks == 0
    assert pool.kv.num_cached_blocks == before[1]
    pool.check_invariants()


def test_a_failing_call_leaves_no_block_held(enabled):
    model = llama()
    pool = enabled(model, num_blocks=64, block_size=4)

    class Boom(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.generate(prompt(1), max_new_tokens=4, stopping_criteria=StoppingCriteriaList([Boom()]))
    assert pool.kv.num_used_blocks == 0
    pool.check_invariants()


def test_explicit_cache_bypasses_prefix_caching(enabled):
    model = llama()
    pool = enabled(model, num_blocks=64, block_size=4)
    cache = DynamicCache(config=model.config)
    model.generate(prompt(1), max_new_tokens=2, cache=cache)
    assert cache.get_seq_length() > 0 and pool.num_query_tokens == 0


def test_pool_for_another_model_is_refused():
    pool = pc.PagedKVPool(llama(), num_blocks=16)
    other = llama(num_hidden_layers=3)
    with pytest.raises(PoolMismatchError, match="layers"):
        pc.enable(other, pool=pool)


def test_generate_from_threads_is_safe(enabled):
    model = llama()
    prompts = [prompt(i, i + 1) for i in range(6)]
    refs = [model.generate(p, max_new_tokens=4, do_sample=False) for p in prompts]
    pool = enabled(model, num_blocks=256, block_size=4)
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for _ in range(3):
                results[i] = model.generate(prompts[i], max_new_tokens=4, do_sample=False)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, ref in enumerate(refs):
        assert torch.equal(results[i], ref)
    assert pool.kv.num_used_blocks == 0
    pool.check_invariants()


def test_a_pool_serves_one_model_only():
    first, second = llama(seed=0), llama(seed=1)  # same shapes, different weights
    pool = pc.PagedKVPool(first, num_blocks=32)
    for use in (
        lambda: pc.PagedCache(second, pool=pool),
        lambda: pc.enable(second, pool=pool),
        lambda: pc.Engine(second, pool=pool),
    ):
        with pytest.raises(PoolMismatchError, match="another LlamaForCausalLM instance"):
            use()
    assert not pc.is_enabled(second)
    from_config = pc.PagedKVPool(first.config, num_blocks=32)
    pc.PagedCache(first, pool=from_config)  # the first model to use it owns it
    with pytest.raises(PoolMismatchError):
        pc.PagedCache(second, pool=from_config)


@pytest.mark.parametrize(
    "sizing",
    [
        {"num_blocks": 8},
        {"memory_budget": "1MiB"},
        {"block_size": 8},
        {"eviction_policy": "lru"},
        {"kv_store": "x", "kv_store_bytes": "1MiB"},
    ],
)
def test_a_new_pools_arguments_with_pool_are_refused_and_enable_nothing(sizing):
    """Each sizes or configures a new pool; with ``pool=`` it used to be ignored (block_size, eviction_policy)."""
    model = llama()
    pool = pc.PagedKVPool(model, num_blocks=16)
    with pytest.raises(ConfigError, match="pool"):
        pc.enable(model, pool=pool, **sizing)
    assert not pc.is_enabled(model) and "generate" not in vars(model)


def test_a_copy_of_an_enabled_model_is_a_plain_model_of_its_own_weights(enabled):
    """TRL's create_reference_model deep-copies the policy: the copy's generate ran the original (its closure held
    it), so after a change to either model's weights it gave the other's tokens."""
    model = llama()
    pool = enabled(model, num_blocks=128, block_size=4, sleep_when_training=True)
    model.generate(prompt(5), max_new_tokens=2)  # the pool holds cached prefixes
    for twin in (copy.deepcopy(model), copy.copy(model)):
        assert not pc.is_enabled(twin) and "generate" not in vars(twin) and "__reduce_ex__" not in vars(twin)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    stock = type(model).generate
    assert torch.equal(twin.generate(prompt(5), **GREEDY).sequences, stock(twin, prompt(5), **GREEDY).sequences)
    assert_same(stock(model, prompt(5), **GREEDY), model.generate(prompt(5), **GREEDY))
    twin.train()(prompt(5), labels=prompt(5)).loss.backward()  # a training forward of the copy
    assert not pool.is_sleeping  # the original's sleep_when_training hook was not copied
    twin_pool = pc.enable(twin, num_blocks=128, block_size=4)  # a pool of its own (one pair of cache hooks)
    twin.eval()
    for _ in range(2):
        assert torch.equal(twin.generate(prompt(5), **GREEDY).sequences, stock(twin, prompt(5), **GREEDY).sequences)
    assert twin_pool is not pool and twin_pool.num_hit_tokens > 0
    pc.disable(twin)


def test_an_enabled_model_pickles_as_a_plain_model_and_a_paged_cache_refuses(enabled):
    model = llama()
    enabled(model, num_blocks=128, block_size=4, sleep_when_training=True)
    out = model.generate(prompt(5), **GREEDY)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # was a PicklingError: the installed generate is no module-level function
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert not pc.is_enabled(loaded) and "generate" not in vars(loaded)
    assert torch.equal(loaded.generate(prompt(5), **GREEDY).sequences, out.sequences)
    assert pc.is_enabled(model)
    with pytest.raises(TypeError, match="a PagedCache cannot be pickled"):
        pickle.dumps(out.cache)
    assert out.cache.get_seq_length() == out.sequences.shape[1] - 1  # untouched
    out.cache.release()


def test_enable_on_a_compiled_model_enables_the_module_it_wraps(enabled):
    """``torch.compile(model)`` is an OptimizedModule whose generate is its module's: enable() used to read
    ``type(compiled).generate`` and raise AttributeError."""
    model = llama()
    ref = model.generate(prompt(5), **GREEDY)
    compiled = torch.compile(model, backend="eager")
    pool = enabled(compiled, num_blocks=128, block_size=4)
    assert pc.is_enabled(compiled) and pc.is_enabled(model) and pc.prefix_pool(compiled) is pool
    for _ in range(2):
        out = compiled.generate(prompt(5), **GREEDY)
        assert_same(ref, out)
        out.cache.release()
    assert pool.num_hit_tokens == prompt(5).shape[1] - 1
    assert pc.disable(compiled) is pool and "generate" not in vars(model)


def test_assistant_early_exit_is_served_as_stock(enabled):
    """transformers drafts with the model itself, its config cut to ``assistant_early_exit`` layers for a nested
    generate: that call met the pool (PoolMismatchError), and the config stayed cut (later calls wrong)."""
    model = llama()
    ids = prompt(5, 6, 7)
    ref = model.generate(ids, max_new_tokens=8, do_sample=False, assistant_early_exit=1)
    plain = model.generate(ids, max_new_tokens=8, do_sample=False)
    pool = enabled(model, num_blocks=128, block_size=4)
    for _ in range(2):
        assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, assistant_early_exit=1), ref)
    assert model.config.num_hidden_layers == 2 and pool.kv.num_used_blocks == 0
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), plain)
