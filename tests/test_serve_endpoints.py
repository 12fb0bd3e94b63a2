"""vLLM's endpoints and metrics on `pagedcore serve`: /tokenize, /detokenize, /tokenizer_info, /version, /ping,
HEAD /health, CORS by option, the `vllm:` series a vLLM dashboard reads, model aliases, and chat without
max_tokens clamped to what the pool can hold."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from test_serve import CONTEXT, MODEL, Served, serving, tiny_model

from pagedcore import __version__
from pagedcore.adapters.transformers import Engine
from pagedcore.adapters.transformers.builtin import builtin_tokenizer
from pagedcore.serve.app import AppOptions, create_app
from pagedcore.serve.loop import EngineLoop
from pagedcore.serve.server import BackgroundServer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def served(one_thread) -> Iterator[Served]:
    with serving(options=AppOptions(aliases=("alias",), allowed_origins=("http://ui.example",))) as s:
        yield s


def test_tokenize_and_detokenize_round_trip(served):
    tokenizer = builtin_tokenizer()
    answer = httpx.post(f"{served.url}/tokenize", json={"prompt": "Neap tide", "return_token_strs": True}).json()
    assert answer["tokens"] == tokenizer.encode("Neap tide") and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == CONTEXT and "".join(answer["token_strs"]) == tokenizer.decode(answer["tokens"])
    text = httpx.post(f"{served.url}/detokenize", json={"model": MODEL, "tokens": answer["tokens"]}).json()
    assert text == {"prompt": "Neap tide"}
    chat = httpx.post(f"{served.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert tokenizer.decode(chat["tokens"]).endswith("assistant:")
    bad = httpx.post(f"{served.url}/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    bad = httpx.post(f"{served.url}/detokenize", json={"tokens": ["a"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("tokens")


def test_tokenizer_info_version_ping_and_head_health(served):
    info = httpx.get(f"{served.url}/tokenizer_info").json()
    assert info["eos_token"] == builtin_tokenizer().eos_token and info["model_max_length"] == CONTEXT
    assert httpx.get(f"{served.url}/version").json() == {"version": __version__}
    assert httpx.get(f"{served.url}/ping").status_code == 200 and httpx.post(f"{served.url}/ping").status_code == 200
    assert httpx.head(f"{served.url}/health").status_code == 200


def test_aliases_and_cors(served):
    models = httpx.get(f"{served.url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL, "alias"]
    body = {"model": "alias", "prompt": "Tide", "max_tokens": 1}
    answer = httpx.post(f"{served.url}/v1/completions", json=body, headers={"Origin": "http://ui.example"})
    assert answer.json()["model"] == MODEL and answer.headers["access-control-allow-origin"] == "http://ui.example"
    other = httpx.post(f"{served.url}/v1/completions", json=body, headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_vllm_metrics_count_requests_with_their_timings(served):
    labels = {"model_name": MODEL, "engine": "0"}

    def value(name: str, **extra: str) -> float:
        key = ",".join(f"{k}={v}" for k, v in sorted({**labels, **extra}.items()))
        return served.metrics().get(f"{name}{{{key}}}", 0.0)

    before = value("vllm:request_success_total", finished_reason="length")
    ttft = value("vllm:time_to_first_token_seconds_count")
    body = {"model": MODEL, "prompt": "Spring tides", "max_tokens": 4, "temperature": 0}
    httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    assert value("vllm:request_success_total", finished_reason="length") == before + 1
    assert value("vllm:time_to_first_token_seconds_count") == ttft + 1
    assert value("vllm:inter_token_latency_seconds_count") >= 3
    assert value("vllm:e2e_request_latency_seconds_count") >= 1 and value("vllm:request_queue_time_seconds_count") >= 1
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f"{name}{{engine=0,model_name={MODEL}}}" in served.metrics(), name
    assert value("vllm:prompt_tokens_total") > 0 and value("vllm:generation_tokens_total") >= 4


def test_chat_without_max_tokens_is_clamped_to_what_the_pool_holds():
    """A pool of 12 blocks of 8 tokens (96) under a context of 512: the answer runs to what fits, not a 400."""
    engine = Engine(tiny_model(), builtin_tokenizer(), num_blocks=12, block_size=8)
    loop = EngineLoop(engine)
    try:
        with BackgroundServer(create_app(loop, model_name=MODEL), loop) as server:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Tides?"}], "ignore_eos": True}
            answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
            assert answer.status_code == 200, answer.text
            usage = answer.json()["usage"]
            assert answer.json()["choices"][0]["finish_reason"] == "length"
            assert usage["completion_tokens"] == loop.max_new_tokens(usage["prompt_tokens"])
            # 96 slots hold every token but the last one drawn (its KV is never computed)
            assert usage["prompt_tokens"] + usage["completion_tokens"] == 97
    finally:
        engine.close()
    assert engine.pool.kv.num_used_blocks == 0
