"""The Engine's host stages per decode step, medians: what `pagedcore bench`'s section 8 splits, without its peers, for
comparing two checkouts of pagedcore (issue 33.3, host work per step).

``N`` sequences share a ``context - 48``-token prefix (464 at the default ``--context 512``, as section 8's prompts of
``context - 32`` tokens) (computed once by an earlier request, then served by the prefix cache) and
have 16 own prompt tokens; after their prefills, ``--steps`` decode steps are timed. Per step: the Engine's own
``stage_seconds()`` (schedule / prepare / sample / record, wall) read around ``step()``, the step's thread CPU
time less its forward's (the host work's CPU time: the machine's other load is left out), and the whole step's wall
time (forward included). With the model (``--forward model``) also ``host``: section 8's host time, from the end of
a step's model forward to the start of the next one's (hooks on its embedding and head: ``forward_edges``), which
also counts what the runner does around the model call (its input tensors, the dropout check) and the step's locks.
Prints medians.

A process's host figures move by ±15% from one run to the next on a 2-core VM (where its memory lands), far more
than one optimisation changes them, so compare two checkouts by alternating processes, several rounds:

    for r in 1 2 3 4; do for tree in /path/to/before /path/to/after; do
      PYTHONPATH=$tree OMP_NUM_THREADS=1 python scripts/host_stages.py --size small --rows 256; done; done

(``PYTHONPATH`` puts that checkout's ``pagedcore`` ahead of the installed one; check with ``--where``.) Rounds one
after the other still differ by the machine's load at the time; ``--pair BEFORE,AFTER --rounds 4`` runs the two
checkouts at once, each process on its own core, swapping the cores every round, so each round's pair shares the
machine's noise (docs/benchmarks.md, "What the host step is made of").

``--forward`` replaces the model's forward, to tell the host's own work apart from what the forward leaves it:
``stream`` streams 64 MiB through the caches (as a forward streams its weights) and returns random logits of the
model's vocabulary (the step's host work as with the model, in a fraction of the time: quicker A/B rounds);
``stream-small`` does the same but returns 8 logits per row (the bookkeeping without the full-vocabulary logits pass
and the caches it evicts); ``none`` returns the 8 logits and streams nothing (every object the host touches stays
in the caches). The tokens are then the fake logits' argmax: only the host's work is measured.

``--checks`` (with the model) also times, per step, what the runner and the direct layers check of the model before
its forward computes, in place (the caches as the previous forward left them): the decode tape's module and
weight checks (``decode_tape._calls_hold``) and its pointer patching (``Tapes._patch``), the dropout check
(``generate_call.draws_dropout``, with ``WeightsWatch.modules`` where it reads the watch's list), the direct layers'
(``DirectLayers.serves``) and the weights watch
(``runner.check_weights``); ms per step, medians (0 where a piece did not run).

``--tokenizer`` gives the Engine a byte-level BPE tokenizer of the model's vocabulary
(:func:`~pagedcore.benchmarks.common.bench_tokenizer`): every running sequence's text is then decoded token by token,
as a served request's is (without one there is no text to decode).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import pagedcore
from pagedcore.adapters.transformers import Engine, SamplingParams, decode_tape
from pagedcore.adapters.transformers import runner as runner_module
from pagedcore.adapters.transformers.weights import WeightsWatch
from pagedcore.benchmarks.common import BLOCK_SIZE, bench_model, bench_tokenizer
from pagedcore.benchmarks.steps import forward_edges

STAGES = ("schedule", "prepare", "sample", "record")
OWN = 16  # each sequence's own prompt tokens; the rest of its ``context - 32``-token prompt is shared


FORWARDS = ("model", "stream", "stream-small", "none")
STREAMED_BYTES = 64 << 20


CHECKS = ("hold", "patch", "dropout", "serves", "weights")


def _timing_checks(engine: Engine) -> dict[str, float]:
    """Wraps each of :data:`CHECKS` (module docstring, ``--checks``) to add its seconds to the returned dict (after
    the first decode steps: the tapes are made by then)."""
    spent = dict.fromkeys(CHECKS, 0.0)

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - started

        return call

    runner, direct = engine.runner, engine.runner._direct  # noqa: SLF001
    decode_tape._calls_hold = timed("hold", decode_tape._calls_hold)  # type: ignore[assignment]  # noqa: SLF001
    runner_module.draws_dropout = timed("dropout", runner_module.draws_dropout)  # type: ignore[assignment]
    if hasattr(WeightsWatch, "modules"):  # the watch's modules, which the dropout check reads: timed as part of it
        WeightsWatch.modules = timed("dropout", WeightsWatch.modules)  # type: ignore[method-assign]
    runner.check_weights = timed("weights", runner.check_weights)  # type: ignore[method-assign]
    if direct is not None:
        direct.serves = timed("serves", direct.serves)  # type: ignore[method-assign]
        if isinstance(direct.tapes, decode_tape.Tapes):
            direct.tapes._patch = timed("patch", direct.tapes._patch)  # type: ignore[method-assign]  # noqa: SLF001
    return spent


def measure(
    size: str,
    rows: int,
    steps: int,
    seed: int = 0,
    forward: str = "model",
    tokenizer: bool = False,
    context: int = 512,
    checks: bool = False,
) -> dict[str, float]:
    """Median ms per decode step of each host stage, their sum, the host CPU time (step CPU less forward CPU) and the
    whole step's wall time;
    ``forward`` is one of :data:`FORWARDS`, ``tokenizer`` decodes the texts, ``checks`` times :data:`CHECKS` (module
    docstring)."""
    if forward not in FORWARDS:
        raise ValueError(f"forward must be one of {FORWARDS}, got {forward!r}")
    model = bench_model(size=size)
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(context - 32 - OWN)]
    own_blocks = -(-(OWN + steps + 20) // BLOCK_SIZE) + 1  # its own tokens' blocks, and one copied on write
    blocks = -(-len(shared) // BLOCK_SIZE) + 64 + rows * max(6, own_blocks)  # every sequence runs to the end
    engine = Engine(model, tokenizer=bench_tokenizer(vocab) if tokenizer else None, num_blocks=blocks,
                    block_size=BLOCK_SIZE, max_num_batched_tokens=512, max_num_seqs=rows)  # fmt: skip
    engine.generate([shared + [1] * OWN], SamplingParams(max_new_tokens=2, ignore_eos=True), use_tqdm=False)
    longest = model.config.max_position_embeddings - (context - 32)  # the new tokens the model's context leaves
    if steps + 8 > longest:
        raise SystemExit(f"--steps {steps} at --context {context}: at most {longest - 8} (the model's context)")
    params = SamplingParams(max_new_tokens=min(steps + 20, longest), ignore_eos=True)
    for _ in range(rows):
        engine.add_request(shared + [rng.randrange(vocab) for _ in range(OWN)], params)
    for _ in range(-(-rows * 2 * OWN // 512) + 3):  # the prefills, and a few decode steps
        engine.step()
    forward_cpu = [0.0]
    execute = engine.runner.execute if forward == "model" else _fake_forward(forward, rows, vocab, seed)

    def timed(prepared: Any) -> torch.Tensor:
        started = time.thread_time()
        try:
            return execute(prepared)
        finally:
            forward_cpu[0] += time.thread_time() - started

    engine.runner.execute = timed  # type: ignore[method-assign]
    per: dict[str, list[float]] = {name: [] for name in (*STAGES, "sum", "cpu-host", "step")}
    spent = _timing_checks(engine) if checks and forward == "model" else None
    per.update({name: [] for name in spent or ()})
    stamps: dict[str, float] = {}
    if forward == "model":  # section 8's host time: the previous forward's end to this one's start
        per["host"] = []
        first, last, _ = forward_edges(model)  # not on the model itself: that would turn its direct layers off
        first.register_forward_pre_hook(lambda *_: stamps.__setitem__("start", time.perf_counter()))
        last.register_forward_hook(lambda *_: stamps.__setitem__("end", time.perf_counter()))
        engine.step()
    for _ in range(steps):
        ended = stamps.get("end")
        before, forward_cpu[0], cpu = engine.stage_seconds(), 0.0, time.thread_time()
        if spent is not None:
            spent.update(dict.fromkeys(spent, 0.0))
        wall = time.perf_counter()
        engine.step()
        wall, cpu, after = time.perf_counter() - wall, time.thread_time() - cpu, engine.stage_seconds()
        per["step"].append(wall * 1000)
        for name in STAGES:
            per[name].append((after[name] - before[name]) * 1000)
        per["sum"].append(sum(per[name][-1] for name in STAGES))
        per["cpu-host"].append((cpu - forward_cpu[0]) * 1000)
        if ended is not None:
            per["host"].append((stamps["start"] - ended) * 1000)
        for name, seconds in (spent or {}).items():
            per[name].append(seconds * 1000)
    engine.close()
    return {name: statistics.median(values) for name, values in per.items()}


def _fake_forward(kind: str, rows: int, vocab: int, seed: int) -> Callable[[Any], torch.Tensor]:
    """A stand-in for the runner's ``execute`` (see the module docstring): fresh logits per call, as a forward's."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab if kind == "stream" else 8, generator=generator)
    streamed = torch.zeros(STREAMED_BYTES // 4) if kind != "none" else None

    def execute(prepared: Any) -> torch.Tensor:
        if streamed is not None:
            streamed.add_(1.0)  # read and write every byte once
        return logits[: len(prepared.keep)].clone()

    return execute


def pair(trees: Sequence[str], rounds: int, args: Sequence[str]) -> list[tuple[int, str, int, str]]:
    """This script in two checkouts at once (``trees``), one process per core, the cores swapped every round, with
    ``args``: per round and checkout, ``(round, tree, core, its output line)``."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(trees) != 2 or len(cores) < 2:
        raise SystemExit(f"--pair takes two checkouts and needs two cores (got {len(trees)} and {len(cores)})")
    lines = []
    for r in range(1, rounds + 1):
        running = []
        for k, tree in enumerate(trees):
            core = cores[(k + r + 1) % 2]
            env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
            command = [sys.executable, __file__, *args]
            pin = functools.partial(os.sched_setaffinity, 0, {core})
            process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True, preexec_fn=pin)
            running.append((tree, core, process))
        for tree, core, process in running:
            output, _ = process.communicate()
            if process.returncode:
                raise SystemExit(f"{tree}: the run failed with exit status {process.returncode}")
            lines.append((r, tree, core, output.strip().splitlines()[-1]))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small", help="benchmark model size (pagedcore.benchmarks MODEL_SIZES)")
    parser.add_argument("--rows", type=int, default=256, help="sequences decoding together")
    parser.add_argument("--context", type=int, default=512, help="positions a decode step reads (section 8: 512, 4096)")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed")
    parser.add_argument("--forward", choices=FORWARDS, default="model", help="the model, or a stand-in (docstring)")
    parser.add_argument("--tokenizer", action="store_true", help="decode the texts, as a server does (docstring)")
    parser.add_argument("--checks", action="store_true", help="time the checks before each forward (docstring)")
    parser.add_argument("--where", action="store_true", help="print which pagedcore is imported")
    parser.add_argument("--pair", metavar="BEFORE,AFTER", help="two checkouts at once, one per core (docstring)")
    parser.add_argument("--rounds", type=int, default=4, help="with --pair: rounds, the cores swapped each round")
    args = parser.parse_args()
    if args.pair:
        passed = ["--size", args.size, "--rows", str(args.rows), "--steps", str(args.steps), "--forward", args.forward]
        passed += ["--context", str(args.context)]
        passed += ["--tokenizer"] if args.tokenizer else []
        passed += ["--checks"] if args.checks else []
        for r, tree, core, line in pair(args.pair.split(","), args.rounds, passed):
            print(f"round {r} core {core} {tree}: {line.split(': ', 1)[-1]}")
        return
    torch.set_num_threads(1)
    if args.where:
        print(pagedcore.__file__)
    figures = measure(
        args.size,
        args.rows,
        args.steps,
        forward=args.forward,
        tokenizer=args.tokenizer,
        context=args.context,
        checks=args.checks,
    )
    shown = " ".join(f"{k} {v:.3f}" for k, v in figures.items())
    texts = ", texts decoded" if args.tokenizer else ""
    print(f"{args.size} {args.rows} rows, context {args.context}, forward {args.forward}{texts}: {shown}")


if __name__ == "__main__":
    main()
