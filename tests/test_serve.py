"""`pagedcore serve` end to end: uvicorn on a loopback port in a background thread, driven by the official openai
client (and httpx where a test needs to hang up mid-stream). Model: the built-in character-level Llama, shrunk."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

pytest.importorskip("openai")  # the optional client and server: the suite runs without them
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import openai
from prometheus_client.parser import text_string_to_metric_families

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer
from pagedcore.serve.app import create_app
from pagedcore.serve.auth import ApiKeys
from pagedcore.serve.loop import EngineLoop
from pagedcore.serve.prompts import ChatRenderer
from pagedcore.serve.protocol import ChatMessage
from pagedcore.serve.server import BackgroundServer

MODEL = "tiny"
CONTEXT = 512
SYSTEM = "You answer questions about the tides, briefly and kindly.\n"
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model():
    return builtin_model(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=CONTEXT, seed=3
    )


@dataclass
class Served:
    url: str
    engine: Engine
    loop: EngineLoop
    server: BackgroundServer

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
                if "le" not in sample.labels:
                    values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return values


@contextlib.contextmanager
def serving(
    *, api_keys: ApiKeys | None = None, max_queue: int = 64, start_loop: bool = True, **app_options: Any
) -> Iterator[Served]:
    engine = Engine(tiny_model(), builtin_tokenizer(), num_blocks=256, block_size=8, max_num_seqs=32)
    loop = EngineLoop(engine, max_queue=max_queue)
    app = create_app(loop, model_name=MODEL, api_keys=api_keys, **app_options)
    server = BackgroundServer(app, loop, start_loop=start_loop)
    server.start()
    try:
        yield Served(server.url, engine, loop, server)
    finally:
        server.stop()
        engine.close()
    assert engine.pool.kv.num_used_blocks == 0, "blocks leaked"
    engine.pool.check_invariants()


@pytest.fixture(scope="module")
def served(one_thread) -> Iterator[Served]:
    with serving() as s:
        yield s


@pytest.fixture(scope="module")
def reference() -> Callable[[str | list[int], int], str]:
    """What ``Engine.generate`` gives for one prompt alone (greedy), on an identical model."""
    engine = Engine(tiny_model(), builtin_tokenizer(), num_blocks=256, block_size=8)
    memo: dict[tuple, str] = {}

    def generate(prompt: str | list[int], max_tokens: int) -> str:
        key = (prompt if isinstance(prompt, str) else tuple(prompt), max_tokens)
        if key not in memo:
            (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=max_tokens), use_tqdm=False)
            memo[key] = out.text or ""
        return memo[key]

    yield generate
    engine.close()


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def idle(s: Served) -> bool:
    m = s.metrics()
    return m["pagedcore_kv_blocks_used"] == 0 and m["pagedcore_requests_running"] == 0


def chat_ids(messages: list[dict]) -> list[int]:
    return ChatRenderer(builtin_tokenizer()).render([ChatMessage.model_validate(m) for m in messages])


# ---------------------------------------------------------------------- endpoints
def test_models_and_health(served):
    client = served.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}


def test_completion_equals_engine_generate_alone(served, reference):
    out = served.client().completions.create(model=MODEL, prompt="The tide at noon", max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].text == reference("The tide at noon", 12)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (16, 12, 28)


def test_usage_reports_the_prompt_tokens_served_from_the_prefix_cache(served):
    prompt = "Cached tokens show in the usage: " + "abcdefgh" * 3  # 57 tokens: 7 blocks of 8, then one token
    first = served.client().completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = served.client().completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 56  # all but the last token, always recomputed


def test_completion_of_token_ids_and_batches(served, reference):
    ids = builtin_tokenizer()("Low water")["input_ids"]
    client = served.client()
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert out.choices[0].text == reference(ids, 5)
    out = client.completions.create(model=MODEL, prompt=[ids, ids[:4]], max_tokens=5, temperature=0)
    assert [c.text for c in out.choices] == [reference(ids, 5), reference(ids[:4], 5)]
    out = client.completions.create(model=MODEL, prompt=["Low water", "High water"], max_tokens=5, n=2, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [reference("Low water", 5)] * 2 + [reference("High water", 5)] * 2
    assert out.usage.prompt_tokens == len("Low water") + len("High water") and out.usage.completion_tokens == 20


def test_chat_uses_the_plain_template(served, reference):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When is high tide?"}]
    out = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == reference(chat_ids(messages), 9)
    assert out.usage.prompt_tokens == len(chat_ids(messages))


def test_chat_without_max_tokens_may_run_to_the_end_of_the_context(served):
    messages = [{"role": "user", "content": "x" * (CONTEXT - 20)}]
    out = served.client().chat.completions.create(model=MODEL, messages=messages, temperature=0)
    assert out.usage.prompt_tokens + out.usage.completion_tokens == CONTEXT
    assert out.choices[0].finish_reason == "length"


def test_streaming_completion_equals_the_plain_answer(served, reference):
    stream = served.client().completions.create(
        model=MODEL,
        prompt="Spring tides",
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference("Spring tides", 10)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_streaming_chat_sends_the_role_with_the_first_token_then_deltas_and_done(served, reference):
    messages = [{"role": "user", "content": "Neap tides?"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    want = reference(chat_ids(messages), 6)
    # The first chunk goes out with the first token (its text: one character per token here), never before prefill.
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": want[0]}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_n_samples_are_seeded_and_share_the_prompt(served, reference):
    client = served.client()
    kwargs = {"model": MODEL, "prompt": "Ebb and flow", "max_tokens": 8, "n": 3, "temperature": 0.9, "seed": 7}
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 24 and first.usage.prompt_tokens == len("Ebb and flow")
    greedy = client.completions.create(model=MODEL, prompt="Ebb and flow", max_tokens=8, n=2, temperature=0)
    assert [c.text for c in greedy.choices] == [reference("Ebb and flow", 8)] * 2
    streamed = client.completions.create(**kwargs, stream=True)
    texts = ["", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in first.choices]


def test_stop_strings_end_the_text_before_them(served, reference):
    full = reference("Moon and sea", 16)
    stop = full[5:7]
    expected = full[: full.find(stop)]
    client = served.client()
    out = client.completions.create(model=MODEL, prompt="Moon and sea", max_tokens=16, temperature=0, stop=[stop])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 16
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Moon and sea", max_tokens=16, temperature=0, stop=["never there", stop], stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_for(lambda: idle(served), "the stopped request's blocks to return")


def test_32_concurrent_clients_sharing_a_system_prompt(served, reference):
    before = served.metrics()
    questions = [f"Question {i}: why does the tide turn?" for i in range(32)]

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=300)
        async with client:

            async def one(i: int, question: str) -> str:
                if i % 2:
                    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
                    chat = await client.chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=6, temperature=0
                    )
                    return chat.choices[0].message.content or ""
                out = await client.completions.create(
                    model=MODEL, prompt=SYSTEM + question, max_tokens=6, temperature=0
                )
                return out.choices[0].text

            return await asyncio.gather(*(one(i, q) for i, q in enumerate(questions)))

    answers = asyncio.run(run())
    for i, (question, answer) in enumerate(zip(questions, answers)):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        assert answer == reference(chat_ids(messages) if i % 2 else SYSTEM + question, 6), f"client {i}"
    after = served.metrics()
    hits = after["pagedcore_prefix_cache_hits_total"] - before["pagedcore_prefix_cache_hits_total"]
    queries = after["pagedcore_prefix_cache_queries_total"] - before["pagedcore_prefix_cache_queries_total"]
    assert queries > 0 and hits / queries > 0
    assert (
        after["pagedcore_requests_total{status=finished}"] - before["pagedcore_requests_total{status=finished}"] == 32
    )


def test_metrics_report_every_documented_series(served):
    served.client().completions.create(model=MODEL, prompt="Tide tables", max_tokens=2, temperature=0)
    response = httpx.get(f"{served.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    metrics = served.metrics()
    for name in [
        "pagedcore_prompt_tokens_total",
        "pagedcore_generation_tokens_total",
        "pagedcore_prefix_cache_queries_total",
        "pagedcore_prefix_cache_hits_total",
        "pagedcore_preemptions_total",
        "pagedcore_kv_blocks_used",
        "pagedcore_kv_blocks",
        "pagedcore_kv_usage",
        "pagedcore_requests_waiting",
        "pagedcore_requests_running",
        "pagedcore_step_seconds_count",
        "pagedcore_requests_total{status=finished}",
        "python_gc_collections_total{generation=2}",  # a full pass stops the step loop (pagedcore/cli/gc_heap.py)
        "python_gc_objects_collected_total{generation=0}",
        "python_gc_objects_uncollectable_total{generation=0}",
    ]:
        assert name in metrics, name
    assert metrics["pagedcore_step_seconds_count"] > 0 and metrics["pagedcore_prompt_tokens_total"] > 0
    assert metrics["pagedcore_kv_blocks"] == 256
    assert metrics["python_gc_collections_total{generation=0}"] > 0  # this process's passes, as gc.get_stats() has them


# ---------------------------------------------------------------------- clients that leave
@contextlib.contextmanager
def paused_after_first_token(engine: Engine, monkeypatch) -> Iterator[threading.Event]:
    """Hold the loop before each step once a token was produced, until the yielded event is set: the request is
    then surely still running when the client hangs up, however fast the machine."""
    gate, original, produced = threading.Event(), engine.step_events, threading.Event()

    def step_events():
        if produced.is_set():
            gate.wait(60)
        out = original()
        if any(event.token_id is not None for event in out.events):
            produced.set()
        return out

    monkeypatch.setattr(engine, "step_events", step_events)
    try:
        yield gate
    finally:
        gate.set()


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(served, monkeypatch):
    before = served.metrics()["pagedcore_requests_total{status=aborted}"]
    body = {"model": MODEL, "prompt": "Storm surge", "max_tokens": 100, "temperature": 0, "stream": True}
    with paused_after_first_token(served.engine, monkeypatch) as gate:
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{served.url}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one token arrived: the request runs; hang up
            assert served.metrics()["pagedcore_kv_blocks_used"] > 0
        wait_for(lambda: served.metrics()["pagedcore_requests_total{status=aborted}"] == before + 1, "the abort")
        gate.set()
        wait_for(lambda: idle(served), "the blocks to return")


def test_a_client_that_disconnects_before_the_answer_frees_its_blocks(served, monkeypatch):
    before = served.metrics()["pagedcore_requests_total{status=aborted}"]
    payload = json.dumps({"model": MODEL, "prompt": "Rip current", "max_tokens": 100, "temperature": 0})
    head = "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(payload)}\r\n\r\n"
    with paused_after_first_token(served.engine, monkeypatch) as gate:
        with socket.create_connection((served.server.host, served.server.port)) as sock:
            sock.sendall((head + payload).encode())
            wait_for(lambda: served.metrics()["pagedcore_kv_blocks_used"] > 0, "the request to run")
        wait_for(lambda: served.metrics()["pagedcore_requests_total{status=aborted}"] == before + 1, "the abort")
        gate.set()
        wait_for(lambda: idle(served), "the blocks to return")


# ---------------------------------------------------------------------- bad input
C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_INPUTS = [
    # (path, body (dict, or raw bytes), status, param)
    (C, b"{not json", 400, None),
    (C, b"[1, 2]", 400, None),
    (C, b"\xff\xfe", 400, None),
    (C, {**OK_COMPLETION, "model": "gpt-4"}, 404, "model"),
    (C, {"model": MODEL}, 400, "prompt"),
    (C, {**OK_COMPLETION, "max_tokens": -1}, 400, "max_tokens"),
    (C, {**OK_COMPLETION, "max_tokens": 10**12}, 400, "max_tokens"),
    (C, {**OK_COMPLETION, "max_tokens": CONTEXT}, 400, "max_tokens"),
    (C, {**OK_COMPLETION, "prompt": "x" * (CONTEXT + 1)}, 400, "prompt"),
    (C, {**OK_COMPLETION, "max_tokens": "5"}, 400, "max_tokens"),
    (C, {**OK_COMPLETION, "max_tokens": 5.5}, 400, "max_tokens"),
    (C, {**OK_COMPLETION, "max_tokens": True}, 400, "max_tokens"),
    (C, {**OK_COMPLETION, "temperature": -1}, 400, "temperature"),
    (C, {**OK_COMPLETION, "temperature": "hot"}, 400, "temperature"),
    (C, {**OK_COMPLETION, "top_p": 0}, 400, "top_p"),
    (C, {**OK_COMPLETION, "top_p": 1.5}, 400, "top_p"),
    (C, {**OK_COMPLETION, "top_k": -2}, 400, "top_k"),
    (C, {**OK_COMPLETION, "n": 0}, 400, "n"),
    (C, {**OK_COMPLETION, "n": 1000}, 400, "n"),  # more than --max-num-seqs: the engine refuses it
    (C, {**OK_COMPLETION, "n": "2"}, 400, "n"),
    (C, {**OK_COMPLETION, "seed": "1"}, 400, "seed"),
    (C, {**OK_COMPLETION, "prompt": ""}, 400, "prompt"),
    (C, {**OK_COMPLETION, "prompt": []}, 400, "prompt"),
    (C, {**OK_COMPLETION, "prompt": [[]]}, 400, "prompt"),
    (C, {**OK_COMPLETION, "prompt": 123}, 400, "prompt"),
    (C, {**OK_COMPLETION, "prompt": [1, "a"]}, 400, "prompt"),
    (C, {**OK_COMPLETION, "prompt": [100000]}, 400, "prompt"),  # out of the vocabulary
    (C, {**OK_COMPLETION, "prompt": ["ok", ""]}, 400, "prompt"),
    (C, {**OK_COMPLETION, "stream": "yes"}, 400, "stream"),
    (C, {**OK_COMPLETION, "stream_options": {"include_usage": "yes"}}, 400, "stream_options.include_usage"),
    (C, {**OK_COMPLETION, "stop": 5}, 400, "stop"),
    (C, {**OK_COMPLETION, "stop": [""]}, 400, "stop"),
    (C, {**OK_COMPLETION, "stop": ["a"] * 17}, 400, "stop"),
    (C, {**OK_COMPLETION, "logprobs": -1}, 400, "logprobs"),
    (C, {**OK_COMPLETION, "best_of": 3}, 400, "best_of"),
    (C, {**OK_COMPLETION, "suffix": "end"}, 400, "suffix"),
    (C, {**OK_COMPLETION, "presence_penalty": 2.5}, 400, "presence_penalty"),
    (C, {**OK_COMPLETION, "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    (C, {**OK_COMPLETION, "cache_salt": ""}, 400, "cache_salt"),
    (CHAT, {**OK_CHAT, "messages": "hi"}, 400, "messages"),
    (CHAT, {**OK_CHAT, "messages": []}, 400, "messages"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    (CHAT, {**OK_CHAT, "messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    (
        CHAT,
        {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages.0.content.0.type",  # "Input should be 'text'": the only part taken
    ),
    (CHAT, {**OK_CHAT, "max_completion_tokens": -5}, 400, "max_tokens"),
    (CHAT, {**OK_CHAT, "logprobs": 1}, 400, "logprobs"),
    (CHAT, {**OK_CHAT, "tools": [{"type": "function", "function": {"parameters": {}}}]}, 400, "tools"),
    (CHAT, {**OK_CHAT, "functions": [{"name": "f"}]}, 400, "functions"),
    (CHAT, {**OK_CHAT, "response_format": {"type": "xml"}}, 400, "response_format"),
    (C, {**OK_COMPLETION, "guided_regex": "(("}, 400, "guided_regex"),
    # Regression: each of these was answered with the field ignored (an audit with the openai client's shapes)
    (C, {**OK_COMPLETION, "stream_options": {"include_usage": True}}, 400, "stream_options"),  # not streamed
    (CHAT, {**OK_CHAT, "stream": True, "stream_options": {"include_usge": True}}, 400, "stream_options.include_usge"),
    (C, {**OK_COMPLETION, "max_tokens": 3, "min_tokens": 10}, 400, "min_tokens"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "hi", "bogus": 1}]}, 400, "messages.0.bogus"),
    (
        CHAT,
        {**OK_CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "refusal": "no"}]},
        400,
        "messages.1.refusal",
    ),
    (
        CHAT,
        {**OK_CHAT, "response_format": {"type": "json_object", "schema": {"type": "integer"}}},
        400,
        "response_format",
    ),
    (
        CHAT,
        {**OK_CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strct": True}}},
        400,
        "response_format",
    ),
    (CHAT, {**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f", "parmeters": {}}}]}, 400, "tools"),
    (
        CHAT,
        {
            **OK_CHAT,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}, "strict": True},
        },
        400,
        "tool_choice",
    ),
    (CHAT, {**OK_CHAT, "model": "gpt-4"}, 404, "model"),
    # A lone surrogate is valid JSON but no tokenizer's input: the tokenizer's failure is a 400, not a 500.
    (C, b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt"),
    (
        CHAT,
        b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}',
        400,
        "messages",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_INPUTS, ids=[str(i) for i in range(len(BAD_INPUTS))])
def test_bad_input_gets_an_openai_error_and_leaves_nothing_running(served, path, body, status, param):
    before = served.metrics()["pagedcore_requests_total{status=invalid}"]
    if isinstance(body, bytes):
        response = httpx.post(served.url + path, content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(served.url + path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert served.metrics()["pagedcore_requests_total{status=invalid}"] == before + 1
    wait_for(lambda: idle(served) and served.metrics()["pagedcore_requests_waiting"] == 0, "nothing running")


def test_bad_input_messages_name_the_value(served):
    error = httpx.post(served.url + C, json={**OK_COMPLETION, "temperature": -1}).json()["error"]
    assert error["message"] == "temperature must be >= 0, got -1.0"
    error = httpx.post(served.url + C, json={**OK_COMPLETION, "max_tokens": CONTEXT}).json()["error"]
    assert "over the context of 512 tokens" in error["message"]
    error = httpx.post(served.url + C, json={**OK_COMPLETION, "n": 1000}).json()["error"]
    assert "1000 parallel samples" in error["message"]
    assert "req-" not in error["message"]  # the engine's request id is the server's business, not the client's


def test_unknown_paths_and_methods_get_json_errors(served):
    response = httpx.get(f"{served.url}/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["message"]
    response = httpx.get(f"{served.url}{C}")
    assert response.status_code == 405 and response.json()["error"]["message"]


def test_an_earlier_answer_sent_back_as_the_client_returned_it_is_taken(served):
    """Messages refuse keys they do not define; an assistant message the openai client returned, sent back whole
    (``refusal``, ``annotations``, ``audio``, ``function_call`` empty), is one they define."""
    client = served.client()
    question = {"role": "user", "content": "hi"}
    first = client.chat.completions.create(model=MODEL, messages=[question], max_tokens=3, temperature=0)
    earlier = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(earlier)
    again = client.chat.completions.create(
        model=MODEL,
        messages=[question, earlier, question],
        max_tokens=3,
        temperature=0,  # type: ignore[list-item]
    )
    assert again.choices[0].finish_reason in ("length", "stop")


def test_a_text_parts_cache_breakpoint_is_taken_and_a_lifetime_refused(served):
    """OpenAI's ``prompt_cache_breakpoint`` (the openai client's text parts define it): the prefix cache keeps every
    prompt's blocks anyway; a ``ttl`` it cannot promise is a 400 naming it."""
    part = {"type": "text", "text": "hi", "prompt_cache_breakpoint": {"mode": "explicit"}}
    body = {**OK_CHAT, "messages": [{"role": "user", "content": [part]}]}
    assert httpx.post(served.url + CHAT, json=body).status_code == 200
    part["prompt_cache_breakpoint"] = {"mode": "explicit", "ttl": "12h"}
    answer = httpx.post(served.url + CHAT, json=body)
    assert answer.status_code == 400 and "prompt_cache_breakpoint.ttl" in answer.json()["error"]["param"]


def test_the_openai_client_raises_bad_request(served):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        served.client().completions.create(model=MODEL, prompt="hi", max_tokens=-3)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        served.client().completions.create(model=MODEL, prompt="hi", max_tokens=3, best_of=2)


# ---------------------------------------------------------------------- failures inside the engine
def server_error_names_only_its_id(error: dict, caplog, detail: str) -> None:
    """A 5xx tells the client a request id and nothing of the server's internals; the log has the details."""
    assert error["type"] == "server_error" and detail not in error["message"]
    request_id = error["message"].split("request id ")[1].split(";")[0]
    logged = [r.getMessage() for r in caplog.records if r.name == "pagedcore.serve"]
    assert any(request_id in line and detail in line for line in logged), logged


def test_a_failing_step_fails_its_requests_and_the_loop_serves_on(served, monkeypatch, caplog):
    original = served.engine.step_events
    calls = []

    def fail_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected step failure")
        return original()

    monkeypatch.setattr(served.engine, "step_events", fail_once)
    before = served.metrics()
    response = httpx.post(served.url + C, json={**OK_COMPLETION, "max_tokens": 5}, timeout=60)
    assert response.status_code == 500
    server_error_names_only_its_id(response.json()["error"], caplog, "injected step failure")
    with served.client().completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=True) as stream:
        assert len(list(stream)) == 3  # and the next request is served
    after = served.metrics()
    assert after["pagedcore_failed_steps_total"] == before["pagedcore_failed_steps_total"] + 1
    assert after["pagedcore_requests_total{status=failed}"] == before["pagedcore_requests_total{status=failed}"] + 1
    wait_for(lambda: idle(served), "the failed request's blocks to return")


def test_a_failing_forward_mid_stream_ends_the_stream_with_an_error(served, monkeypatch, caplog):
    model = served.engine.model
    original = model.forward
    calls = []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected forward failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    body = {**OK_COMPLETION, "max_tokens": 10, "stream": True, "temperature": 0}
    with httpx.stream("POST", served.url + C, json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    server_error_names_only_its_id(json.loads(lines[-2].removeprefix("data: "))["error"], caplog, "injected forward")
    assert len(lines) == 4  # two tokens, the error, [DONE]
    wait_for(lambda: idle(served), "the failed request's blocks to return")


# ---------------------------------------------------------------------- tenants, overload, shutdown
def test_api_keys_authenticate_and_tenants_do_not_share_the_prefix_cache():
    keys = ApiKeys({"sk-alice": "alice", "sk-alice-2": "alice", "sk-bob": "bob"})
    prompt = "A tenant's private prompt that spans several blocks of the pool."
    with serving(api_keys=keys) as s:
        for client in (s.client(), s.client("sk-mallory")):
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
            with pytest.raises(openai.AuthenticationError):
                client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        response = httpx.post(f"{s.url}{C}", json=OK_COMPLETION, headers={"Authorization": "Basic sk-alice"})
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{s.url}/health").status_code == 200  # probes need no key
        assert s.metrics()["pagedcore_requests_total{status=unauthorized}"] == 5

        def hits_after(key: str, **extra) -> float:
            s.client(key).completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=extra)
            return s.metrics()["pagedcore_prefix_cache_hits_total"]

        assert hits_after("sk-alice") == 0  # cold
        assert hits_after("sk-alice-2") > 0  # same tenant, another key: hits
        warm = s.metrics()["pagedcore_prefix_cache_hits_total"]
        # Bob sends the same prompt, even naming Alice's namespace: no hit (a client never chooses its namespace:
        # a namespace field is no field of the API, so a 400 naming it, and Alice's name as cache_salt narrows
        # sharing within Bob's tenant).
        for field in ("namespace", "pagedcore_namespace"):
            with pytest.raises(openai.BadRequestError) as info:
                hits_after("sk-bob", **{field: "alice"})
            assert info.value.body["param"] == field
        assert hits_after("sk-bob", cache_salt="alice") == warm
        assert hits_after("sk-bob") == warm  # cold: a salted request shares nothing with unsalted ones
        assert hits_after("sk-bob") > warm  # Bob's own cache now serves Bob


def test_a_full_queue_answers_429():
    with serving(max_queue=2, start_loop=False) as s:
        results: list[httpx.Response] = []
        threads = [
            threading.Thread(target=lambda: results.append(httpx.post(s.url + C, json=OK_COMPLETION, timeout=120)))
            for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        wait_for(lambda: s.metrics()["pagedcore_requests_waiting"] == 2, "two waiting requests")
        with pytest.raises(openai.RateLimitError):
            s.client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
        response = httpx.post(s.url + C, json=OK_COMPLETION)
        assert response.status_code == 429 and response.json()["error"]["code"] == "queue_full"
        s.loop.start()  # the queue drains and the waiting requests are answered
        for thread in threads:
            thread.join(120)
        assert [r.status_code for r in results] == [200, 200]
        assert s.metrics()["pagedcore_requests_total{status=overloaded}"] == 2
        assert s.client().completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text


def test_shutdown_ends_running_requests_with_an_error_and_does_not_hang(monkeypatch):
    lines: list[str] = []
    with serving() as s:
        started = threading.Event()
        body = {**OK_COMPLETION, "max_tokens": CONTEXT - 10, "stream": True, "temperature": 0}  # no special token first

        def stream() -> None:
            with httpx.stream("POST", s.url + C, json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        with contextlib.ExitStack() as stack:
            stack.enter_context(paused_after_first_token(s.engine, monkeypatch))
            thread = threading.Thread(target=stream)
            thread.start()
            assert started.wait(60)
            stopper = threading.Thread(target=s.server.stop)
            stopper.start()  # the loop is held before its next step; the stop must still end the request
            wait_for(lambda: not s.loop.is_running, "the loop to be told to stop")
        stopper.join(60)
        thread.join(60)
        assert not stopper.is_alive() and not thread.is_alive()
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "shutting_down"


def test_an_unexpected_error_still_gets_an_openai_error_body(served, monkeypatch, caplog):
    import pagedcore.serve.prompts as prompts_module

    def broken(prompt):
        raise RuntimeError("a bug")

    monkeypatch.setattr(prompts_module, "completion_prompts", broken)
    response = httpx.post(served.url + C, json=OK_COMPLETION)
    assert response.status_code == 500
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] is None and error["code"] is None
    server_error_names_only_its_id(error, caplog, "RuntimeError: a bug")
