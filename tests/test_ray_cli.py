"""``pagedcore serve --ray``: its argument checks, and a run in a subprocess (its own local Ray cluster) that serves
a completion and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from pagedcore.cli import main

pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--replicas", "2"], "--replicas needs --ray"),
        (["serve", "--routing", "random"], "--routing needs --ray"),
        (["serve", "--ray", "--replicas", "0"], "--replicas must be >= 1, got 0"),
        (["serve", "--ray", "--cpus-per-replica", "0"], "--cpus-per-replica must be > 0"),
        (["serve", "--ray", "--model", "./no-such-model"], "--model './no-such-model': no such folder"),
    ],
)
def test_bad_ray_arguments_exit_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_serve_with_ray_answers_and_stops_cleanly_on_sigterm():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "pagedcore", "serve", "--ray", "--replicas", "2", "--port", str(port)]
    command += ["--cpus-per-replica", "0.5", "--num-blocks", "64", "--threads", "1"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local cluster
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            if "Ctrl-C stops" in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(240), "".join(lines[-20:])
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": "pagedcore-builtin", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
        response = httpx.post(url, json=body, timeout=120)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == 0, "".join(lines[-20:])
        print(f"\nstopped {time.monotonic() - started:.1f} s after SIGTERM")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
