"""The server process against hostile or careless clients (issue 26): half-sent headers and one client's flood of
connections cannot lock others out (raw sockets), ``VLLM_API_KEY`` is honoured, a client's ``request_id`` cannot
forge log lines and the id the server logs is its own."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from pagedcore.cli import main

BODY = {"model": "pagedcore-builtin", "prompt": "Hello", "max_tokens": 2, "temperature": 0}


class Server:
    """``pagedcore serve`` as a process: its port and what it printed."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None, nofile: int | None = None) -> None:
        command = [sys.executable, "-m", "pagedcore", "serve", "--port", "0", "--threads", "1", "--num-blocks", "64"]

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.process = subprocess.Popen(
            [*command, *flags],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            preexec_fn=limit,
        )
        self.lines: list[str] = []
        self.port = self._read_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + 120
        while True:
            assert self.process.poll() is None, "the server exited: " + "".join(self.lines)
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)

    def _read_port(self) -> int:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)
            if line.startswith("pagedcore serve: model"):
                return int(line.split("http://127.0.0.1:", 1)[1].split("/", 1)[0])
        raise AssertionError("the server printed no address: " + "".join(self.lines))

    def _drain(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)

    def stop(self) -> str:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(60)
        self._reader.join(10)
        return "".join(self.lines)


@contextlib.contextmanager
def serving(*flags: str, **kwargs) -> Iterator[Server]:
    server = Server(*flags, **kwargs)
    try:
        yield server
    finally:
        server.stop()


def half_header(port: int, source: str) -> socket.socket:
    """A connection from ``source`` that sends half a header block and waits."""
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: app")
    return sock


def closed_by_server(sock: socket.socket, within: float) -> bytes | None:
    """What the server sent before closing ``sock`` within ``within`` seconds (None: still open)."""
    sock.settimeout(within)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return data


def test_half_sent_headers_from_one_client_do_not_lock_others_out():
    """Issue 26.4: with ``ulimit -n 256``, 300 connections from one address that send half a header block held
    every descriptor, and no other client was served until they left. Now that address holds at most a quarter of
    the descriptors (429 for more), and each of its connections is closed with 408 at the header timeout."""
    with serving("--header-timeout", "3", nofile=256) as server:
        attackers: list[socket.socket] = []
        try:
            for _ in range(300):
                with contextlib.suppress(OSError):
                    attackers.append(half_header(server.port, "127.0.0.2"))
            started = time.monotonic()
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            assert httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=30).status_code == 200
            assert time.monotonic() - started < 3  # before any header timeout: the cap is what kept room
            answers = [closed_by_server(sock, 8) for sock in attackers]
        finally:
            for sock in attackers:
                sock.close()
        refused = [a for a in answers if a is not None and a.startswith(b"HTTP/1.1 429")]
        timed_out = [a for a in answers if a is not None and a.startswith(b"HTTP/1.1 408")]
        assert len(timed_out) == 64 and len(refused) == len(answers) - 64  # 256 // 4 kept, each closed in time
        assert None not in answers


def test_a_connection_that_stops_sending_headers_is_closed_and_others_are_served():
    with serving("--header-timeout", "1", "--max-connections-per-client", "4") as server:
        slow = half_header(server.port, "127.0.0.1")
        try:
            started = time.monotonic()
            answer = closed_by_server(slow, 10)
            assert answer is not None and answer.startswith(b"HTTP/1.1 408")
            assert 0.9 < time.monotonic() - started < 5
        finally:
            slow.close()
        with httpx.Client(timeout=30) as client:  # a keep-alive client making requests is never cut off
            for _ in range(3):
                assert client.post(f"{server.url}/v1/completions", json=BODY).status_code == 200
        held = [half_header(server.port, "127.0.0.1") for _ in range(5)]
        try:
            assert closed_by_server(held[-1], 5).startswith(b"HTTP/1.1 429")  # the fifth from one address
        finally:
            for sock in held:
                sock.close()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--header-timeout", "0"], "--header-timeout must be a number of seconds > 0"),
        (["--max-connections-per-client", "-1"], "--max-connections-per-client must be >= 0"),
        (["--ray", "--header-timeout", "5"], "--header-timeout is not supported with --ray"),
    ],
)
def test_bad_connection_limits_exit_with_code_2(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- VLLM_API_KEY (issue 26.5)


def test_vllm_api_key_protects_the_server_and_the_log_says_so():
    with serving(env={"VLLM_API_KEY": "sk-from-env"}) as server:
        assert httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=30).status_code == 401
        wrong = {"Authorization": "Bearer sk-other"}
        assert httpx.post(f"{server.url}/v1/completions", json=BODY, headers=wrong, timeout=30).status_code == 401
        right = {"Authorization": "Bearer sk-from-env"}
        assert httpx.post(f"{server.url}/v1/completions", json=BODY, headers=right, timeout=30).status_code == 200
        assert httpx.get(f"{server.url}/health").status_code == 200
    assert "API keys from VLLM_API_KEY (1 keys)" in "".join(server.lines)


def test_the_api_key_flag_wins_over_vllm_api_key_as_in_vllm():
    with serving("--api-key", "sk-flag", env={"VLLM_API_KEY": "sk-from-env"}) as server:
        env_key = {"Authorization": "Bearer sk-from-env"}
        assert httpx.post(f"{server.url}/v1/completions", json=BODY, headers=env_key, timeout=30).status_code == 401
        flag_key = {"Authorization": "Bearer sk-flag"}
        assert httpx.post(f"{server.url}/v1/completions", json=BODY, headers=flag_key, timeout=30).status_code == 200
    assert "API keys from --api-key (1 keys) (VLLM_API_KEY is set and not used)" in "".join(server.lines)


@pytest.mark.parametrize("value", ["", "   ", "two words"])
def test_an_empty_or_blank_vllm_api_key_is_refused_at_start(value, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_API_KEY", value)
    assert main(["serve", "--num-blocks", "8"]) == 2
    assert "VLLM_API_KEY" in capsys.readouterr().err


# ---------------------------------------------------------------- request ids in the log (issue 26.8)


@pytest.fixture(scope="module")
def in_process():
    """The app in this process (its log records reach caplog), on the shrunk built-in model."""
    from test_serve import serving as serving_in_process

    with serving_in_process() as served:
        yield served


@pytest.mark.parametrize("request_id", ["ok\nERROR pagedcore: forged line", "red\x1b[31malert", "rtl\u202eevil"])
def test_a_request_id_with_control_characters_is_refused_naming_it(in_process, request_id):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "request_id": request_id}
    response = httpx.post(f"{in_process.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "request_id"


def test_the_logged_id_is_the_servers_own_and_unique_beside_the_clients(in_process, monkeypatch, caplog):
    """Two requests with the same client ``request_id`` fail (an injected step failure): each 500 names a distinct
    server id, and the log line under that id shows the client's id as a separate, escaped field."""

    def failing():
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(in_process.engine, "step_events", failing)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "request_id": "shared-id"}
    first = httpx.post(f"{in_process.url}/v1/completions", json=body, timeout=60)
    second = httpx.post(f"{in_process.url}/v1/completions", json=body, timeout=60)
    monkeypatch.undo()
    ids = [r.json()["error"]["message"].split("request id ")[1].split(";")[0] for r in (first, second)]
    assert first.status_code == second.status_code == 500 and ids[0] != ids[1]
    assert all(i.startswith("req-") and "shared-id" not in i for i in ids)
    logged = [r.getMessage() for r in caplog.records if r.name == "pagedcore.serve"]
    for request_id in ids:
        (line,) = [line for line in logged if request_id in line]
        assert "client request_id 'shared-id'" in line and "injected step failure" in line


# ---------------------------------------------------------------- tool messages (issue 26.9)


@pytest.mark.parametrize(
    ("message", "missing"),
    [
        ({"role": "tool"}, "content and tool_call_id"),
        ({"role": "tool", "content": "42"}, "tool_call_id"),
        ({"role": "tool", "tool_call_id": "call_1"}, "content"),
    ],
)
def test_a_tool_message_without_content_or_tool_call_id_is_refused(in_process, message, missing):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}, message], "max_tokens": 1}
    response = httpx.post(f"{in_process.url}/v1/chat/completions", json=body, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "messages" and missing in error["message"]


# ---------------------------------------------------------------- smaller edges (issue 26.9)


def test_an_engine_loop_with_max_queue_0_is_refused(in_process):
    """The command line refused ``--max-queue 0``; from Python the loop took it and answered every request 429."""
    from pagedcore.errors import ConfigError
    from pagedcore.serve.loop import EngineLoop

    with pytest.raises(ConfigError, match="max_queue"):
        EngineLoop(in_process.engine, max_queue=0)


@pytest.mark.parametrize("tokens", [[-1], [500], [5, 99]])
def test_detokenize_refuses_ids_outside_the_vocabulary_naming_tokens(in_process, tokens):
    response = httpx.post(f"{in_process.url}/detokenize", json={"tokens": tokens}, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "tokens" and "outside the vocabulary" in error["message"]
    assert httpx.post(f"{in_process.url}/detokenize", json={"tokens": [40, 41]}).json() == {"prompt": "DE"}


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [("GET", "/v1/completions", "POST"), ("POST", "/health", "GET, HEAD"), ("DELETE", "/v1/models", "GET")],
)
def test_a_405_says_which_methods_the_path_takes(in_process, method, path, allow):
    response = httpx.request(method, f"{in_process.url}{path}", timeout=30)
    assert response.status_code == 405 and response.headers["allow"] == allow
    assert response.json()["error"]["code"] == "405"


# ---------------------------------------------------------------- what the strict schema fuzz found (issue 26.9)


@pytest.mark.parametrize(
    "fields",
    [
        {"repetition_penalty": 5e-324, "temperature": 1.0},  # 0 in float32: logits / 0 = inf, softmax NaN
        {"temperature": 3.36e307, "guided_regex": "[a-z]+"},  # inf in float32: a masked -inf / inf = NaN
    ],
    ids=["tiny-repetition-penalty", "huge-temperature-with-a-grammar"],
)
def test_extreme_but_valid_sampling_values_are_served(in_process, fields):
    """Values the document allows (and the server accepted) ended in 500: "probability tensor contains inf/nan"."""
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 4, "seed": 1, **fields}
    response = httpx.post(f"{in_process.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text


def test_allowed_token_ids_with_a_structured_output_is_refused_naming_it(in_process):
    """Their intersection could be empty: the request then failed mid-way with a 500 (no finite logit)."""
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 4, "guided_regex": "[a-z]+", "allowed_token_ids": [5]}
    response = httpx.post(f"{in_process.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "allowed_token_ids"


def test_integral_json_numbers_are_integers_as_json_schema_counts_them(in_process):
    """``85.0`` is an integer to JSON Schema (what ``/openapi.json`` promises); the server refused it."""
    body = {"model": "tiny", "prompt": [40.0, 41, 42.0], "max_tokens": 2.0, "temperature": 0}
    response = httpx.post(f"{in_process.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def test_the_openapi_document_states_what_the_server_enforces(in_process):
    """The issue's two examples: an empty prompt and /tokenize with neither prompt nor messages were schema-valid
    and 400; now the document refuses them too (and every other field the server does not know)."""
    import jsonschema

    document = httpx.get(f"{in_process.url}/openapi.json").json()
    components = {"components": document["components"]}

    def valid(name: str, body: dict) -> bool:
        schema = {**components, "$ref": f"#/components/schemas/{name}"}
        return jsonschema.Draft202012Validator(schema).is_valid(body)

    assert valid("CompletionRequest", {"model": "tiny", "prompt": "hi"})
    assert not valid("CompletionRequest", {"model": "tiny", "prompt": ""})
    assert not valid("CompletionRequest", {"model": "tiny", "prompt": "hi", "no_such_field": 1})
    assert not valid("CompletionRequest", {"model": "other", "prompt": "hi"})
    assert not valid("CompletionRequest", {"prompt": [99]})  # outside the vocabulary of 99 ids
    assert valid("TokenizeRequest", {"prompt": "hi"}) and not valid("TokenizeRequest", {})
    assert not valid("TokenizeRequest", {"prompt": "hi", "messages": [{"role": "user", "content": "x"}]})
    assert not valid("ChatMessage", {"role": "tool"})
    rules = document["paths"]["/v1/completions"]["post"]["x-pagedcore-rules"]
    assert any("max_model_len" in rule for rule in rules)
