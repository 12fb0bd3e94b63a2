"""Benchmark 10: the native CPU engine as the peer to beat. The pagedcore Engine vs CTranslate2 (the same Llama weights
converted with CTranslate2's converter) side by side, the same threads each, on greedy batches: 1 / 16 / 64 requests
of a 128-token prompt + 128 new tokens, 32 requests sharing a 512-token prefix (CTranslate2 with ``static_prompt``),
and one 512-token prompt (time to first token, ms per token).

The equality check comes first: every timed run's greedy tokens against transformers' ``generate`` on the same
batch, request by request; a row whose tokens differ says where. CTranslate2 runs in worker processes
(:mod:`~pagedcore.benchmarks.ct2`), with glibc's malloc tuned as its CPU users tune it and with glibc's defaults;
CTranslate2 int8 is a reference row (its weights are quantized: no aim, no equality expected).
"""

from __future__ import annotations

import contextlib
import math
import random
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from . import ct2
from .common import BLOCK_SIZE, blocks_for, random_tokens
from .context import BenchContext
from .peers import ENGINE, Batch, CTranslate2Peer, EnginePeer, PaddedBatch, Peer, Served, kept_engine
from .report import RATIO_HEADERS, Aim, Header, Reported, Section, Table, package_version, ratio, sentence
from .roofline import MachineLimits, Request, Roofline, machine_limits, roofline
from .runner import Runner, Timed, clock, torch_threads

__all__ = ["CT2_DEFAULT", "CT2_INT8", "CT2_TUNED", "PeerRuns", "PeerWorkload", "PeersResult", "WorkloadRuns", "run",
           "workloads"]  # fmt: skip

CT2_TUNED = "CTranslate2 fp32 (tuned malloc)"
CT2_DEFAULT = "CTranslate2 fp32 (default malloc)"
CT2_INT8 = "CTranslate2 int8 (tuned malloc)"
PEERS = (ENGINE, CT2_TUNED, CT2_DEFAULT, CT2_INT8)
EXACT = (ENGINE, CT2_TUNED, CT2_DEFAULT)  # float32 peers: greedy tokens identical to transformers'
THREADS = 2  # each side's threads unless the run sets --threads
TIMES = "{:g}x"


# ---------------------------------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class PeerWorkload:
    """One workload of the section: its requests, an untimed warm-up batch of the same shape (other tokens), the aim
    of the Engine's tokens/s over CTranslate2 fp32's (tuned malloc), and whether latency is reported.

    Example:
        >>> w = PeerWorkload("batch 2", Batch([[5, 6], [7, 8]], [3, 3]), Batch([[9, 9], [4, 4]], [2, 2]))
        >>> w.generated_tokens, w.aim is None
        (6, True)
    """

    label: str
    batch: Batch
    warm: Batch
    aim: Aim | None = None
    latency: bool = False
    floor_aim: Aim | None = None

    @property
    def generated_tokens(self) -> int:
        """Tokens the requests generate."""
        return sum(self.batch.new_tokens)

    def requests(self) -> list[Request]:
        """The batch as the roofline counts it: several prompts sharing a prefix compute it once (the first
        request), the others from their own tokens on.

        Example:
            >>> w = PeerWorkload("2", Batch([[5, 6, 7], [5, 6, 8]], [3, 3]), Batch([[1], [2]], [2, 2]))
            >>> w.requests()
            [Request(prompt=3, new=3, cached=0), Request(prompt=3, new=3, cached=2)]
        """
        prompts, shared = self.batch.prompts, 0
        if len(prompts) > 1:
            limit = min(len(p) for p in prompts) - 1
            while shared < limit and all(p[shared] == prompts[0][shared] for p in prompts):
                shared += 1
        return [Request(len(p), n, shared if i else 0) for i, (p, n) in enumerate(zip(prompts, self.batch.new_tokens))]


def _requests(rng: random.Random, vocab: int, count: int, shared: int, own: int, new: int) -> Batch:
    """``count`` prompts of a ``shared``-token prefix (0: none) + ``own`` tokens each, ``new`` new tokens each."""
    prefix = random_tokens(rng, shared, vocab)
    return Batch([prefix + random_tokens(rng, own, vocab) for _ in range(count)], [new] * count)


def workloads(quick: bool, vocab: int, seed: int = 0) -> list[PeerWorkload]:
    """The section's seeded workloads (quick: smaller batches and fewer tokens), each with its warm-up batch: the
    same shape with other tokens and 2 new tokens.

    Example:
        >>> [(w.label, w.batch.size, len(w.batch.prompts[0]), w.batch.new_tokens[0]) for w in workloads(False, 32000)]
        ... # doctest: +NORMALIZE_WHITESPACE
        [('batch 1, 128-token prompt + 128 new', 1, 128, 128), ('batch 16, 128-token prompt + 128 new', 16, 128, 128),
         ('batch 64, 128-token prompt + 128 new', 64, 128, 128),
         ('32 x (512 shared + 32 unique), 64 new', 32, 544, 64), ('1 x 512-token prompt, 128 new', 1, 512, 128)]
        >>> [w.aim.text if w.aim else "-" for w in workloads(True, 512)]
        ['≥ 1x', '≥ 1.5x', '≥ 1.5x', '≥ 3x', '-']
    """
    rng = random.Random(seed + 10)
    (prompt, new, sizes), (shared, own, count, shared_new), (long, long_new) = (
        ((32, 16, (1, 4, 8)), (64, 8, 8, 8), (128, 16)) if quick else ((128, 128, (1, 16, 64)), (512, 32, 32, 64),
                                                                        (512, 128)))  # fmt: skip
    aims = (Aim(1.0, at_most=False, fmt=TIMES), Aim(1.5, at_most=False, fmt=TIMES), Aim(1.5, at_most=False, fmt=TIMES))
    floors = (Aim(1.2, fmt=TIMES), Aim(1.5, fmt=TIMES), None)
    out = []
    for size, aim, floor in zip(sizes, aims, floors):
        batch, warm = (_requests(rng, vocab, size, 0, prompt, n) for n in (new, 2))
        out.append(PeerWorkload(f"batch {size}, {prompt}-token prompt + {new} new", batch, warm, aim, size == 1,
                                floor))  # fmt: skip
    batch, warm = (_requests(rng, vocab, count, shared, own, n) for n in (shared_new, 2))
    label = f"{count} x ({shared} shared + {own} unique), {shared_new} new"
    out.append(PeerWorkload(label, batch, warm, Aim(3.0, at_most=False, fmt=TIMES), floor_aim=Aim(1.5, fmt=TIMES)))
    batch, warm = (_requests(rng, vocab, 1, 0, long, n) for n in (long_new, 2))
    out.append(PeerWorkload(f"1 x {long}-token prompt, {long_new} new", batch, warm, latency=True))
    return out


# ---------------------------------------------------------------------------------------------------- results
@dataclass
class PeerRuns:
    """One peer's timed runs of one workload.

    Attributes:
        name: the peer.
        seconds: per run, from the serve call to its last result.
        first_token: per run, seconds to request 0's first token (None where the peer does not stamp it).
        per_token: per run, request 0's seconds per token after its first.
        differ: where the greedy tokens differ from transformers' (None: identical in every run).
        error: why the peer could not run.
        note: the peer's note on its last run.

    Example:
        >>> runs = PeerRuns("pagedcore Engine", seconds=[2.0, 1.0, 4.0], per_token=[0.02, 0.01, 0.03])
        >>> runs.wall, runs.tokens_per_second(128), runs.median_per_token
        (2.0, 64.0, 0.02)
    """

    name: str
    seconds: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    per_token: list[float] = field(default_factory=list)
    differ: str | None = None
    error: str | None = None
    note: str = ""

    @property
    def wall(self) -> float | None:
        """Median seconds (None when the peer could not run)."""
        return statistics.median(self.seconds) if self.seconds and self.error is None else None

    def tokens_per_second(self, tokens: int) -> float | None:
        """``tokens`` per median second."""
        return tokens / self.wall if self.wall else None

    @property
    def median_first_token(self) -> float | None:
        """Median seconds to the first token."""
        return statistics.median(self.first_token) if self.first_token and self.error is None else None

    @property
    def median_per_token(self) -> float | None:
        """Median seconds per token after the first."""
        return statistics.median(self.per_token) if self.per_token and self.error is None else None


@dataclass
class WorkloadRuns:
    """Every peer's runs of one workload, and the reference's error if transformers could not run it.

    Example:
        >>> w = PeerWorkload("batch 1", Batch([[5, 6]], [128]), Batch([[7, 8]], [2]))
        >>> runs = WorkloadRuns(w, {ENGINE: PeerRuns(ENGINE, [2.0]), CT2_TUNED: PeerRuns(CT2_TUNED, [1.0])})
        >>> runs.ratio(CT2_TUNED)   # Engine tokens/s over CTranslate2's: the same tokens in twice the time
        0.5
    """

    workload: PeerWorkload
    runs: dict[str, PeerRuns]
    reference_error: str | None = None
    floor: Roofline | None = None

    def floor_ratio(self, name: str = ENGINE) -> float | None:
        """``name``'s median wall / the workload's roofline floor (None without either)."""
        wall = self.runs[name].wall if name in self.runs else None
        return wall / self.floor.seconds if wall and self.floor is not None else None

    def ratio(self, name: str) -> float | None:
        """The Engine's tokens/s / ``name``'s (None when either could not run)."""
        engine, other = self.runs[ENGINE].wall, self.runs[name].wall if name in self.runs else None
        return other / engine if engine and other else None

    def time_ratio(self, name: str, what: Callable[[PeerRuns], float | None]) -> float | None:
        """The Engine's ``what`` (a time) / ``name``'s."""
        engine, other = what(self.runs[ENGINE]), what(self.runs[name]) if name in self.runs else None
        return engine / other if engine and other else None


def where_differ(reference: list[list[int]], runs: list[list[list[int]]]) -> str | None:
    """Where a peer's tokens (``runs``: one list of requests per run) differ from the reference: the first differing
    run's first differing request and token, and how many requests and runs differ (None: identical everywhere).

    Example:
        >>> ref = [[1, 2, 3], [4, 5, 6]]
        >>> where_differ(ref, [ref, ref]) is None
        True
        >>> where_differ(ref, [ref, [[1, 2, 3], [4, 9, 9]]])
        'differ in 1 of 2 runs: request 1 from token 1'
        >>> where_differ(ref, [[[7, 2, 3], [4, 9, 9]]])
        'differ in 1 of 1 runs: request 0 from token 0 (+1 more requests)'
    """
    differing = [tokens for tokens in runs if tokens != reference]
    if not differing:
        return None
    tokens = differing[0]
    requests = [i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b] or [len(reference)]
    i = requests[0]
    a, b = (reference[i], tokens[i]) if i < len(reference) and i < len(tokens) else ([], [])
    at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    more = f" (+{len(requests) - 1} more requests)" if len(requests) > 1 else ""
    return f"differ in {len(differing)} of {len(runs)} runs: request {i} from token {at}{more}"


@dataclass
class PeersResult(Reported):
    """The section's result: every workload's runs (see :class:`WorkloadRuns`), or why it was skipped.

    Example:
        >>> w = PeerWorkload("batch 1", Batch([[5, 6]], [128]), Batch([[7, 8]], [2]), Aim(1.0, False, "{:g}x"))
        >>> runs = {name: PeerRuns(name, [2.0 if name == ENGINE else 1.0]) for name in PEERS}
        >>> result = PeersResult(Header(True, "Llama", "laptop"), [WorkloadRuns(w, runs)], repeats=1, threads=2)
        >>> result.aim_rows()[0]
        ['Engine / CTranslate2 fp32 (tuned malloc), tokens/s: batch 1', '0.50x', '≥ 1x', '**missed**']
        >>> skipped = PeersResult(Header(True, "Llama", "laptop"), [], 1, 2, skipped="ctranslate2 is not installed")
        >>> "Skipped: ctranslate2 is not installed." in skipped.markdown()
        True
    """

    head: Header
    rows: list[WorkloadRuns]
    repeats: int
    threads: int
    skipped: str | None = None
    configs: list[str] = field(default_factory=list)

    def section(self) -> Section:
        """The report: the equality check, tokens/s and ratios per workload, latency, the aims, the configs."""
        labels = "; ".join(r.workload.label for r in self.rows) or "none run"
        workload = (f"{labels}. Greedy, eos ignored; the requests of a batch submitted together; prompts of seeded "
                    "random tokens")  # fmt: skip
        measured = (
            "the Engine is kept for the workload, as a server keeps it (one Engine, warmed untimed on the workload "
            "itself once: its row split's and head's trials at each row count, and its compiled graphs where it "
            "compiles, are behind it); each CTranslate2 run is a new worker process, its Generator loaded (its "
            "static-prompt cache starts empty); before each timed run the Engine forgets its cached prefixes, and "
            "each side is warmed untimed on a batch of the same shape with other tokens and 2 new tokens, then the "
            "workload is served once, timed from the serve call to its last result; "
            f"{self.repeats} rounds, every peer once per round, the order rotating each round; medians. "
            "tokens/s = generated tokens / median wall; ratio = the Engine's tokens/s / CTranslate2's. Time to first "
            "token: from the serve call to the first token (Engine: `RequestMetrics.first_token_time`; CTranslate2: "
            "stamped by `generate_batch`'s per-token callback in its worker); ms per token: (last token - first) / "
            f"(tokens - 1). {self.threads} threads each: `torch.set_num_threads` for the Engine, `intra_threads` "
            "for CTranslate2 (`inter_threads=1`)"
        )
        title = "10. The native CPU engine: Engine vs CTranslate2"
        if self.skipped is not None:
            return Section(title, self.head, workload, measured, body=[f"Skipped: {sentence(self.skipped)}"])
        body: list[Table | str] = [self._equality(), self._throughput()]
        if any(r.floor is not None for r in self.rows):
            body.append(self._roofline())
        if any(r.workload.latency for r in self.rows):
            body.append(self._latency())
        body.append(Table(RATIO_HEADERS, self.aim_rows()))
        return Section(title, self.head, workload, measured, body=body, notes=self._notes())

    def _equality(self) -> Table:
        rows = []
        for r in self.rows:
            cells = [r.runs[name].error or (f"**{r.runs[name].differ}**" if r.runs[name].differ else "identical")
                     for name in PEERS]  # fmt: skip
            rows.append([r.workload.label, r.reference_error or "reference", *cells])
        caption = ("**Equality check** (first): every timed run's greedy tokens against transformers' `generate` "
                   "(DynamicCache) on the same batch, request by request")  # fmt: skip
        return Table(["workload", "transformers generate", *PEERS[:3], f"{CT2_INT8} (reference: int8 weights)"],
                     rows, caption=caption)  # fmt: skip

    def _throughput(self) -> Table:
        rows = []
        for r in self.rows:
            cells = []
            for name in PEERS:
                runs, rate = r.runs[name], r.runs[name].tokens_per_second(r.workload.generated_tokens)
                cells.append(runs.error or (f"{rate:.0f} tok/s ({runs.wall:.2f} s)" if rate and runs.wall else "n/a"))
            rows.append([r.workload.label, *cells, ratio(r.ratio(CT2_TUNED)), ratio(r.ratio(CT2_DEFAULT)),
                         ratio(r.ratio(CT2_INT8))])  # fmt: skip
        headers = ["workload", *PEERS, "ratio tuned", "ratio default malloc", "ratio int8"]
        return Table(headers, rows, caption="**Generated tokens/s** (median wall); ratio = Engine / CTranslate2")

    def _roofline(self) -> Table:
        rows = []
        for r in (r for r in self.rows if r.floor is not None):
            assert r.floor is not None
            shown = [ratio(r.floor_ratio(name)) for name in (ENGINE, CT2_TUNED)]
            rows.append(
                [
                    r.workload.label,
                    f"{r.floor.seconds:.3f} s",
                    f"{r.floor.compute_seconds:.3f} s",
                    f"{r.floor.memory_seconds:.3f} s",
                    f"{r.floor.memory_bound} of {r.floor.steps}",
                    *shown,
                ]
            )
        caption = ("**Roofline floor** (the least time this machine needs: per step the larger of its FLOPs at the "
                   "best GEMM rate and its bytes at the measured bandwidth, summed; see the notes); ratio = median "
                   "wall / floor")  # fmt: skip
        return Table(["workload", "floor", "FLOPs alone", "bytes alone", "steps bound by memory",
                      f"{ENGINE} / floor", f"{CT2_TUNED} / floor"], rows, caption=caption)  # fmt: skip

    def _latency(self) -> Table:
        def ms(value: float | None) -> str:
            return "n/a" if value is None else f"{value * 1e3:.1f} ms"

        rows = []
        for r in (r for r in self.rows if r.workload.latency):
            for name in PEERS:
                runs = r.runs[name]
                first = r.time_ratio(name, lambda p: p.median_first_token)
                per = r.time_ratio(name, lambda p: p.median_per_token)
                shown = "-" if name == ENGINE else f"{ratio(first)} / {ratio(per)}"
                rows.append([r.workload.label, name, ms(runs.median_first_token), ms(runs.median_per_token), shown])
        return Table(["workload", "peer", "time to first token", "ms per token", "Engine / peer (time)"], rows,
                     caption="**Latency** of one request (medians)")  # fmt: skip

    def aim_rows(self) -> list[list[str]]:
        """The aims' rows: the Engine's tokens/s over CTranslate2 fp32's (tuned malloc), workload by workload."""
        rows = []
        for r in (r for r in self.rows if r.workload.aim is not None):
            assert r.workload.aim is not None
            value = r.ratio(CT2_TUNED)
            label = f"Engine / {CT2_TUNED}, tokens/s: {r.workload.label}"
            rows.append(r.workload.aim.row(label, ratio(value), value))
        for r in (r for r in self.rows if r.workload.floor_aim is not None and r.floor is not None):
            assert r.workload.floor_aim is not None
            value = r.floor_ratio()
            rows.append(r.workload.floor_aim.row(f"Engine wall / roofline floor: {r.workload.label}", ratio(value),
                                                 value))  # fmt: skip
        return rows

    def _notes(self) -> list[str]:
        notes = list(self.configs)
        floors = [r for r in self.rows if r.floor is not None]
        if floors:
            assert floors[0].floor is not None
            notes.append(
                "Roofline floor: the workload's steps as an ideal continuous batcher with the Engine's token budget "
                "runs them (the prompts' uncached positions in budget-sized chunks, a prefix shared by several "
                "prompts once, then one decode step per generated token after the first, every request still "
                "generating a row); per step the larger of its FLOPs (projections, MLP, attention, LM head) at the "
                "best GEMM rate and its bytes (every linear weight and the LM head once, the keys and values of each "
                "sequence's context, the logits written) at the measured bandwidth, both measured in this run: "
                f"{floors[0].floor.limits.describe()}."
            )
        for r in self.rows:
            differ = [name for name in EXACT if r.runs[name].differ]
            if differ:
                notes.append(f"{r.workload.label}: the greedy tokens of {', '.join(differ)} differ from transformers' "
                             "(see the equality check): those ratios compare different work.")  # fmt: skip
        last = {name: r.runs[name].note for r in self.rows for name in PEERS if r.runs[name].note}
        notes += [f"{name}, last run: {sentence(note)}" for name, note in last.items()]
        return notes


# ---------------------------------------------------------------------------------------------------- measuring
def _peers(model_dir: str, threads: int, w: PeerWorkload) -> dict[str, Peer]:
    """The section's peers for ``w``, in report order: the Engine sized for it, CTranslate2 fp32 with the tuned and
    the default malloc, CTranslate2 int8 (tuned)."""
    tokens = [len(p) + n for b in (w.batch, w.warm) for p, n in zip(b.prompts, b.new_tokens)]
    engine = EnginePeer(num_blocks=sum(blocks_for(t) for t in tokens) + 8, max_seqs=max(w.batch.size, w.warm.size))
    return {
        ENGINE: engine,
        CT2_TUNED: CTranslate2Peer(model_dir, "float32", threads, name=CT2_TUNED),
        CT2_DEFAULT: CTranslate2Peer(model_dir, "float32", threads, malloc=None, name=CT2_DEFAULT),
        CT2_INT8: CTranslate2Peer(model_dir, "int8", threads, name=CT2_INT8),
    }


def _timed(model: PreTrainedModel, peer: Peer, w: PeerWorkload) -> Timed:
    """A session of ``peer`` (a new one; the kept Engine's forgets its cached prefixes), warmed on ``w.warm``
    untimed, then ``w.batch`` served once and timed; the output is the :class:`Served`, the first token counted from
    the serve call."""
    with peer.session(model) as serve:
        serve(w.warm)
        start = clock(model.device)
        served = serve(w.batch)
    first = served.first_tokens[0] - start if served.first_tokens else None
    return Timed(served.ended - start, served, first_token=first)


def _per_token(served: Served) -> float | None:
    """Request 0's seconds per token after its first."""
    n = len(served.tokens[0])
    return (served.finished[0] - served.first_tokens[0]) / (n - 1) if served.first_tokens and n > 1 else None


def _runs(name: str, timed: list[Timed], reference: list[list[int]] | None) -> PeerRuns:
    """One peer's :class:`PeerRuns` from its timed runs (an output that is a string: the run failed, and why)."""
    errors = [t.output for t in timed if isinstance(t.output, str)]
    if errors:
        return PeerRuns(name, error=errors[0])
    served: list[Served] = [t.output for t in timed]
    runs = PeerRuns(name, seconds=[t.seconds for t in timed], note=served[-1].note)
    runs.first_token = [t.first_token for t in timed if t.first_token is not None]
    runs.per_token = [x for x in map(_per_token, served) if x is not None]
    if reference is not None:
        runs.differ = where_differ(reference, [s.tokens for s in served])
    return runs


def _measure(runner: Runner, model: PreTrainedModel, peers: dict[str, Peer], w: PeerWorkload, repeats: int,
             ) -> WorkloadRuns:  # fmt: skip
    """The reference tokens (transformers ``generate`` on the batch: its prompts have one length, so no padding),
    the Engine kept for the workload (:func:`~pagedcore.benchmarks.peers.kept_engine`), then ``repeats`` rounds of
    every peer (:func:`_timed`), the order rotating; a peer that fails keeps its reason."""
    runner.label(f"{w.label}: transformers reference")
    reference, reference_error = runner.attempt(lambda: PaddedBatch().serve(model, w.batch).tokens)
    runner.tick()
    with contextlib.ExitStack() as stack:
        engine = peers[ENGINE]
        assert isinstance(engine, EnginePeer)
        runner.label(f"{w.label}: {ENGINE}, warming up on the workload")
        kept, kept_error = runner.attempt(lambda: kept_engine(stack, model, engine, w.batch))
        runner.tick()

        def one(name: str, r: int) -> Timed:
            runner.label(f"{w.label}: {name}, round {r + 1}")
            peer: Peer | None = peers[name] if name != ENGINE else kept  # the Engine: the one kept for the workload
            if peer is None:
                return Timed(math.nan, kept_error)
            timed, error = runner.attempt(lambda: _timed(model, peer, w))
            return timed if timed is not None else Timed(math.nan, error)

        trials = runner.rounds(list(peers), repeats, one)
    return WorkloadRuns(w, {name: _runs(name, trials.runs[name], reference) for name in peers}, reference_error)


def _floor(model: PreTrainedModel, w: PeerWorkload, limits: MachineLimits) -> Roofline:
    """The workload's roofline floor, with the Engine's token budget per step."""
    return roofline(model, w.requests(), limits, EnginePeer().budget)


def _cannot_run(ctx: BenchContext) -> str | None:
    """Why the section cannot run on this run's settings or machine (None: it can)."""
    if ctx.device.type != "cpu" or ctx.dtype != torch.float32:
        return (f"the native CPU engine is compared on the CPU in float32; this run is on {ctx.device} in "
                f"{str(ctx.dtype).removeprefix('torch.')}")  # fmt: skip
    return ct2.missing()


def _configs(threads: int, budget: int) -> list[str]:
    tuned = " ".join(f"`{k}={v}`" for k, v in ct2.TUNED_MALLOC.items())
    return [
        f"Engine: block size {BLOCK_SIZE}, blocks for every request of the workload and its warm-up, max_num_seqs = "
        f"the batch size, max_num_batched_tokens {budget} (its default), prefix caching on; it runs in the benchmark's "
        "process, under its malloc (glibc's defaults unless `PAGEDCORE_MALLOC=tuned` asks `pagedcore bench` to "
        "tune them, `pagedcore.cli.malloc`; the start-up line says which).",
        f"CTranslate2 {package_version('ctranslate2')}: the model saved with `save_pretrained` (with a word-level "
        "tokenizer whose token i is id i) and converted by CTranslate2's converter, `python -m "
        "ctranslate2.converters.transformers --model DIR --output_dir DIR` (the `ct2-transformers-converter` command; "
        f"weights as stored, float32); `Generator(device='cpu', compute_type='float32' | 'int8', intra_threads="
        f"{threads}, inter_threads=1)` in a worker process; `generate_batch(..., include_prompt_in_result=False, "
        "end_token=[], sampling_topk=1, max_length=<new tokens>, callback=...)`, the callback stamping each token and "
        "stopping each request at its own count; prompts that share a prefix pass it as `static_prompt`.",
        f"Tuned malloc: {tuned} in the worker's environment from its start (glibc reads them only then); default "
        "malloc: every `MALLOC_*_` variable removed.",
    ]


def run(ctx: BenchContext, *, repeats: int | None = None) -> PeersResult:
    """The Engine vs CTranslate2 (:func:`workloads`), median of ``repeats`` rounds (default 3; quick 1), each side
    with ``--threads`` threads (default 2); skipped, with the reason, where CTranslate2 is not installed or the run is
    not on the CPU in float32. See :class:`PeersResult`.

    Example:
        >>> from pagedcore.benchmarks import BenchOptions
        >>> ctx = BenchContext(BenchOptions(quick=True, progress=False, model_size="tiny"))
        >>> result = run(ctx)  # doctest: +SKIP
        >>> [r.runs[ENGINE].differ for r in result.rows]  # doctest: +SKIP
        [None, None, None, None, None]
    """
    model, repeats = ctx.model(), repeats or (1 if ctx.quick else 3)
    threads = ctx.options.threads or THREADS
    chosen = workloads(ctx.quick, model.config.vocab_size, ctx.options.seed)
    with Runner(ctx, "peers: Engine vs CTranslate2", 1 + len(chosen) * (2 + repeats * len(PEERS))) as runner:
        head = runner.header()
        reason = _cannot_run(ctx)
        if reason is not None:
            return PeersResult(head, [], repeats, threads, skipped=reason)
        with tempfile.TemporaryDirectory(prefix="pagedcore-ct2-") as root, torch_threads(threads):
            runner.label("converting the model for CTranslate2")
            model_dir, error = runner.attempt(lambda: str(ct2.convert_model(model, root)))
            runner.tick()
            if model_dir is None:
                return PeersResult(head, [], repeats, threads, skipped=f"the conversion failed: {error}")
            runner.label("measuring this machine's GEMM rate and memory bandwidth")
            limits = machine_limits(model)
            rows = [_measure(runner, model, _peers(model_dir, threads, w), w, repeats) for w in chosen]
            for r in rows:
                r.floor = _floor(model, r.workload, limits)
    budget = EnginePeer().budget
    return PeersResult(head, rows, repeats, threads, configs=_configs(threads, budget))
