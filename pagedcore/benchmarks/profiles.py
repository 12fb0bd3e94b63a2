"""Profiling scenarios: the workloads of the decode, engine and host benchmarks as plain runs for a sampling
profiler, and a summary of what the profiler saw.

Record a scenario with py-spy (``pip install py-spy``), one torch thread so that all the work is on the sampled
Python thread, then summarize the raw (collapsed-stack) output::

    py-spy record --native --format raw -r 200 -o decode.txt -- \\
        python -m pagedcore.benchmarks.profiles run decode --cache paged-sdpa --context 4096
    python -m pagedcore.benchmarks.profiles summarize decode.txt --within _sample --exclude _prefill

``--within _sample --exclude _prefill`` keeps the samples taken inside ``generate``'s decoding loop but not in its
prefill: the decode steps (for the Engine: ``--within Engine.generate``). Or let torch's profiler time the operators
of the same run: ``... run decode --torch-profile``.

Scenarios: ``decode`` (one sequence: a prompt of ``context - new`` tokens, ``new`` greedy tokens, with a cache of
``--cache``, on the decode benchmark's narrower model by default), ``engine`` (the engine benchmark's 32 requests
sharing a prefix, served by the Engine), ``engine-decode`` (``--seqs`` sequences sharing all but 16 tokens of their
prompts, decoding ``--steps`` steps together up to ``--context`` positions).
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel

from pagedcore.adapters.transformers import PagedKVPool

from . import peers
from .common import BLOCK_SIZE, bench_model, blocks_for, random_tokens
from .decode import narrow_model
from .engine import shared_prefix_workload
from .host import OWN
from .peers import Batch, EnginePeer
from .runner import torch_threads

__all__ = ["ProfileEntry", "main", "summarize_collapsed"]

KINDS = {
    "dynamic": peers.DYNAMIC,
    "static": peers.STATIC,
    "paged-sdpa": peers.PAGED_SDPA,
    "paged-attn": peers.PAGED_ATTN,
}
CACHES = tuple(KINDS)
LIBRARY = ("pagedcore/",)  # the library's folder (its own functions' table); the benchmarks are inside it too


@dataclass(frozen=True)
class ProfileEntry:
    """A function and its share of the samples: ``self_share`` where it is the innermost Python frame (so the time of
    the torch operators it calls counts as its own), ``total_share`` anywhere on the stack.

    Example:
        >>> entry = ProfileEntry("pagedcore/adapters/transformers/sampling.py:sample_rows", 0.072, 0.072)
        >>> entry.function.endswith("sample_rows")
        True
    """

    function: str
    self_share: float
    total_share: float


def _frame_key(frame: str) -> str | None:
    """``file.py:function`` of a py-spy Python frame ``function (path/file.py:line)``; None for a native frame."""
    name, _, where = frame.rpartition(" (")
    path, _, _line = where.rstrip(")").rpartition(":")
    if not path.endswith(".py"):
        return None
    parts = path.split("/")
    if "site-packages" in parts:  # transformers/..., torch/...
        path = "/".join(parts[parts.index("site-packages") + 1 :])
    else:  # pagedcore's source folders, wherever the checkout is
        roots = [i for i, part in enumerate(parts[:-1]) if part + "/" in LIBRARY]
        if roots:  # the innermost: a checkout may itself sit in a folder named pagedcore
            path = "/".join(parts[roots[-1] :])
    return f"{path}:{name}"


def summarize_collapsed(
    lines: Iterable[str], exclude: Sequence[str] = (), within: Sequence[str] = ()
) -> tuple[int, list[ProfileEntry]]:
    """Samples and per-function shares of py-spy's raw output (``frame;frame;... count`` per line, outermost first),
    keeping only the stacks that contain every text of ``within`` and none of ``exclude``; sorted by self share.

    Example:
        >>> raw = ["main (run.py:1);forward (model.py:9);matmul_kernel (libtorch.so) 6",
        ...        "main (run.py:1);update (cache.py:5) 3", "main (run.py:1);_prefill (gen.py:2) 10",
        ...        "main (run.py:1) 1"]
        >>> samples, entries = summarize_collapsed(raw, exclude=["_prefill"])
        >>> samples, [(e.function, e.self_share, e.total_share) for e in entries]
        (10, [('model.py:forward', 0.6, 0.6), ('cache.py:update', 0.3, 0.3), ('run.py:main', 0.1, 1.0)])
        >>> summarize_collapsed(raw, within=["forward ("])[0]
        6
    """
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in lines:
        stack, _, count_text = line.strip().rpartition(" ")
        if not stack or not count_text.isdigit() or any(x in stack for x in exclude):
            continue
        if not all(x in stack for x in within):
            continue
        count = int(count_text)
        samples += count
        keys = [k for k in (_frame_key(f) for f in stack.split(";")) if k is not None]
        if keys:
            own[keys[-1]] += count
        for key in set(keys):
            total[key] += count
    if not samples:
        return 0, []
    entries = [ProfileEntry(k, own[k] / samples, total[k] / samples) for k in total]
    entries.sort(key=lambda e: (-e.self_share, -e.total_share, e.function))
    return samples, entries


def render(samples: int, entries: list[ProfileEntry], top: int) -> str:
    """Markdown: the ``top`` functions by self share, then pagedcore's own functions by total share."""
    lines = [f"{samples} samples", "", "| function | self | total |", "| --- | --- | --- |"]
    lines += [f"| `{e.function}` | {e.self_share:.1%} | {e.total_share:.1%} |" for e in entries[:top]]
    mine = sorted((e for e in entries if e.function.startswith(LIBRARY)), key=lambda e: -e.total_share)
    lines += ["", "pagedcore's own functions by total share:", "", "| function | total | self |", "| --- | --- | --- |"]
    lines += [f"| `{e.function}` | {e.total_share:.1%} | {e.self_share:.1%} |" for e in mine[:top]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- scenarios
def decode_scenario(model: PreTrainedModel, cache_name: str, context: int, new: int, seed: int = 0) -> list[int]:
    """One greedy ``generate`` of ``new`` tokens after a prompt of ``context - new`` tokens, with the cache named
    ``cache_name`` (one of :data:`CACHES`), after a short warm-up call; returns the tokens."""
    prompt = random_tokens(random.Random(seed + 6), context - new, model.config.vocab_size)
    pool = PagedKVPool(model, num_blocks=blocks_for(context) + 2, block_size=BLOCK_SIZE)
    kind = KINDS[cache_name]

    def once(max_new: int, length: int) -> list[int]:
        with kind.cache(model, length, pool) as cache:
            return kind.greedy(model, prompt[: length - max_new], max_new, cache)

    once(4, min(context, 64))
    return once(new, context)


def engine_scenario(model: PreTrainedModel, quick: bool = False, seed: int = 0) -> list[list[int]]:
    """The engine benchmark's requests sharing a prefix, served by one Engine (after a warm-up Engine)."""
    prefix_len, prompts, news, warm = shared_prefix_workload(quick, model.config.vocab_size, seed)
    with EnginePeer(num_blocks=64).session(model) as serve:
        serve(Batch(warm, [2] * len(warm)))
    num_blocks = sum(blocks_for(len(p) + n) for p, n in zip(prompts, news)) + 8
    with EnginePeer(num_blocks=num_blocks, budget=prefix_len, max_seqs=len(prompts)).session(model) as serve:
        return serve(Batch(prompts, news)).tokens


def engine_decode_scenario(model: PreTrainedModel, seqs: int, context: int, steps: int, seed: int = 0) -> int:
    """``seqs`` sequences whose prompts of ``context - steps`` tokens share all but their last 16 (computed once
    first) decode ``steps`` steps together in one Engine, up to ``context`` positions; returns the Engine's step
    count."""
    if context - steps <= OWN:
        raise ValueError(f"a context of {context} leaves no shared prompt before {steps} steps and {OWN} own tokens")
    rng = random.Random(seed + 8)
    vocab = model.config.vocab_size
    shared = random_tokens(rng, context - steps - OWN, vocab)
    room = blocks_for(context) + seqs * blocks_for(OWN + steps) + 8
    with EnginePeer(num_blocks=room, budget=max(512, seqs), max_seqs=seqs).session(model) as serve:
        first = serve(Batch([shared + random_tokens(rng, OWN, vocab)], [2]))
        prompts = [shared + random_tokens(rng, OWN, vocab) for _ in range(seqs)]
        return (first.steps or 0) + (serve(Batch(prompts, [steps] * seqs)).steps or 0)


def _torch_profile(fn: Callable[[], object], top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return str(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedcore.benchmarks.profiles run SCENARIO ...`` or ``... summarize RAW [--exclude X]``.

    Example:
        >>> main(["run", "decode", "--model-size", "tiny", "--context", "64", "--new", "4"])
        decode: 4 tokens
        0
    """
    parser = argparse.ArgumentParser(prog="python -m pagedcore.benchmarks.profiles", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a scenario (under a profiler)")
    run.add_argument("scenario", choices=["decode", "engine", "engine-decode"])
    run.add_argument("--model-size", default="small", help="tiny, small or 1b (default: small)")
    run.add_argument("--full-model", action="store_true", help="decode: the model itself, not its narrower variant")
    run.add_argument("--cache", default="paged-sdpa", choices=CACHES)
    run.add_argument("--context", type=int, default=None, help="decode: 512; engine-decode: 512")
    run.add_argument("--new", type=int, default=128, help="decode: new tokens (default 128)")
    run.add_argument("--seqs", type=int, default=64, help="engine-decode: sequences (default 64)")
    run.add_argument("--steps", type=int, default=48, help="engine-decode: decode steps (default 48)")
    run.add_argument("--quick", action="store_true", help="engine: the quick workload")
    run.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    run.add_argument("--torch-profile", action="store_true", help="print torch.profiler's operator table")
    summ = sub.add_parser("summarize", help="summarize py-spy's raw output")
    summ.add_argument("raw", type=Path)
    summ.add_argument("--exclude", action="append", default=[], help="leave out stacks with this frame text")
    summ.add_argument("--within", action="append", default=[], help="keep only stacks with this frame text")
    summ.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    if args.command == "summarize":
        samples, entries = summarize_collapsed(args.raw.read_text().splitlines(), args.exclude, args.within)
        print(render(samples, entries, args.top))
        return 0
    with torch_threads(args.threads):
        model = bench_model(size=args.model_size)
        context = args.context or 512
        fn: Callable[[], str]
        if args.scenario == "decode":
            model = model if args.full_model else narrow_model(model)
            fn = lambda: f"decode: {len(decode_scenario(model, args.cache, context, args.new))} tokens"  # noqa: E731
        elif args.scenario == "engine":
            fn = lambda: f"engine: {len(engine_scenario(model, args.quick))} requests"  # noqa: E731
        else:
            fn = lambda: f"engine-decode: {engine_decode_scenario(model, args.seqs, context, args.steps)} steps"  # noqa: E731
        if args.torch_profile:
            print(_torch_profile(fn, 25))
        else:
            print(fn())
    return 0


if __name__ == "__main__":
    sys.exit(main())
