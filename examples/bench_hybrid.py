"""Hybrid models (recurrent-state layers beside attention) under pagedcore: prefix caching that hits, memory, and what a
state snapshot costs. Side by side in one run, on one machine; random weights, nothing downloaded.

Needs: the `transformers` extra (`make demo` installs it).

Sections:

- ``system-prompt``: vLLM issue #40696's case on a model built like Qwen3.5 (three Gated DeltaNet linear-attention
  layers to one full-attention layer; ``--model-size small``: hidden 512, 8 layers). A ``--system``-token shared system
  prompt and ``--questions`` questions of ``--question`` tokens, one ``generate`` each (greedy): plain ``generate``
  (``DynamicCache``) against ``enable()`` on a copy of the model with the same weights. Prefill tokens computed
  against the unique tokens (vLLM: every token, 0% hits), time to first token (``max_new_tokens=1``) of the questions
  after the first, and the answers (``--answer`` tokens) compared token for token.
- ``memory``: a left-padded batch of ``--rows`` prompts of mixed lengths; the KV + state memory ``PagedCache`` holds
  and ``DynamicCache`` holds, each against what the real tokens and the rows' states need.
- ``snapshots``: per family (the test suite's tiny configs, and the bench model): bytes of one snapshot (one state
  slot: every recurrent state of the model), bytes per cached token at one snapshot per block, the keys and values of
  one token for comparison, and the time to take one (the copy of a slot the next write makes); with ``--published``,
  the bytes of a snapshot at each family's published default size (read off a meta-device forward, nothing built).

    python examples/bench_hybrid.py [--model-size small] [--system 480] [--questions 16] [--question 24]
    python examples/bench_hybrid.py --quick
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from pagedcore.adapters.transformers import PagedCache, PagedKVPool, disable, enable
from pagedcore.adapters.transformers.state_spec import StateSpec, probe_states, state_bytes
from pagedcore.benchmarks.hybrid import hybrid_config as bench_hybrid_config
from pagedcore.benchmarks.options import MODEL_SIZES

BLOCK = 16


def hybrid_config(size: str) -> Any:
    """A Qwen3.5-text config of ``--model-size``'s shapes: layers linear, linear, linear, full, repeated (the
    ``pagedcore bench --only hybrid`` model's)."""
    return bench_hybrid_config(MODEL_SIZES[size])


def build(size: str) -> Any:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hybrid_config(size)).eval()


class TokenCounter:
    """Counts the positions a model's forwards compute (a forward pre-hook)."""

    def __init__(self, model: Any) -> None:
        self.count = 0
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor):
            self.count += ids.shape[0] * ids.shape[1]


def timed(fn: Any) -> tuple[float, float]:
    """``(wall seconds, this thread's CPU seconds)`` of ``fn()``: with torch on one thread the forwards run in this
    thread, so the CPU time is the work done, whatever else the machine runs."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def system_prompt(args: argparse.Namespace, interval: int) -> dict[str, Any]:
    plain = build(args.model_size)
    cached = copy.deepcopy(plain)
    pool = enable(cached, block_size=BLOCK, num_blocks=4096, state_slots=args.state_slots, snapshot_interval=interval)
    counter = TokenCounter(cached)
    gen = torch.Generator().manual_seed(1)
    vocab = plain.config.vocab_size
    system = torch.randint(3, vocab, (1, args.system), generator=gen)
    prompts = [
        torch.cat([system, torch.randint(3, vocab, (1, args.question), generator=gen)], 1)
        for _ in range(args.questions)
    ]
    rows, same = [], True
    for i, prompt in enumerate(prompts):
        before, hit_before = counter.count, pool.num_hit_tokens
        t_cached = timed(lambda p=prompt: cached.generate(p, max_new_tokens=1, do_sample=False))
        computed, hit = counter.count - before, pool.num_hit_tokens - hit_before
        t_plain = timed(lambda p=prompt: plain.generate(p, max_new_tokens=1, do_sample=False))
        if i < args.check:  # the answers, token for token
            want = plain.generate(prompt, max_new_tokens=args.answer, do_sample=False)
            same &= torch.equal(cached.generate(prompt, max_new_tokens=args.answer, do_sample=False), want)
        rows.append({"question": i + 1, "plain_s": t_plain, "enable_s": t_cached, "computed": computed, "hit": hit})
    unique = args.system + args.questions * args.question
    later = rows[1:]
    ttft_plain = [statistics.median(r["plain_s"][c] for r in later) for c in (0, 1)]
    ttft_cached = [statistics.median(r["enable_s"][c] for r in later) for c in (0, 1)]
    stats = pool.memory_stats()
    disable(cached)
    return {
        "interval": interval,
        "rows": rows,
        "unique": unique,
        "computed": sum(r["computed"] for r in rows),
        "ttft_plain": ttft_plain,
        "ttft_enable": ttft_cached,
        "first": (rows[0]["plain_s"], rows[0]["enable_s"]),
        "same": same,
        "snapshots": stats.snapshots,
        "snapshot_bytes": stats.state_cached_bytes + stats.state_used_bytes,
        "kv_cached_bytes": stats.cached_bytes,
    }


def memory(args: argparse.Namespace) -> dict[str, Any]:
    model = build(args.model_size)
    lengths = [
        args.memory_shortest + i * (args.memory_longest - args.memory_shortest) // max(1, args.rows - 1)
        for i in range(args.rows)
    ]
    width = max(lengths)
    ids = torch.randint(3, model.config.vocab_size, (len(lengths), width), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    for r, n in enumerate(lengths):
        ids[r, : width - n] = 0
        mask[r, : width - n] = 0
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": args.memory_new, "do_sample": False}
    cache = PagedCache(model, block_size=BLOCK, num_blocks=sum(-(-(n + args.memory_new) // BLOCK) for n in lengths) + 8)
    paged_out = model.generate(cache=cache, **kwargs)
    stock = DynamicCache(config=model.config)
    stock_out = model.generate(cache=stock, **kwargs)
    stats = cache.memory_stats()
    slot = cache.pool.states.slot_nbytes()
    need = stats.token_bytes + len(lengths) * slot  # the real tokens' keys and values, one state per row
    paged = stats.held_bytes + stats.state_bytes
    dynamic = 0
    for layer in stock.layers:
        for tensor in [getattr(layer, "keys", None), getattr(layer, "values", None)]:
            if isinstance(tensor, torch.Tensor):
                dynamic += tensor.numel() * tensor.element_size()
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            dynamic += sum(t.numel() * t.element_size() for t in states.values() if isinstance(t, torch.Tensor))
    cache.release()
    return {
        "lengths": lengths,
        "need": need,
        "paged": paged,
        "dynamic": dynamic,
        "same": torch.equal(paged_out, stock_out),
    }


def snapshot_cost(model: Any, repeats: int) -> dict[str, Any]:
    """One family's snapshot: its bytes, bytes per cached token (one per block), KV bytes per token, copy time."""
    pool = PagedKVPool(model, num_blocks=16, block_size=BLOCK, state_slots=4)
    cache = PagedCache(model, pool=pool)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]), cache=cache)  # makes the state tensors
    states = pool.states
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        states.apply([(0, 1)])  # what taking a snapshot costs: the next write copies the slot
        times.append(time.perf_counter() - start)
    cache.release()
    slot = states.slot_nbytes()
    kv_token = sum(pool.block_bytes(g.index) for g in pool.kv.groups) // BLOCK
    return {"slot": slot, "per_token": slot / BLOCK, "kv_token": kv_token, "copy_us": statistics.median(times) * 1e6}


def snapshots(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from hybrid_models import HYBRID_FAMILIES, hybrid_model

    out = [(f"bench model ({args.model_size})", snapshot_cost(build(args.model_size), args.repeats))]
    for family in HYBRID_FAMILIES:
        out.append((f"{family} (tiny)", snapshot_cost(hybrid_model(family), args.repeats)))
    return out


PUBLISHED = ("qwen3_5_text", "lfm2", "bamba", "falcon_h1", "mamba2", "zamba2", "olmo_hybrid")


def published() -> list[tuple[str, int | None]]:
    """Bytes of one snapshot at each family's default config (bfloat16 model), read off a meta forward."""
    out: list[tuple[str, int | None]] = []
    for model_type in PUBLISHED:
        config = AutoConfig.for_model(model_type)
        if model_type == "lfm2":
            config = AutoConfig.for_model(model_type, full_attn_idxs=[2, 5, 8, 10, 12, 14])
        shapes = probe_states(config, StateSpec.from_config(config), torch.bfloat16)
        out.append((model_type, None if not shapes else state_bytes(shapes)))
    return out


def report(
    args: argparse.Namespace, sps: list[dict[str, Any]], mem: dict[str, Any], snaps: list[tuple[str, dict[str, Any]]]
) -> None:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    threads = torch.get_num_threads()
    print(f"# hybrid models: {args.model_size} Qwen3.5-like model, CPU, {threads} threads, load {load:.1f}")
    for sp in sps:
        spacing = sp["interval"] * BLOCK
        print(
            f"\n## system prompt ({args.system} tokens) + {args.questions} questions of {args.question} tokens, "
            f"a snapshot every {sp['interval']} block(s) ({spacing} tokens)"
        )
        ratio = sp["computed"] / sp["unique"]
        print(f"prefill tokens computed: {sp['computed']} / unique {sp['unique']} = {ratio:.3f}x")
        print(f"hits per question after the first: {sorted({r['hit'] for r in sp['rows'][1:]})} tokens")
        for clock, name in ((0, "wall"), (1, "CPU")):
            plain, cached = sp["ttft_plain"][clock], sp["ttft_enable"][clock]
            print(
                f"time to first token ({name}), questions 2-{args.questions} (median): plain {plain * 1e3:.1f} ms, "
                f"enable {cached * 1e3:.1f} ms: {plain / cached:.1f}x faster"
            )
        first_plain, first_enable = sp["first"]
        print(
            f"first question (CPU): plain {first_plain[1] * 1e3:.1f} ms, enable {first_enable[1] * 1e3:.1f} ms "
            "(its snapshots taken)"
        )
        print(f"answers identical to plain generate: {sp['same']}")
        kept, kv = sp["snapshot_bytes"] / 2**20, sp["kv_cached_bytes"] / 2**20
        print(f"snapshots kept: {sp['snapshots']} ({kept:.1f} MiB); cached keys and values {kv:.2f} MiB")
    print(f"\n## memory: {len(mem['lengths'])} rows of {mem['lengths'][0]}..{mem['lengths'][-1]} tokens, left-padded")
    print(f"needed (real tokens' KV + one state per row): {mem['need'] / 2**20:.2f} MiB")
    print(f"PagedCache: {mem['paged'] / 2**20:.2f} MiB = {mem['paged'] / mem['need']:.3f}x")
    print(f"DynamicCache: {mem['dynamic'] / 2**20:.2f} MiB = {mem['dynamic'] / mem['need']:.3f}x (stores the padding)")
    print(f"same tokens: {mem['same']}")
    print(f"\n## snapshot cost (block {BLOCK}, one snapshot per block)")
    print("| family | bytes / snapshot | bytes / cached token | KV bytes / token | time to take one |")
    print("|---|---:|---:|---:|---:|")
    for name, s in snaps:
        print(f"| {name} | {s['slot']:,} | {s['per_token']:,.0f} | {s['kv_token']:,} | {s['copy_us']:.1f} µs |")
    if args.published:
        print("\n## bytes of one snapshot at the published default sizes (bfloat16)")
        for name, size in published():
            print(f"- {name}: {'meta forward failed' if size is None else f'{size / 2**20:.1f} MiB'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-size", default="small", choices=sorted(MODEL_SIZES))
    parser.add_argument("--system", type=int, default=480)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--question", type=int, default=24)
    parser.add_argument("--answer", type=int, default=8)
    parser.add_argument("--check", type=int, default=4, help="questions whose answers are compared")
    parser.add_argument("--state-slots", type=int, default=256)
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 2], help="snapshot intervals (blocks)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--memory-shortest", type=int, default=64)
    parser.add_argument("--memory-longest", type=int, default=512)
    parser.add_argument("--memory-new", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--published", action="store_true", help="snapshot bytes at the families' published sizes")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny model, short prompts (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.model_size, args.system, args.questions, args.question, args.check = "tiny", 48, 3, 8, 2
        args.rows, args.memory_shortest, args.memory_longest, args.memory_new, args.repeats = 3, 8, 40, 4, 3
    torch.set_num_threads(args.threads)
    sps = [system_prompt(args, interval) for interval in args.intervals]
    mem = memory(args)
    snaps = snapshots(args)
    report(args, sps, mem, snaps)
    return 0 if all(sp["same"] for sp in sps) and mem["same"] else 1


if __name__ == "__main__":
    sys.exit(main())
