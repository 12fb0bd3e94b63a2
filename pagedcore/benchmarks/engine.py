"""Benchmark 4: many requests sharing a prefix: the :class:`~pagedcore.adapters.transformers.Engine` vs ``generate``
one request at a time, ``generate`` on the padded batch and transformers' own continuous batching."""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass

from transformers import PreTrainedModel

from .chart import Panel
from .common import BLOCK_SIZE, blocks_for, random_tokens
from .context import BenchContext
from .floor import ComputeFloor, Segment, compute_floor
from .peers import (
    ENGINE,
    HF_CONTINUOUS,
    ONE_AT_A_TIME,
    PADDED_BATCH,
    Batch,
    ContinuousBatching,
    EnginePeer,
    OneAtATime,
    PaddedBatch,
    Peer,
    PeerResult,
    kept_engine,
    measure_all,
)
from .report import RATIO_HEADERS, Aim, Header, Reported, Section, Table, mib, ratio, sentence
from .roofline import Request, Roofline, machine_limits, roofline
from .runner import Runner, percentile

__all__ = [
    "EngineResult",
    "run",
    "shared_prefix_peers",
    "shared_prefix_segments",
    "shared_prefix_workload",
]

AIM_ENGINE_PREFILL_RATIO = Aim(1.05)
AIM_ENGINE_SPEEDUP = {name: Aim(3.0, at_most=False, fmt="{:g}x") for name in (ONE_AT_A_TIME, PADDED_BATCH,
                                                                                HF_CONTINUOUS)}  # fmt: skip
AIM_FLOOR_RATIO = Aim(1.7, fmt="{:g}x")  # Engine wall / compute floor (issue 13: 4.0 s on the reference 2-core machine)
AIM_ROOFLINE_RATIO = Aim(1.5, fmt="{:g}x")  # Engine wall / roofline floor (issue 33)
HEADERS = ["peer", "wall", "gen tokens/s", "p50 latency", "p99 latency", "prefill tokens computed", "peak KV",
           "greedy mismatches vs one-at-a-time"]  # fmt: skip


def shared_prefix_segments(prefix_tokens: int, unique_lengths: list[int], new_tokens: list[int]) -> list[Segment]:
    """The positions serving requests that share a prefix must compute: the prefix once, each request's own prompt
    tokens (then one row of logits), and each generated token but the last fed back as a decode step.

    Example:
        >>> [(s.start, s.count, s.logits) for s in shared_prefix_segments(512, [20, 30], [16, 1])]
        [(0, 512, 0), (512, 20, 1), (532, 15, 15), (512, 30, 1), (542, 0, 0)]
    """
    segments = [Segment(0, prefix_tokens, 0)]
    for own, new in zip(unique_lengths, new_tokens):
        segments.append(Segment(prefix_tokens, own, 1))
        segments.append(Segment(prefix_tokens + own, new - 1, new - 1))
    return segments


@dataclass
class EngineResult(Reported):
    """Requests sharing a prefix served by the Engine and its peers (see :class:`PeerResult`).

    Example:
        >>> peers = [PeerResult("generate, one at a time", wall=6.0, generated_tokens=24),
        ...          PeerResult("pagedcore Engine", wall=1.5, generated_tokens=24)]
        >>> result = EngineResult(Header(True, "Llama", "laptop"), prefix_tokens=256,
        ...     unique_lengths=[8, 16], new_tokens=[8, 16], peers=peers, engine_config="", hf_config="",
        ...     floor=ComputeFloor(flops=1e9, rate=1e9, rows=512, tokens=302))
        >>> result.prompt_tokens, result.unique_tokens
        (536, 280)
        >>> result.speedup("generate, one at a time"), result.peer("pagedcore Engine").tokens_per_second
        (4.0, 16.0)
        >>> result.floor_ratio()   # 1.5 s of wall for a 1.0 s floor
        1.5
    """

    head: Header
    prefix_tokens: int
    unique_lengths: list[int]
    new_tokens: list[int]
    peers: list[PeerResult]
    engine_config: str
    hf_config: str
    floor: ComputeFloor | None = None
    roofline: Roofline | None = None

    def floor_ratio(self) -> float | None:
        """The Engine's wall time / the workload's compute floor (None without either)."""
        wall = self.peer(ENGINE).wall
        return wall / self.floor.seconds if wall and self.floor is not None else None

    def roofline_ratio(self, name: str = ENGINE) -> float | None:
        """``name``'s wall time / the workload's roofline floor (None without either)."""
        wall = self.peer(name).wall
        return wall / self.roofline.seconds if wall and self.roofline is not None else None

    @property
    def unique_tokens(self) -> int:
        """The shared prefix once plus every request's own tokens."""
        return self.prefix_tokens + sum(self.unique_lengths)

    @property
    def prompt_tokens(self) -> int:
        """All prompt tokens of all requests."""
        return len(self.unique_lengths) * self.prefix_tokens + sum(self.unique_lengths)

    def peer(self, name: str) -> PeerResult:
        """The result of one peer."""
        return next(p for p in self.peers if p.name == name)

    def speedup(self, name: str) -> float | None:
        """Wall time of ``name`` / wall time of the Engine."""
        other, engine = self.peer(name).wall, self.peer(ENGINE).wall
        return other / engine if other and engine else None

    def section(self) -> Section:
        """The report: workload, model, machine, per-peer figures and the Engine's ratios with their aims."""
        workload = (
            f"{len(self.unique_lengths)} requests: a shared {self.prefix_tokens}-token prefix followed by "
            f"{min(self.unique_lengths)}-{max(self.unique_lengths)} unique tokens, "
            f"{min(self.new_tokens)}-{max(self.new_tokens)} new tokens each (seeded), greedy, eos ignored; all "
            f"requests arrive at once. {self.prompt_tokens} prompt tokens, {self.unique_tokens} unique, "
            f"{sum(self.new_tokens)} tokens to generate"
        )
        measured = (
            "wall time from the start to the last completion, one run per peer after an untimed warm-up of its code "
            "path (the Engine's: the workload itself, then the warm-up batch, on the one Engine it keeps); tokens/s = "
            "the requests' own generated tokens / wall time; latency of a request = its completion time since the "
            "start (one at a time: cumulative; padded batch: every request completes at the end; continuous batching "
            "and Engine: when the request finished). Prefill tokens computed: Engine = "
            "`stats().prompt_tokens_computed`; every peer also cross-checked by counting the positions each model "
            "forward computes (minus one decode position per generated token after the first)."
        )
        figures = Table(HEADERS, [self._peer_row(p) for p in self.peers])
        suffix = " (quick workload)" if self.head.quick else ""
        return Section(
            "4. Continuous batching with a shared prefix", self.head, workload, measured,
            body=[figures, Table(RATIO_HEADERS, self._ratio_rows())],
            notes=self._notes(),
            panels=self._panels(),
            chart_title=f"{len(self.unique_lengths)} requests sharing a {self.prefix_tokens}-token prefix{suffix}",
        )  # fmt: skip

    def _peer_row(self, p: PeerResult) -> list[str]:
        if p.error is not None or p.wall is None:
            return [p.name, p.error or "n/a", *["n/a"] * 6]
        prefill = "n/a" if p.prefill_computed is None else f"{p.prefill_computed}"
        if p.padding_computed:
            prefill += f" (+{p.padding_computed} padding)"
        kv = "n/a" if p.peak_kv_bytes is None else mib(p.peak_kv_bytes)
        n = len(self.unique_lengths)
        same = "reference" if p.name == ONE_AT_A_TIME else (f"{len(p.mismatches)} of {n}" if p.mismatches else "0")
        return [p.name, f"{p.wall:.2f} s", f"{p.tokens_per_second:.1f}", f"{percentile(p.latencies, 50):.2f} s",
                f"{percentile(p.latencies, 99):.2f} s", prefill, f"{kv} ({p.kv_how})", same]  # fmt: skip

    def _ratio_rows(self) -> list[list[str]]:
        rows = []
        for name, aim in AIM_ENGINE_SPEEDUP.items():
            s = self.speedup(name)
            rows.append(aim.row(f"Engine speedup vs {name} (wall)", "n/a" if s is None else ratio(s), s))
        engine = self.peer(ENGINE)
        if engine.prefill_computed is not None:
            r = engine.prefill_computed / self.unique_tokens
            rows.append(AIM_ENGINE_PREFILL_RATIO.row("Engine prefill tokens computed / unique tokens", f"{r:.3f}", r))
        floor_ratio = self.floor_ratio()
        if floor_ratio is not None and self.floor is not None:
            label = f"Engine wall / compute floor ({self.floor.seconds:.2f} s)"
            rows.append(AIM_FLOOR_RATIO.row(label, ratio(floor_ratio), floor_ratio))
        roof = self.roofline_ratio()
        if roof is not None and self.roofline is not None:
            label = f"Engine wall / roofline floor ({self.roofline.seconds:.2f} s)"
            rows.append(AIM_ROOFLINE_RATIO.row(label, ratio(roof), roof))
        return rows

    def _notes(self) -> list[str]:
        notes = [f"Engine: {self.engine_config}.", f"{HF_CONTINUOUS}: {self.hf_config}."]
        if self.floor is not None:
            notes.append(
                f"Compute floor: the FLOPs of the positions the workload must compute (the shared prefix once, each "
                f"request's own prompt tokens, each generated token but the last as a decode step; projections, MLP, "
                f"attention over each position's context, the LM head for each sampled row): {self.floor.describe()}."
            )
        if self.roofline is not None:
            others = ", ".join(f"{p.name} {ratio(self.roofline_ratio(p.name))}" for p in self.peers
                               if p.name != ENGINE and self.roofline_ratio(p.name) is not None)  # fmt: skip
            notes.append(
                "Roofline floor: the workload's steps as an ideal continuous batcher with this token budget runs "
                "them (the shared prefix once, each request's own prompt tokens in budget-sized chunks, then one "
                "decode step per generated token after the first, every request still generating a row); per step "
                "the larger of its FLOPs at the best GEMM rate and its bytes (every linear weight and the LM head "
                "once, the keys and values of each sequence's context, the logits written) at the measured bandwidth: "
                f"{self.roofline.describe()}. The peers' walls over it: {others or 'n/a'}."
            )
        notes += [f"{p.name}: {sentence(p.note.strip())}" for p in self.peers if p.note]
        mism = [p for p in self.peers if p.mismatches and p.name != ONE_AT_A_TIME]
        notes += [f"{p.name}: greedy tokens differ from one-at-a-time for requests {p.mismatches}." for p in mism]
        return notes

    def _panels(self) -> list[Panel]:
        """The chart's panels: wall time and generated tokens/s per peer (``n/a`` for a peer that could not run)."""
        labels = [p.name.replace("generate, ", "generate\n").replace(" continuous", "\ncontinuous") for p in self.peers]
        walls = [None if p.error is not None else p.wall or 0.0 for p in self.peers]
        rates = [None if p.error is not None else p.tokens_per_second or 0.0 for p in self.peers]
        return [
            Panel("wall time (lower is better)", "s", labels, walls, "{:.2f}"),
            Panel("generated tokens/s (higher is better)", "tok/s", labels, rates, "{:.0f}"),
        ]


def shared_prefix_workload(
    quick: bool, vocab: int, seed: int = 0
) -> tuple[int, list[list[int]], list[int], list[list[int]]]:
    """The engine benchmark's seeded requests: ``(prefix length, prompts, max_new_tokens per prompt, two warm-up
    prompts)``; 32 prompts of a 512-token prefix + 16-64 tokens, 16-64 new tokens (quick: 16, 256, 8-32, 8-16).

    Example:
        >>> prefix_len, prompts, news, warm = shared_prefix_workload(False, 32000)
        >>> prefix_len, len(prompts), sum(news), all(p[:512] == prompts[0][:512] for p in prompts)
        (512, 32, 1244, True)
    """
    if quick:
        count, prefix_len, (u_lo, u_hi), (n_lo, n_hi) = 16, 256, (8, 32), (8, 16)
    else:
        count, prefix_len, (u_lo, u_hi), (n_lo, n_hi) = 32, 512, (16, 64), (16, 64)
    rng = random.Random(seed + 4)
    prefix = random_tokens(rng, prefix_len, vocab)
    prompts = [prefix + random_tokens(rng, rng.randint(u_lo, u_hi), vocab) for _ in range(count)]
    news = [rng.randint(n_lo, n_hi) for _ in range(count)]
    warm = [random_tokens(rng, 24, vocab) for _ in range(2)]
    return prefix_len, prompts, news, warm


def shared_prefix_peers(num_blocks: int, budget: int, count: int, longest: int) -> list[Peer]:
    """The engine benchmark's peers, the reference first: ``generate`` one at a time, on the padded batch,
    transformers' continuous batching and the Engine, the last two with ``num_blocks`` blocks, a token budget of
    ``budget`` per step and room for ``count`` requests.

    Example:
        >>> [peer.name for peer in shared_prefix_peers(64, 512, 32, 16)]
        ['generate, one at a time', 'generate, padded batch', 'transformers continuous batching', 'pagedcore Engine']
    """
    return [
        OneAtATime(),
        PaddedBatch(),
        ContinuousBatching(num_blocks=num_blocks, budget=budget, max_requests=count, max_new_tokens=longest),
        EnginePeer(num_blocks=num_blocks, budget=budget, max_seqs=count),
    ]


def _keep_engine(stack: contextlib.ExitStack, runner: Runner, model: PreTrainedModel, peers: list[Peer],
                 batch: Batch) -> None:  # fmt: skip
    """Replace the last peer, the :class:`~pagedcore.benchmarks.peers.EnginePeer`, by one Engine for the section,
    warmed on ``batch`` (:func:`~pagedcore.benchmarks.peers.kept_engine`). An Engine that cannot be built stays the
    peer: it fails again in its turn and keeps its row with the reason."""
    engine_peer = peers[-1]
    assert isinstance(engine_peer, EnginePeer)
    runner.label(f"{ENGINE}, warming up on the workload")
    kept, _ = runner.attempt(lambda: kept_engine(stack, model, engine_peer, batch))
    peers[-1] = kept or engine_peer
    runner.tick()


def run(ctx: BenchContext) -> EngineResult:
    """32 requests: a shared 512-token prefix + 16-64 unique tokens, 16-64 new tokens each (quick: 16 requests,
    256-token prefix, 8-32 unique, 8-16 new). Compares the Engine with ``generate`` one request at a time,
    ``generate`` on the left-padded batch and transformers' continuous batching, and the Engine's wall time with the
    workload's compute floor (:mod:`~pagedcore.benchmarks.floor`, measured after the peers); see :class:`EngineResult`.

    Example:
        >>> from pagedcore.benchmarks import BenchOptions
        >>> ctx = BenchContext(BenchOptions(quick=True, progress=False, model_size="tiny"))
        >>> result = run(ctx)  # doctest: +SKIP
        >>> [peer.name for peer in result.peers]  # doctest: +SKIP
        ['generate, one at a time', 'generate, padded batch', 'transformers continuous batching', 'pagedcore Engine']
        >>> result.speedup("generate, one at a time") >= 3.0  # the aim  # doctest: +SKIP
        True
    """
    quick, model, seed = ctx.quick, ctx.model(), ctx.options.seed
    prefix_len, prompts, news, warm = shared_prefix_workload(quick, model.config.vocab_size, seed)
    count = len(prompts)
    num_blocks = sum(blocks_for(len(p) + n) for p, n in zip(prompts, news)) + 8
    budget = prefix_len  # tokens per step: 512 (the Engine's default) in the full workload, scaled down with --quick
    peers = shared_prefix_peers(num_blocks, budget, count, max(news))
    warm_batch = Batch([warm[0], warm[1][8:]], [2, 2])  # 24 tokens, and 16 (after 8 padding positions when padded)
    batch = Batch(prompts, news)
    with contextlib.ExitStack() as stack, Runner(ctx, "engine benchmark: peers", len(peers) + 1) as runner:
        _keep_engine(stack, runner, model, peers, batch)
        results = measure_all(model, peers, batch, warm_batch, runner)
    unique_lengths = [len(p) - prefix_len for p in prompts]
    limits = machine_limits(model)
    requests = [Request(len(p), n, prefix_len if i else 0) for i, (p, n) in enumerate(zip(prompts, news))]
    return EngineResult(
        head=runner.header(),
        prefix_tokens=prefix_len,
        unique_lengths=unique_lengths,
        new_tokens=news,
        peers=results,
        floor=compute_floor(model, shared_prefix_segments(prefix_len, unique_lengths, news)),
        roofline=roofline(model, requests, limits, budget),
        engine_config=(
            f"block size {BLOCK_SIZE}, {num_blocks} blocks (room for every request without sharing), "
            f"max_num_batched_tokens {budget} (tokens computed per step; the same budget for transformers' continuous "
            f"batching), max_num_seqs {count}, prefix caching on; one Engine for the section, built and warmed on "
            "the workload before the peers run, its cached prefixes forgotten when each of its sessions opens "
            "(inside the timed run, as the other peers' set-up is); peak KV = `stats().kv_peak_used_bytes` (blocks "
            "held at the peak since it was built, its warm-up on this workload included; the pool reserves its "
            "capacity up front)"
        ),
        hf_config=(
            f"`model.continuous_batching_context_manager` + `add_request(max_new_tokens=...)` per request, the code "
            "path `generate_batch` wraps (`generate_batch` itself takes one `max_new_tokens` for all requests); "
            f"requests added in the order `generate_batch` uses (sorted by prompt when block sharing is on); "
            f"`ContinuousBatchingConfig(page_size={BLOCK_SIZE}, num_blocks={num_blocks}, max_batch_tokens={budget}, "
            f"max_requests_per_batch={count}, allow_block_sharing=True)`, no warm-up (CUDA-graph capture only), "
            "manager created inside the timed run as `generate_batch` does; peak KV = its preallocated cache tensor "
            "(used blocks at the peak are not exposed)"
        ),
    )
