"""A group computed once: rows of one enable()d generate call with the same prompt (GRPO repeats each prompt
num_generations times) compute it once and fork its blocks; a prefix that distinct rows share is computed once and
hit; in the Engine, requests arriving together with the same prompt compute it once.

Counted from the outside: a forward pre-hook records every forward's input shape (what the model computed)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, StoppingCriteria

from pagedcore.adapters import transformers as pc
from pagedcore.adapters.transformers.hook_ids import transparent_hook

BS = 4


def llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=128,
        vocab_size=128, initializer_range=0.5, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def shapes_of(model) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        shapes.append(tuple(ids.shape))

    model.register_forward_pre_hook(transparent_hook(record), with_kwargs=True)  # a counter: not a model change
    return shapes


def group_batch(prompts: list[list[int]], copies: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt ``copies`` times in a row (TRL's RepeatSampler), left-padded to the longest."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts) * copies, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        for k in range(copies):
            ids[i * copies + k, width - len(prompt) :] = torch.tensor(prompt)
            mask[i * copies + k, width - len(prompt) :] = 1
    return ids, mask


PROMPTS = [list(range(3, 25)), list(range(40, 57)), list(range(60, 79))]  # 22, 17 and 19 tokens
GREEDY = {"max_new_tokens": 5, "do_sample": False, "return_dict_in_generate": True, "output_scores": True}


def test_identical_rows_compute_their_prompt_once_and_answer_as_stock_generate(enabled):
    model = llama()
    ids, mask = group_batch(PROMPTS, copies=4)
    ref = model.generate(ids, attention_mask=mask, cache=DynamicCache(config=model.config), **GREEDY)
    pool = enabled(model, num_blocks=256, block_size=BS)
    shapes = shapes_of(model)
    out = model.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref.scores, out.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    # The three prompts once (all but their last token, 21 rectangular positions), then each of the 12 rows its last
    # prompt token and its new tokens: stock generate computes (12, 22) first.
    assert shapes[0] == (3, 21) and shapes[1:] == [(12, 1)] * 5
    out.cache.release()
    assert pool.kv.num_used_blocks == 0


def test_the_group_holds_its_prompt_once(enabled):
    model = llama()
    ids, mask = group_batch([list(range(3, 27))], copies=8)  # 24 tokens: 6 blocks of 4
    pool = enabled(model, num_blocks=256, block_size=BS)
    peak: list[int] = []

    class Watch(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            peak.append(pool.kv.num_used_blocks)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, stopping_criteria=[Watch()])
    # 5 shared blocks of prompt and per row its copy of the 6th (with its last prompt token); then per row a 7th for
    # its new tokens. Without sharing: 8 rows x 6 blocks, then x 7.
    assert peak == [5 + 8, 5 + 8 * 2, 5 + 8 * 2]


def test_sampled_groups_match_stock_generate_with_the_same_seed(enabled):
    model = llama()
    ids, mask = group_batch(PROMPTS[:2], copies=3)
    kwargs = {"max_new_tokens": 6, "do_sample": True, "num_return_sequences": 2}
    torch.manual_seed(7)
    ref = model.generate(ids, attention_mask=mask, **kwargs)
    enabled(model, num_blocks=256, block_size=BS)
    shapes = shapes_of(model)
    torch.manual_seed(7)
    out = model.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(ref, out)
    assert shapes[0] == (2, 21)  # 2 distinct prompts of the 6 rows (12 with num_return_sequences) computed once


def test_a_prefix_distinct_rows_share_is_computed_once_and_hit(enabled):
    model = llama()
    system = list(range(90, 110))  # 20 tokens: 5 blocks
    prompts = [[*system, 5, 6, 7], [*system, 8, 9], [*system, 11, 12, 13, 14]]
    ids, mask = group_batch(prompts, copies=2)
    ref = model.generate(ids, attention_mask=mask, cache=DynamicCache(config=model.config), **GREEDY)
    pool = enabled(model, num_blocks=256, block_size=BS)
    shapes = shapes_of(model)
    out = model.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref.scores, out.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    # The system prompt once (20 positions), then the rows from the longest common rectangular position (20: the
    # longest row's system prompt ends there) to the last but one.
    assert shapes[0] == (1, 20) and shapes[1] == (3, 24 - 1 - 20)
    assert pool.num_hit_tokens == 19 + 18 + 20  # the rows' hits: pads 1, 2 and 0 (rectangular prefix of 20)
    out.cache.release()


def test_a_second_call_hits_the_cache_instead_of_warming(enabled):
    model = llama()
    system = list(range(90, 110))
    prompts = [[*system, 5, 6, 7], [*system, 8, 9, 10]]
    enabled(model, num_blocks=256, block_size=BS)
    model.generate(torch.tensor([[*system, 1]]), max_new_tokens=1)  # caches the system prompt
    shapes = shapes_of(model)
    ids, mask = group_batch(prompts, copies=2)
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert shapes[0] == (2, 2)  # positions 20 and 21 of the two prompts: nothing to warm


def test_rows_with_other_model_inputs_are_not_merged(enabled):
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=64, initializer_range=0.5)
    model = GPT2LMHeadModel(config).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]] * 2)
    types = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0]])  # the same ids, told apart by token types
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "token_type_ids": types}
    ref = model.generate(ids, **kwargs)
    enabled(model, num_blocks=64, block_size=BS)
    shapes = shapes_of(model)
    out = model.generate(ids, **kwargs)
    assert torch.equal(ref, out)
    assert shapes[0][0] == 2  # both rows computed


def test_engine_requests_with_the_same_prompt_compute_it_once():
    model = llama()
    prompts = [list(range(3, 25)), list(range(40, 61))]  # 22 and 21 tokens
    group = [p for p in prompts for _ in range(4)]
    params = pc.SamplingParams(max_new_tokens=4)
    with pc.Engine(model, num_blocks=256, block_size=BS) as alone:
        expected = [alone.generate([p], params, use_tqdm=False)[0].token_ids for p in group]
    with pc.Engine(model, num_blocks=256, block_size=BS) as engine:
        outs = engine.generate(group, params, use_tqdm=False)
        computed = engine.scheduler.stats.num_prompt_tokens_computed
    assert [o.token_ids for o in outs] == expected
    # Each prompt once; each other request of its group only its last token (it waited a step for the first one,
    # which then shared its prompt's partly filled last block too).
    assert computed == 22 + 21 + 2 * 3
    assert sorted(o.metrics.num_cached_tokens for o in outs) == [0, 0] + [20] * 3 + [21] * 3


@pytest.mark.parametrize("n", [1, 4])
def test_engine_parallel_samples_compute_the_prompt_once(n):
    model = llama()
    with pc.Engine(model, num_blocks=256, block_size=BS) as engine:
        engine.generate([list(range(3, 25))] * (4 // n), pc.SamplingParams(max_new_tokens=3, n=n), use_tqdm=False)
        assert engine.scheduler.stats.num_prompt_tokens_computed == 22 + (4 // n - 1)
