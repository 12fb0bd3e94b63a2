"""Benchmark 8: host overhead per decode step: what a serving loop spends outside the model forward (sampling,
bookkeeping, scheduling, packing the next batch) with 1 to 256 sequences decoding at contexts of 512 and 4k tokens,
the :class:`~pagedcore.adapters.transformers.Engine` next to transformers' continuous batching (the manager
``generate_batch`` runs).

The sequences share all but their last 16 prompt tokens (computed once and served from the prefix cache, so reaching
256 x 4k tokens of context costs one 4k prefill), and decode together. The bookkeeping of a step (block tables of
``context / block_size`` entries per sequence, slots, sampling rows) is that of independent sequences of the same
length; the forward is cheaper than theirs would be, and is not what this benchmark measures.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedModel

from pagedcore.adapters.transformers import Engine, SamplingParams

from .common import BLOCK_SIZE, blocks_for, random_tokens
from .context import BenchContext
from .peers import Batch, ContinuousBatching, EnginePeer, check_outputs
from .report import Aim, Header, Reported, Section, Table
from .runner import Runner, rotated
from .steps import StepTimes, logging_forwards

__all__ = ["HostPoint", "HostResult", "run"]

ENGINE = "pagedcore Engine"
HF = "transformers continuous batching"
AIM_HOST_MS = {64: Aim(1.0, fmt="{:g} ms"), 256: Aim(3.0, fmt="{:g} ms")}  # Engine host ms per step at N sequences
OWN = 16  # each sequence's own prompt tokens after the shared part (one block)
HEADROOM = 32  # prompts are this much shorter than the context: the decode steps stay within it (and the model's)
BUDGET = 512  # max_num_batched_tokens / max_batch_tokens
HF_LIMIT = 64 * 64 * 512  # transformers' CPU path attends each of N queries to all N x context keys read: N^2 x C
HEADERS = ["context", "sequences", "Engine host ms/step", "Engine forward ms/step", "Engine host share",
           "Engine schedule / prepare / sample / record ms", "transformers host ms/step",
           "transformers forward ms/step", "transformers / Engine host", "aim", "status",
           "same greedy tokens"]  # fmt: skip


@dataclass
class HostPoint:
    """One (context, sequences) point: per peer its decode steps' times, or why it did not run; greedy tokens.

    Example:
        >>> point = HostPoint(4096, 256, skipped={HF: "not run (256² x 4096 > 64² x 512)"})
        >>> point.identical() is None   # only one peer could have run
        True
    """

    context: int
    seqs: int
    times: dict[str, StepTimes] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    tokens: dict[str, list[list[int]]] = field(default_factory=dict, repr=False)

    def identical(self) -> bool | None:
        """Whether both peers produced the same greedy tokens (None unless both ran)."""
        if len(self.tokens) < 2:
            return None
        return self.tokens[ENGINE] == self.tokens[HF]


@dataclass
class HostResult(Reported):
    """Host milliseconds per decode step by context and running sequences.

    Example:
        >>> point = HostPoint(512, 64, {ENGINE: StepTimes([0.05] * 3, [0.0008, 0.0009, 0.0012]),
        ...     HF: StepTimes([0.07] * 3, [0.004] * 3)}, tokens={ENGINE: [[1]], HF: [[1]]})
        >>> result = HostResult(Header(True, "Llama", "laptop"), [point], 4, 2, "")
        >>> result.missed(), point.identical()
        ([], True)
    """

    head: Header
    points: list[HostPoint]
    timed_steps: int
    warm_steps: int
    configs: str

    def missed(self) -> list[str]:
        """Points above their aim."""
        return [
            f"{p.seqs} sequences at {p.context}: {p.times[ENGINE].host_ms:.2f} ms"
            for p in self.points
            if ENGINE in p.times and p.seqs in AIM_HOST_MS and not AIM_HOST_MS[p.seqs].met(p.times[ENGINE].host_ms)
        ]

    def section(self) -> Section:
        """The report: workload, model, machine, the table of points and the aims."""
        contexts = sorted({p.context for p in self.points})
        seqs = sorted({p.seqs for p in self.points})
        workload = (
            f"{'/'.join(map(str, seqs))} sequences decoding together (greedy, eos ignored) at contexts "
            f"{' and '.join(map(str, contexts))}: prompts of `context - {HEADROOM}` tokens (the decode steps read up "
            f"to `context` positions) that share all but their last {OWN} (the shared part computed once, "
            "beforehand, and taken from the prefix cache), submitted at once"
        )
        measured = (
            "hooks on the model's input embedding (its start), head (its end) and rotary embedding (its positions) "
            "stamp every forward (not on the model itself: that would turn the Engine's direct layers off); a decode "
            "step is a forward that computes "
            "one position per sequence for every sequence; host time per step = from the end of a decode step's "
            "forward to the start of the next one's (sampling, bookkeeping, scheduling and packing: everything the "
            "loop does outside the forward). The Engine's own split of that time comes from "
            "`Engine.stage_seconds()` read around each `step()`: schedule / prepare (packing, metadata) / sample / "
            "record (outputs, events), medians per step; the gap also holds what none of them times (freeing the "
            f"step's logits, the model call's wrapping). The first {self.warm_steps} decode steps are left out; "
            f"median over the next {self.timed_steps}. Each point runs both peers, their order alternating from point "
            "to point."
        )
        missed = self.missed()
        verdict = "Every aim met." if not missed else f"Above the aim: {'; '.join(missed)}."
        return Section("8. Host overhead per decode step", self.head, workload, measured,
                       body=[Table(HEADERS, [_row(p) for p in self.points]), verdict],
                       notes=[self.configs])  # fmt: skip


def _row(p: HostPoint) -> list[str]:
    e, h = p.times.get(ENGINE), p.times.get(HF)
    aim, same = AIM_HOST_MS.get(p.seqs), p.identical()
    engine = [f"{e.host_ms:.2f}", f"{e.forward_ms:.1f}", f"{100 * e.host_share:.1f}%", _split(e)] if e else [
        p.skipped.get(ENGINE, "n/a"), "n/a", "n/a", "n/a"]  # fmt: skip
    hf = [f"{h.host_ms:.2f}", f"{h.forward_ms:.1f}"] if h else [p.skipped.get(HF, "n/a"), "n/a"]
    return [
        str(p.context),
        str(p.seqs),
        *engine,
        *hf,
        f"{h.host_ms / e.host_ms:.1f}x" if e and h else "n/a",
        aim.text if aim else "-",
        aim.status(e.host_ms) if aim and e else "-",
        "n/a" if same is None else ("yes" if same else "**no**"),
    ]


def _split(times: StepTimes | None) -> str:
    if times is None or not times.stages:
        return "n/a"
    return " / ".join(f"{times.stage_ms(name):.2f}" for name in ("schedule", "prepare", "sample", "record"))


def _engine_point(
    model: PreTrainedModel, engine: Engine, prompts: list[list[int]], new: int, prompt_len: int, warm: int
) -> tuple[StepTimes, list[list[int]]]:
    """The prompts through ``step()``, reading the Engine's stage times around each step that ran a forward."""
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    stages: list[dict[str, float]] = []
    done: dict[str, Any] = {}
    with logging_forwards(model) as log:
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        while len(done) < len(ids):
            before, forwards = engine.stage_seconds(), len(log.forwards)
            done.update((out.request_id, out) for out in engine.step())
            if len(log.forwards) > forwards:
                after = engine.stage_seconds()
                stages.append({name: after[name] - before[name] for name in after})
    outputs = [done[i] for i in ids]
    check_outputs(outputs)
    times = log.decode_steps(len(prompts), prompt_len, skip=warm, stages=stages)
    return times, [list(o.token_ids) for o in outputs]


def _hf_point(
    model: PreTrainedModel, warm_prompt: list[int], prompts: list[list[int]], new: int, prompt_len: int, warm: int
) -> tuple[StepTimes, list[list[int]]]:
    """transformers' continuous batching (the manager ``generate_batch`` runs): the shared prompt part first, as its
    own request, so that the others find its blocks; then every prompt at once."""
    n = len(prompts)
    num_blocks = n * blocks_for(prompt_len + new) + blocks_for(prompt_len) + 8  # to read every sequence's keys
    peer = ContinuousBatching(num_blocks=num_blocks, budget=BUDGET, max_requests=max(n, 1), max_new_tokens=new)
    with logging_forwards(model) as log, peer.session(model) as serve:
        serve(Batch([warm_prompt], [2]))
        served = serve(Batch(prompts, [new] * n))
    return log.decode_steps(n, prompt_len, skip=warm), served.tokens


def run(
    ctx: BenchContext,
    *,
    contexts: tuple[int, ...] | None = None,
    seqs: tuple[int, ...] | None = None,
    timed_steps: int | None = None,
    with_transformers: bool = True,
) -> HostResult:
    """Host milliseconds per decode step at 1/16/64/256 sequences and contexts 512 and 4096 (quick: 1/4/16 at 64 and
    256), median over ``timed_steps`` steps (default 8; quick 4) after 2 warm-up steps. transformers' continuous
    batching runs where its attention (each query over every key the step reads) stays affordable:
    ``sequences^2 x context <= 64^2 x 512``.

    Example:
        >>> from pagedcore.benchmarks import BenchOptions
        >>> ctx = BenchContext(BenchOptions(quick=True, progress=False, model_size="tiny"))
        >>> result = run(ctx)  # doctest: +SKIP
        >>> [(p.context, p.seqs) for p in result.points]  # doctest: +SKIP
        [(64, 1), (64, 4), (64, 16), (256, 1), (256, 4), (256, 16)]
    """
    quick, model, seed = ctx.quick, ctx.model(), ctx.options.seed
    contexts = contexts or ((64, 256) if quick else (512, 4096))
    seqs = seqs or ((1, 4, 16) if quick else (1, 16, 64, 256))
    timed = timed_steps or (4 if quick else 8)
    warm = 2
    if min(contexts) <= HEADROOM + OWN or min(contexts) % BLOCK_SIZE:
        raise ValueError(f"contexts must be multiples of {BLOCK_SIZE} above {HEADROOM + OWN}, got {contexts}")
    if warm + timed + math.ceil(max(seqs) * OWN / BUDGET) + 2 > HEADROOM:
        raise ValueError(f"{timed} timed steps for {max(seqs)} sequences do not fit in {HEADROOM} new tokens")
    rng = random.Random(seed + 8)
    runs = len(contexts) * len(seqs) * (2 if with_transformers else 1)
    points: list[HostPoint] = []
    with Runner(ctx, "host: overhead per step", runs) as runner:
        for context in contexts:  # the peers' order alternates from point to point, across contexts too
            points += _context(runner, model, rng, context, seqs, (timed, warm, len(points)), with_transformers)
    configs = (
        f"Engine: one per context, block size {BLOCK_SIZE}, max_num_batched_tokens {BUDGET}, max_num_seqs "
        f"{max(seqs)}, prefix caching on, the shared part computed by one request before the points; transformers: "
        f"`continuous_batching_context_manager` with `ContinuousBatchingConfig(page_size={BLOCK_SIZE}, "
        f"max_batch_tokens={BUDGET}, max_requests_per_batch=N, allow_block_sharing=True)` and blocks to read every "
        "sequence's keys in one step, the shared part first as its own request, sdpa attention; not run where "
        "N² x context > 64² x 512 (its CPU attention attends each query to every key of the step: minutes per point)"
    )
    return HostResult(runner.header(), points, timed, warm, configs)


def _context(
    runner: Runner,
    model: PreTrainedModel,
    rng: random.Random,
    context: int,
    seqs: tuple[int, ...],
    steps: tuple[int, int, int],
    with_transformers: bool,
) -> list[HostPoint]:
    """Every point of one context, on one Engine whose prefix cache holds the shared prompt part; ``steps``: the
    timed and warm-up decode steps, and how many points ran before (the peers' order alternates point by point)."""
    timed, warm, before = steps
    vocab, prompt_len = model.config.vocab_size, context - HEADROOM
    shared = random_tokens(rng, prompt_len - OWN, vocab)
    warm_prompt = shared + random_tokens(rng, OWN, vocab)
    room = blocks_for(context) + max(seqs) * blocks_for(OWN + HEADROOM)
    points: list[HostPoint] = []
    with EnginePeer(num_blocks=room + 8, budget=BUDGET, max_seqs=max(seqs)).engine(model) as engine:
        engine.generate([warm_prompt], SamplingParams(max_new_tokens=2, ignore_eos=True), use_tqdm=False)
        for n in seqs:
            prompts = [shared + random_tokens(rng, OWN, vocab) for _ in range(n)]
            new = warm + timed + math.ceil(n * OWN / BUDGET) + 2  # enough decode steps after the last prefill
            point = HostPoint(context, n)
            peers: list[tuple[str, Callable[[], tuple[StepTimes, list[list[int]]]]]] = [
                (ENGINE, functools.partial(_engine_point, model, engine, prompts, new, prompt_len, warm))
            ]
            if with_transformers and n * n * context <= HF_LIMIT:
                peers.append((HF, functools.partial(_hf_point, model, warm_prompt, prompts, new, prompt_len, warm)))
            elif with_transformers:
                point.skipped[HF] = f"not run ({n}² x {context} > 64² x 512)"
                runner.tick()
            for name, fn in rotated(peers, before + len(points)):
                runner.label(f"{name}: {n} x {context}")
                measured, error = runner.attempt(fn, width=120)
                if measured is None:
                    point.skipped[name] = error or "n/a"
                else:
                    point.times[name], point.tokens[name] = measured
                runner.tick()
            points.append(point)
    return points
