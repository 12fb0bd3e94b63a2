"""The Engine's log-probabilities against transformers' own logits: ``logprobs=k`` equals ``log_softmax`` of the
logits ``model.generate`` gives at the same positions (fp32, 1e-4), across prefix hits and preemptions, and
``prompt_logprobs=k`` equals ``log_softmax`` of one full forward of the prompt, however the prompt was chunked."""

from __future__ import annotations

import pytest
import torch
from models import FIRST_TOKEN, VOCAB, tiny_model
from test_engine import reference, settle, workload

from pagedcore import ConfigError, InvalidRequestError
from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers.outputs import TokenLogprobs

ATOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def check_entry(entry: TokenLogprobs, logprobs: torch.Tensor, token: int, k: int) -> None:
    """One position's entry against the reference ``logprobs (vocab,)``: the token's value and rank, the top k."""
    assert entry.token.token_id == token
    assert abs(entry.token.logprob - float(logprobs[token])) < ATOL
    assert entry.token.rank == int((logprobs >= logprobs[token]).sum())
    values, ids = torch.topk(logprobs, k)
    assert [t.token_id for t in entry.top] == ids.tolist()
    assert [t.rank for t in entry.top] == list(range(1, k + 1))
    torch.testing.assert_close(torch.tensor([t.logprob for t in entry.top]), values, atol=ATOL, rtol=0)


def check_generated(model, prompt: list[int], out, k: int) -> None:
    """Greedy tokens and their log-probabilities equal those of ``model.generate`` on the prompt alone."""
    tokens, logits = reference(model, prompt, len(out.token_ids))
    assert out.token_ids == tokens
    entries = out.samples[0].logprobs
    assert entries is not None and len(entries) == len(tokens)
    for entry, token, row in zip(entries, tokens, logits):
        check_entry(entry, torch.log_softmax(row, -1), token, k)
        assert entry.token.rank == 1  # greedy, nothing processed: the argmax


def full_forward_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)  # (len(prompt), vocab): row p predicts token p + 1


def check_prompt(model, prompt: list[int], scored, k: int) -> None:
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None
    reference_rows = full_forward_logprobs(model, prompt)
    for p in range(1, len(prompt)):
        check_entry(scored[p], reference_rows[p - 1], prompt[p], k)


def test_greedy_logprobs_equal_transformers_logits_with_prefix_hits(model):
    prompts = workload(40, 6)
    with Engine(model, num_blocks=96, block_size=4, max_num_batched_tokens=24, max_num_seqs=4) as engine:
        first = engine.generate(prompts, SamplingParams(max_new_tokens=8, logprobs=5), use_tqdm=False)
        again = engine.generate(prompts, SamplingParams(max_new_tokens=8, logprobs=5), use_tqdm=False)
        settle(engine)
    assert any(out.metrics.num_cached_tokens > 0 for out in again)  # the second round hit the cache
    for prompt, out in zip(prompts + prompts, first + again):
        check_generated(model, prompt, out, 5)


def test_logprobs_across_a_preemption(model):
    prompts = workload(41, 8)
    params = SamplingParams(max_new_tokens=12, logprobs=3)
    with Engine(model, num_blocks=24, block_size=4, max_num_batched_tokens=64, max_num_seqs=8) as engine:
        outs = engine.generate(prompts, params, use_tqdm=False)
        stats = engine.stats()
        settle(engine)
    assert stats.num_preemptions > 0
    assert any(out.metrics.num_preemptions for out in outs)
    for prompt, out in zip(prompts, outs):
        check_generated(model, prompt, out, 3)


def test_sampled_tokens_carry_the_models_log_probabilities(model):
    """A sampled token's log-probability is the model's own (raw: before temperature and top-k), as vLLM's
    default; checked by a full forward over prompt + the sampled tokens."""
    prompt = workload(42, 1)[0]
    params = SamplingParams(max_new_tokens=6, temperature=1.7, top_k=20, seed=3, logprobs=2, n=2)
    with Engine(model, num_blocks=64, block_size=4, max_num_seqs=4) as engine:
        (out,) = engine.generate([prompt], params, use_tqdm=False)
    for sample in out.samples:
        rows = full_forward_logprobs(model, prompt + sample.token_ids)
        assert sample.logprobs is not None and len(sample.logprobs) == len(sample.token_ids)
        for i, (entry, token) in enumerate(zip(sample.logprobs, sample.token_ids)):
            check_entry(entry, rows[len(prompt) - 1 + i], token, 2)
        assert sample.cumulative_logprob == pytest.approx(sum(e.token.logprob for e in sample.logprobs))


@pytest.mark.parametrize("budget", [5, 512])
def test_prompt_logprobs_equal_a_full_forward_however_chunked(model, budget):
    prompts = [list(range(FIRST_TOKEN, FIRST_TOKEN + 23)), [7, 9], [11]]
    params = SamplingParams(max_new_tokens=3, prompt_logprobs=4, logprobs=1)
    with Engine(model, num_blocks=64, block_size=4, max_num_batched_tokens=budget) as engine:
        outs = engine.generate(prompts, params, use_tqdm=False)
        settle(engine)
    for prompt, out in zip(prompts, outs):
        check_prompt(model, prompt, out.prompt_logprobs, 4)
        check_generated(model, prompt, out, 1)


def test_prompt_logprobs_skip_the_prefix_cache_and_others_still_hit(model):
    prompt = list(range(FIRST_TOKEN, FIRST_TOKEN + 20))
    with Engine(model, num_blocks=64, block_size=4) as engine:
        warm = engine.generate([prompt], SamplingParams(max_new_tokens=2), use_tqdm=False)[0]
        scored = engine.generate([prompt], SamplingParams(max_new_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
        hit = engine.generate([prompt], SamplingParams(max_new_tokens=2), use_tqdm=False)[0]
        settle(engine)
    assert warm.metrics.num_cached_tokens == 0 and hit.metrics.num_cached_tokens > 0
    assert scored.metrics.num_cached_tokens == 0  # its cached prefix was there, and recomputed for its logits
    check_prompt(model, prompt, scored.prompt_logprobs, 0)
    assert scored.token_ids == warm.token_ids == hit.token_ids


def test_prompt_logprobs_across_a_preemption(model):
    prompts = [list(range(FIRST_TOKEN + i, FIRST_TOKEN + i + 14)) for i in range(6)]
    params = SamplingParams(max_new_tokens=10, prompt_logprobs=2, logprobs=2)
    with Engine(model, num_blocks=20, block_size=4, max_num_batched_tokens=64, max_num_seqs=6) as engine:
        outs = engine.generate(prompts, params, use_tqdm=False)
        stats = engine.stats()
        settle(engine)
    assert stats.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        check_prompt(model, prompt, out.prompt_logprobs, 2)
        check_generated(model, prompt, out, 2)


def test_max_new_tokens_zero_scores_the_prompt_only(model):
    prompt = list(range(FIRST_TOKEN, FIRST_TOKEN + 9))
    with Engine(model, num_blocks=32, block_size=4, max_num_seqs=4) as engine:
        (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=0, prompt_logprobs=1), use_tqdm=False)
        events = list(engine.stream([prompt], SamplingParams(max_new_tokens=0, prompt_logprobs=1, n=2)))
        plain = engine.generate([prompt], SamplingParams(max_new_tokens=0), use_tqdm=False)[0]
        generated = engine.stats().generated_tokens
        settle(engine)
    assert out.token_ids == [] and out.finish_reason == "length" and out.error is None
    check_prompt(model, prompt, out.prompt_logprobs, 1)
    assert [(e.sample, e.token_id, e.finish_reason) for e in events] == [(0, None, "length"), (1, None, "length")]
    assert all(e.prompt_logprobs == out.prompt_logprobs for e in events)
    assert plain.prompt_logprobs is None and plain.token_ids == []
    assert generated == 0


def test_events_carry_the_tokens_logprobs_and_the_first_the_prompts(model):
    prompt = workload(43, 1)[0]
    params = SamplingParams(max_new_tokens=5, logprobs=2, prompt_logprobs=1)
    with Engine(model, num_blocks=64, block_size=4) as engine:
        events = [e for e in engine.stream([prompt], params) if e.token_id is not None]
        (out,) = engine.generate([prompt], params, use_tqdm=False)
    streamed = [(e.token_id, e.logprobs.token.logprob, [t.token_id for t in e.logprobs.top]) for e in events]
    returned = [(lp.token.token_id, lp.token.logprob, [t.token_id for t in lp.top]) for lp in out.samples[0].logprobs]
    assert [(t, pytest.approx(v, abs=ATOL), top) for t, v, top in streamed] == returned
    assert events[0].prompt_logprobs is not None and len(events[0].prompt_logprobs) == len(prompt)
    assert all(e.prompt_logprobs is None for e in events[1:])


def test_nobody_asking_gets_no_logprobs(model):
    with Engine(model, num_blocks=32, block_size=4) as engine:
        (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3), use_tqdm=False)
        events = list(engine.stream([[5, 6, 7]], SamplingParams(max_new_tokens=3)))
    assert out.samples[0].logprobs is None and out.prompt_logprobs is None and out.samples[0].cumulative_logprob is None
    assert all(e.logprobs is None and e.prompt_logprobs is None for e in events)


def test_logprobs_zero_is_the_token_alone_and_minus_one_the_whole_vocabulary(model):
    with Engine(model, num_blocks=32, block_size=4, max_logprobs=-1) as engine:
        zero, everything = engine.generate(
            [[5, 6, 7], [5, 6, 7]],
            [SamplingParams(max_new_tokens=2, logprobs=0), SamplingParams(max_new_tokens=2, logprobs=-1)],
            use_tqdm=False,
        )
    assert all(entry.top == () for entry in zero.samples[0].logprobs)
    for entry in everything.samples[0].logprobs:
        assert len(entry.top) == VOCAB and len(entry.as_dict()) == VOCAB
        assert sum(torch.tensor([t.logprob for t in entry.top]).exp().tolist()) == pytest.approx(1.0, abs=1e-4)


def test_logprobs_are_raw_even_when_processors_change_the_choice(model):
    """A bias that makes the greedy choice a token the model finds unlikely: its log-probability and rank are the
    model's (vLLM's raw_logprobs), not the biased distribution's."""
    prompt = workload(44, 1)[0]
    plain, _ = reference(model, prompt, 1)
    forced = (plain[0] + 1) % VOCAB
    params = SamplingParams(max_new_tokens=1, logprobs=1, logit_bias={forced: 100})
    with Engine(model, num_blocks=32, block_size=4) as engine:
        (out,) = engine.generate([prompt], params, use_tqdm=False)
    (entry,) = out.samples[0].logprobs
    assert out.token_ids == [forced] and entry.token.rank > 1
    check_entry(entry, full_forward_logprobs(model, prompt)[-1], forced, 1)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (SamplingParams(logprobs=21), "logprobs=21 is more than"),
        (SamplingParams(prompt_logprobs=40), "prompt_logprobs=40 is more than"),
        (SamplingParams(logprobs=-1), "logprobs=-1 is more than"),
    ],
)
def test_logprobs_over_the_engines_cap_are_refused(model, params, match):
    with Engine(model, num_blocks=32, block_size=4) as engine:
        with pytest.raises(InvalidRequestError, match=match):
            engine.add_request([5, 6], params)
        (out,) = engine.generate([[5, 6]], params, use_tqdm=False)
        assert "max_logprobs=20" in out.error
        assert not engine.has_unfinished()


@pytest.mark.parametrize(("value", "match"), [(-2, "logprobs"), (1.5, "logprobs"), (True, "logprobs")])
def test_bad_logprobs_values_are_refused(value, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(logprobs=value)
    with pytest.raises(InvalidRequestError, match="prompt_" + match):
        SamplingParams(prompt_logprobs=value)


def test_max_logprobs_is_checked_when_the_engine_is_built(model):
    with pytest.raises(ConfigError, match="max_logprobs"):
        Engine(model, num_blocks=8, block_size=4, max_logprobs=-2)


def test_generate_kwargs_ask_for_logprobs_too(model):
    prompt = workload(45, 1)[0]
    with Engine(model, num_blocks=64, block_size=4) as engine:
        (out,) = engine.generate([prompt], max_new_tokens=4, logprobs=2, prompt_logprobs=1, use_tqdm=False)
        (logits,) = engine.generate([prompt], max_new_tokens=4, output_logits=True, return_dict_in_generate=True)
    check_generated(model, prompt, out, 2)
    check_prompt(model, prompt, out.prompt_logprobs, 1)
    _, want = reference(model, prompt, 4)
    for got, row in zip(logits.samples[0].logits, want):  # output_logits: transformers' raw logits
        torch.testing.assert_close(got, row, atol=ATOL, rtol=0)
