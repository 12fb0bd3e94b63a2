"""The Engine on every hybrid family (recurrent-state layers beside attention), against stock ``generate`` per request.

Each family is built tiny with its real layer pattern (:mod:`hybrid_models`). The Engine serves it with continuous
batching, chunked prefill (the state carried over chunks in its slot), a snapshot of the state at every block of every
prompt, prefix hits that resume a snapshot (a shared prefix, a repeated prompt, a conversation's next turn at the end
of the reply), preemption, ``n > 1``, log-probabilities, structured outputs and seeded sampling; every answer is stock
``generate``'s on that request alone. Greedy tokens are identical; logits agree within 1e-4 where the Engine computes
as stock does (one request at a time, its prompt in one forward: ``test_one_request_at_a_time_computes_as_stock``) and
within 1e-3 in a mixed batch whose prompts are cut at snapshot points (a chunked linear-attention or SSM kernel rounds
differently over pieces, and a ``(batch, 1)`` decode multiplies other matrix shapes than a ``(1, 1)`` one). Every
case ends with no block and no state slot held and the pool's invariants true.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from hybrid_models import HYBRID_FAMILIES, TOKEN_BY_TOKEN, hybrid_model
from transformers import DynamicCache
from transformers.cache_utils import Cache
from transformers.models.minimax.modeling_minimax import MiniMaxCache

from pagedcore import ConfigError
from pagedcore.adapters.transformers import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL_SAME = 1e-4  # one request at a time, its prompt in one forward: the computation stock generate does
ATOL_MIXED = 1e-3  # chunked prompts cut at snapshot points, batched decodes
NEW = 8


@functools.cache
def model_for(family: str) -> torch.nn.Module:
    return hybrid_model(family)


def stock_cache(family: str, model: torch.nn.Module) -> Cache:
    return MiniMaxCache() if family == "minimax" else DynamicCache(config=model.config)


def stock(family: str, prompt: list[int], new: int = NEW) -> tuple[list[int], list[torch.Tensor]]:
    """Stock greedy ``generate`` on ``prompt`` alone: its new tokens and each step's fp32 logits."""
    model = model_for(family)
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=new,
        do_sample=False,
        cache=stock_cache(family, model),
        return_dict_in_generate=True,
        output_logits=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), [step[0].float() for step in out.logits]


def workload(seed: int) -> list[list[int]]:
    """Prompts sharing a 10-token prefix, and one without it."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(10)]
    prompts = [shared + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
    return [*prompts, [rng.randrange(3, 256) for _ in range(7)]]


def assert_stock(family: str, prompts: list[list[int]], outputs, atol: float, new: int = NEW) -> None:
    for prompt, out in zip(prompts, outputs):
        assert out.error is None, out.error
        tokens, logits = stock(family, prompt, new)
        assert out.token_ids == tokens, (prompt, out.token_ids, tokens)
        got = out.samples[0].logits
        assert got is not None and len(got) == len(logits)
        for step, (g, w) in enumerate(zip(got, logits)):
            torch.testing.assert_close(g, w, atol=atol, rtol=0, msg=lambda m, s=step: f"step {s}: {m}")


def settle(engine: Engine) -> None:
    """Nothing held once every request finished: no block, no state slot; the bookkeeping consistent."""
    kv = engine.pool.kv
    assert kv.num_used_blocks == 0 and kv.states is not None and kv.states.num_used == 0, "blocks or slots leaked"
    engine.scheduler.check_invariants()


def engine_for(family: str, **settings) -> Engine:
    base = {"num_blocks": 96, "block_size": 4, "max_num_batched_tokens": 8, "max_num_seqs": 4, "state_slots": 48}
    return Engine(model_for(family), **{**base, **settings})


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_continuous_batching_equals_stock_generate(family):
    """Chunked prefill (8 tokens a step, block 4), four sequences at once, a snapshot at every block: a mixed batch."""
    prompts = workload(0)
    params = SamplingParams(max_new_tokens=NEW, return_logits=True)
    with engine_for(family) as engine:
        outputs = engine.generate(prompts, params, use_tqdm=False)
        hits = engine.stats().prefix_hit_tokens
        again = engine.generate([prompts[1]], params, use_tqdm=False)  # a repeated prompt
        settle(engine)
    assert_stock(family, [*prompts, prompts[1]], outputs + again, ATOL_MIXED)
    assert hits > 0 or family in TOKEN_BY_TOKEN  # the shared prefix resumed a snapshot (not Jamba's: 10+ tokens on)
    assert again[0].metrics.num_cached_tokens == len(prompts[1]) - 1  # its snapshot at the last-but-one token


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_one_request_at_a_time_computes_as_stock(family):
    """One sequence at a time, its prompt in one forward, no snapshot cut: stock's computation, within 1e-4."""
    prompts = workload(1)[:3]
    with engine_for(family, max_num_seqs=1, max_num_batched_tokens=64, enable_prefix_caching=False) as engine:
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, return_logits=True), use_tqdm=False)
        settle(engine)
    assert_stock(family, prompts, outputs, ATOL_SAME)


@pytest.mark.parametrize("family", ["qwen3_5", "jamba", "mamba2", "falcon_h1", "minimax", "lfm2", "zamba2"])
def test_the_next_chat_turn_resumes_where_the_reply_ended(family):
    rng = random.Random(2)
    first = [rng.randrange(3, 256) for _ in range(13)]
    with engine_for(family) as engine:
        (reply,) = engine.generate([first], SamplingParams(max_new_tokens=6), use_tqdm=False)
        second = first + reply.token_ids + [rng.randrange(3, 256) for _ in range(5)]
        (answer,) = engine.generate([second], SamplingParams(max_new_tokens=NEW, return_logits=True), use_tqdm=False)
        settle(engine)
    # The state after the reply's tokens but its last (which was sampled, never computed) was filed where it stopped.
    assert answer.metrics.num_cached_tokens == len(first) + len(reply.token_ids) - 1
    assert_stock(family, [second], [answer], ATOL_MIXED)


@pytest.mark.parametrize("family", ["qwen3_5", "jamba", "mamba2", "granitemoehybrid"])
def test_preemption_by_recompute_gives_the_same_tokens(family):
    """A pool too small for every sequence at once: sequences are preempted (their slots freed, their state filed
    where they stopped) and resumed; every answer is still stock's."""
    prompts = workload(3)
    with engine_for(family, num_blocks=16, max_num_seqs=6, max_num_batched_tokens=12) as engine:
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=12, return_logits=True), use_tqdm=False)
        stats = engine.stats()
        settle(engine)
    assert stats.num_preemptions > 0
    assert_stock(family, prompts, outputs, ATOL_MIXED, new=12)


def test_too_few_state_slots_preempt_instead_of_failing():
    """Three slots for six sequences: a sequence runs only with a slot for its state, the others wait or are
    preempted; snapshots take only the slots left over."""
    prompts = workload(4)
    with engine_for("qwen3_5", state_slots=3, max_num_seqs=6) as engine:
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, return_logits=True), use_tqdm=False)
        settle(engine)
    assert_stock("qwen3_5", prompts, outputs, ATOL_MIXED)


def test_parallel_samples_and_seeded_sampling_are_reproducible():
    """``n=3`` forks share the prompt's state slot until each writes; a seeded request gives the same tokens alone,
    in a batch, and with its samples' slots copied at different steps."""
    prompts = workload(5)
    params = SamplingParams(max_new_tokens=NEW, n=3, temperature=0.9, top_k=40, seed=11)
    with engine_for("qwen3_5") as engine:
        (alone,) = engine.generate([prompts[0]], params, use_tqdm=False)
        together = engine.generate(prompts, params, use_tqdm=False)
        greedy = engine.generate([prompts[2]], SamplingParams(max_new_tokens=NEW, n=2), use_tqdm=False)
        settle(engine)
    assert [s.token_ids for s in alone.samples] == [s.token_ids for s in together[0].samples]
    assert len({tuple(s.token_ids) for s in alone.samples}) > 1  # the samples differ from each other
    tokens, _ = stock("qwen3_5", prompts[2])
    assert [s.token_ids for s in greedy[0].samples] == [tokens, tokens]


def test_log_probabilities_are_stocks():
    """``logprobs`` of each new token and ``prompt_logprobs`` of every prompt token (over chunks and snapshot
    cuts) equal the log-softmax of stock's logits."""
    (prompt,) = workload(6)[:1]
    params = SamplingParams(max_new_tokens=4, logprobs=2, prompt_logprobs=1)
    with engine_for("qwen3_5") as engine:
        (out,) = engine.generate([prompt], params, use_tqdm=False)
        settle(engine)
    model = model_for("qwen3_5")
    tokens, logits = stock("qwen3_5", prompt, 4)
    for step, entry in enumerate(out.samples[0].logprobs or []):
        want = torch.log_softmax(logits[step], -1)
        assert entry.token.token_id == tokens[step]
        assert entry.token.logprob == pytest.approx(float(want[tokens[step]]), abs=ATOL_MIXED)
        assert [t.token_id for t in entry.top] == want.topk(2).indices.tolist()
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    scored = out.prompt_logprobs
    assert scored is not None and scored[0] is None and len(scored) == len(prompt)
    for position, entry in enumerate(scored[1:]):
        assert entry is not None and entry.token.token_id == prompt[position + 1]
        assert entry.token.logprob == pytest.approx(float(full[position, prompt[position + 1]]), abs=ATOL_MIXED)


def test_a_model_that_resumes_one_token_at_a_time():
    """Jamba continues a cached state only one token per forward: a hit is taken when at most 32 tokens follow it
    (then computed one per step), else the prompt is computed from its start."""
    rng = random.Random(7)
    base = [rng.randrange(3, 256) for _ in range(9)]
    params = SamplingParams(max_new_tokens=2, return_logits=True)
    with engine_for("jamba", max_num_batched_tokens=64) as engine:
        (reply,) = engine.generate([base], params, use_tqdm=False)
        near = base + reply.token_ids + [rng.randrange(3, 256) for _ in range(3)]
        far = base + [rng.randrange(3, 256) for _ in range(40)]
        steps = engine.scheduler.stats.num_steps
        (close,) = engine.generate([near], params, use_tqdm=False)
        close_steps = engine.scheduler.stats.num_steps - steps
        (distant,) = engine.generate([far], params, use_tqdm=False)
        settle(engine)
    hit = len(base) + 1  # the end of the first reply, where its state was filed
    assert close.metrics.num_cached_tokens == hit
    assert close_steps == len(near) - hit + 1  # one prompt token per step, then the second new token
    assert distant.metrics.num_cached_tokens == 0  # 40 tokens after its snapshot (base's last-but-one): from the start
    assert_stock("jamba", [near, far], [close, distant], ATOL_MIXED, new=2)
    assert "jamba" in TOKEN_BY_TOKEN


def test_compile_true_is_refused_naming_it():
    with pytest.raises(ConfigError, match="compile=True") as caught:
        Engine(model_for("qwen3_5"), num_blocks=16, compile=True)
    assert caught.value.param == "compile"


def test_enable_lora_is_refused_naming_it_and_the_model_is_left_as_it_was():
    """The state steps apply no adapter: accepted, ``enable_lora`` would be ignored (every answer the base model's)."""
    model = model_for("qwen3_5")
    before = model.config._attn_implementation
    with pytest.raises(ConfigError, match="enable_lora") as caught:
        Engine(model, num_blocks=16, enable_lora=True)
    assert caught.value.param == "enable_lora"
    assert model.config._attn_implementation == before


def test_structured_outputs_on_a_hybrid_model():
    """Constrained samples (``n=2``, forks of one state) are valid JSON of their schema; the unconstrained requests
    of the same batch are what they are alone."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    import json

    from structured_helpers import bpe_tokenizer

    tok = bpe_tokenizer()
    model = hybrid_model("qwen3_5", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    model.generation_config.eos_token_id = tok.eos_token_id
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5}},
              "required": ["n"], "additionalProperties": False}  # fmt: skip
    prompts = ["Hello there", "The weather today", "Let me check"]
    plain = [SamplingParams(max_new_tokens=12) for _ in prompts]
    shape = [SamplingParams(max_new_tokens=40, n=2, seed=i, structured={"json_schema": schema}) for i in range(3)]
    with Engine(model, tok, num_blocks=128, block_size=4, max_num_batched_tokens=16) as engine:
        alone = engine.generate(prompts, plain, use_tqdm=False)
        mixed = engine.generate(prompts + prompts, shape + plain, use_tqdm=False)
        settle(engine)
    assert [o.token_ids for o in mixed[3:]] == [o.token_ids for o in alone]
    finished = [s for out in mixed[:3] for s in out.samples if s.finish_reason == "stop"]
    assert len(finished) >= 4
    for sample in finished:
        jsonschema.validate(json.loads(sample.text), schema)


def test_a_weight_update_forgets_the_snapshots():
    """Snapshots computed by the old weights are never resumed after an update: the prompt is computed again."""
    model = hybrid_model("qwen3_5", seed=3)
    prompt = workload(8)[0]
    with Engine(model, num_blocks=64, block_size=4, state_slots=16) as engine:
        engine.generate([prompt], SamplingParams(max_new_tokens=2), use_tqdm=False)
        with torch.no_grad():
            model.model.layers[0].linear_attn.out_proj.weight.mul_(1.5)  # an in-place update the watch sees
        (again,) = engine.generate([prompt], SamplingParams(max_new_tokens=NEW, return_logits=True), use_tqdm=False)
        settle(engine)
    assert again.metrics.num_cached_tokens == 0
    want = model.generate(
        torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, cache=DynamicCache(config=model.config)
    )
    assert again.token_ids == want[0, len(prompt) :].tolist()


def test_snapshots_come_back_from_the_disk_store_after_a_restart(tmp_path):
    """An Engine writes its cached blocks and their block-end snapshots to the store when it closes; a new Engine on
    the same model and store resumes the prompt from there."""
    model = model_for("qwen3_5")
    prompt = workload(9)[0]
    store = {"kv_store": str(tmp_path), "kv_store_bytes": "64MiB"}
    params = SamplingParams(max_new_tokens=NEW, return_logits=True)
    with engine_for("qwen3_5", **store) as engine:
        engine.generate([prompt], params, use_tqdm=False)
    with engine_for("qwen3_5", **store) as engine:
        (again,) = engine.generate([prompt], params, use_tqdm=False)
        settle(engine)
    assert again.metrics.num_cached_tokens == (len(prompt) - 1) // 4 * 4  # the last block-end snapshot of the prompt
    assert_stock("qwen3_5", [prompt], [again], ATOL_MIXED)
    assert model is model_for("qwen3_5")


def test_a_shared_prefix_hits_from_its_second_reuse_with_sparse_snapshots():
    """With a snapshot every 100 blocks no block boundary of these prompts keeps one; the second prompt sharing a
    prefix snapshots where it leaves the cached one, and every later prompt resumes there."""
    rng = random.Random(10)
    shared = [rng.randrange(3, 256) for _ in range(12)]
    prompts = [shared + [rng.randrange(3, 256) for _ in range(5)] for _ in range(4)]
    params = SamplingParams(max_new_tokens=4, return_logits=True)
    with engine_for("qwen3_5", snapshot_interval=100, max_num_batched_tokens=64) as engine:
        outputs = [engine.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
        settle(engine)
    assert [out.metrics.num_cached_tokens for out in outputs] == [0, 0, 12, 12]
    assert_stock("qwen3_5", prompts, outputs, ATOL_MIXED, new=4)
