"""vLLM's ``serve`` flags as real ``pagedcore serve`` processes: each implemented flag's effect is seen from outside
(the HTTP answers, the log), each no-op flag says why in the start-up log, ``--config FILE.yaml`` is read as vLLM
reads it (the command line wins), and models load from the hub cache at a ``--revision`` (offline, from a cache
built here) with their generation config's defaults. ``POST /reset_prefix_cache`` makes the next request miss."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("yaml")

from pagedcore.cli import main
from pagedcore.serve.vllm_flags import expand_config, human_int

BUILTIN = "pagedcore-builtin"


class Server:
    """A ``pagedcore serve`` process: its URL, and its log so far."""

    def __init__(self, process: subprocess.Popen, log: Path) -> None:
        self.process = process
        self.log_path = log
        self.url = ""

    def log(self) -> str:
        return self.log_path.read_text()


@contextlib.contextmanager
def serve(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    log = tmp_path / f"serve-{time.monotonic_ns()}.log"
    command = [sys.executable, "-m", "pagedcore", "serve", *argv]
    with log.open("w") as sink:
        process = subprocess.Popen(command, stderr=sink, stdout=sink, env={**os.environ, **(env or {})})
    server = Server(process, log)
    try:
        deadline = time.monotonic() + 180
        while "/v1 (" not in server.log():
            assert process.poll() is None, f"the server exited: {server.log()}"
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        line = next(line for line in server.log().splitlines() if "/v1 (" in line)
        server.url = line.split(" at ", 1)[1].split("/v1", 1)[0]
        while not _healthy(server.url):
            assert process.poll() is None and time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        yield server
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:  # bound, not yet listening
        return False


def test_human_ints_read_as_vllm_reads_them():
    assert [human_int(t) for t in ("1k", "1K", "25.6k", "2M", "4096")] == [1000, 1024, 25600, 2 * 2**20, 4096]


def test_each_no_op_flag_says_why_it_changes_nothing():
    from pagedcore.cli import _parser
    from pagedcore.serve.vllm_flags import NO_OPS, no_op_notes

    argv = ["--enable-chunked-prefill", "--swap-space", "0", "--enable-tokenizer-info-endpoint"]
    args = _parser().parse_args(["serve", *argv, "--enable-prompt-tokens-details"])
    notes = no_op_notes(args)
    assert [note.split(" has no effect here: ")[0] for note in notes] == list(NO_OPS)
    assert no_op_notes(_parser().parse_args(["serve"])) == []


def test_a_config_file_goes_before_the_command_line(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("max_model_len: 512\nserved-model-name: [a, b]\nenforce_eager: true\ncompile: false\n")
    argv = expand_config(["serve", "m", "--config", str(config), "--max-model-len", "1k"])
    assert argv == ["serve", "--max-model-len", "512", "--served-model-name", "a", "b", "--enforce-eager",
                    "--no-compile", "m", "--max-model-len", "1k"]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tool-call-parser", "granite"], "--tool-call-parser granite is not supported here"),
        (["--tool-call-parser", "nonsense"], "no vLLM parser has this name"),
        (["--reasoning-parser", "granite"], "--reasoning-parser granite is not supported here"),
        (
            [BUILTIN, "--threads", "1", "--num-blocks", "16", "--reasoning-parser", "openai_gptoss"],
            "--reasoning-parser openai_gptoss reads gpt-oss's channel format: the tokenizer must have <|start|>",
        ),
        (["--guided-decoding-backend", "xgrammar"], "--guided-decoding-backend xgrammar (vLLM's backend)"),
        (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill is not supported"),
        (["--enforce-eager", "--compile"], "--enforce-eager and --compile contradict"),
        (["--cuda-graphs", "--compile"], "--cuda-graphs and --enforce-eager / --compile contradict"),
        (["--swap-space", "-1"], "--swap-space must be a number of GiB >= 0"),
        (["--root-path", "api/"], "--root-path must start with /"),
        (["--generation-config", "/nonexistent"], "--generation-config '/nonexistent': expected auto, vllm"),
        (["--ray", "--reasoning-parser", "qwen3"], "--reasoning-parser is not supported with --ray yet"),
        (["--config", "/nonexistent.yaml"], "--config '/nonexistent.yaml': cannot read it"),
    ],
)
def test_bad_flags_exit_with_code_2_naming_them(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_vllms_flags_as_a_process(tmp_path):
    """Every flag is given (some through --config), and each one's effect is checked from outside. The log level
    is the default (warning): --enable-log-requests logs its lines all the same (it logged nothing, an outside
    audit found)."""
    config = tmp_path / "serve.yaml"
    config.write_text(
        "port: 0\nthreads: 1\nnum-blocks: 128\nserved_model_name: [first, second]\nmax_model_len: 512\n"
        "enable-request-id-headers: true\nresponse_role: helper\nreturn-tokens-as-token-ids: true\n"
    )
    argv = [BUILTIN, "--config", str(config), "--max-model-len", "1k", "--root-path", "/api", "--disable-fastapi-docs",
            "--enable-log-requests", "--max-log-len", "5", "--disable-uvicorn-access-log",
            "--dtype", "half", "--enforce-eager", "--swap-space", "4", "--enable-chunked-prefill",
            "--guided-decoding-backend", "guidance", "--disable-log-stats", "--no-enable-auto-tool-choice",
            "--tool-call-parser", "mistral", "--override-generation-config", '{"max_new_tokens": 2}']  # fmt: skip
    with serve(tmp_path, *argv, env={"VLLM_LOG_STATS_INTERVAL": "0.3"}) as server:
        url = server.url
        (card, _) = httpx.get(f"{url}/api/v1/models").json()["data"]  # behind a proxy's prefix, and without it
        assert httpx.get(f"{url}/v1/models").json()["data"][0] == card
        assert card["id"] == "first" and card["max_model_len"] == 1000  # the command line's 1k over the file's 512
        assert card["root"] == BUILTIN and card["parent"] is None and card["permission"][0]["allow_sampling"]
        assert httpx.get(f"{url}/openapi.json").status_code == 404
        body = {"model": "second", "messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-7"})
        assert answer.headers["x-request-id"] == "trace-7"
        choice = answer.json()["choices"][0]
        assert choice["message"]["role"] == "helper"
        assert answer.json()["usage"]["completion_tokens"] == 2  # --override-generation-config's max_new_tokens
        assert all(entry["token"].startswith("token_id:") for entry in choice["logprobs"]["content"])
        assert len(httpx.get(f"{url}/health").headers["x-request-id"]) == 32  # a new one
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        refused = httpx.post(f"{url}/v1/chat/completions", json={**body, "tools": tools})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"
        time.sleep(1.0)  # stats lines would come every 0.3 s
        log = server.log()
    assert "weights in float16, decode steps eager" in log
    assert "/v1 (context 1000 tokens; " in log  # the start-up line states the context served, as vLLM logs it
    assert "requests that leave them unset get the generation config's max_tokens=2" in log
    assert "--enable-chunked-prefill has no effect here: prefills are always chunked" in log
    assert "--swap-space has no effect here: preempted requests are recomputed" in log
    # the server's own unique id, the answer's id beside it (issue 26.8: the client cannot choose what the log names)
    line = r"request req-[0-9a-f]{32} \(response chatcmpl-\S+\) from 127\.0\.0\.1: "
    line += r"prompt \[\d+(, \d+){4}\] \(\d+ token ids\)"
    assert re.search(line, log)
    assert "HTTP/1.1" not in log and "Avg prompt throughput" not in log, log


def test_the_logs_vllm_users_read_as_a_process(tmp_path):
    """Without the --disable flags, at --log-level info: the access log and the periodic stats lines; requests are
    not logged (--disable-log-requests, the default). And POST /reset_prefix_cache."""
    argv = [BUILTIN, "--port", "0", "--threads", "1", "--num-blocks", "64", "--log-level", "info",
            "--disable-log-requests", "--api-key", "sk-1"]  # fmt: skip
    with serve(tmp_path, *argv, env={"VLLM_LOG_STATS_INTERVAL": "0.3"}) as server:
        headers = {"Authorization": "Bearer sk-1"}
        body = {"model": BUILTIN, "prompt": "The tides come and go twice a day.", "max_tokens": 20}

        def cached() -> int:
            answer = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60).json()
            return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

        # POST /reset_prefix_cache: the request after it misses (and caches its prompt again).
        assert cached() == 0 and cached() > 0
        assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 401
        reset = httpx.post(f"{server.url}/reset_prefix_cache", headers=headers)
        assert reset.status_code == 200 and reset.json()["forgotten_blocks"] > 0
        assert cached() == 0 and cached() > 0
        assert httpx.get(f"{server.url}/openapi.json").status_code == 200
        deadline = time.monotonic() + 30
        while "Avg generation throughput" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = server.log()
    assert '"POST /v1/completions HTTP/1.1" 200' in log
    assert "Avg generation throughput" in log and "Prefix cache hit rate" in log
    assert "request cmpl-" not in log


def _hub_cache(root: Path) -> tuple[Path, str, str]:
    """A Hugging Face cache holding ``pc/tiny`` at two revisions whose generation configs differ."""
    from transformers import GenerationConfig

    from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer

    repo = root / "models--pc--tiny"
    revisions = {"a" * 40: 3, "b" * 40: 5}
    for revision, max_new_tokens in revisions.items():
        context = 128 * max_new_tokens  # the revisions differ in their context too: 384 and 640
        model = builtin_model(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, max_position_embeddings=context
        )
        model.generation_config = GenerationConfig(max_new_tokens=max_new_tokens)
        model.save_pretrained(repo / "snapshots" / revision)
        builtin_tokenizer().save_pretrained(repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    return root, "a" * 40, "b" * 40


def test_hub_loading_flags_as_a_process(tmp_path):
    """--download-dir (the cache), --revision, --tokenizer and the generation config's defaults, offline."""
    cache, _, second = _hub_cache(tmp_path / "cache")
    tokenizer_dir = tmp_path / "tokenizer"
    from pagedcore.adapters.transformers.builtin import builtin_tokenizer

    other = builtin_tokenizer()
    other.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %} ->"
    other.save_pretrained(tokenizer_dir)
    argv = ["pc/tiny", "--port", "0", "--threads", "1", "--num-blocks", "64", "--download-dir", str(cache),
            "--revision", second, "--tokenizer", str(tokenizer_dir)]  # fmt: skip
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-home")}
    with serve(tmp_path, *argv, env=env) as server:
        assert httpx.get(f"{server.url}/tokenizer_info").json()["chat_template"] == other.chat_template
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"] == 640  # revision b
        chat = {"model": "pc/tiny", "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
        usage = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).json()["usage"]
        assert usage["completion_tokens"] == 5  # revision b's generation config: max_new_tokens 5
        log = server.log()
    assert "requests that leave them unset get the generation config's max_tokens=5" in log


def test_the_generation_configs_sources(tmp_path):
    from pagedcore.serve.sampling_defaults import generation_defaults

    cache, first, second = _hub_cache(tmp_path)
    folder = cache / "models--pc--tiny" / "snapshots" / second
    assert generation_defaults("auto", str(folder)) == {"max_tokens": 5}
    assert generation_defaults("auto", "pc/tiny", cache_dir=str(cache), revision=first) == {"max_tokens": 3}
    assert generation_defaults("vllm", str(folder)) == {}
    assert generation_defaults(str(folder), None, {"temperature": 0.5}) == {"max_tokens": 5, "temperature": 0.5}
    with pytest.raises(ValueError, match="do_sample cannot be a request default"):
        generation_defaults("vllm", None, {"do_sample": True})


def test_the_openapi_document_names_the_root_path(one_thread):
    from pagedcore.adapters.transformers import Engine
    from pagedcore.adapters.transformers.testing import tiny_llama
    from pagedcore.serve.app import AppOptions, create_app
    from pagedcore.serve.loop import EngineLoop
    from pagedcore.serve.server import BackgroundServer

    with Engine(tiny_llama(num_hidden_layers=1), num_blocks=16, block_size=8) as engine:
        loop = EngineLoop(engine)
        with BackgroundServer(create_app(loop, model_name="m", options=AppOptions(root_path="/api")), loop) as server:
            document = httpx.get(f"{server.url}/api/openapi.json").json()
            assert document["servers"] == [{"url": "/api"}]
            assert "/v1/responses" in document["paths"] and "/reset_prefix_cache" in document["paths"]


def test_the_yaml_config_file_refuses_what_it_cannot_read(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("- a list\n- not options\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert "expected a mapping of options" in capsys.readouterr().err
    config.write_text(json.dumps({"config": "other.yaml"}))
    assert main(["serve", "--config", str(config)]) == 2
    assert "cannot name another one" in capsys.readouterr().err


def test_ray_replicas_get_the_decode_mode_the_flags_ask_for():
    """Regression: with --ray the replicas' Engines took --compile alone, so --enforce-eager and --cuda-graphs were
    accepted and ignored."""
    import argparse

    from pagedcore.serve import cli
    from pagedcore.serve.ray.command import replica_engine_kwargs

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    modes = {}
    for flags in ([], ["--compile"], ["--no-compile"], ["--enforce-eager"], ["--cuda-graphs"]):
        args = parser.parse_args(["--ray", "--num-blocks", "16", *flags])
        modes[" ".join(flags)] = replica_engine_kwargs(args)["compile"]
    assert modes == {"": "auto", "--compile": True, "--no-compile": False, "--enforce-eager": False,
                     "--cuda-graphs": "cudagraphs"}  # fmt: skip


def test_ray_replicas_get_the_state_pool_flags_and_the_defaults_pass():
    """Regression: with --ray, --state-slots and --snapshot-interval (a recurrent-state model's pool) were accepted
    and never reached the replicas' Engines; the body and shutdown flags at their defaults stay accepted."""
    import argparse

    from pagedcore.serve import cli
    from pagedcore.serve.ray.command import replica_engine_kwargs

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    flags = ["--ray", "--num-blocks", "16", "--state-slots", "8", "--snapshot-interval", "3"]
    args = parser.parse_args([*flags, "--max-request-bytes", "8MiB", "--body-timeout", "30"])
    cli._check(args, ValueError)
    cli._check_ray(args, ValueError)
    kwargs = replica_engine_kwargs(args)
    assert (kwargs["state_slots"], kwargs["snapshot_interval"]) == (8, 3)
    assert replica_engine_kwargs(parser.parse_args(["--ray"]))["state_slots"] is None


@pytest.mark.parametrize(
    "flag", [["--max-request-bytes", "1KiB"], ["--body-timeout", "5"], ["--shutdown-timeout", "0"]]
)
def test_ray_refuses_the_body_and_shutdown_flags_it_does_not_apply(flag):
    """Regression: accepted with --ray and read by nothing there (Ray Serve's proxy reads the bodies, and its
    shutdown does not drain). Checked on the flags, not through main: unrefused, main would start Ray."""
    import argparse

    from pagedcore.serve import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--ray", *flag])
    cli._check(args, ValueError)
    with pytest.raises(ValueError, match=f"{flag[0]} is not supported with --ray yet"):
        cli._check_ray(args, ValueError)


def test_tokenizer_names_the_tokenizer_of_a_checkpoint_saved_without_one(tmp_path, one_thread):
    """Regression (an outside audit): ``serve FOLDER --tokenizer OTHER`` loaded FOLDER's own tokenizer first, so a
    checkpoint saved without one (the reason vLLM has the flag) could not be served at all."""
    from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer
    from pagedcore.cli.common import UsageError
    from pagedcore.serve import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    builtin_model().save_pretrained(tmp_path / "bare")
    builtin_tokenizer().save_pretrained(tmp_path / "tokenizer")
    args = parser.parse_args(
        ["--model", str(tmp_path / "bare"), "--tokenizer", str(tmp_path / "tokenizer"), "--threads", "1"]
    )
    _, tokenizer, name = cli._model(args, UsageError)
    assert name == str(tmp_path / "bare") and tokenizer("Hi").input_ids == builtin_tokenizer()("Hi").input_ids
    with pytest.raises(
        UsageError, match=r"a folder without tokenizer files\? \(serve's --tokenizer PATH names another\)"
    ):
        cli._model(parser.parse_args(["--model", str(tmp_path / "bare"), "--threads", "1"]), UsageError)
