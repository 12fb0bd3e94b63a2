"""A prefix cache larger than the pool (issue 22): multi-turn chat whose working set is 4x the pool, and a restart.

Needs: the `transformers` extra (`make demo` installs it).

Chat: ``--conversations`` conversations, each with its own ``--prefix``-token context (a document, few-shot
examples), take ``--turns`` turns round-robin (turn 1 of every conversation, then turn 2, ...); each turn's prompt is
the whole conversation so far plus a new ``--message``, answered with ``--reply`` greedy tokens, one request at a
time. The pool holds a quarter of the conversations, so LRU evicts a conversation before its next turn. Side by
side, in one run, on one model:

- recompute: that pool alone (what was evicted is computed again);
- disk tier: the same pool with ``kv_store=`` a temporary directory (evicted blocks written down, loaded back);
- 4x pool: a pool that holds every conversation (the upper bound).

TTFT (arrival to first token, the Engine's own metrics) p50/p99 and prompt tokens computed, over the turns after
the first (turn 1 is cold for all three). The replies of the three must be identical (greedy, same model).

Restart: a ``--restart-prefix``-token prompt served by one Engine, which closes (writing its cached blocks); then
the TTFT of the same prompt on a new Engine (new pool) with the same directory vs a cold one without it.

    python examples/bench_kv_store.py [--model-size small] [--conversations 32] [--turns 3] [--prefix 1024]
    python examples/bench_kv_store.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedcore.adapters.transformers import Engine
from pagedcore.benchmarks.options import MODEL_SIZES

BLOCK = 16


@dataclass
class Trial:
    """One configuration's figures."""

    name: str
    ttft: list[float] = field(default_factory=list)  # turns after the first
    computed: int = 0  # prompt tokens computed, turns after the first
    replies: list[list[int]] = field(default_factory=list)
    host_ms_per_step: float = 0.0
    loaded_tokens: int = 0
    written_blocks: int = 0
    skipped: int = 0
    seconds: float = 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def build_model(size: str, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(**MODEL_SIZES[size], tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def conversation_tokens(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    g = torch.Generator().manual_seed(1)
    contexts = [torch.randint(3, vocab, (args.prefix,), generator=g).tolist() for _ in range(args.conversations)]
    messages = [
        [torch.randint(3, vocab, (args.message,), generator=g).tolist() for _ in range(args.turns)]
        for _ in range(args.conversations)
    ]
    return contexts, messages


def history_tokens(args: argparse.Namespace) -> int:
    return args.prefix + args.turns * (args.message + args.reply)


def run_chat(model: Any, args: argparse.Namespace, name: str, num_blocks: int, store: str | None) -> Trial:
    contexts, messages = conversation_tokens(args, model.config.vocab_size)
    kw: dict[str, Any] = {} if store is None else {"kv_store": store, "kv_store_bytes": "64GiB"}
    trial = Trial(name)
    history = [list(c) for c in contexts]
    started = time.perf_counter()
    with Engine(model, num_blocks=num_blocks, block_size=BLOCK, max_num_batched_tokens=2048, **kw) as engine:
        for turn in range(args.turns):
            for conv in range(args.conversations):
                prompt = history[conv] + messages[conv][turn]
                before = engine.stats().prompt_tokens_computed
                out = engine.generate([prompt], max_new_tokens=args.reply, do_sample=False, use_tqdm=False)[0]
                history[conv] = prompt + out.token_ids
                trial.replies.append(out.token_ids)
                if turn > 0:
                    assert out.metrics.time_to_first_token is not None
                    trial.ttft.append(out.metrics.time_to_first_token)
                    trial.computed += engine.stats().prompt_tokens_computed - before
        stats = engine.stats()
        trial.host_ms_per_step = 1000 * stats.host_seconds / max(1, stats.num_steps)
        if engine.pool.tiers is not None:
            engine.pool.tiers.flush(120)
            stats = engine.stats()
            trial.loaded_tokens, trial.written_blocks = stats.kv_store_loaded_tokens, stats.kv_store_written_blocks
            trial.skipped = stats.kv_store_writes_skipped
    trial.seconds = time.perf_counter() - started
    return trial


def restart_ttft(model: Any, args: argparse.Namespace, directory: str) -> tuple[float, float, bool]:
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, model.config.vocab_size, (args.restart_prefix,), generator=g).tolist()
    blocks = -(-(args.restart_prefix + 8) // BLOCK) + 4
    store = {"kv_store": directory, "kv_store_bytes": "64GiB"}
    with Engine(model, num_blocks=blocks, block_size=BLOCK, max_num_batched_tokens=4096, **store) as engine:
        first = engine.generate([prompt], max_new_tokens=2, do_sample=False, use_tqdm=False)[0].token_ids
    ttft, same = {}, True
    for label, kw in (("cold", {}), ("store", store)):
        with Engine(model, num_blocks=blocks, block_size=BLOCK, max_num_batched_tokens=4096, **kw) as engine:
            out = engine.generate([prompt], max_new_tokens=2, do_sample=False, use_tqdm=False)[0]
            assert out.metrics.time_to_first_token is not None
            ttft[label] = out.metrics.time_to_first_token
            same = same and out.token_ids == first  # the cold run's tokens and the loaded run's
    return ttft["store"], ttft["cold"], same


def report(trials: list[Trial], restart: tuple[float, float, bool], args: argparse.Namespace, params: int) -> None:
    base = {t.name: t for t in trials}
    recompute, disk, big = base["recompute"], base["disk tier"], base["4x pool"]
    print(
        f"model: Llama {args.model_size} ({params / 1e6:.0f}M parameters, fp32, {torch.get_num_threads()} threads); "
        f"{args.conversations} conversations x {args.turns} turns, {args.prefix}-token contexts, "
        f"{args.message}-token messages, {args.reply}-token replies; load average before: {args.load_before}"
    )
    print("config       | TTFT p50 ms | TTFT p99 ms | prompt tokens computed | loaded tokens | host ms/step | run s")
    for t in trials:
        print(
            f"{t.name:<12} | {1000 * statistics.median(t.ttft):11.1f} | {1000 * percentile(t.ttft, 0.99):11.1f} | "
            f"{t.computed:22d} | {t.loaded_tokens:13d} | {t.host_ms_per_step:12.2f} | {t.seconds:5.1f}"
        )
    p50 = {t.name: statistics.median(t.ttft) for t in trials}
    print(
        f"median TTFT: recompute / disk tier = {p50['recompute'] / p50['disk tier']:.2f}x; "
        f"disk tier / 4x pool = {p50['disk tier'] / p50['4x pool']:.2f}x; "
        f"prompt tokens computed: disk tier / recompute = {disk.computed / max(1, recompute.computed):.3f}"
    )
    print(
        f"disk tier: {disk.written_blocks} blocks written, {disk.skipped} skipped (queue full); replies identical "
        f"to recompute and 4x pool: {disk.replies == recompute.replies == big.replies}"
    )
    store, cold, same = restart
    print(
        f"restart, {args.restart_prefix}-token prefix seen before: TTFT {1000 * store:.1f} ms from the store vs "
        f"{1000 * cold:.1f} ms cold ({cold / store:.2f}x); same tokens: {same}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-size", default="small", choices=sorted(MODEL_SIZES))
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--message", type=int, default=32)
    parser.add_argument("--reply", type=int, default=8)
    parser.add_argument("--restart-prefix", type=int, default=2048)
    parser.add_argument("--quick", action="store_true", help="the tiny model and a small workload (seconds)")
    args = parser.parse_args(argv)
    if args.quick:
        args.model_size, args.conversations, args.turns, args.prefix = "tiny", 8, 2, 64
        args.message, args.reply, args.restart_prefix = 8, 4, 128
    args.load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    model = build_model(args.model_size)
    params = sum(p.numel() for p in model.parameters())
    per_conversation = -(-history_tokens(args) // BLOCK) + 1
    small = max(per_conversation + 2, args.conversations * per_conversation // 4)
    trials = []
    with tempfile.TemporaryDirectory() as directory:
        for name, blocks, store in (
            ("recompute", small, None),
            ("disk tier", small, directory),
            ("4x pool", 4 * small + 8, None),
        ):
            trials.append(run_chat(model, args, name, blocks, store))
    with tempfile.TemporaryDirectory() as directory:
        restart = restart_ttft(model, args, directory)
    report(trials, restart, args, params)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
