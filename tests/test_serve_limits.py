"""`pagedcore serve` against careless and hostile clients: oversized prompts and bodies, slow and half-sent bodies,
deeply nested JSON, sampling values at the edge of float arithmetic. Each is refused (or served) without stalling
anyone else, and the server stays healthy."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
from test_serve import CONTEXT, MODEL, OK_COMPLETION, C, Served, idle, serving, wait_for

from pagedcore.adapters.transformers.builtin import builtin_tokenizer
from pagedcore.serve.body import BodyLimits

pytestmark = pytest.mark.usefixtures("one_thread")


class WatchedTokenizer:
    """The built-in tokenizer, recording the length of every text it encodes; ``hook(text)`` runs first."""

    def __init__(self) -> None:
        self.inner = builtin_tokenizer()
        self.lengths: list[int] = []
        self.hook = lambda text: None

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        self.hook(text)
        return self.inner(text, **kwargs)


class Stream:
    """A long streaming completion on a thread, counting the events it receives."""

    def __init__(self, url: str, max_tokens: int = CONTEXT - 40) -> None:
        self.lines = 0
        self.done = threading.Event()
        body = {"model": MODEL, "prompt": "Streaming along", "max_tokens": max_tokens, "temperature": 0}
        self._thread = threading.Thread(target=self._run, args=(url, {**body, "stream": True}))
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + C, json=body, timeout=300) as response:
                for line in response.iter_lines():
                    if line:
                        self.lines += 1
        finally:
            self.done.set()

    def join(self) -> None:
        self._thread.join(300)


@pytest.fixture(scope="module")
def watched(one_thread) -> Iterator[tuple[Served, WatchedTokenizer]]:
    tokenizer = WatchedTokenizer()
    with serving(tokenizer=tokenizer) as s:
        yield s, tokenizer


def post(url: str, payload: bytes) -> httpx.Response:
    return httpx.post(url + C, content=payload, headers={"content-type": "application/json"}, timeout=120)


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# ---------------------------------------------------------------------- 17.7: oversized prompts stall no one
def test_prompts_are_tokenized_off_the_event_loop_and_off_the_step_loop(watched):
    """While the tokenizer works on one request (held here until another client's stream has moved on), that
    stream keeps receiving: neither the event loop nor the engine's step loop is waiting for the tokenizer."""
    s, tokenizer = watched
    stream = Stream(s.url)
    wait_for(lambda: stream.lines >= 3, "the stream to start")
    moved_on = threading.Event()

    def hold(text: str) -> None:
        if text.startswith("Held prompt"):
            seen = stream.lines
            wait_for(lambda: stream.lines >= seen + 5 or stream.done.is_set(), "the stream to move on", timeout=120)
            if stream.lines >= seen + 5:
                moved_on.set()

    tokenizer.hook = hold
    try:
        response = httpx.post(s.url + C, json={**OK_COMPLETION, "prompt": "Held prompt"}, timeout=300)
    finally:
        tokenizer.hook = lambda text: None
    assert response.status_code == 200 and moved_on.is_set()
    stream.join()
    wait_for(lambda: idle(s), "nothing running")


def test_an_oversized_prompt_is_refused_before_the_tokenizer_sees_it_while_another_stream_goes_on(watched):
    s, tokenizer = watched
    limit = CONTEXT * len("<unk>")  # the context times the longest vocabulary entry
    stream = Stream(s.url)
    wait_for(lambda: stream.lines >= 3, "the stream to start")
    tokenizer.lengths.clear()
    for prompt in ("x" * 5_000_000, "y" * (limit + 1), ["fine", "z" * (limit + 1)]):
        error = assert_openai_error(post(s.url, json.dumps({**OK_COMPLETION, "prompt": prompt}).encode()), 400)
        assert f"at most {limit} characters" in error["message"] and error["param"] == "prompt"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "m" * 3_000_000}]}
    error = assert_openai_error(httpx.post(s.url + "/v1/chat/completions", json=chat, timeout=120), 400)
    assert error["param"] == "messages"
    assert all(length <= limit for length in tokenizer.lengths), tokenizer.lengths
    refused_at = stream.lines
    assert not stream.done.is_set()  # the other client was still being served when the refusals came
    stream.join()
    assert stream.lines > refused_at
    assert httpx.get(f"{s.url}/health").status_code == 200


def test_a_huge_list_of_token_ids_is_refused_by_its_length_and_never_reaches_the_engine(watched, monkeypatch):
    s, _ = watched
    added: list[int] = []
    original = s.engine.add_request

    def add_request(request, *args, **kwargs):
        added.append(len(request.prompt))  # the loop hands the engine its Request
        return original(request, *args, **kwargs)

    monkeypatch.setattr(s.engine, "add_request", add_request)
    error = assert_openai_error(post(s.url, json.dumps({**OK_COMPLETION, "prompt": [5] * 2_000_000}).encode()), 400)
    assert "2000000 token ids, more than the model's context of 512 tokens" in error["message"]
    assert added == []
    assert httpx.post(s.url + C, json={**OK_COMPLETION, "prompt": [5] * 8}, timeout=60).status_code == 200
    assert added == [8]  # what the engine receives is token ids


# ---------------------------------------------------------------------- 17.14: sampling values at float's edge
@pytest.mark.parametrize("extra", [{"temperature": 1e-40}, {"temperature": 1e-300}, {"top_p": 1e-320}])
def test_tiny_temperatures_and_top_p_are_served_never_a_500(watched, extra):
    s, _ = watched
    greedy = httpx.post(s.url + C, json={**OK_COMPLETION, "max_tokens": 6, "temperature": 0}, timeout=60)
    response = httpx.post(s.url + C, json={**OK_COMPLETION, "max_tokens": 6, "seed": 1, **extra}, timeout=60)
    assert response.status_code == 200, response.text
    if "temperature" in extra:
        assert response.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert s.metrics()["pagedcore_requests_total{status=failed}"] == 0


# ---------------------------------------------------------------------- 17.16: nested JSON
def test_deeply_nested_json_is_a_400_and_the_keep_alive_connection_survives(watched):
    s, _ = watched
    with httpx.Client(base_url=s.url, timeout=60, limits=httpx.Limits(max_connections=1)) as client:
        ports = []
        for body in (
            b"[" * 100_000,
            b'{"model": "tiny", "prompt": "x", "deep": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        ):
            response = client.post(C, content=body, headers={"content-type": "application/json"})
            assert "nests too deeply" in assert_openai_error(response, 400)["message"]
            ports.append(response.extensions["network_stream"].get_extra_info("client_addr"))
        response = client.post(C, json=OK_COMPLETION)
        assert response.status_code == 200
        ports.append(response.extensions["network_stream"].get_extra_info("client_addr"))
    assert len(set(ports)) == 1  # one connection served all three


# ---------------------------------------------------------------------- 17.7 / 17.15: bodies, bounded
@pytest.fixture(scope="module")
def strict(one_thread) -> Iterator[Served]:
    with serving(limits=BodyLimits(max_bytes=4096, timeout=1.0)) as s:
        yield s


def raw_request(s: Served, head: str, body: bytes = b"", *, close: bool = False) -> bytes:
    """Send ``head`` and ``body`` on a fresh connection and return what the server answers (until it closes the
    connection, or at once when ``close``: the client then leaves without reading)."""
    with socket.create_connection((s.server.host, s.server.port), timeout=60) as sock:
        sock.sendall(head.encode() + body)
        if close:
            return b""
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        size, _, rest = body.partition(b"\r\n")
        body = rest[: int(size, 16)]
    return int(head.split()[1]), json.loads(body)["error"]


HEAD = "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"


def test_a_body_over_the_limit_gets_413_at_once_by_its_length_or_while_it_streams_in(strict):
    before = strict.metrics()["pagedcore_requests_total{status=invalid}"]
    response = httpx.post(strict.url + C, json={**OK_COMPLETION, "prompt": "x" * 5000}, timeout=60)
    error = assert_openai_error(response, 413)
    assert "limit of 4096 bytes" in error["message"] and error["code"] == "request_too_large"
    # Declared larger than the limit: answered before one byte of the body is sent.
    status, error = status_and_error(raw_request(strict, HEAD + "Content-Length: 10000000\r\n\r\n"))
    assert status == 413 and "Content-Length is 10000000" in error["message"]
    # Chunked, no length: answered once the limit is passed, while the client has not finished sending.
    chunk = b"1000\r\n" + b" " * 4096 + b"\r\n"
    status, error = status_and_error(raw_request(strict, HEAD + "Transfer-Encoding: chunked\r\n\r\n", chunk * 2))
    assert status == 413 and "bytes came so far" in error["message"]
    assert strict.metrics()["pagedcore_requests_total{status=invalid}"] == before + 3
    assert httpx.get(f"{strict.url}/health").status_code == 200


def test_a_body_that_comes_too_slowly_gets_408(strict):
    before = strict.metrics()["pagedcore_requests_total{status=timed_out}"]
    raw = raw_request(strict, HEAD + "Content-Length: 100\r\n\r\n", b'{"model": ')  # and nothing more
    status, error = status_and_error(raw)
    assert status == 408 and "did not arrive within 1 s" in error["message"] and error["code"] == "request_timeout"
    assert strict.metrics()["pagedcore_requests_total{status=timed_out}"] == before + 1


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_client_that_leaves_mid_upload_is_counted_as_disconnected_with_one_log_line(strict):
    records = Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "pagedcore.serve")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(records)
        logger.setLevel(logging.INFO)
    before = strict.metrics()
    try:
        for _ in range(3):
            raw_request(strict, HEAD + "Content-Length: 1000\r\n\r\n", b'{"model": "tiny", "pro', close=True)
        key = "pagedcore_requests_total{status=disconnected}"
        wait_for(lambda: strict.metrics()[key] == before[key] + 3, "three disconnects")
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(records)
            logger.setLevel(level)
    after = strict.metrics()
    assert after["pagedcore_requests_total{status=failed}"] == before["pagedcore_requests_total{status=failed}"]
    assert not [r for r in records.records if r.exc_info or r.levelno >= logging.ERROR]
    lines = [r.getMessage() for r in records.records if r.name == "pagedcore.serve"]
    assert len(lines) == 3 and all("the client left after sending" in line for line in lines), lines
