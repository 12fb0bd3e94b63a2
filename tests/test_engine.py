"""Engine: continuous batching over HF models equals model.generate on each prompt alone."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from models import FIRST_TOKEN, VOCAB, tiny_model
from transformers import DynamicCache

from pagedcore import ConcurrentUseError, ConfigError, InvalidRequestError
from pagedcore.adapters.transformers import Engine, SamplingParams

ENGINE_FAMILIES = ["llama", "qwen3", "gemma3", "mixtral", "qwen3_moe", "gpt_neox", "gemma2", "mistral", "gpt2", "opt"]


def reference(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        cache=DynamicCache(config=model.config),
        return_dict_in_generate=True,
        output_logits=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), [x[0].float() for x in out.logits]


def workload(seed: int, count: int, shared: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(shared)]
    return [
        (prefix if rng.random() < 0.6 else [])
        + [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(rng.randrange(1, 20))]
        for _ in range(count)
    ]


def assert_matches(model, prompts, outputs, max_new_tokens) -> None:
    for prompt, out in zip(prompts, outputs):
        assert out.error is None, out.error
        tokens, logits = reference(model, prompt, max_new_tokens)
        assert out.token_ids == tokens
        assert out.samples[0].logits is not None
        for got, want in zip(out.samples[0].logits, logits):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def settle(engine: Engine) -> None:
    assert engine.pool.kv.num_used_blocks == 0, "blocks leaked"
    engine.pool.check_invariants()


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_greedy_equals_generate_alone(family):
    model = tiny_model(family)
    prompts = workload(0, 6)
    params = SamplingParams(max_new_tokens=10, return_logits=True)
    with Engine(model, num_blocks=96, block_size=4, max_num_batched_tokens=24, max_num_seqs=4) as engine:
        outputs = engine.generate(prompts, params, use_tqdm=False)
        stats = engine.stats()
        settle(engine)
    assert stats.prefix_hit_tokens > 0  # the shared prefix was reused
    assert_matches(model, prompts, outputs, 10)


@pytest.mark.parametrize(
    ("block_size", "budget", "num_blocks", "max_seqs", "preempts"),
    [(1, 7, 200, 3, False), (4, 64, 24, 8, True), (16, 5, 12, 2, False), (8, 512, 14, 16, True)],
)
def test_any_chunking_preemption_and_prefix_hits_give_the_same_output(
    block_size, budget, num_blocks, max_seqs, preempts
):
    model = tiny_model("llama")
    prompts = workload(1, 8)
    params = SamplingParams(max_new_tokens=12, return_logits=True)
    with Engine(
        model, num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs
    ) as engine:
        outputs = engine.generate(prompts, params, use_tqdm=False)
        stats = engine.stats()
        settle(engine)
    assert_matches(model, prompts, outputs, 12)
    assert (stats.num_preemptions > 0) == preempts


def test_arrivals_between_steps():
    model = tiny_model("gemma3")
    prompts = workload(2, 7)
    params = SamplingParams(max_new_tokens=9, return_logits=True)
    outputs = {}
    with Engine(model, num_blocks=40, block_size=4, max_num_batched_tokens=16, max_num_seqs=3) as engine:
        queue = list(enumerate(prompts))
        ids: dict[str, int] = {}
        rng = random.Random(0)
        while queue or engine.has_unfinished():
            if queue and (rng.random() < 0.7 or not engine.has_unfinished()):
                i, prompt = queue.pop(0)
                ids[engine.add_request(prompt, params)] = i
            for out in engine.step():
                outputs[ids[out.request_id]] = out
        settle(engine)
    assert_matches(model, prompts, [outputs[i] for i in range(len(prompts))], 9)


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    model = tiny_model("llama")
    prompts = workload(3, 5)
    params = SamplingParams(max_new_tokens=8, temperature=0.8, top_k=50, top_p=0.9, seed=1234)
    with Engine(model, num_blocks=128, block_size=4) as engine:
        alone = engine.generate([prompts[0]], params, use_tqdm=False)[0].token_ids
        together = engine.generate(prompts, params, use_tqdm=False)[0].token_ids
        other_seed = engine.generate(
            [prompts[0]], SamplingParams(max_new_tokens=8, temperature=0.8, seed=1), use_tqdm=False
        )[0].token_ids
    assert alone == together
    assert alone != other_seed


def test_parallel_samples_fork_and_share_the_prompt():
    model = tiny_model("llama")
    prompt = list(range(FIRST_TOKEN, FIRST_TOKEN + 30))
    with Engine(model, num_blocks=64, block_size=4, max_num_seqs=8) as engine:
        greedy = engine.generate([prompt], SamplingParams(max_new_tokens=6, n=3), use_tqdm=False)[0]
        sampled = engine.generate(
            [prompt], SamplingParams(max_new_tokens=6, n=4, temperature=1.0, seed=7), use_tqdm=False
        )[0]
        settle(engine)
    assert [s.token_ids for s in greedy.samples] == [greedy.token_ids] * 3
    assert greedy.token_ids == reference(model, prompt, 6)[0]
    assert len({tuple(s.token_ids) for s in sampled.samples}) > 1
    assert all(s.finish_reason == "length" for s in sampled.samples)


def test_stream_yields_every_token():
    model = tiny_model("qwen3")
    prompts = workload(4, 3)
    with Engine(model, num_blocks=64, block_size=4) as engine:
        expected = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=5), use_tqdm=False)]
        events = list(engine.stream(prompts, SamplingParams(max_new_tokens=5)))
    by_request: dict[str, list[int]] = {}
    order = []
    for event in events:
        if event.request_id not in by_request:
            order.append(event.request_id)
        by_request.setdefault(event.request_id, [])
        if event.token_id is not None:
            by_request[event.request_id].append(event.token_id)
    assert [by_request[r] for r in order] == expected
    assert sum(e.finish_reason is not None for e in events) == len(prompts)


def test_step_events_reports_every_token_and_the_finished_outputs():
    model = tiny_model("llama")
    prompts = workload(5, 3)
    with Engine(model, num_blocks=64, block_size=4) as engine:
        expected = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=4), use_tqdm=False)]
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=4)) for p in prompts]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        finished = {}
        while engine.has_unfinished():
            step = engine.step_events()
            for event in step.events:
                if event.token_id is not None:
                    tokens[event.request_id].append(event.token_id)
            finished.update({out.request_id: out for out in step.finished})
        settle(engine)
    assert [tokens[rid] for rid in ids] == expected
    assert [finished[rid].token_ids for rid in ids] == expected


def test_events_are_made_for_whoever_reads_them(monkeypatch):
    """``step()`` and ``generate()`` drop the token events of their own requests, so those are not made (host time
    per row); the events of requests someone else reads still are: a ``generate()`` call stepping beside requests
    added with ``add_request`` leaves their events for ``step_events()``, every token once."""
    from pagedcore.engine import engine as engine_module

    made: list[str] = []
    real = engine_module.token_event
    monkeypatch.setattr(engine_module, "token_event", lambda rid, *rest: made.append(rid) or real(rid, *rest))
    model = tiny_model("llama")
    prompts = workload(9, 3)
    params = SamplingParams(max_new_tokens=4)
    with Engine(model, num_blocks=64, block_size=4) as engine:
        expected = [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        assert made == []
        ids = [engine.add_request(p, params) for p in prompts[:2]]
        engine.step()
        assert made == []  # step() drops its requests' events
        engine.step_events()  # one token each
        assert sorted(made) == sorted(ids)
        assert [o.token_ids for o in engine.generate(prompts[2:], params, use_tqdm=False)] == expected[2:]
        assert made.count(ids[0]) >= 2 and not [rid for rid in made if rid not in ids]  # theirs, made beside
        left = engine.step_events().events
        while engine.has_unfinished():
            left += engine.step_events().events
        seen = {rid: [e.token_id for e in left if e.request_id == rid and e.token_id is not None] for rid in ids}
        assert [len(seen[rid]) for rid in ids] == [2, 2]  # the tokens after step() and the first step_events()
        assert [seen[rid] for rid in ids] == [expected[0][2:], expected[1][2:]]
        settle(engine)


def test_stop_tokens_and_eos_default():
    model = tiny_model("llama")
    prompt = workload(5, 1)[0]
    tokens, _ = reference(model, prompt, 8)
    stop = tokens[3]
    with Engine(model, num_blocks=64, block_size=4) as engine:
        out = engine.generate([prompt], SamplingParams(max_new_tokens=8, stop_token_ids=[stop]), use_tqdm=False)[0]
        model.generation_config.eos_token_id = stop
        engine_eos = Engine(model, pool=engine.pool)
        out_eos = engine_eos.generate([prompt], SamplingParams(max_new_tokens=8), use_tqdm=False)[0]
        out_ignore = engine_eos.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    first = tokens.index(stop)
    assert out.token_ids == tokens[: first + 1] and out.finish_reason == "stop"
    assert out_eos.token_ids == out.token_ids
    assert out_ignore.token_ids == tokens and out_ignore.finish_reason == "length"


def test_bad_requests_fail_alone_and_the_others_finish():
    model = tiny_model("llama")
    good = workload(6, 2)
    with Engine(model, num_blocks=16, block_size=4, max_num_seqs=4) as engine:
        prompts = [good[0], [], [3] * 600, [3] * 70, [VOCAB + 5], good[1], good[1], good[1]]
        params = [SamplingParams(max_new_tokens=4)] * 6 + [
            {"max_new_tokens": 4, "top_p": 1.5},
            {"max_new_tokens": 4, "n": 9},
            {"temperature": -1},
            {"n": 0},
            {"no_such_field": 1},
        ]
        prompts += [good[1]] * 3
        outputs = engine.generate(prompts, params, use_tqdm=False)
        settle(engine)
    errors = [o.error for o in outputs]
    assert errors[0] is None and errors[5] is None
    assert "empty" in errors[1]
    assert "context" in errors[2]  # 597 + 4 > 512 positions
    assert "never fit" in errors[3]  # 74 tokens > 16 blocks of 4
    assert "vocabulary" in errors[4]
    assert "top_p" in errors[6] and outputs[6].finish_reason == "error"
    assert "parallel samples" in errors[7]
    assert "temperature" in errors[8] and "n must be" in errors[9] and "no_such_field" in errors[10]
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-0.1)
    with pytest.raises(InvalidRequestError, match="n must be"):
        SamplingParams(n=0)


def test_a_request_refused_for_its_n_answers_with_one_sample():
    """Regression: ``generate`` built the refused output with n samples, so n=10**7 took 20 s and 2.5 GB to say
    that n is too large (``add_request`` refuses it at once)."""
    model = tiny_model("llama")
    with Engine(model, num_blocks=16, block_size=4, max_num_seqs=8) as engine:
        huge, fine = engine.generate([[5, 6, 7]] * 2, [{"n": 10**5}, {"n": 2, "top_p": 1.5}], use_tqdm=False)
    assert "parallel samples" in (huge.error or "") and len(huge.outputs) == 1
    assert "top_p" in (fine.error or "") and len(fine.outputs) == 2  # an n the engine could run keeps its shape


def test_max_new_tokens_zero_returns_empty_output():
    model = tiny_model("llama")
    with Engine(model, num_blocks=16, block_size=4) as engine:
        (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=0), use_tqdm=False)
    assert out.token_ids == [] and out.finish_reason == "length" and out.error is None


def test_abort_mid_flight_releases_everything():
    model = tiny_model("llama")
    with Engine(model, num_blocks=64, block_size=4) as engine:
        a = engine.add_request(workload(7, 1)[0], SamplingParams(max_new_tokens=30, n=2))
        b = engine.add_request(workload(8, 1)[0], SamplingParams(max_new_tokens=5))
        engine.step()
        engine.step()
        aborted = engine.abort(a)
        assert aborted.finish_reason == "abort"
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                done[out.request_id] = out
        assert done[b].finish_reason == "length" and done[a].finish_reason == "abort"
        settle(engine)
        with pytest.raises(InvalidRequestError, match="no running request"):
            engine.abort(a)


def test_forward_failure_fails_only_that_step():
    model = tiny_model("llama")
    calls = {"n": 0}

    def flaky(module, args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated out of memory")

    handle = None
    try:
        with Engine(model, num_blocks=64, block_size=4, max_num_batched_tokens=8) as engine:
            # after the Engine's construction-time probe (probe.py), whose forwards are not steps
            handle = model.model.layers[0].register_forward_pre_hook(flaky)
            first = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=6))
            outs = {
                o.request_id: o
                for o in engine.generate(workload(9, 2), SamplingParams(max_new_tokens=4), use_tqdm=False)
            }
            while engine.has_unfinished():
                for o in engine.step():
                    outs[o.request_id] = o
            settle(engine)
            again = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6), use_tqdm=False)[0]
    finally:
        if handle is not None:
            handle.remove()
    failed = [o for o in outs.values() if o.finish_reason == "error"]
    assert failed and all("simulated out of memory" in o.error for o in failed)
    assert first in outs
    assert again.error is None and len(again.token_ids) == 6


def test_add_request_from_threads_while_stepping():
    model = tiny_model("llama")
    prompts = workload(10, 12)
    refs = {tuple(p): reference(model, p, 4)[0] for p in prompts}
    results = {}
    with Engine(model, num_blocks=128, block_size=4) as engine:
        ids: dict[str, list[int]] = {}
        lock = threading.Lock()

        def submit(chunk):
            for p in chunk:
                rid = engine.add_request(p, SamplingParams(max_new_tokens=4))
                with lock:
                    ids[rid] = p

        threads = [threading.Thread(target=submit, args=(prompts[i::3],)) for i in range(3)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads) or engine.has_unfinished():
            for out in engine.step():
                results[out.request_id] = out
        for t in threads:
            t.join()
        while engine.has_unfinished():
            for out in engine.step():
                results[out.request_id] = out
        settle(engine)
    assert len(results) == len(prompts)
    for rid, out in results.items():
        assert out.token_ids == refs[tuple(ids[rid])]


def test_second_stepping_thread_is_refused():
    model = tiny_model("llama")
    engine = Engine(model, num_blocks=32, block_size=4)
    engine._stepping.acquire()  # as if another thread were inside step()
    try:
        with pytest.raises(ConcurrentUseError, match="another thread"):
            engine.step()
    finally:
        engine._stepping.release()
        engine.close()


def test_stats_and_close_restore_the_model():
    model = tiny_model("llama")
    assert model.config._attn_implementation == "sdpa"
    engine = Engine(model, num_blocks=64, block_size=4)
    assert model.config._attn_implementation == "paged"
    engine.generate(workload(11, 4), SamplingParams(max_new_tokens=3), use_tqdm=False)
    stats = engine.stats()
    assert stats.num_requests == stats.num_finished == 4
    assert stats.generated_tokens == 12 and stats.num_steps > 0 and stats.kv_peak_used_bytes > 0
    assert 0 <= stats.prefix_hit_rate <= 1 and stats.generation_throughput > 0
    engine.close()
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ConfigError, match="closed"):
        engine.add_request([1, 2])


def test_stats_time_each_stage_of_the_steps():
    model = tiny_model("llama")
    with Engine(model, num_blocks=64, block_size=4) as engine:
        before = engine.stats()
        assert before.host_seconds == before.forward_seconds == 0.0
        engine.generate(workload(12, 4), SamplingParams(max_new_tokens=3), use_tqdm=False)
        stats = engine.stats()
    stages = [stats.schedule_seconds, stats.prepare_seconds, stats.forward_seconds, stats.sample_seconds,
              stats.record_seconds]  # fmt: skip
    assert all(seconds > 0 for seconds in stages)
    assert stats.host_seconds == pytest.approx(sum(stages) - stats.forward_seconds)
    assert sum(stages) <= stats.busy_seconds and stats.forward_seconds > stats.sample_seconds


def test_stats_report_the_attention_backends_kernel_failures(monkeypatch):
    from types import SimpleNamespace

    model = tiny_model("llama")
    engine = Engine(model, num_blocks=64, block_size=4)
    assert engine.stats().kernel_failures == 0  # the torch backend does not count any
    torch_backend = engine.pool.attention_backend(torch.device("cpu"), torch.float32)
    counting = SimpleNamespace(name="counting", forward=torch_backend.forward, stats=SimpleNamespace(kernel_failures=3))
    monkeypatch.setattr(engine.pool, "attention_backend", lambda device, dtype, name=None: counting)
    assert engine.stats().kernel_failures == 3
    engine.close()


# --------------------------------------------------------------------------- the model's context, unsupported models
def test_the_context_limit_is_the_specs():
    # Dynamic NTK rope rescales past max_position_embeddings by design (the spec says no limit), but it chooses its
    # frequencies from each forward's largest position, which packing and chunking change: the Engine serves it up
    # to max_position_embeddings, exactly (tests/test_forward_dependent_rope.py).
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = tiny_model("llama", max_position_embeddings=32, rope_parameters=rope)
    twin = tiny_model("llama", max_position_embeddings=32, rope_parameters=rope)  # NTK state: one copy per run
    prompt = list(range(FIRST_TOKEN, FIRST_TOKEN + 40))
    with Engine(model, num_blocks=64, block_size=4) as engine:
        with pytest.raises(InvalidRequestError, match="over the context of 32 tokens"):
            engine.add_request(prompt, SamplingParams(max_new_tokens=4))
        (out,) = engine.generate([prompt[:28]], SamplingParams(max_new_tokens=4), use_tqdm=False)
        settle(engine)
    assert out.error is None and out.token_ids == reference(twin, prompt[:28], 4)[0]
    # Learned positions: GPT-2's n_positions is a hard limit.
    with Engine(tiny_model("gpt2", n_positions=32), num_blocks=64, block_size=4) as engine:
        with pytest.raises(InvalidRequestError, match="over the context of 32 tokens"):
            engine.add_request(prompt[:30], SamplingParams(max_new_tokens=4))
        engine.add_request(prompt[:28], SamplingParams(max_new_tokens=4))  # 32 positions: fits


@pytest.mark.parametrize("family", ["bloom", "falcon", "gpt_neo"])
def test_a_model_whose_attention_the_engine_cannot_replace_runs_its_own_attention_exactly(family):
    # Their attention ignores attn_implementation: with the Engine's packed cache it read only each step's own keys
    # (wrong tokens after the first, silently); then the Engine refused them. The construction-time probe now sends
    # them down the compatible path: left-padded rows over the model's own attention, keys gathered from the pool.
    model = tiny_model(family)
    before = model.config._attn_implementation
    prompts = workload(3, 5)
    params = SamplingParams(max_new_tokens=8, return_logits=True)
    with Engine(model, num_blocks=96, block_size=4, max_num_batched_tokens=16, max_num_seqs=3) as engine:
        assert model.config._attn_implementation == before  # its own attention, not "paged"
        outputs = engine.generate(prompts, params, use_tqdm=False)
        stats = engine.stats()
        settle(engine)
    assert stats.prefix_hit_tokens > 0
    assert_matches(model, prompts, outputs, 8)
    assert model.config._attn_implementation == before


def test_the_step_moves_its_host_tensors_with_to_device(monkeypatch):
    # On CUDA a plain .to()/torch.tensor(device=) of a CPU tensor waits for the GPU every step; to_device copies
    # from pinned memory without waiting. On the CPU it returns its input: here we check that every per-step copy
    # of the Engine (inputs, slots, copy-on-write pairs) goes through it.
    from pagedcore.adapters.transformers import pool as pool_module
    from pagedcore.adapters.transformers import runner as runner_module
    from pagedcore.adapters.transformers import step_batch
    from pagedcore.attention import to_device

    calls: list[str] = []
    for module in (runner_module, pool_module, step_batch):
        name = module.__name__.rsplit(".", 1)[-1]
        monkeypatch.setattr(module, "to_device", lambda t, d, name=name: calls.append(name) or to_device(t, d))
    model = tiny_model("llama")
    with Engine(model, num_blocks=64, block_size=4) as engine:
        # two samples of a prompt that ends inside a block: the fork copies that block on its first write
        engine.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_new_tokens=3, n=2, temperature=1.0, seed=0),
                        use_tqdm=False)  # fmt: skip
        settle(engine)
    assert {"runner", "pool", "step_batch"} <= set(calls), calls
