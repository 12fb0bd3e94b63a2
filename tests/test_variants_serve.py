"""`pagedcore serve` with the attention variants: the official openai client over a real socket against the server
running a tiny MLA (DeepSeek V3), KV-sharing (Gemma 4), sinks (gpt-oss) or chunked-attention (Llama 4) model gets,
for token-id prompts sharing a prefix, the text of stock ``generate``'s greedy tokens, streamed or not."""

from __future__ import annotations

import pytest
import torch
from models import tiny_tokenizer
from paged_checks import dynamic
from variant_models import variant_model

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import openai

from pagedcore.adapters.transformers import Engine
from pagedcore.adapters.transformers.runner import eos_token_ids
from pagedcore.serve.app import create_app
from pagedcore.serve.loop import EngineLoop
from pagedcore.serve.server import BackgroundServer

pytestmark = pytest.mark.usefixtures("one_thread")

PREFIX = list(range(40, 58))
PROMPTS = [[*PREFIX, 100, 101, 102], [*PREFIX, 7, 8], PREFIX + [200] * 9]


@pytest.mark.parametrize("family", ["deepseek_v3", "gemma4_shared", "gpt_oss", "llama4"])
def test_the_server_answers_with_stock_generates_tokens(family):
    tokenizer = tiny_tokenizer()
    model = variant_model(family)
    expected = []
    stops = eos_token_ids(model, tokenizer)  # the server stops at the tokenizer's eos too, as vLLM does
    for prompt in PROMPTS:
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, cache=dynamic(model), eos_token_id=stops
        )
        expected.append(tokenizer.decode(out[0, len(prompt) :].tolist(), skip_special_tokens=True))
    engine = Engine(model, tokenizer, num_blocks=128, block_size=4, max_num_batched_tokens=12)
    loop = EngineLoop(engine)
    server = BackgroundServer(create_app(loop, model_name=family), loop)
    server.start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.completions.create(model=family, prompt=PROMPTS, max_tokens=8, temperature=0)
        assert [choice.text for choice in sorted(answer.choices, key=lambda c: c.index)] == expected
        assert answer.usage.prompt_tokens_details.cached_tokens > 0  # the shared prefix came from the cache
        stream = client.completions.create(model=family, prompt=PROMPTS[2], max_tokens=8, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected[2]
    finally:
        server.stop()
        engine.close()
    assert engine.pool.kv.num_used_blocks == 0
    engine.pool.check_invariants()
