"""Benchmark 4: many requests sharing a prefix: the :class:`~pagedcore.adapters.transformers.Engine` vs ``generate``
one request at a time, ``generate`` on the padded batch and transformers' own continuous batching."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedModel

from . import engine_peers
from .chart import Panel
from .common import BLOCK_SIZE, bench_model, blocks_for, describe_model, percentile, progress_bar, random_tokens
from .context import BenchContext
from .engine_peers import ENGINE, HF_CONTINUOUS, ONE_AT_A_TIME, PADDED_BATCH, PeerResult
from .floor import ComputeFloor, Segment, compute_floor
from .report import aim_status, machine_info, mib, ratio, section_header, table

__all__ = ["EngineResult", "engine_benchmark", "shared_prefix_segments", "shared_prefix_workload"]

AIM_ENGINE_PREFILL_RATIO = 1.05
AIM_ENGINE_SPEEDUP = {ONE_AT_A_TIME: 3.0, PADDED_BATCH: 3.0, HF_CONTINUOUS: 3.0}
AIM_FLOOR_RATIO = 1.7  # Engine wall / compute floor (issue 13: 4.0 s on the reference 2-core machine)


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
class EngineResult:
    """Requests sharing a prefix served by the Engine and its peers (see :class:`PeerResult`).

    Example:
        >>> peers = [PeerResult("generate, one at a time", wall=6.0, generated_tokens=24),
        ...          PeerResult("pagedcore Engine", wall=1.5, generated_tokens=24)]
        >>> result = EngineResult(quick=True, model="Llama", machine="laptop", prefix_tokens=256,
        ...     unique_lengths=[8, 16], new_tokens=[8, 16], peers=peers, engine_config="", hf_config="",
        ...     floor=ComputeFloor(flops=1e9, rate=1e9, rows=512, tokens=302))
        >>> result.prompt_tokens, result.unique_tokens
        (536, 280)
        >>> result.speedup("generate, one at a time"), result.peer("pagedcore Engine").tokens_per_second
        (4.0, 16.0)
        >>> result.floor_ratio()   # 1.5 s of wall for a 1.0 s floor
        1.5
    """

    quick: bool
    model: str
    machine: str
    prefix_tokens: int
    unique_lengths: list[int]
    new_tokens: list[int]
    peers: list[PeerResult]
    engine_config: str
    hf_config: str
    floor: ComputeFloor | None = None

    def floor_ratio(self) -> float | None:
        """The Engine's wall time / the workload's compute floor (None without either)."""
        wall = self.peer(ENGINE).wall
        return wall / self.floor.seconds if wall and self.floor is not None else None

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

    def markdown(self) -> str:
        """The report: workload, model, machine, per-peer figures and the Engine's ratios with their aims."""
        n = len(self.unique_lengths)
        workload = (
            f"{n} requests: a shared {self.prefix_tokens}-token prefix followed by "
            f"{min(self.unique_lengths)}-{max(self.unique_lengths)} unique tokens, "
            f"{min(self.new_tokens)}-{max(self.new_tokens)} new tokens each (seeded), greedy, eos ignored; all "
            f"requests arrive at once. {self.prompt_tokens} prompt tokens, {self.unique_tokens} unique, "
            f"{sum(self.new_tokens)} tokens to generate"
        )
        measured = (
            "wall time from the start to the last completion, one run per peer after an untimed warm-up of its code "
            "path; tokens/s = the requests' own generated tokens / wall time; latency of a request = its completion "
            "time since the start (one at a time: cumulative; padded batch: every request completes at the end; "
            "continuous batching and Engine: when the request finished). Prefill tokens computed: Engine = "
            "`stats().prompt_tokens_computed`; every peer also cross-checked by counting the positions each model "
            "forward computes (minus one decode position per generated token after the first)."
        )
        head = section_header("4. Continuous batching with a shared prefix", self.quick, workload, self.model,
                              self.machine, measured)  # fmt: skip
        rows = []
        for p in self.peers:
            if p.error is not None:
                rows.append([p.name, p.error, "n/a", "n/a", "n/a", "n/a", "n/a", "n/a"])
                continue
            prefill = "n/a" if p.prefill_computed is None else f"{p.prefill_computed}"
            if p.padding_computed:
                prefill += f" (+{p.padding_computed} padding)"
            kv = "n/a" if p.peak_kv_bytes is None else mib(p.peak_kv_bytes)
            rows.append(
                [
                    p.name,
                    f"{p.wall:.2f} s",
                    f"{p.tokens_per_second:.1f}",
                    f"{percentile(p.latencies, 50):.2f} s",
                    f"{percentile(p.latencies, 99):.2f} s",
                    prefill,
                    f"{kv} ({p.kv_how})",
                    "reference"
                    if p.name == ONE_AT_A_TIME
                    else (f"{len(p.mismatches)} of {n}" if p.mismatches else "0"),
                ]
            )
        figures = table(
            ["peer", "wall", "gen tokens/s", "p50 latency", "p99 latency", "prefill tokens computed", "peak KV",
             "greedy mismatches vs one-at-a-time"],
            rows,
        )  # fmt: skip
        ratio_rows = []
        for name, aim in AIM_ENGINE_SPEEDUP.items():
            s = self.speedup(name)
            ratio_rows.append(
                [
                    f"Engine speedup vs {name} (wall)",
                    "n/a" if s is None else ratio(s),
                    f"≥ {aim:g}x",
                    "n/a" if s is None else aim_status(s >= aim),
                ]
            )
        engine = self.peer(ENGINE)
        if engine.prefill_computed is not None:
            r = engine.prefill_computed / self.unique_tokens
            ratio_rows.append(
                [
                    "Engine prefill tokens computed / unique tokens",
                    f"{r:.3f}",
                    f"≤ {AIM_ENGINE_PREFILL_RATIO:g}",
                    aim_status(r <= AIM_ENGINE_PREFILL_RATIO),
                ]
            )
        floor_ratio = self.floor_ratio()
        if floor_ratio is not None and self.floor is not None:
            ratio_rows.append(
                [
                    f"Engine wall / compute floor ({self.floor.seconds:.2f} s)",
                    ratio(floor_ratio),
                    f"≤ {AIM_FLOOR_RATIO:g}x",
                    aim_status(floor_ratio <= AIM_FLOOR_RATIO),
                ]
            )
        ratios = table(["ratio", "value", "aim", "status"], ratio_rows)
        notes = [f"- Engine: {self.engine_config}.", f"- {HF_CONTINUOUS}: {self.hf_config}."]
        if self.floor is not None:
            notes.append(
                f"- Compute floor: the FLOPs of the positions the workload must compute (the shared prefix once, each "
                f"request's own prompt tokens, each generated token but the last as a decode step; projections, MLP, "
                f"attention over each position's context, the LM head for each sampled row): {self.floor.describe()}."
            )
        notes += [f"- {p.name}: {p.note}" for p in self.peers if p.note]
        mism = [p for p in self.peers if p.mismatches and p.name != ONE_AT_A_TIME]
        notes += [f"- {p.name}: greedy tokens differ from one-at-a-time for requests {p.mismatches}." for p in mism]
        return f"{head}{figures}\n\n{ratios}\n\n" + "\n".join(notes) + "\n"

    def chart_panels(self) -> list[Panel]:
        """The chart's panels: wall time and generated tokens/s per peer (``n/a`` for a peer that could not run)."""
        labels = [p.name.replace("generate, ", "generate\n").replace(" continuous", "\ncontinuous") for p in self.peers]
        walls = [None if p.error is not None else p.wall or 0.0 for p in self.peers]
        rates = [None if p.error is not None else p.tokens_per_second or 0.0 for p in self.peers]
        return [
            Panel("wall time (lower is better)", "s", labels, walls, "{:.2f}"),
            Panel("generated tokens/s (higher is better)", "tok/s", labels, rates, "{:.0f}"),
        ]

    def chart_title(self) -> str:
        """The chart's title: the workload in a few words."""
        suffix = " (quick workload)" if self.quick else ""
        return f"{len(self.unique_lengths)} requests sharing a {self.prefix_tokens}-token prefix{suffix}"


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


def engine_benchmark(
    quick: bool = False, progress: bool = True, *, model: PreTrainedModel | None = None, seed: int = 0
) -> EngineResult:
    """32 requests: a shared 512-token prefix + 16-64 unique tokens, 16-64 new tokens each (quick: 16 requests,
    256-token prefix, 8-32 unique, 8-16 new). Compares the Engine with ``generate`` one request at a time,
    ``generate`` on the left-padded batch and transformers' continuous batching, and the Engine's wall time with the
    workload's compute floor (:mod:`~pagedcore.benchmarks.floor`, measured after the peers); see :class:`EngineResult`.

    Example:
        >>> model = bench_model(quick=True)   # what quick=True builds when no model is given
        >>> model.config.vocab_size
        8000
        >>> result = engine_benchmark(quick=True, progress=False, model=model)  # doctest: +SKIP
        >>> [peer.name for peer in result.peers]  # doctest: +SKIP
        ['generate, one at a time', 'generate, padded batch', 'transformers continuous batching', 'pagedcore Engine']
        >>> result.speedup("generate, one at a time") >= 3.0  # the aim  # doctest: +SKIP
        True
    """
    model = model if model is not None else bench_model(seed, quick=quick)
    prefix_len, prompts, news, warm = shared_prefix_workload(quick, model.config.vocab_size, seed)
    count = len(prompts)
    num_blocks = sum(blocks_for(len(p) + n) for p, n in zip(prompts, news)) + 8
    budget = prefix_len  # tokens per step: 512 (the Engine's default) in the full workload, scaled down with --quick
    machine = machine_info()

    runs: list[tuple[str, Callable[[], PeerResult]]] = [
        (ONE_AT_A_TIME, lambda: engine_peers.one_at_a_time(model, prompts, news, warm, progress)),
        (PADDED_BATCH, lambda: engine_peers.padded_batch(model, prompts, news, warm)),
        (HF_CONTINUOUS, lambda: engine_peers.hf_continuous(model, prompts, news, warm, num_blocks, budget, progress)),
        (ENGINE, lambda: engine_peers.engine(model, prompts, news, warm, num_blocks, budget, progress)),
    ]
    peers: list[PeerResult] = []
    bar = progress_bar(len(runs), "engine benchmark: peers", progress)
    for name, fn in runs:
        bar.set_postfix_str(name)
        try:
            peer = fn()
        except Exception as exc:  # a peer that cannot run keeps its row with the reason
            peer = PeerResult(name, error=f"n/a ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
        peers.append(peer)
        bar.update(1)
    bar.close()
    reference = peers[0].tokens
    for peer in peers:
        if reference is not None and peer.tokens is not None:
            peer.mismatches = [i for i, (a, b) in enumerate(zip(reference, peer.tokens)) if a != b]
        if peer.counted_positions is not None and peer.error is None:
            computed = peer.counted_positions - peer.decode_positions - peer.padding_computed
            if peer.prefill_computed is None:
                peer.prefill_computed = computed
            elif computed != peer.prefill_computed:
                peer.note += f" Forward-hook count of prefill positions: {computed} (differs from its own counter)."
    unique_lengths = [len(p) - prefix_len for p in prompts]
    floor = compute_floor(model, shared_prefix_segments(prefix_len, unique_lengths, news))
    return EngineResult(
        quick=quick,
        model=describe_model(model),
        machine=machine,
        prefix_tokens=prefix_len,
        unique_lengths=unique_lengths,
        new_tokens=news,
        peers=peers,
        floor=floor,
        engine_config=(
            f"block size {BLOCK_SIZE}, {num_blocks} blocks (room for every request without sharing), "
            f"max_num_batched_tokens {budget} (tokens computed per step; the same budget for transformers' continuous "
            f"batching), max_num_seqs {count}, prefix caching on, created inside the timed run; "
            "peak KV = `stats().kv_peak_used_bytes` (blocks held at the peak; the pool reserves its capacity up front)"
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


def run(ctx: BenchContext) -> EngineResult:
    """The registry's entry point: the benchmark on the run's model."""
    return engine_benchmark(ctx.quick, ctx.progress, model=ctx.model(), seed=ctx.options.seed)
