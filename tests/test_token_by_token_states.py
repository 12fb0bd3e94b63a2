"""Families whose forward of several tokens over a cached recurrent state does not continue it (Mamba, Falcon-Mamba,
Jamba, Zamba, RecurrentGemma: ``StateSpec.resumes_chunks`` false), where an outside audit found other tokens than
stock ``generate``'s, each checked against stock (greedy, fp32, a ``DynamicCache``):

- the Engine, with a pool small enough to preempt while the prefix cache is on: a preempted sequence is computed
  again from its start past its prompt, and a snapshot point at its prompt's last-but-one token cut that chunk into
  a piece that continued the state over many tokens;
- ``enable()`` on RecurrentGemma, which was not known to resume one token at a time: a single row was computed in
  pieces at every block;
- ``enable()`` on Mamba and Falcon-Mamba (state layers only) and RecurrentGemma after an earlier call of the same
  prefix: the resumed tokens were fed with the whole attention mask, which Mamba's layers multiply the fed tokens
  by, and RecurrentGemma's one-token forwards over a resumed state differ from its whole prompt's. They take no hit.
"""

from __future__ import annotations

import random

import pytest
import torch
from family_configs import tiny_family
from transformers import DynamicCache, GenerationConfig

import pagedcore.adapters.transformers as pc
from pagedcore.adapters.transformers import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 12


def stock(model: torch.nn.Module, prompt: list[int], new: int = NEW) -> tuple[list[int], list[torch.Tensor]]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=new,
        do_sample=False,
        cache=DynamicCache(config=model.config),
        return_dict_in_generate=True,
        output_logits=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), [step[0].float() for step in out.logits]


def assert_stock(tokens: list[int], logits: list[torch.Tensor], want: tuple[list[int], list[torch.Tensor]]) -> None:
    assert tokens == want[0]
    for got, expected in zip(logits, want[1]):
        torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=0)


@pytest.mark.parametrize("family", ["mamba", "zamba"])
def test_preempted_sequences_with_prefix_caching_on_give_stock_tokens(family):
    model = tiny_family(family)
    rng = random.Random(0)
    prefix = [rng.randrange(3, 256) for _ in range(14)]
    prompts = [prefix + [rng.randrange(3, 256) for _ in range(k)] for k in (0, 1, 3, 10)]
    prompts.append([rng.randrange(3, 256) for _ in range(21)])
    settings = {"num_blocks": 18, "block_size": 4, "max_num_batched_tokens": 64, "max_num_seqs": 5}
    with Engine(model, **settings) as engine:
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=16, return_logits=True), use_tqdm=False)
        assert engine.stats().num_preemptions > 0
        assert engine.pool.kv.num_used_blocks == 0
    for prompt, out in zip(prompts, outputs):
        assert out.error is None, out.error
        assert_stock(out.token_ids, out.samples[0].logits, stock(model, prompt, 16))


def single_row_calls(model: torch.nn.Module, prompts: list[list[int]]) -> int:
    """``enable()``d generate on each prompt in turn, each checked against stock; returns the tokens hit."""
    model.generation_config = GenerationConfig(pad_token_id=0, eos_token_id=None, use_cache=True)
    wants = [stock(model, prompt) for prompt in prompts]
    pool = pc.enable(model, num_blocks=64, block_size=4)
    try:
        for prompt, want in zip(prompts, wants):
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                output_logits=True,
            )  # fmt: skip
            out.cache.release()  # the output keeps its cache (transformers' return_dict_in_generate)
            assert_stock(out.sequences[0, len(prompt) :].tolist(), [step[0] for step in out.logits], want)
        assert pool.kv.num_used_blocks == 0
        return pool.num_hit_tokens
    finally:
        pc.disable(model)


PROMPT = [5, 9, 30, 41, 7, 8, 100, 12, 13, 14, 60, 22]


def test_recurrent_gemma_single_rows_are_computed_as_stock():
    single_row_calls(tiny_family("recurrent_gemma"), [PROMPT, PROMPT[:7], PROMPT[:9]])


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "recurrent_gemma"])
def test_families_that_cannot_resume_a_snapshot_take_no_hit_and_give_stock_tokens(family):
    model = tiny_family(family)
    assert single_row_calls(model, [PROMPT, [*PROMPT, 33, 34, 35, 36, 37]]) == 0
    # Mamba's repeated prompt resumes nothing (its state is kept at its last-but-one token): its hit is taken
    assert single_row_calls(model, [PROMPT, PROMPT]) == (0 if family == "recurrent_gemma" else len(PROMPT) - 1)


def test_a_hybrid_resuming_one_token_at_a_time_still_hits():
    assert single_row_calls(tiny_family("jamba"), [PROMPT, [*PROMPT, 33, 34, 35, 36, 37]]) > 0
