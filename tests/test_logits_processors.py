"""Every sampling control vLLM's server takes, in the Engine, against a reference: transformers' own logits
processors where one exists (RepetitionPenaltyLogitsProcessor, MinPLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper, SequenceBiasLogitsProcessor) and ``model.generate`` itself; a hand-computed reference for OpenAI's
presence and frequency penalties and ``logit_bias``. Batched rows equal rows processed alone, and a seeded request
draws the same tokens whatever else is in its batch."""

from __future__ import annotations

import math

import pytest
import torch
from models import EOS, FIRST_TOKEN, VOCAB, tiny_model
from python_lines import lines_run
from test_engine import settle, workload
from transformers import DynamicCache
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pagedcore import InvalidRequestError, SequenceState
from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers.logits_processors import process_rows, warp_rows
from pagedcore.adapters.transformers.sampling import SampleRow, sample_rows, torch_seed


def row(params: SamplingParams, prompt: list[int], output: list[int] = (), suppress=()) -> SampleRow:
    seq = SequenceState("r", prompt, max_new_tokens=len(output) + 1)
    for token in output:
        seq.append_token(token)
    return SampleRow("r", params, [torch.Generator()], tuple(suppress), seq)


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


HISTORIES = [([5, 6, 7, 5], [9, 9, 5]), ([3], [3, 3, 3, 4]), ([100, 101], []), ([8] * 6, [200, 8])]


# --------------------------------------------------------------------------------------------- unit references
def test_repetition_penalty_equals_transformers_processor_over_prompt_and_output():
    logits = random_logits(len(HISTORIES))
    penalties = [1.3, 0.7, 2.0, 1.0]
    rows = [row(SamplingParams(repetition_penalty=p), *h) for p, h in zip(penalties, HISTORIES)]
    got = process_rows(logits.clone(), rows)
    for i, ((prompt, output), penalty) in enumerate(zip(HISTORIES, penalties)):
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits[i : i + 1].clone())
        torch.testing.assert_close(got[i], want[0], atol=1e-6, rtol=0)


def test_presence_and_frequency_penalties_count_the_output_only():
    logits = random_logits(len(HISTORIES), seed=1)
    settings = [(0.5, 0.25), (-1.0, 2.0), (2.0, -2.0), (0.0, 0.7)]
    rows = [row(SamplingParams(presence_penalty=p, frequency_penalty=f), *h) for (p, f), h in zip(settings, HISTORIES)]
    got = process_rows(logits.clone(), rows)
    for i, ((_, output), (presence, frequency)) in enumerate(zip(HISTORIES, settings)):
        want = logits[i].clone()
        for token in set(output):  # OpenAI's formula: mu[j] - c[j] * frequency - (c[j] > 0) * presence
            want[token] -= output.count(token) * frequency + presence
        torch.testing.assert_close(got[i], want, atol=1e-6, rtol=0)


def test_logit_bias_adds_and_matches_transformers_sequence_bias_for_single_tokens():
    logits = random_logits(2, seed=2)
    bias = {5: 3.5, 200: -100.0, 7: 100}
    rows = [row(SamplingParams(logit_bias=bias), [4]), row(SamplingParams(), [4])]
    got = process_rows(logits.clone(), rows)
    want = logits[0].clone()
    for token, amount in bias.items():
        want[token] += amount
    torch.testing.assert_close(got[0], want, atol=1e-6, rtol=0)
    assert torch.equal(got[1], logits[1])  # rows without processors are not touched
    reference = SequenceBiasLogitsProcessor({(t,): float(b) for t, b in bias.items()})
    torch.testing.assert_close(got[0], reference(torch.tensor([[4]]), logits[:1].clone())[0], atol=1e-6, rtol=0)


def test_allowed_tokens_and_min_tokens_mask_then_bias_adds():
    logits = random_logits(2, seed=3)
    params = SamplingParams(allowed_token_ids=[4, 9, 30], logit_bias={9: 1.0, 50: 2.0})
    got = process_rows(logits.clone(), [row(params, [4], suppress=[30]), row(SamplingParams(), [4], suppress=[1])])
    finite = torch.isfinite(got[0]).nonzero()[:, 0].tolist()
    assert finite == [4, 9]
    assert got[0, 9] == logits[0, 9] + 1.0 and got[0, 4] == logits[0, 4]
    assert got[1, 1] == float("-inf") and torch.isfinite(got[1]).sum() == VOCAB - 1


def test_masks_and_bias_cost_the_same_python_for_two_ids_or_the_whole_vocabulary():
    """Regression: every step rebuilt a row's ``logit_bias`` and ``allowed_token_ids`` from Python lists, so one
    request biasing the whole vocabulary (151936 ids) made each of its neighbours' steps 30-40 ms slower. The ids are
    now tensors made once with the parameters. Counted in Python lines run, not timed; the values are the same."""
    vocab = 4096

    def masked(count: int) -> int:
        params = [
            SamplingParams(logit_bias={token: 0.5 + token % 3 for token in range(count)}),
            SamplingParams(allowed_token_ids=list(range(0, 2 * count, 2))),
            SamplingParams(),
        ]
        logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
        rows = [row(p, [4]) for p in params]
        lines, got = lines_run(lambda: process_rows(logits.clone(), rows))
        want = logits.clone()
        want[0, :count] += torch.tensor([0.5 + token % 3 for token in range(count)])
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[: 2 * count : 2] = True
        want[1, ~keep] = float("-inf")
        assert torch.equal(got, want)
        return lines

    few, many = masked(2), masked(vocab // 2)
    assert many <= few + 10, (few, many)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_warpers_equal_transformers_warpers(temperature):
    logits = random_logits(5, seed=4)
    params = [
        SamplingParams(temperature=temperature, min_p=0.05),
        SamplingParams(temperature=temperature, top_k=7),
        SamplingParams(temperature=temperature, top_p=0.8),
        SamplingParams(temperature=temperature, top_k=-1),  # vLLM's "all"
        SamplingParams(temperature=temperature, top_k=20, min_p=0.1),  # top-k and min-p commute
    ]
    warpers = [
        [MinPLogitsWarper(0.05)],
        [TopKLogitsWarper(7)],
        [TopPLogitsWarper(0.8)],
        [],
        [TopKLogitsWarper(20), MinPLogitsWarper(0.1)],  # transformers' order
    ]
    got = warp_rows(logits.clone(), params)
    ids = torch.tensor([[4]])
    for i, chain in enumerate(warpers):
        scores = TemperatureLogitsWarper(temperature)(ids, logits[i : i + 1].clone())
        for warper in chain:
            scores = warper(ids, scores)
        torch.testing.assert_close(got[i], torch.softmax(scores, -1)[0], atol=1e-6, rtol=0)
    assert SamplingParams(top_k=-1).top_k == 0


def test_a_batch_of_mixed_rows_equals_each_row_alone():
    logits = random_logits(6, seed=5)
    params = [
        SamplingParams(repetition_penalty=1.4, temperature=0.9, top_p=0.9),
        SamplingParams(),
        SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, temperature=1.2, min_p=0.02),
        SamplingParams(logit_bias={8: 5.0}, temperature=0.7, top_k=12),
        SamplingParams(allowed_token_ids=[9, 10, 11, 200], temperature=1.0),
        SamplingParams(temperature=1.1, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=0.8),
    ]
    histories = [*HISTORIES, ([9, 10], [11]), ([12], [12, 13])]
    rows = [row(p, *h) for p, h in zip(params, histories)]
    batched = process_rows(logits.clone(), rows)
    drawing = [i for i, p in enumerate(params) if not p.is_greedy]
    probs = warp_rows(batched[drawing].clone(), [params[i] for i in drawing])
    for j, i in enumerate(drawing):
        alone = process_rows(logits[i : i + 1].clone(), [rows[i]])
        assert torch.equal(batched[i], alone[0])
        assert torch.equal(probs[j], warp_rows(alone.clone(), [params[i]])[0])


def test_the_sampler_keeps_raw_logits_for_return_logits_before_processing():
    logits = random_logits(1, seed=6)
    out = sample_rows(logits.clone(), [row(SamplingParams(return_logits=True, logit_bias={3: 50}), [4])])
    assert torch.equal(out.logits["r"], logits[0]) and out.tokens == {"r": [3]}


# ---------------------------------------------------------------------------------- the Engine against generate
@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def hf(model, prompt: list[int], seed: int | None = None, **kwargs) -> list[int]:
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(torch.tensor([prompt]), cache=DynamicCache(config=model.config), **kwargs)
    return out[0, len(prompt) :].tolist()


REPEATING = [7, 8, 7, 8, 7, 8, 7, 8, 7]  # a prompt the tiny model continues with its own tokens


@pytest.mark.parametrize(
    "kwargs",
    [
        {"repetition_penalty": 1.8},
        {"repetition_penalty": 0.6},
        {"sequence_bias": {(9,): 4.0, (160,): -5.0}},
        {"repetition_penalty": 1.3, "sequence_bias": [[[20], 2.0]]},
    ],
)
def test_greedy_processors_equal_model_generate(model, kwargs):
    prompts = [REPEATING, *workload(50, 3)]
    with Engine(model, num_blocks=96, block_size=4) as engine:
        outs = engine.generate(prompts, max_new_tokens=10, use_tqdm=False, **kwargs)
        plain = engine.generate(prompts, max_new_tokens=10, use_tqdm=False)
        settle(engine)
    want = [hf(model, p, max_new_tokens=10, do_sample=False, **kwargs) for p in prompts]
    assert [o.token_ids for o in outs] == want
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain]  # the processor changed something


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.9, "repetition_penalty": 1.5},
        {"temperature": 1.2, "min_p": 0.1},
        {"temperature": 0.8, "min_p": 0.05, "top_k": 30, "repetition_penalty": 1.2},
        {"top_k": 0, "min_p": 0.2},
    ],
)
def test_seeded_sampling_with_processors_equals_model_generate(model, kwargs):
    prompt = workload(51, 1)[0]
    with Engine(model, num_blocks=96, block_size=4) as engine:
        out = engine.generate([prompt], max_new_tokens=10, do_sample=True, seed=21, use_tqdm=False, **kwargs)[0]
    assert out.token_ids == hf(model, prompt, seed=21, max_new_tokens=10, do_sample=True, **kwargs)


def test_the_models_repetition_penalty_applies_as_in_generate(model):
    prompt = REPEATING
    model.generation_config.repetition_penalty = 1.8
    try:
        with Engine(model, num_blocks=64, block_size=4) as engine:
            out = engine.generate([prompt], max_new_tokens=8, use_tqdm=False)[0]
        want = hf(model, prompt, max_new_tokens=8, do_sample=False)
    finally:
        model.generation_config.repetition_penalty = 1.0
    assert out.token_ids == want != hf(model, prompt, max_new_tokens=8, do_sample=False)


@pytest.mark.parametrize("seed", [-5, -(2**63), 2**63 + 7, 2**64 - 1, 12345])
def test_any_seed_torch_takes_draws_what_torch_manual_seed_draws(model, seed):
    prompt = workload(52, 1)[0]
    with Engine(model, num_blocks=64, block_size=4) as engine:
        out = engine.generate([prompt], max_new_tokens=6, do_sample=True, top_k=0, seed=seed, use_tqdm=False)[0]
    assert out.token_ids == hf(model, prompt, seed=seed, max_new_tokens=6, do_sample=True, top_k=0)


def test_seeds_beyond_torchs_range_reduce_mod_2_to_the_64(model):
    prompt = workload(53, 1)[0]
    assert torch_seed(2**70 + 3) == 3 and torch_seed(-(2**63) - 1) == 2**64 - 2**63 - 1
    with Engine(model, num_blocks=64, block_size=4) as engine:
        big, small = engine.generate(
            [prompt, prompt],
            [SamplingParams(max_new_tokens=6, temperature=1.0, seed=s) for s in (2**70 + 3, 3)],
            use_tqdm=False,
        )
    assert big.token_ids == small.token_ids


def test_a_seeded_request_draws_the_same_alone_and_among_processed_rows(model):
    prompts = workload(54, 6)
    seeded = SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.95, seed=99)
    others = [
        SamplingParams(max_new_tokens=12, temperature=1.1, repetition_penalty=1.3, logprobs=3, seed=1),
        SamplingParams(max_new_tokens=9, presence_penalty=1.0, frequency_penalty=0.5, prompt_logprobs=2),
        SamplingParams(max_new_tokens=7, logit_bias={40: 8.0}, min_p=0.1, temperature=0.7),
        SamplingParams(max_new_tokens=8, allowed_token_ids=list(range(FIRST_TOKEN, 60)), n=2, temperature=1.0),
        SamplingParams(max_new_tokens=11, top_k=-1, min_new_tokens=5, stop_token_ids=[EOS], logprobs=0),
    ]
    with Engine(model, num_blocks=160, block_size=4, max_num_seqs=8) as engine:
        alone = engine.generate([prompts[0]], seeded, use_tqdm=False)[0]
        mixed = engine.generate(prompts, [seeded, *others], use_tqdm=False)
        settle(engine)
    assert all(out.error is None for out in mixed)
    assert mixed[0].token_ids == alone.token_ids


def test_openai_penalties_in_the_engine_equal_a_hand_run_greedy_loop(model):
    prompt = [7, 8, 7, 9]
    params = SamplingParams(max_new_tokens=8, presence_penalty=1.5, frequency_penalty=0.8, logit_bias={11: 1.0})
    with Engine(model, num_blocks=64, block_size=4) as engine:
        out = engine.generate([prompt], params, use_tqdm=False)[0]
    tokens: list[int] = []
    for _ in range(8):  # the reference: a full forward per token, then the formula by hand
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float()
        logits[11] += 1.0
        for token in set(tokens):
            logits[token] -= 0.8 * tokens.count(token) + 1.5
        tokens.append(int(logits.argmax()))
    assert out.token_ids == tokens
    assert len(set(tokens)) > 2


def test_logit_bias_and_allowed_tokens_steer_the_engine(model):
    prompt = workload(55, 1)[0]
    allowed = [30, 31, 32]
    with Engine(model, num_blocks=64, block_size=4) as engine:
        forced, within, sampled = engine.generate(
            [prompt] * 3,
            [
                SamplingParams(max_new_tokens=5, logit_bias={77: 100}),
                SamplingParams(max_new_tokens=5, allowed_token_ids=allowed),
                SamplingParams(max_new_tokens=20, allowed_token_ids=allowed, temperature=1.5, seed=4),
            ],
            use_tqdm=False,
        )
    assert forced.token_ids == [77] * 5
    assert set(within.token_ids) <= set(allowed) and set(sampled.token_ids) <= set(allowed)


def test_vllm_names_min_tokens_and_max_tokens_and_ignore_eos(model):
    prompt = workload(56, 1)[0]
    with Engine(model, num_blocks=64, block_size=4) as engine:
        plain = engine.generate([prompt], SamplingParams(max_new_tokens=8), use_tqdm=False)[0]
        stop = plain.token_ids[1]
        stopped = engine.generate([prompt], {"max_tokens": 8, "stop_token_ids": [stop]}, use_tqdm=False)[0]
        held = engine.generate([prompt], {"max_tokens": 8, "stop_token_ids": [stop], "min_tokens": 4}, use_tqdm=False)
        same = engine.generate([prompt], SamplingParams(max_new_tokens=8, stop_token_ids=[stop], min_new_tokens=4))
        ignored = engine.generate([prompt], {"max_tokens": 8, "stop_token_ids": [stop], "ignore_eos": True})[0]
    assert stopped.token_ids == plain.token_ids[:2] and stopped.finish_reason == "stop"
    assert held[0].token_ids == same[0].token_ids and len(held[0].token_ids) >= 4
    assert stop not in held[0].token_ids[:4]  # masked before min_tokens
    assert ignored.token_ids == plain.token_ids and ignored.finish_reason == "length"


def test_top_k_minus_one_is_every_token(model):
    prompt = workload(57, 1)[0]
    with Engine(model, num_blocks=64, block_size=4) as engine:
        a, b = engine.generate(
            [prompt] * 2, [SamplingParams(max_new_tokens=8, temperature=1.0, top_k=k, seed=8) for k in (-1, 0)]
        )
    assert a.token_ids == b.token_ids


# ----------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"logit_bias": {5: 101}}, r"logit_bias\[5\] must be a number in \[-100.0, 100.0\], got 101"),
        ({"logit_bias": {5: -100.5}}, r"logit_bias\[5\]"),
        ({"logit_bias": {5: math.nan}}, "nan"),
        ({"logit_bias": {5: math.inf}}, "inf"),
        ({"logit_bias": {5: "1"}}, "'1'"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token ids"),
        ({"logit_bias": {"5": 1.0}}, "'5'"),
        ({"logit_bias": {5.5: 1.0}}, "5.5"),
        ({"logit_bias": [5, 6]}, "logit_bias must map token ids to biases"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2.0, 2.0\], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": True}, "frequency_penalty"),
        ({"repetition_penalty": 0}, r"repetition_penalty must be a number in \(0.0, inf\), got 0"),
        # Regression: the interval said inf was allowed, and inf was refused
        ({"repetition_penalty": math.inf}, r"repetition_penalty must be a number in \(0.0, inf\), got inf"),
        ({"repetition_penalty": -1.2}, "repetition_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"stop": ["x" * 40_000, "y" * 30_000]}, "stop strings may have 65536 characters in all, got 2 with 70000"),
        ({"allowed_token_ids": [3, "x"]}, "'x'"),
        ({"seed": 2.5}, "seed"),
        ({"min_tokens": 2, "min_new_tokens": 3}, "min_tokens and min_new_tokens are the same field"),
        ({"max_tokens": 2, "max_new_tokens": 3}, "max_tokens and max_new_tokens"),
        ({"best_of": 2}, "best_of"),
    ],
)
def test_bad_sampling_controls_are_refused_by_name(fields, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams.from_fields(fields)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (SamplingParams(logit_bias={VOCAB: 1.0}), f"logit_bias token ids.*{VOCAB}"),
        (SamplingParams(allowed_token_ids=[5, VOCAB + 3]), f"allowed_token_ids.*{VOCAB + 3}"),
    ],
)
def test_token_ids_outside_the_vocabulary_fail_that_request_alone(model, params, match):
    with Engine(model, num_blocks=32, block_size=4) as engine:
        with pytest.raises(InvalidRequestError, match=match):
            engine.add_request([5, 6], params)
        bad, good = engine.generate([[5, 6], [5, 6]], [params, SamplingParams(max_new_tokens=2)], use_tqdm=False)
        settle(engine)
    assert bad.error is not None and good.error is None and len(good.token_ids) == 2


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"params": SamplingParams(logit_bias={VOCAB + 1: 2.0})}, "logit_bias token ids"),
        ({"params": SamplingParams(allowed_token_ids=[VOCAB])}, "allowed_token_ids"),
        ({"params": {"min_tokens": 1, "min_new_tokens": 1}}, "min_tokens and min_new_tokens"),
        ({"params": {"presence_penalty": 9}}, "presence_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"min_p": 2.0, "do_sample": True}, "min_p"),
        ({"sequence_bias": {(3,): 500.0}}, r"logit_bias\[3\]"),
    ],
)
def test_a_refused_control_changes_nothing_in_a_running_engine(model, bad, match):
    """A bad value is refused by name while another request is mid-generation; that request's tokens, the pool's
    blocks and the queue are as if the bad request had never come."""
    prompt = workload(58, 1)[0]
    params = SamplingParams(max_new_tokens=6, repetition_penalty=1.3)
    with Engine(model, num_blocks=64, block_size=4) as engine:
        alone = engine.generate([prompt], params, use_tqdm=False)[0]
        engine.add_request(prompt, params, request_id="running")
        engine.step()
        used = engine.pool.kv.num_used_blocks
        with pytest.raises(InvalidRequestError, match=match):
            engine.add_request([5, 6, 7], **bad)
        assert engine.pool.kv.num_used_blocks == used
        assert engine.scheduler.num_waiting + engine.scheduler.num_running == 1
        outs = []
        while engine.has_unfinished():
            outs.extend(engine.step())
        settle(engine)
    assert [out.request_id for out in outs] == ["running"] and outs[0].token_ids == alone.token_ids


def test_allowed_token_ids_are_kept_once_each():
    """Regression: the list was stored as given, and every step builds the request's mask from it, so one request's
    ``[5] * 10**7`` made every step of the loop it shares 400x slower. Kept sorted, each id once (at most the
    vocabulary)."""
    params = SamplingParams(allowed_token_ids=[9, 5] * 50_000 + [3])
    assert params.allowed_token_ids == (3, 5, 9)
