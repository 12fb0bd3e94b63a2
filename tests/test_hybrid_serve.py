"""`pagedcore serve` with a hybrid model (Qwen3.5-like: Gated DeltaNet layers beside full attention), as a process:
the official openai client over a real socket gets stock ``generate``'s greedy text for prompts sharing a prefix,
streamed or not; a conversation's next turn and a repeated prompt are answered from snapshots (``cached_tokens``);
log-probabilities are stock's. The model and its tokenizer are saved to a folder the command loads."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from hybrid_models import hybrid_model
from models import tiny_tokenizer
from paged_checks import dynamic

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import openai
from test_serve_cli import read_port, wait_healthy

pytestmark = pytest.mark.usefixtures("one_thread")

PREFIX = list(range(40, 58))
PROMPTS = [[*PREFIX, 100, 101, 102], [*PREFIX, 7, 8], PREFIX + [200] * 9]


def stock_text(model, tokenizer, prompt: list[int], new: int) -> tuple[str, list[int], list[torch.Tensor]]:
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=new,
        do_sample=False,
        cache=dynamic(model),
        return_dict_in_generate=True,
        output_logits=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokenizer.decode(tokens, skip_special_tokens=True), tokens, [step[0].float() for step in out.logits]


@pytest.mark.slow
def test_pagedcore_serve_answers_a_hybrid_model_as_stock_generate(tmp_path):
    tokenizer = tiny_tokenizer()
    model = hybrid_model("qwen3_5")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    expected = [stock_text(model, tokenizer, prompt, 8)[0] for prompt in PROMPTS]
    command = [sys.executable, "-m", "pagedcore", "serve", str(tmp_path), "--port", "0", "--threads", "1"]
    command += ["--num-blocks", "128", "--block-size", "4", "--state-slots", "32", "--max-num-batched-tokens", "12"]
    command += ["--served-model-name", "hybrid"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        port = read_port(process, lines)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, lambda: process.poll() is None)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.completions.create(model="hybrid", prompt=PROMPTS, max_tokens=8, temperature=0)
        assert [choice.text for choice in sorted(answer.choices, key=lambda c: c.index)] == expected
        stream = client.completions.create(model="hybrid", prompt=PROMPTS[2], max_tokens=8, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected[2]
        # The repeated prompt resumes the snapshot at its last-but-one token.
        again = client.completions.create(model="hybrid", prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=1)
        assert again.choices[0].text == expected[0]
        assert again.usage.prompt_tokens_details.cached_tokens == len(PROMPTS[0]) - 1
        _, tokens, logits = stock_text(model, tokenizer, PROMPTS[0], 8)
        got = again.choices[0].logprobs.token_logprobs
        want = [float(torch.log_softmax(step, -1)[token]) for step, token in zip(logits, tokens)]
        assert all(math.isclose(g, w, abs_tol=1e-3) for g, w in zip(got, want))
        # The next turn of a conversation resumes where the reply ended (its last token was never computed).
        turn = [*PROMPTS[1], *tokenizer.encode(expected[1], add_special_tokens=False), 60, 61, 62]
        follow = client.completions.create(model="hybrid", prompt=turn, max_tokens=6, temperature=0)
        assert follow.choices[0].text == stock_text(model, tokenizer, turn, 6)[0]
        assert follow.usage.prompt_tokens_details.cached_tokens == len(PROMPTS[1]) + 8 - 1
    finally:
        process.terminate()
        try:
            process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
    assert "state slots" in "".join(lines)


@pytest.mark.parametrize("family", ["qwen3_5", "mamba2", "falcon_h1", "jamba"])
def test_the_server_answers_every_kind_of_hybrid_as_stock(family):
    """The server in this process (the same app and loop as the command) on four kinds of state layers: Gated
    DeltaNet beside attention, Mamba-2 alone, attention and SSM in one layer, Jamba's one-token-at-a-time Mamba."""
    from pagedcore.adapters.transformers import Engine
    from pagedcore.serve.app import create_app
    from pagedcore.serve.loop import EngineLoop
    from pagedcore.serve.server import BackgroundServer

    tokenizer = tiny_tokenizer()
    model = hybrid_model(family)
    expected = [stock_text(model, tokenizer, prompt, 8)[0] for prompt in PROMPTS]
    engine = Engine(model, tokenizer, num_blocks=128, block_size=4, max_num_batched_tokens=12, state_slots=32)
    loop = EngineLoop(engine)
    server = BackgroundServer(create_app(loop, model_name=family), loop)
    server.start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.completions.create(model=family, prompt=PROMPTS, max_tokens=8, temperature=0)
        assert [choice.text for choice in sorted(answer.choices, key=lambda c: c.index)] == expected
        stream = client.completions.create(model=family, prompt=PROMPTS[2], max_tokens=8, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected[2]
    finally:
        server.stop()
        engine.close()
    assert engine.pool.kv.num_used_blocks == 0 and engine.pool.kv.states.num_used == 0
    engine.pool.check_invariants()
