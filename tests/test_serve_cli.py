"""`pagedcore serve` as a command: cheap to import, serves the built-in model, stops cleanly on Ctrl-C / SIGTERM."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")  # the optional server: the suite runs without it
pytest.importorskip("uvicorn")

from pagedcore.cli import main


def test_the_command_line_imports_no_server_or_model_library():
    code = (
        "import sys, pagedcore.cli; pagedcore.cli._parser();"
        "print(sorted(m for m in ('torch', 'transformers', 'fastapi', 'uvicorn', 'prometheus_client', 'starlette')"
        " if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--max-queue", "-1"], "--max-queue must be >= 1"),
        (["--max-queue", "0"], "--max-queue must be >= 1"),  # 0 would answer every request with 429
        (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1"),
        (["--max-request-bytes", "lots"], "--max-request-bytes must be a size like 8MiB"),
        (["--body-timeout", "0"], "--body-timeout must be a number of seconds > 0"),
        (["--body-timeout", "nan"], "--body-timeout must be a number of seconds > 0"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--api-keys", "/nonexistent/keys.txt"], "cannot read the API key file"),
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2 is not supported: one engine holds the whole"),
        (["--quantization", "awq"], "--quantization awq is not supported"),
        (["--max-model-len", "0"], "--max-model-len must be >= 1"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout must be a number of seconds >= 0"),
        (["a/model", "--model", "b/model"], "the model is given twice"),
        (["--ray", "--api-key", "sk-1"], "--api-key is not supported with --ray yet"),
        (["--kv-store", "/tmp"], "--kv-store: kv_store='/tmp' needs kv_store_bytes= (its budget"),
        # a broken template is the server's error at start-up, not a 400 blaming every chat request (outside audit)
        (["--chat-template", "{% for m in messages %}{{ m.content }", "--port", "0"], "is not a Jinja template"),
        (["--kv-store-bytes", "1GiB"], "--kv-store-bytes sizes the stores below the pool: give kv_store= too"),
        (["--kv-store", "/tmp", "--kv-store-bytes", "lots"], "--kv-store-bytes must be a size like 8MiB"),
        # The Ray deployment's app reads tool calls in the default format: another one is refused, not ignored.
        (["--ray", "--tool-call-parser", "llama3_json"], "--tool-call-parser is not supported with --ray yet"),
    ],
)
def test_bad_arguments_exit_with_code_2(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_taken_port_is_one_line_said_before_the_model_loads(capsys, monkeypatch):
    """Regression (an outside audit): a taken port or a host that does not resolve ended start-up with a traceback,
    and only after the model and the Engine were built (minutes for a large model)."""
    import socket

    from pagedcore.serve import cli

    monkeypatch.setattr(cli, "_model", lambda *a: pytest.fail("the model was loaded before the port was bound"))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
        assert capsys.readouterr().err.strip() == (
            f"pagedcore serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
        )
    finally:
        taken.close()
    assert main(["serve", "--host", "nosuchhost.invalid", "--port", "0"]) == 2
    assert "cannot listen on nosuchhost.invalid:0" in capsys.readouterr().err


def test_vllm_flags_parse_as_vllm_reads_them_and_abbreviations_are_refused(capsys):
    from pagedcore.cli import _parser

    args = _parser().parse_args(["serve", "org/model", "--api-key", "sk-test", "--served-model-name", "a", "b"])
    assert args.model_tag == "org/model" and args.api_key == ["sk-test"] and args.api_keys is None
    assert args.served_model_name == ["a", "b"] and args.dtype == "auto" and args.enable_prefix_caching
    args = _parser().parse_args(["serve", "--no-enable-prefix-caching", "--allowed-origins", '["http://x"]'])
    assert not args.enable_prefix_caching and args.allowed_origins == ["http://x"]
    assert _parser().parse_args(["serve", "--uvicorn-log-level", "info"]).log_level == "info"
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["serve", "--max-q", "8"])  # argparse would have read it as --max-queue
    assert exit_info.value.code == 2 and "unrecognized arguments: --max-q" in capsys.readouterr().err


def test_the_port_refuses_connections_while_the_model_loads(capsys, monkeypatch):
    """Regression (review of the early bind): listening before the model loaded left clients connected and waiting
    (a TCP readiness probe said the server was up); the port is bound then, and listens only once it can answer."""
    import socket

    from pagedcore.cli.common import UsageError
    from pagedcore.serve import cli

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    seen: list[str] = []

    def loading(*args: object) -> None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            seen.append("accepted")
        except ConnectionRefusedError:
            seen.append("refused")
        raise UsageError("stop here")

    monkeypatch.setattr(cli, "_model", loading)
    assert main(["serve", "--port", str(port)]) == 2
    assert seen == ["refused"] and "stop here" in capsys.readouterr().err


def test_usage_errors_are_one_line_from_the_subcommand_and_vllm_short_flags_parse(capsys):
    """Regression (an outside audit): argparse printed the whole usage (52 lines for serve) before its error, an
    unknown option was reported by the top-level parser with its usage, and vLLM's -tp / -pp / -dp / -q were
    unknown while their long forms are refused with a reason."""
    for argv, message in (
        (["serve", "--dtype", "fp16"], "pagedcore serve: error: argument --dtype: invalid choice: 'fp16'"),
        (["serve", "--porrt", "3"], "pagedcore serve: error: unrecognized arguments: --porrt"),
        (["generate", "--threads", "0"], "pagedcore generate: error: argument --threads: must be >= 1"),
        (["serve", "-tp", "2"], "pagedcore serve: error: --tensor-parallel-size 2 is not supported"),
        (["serve", "-q", "awq"], "pagedcore serve: error: --quantization awq is not supported"),
    ):
        try:
            code = main(argv)  # a refused flag: main returns 2; argparse's own errors exit 2
        except SystemExit as exc:
            code = exc.code
        assert code == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and err.count("\n") == 1, err


def test_a_missing_kv_store_directory_is_refused_at_start(tmp_path, capsys):
    missing = tmp_path / "missing"
    assert main(["serve", "--kv-store", str(missing), "--kv-store-bytes", "1MiB", "--num-blocks", "8"]) != 0
    assert f"kv_store: {str(missing)!r} is not an existing directory" in capsys.readouterr().err


def test_a_json_key_file_with_a_duplicated_key_exits_with_code_2_without_printing_it(tmp_path, capsys):
    keys = tmp_path / "keys.json"
    keys.write_text('{"sk-shared-secret": "alice", "sk-shared-secret": "bob"}')
    assert main(["serve", "--api-keys", str(keys)]) == 2
    err = capsys.readouterr().err
    assert f"{keys}: entry 2 repeats the key of entry 1" in err and "sk-shared-secret" not in err


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_healthy(url: str, alive) -> None:
    deadline = time.monotonic() + 180
    while True:
        assert alive(), "the server exited"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.1)


BODY = {"model": "pagedcore-builtin", "prompt": "Hello", "max_tokens": 3, "temperature": 0}


def test_serve_in_process_until_ctrl_c(one_thread, capsys):
    port = free_port()
    statuses: list[int] = []
    serving = threading.Event()  # set while main() runs: only then does a SIGINT reach the server, not pytest

    def client() -> None:
        try:
            wait_healthy(f"http://127.0.0.1:{port}", serving.is_set)
            statuses.append(httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=BODY, timeout=60).status_code)
        finally:
            if serving.is_set():  # what Ctrl-C sends; uvicorn shuts down, run() returns
                os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=client)
    serving.set()
    thread.start()
    try:
        code = main(["serve", "--port", str(port), "--num-blocks", "64"])
    finally:
        serving.clear()  # main() returned (a server that never started): the client must not signal the runner
    thread.join(60)
    assert code == 0 and statuses == [200]
    assert "no --model given: serving the built-in" in capsys.readouterr().err


def test_serve_as_a_process_with_api_keys_until_sigterm(tmp_path):
    port = free_port()
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-test tenant-a\n")
    command = [sys.executable, "-m", "pagedcore", "serve", "--port", str(port), "--num-blocks", "64", "--threads", "1"]
    process = subprocess.Popen(
        [*command, "--api-keys", str(keys)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, lambda: process.poll() is None)
        assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).status_code == 401
        headers = {"Authorization": "Bearer sk-test"}
        response = httpx.post(f"{url}/v1/completions", json=BODY, headers=headers, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    assert f"http://127.0.0.1:{port}/v1" in err and "1 API keys" in err


def test_the_load_example_reports_its_figures(one_thread, capsys):
    path = Path(__file__).resolve().parent.parent / "examples" / "serve_load.py"
    spec = importlib.util.spec_from_file_location("example_serve_load", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    assert module.main(["--requests", "4", "--concurrency", "2", "--max-tokens", "3", "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["server"] == "pagedcore serve" and row["requests"] == 4
    assert row["requests_per_s"] > 0 and row["ttft_p50_s"] <= row["latency_p50_s"]
    assert row["prefix_hit_rate"] > 0  # the four prompts share the system prompt


def read_port(process: subprocess.Popen, lines: list[str]) -> int:
    """The port the server printed (it was started with --port 0)."""
    assert process.stderr is not None
    for line in process.stderr:
        lines.append(line)
        if line.startswith("pagedcore serve: model"):
            return int(line.split("http://127.0.0.1:", 1)[1].split("/", 1)[0])
    raise AssertionError("the server printed no address: " + "".join(lines))


def test_sigterm_drains_running_streams_and_refuses_new_requests_with_503():
    """vLLM's flags on the command line; SIGTERM with 8 streams running: each finishes, a request sent meanwhile
    gets 503 with Retry-After, and the process exits 0."""
    command = [sys.executable, "-m", "pagedcore", "serve", "pagedcore-builtin", "--port", "0", "--threads", "1"]
    command += ["--num-blocks", "256", "--served-model-name", "first", "second", "--api-key", "sk-test"]
    command += ["--max-model-len", "256", "--dtype", "auto", "--allowed-origins", '["*"]', "--shutdown-timeout", "60"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    headers = {"Authorization": "Bearer sk-test"}
    try:
        port = read_port(process, lines)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, lambda: process.poll() is None)
        models = httpx.get(f"{url}/v1/models", headers=headers).json()["data"]
        assert [m["id"] for m in models] == ["first", "second"] and models[0]["max_model_len"] == 256
        cors = httpx.options(
            f"{url}/v1/completions",
            headers={"Origin": "http://elsewhere", "Access-Control-Request-Method": "POST"},
        )
        assert cors.headers["access-control-allow-origin"] in ("*", "http://elsewhere")
        # Streams long enough to outlive the late requests below (a late request answered 200 before admission
        # closed is one token): once every stream ends the server exits and a late request is refused instead.
        body = {"model": "second", "prompt": "Tides", "max_tokens": 200, "ignore_eos": True, "stream": True}
        first_chunks = threading.Semaphore(0)
        ends: list[tuple[str | None, bool]] = []

        def stream() -> None:
            reason, done, chunks = None, False, 0
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120) as response:
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line.removeprefix("data: "))
                        chunks += 1
                        if chunks == 1:
                            first_chunks.release()
                        reason = "error" if "error" in chunk else chunk["choices"][0]["finish_reason"] or reason
            ends.append((reason, done))

        threads = [threading.Thread(target=stream) for _ in range(8)]
        for thread in threads:
            thread.start()
        for _ in threads:  # every stream has its first chunk
            assert first_chunks.acquire(timeout=120)
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while True:  # the signal is handled asynchronously: wait until admission closes
            late_body = {**body, "stream": False, "max_tokens": 1}
            late = httpx.post(f"{url}/v1/completions", json=late_body, headers=headers, timeout=60)
            if late.status_code != 200 or time.monotonic() > deadline:
                break
        assert late.status_code == 503 and late.headers["retry-after"] == "5", late.text
        assert late.json()["error"]["code"] == "shutting_down"
        assert httpx.get(f"{url}/health").status_code == 503
        for thread in threads:
            thread.join(120)
        assert ends == [("length", True)] * 8
        process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, "".join(lines)


def test_a_model_without_a_chat_template_is_said_at_start_up(capsys):
    """Regression (an outside audit): a --model whose tokenizer has no chat template was served chat requests
    through the plain 'role: content' template without a word (vLLM refuses them); the built-in model's is expected."""
    import argparse

    from pagedcore.adapters.transformers.builtin import builtin_tokenizer
    from pagedcore.cli.common import UsageError
    from pagedcore.serve import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    cli._app_options(parser.parse_args(["--model", "./ckpt"]), ["./ckpt"], UsageError, builtin_tokenizer())
    assert "warning: './ckpt' has no chat template" in capsys.readouterr().err
    cli._app_options(parser.parse_args([]), ["pagedcore-builtin"], UsageError, builtin_tokenizer())
    assert "chat template" not in capsys.readouterr().err


def test_a_chat_template_is_checked_with_the_jinja_transformers_renders_with():
    """Regression (review): the start-up check used plain Jinja, which refuses the {% break %} and {% generation %}
    tags transformers' apply_chat_template renders."""
    from pagedcore.cli.common import UsageError
    from pagedcore.serve import cli

    loops = "{% for m in messages %}{{ m.content }}{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}"
    cli._check_template(loops, "loops", UsageError)
    cli._check_template("{% generation %}{{ messages[0].content }}{% endgeneration %}", "gen", UsageError)
    with pytest.raises(UsageError, match="is not a Jinja template"):
        cli._check_template("{{ x }", "bad", UsageError)
