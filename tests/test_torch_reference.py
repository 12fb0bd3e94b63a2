"""The plain-PyTorch runner (issue 27): a Llama written on torch.nn, loading a transformers checkpoint, driven by the
same pagedcore.engine.Engine as transformers models; its greedy tokens equal transformers' generate on the same
weights, through continuous batching, prefix hits and preemption. Nothing in it may need transformers."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch
from models import tiny_model
from repo import ROOT

from pagedcore.adapters.torch_reference import LlamaShape, TorchLlama, TorchRunner
from pagedcore.engine import Engine, EngineConfig, Request, SamplingParams
from pagedcore.errors import ConfigError, InvalidRequestError, UnsupportedModelError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny transformers Llama saved as a checkpoint folder, and the model itself (the reference)."""
    model = tiny_model("llama", num_hidden_layers=2)
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder)
    return folder, model


def workload(seed: int, count: int, shared: int = 10) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 100) for _ in range(shared)]
    return [
        (prefix if i % 3 else []) + [rng.randrange(3, 100) for _ in range(rng.randrange(1, 14))] for i in range(count)
    ]


def reference(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)[0][
        len(prompt) :
    ].tolist()


def test_it_loads_the_checkpoint_transformers_saved(checkpoint):
    folder, model = checkpoint
    ours = TorchLlama.from_pretrained(folder)
    theirs = model.state_dict()
    assert set(ours.state_dict()) == set(theirs)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name


def test_greedy_tokens_equal_transformers_generate_with_prefix_hits_and_preemption(checkpoint):
    folder, model = checkpoint
    prompts = workload(0, 9)
    new = 10
    runner = TorchRunner(TorchLlama.from_pretrained(folder), num_blocks=20, block_size=4)
    with Engine(runner, max_num_seqs=6, max_num_batched_tokens=16) as engine:
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=new), use_tqdm=False)
        again = engine.generate(prompts[:3], SamplingParams(max_new_tokens=new), use_tqdm=False)
        stats = engine.stats()
        assert runner.kv.num_used_blocks == 0
        runner.kv.check_invariants()
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0  # both happened, tokens unchanged
    for prompt, out in zip([*prompts, *prompts[:3]], [*outputs, *again]):
        assert out.error is None, out.error
        assert out.token_ids == reference(model, prompt, new), prompt


def test_logits_match_transformers_within_1e_4(checkpoint):
    folder, model = checkpoint
    prompt = workload(1, 1)[0] + [7, 8, 9]
    with Engine(TorchRunner(TorchLlama.from_pretrained(folder), num_blocks=16, block_size=4)) as engine:
        (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=4, return_logits=True), use_tqdm=False)
    ids = torch.tensor([prompt + out.token_ids[:-1]])
    with torch.no_grad():
        want = model(ids).logits[0, len(prompt) - 1 :]
    assert out.samples[0].logits is not None
    for got, expected in zip(out.samples[0].logits, want):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_the_same_engine_features_run_on_it(checkpoint):
    """Parallel samples (forks: copy-on-write in the runner), seeds, logprobs and the Request type."""
    folder, _ = checkpoint
    runner = TorchRunner(TorchLlama.from_pretrained(folder), num_blocks=32, block_size=4)
    params = SamplingParams(max_new_tokens=5, n=3, temperature=1.0, seed=7, logprobs=2)
    with Engine(runner) as engine:
        first = engine.generate([[5, 6, 7, 8, 9, 10]], params, use_tqdm=False)[0]
        rid = engine.add_request(Request([5, 6, 7, 8, 9, 10], params, request_id="mine"))
        while engine.has_unfinished():
            done = engine.step()
        assert rid == "mine" and done[0].request_id == "mine"
        second = done[0]
    assert len(first.samples) == 3 and all(len(s.token_ids) == 5 for s in first.samples)
    assert [s.token_ids for s in first.samples] == [s.token_ids for s in second.samples]  # seeded: same draws
    assert all(s.logprobs is not None and len(s.logprobs) == 5 for s in first.samples)


def test_a_weight_update_forgets_the_prefixes(checkpoint):
    folder, _ = checkpoint
    model = TorchLlama.from_pretrained(folder)
    runner = TorchRunner(model, num_blocks=32, block_size=4)
    prompt = list(range(3, 20))
    with Engine(runner) as engine:
        before = engine.generate([prompt], SamplingParams(max_new_tokens=3), use_tqdm=False)[0]
        with torch.no_grad():
            model.lm_head.weight.mul_(0.5)  # an in-place update: the runner's weights epoch moves
        engine.generate([prompt], SamplingParams(max_new_tokens=3), use_tqdm=False)
        assert engine.stats().prefix_hit_tokens == 0  # nothing computed by the old weights was served
    assert before.error is None


def test_what_it_cannot_do_is_refused():
    with pytest.raises(ConfigError, match="no tiers below its pool"):
        TorchRunner(TorchLlama.tiny(), num_blocks=8, kv_store="memory://", kv_store_bytes="1MiB")
    with pytest.raises(UnsupportedModelError, match="rotary"):
        LlamaShape.from_config({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(UnsupportedModelError, match="gelu"):
        LlamaShape.from_config({"hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="pool, compile: the runner's settings"):
        Engine(TorchRunner(TorchLlama.tiny(), num_blocks=8), config=EngineConfig.of(num_blocks=8, compile=True))
    with pytest.raises(ConfigError, match="attention_backend: the runner's settings"):
        Engine(TorchRunner(TorchLlama.tiny(), num_blocks=8), attention_backend="torch")
    with (
        Engine(TorchRunner(TorchLlama.tiny(), num_blocks=8, block_size=4)) as engine,
        pytest.raises(InvalidRequestError, match="keyword arguments") as caught,
    ):
        engine.generate([[1, 2]], max_new_tokens=3)  # transformers' words: that is the transformers Engine's
    assert "max_new_tokens" in str(caught.value)


def test_it_needs_no_transformers():
    code = (
        "import sys\n"
        "from pagedcore.adapters.torch_reference import TorchLlama, TorchRunner\n"
        "from pagedcore.engine import Engine, SamplingParams\n"
        "with Engine(TorchRunner(TorchLlama.tiny(), num_blocks=16, block_size=4)) as engine:\n"
        "    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), use_tqdm=False)\n"
        "print(len(out[0].token_ids), sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "2 []"
