"""TRL's GRPOTrainer, unmodified, generating through pagedcore (``examples/grpo_trl.py``): two steps of a tiny Llama on
a local dataset whose prompts share a system prompt and come back every step.

Against the same run with TRL's own ``generate``: the same completions (sampled with the same seed, and greedy), the
same training results (loss, gradient norm, weights after step 2), a fraction of the prompt positions computed (each
prompt once per group, the shared system prompt once per call), no stale prefix hit after either optimizer step
(counted by an audit the trainer tells of each step, which does count them when the pool's weights watch is off).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")  # the rl extra (TRL, datasets): the GPU image has neither
pytest.importorskip("datasets")

import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "grpo_trl.py"
VOCAB, G, PROMPTS, PROMPT_TOKENS, SYSTEM_TOKENS, COMPLETION = 256, 4, 2, 48, 32, 8


def _load():
    spec = importlib.util.spec_from_file_location("example_grpo_trl", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


grpo = _load()


def run(mode: str, **options):
    torch.set_num_threads(1)
    dataset = grpo.prompt_dataset(PROMPTS, PROMPT_TOKENS, VOCAB, system_tokens=SYSTEM_TOKENS)
    model = grpo.tiny_model(VOCAB, seed=0)
    settings = {"steps": 2, "num_generations": G, "prompts_per_step": PROMPTS, "completion_tokens": COMPLETION}
    result = grpo.train(mode, model, grpo.word_tokenizer(VOCAB), dataset, **{**settings, **options})
    return result, model


@pytest.fixture(scope="module")
def sampled():
    return run("trl"), run("pagedcore")


def test_completions_and_training_results_equal_trls_own_generate(sampled):
    (reference, ref_model), (paged, model) = sampled
    assert len(paged.rollouts) == len(reference.rollouts) == 2
    for ours, theirs in zip(paged.rollouts, reference.rollouts):
        assert ours.completions == theirs.completions
        assert len(ours.completions) == G * PROMPTS
    assert paged.losses == pytest.approx(reference.losses, abs=1e-6)
    norms = [[h["grad_norm"] for h in r.trainer.state.log_history if "grad_norm" in h] for r in (paged, reference)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-4) and len(norms[0]) == 2
    for (name, ours), theirs in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0, msg=name)


def test_each_prompt_is_computed_once_per_group(sampled):
    (reference, _), (paged, _) = sampled
    rows = G * PROMPTS
    # TRL's generate: every row computes its whole prompt. pagedcore: the system prompt's 32 tokens once (two blocks
    # of 16, shared by both prompts), each prompt's next 15 once for its group, each row its last prompt token.
    assert [r.prompt_positions for r in reference.rollouts] == [rows * PROMPT_TOKENS] * 2
    once = SYSTEM_TOKENS + PROMPTS * (PROMPT_TOKENS - 1 - SYSTEM_TOKENS) + rows
    assert [r.prompt_positions for r in paged.rollouts] == [once] * 2


def test_no_stale_prefix_hit_after_either_optimizer_step(sampled):
    _, (paged, _) = sampled
    assert paged.stale_after_step == [0, 0]
    # The prompts hit the system prompt computed in their own call (fresh), every step; never the previous step's.
    assert paged.hits_after_step == [PROMPTS, 2 * PROMPTS]
    assert paged.audit["updates"] == 2 and paged.audit["stale_hits"] == 0
    assert [r.weights_version for r in paged.rollouts] == [0, 1]  # one optimizer step between the rollouts


def test_the_audit_counts_stale_hits_when_the_weights_watch_is_off():
    def watch_off(trainer, pool):
        pool.check_weights = lambda **_: 0  # a pool that never notices the optimizer steps

    paged, _ = run("pagedcore", before_train=watch_off)
    assert paged.stale_after_step[0] == 0
    assert paged.stale_after_step[1] == PROMPTS  # step 2's prompts were served step 1's system prompt


def test_greedy_completions_equal_trls_own_generate():
    reference, _ = run("trl", greedy=True)
    paged, _ = run("pagedcore", greedy=True)
    assert [r.completions for r in paged.rollouts] == [r.completions for r in reference.rollouts]
    assert paged.stale_after_step == [0, 0]


def test_the_pool_sleeps_through_each_training_step(sampled):
    (reference, _), _ = sampled
    seen = []

    def watch_sleep(trainer, pool):
        model = trainer.model
        model.register_forward_hook(lambda *a: seen.append(pool.is_sleeping) if model.training else None)

    paged, _ = run("pagedcore", sleep=True, before_train=watch_sleep)
    assert [r.completions for r in paged.rollouts] == [r.completions for r in reference.rollouts]
    assert paged.losses == pytest.approx(reference.losses, abs=1e-6)
    assert paged.pool is not None and paged.pool.is_sleeping  # after the last training step
    assert True in seen  # a training forward ran with the pool asleep
    assert paged.stale_after_step == [0, 0]
