"""Benchmark 9: how the :class:`~pagedcore.adapters.transformers.Engine`'s cost grows: throughput, time outside the
forward and KV memory as the number of requests grows (8 to 512 prompts of 128 tokens) and as prompts grow (128 to
4096 tokens, 8 requests). Next to each point, its compute floor (the FLOPs of its tokens at this machine's matmul
rate): where the wall time follows the floor the Engine is compute-bound; where the host share grows, bookkeeping
shows. Each point runs only if its estimated time (floor x the previous point's wall / floor) fits the point budget.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from transformers import PreTrainedModel

from .common import BLOCK_SIZE, blocks_for, kv_bytes_per_token, random_tokens
from .context import BenchContext
from .floor import RATE_ROWS, ModelShape, Segment, matmul_rate, segments_flops
from .peers import Batch, EnginePeer
from .plots import Curve, LineChart, LinePanel
from .report import Header, Reported, Section, Table, mib
from .runner import Runner, clock
from .steps import logging_forwards

__all__ = ["ScalePoint", "ScalingResult", "run"]

CHART = "scaling.png"
REQUESTS = "requests"
PROMPTS = "prompt length"
HEADERS = ["sweep", "requests", "prompt tokens", "wall", "tokens/s", "compute floor", "wall / floor", "in forward",
           "host ms/step", "steps", "KV peak", "KV peak / all requests' KV"]  # fmt: skip


@dataclass
class ScalePoint:
    """One run of the Engine: ``requests`` unique prompts of ``prompt`` tokens, ``new`` tokens each.

    Example:
        >>> point = ScalePoint(REQUESTS, 8, 128, 16, floor=0.5, wall=1.0, busy=0.75, steps=20, kv_peak=2**20)
        >>> point.tokens_per_second, point.host_ms_per_step, point.floor_ratio, point.forward_share
        (1152.0, 12.5, 2.0, 0.75)
    """

    sweep: str
    requests: int
    prompt: int
    new: int
    floor: float  # seconds
    wall: float | None = None
    busy: float = 0.0  # seconds inside model forwards
    steps: int = 0
    kv_peak: int = 0
    skipped: str = ""

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens plus generated tokens."""
        return self.requests * (self.prompt + self.new)

    @property
    def tokens_per_second(self) -> float | None:
        """Prompt and generated tokens per second of wall time."""
        return self.computed_tokens / self.wall if self.wall else None

    @property
    def host_ms_per_step(self) -> float | None:
        """Milliseconds per step outside the model forward."""
        return 1000 * (self.wall - self.busy) / self.steps if self.wall and self.steps else None

    @property
    def floor_ratio(self) -> float | None:
        """Wall / compute floor."""
        return self.wall / self.floor if self.wall else None

    @property
    def forward_share(self) -> float | None:
        """Share of the wall time inside model forwards."""
        return self.busy / self.wall if self.wall else None


@dataclass
class ScalingResult(Reported):
    """Both sweeps' points (see :class:`ScalePoint`).

    Example:
        >>> points = [ScalePoint(REQUESTS, 8, 128, 16, 0.5, 1.0, 0.9, 20, 2**20),
        ...           ScalePoint(REQUESTS, 512, 128, 16, 30.0, None, skipped="skipped: ~90 s > 60 s budget"),
        ...           ScalePoint(PROMPTS, 8, 4096, 16, 9.0, 12.0, 11.0, 30, 2**24)]
        >>> result = ScalingResult(Header(True, "Llama", "laptop"), points, 8192, 1e11, 60.0, "")
        >>> [panel.title for panel in result.section().line_charts[0].panels][:3]
        ['throughput vs requests', 'KV peak vs requests', 'wall / compute floor vs requests']
        >>> result.markdown().count("| skipped: ~90 s > 60 s budget |")
        1
    """

    head: Header
    points: list[ScalePoint]
    kv_bytes_per_token: int
    rate: float
    point_budget: float
    engine_config: str

    def section(self) -> Section:
        """The report: workload, model, machine, the table of both sweeps, the line chart."""
        req, prm = ([p for p in self.points if p.sweep == s] for s in (REQUESTS, PROMPTS))
        workload = (
            f"all requests submitted at once, unique seeded prompts (no shared prefix), {self.points[0].new} new "
            f"tokens each, greedy, eos ignored; requests {'/'.join(str(p.requests) for p in req)} with "
            f"{req[0].prompt}-token prompts, then prompts of {'/'.join(str(p.prompt) for p in prm)} tokens for "
            f"{prm[0].requests} requests"
        )
        measured = (
            "wall time of one `Engine.generate` call per point (an Engine made per point, untimed, after one warm-up "
            "call; the call includes the Engine's first steps at its row counts, and with `--engine-compile inductor` "
            "the compiling of its buckets); forward time from forward pre/post hooks; host ms/step = (wall - forward "
            "time) / steps; tokens/s "
            "= (prompt + generated tokens) / wall; compute floor = the FLOPs of every prompt token and every "
            f"generated token but the last, at {self.rate / 1e9:.1f} GFLOP/s (the best rate with `F.linear`'s bits "
            f"of this machine on the model's weight shapes with {RATE_ROWS} rows, measured once in the run); KV peak = "
            "`stats().kv_peak_used_bytes`; all requests' KV = the bytes of every request's prompt and generated "
            "tokens (below 1 when requests finish before the last ones start). A point runs if floor x the previous "
            f"point's wall / floor is under {self.point_budget:.0f} s."
        )
        return Section(
            "9. Scaling: requests and prompt length", self.head, workload, measured,
            body=[Table(HEADERS, [self._row(p) for p in self.points])], notes=[f"Engine: {self.engine_config}."],
            line_charts=[self._chart()],
        )  # fmt: skip

    def _row(self, p: ScalePoint) -> list[object]:
        if p.wall is None:
            return [p.sweep, p.requests, p.prompt, p.skipped, *["n/a"] * 8]
        assert p.tokens_per_second is not None and p.floor_ratio is not None and p.forward_share is not None
        stored = p.requests * (p.prompt + p.new - 1)
        return [p.sweep, p.requests, p.prompt, f"{p.wall:.2f} s", f"{p.tokens_per_second:.0f}", f"{p.floor:.3g} s",
                f"{p.floor_ratio:.2f}x", f"{100 * p.forward_share:.1f}%", f"{p.host_ms_per_step:.2f}", p.steps,
                mib(p.kv_peak), f"{p.kv_peak / (stored * self.kv_bytes_per_token):.3f}"]  # fmt: skip

    def _chart(self) -> LineChart:
        """``scaling.png``: against requests (first row) and prompt length (second row): throughput, KV peak, wall /
        compute floor, share of the wall time outside the forward."""
        panels = []
        for sweep, x_of, x_label in ((REQUESTS, "requests", "requests"), (PROMPTS, "prompt", "prompt tokens")):
            points = [p for p in self.points if p.sweep == sweep]
            xs = [getattr(p, x_of) for p in points]
            kv = [p.kv_peak / 2**20 if p.wall is not None else None for p in points]
            host = [100 * (1 - p.forward_share) if p.forward_share is not None else None for p in points]
            panels += [
                LinePanel(f"throughput vs {sweep}", x_label, "tokens/s (prompt + generated)",
                          [Curve("Engine", xs, [p.tokens_per_second for p in points])]),
                LinePanel(f"KV peak vs {sweep}", x_label, "MiB", [Curve("Engine", xs, kv)]),
                LinePanel(f"wall / compute floor vs {sweep}", x_label, "x (1 = compute-bound at best)",
                          [Curve("Engine", xs, [p.floor_ratio for p in points])]),
                LinePanel(f"time outside the forward vs {sweep}", x_label, "% of wall", [Curve("Engine", xs, host)]),
            ]  # fmt: skip
        suffix = " (quick workload)" if self.head.quick else ""
        return LineChart(CHART, f"Engine scaling{suffix}", panels, "scaling")


def _run_point(model: PreTrainedModel, point: ScalePoint, prompts: list[list[int]]) -> None:
    """Serve ``prompts`` with a new Engine sized for them (made untimed); fill in the point's figures."""
    peer = EnginePeer(num_blocks=point.requests * blocks_for(point.prompt + point.new) + 8,
                      budget=max(512, point.requests), max_seqs=point.requests)  # fmt: skip
    with peer.session(model) as serve, logging_forwards(model) as log:
        start = clock(model.device)
        served = serve(Batch(prompts, [point.new] * len(prompts)))
    point.wall, point.busy, point.steps = served.ended - start, log.busy_seconds(), served.steps or 0
    point.kv_peak = served.peak_kv_bytes or 0


def run(
    ctx: BenchContext,
    *,
    point_budget: float | None = None,
    requests: tuple[int, ...] | None = None,
    prompt_lens: tuple[int, ...] | None = None,
) -> ScalingResult:
    """Requests 8/32/128/512 (``requests``) with 128-token prompts, then prompts of 128/512/2048/4096 tokens
    (``prompt_lens``; at most the model's positions minus the new tokens: 4080 for 4096) for 8 requests, 16 new
    tokens each (quick: requests 4/8/16/32 of 32 tokens, prompts 32/64/128/256 for 4 requests, 4 new tokens); points
    whose estimate exceeds ``point_budget`` seconds (default 120; quick 20) are skipped, and a point that fails keeps
    its row with the reason.

    Example:
        >>> from pagedcore.benchmarks import BenchOptions
        >>> ctx = BenchContext(BenchOptions(quick=True, progress=False, model_size="tiny"))
        >>> result = run(ctx)  # doctest: +SKIP
        >>> [(p.requests, p.prompt) for p in result.points][:4]  # doctest: +SKIP
        [(4, 32), (8, 32), (16, 32), (32, 32)]
    """
    quick, model, seed = ctx.quick, ctx.model(), ctx.options.seed
    counts: tuple[int, ...]
    lengths: tuple[int, ...]
    if quick:
        counts, lengths, base_prompt, base_requests, new = (4, 8, 16, 32), (32, 64, 128, 256), 32, 4, 4
    else:
        counts, lengths, base_prompt, base_requests, new = (8, 32, 128, 512), (128, 512, 2048, 4096), 128, 8, 16
    counts, lengths = requests or counts, prompt_lens or lengths
    budget = point_budget if point_budget is not None else (20.0 if quick else 120.0)
    positions = getattr(model.config, "max_position_embeddings", None) or max(lengths) + new
    lengths = tuple(min(p, int(positions) - new) for p in lengths)
    rng = random.Random(seed + 9)
    shape = ModelShape.from_config(model.config)
    rate = matmul_rate(shape, model.device, model.dtype)

    def floor(n: int, prompt: int) -> float:
        segments = [Segment(0, prompt, 1), Segment(prompt, new - 1, new - 1)] * n
        return segments_flops(shape, segments) / rate

    plan = [ScalePoint(REQUESTS, n, base_prompt, new, floor(n, base_prompt)) for n in counts]
    plan += [ScalePoint(PROMPTS, base_requests, p, new, floor(base_requests, p)) for p in lengths]
    with EnginePeer(num_blocks=64).session(model) as serve:  # warm-up
        serve(Batch([random_tokens(rng, 24, model.config.vocab_size)], [2]))
    with Runner(ctx, "scaling: Engine", len(plan)) as runner:
        _run_plan(runner, model, plan, rng, budget)
    return ScalingResult(
        head=runner.header(),
        points=plan,
        kv_bytes_per_token=kv_bytes_per_token(model),
        rate=rate,
        point_budget=budget,
        engine_config=(
            f"block size {BLOCK_SIZE}, blocks for every request's prompt and new tokens, max_num_seqs = the requests, "
            "max_num_batched_tokens = max(512, requests), prefix caching on (no prompt shares a block)"
        ),
    )


def _run_plan(
    runner: Runner, model: PreTrainedModel, plan: list[ScalePoint], rng: random.Random, budget: float
) -> None:
    """Run each point whose estimate (its floor x the sweep's last wall / floor, 3 at first) fits ``budget``; a point
    that cannot run keeps its row with the reason."""
    ratio_seen: dict[str, float] = {}
    for point in plan:
        estimate = point.floor * ratio_seen.get(point.sweep, 3.0)
        if estimate > budget:
            point.skipped = f"skipped: about {estimate:.0f} s > the {budget:.0f} s point budget"
            runner.tick()
            continue
        runner.label(f"{point.requests} x {point.prompt}")
        prompts = [random_tokens(rng, point.prompt, model.config.vocab_size) for _ in range(point.requests)]
        _, error = runner.attempt(functools.partial(_run_point, model, point, prompts), width=160)
        if error is not None:
            point.wall, point.skipped = None, error
        else:
            assert point.wall is not None
            ratio_seen[point.sweep] = point.wall / point.floor
        runner.tick()
