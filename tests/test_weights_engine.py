"""The Engine after the model's weights change (issue 17.1): every step checks the weights fingerprint, so requests
admitted after an update compute with the new weights (greedy tokens and fp32 logits equal stock ``generate`` on
them), requests running across it finish on the keys and values they computed (as a ``DynamicCache`` kept across
the update would), and none of their blocks is cached afterwards. Without an update a whole run keeps its hits.

References run on a mirror of the model (same weights, copied with ``load_state_dict`` after every update), so the
Engine's switch to paged attention never touches them."""

from __future__ import annotations

import pytest
import torch
from models import FIRST_TOKEN, VOCAB, tiny_model
from transformers import DynamicCache

from pagedcore.adapters import transformers as pc
from pagedcore.adapters.transformers import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4
GREEDY = SamplingParams(max_new_tokens=6, return_logits=True)


def workload(seed: int, count: int, shared: int = 10) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    prefix = torch.randint(FIRST_TOKEN, VOCAB, (shared,), generator=rng).tolist()
    return [prefix + torch.randint(FIRST_TOKEN, VOCAB, (2 + i,), generator=rng).tolist() for i in range(count)]


def mirror(model: torch.nn.Module) -> torch.nn.Module:
    """A second tiny Llama of ``model``'s sizes holding its weights (the reference stock ``generate`` runs on)."""
    sizes = {name: getattr(model.config, name) for name in ("hidden_size", "intermediate_size")}
    ref = tiny_model("llama", seed=99, **sizes)
    ref.load_state_dict(model.state_dict())
    return ref


def sgd_step(model: torch.nn.Module, prompts: list[list[int]], lr: float = 0.5) -> None:
    """One step of training on the samples (the RL pattern: sample, score, step, sample again)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    ids = torch.tensor([p[:8] for p in prompts])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def assert_stock(ref: torch.nn.Module, prompts: list[list[int]], outputs, max_new_tokens: int = 6) -> None:
    for prompt, out in zip(prompts, outputs):
        assert out.error is None, out.error
        want = ref.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            cache=DynamicCache(config=ref.config),
            return_dict_in_generate=True,
            output_logits=True,
        )
        assert out.token_ids == want.sequences[0, len(prompt) :].tolist()
        for got, logits in zip(out.samples[0].logits, want.logits):
            torch.testing.assert_close(got, logits[0].float(), atol=1e-4, rtol=0)


def settle(engine: Engine) -> None:
    assert engine.pool.kv.num_used_blocks == 0, "blocks leaked"
    engine.pool.check_invariants()


def test_an_rl_loop_samples_with_the_engine_steps_and_samples_again():
    model = tiny_model("llama")
    ref = mirror(model)
    prompts = workload(0, 4)
    with Engine(model, num_blocks=128, block_size=BLOCK, max_num_batched_tokens=64) as engine:
        for _ in range(3):
            outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
            assert_stock(ref, prompts, outputs)
            assert sum(o.metrics.num_cached_tokens for o in outputs) > 0  # the shared prefix within a round
            seeded = engine.generate([prompts[0]], max_new_tokens=5, do_sample=True, seed=3, use_tqdm=False)[0]
            torch.manual_seed(3)
            want = ref.generate(torch.tensor([prompts[0]]), max_new_tokens=5, do_sample=True, top_k=0)
            assert seeded.token_ids == want[0, len(prompts[0]) :].tolist()
            sgd_step(model, prompts)
            ref.load_state_dict(model.state_dict())
        settle(engine)


def test_a_whole_engine_run_keeps_its_hits():
    model = tiny_model("llama")
    prompts = workload(1, 5)
    with Engine(model, num_blocks=128, block_size=BLOCK, max_num_batched_tokens=64) as engine:
        engine.generate(prompts, GREEDY, use_tqdm=False)
        watch = engine.pool.weights
        epoch, walks = watch.epoch, watch.num_walks
        again = engine.generate(prompts, GREEDY, use_tqdm=False)
        assert watch.epoch == epoch and watch.num_walks == walks  # each step's check read the tensors only
        assert all(o.metrics.num_cached_tokens >= 8 for o in again)  # every prompt's full blocks
        settle(engine)


def test_a_request_running_across_an_update_finishes_on_what_it_computed():
    """It keeps the keys and values computed before the update (vLLM does the same); its later tokens are computed
    with the new weights over them, exactly as a DynamicCache continued across the update gives. None of its
    blocks is cached after the update: the same prompt then computes everything with the new weights."""
    model = tiny_model("llama")
    ref = mirror(model)
    prompt = workload(2, 1)[0]
    before, total = 3, 8
    with Engine(model, num_blocks=64, block_size=BLOCK) as engine:
        engine.add_request(prompt, SamplingParams(max_new_tokens=total), request_id="live")
        for _ in range(before):
            assert engine.step() == []
        with torch.no_grad():
            model.model.layers[0].self_attn.k_proj.weight.mul_(1.7)
            model.model.layers[1].mlp.up_proj.weight.mul_(1.3)
        finished = []
        while engine.has_unfinished():
            finished.extend(engine.step())
        (live,) = finished
        assert live.error is None and live.metrics.num_preemptions == 0
        assert live.token_ids == continued(ref, prompt, before, total, model.state_dict())
        again = engine.generate([prompt], GREEDY, use_tqdm=False)
        assert again[0].metrics.num_cached_tokens == 0
        assert_stock(ref, [prompt], again)
        settle(engine)


def continued(ref: torch.nn.Module, prompt: list[int], before: int, total: int, new_state: dict) -> list[int]:
    """Greedy tokens of a DynamicCache decode whose weights become ``new_state`` after ``before`` tokens."""
    cache = DynamicCache(config=ref.config)
    out: list[int] = []
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]
        while True:
            out.append(int(logits.argmax()))
            if len(out) == total:
                return out
            if len(out) == before:
                ref.load_state_dict(new_state)
            logits = ref(input_ids=torch.tensor([[out[-1]]]), cache=cache, use_cache=True).logits[0, -1]


def test_reset_prefix_cache_on_the_engine():
    model = tiny_model("llama")
    prompts = workload(3, 2)
    with Engine(model, num_blocks=64, block_size=BLOCK) as engine:
        engine.generate(prompts, GREEDY, use_tqdm=False)
        cached = engine.pool.kv.num_cached_blocks
        assert cached > 0
        assert engine.reset_prefix_cache() == cached
        assert engine.reset_prefix_cache() == 0
        again = engine.generate(prompts[:1], GREEDY, use_tqdm=False)
        assert again[0].metrics.num_cached_tokens == 0
        settle(engine)


def test_a_pool_shared_by_enable_and_an_engine():
    model = tiny_model("llama")
    ref = mirror(model)
    prompts = workload(4, 3)
    pool = pc.enable(model, num_blocks=128, block_size=BLOCK)
    try:
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False)
        with Engine(model, pool=pool, max_num_batched_tokens=64) as engine:
            outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
            assert outputs[0].metrics.num_cached_tokens == 11  # enable()'s prefix, the Engine's start moved nothing
            assert_stock(ref, prompts, outputs)
            sgd_step(model, prompts)
            ref.load_state_dict(model.state_dict())
            outputs = engine.generate(prompts[:1], GREEDY, use_tqdm=False)
            assert outputs[0].metrics.num_cached_tokens == 0
            assert_stock(ref, prompts[:1], outputs)
            with torch.no_grad():
                model.lm_head.weight.mul_(1.5)
            ref.load_state_dict(model.state_dict())
        hits = pool.num_hit_tokens
        got = model.generate(torch.tensor([prompts[1]]), max_new_tokens=6, do_sample=False)
        want = ref.generate(torch.tensor([prompts[1]]), max_new_tokens=6, do_sample=False)
        assert torch.equal(got, want) and pool.num_hit_tokens == hits  # the Engine's prefixes are of old weights
    finally:
        pc.disable(model)
    assert pool.kv.num_used_blocks == 0
    pool.check_invariants()


def test_a_converted_model_rebuilds_an_idle_pool_and_fails_only_the_requests_running_across_it():
    model = tiny_model("llama")
    prompt = workload(5, 1)[0]
    with Engine(model, num_blocks=64, block_size=BLOCK) as engine:
        engine.generate([prompt], SamplingParams(max_new_tokens=3), use_tqdm=False)
        model.to(torch.bfloat16)
        served = engine.generate([prompt], SamplingParams(max_new_tokens=3), use_tqdm=False)[0]
        assert served.error is None and served.metrics.num_cached_tokens == 0  # rebuilt in bfloat16
        assert engine.pool.layer_tensors(0)[0].dtype == torch.bfloat16
        engine.add_request(prompt, SamplingParams(max_new_tokens=6), request_id="running")
        engine.step()
        model.to(torch.float32)
        (failed,) = engine.step()
        assert failed.error is not None and failed.error.startswith("PoolMismatchError")
        served = engine.generate([prompt], SamplingParams(max_new_tokens=3), use_tqdm=False)[0]
        assert served.error is None and engine.pool.layer_tensors(0)[0].dtype == torch.float32
        settle(engine)


@pytest.mark.parametrize("change", ["activation", "setting", "forward", "hook", "hook removed"])
def test_a_change_that_moves_no_tensor_is_seen_by_the_next_request(change):
    """Regression: ``mlp.act_fn = nn.GELU()``, ``input_layernorm.variance_epsilon = ...``, ``mlp.forward = ...``
    or a forward hook added (a steering vector on the attention's output) or removed between two ``generate`` calls
    moved no tensor, so the Engine served the second call's prompts the keys the model computed before: other tokens
    than the model's own, with the same weights version."""
    model = tiny_model("llama")
    prompts = workload(31, 3)
    steer = model.model.layers[0].self_attn.o_proj
    handle = steer.register_forward_hook(lambda module, args, out: out * 3) if change == "hook removed" else None
    with Engine(model, num_blocks=128, block_size=BLOCK) as engine:
        first = engine.generate(prompts, GREEDY, use_tqdm=False)
        layer = model.model.layers[0]
        if handle is not None:
            handle.remove()
        elif change == "hook":
            steer.register_forward_hook(lambda module, args, out: out * 3)
        elif change == "activation":
            layer.mlp.act_fn = torch.nn.GELU()
        elif change == "setting":
            layer.input_layernorm.variance_epsilon = 0.5
        else:
            forward = layer.mlp.forward
            layer.mlp.forward = lambda x: forward(x) * 2
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.weights_version for o in outputs] == [first[0].weights_version + 1] * len(prompts)
        assert_stock(model, prompts, outputs)


def test_steps_that_admit_no_request_do_not_compare_the_settings(monkeypatch):
    """The settings check (tens of microseconds) runs only in steps that may admit a request, where a prefix lookup
    follows: one step here, not the decode steps after it."""
    from pagedcore.adapters.transformers import weights

    compared: list[int] = []
    real = weights._settings_hold
    monkeypatch.setattr(weights, "_settings_hold", lambda walk: compared.append(1) or real(walk))
    model = tiny_model("llama")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    with Engine(model, num_blocks=64, block_size=BLOCK) as engine:
        engine.generate([workload(32, 1)[0]], params, use_tqdm=False)  # the watch starts at the first step
        compared.clear()
        out = engine.generate([workload(33, 1)[0]], params, use_tqdm=False)
        assert len(out[0].token_ids) == 12 and out[0].error is None
        assert len(compared) == 1
