"""On-policy by construction: the weights version per output, requests running across a weight update, the Engine's
log-probabilities against a training forward, stale prefix hits counted from the outside, and the pool's memory given
back to training (sleep / wake)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")  # the rl extra: the GPU image has none

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from trl.trainer.utils import selective_log_softmax

from pagedcore import InvalidBlockError, PluginManager, StaleHitAudit
from pagedcore.adapters import transformers as pc

BS = 4


def llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=128,
        vocab_size=128, initializer_range=0.5, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def sgd_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One training step on a fixed batch (the weights move)."""
    ids = torch.arange(3, 19)[None]
    model.train()
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model.eval()


PROMPT = list(range(3, 21))  # 18 tokens


def test_engine_outputs_carry_the_weights_version():
    model = llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    params = pc.SamplingParams(max_new_tokens=3)
    with pc.Engine(model, num_blocks=128, block_size=BS) as engine:
        first = engine.generate([PROMPT], params, use_tqdm=False)[0]
        sgd_step(model, optimizer)  # train() and eval() leave the version as it was: one optimizer step
        second = engine.generate([PROMPT], params, use_tqdm=False)[0]
        sgd_step(model, optimizer)
        sgd_step(model, optimizer)  # two steps between two Engine steps count two
        third = engine.generate([PROMPT], params, use_tqdm=False)[0]
    assert (first.weights_version, second.weights_version, third.weights_version) == (0, 1, 3)


def test_the_version_counts_each_optimizer_step():
    model = llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    pool = pc.PagedKVPool(model, num_blocks=16, block_size=BS)
    pool.check_weights()
    for _ in range(3):  # no train()/eval() here: only the optimizer moves the weights
        model(torch.arange(3, 9)[None], labels=torch.arange(3, 9)[None]).loss.backward()
        optimizer.step()
    pool.check_weights()
    assert pool.weights_version == 3
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)  # not an optimizer step: one more per check that sees it
    pool.check_weights()
    assert pool.weights_version == 4


def test_a_request_running_across_an_update_finishes_on_the_kv_it_holds():
    """The Engine keeps a running request's blocks across a weight update (no recompute): its next tokens are the new
    weights' over the old weights' keys and values, as a DynamicCache kept across the update gives them."""
    model = llama()
    before = 3  # Engine steps before the update: the prompt's step and two decodes
    with pc.Engine(model, num_blocks=128, block_size=BS) as engine:
        engine.add_request(PROMPT, pc.SamplingParams(max_new_tokens=6), request_id="r")
        for _ in range(before):
            engine.step()
        with torch.no_grad():
            model.lm_head.weight.mul_(0.5)  # the update, between two steps
            model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
        outputs = []
        while engine.has_unfinished():
            outputs.extend(engine.step())
        late = engine.generate([PROMPT], pc.SamplingParams(max_new_tokens=6), use_tqdm=False)[0]
    (out,) = outputs
    assert out.metrics.num_preemptions == 0
    assert (out.weights_version, late.weights_version) == (0, 1)  # the request keeps the version it started with

    with torch.no_grad():  # the reference: the same two phases with DynamicCache, then the model as it is now
        model.lm_head.weight.mul_(2)
        model.model.layers[0].mlp.down_proj.weight.mul_(2)
        cache = DynamicCache(config=model.config)
        ids = torch.tensor([PROMPT])
        tokens = []
        for _ in range(before):
            logits = model(ids, cache=cache, use_cache=True).logits[:, -1]
            ids = logits.argmax(-1, keepdim=True)
            tokens.append(int(ids))
        model.lm_head.weight.mul_(0.5)
        model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
        while len(tokens) < 6:
            logits = model(ids, cache=cache, use_cache=True).logits[:, -1]
            ids = logits.argmax(-1, keepdim=True)
            tokens.append(int(ids))
        recomputed = model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False)[0, len(PROMPT) :]
    assert out.token_ids == tokens
    assert late.token_ids == recomputed.tolist()  # a request admitted after the update: the new weights throughout


def test_engine_logprobs_equal_the_training_forward_and_are_batch_invariant_within_float_noise():
    model = llama()
    torch.manual_seed(0)
    prompts = [torch.randint(3, 128, (n,)).tolist() for n in (18, 25, 9, 31)]
    params = pc.SamplingParams(max_new_tokens=8, temperature=1.0, seed=5, logprobs=0)
    with pc.Engine(model, num_blocks=256, block_size=BS) as engine:
        together = engine.generate(prompts, params, use_tqdm=False)
        alone = [engine.generate([p], params, use_tqdm=False)[0] for p in prompts]
    worst = batch = 0.0
    for out, single in zip(together, alone):
        ids = torch.tensor([out.prompt_token_ids + out.token_ids])
        with torch.no_grad():  # the training forward: TRL's selective_log_softmax over the same tokens
            logits = model(ids).logits[:, len(out.prompt_token_ids) - 1 : -1]
        trained = selective_log_softmax(logits, ids[:, len(out.prompt_token_ids) :])[0]
        served = torch.tensor([lp.token.logprob for lp in out.samples[0].logprobs])
        worst = max(worst, float((trained - served).abs().max()))
        assert single.token_ids == out.token_ids  # seeded: the same tokens alone and in a batch
        again = torch.tensor([lp.token.logprob for lp in single.samples[0].logprobs])
        batch = max(batch, float((again - served).abs().max()))
    assert worst < 1e-4  # fp32 (measured: 6.1e-6)
    assert batch < 1e-4  # not bitwise batch-invariant: another batch, another float rounding (measured: 1.6e-5)


def test_the_audit_counts_hits_on_blocks_filled_before_an_update():
    model = llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    pool = pc.PagedKVPool(model, num_blocks=128, block_size=BS, plugins=PluginManager())
    audit = StaleHitAudit(pool.kv)
    pool.plugins.register(audit)
    params = pc.SamplingParams(max_new_tokens=2)
    with pc.Engine(model, pool=pool) as engine:
        engine.generate([PROMPT], params, use_tqdm=False)
        engine.generate([PROMPT], params, use_tqdm=False)  # a fresh hit
        sgd_step(model, optimizer)
        audit.weights_changed()
        engine.generate([PROMPT], params, use_tqdm=False)  # the watch forgot the prefixes: computed anew
        engine.generate([PROMPT], params, use_tqdm=False)  # a fresh hit again
        fresh = audit.summary()
        sgd_step(model, optimizer)
        audit.weights_changed()
        pool.check_weights = lambda **_: 0  # a pool that misses the update serves the old blocks
        engine.generate([PROMPT], params, use_tqdm=False)
    assert fresh == {"updates": 1, "hits": 2, "hit_tokens": 2 * 17, "stale_hits": 0, "stale_hit_tokens": 0}
    assert audit.num_stale_hits == 1 and audit.num_stale_hit_tokens == 17


def test_sleep_gives_the_tensors_back_and_the_next_call_recreates_them(enabled):
    model = llama()
    pool = enabled(model, num_blocks=64, block_size=BS)
    ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False)
    allocated = pool.memory_stats().allocated_bytes
    assert allocated == 2 * 2 * 65 * BS * 2 * 16 * 4  # layers x (k, v) x (blocks + pad) x slots x heads x dim x fp32
    assert pool.sleep() == allocated
    assert pool.is_sleeping and pool.memory_stats().allocated_bytes == 0 and pool.kv.num_cached_blocks == 0
    assert pool.sleep() == 0  # asleep already
    assert torch.equal(model.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False), ref)
    assert not pool.is_sleeping and pool.num_hit_tokens == 0  # computed anew: the prefixes went with the tensors
    assert pool.sleep() == allocated and pool.wake() == allocated and not pool.is_sleeping
    assert pool.wake() == 0


def test_sleep_is_refused_while_blocks_are_held(enabled):
    model = llama()
    pool = enabled(model, num_blocks=64, block_size=BS)
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    with pytest.raises(InvalidBlockError, match="held by caches or requests"):
        pool.sleep()
    assert pool.has_tensors and pool.kv.num_cached_blocks > 0  # nothing changed
    out.cache.release()
    assert pool.sleep() > 0


def test_sleep_when_training_sleeps_at_a_training_forward_only(enabled):
    model = llama()
    pool = enabled(model, num_blocks=64, block_size=BS, sleep_when_training=True)
    ids = torch.tensor([PROMPT])
    model.train()
    model.generate(ids, max_new_tokens=2, do_sample=False)  # generation in training mode (TRL's default path)
    assert pool.has_tensors
    with torch.no_grad():
        model(ids)  # a scoring forward (old / reference log-probabilities): no gradients
    assert pool.has_tensors
    out = model.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    model(ids, labels=ids).loss.backward()  # a training forward while a kept result holds blocks: stays awake
    assert pool.has_tensors
    out.cache.release()
    model(ids, labels=ids).loss.backward()
    assert pool.is_sleeping
    model.generate(ids, max_new_tokens=2, do_sample=False)  # the next rollout wakes it
    assert pool.has_tensors
    pc.disable(model)
    model(ids, labels=ids).loss.backward()  # disable() removes the hook
    assert pool.has_tensors


def test_a_kept_generate_result_carries_the_version_it_was_computed_with(enabled):
    model = llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    pool = enabled(model, num_blocks=64, block_size=BS)
    kept = model.generate(torch.tensor([PROMPT]), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    sgd_step(model, optimizer)
    later = model.generate(torch.tensor([PROMPT]), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert (kept.cache.weights_version, later.cache.weights_version, pool.weights_version) == (0, 1, 1)
    fork = kept.cache.fork()  # a copy of the rows keeps their version
    assert fork.weights_version == 0
    for cache in (kept.cache, later.cache, fork):
        cache.release()
