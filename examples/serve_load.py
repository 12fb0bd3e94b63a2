"""A bounded load run of `pagedcore serve` on the built-in model: loopback only, stops by itself.

Needs: the `serve` extra and httpx (`pip install 'pagedcore[serve]' httpx`; both in `all`).

N concurrent clients share a fixed number of streaming /v1/completions requests (one system prompt, a different
question each, greedy, a fixed number of new tokens); the report gives requests/s, generated tokens/s, p50/p99
latency and time to first token. With --against-transformers the same workload runs against `transformers serve`
on the same model (saved with save_pretrained to a temporary directory, loaded offline), without and with its
--continuous-batching.

python examples/serve_load.py [--requests 64] [--concurrency 16] [--max-tokens 32] [--against-transformers]
                              [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx
import torch

from pagedcore.adapters.transformers import Engine
from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer
from pagedcore.serve.app import create_app
from pagedcore.serve.loop import EngineLoop
from pagedcore.serve.server import BackgroundServer

NAME = "pagedcore-builtin"
SYSTEM = (
    "You are the help desk of a public library. Answer in one short sentence, politely, and point to the right "
    "desk when a question needs staff.\n"
)
TOPICS = ["opening hours", "late fees", "printing", "wifi", "e-books", "study rooms", "membership", "parking"]


@dataclass
class Result:
    latency: float
    ttft: float
    tokens: int


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return Result(end - started, (first or end) - started, tokens)


async def drive(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[list, float]:
    """Run every prompt with ``concurrency`` clients; returns the results and the wall time."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                results.append(await _one(client, url, model, queue.get_nowait(), max_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - started


def report(name: str, results: list[Result], wall: float) -> dict[str, float | str]:
    latencies = sorted(r.latency for r in results)
    ttfts = sorted(r.ttft for r in results)
    return {
        "server": name,
        "requests": len(results),
        "requests_per_s": round(len(results) / wall, 2),
        "tokens_per_s": round(sum(r.tokens for r in results) / wall, 1),
        "latency_p50_s": round(_quantile(latencies, 0.5), 3),
        "latency_p99_s": round(_quantile(latencies, 0.99), 3),
        "ttft_p50_s": round(_quantile(ttfts, 0.5), 3),
        "ttft_p99_s": round(_quantile(ttfts, 0.99), 3),
        "wall_s": round(wall, 2),
    }


def _quantile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1] if q < 1 else values[-1]


def run_pagedcore(prompts: list[str], args: argparse.Namespace) -> dict[str, float | str]:
    model, tokenizer = builtin_model(), builtin_tokenizer()
    with Engine(model, tokenizer, max_num_seqs=args.concurrency, max_num_batched_tokens=512) as engine:
        loop = EngineLoop(engine, max_queue=max(args.requests, 1))
        with BackgroundServer(create_app(loop, model_name=NAME), loop) as server:
            asyncio.run(drive(server.url, NAME, prompts[:1], 1, 2))  # warm-up
            results, wall = asyncio.run(drive(server.url, NAME, prompts, args.concurrency, args.max_tokens))
            stats = loop.stats.engine
    row = report("pagedcore serve", results, wall)
    row["prefix_hit_rate"] = round(stats.prefix_hit_rate, 3)
    return row


def run_transformers(prompts: list[str], args: argparse.Namespace, continuous: bool) -> dict[str, float | str]:
    """The same workload against `transformers serve` in a subprocess, offline, on the same saved model."""
    with tempfile.TemporaryDirectory() as tmp:
        builtin_model().save_pretrained(tmp)
        builtin_tokenizer().save_pretrained(tmp)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        command = [sys.executable, "-c", "from transformers.cli.transformers import main; main()", "serve", tmp]
        command += ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
        command += ["--continuous-batching"] if continuous else []
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        if args.threads is not None:
            env["OMP_NUM_THREADS"] = str(args.threads)  # torch's intra-op threads in the subprocess
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, process)
            asyncio.run(drive(url, tmp, prompts[:1], 1, 2))  # warm-up (and loads the model)
            results, wall = asyncio.run(drive(url, tmp, prompts, args.concurrency, args.max_tokens))
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
    return report("transformers serve" + (" --continuous-batching" if continuous else ""), results, wall)


def _wait_healthy(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"transformers serve exited: {process.stderr.read() if process.stderr else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("transformers serve did not become healthy")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--against-transformers", action="store_true", help="also run `transformers serve`")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of every server (default: torch's)")
    parser.add_argument("--json", action="store_true", help="one JSON object per server")
    parser.add_argument("--quick", action="store_true", help="8 requests, 4 clients, 4 new tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.concurrency, args.max_tokens = 8, 4, 4
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        parser.error("--requests, --concurrency and --max-tokens must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    prompts = [f"{SYSTEM}Question {i}: what about {TOPICS[i % len(TOPICS)]}?\nAnswer:" for i in range(args.requests)]
    rows = [run_pagedcore(prompts, args)]
    if args.against_transformers:
        for continuous in (False, True):
            try:
                rows.append(run_transformers(prompts, args, continuous))
            except Exception as exc:  # report why the peer could not run, keep our figures
                rows.append({"server": "transformers serve", "error": f"{type(exc).__name__}: {exc}"})
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(
        f"{args.requests} requests, {args.concurrency} concurrent clients, {args.max_tokens} new tokens each, "
        "greedy, streaming, loopback"
    )
    for row in rows:
        print("  " + ", ".join(f"{key}={value}" for key, value in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
