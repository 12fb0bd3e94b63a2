"""Benchmark 5: the plain-Python bookkeeping core: block operations, prefix trie, eviction, one scheduler step.

Every figure is the median over several runs; a run times many repetitions with ``time.perf_counter_ns`` (or process
CPU time, ``clock="cpu"``) around the operation alone (setup and clean-up stay outside the timed region), with the
garbage collector paused as ``timeit`` does. Aims: 2 us per block operation, 1 ms per scheduler step. No torch.
"""

from __future__ import annotations

import cProfile
import functools
import gc
import io
import pstats
import random
import statistics
import time
import timeit
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from pagedcore import BlockManager, BlockTables, KVPool, PrefixTrie, Scheduler, SchedulerConfig, SequenceState
from pagedcore.errors import ConfigError

from .context import BenchContext
from .report import QUICK_NOTE, Header, Reported, Section, Table, load_average, machine_info, num_cores

__all__ = ["Clock", "CoreResult", "CoreSettings", "core_benchmark", "profile_report"]

BLOCK_SIZE = 16
BATCH = 64  # blocks per call in the per-block figures
TABLE_TOKENS = 2048  # a sequence of 2k tokens: a table of 128 blocks
AIM_BLOCK_US = 2.0
AIM_STEP_MS = 1.0
CLOCKS: dict[str, Callable[[], int]] = {"wall": time.perf_counter_ns, "cpu": time.process_time_ns}


class Clock:
    """What every timed region reads (wall or process CPU nanoseconds), and the profiler that records the timed
    regions while an operation is re-run for :func:`profile_report`.

    Example:
        >>> clock = Clock("cpu")
        >>> t0 = clock.start()
        >>> clock.stop(t0) >= 0
        True
        >>> Clock("sundial")
        Traceback (most recent call last):
        ...
        pagedcore.errors.ConfigError: clock 'sundial' is not one of cpu, wall
    """

    def __init__(self, kind: str = "wall") -> None:
        if kind not in CLOCKS:
            raise ConfigError(f"clock {kind!r} is not one of {', '.join(sorted(CLOCKS))}")
        self.kind = kind
        self.read = CLOCKS[kind]
        self.profiler: cProfile.Profile | None = None

    def start(self) -> int:
        """Open a timed region (and the profiler, when one is re-running this operation)."""
        if self.profiler is not None:
            self.profiler.enable()
        return self.read()

    def stop(self, t0: int) -> int:
        """Close a timed region; returns its nanoseconds."""
        elapsed = self.read() - t0
        if self.profiler is not None:
            self.profiler.disable()
        return elapsed


@dataclass(frozen=True)
class CoreSettings:
    """How much each figure repeats, and the scheduler step's size.

    Example:
        >>> CoreSettings.for_run(quick=True).runs, CoreSettings.for_run(quick=False, num_seqs=32).num_seqs
        (7, 32)
    """

    runs: int  # runs per figure; the median is reported
    batches: int  # calls of BATCH blocks per run
    calls: int  # calls per run for per-call figures
    decode_steps: int  # timed scheduler steps
    num_seqs: int
    seq_tokens: int

    @classmethod
    def for_run(cls, quick: bool, num_seqs: int = 256, seq_tokens: int = 2048) -> CoreSettings:
        """The quick (a few seconds) or full (about 20 s on an idle machine) settings."""
        if num_seqs < 1 or seq_tokens < 2:
            raise ConfigError(f"scheduler step: need num_seqs >= 1 and seq_tokens >= 2, got {num_seqs}, {seq_tokens}")
        if quick:
            return cls(runs=7, batches=32, calls=5_000, decode_steps=64, num_seqs=num_seqs, seq_tokens=seq_tokens)
        return cls(runs=11, batches=64, calls=20_000, decode_steps=256, num_seqs=num_seqs, seq_tokens=seq_tokens)


@dataclass(frozen=True)
class Figure:
    """One operation's measured cost next to its aim."""

    name: str
    median: float
    spread: str
    unit: str  # "us/block", "us/call", "ms/step", ...
    aim: float | None
    note: str = ""
    rerun: Callable[[], object] | None = None  # runs the operation once more (its timed regions get profiled)

    @property
    def ok(self) -> bool | None:
        """Whether the aim is met (None: no aim)."""
        return None if self.aim is None else self.median <= self.aim


@contextmanager
def no_gc() -> Iterator[None]:
    """The garbage collector paused for the block (after a collection), as ``timeit`` does."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def block_figure(
    name: str, run: Callable[[], tuple[int, int]], s: CoreSettings, note: str = "", unit: str = "us/block"
) -> Figure:
    """Runs ``run`` (which returns ``(elapsed_ns, units)``) ``s.runs`` times; microseconds per unit."""
    samples = []
    for _ in range(s.runs):
        with no_gc():
            elapsed, units = run()
        samples.append(elapsed / units / 1e3)
    spread = f"min {min(samples):.3f}, max {max(samples):.3f}"
    return Figure(name, statistics.median(samples), spread, unit, AIM_BLOCK_US, note, run)


def chain_tokens(rng: random.Random, num_blocks: int, first: int) -> list[int]:
    """Tokens of a chain of ``num_blocks`` full blocks; ``first`` keeps chains apart from their first block on."""
    return [first] + [rng.randrange(32_000) for _ in range(num_blocks * BLOCK_SIZE - 1)]


def cached_chains(bm: BlockManager, trie: PrefixTrie, chains: list[list[int]]) -> list[list[int]]:
    """Allocate and cache a chain of blocks for each token list; the caller holds them once."""
    held = []
    for tokens in chains:
        ids = bm.allocate(len(tokens) // BLOCK_SIZE)
        trie.insert(tokens, ids)
        held.append(ids)
    return held


# ---------------------------------------------------------------- block manager


def bench_block_manager(s: CoreSettings, clock: Clock) -> list[Figure]:
    """Allocation, reference counting and freeing, per block (calls of :data:`BATCH` blocks)."""
    n = BATCH * s.batches
    bm = BlockManager(n, BLOCK_SIZE)
    note = f"calls of {BATCH} blocks"

    def allocate() -> tuple[int, int]:
        return _time_then_free(clock, bm, lambda: [bm.allocate(BATCH) for _ in range(s.batches)], n)

    return [
        block_figure("BlockManager.allocate (free heap)", allocate, s, note),
        block_figure("BlockManager.retain (ref 1 -> 2)", functools.partial(_holders, bm, s, clock, "retain"), s, note),
        block_figure("BlockManager.release (ref 2 -> 1)", functools.partial(_holders, bm, s, clock, "release"), s,
                     note),
        block_figure("BlockManager.release (ref 1 -> 0, to free)", functools.partial(_to_zero, bm, s, clock,
                                                                                     "release"), s, note),
        block_figure("BlockManager.free (ref 1 -> 0, to free)", functools.partial(_to_zero, bm, s, clock, "free"), s,
                     note),
        *_cached_figures(s, clock, note),
    ]  # fmt: skip


def _time_then_free(
    clock: Clock, bm: BlockManager, allocate: Callable[[], list[list[int]]], units: int
) -> tuple[int, int]:
    """Time ``allocate()`` (which returns the block lists it allocated), then free them untimed."""
    t0 = clock.start()
    held = allocate()
    elapsed = clock.stop(t0)
    for ids in held:
        bm.free(ids)
    return elapsed, units


def _holders(bm: BlockManager, s: CoreSettings, clock: Clock, op: str) -> tuple[int, int]:
    """retain (ref 1 -> 2) or release (ref 2 -> 1) of held blocks."""
    held = [bm.allocate(BATCH) for _ in range(s.batches)]
    if op == "release":
        for ids in held:
            bm.retain(ids)
    call = bm.retain if op == "retain" else bm.release
    t0 = clock.start()
    for ids in held:
        call(ids)
    elapsed = clock.stop(t0)
    for ids in held:
        bm.release(ids)
        if op == "retain":
            bm.release(ids)
    return elapsed, BATCH * s.batches


def _to_zero(bm: BlockManager, s: CoreSettings, clock: Clock, op: str) -> tuple[int, int]:
    """release or free of blocks held once: back to the free heap."""
    held = [bm.allocate(BATCH) for _ in range(s.batches)]
    call = bm.release if op == "release" else bm.free
    t0 = clock.start()
    for ids in held:
        call(ids[::-1])
    return clock.stop(t0), BATCH * s.batches


def _cached_figures(s: CoreSettings, clock: Clock, note: str) -> list[Figure]:
    """Releasing cached blocks (to the LRU list), and allocating by evicting them."""
    n = BATCH * s.batches
    bm = BlockManager(n, BLOCK_SIZE)
    trie = PrefixTrie(bm)
    rng = random.Random(0)
    chains = [chain_tokens(rng, BATCH, first=c) for c in range(s.batches)]

    def release_cached() -> tuple[int, int]:
        held = cached_chains(bm, trie, chains)
        t0 = clock.start()
        for ids in held:
            bm.release(ids[::-1])  # tail first, as a finished sequence does
        elapsed = clock.stop(t0)
        trie.clear()
        return elapsed, n

    def evict() -> tuple[int, int]:
        for ids in cached_chains(bm, trie, chains):
            bm.release(ids[::-1])
        assert bm.num_evictable_blocks == n
        return _time_then_free(clock, bm, lambda: [bm.allocate(BATCH) for _ in range(s.batches)], n)

    return [
        block_figure("BlockManager.release (ref 1 -> 0, cached: to LRU)", release_cached, s, note),
        block_figure("allocate with LRU eviction (all evictable)", evict, s, note + "; evicts trie leaves"),
    ]


def bench_append_slot(s: CoreSettings, clock: Clock) -> list[Figure]:
    table_blocks = TABLE_TOKENS // BLOCK_SIZE
    bm = BlockManager(table_blocks + s.calls + 1, BLOCK_SIZE)
    table = bm.allocate(table_blocks)
    half_full = TABLE_TOKENS - BLOCK_SIZE // 2  # last block half full and private: no block needed

    def within_block() -> tuple[int, int]:
        t0 = clock.start()
        for _ in range(s.calls):
            bm.append_slot(table, half_full, 1)
        return clock.stop(t0), s.calls

    def new_block() -> tuple[int, int]:
        def append() -> list[list[int]]:  # each call allocates one block
            return [bm.append_slot(table, TABLE_TOKENS, 1).new_block_ids for _ in range(s.calls)]

        return _time_then_free(clock, bm, append, s.calls)

    pool = KVPool(-(-(TABLE_TOKENS + s.calls) // BLOCK_SIZE) + 1, BLOCK_SIZE)

    def tables() -> tuple[int, int]:
        seq = BlockTables(pool)
        seq.append(TABLE_TOKENS)
        t0 = clock.start()
        for _ in range(s.calls):
            seq.append(1)
        elapsed = clock.stop(t0)
        seq.release()
        return elapsed, s.calls

    note = f"table of {table_blocks} blocks"
    return [
        block_figure("BlockManager.append_slot, decode (no new block)", within_block, s, note, "us/call"),
        block_figure("BlockManager.append_slot, decode (new block)", new_block, s, note, "us/call"),
        block_figure(
            "BlockTables.append(1), decode (amortized)",
            tables,
            s,
            f"what the scheduler calls; a new block every {BLOCK_SIZE} steps",
            "us/call",
        ),
    ]


# ---------------------------------------------------------------- prefix trie


def bench_trie(s: CoreSettings, clock: Clock) -> list[Figure]:
    chain = TABLE_TOKENS // BLOCK_SIZE
    count = max(1, s.batches // 4)  # chains per run
    bm = BlockManager(chain * count, BLOCK_SIZE)
    trie = PrefixTrie(bm)
    rng = random.Random(2)
    chains = [chain_tokens(rng, chain, first=c) for c in range(count)]

    def insert() -> tuple[int, int]:
        held = [bm.allocate(chain) for _ in chains]
        t0 = clock.start()
        for tokens, ids in zip(chains, held):
            trie.insert(tokens, ids)
        elapsed = clock.stop(t0)
        trie.clear()
        for ids in held:
            bm.free(ids)
        return elapsed, chain * count

    def insert_under_parent() -> tuple[int, int]:
        held = [bm.allocate(chain) for _ in chains]
        elapsed = 0
        for tokens, ids in zip(chains, held):
            trie.insert(tokens[:BLOCK_SIZE], ids[:1])
            t0 = clock.start()
            for i in range(1, chain):
                trie.insert(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], ids[i : i + 1], parent=ids[i - 1])
            elapsed += clock.stop(t0)
        trie.clear()
        for ids in held:
            bm.free(ids)
        return elapsed, (chain - 1) * count

    results = [
        block_figure("PrefixTrie.insert (new chain)", insert, s, f"{count} chains of {chain} blocks"),
        block_figure("PrefixTrie.insert (one block under parent)", insert_under_parent, s, "as a growing sequence"),
    ]
    for ids in cached_chains(bm, trie, chains):
        bm.release(ids[::-1])
    repeats = max(1, s.calls // 100)

    def match() -> tuple[int, int]:
        t0 = clock.start()
        for _ in range(repeats):
            for tokens in chains:
                trie.match(tokens)
        return clock.stop(t0), repeats * chain * count

    assert trie.match(chains[0]).num_tokens == TABLE_TOKENS
    return [block_figure("PrefixTrie.match", match, s, f"full hit of {chain} blocks"), *results]


# ---------------------------------------------------------------- scheduler


def _decoding_scheduler(s: CoreSettings, budget: int, max_new: int) -> tuple[Scheduler, float]:
    """A scheduler with ``s.num_seqs`` sequences of ``s.seq_tokens`` tokens, every prefill done (so every step from
    here on is a decode step); the prefill's seconds."""
    blocks_per_seq = -(-(s.seq_tokens + max_new) // BLOCK_SIZE)
    num_blocks = int(s.num_seqs * blocks_per_seq / 0.98) + 1  # + the 1% admission watermark
    sched = Scheduler(KVPool(num_blocks, BLOCK_SIZE), SchedulerConfig(max_num_batched_tokens=budget,
                                                                      max_num_seqs=s.num_seqs))  # fmt: skip
    rng = random.Random(3)
    for i in range(s.num_seqs):
        # Distinct prompts; lengths staggered over a block so block boundaries are crossed on different steps.
        length = s.seq_tokens - i % BLOCK_SIZE
        sched.add(
            SequenceState(f"r{i}", [i, *(rng.randrange(32_000) for _ in range(length - 1))], max_new_tokens=max_new)
        )
    t_prefill = time.perf_counter()
    while sched.num_waiting or any(seq.num_uncomputed_tokens > 1 for seq in sched.sequences()):
        out = sched.schedule()
        sched.update(out, {item.request_id: [7] for item in out.scheduled if item.sample})
    return sched, time.perf_counter() - t_prefill


def bench_scheduler(s: CoreSettings, clock: Clock) -> list[Figure]:
    """One decode step of ``s.num_seqs`` running sequences: ``schedule()`` alone, and with ``update()``."""
    budget, profile_steps = 16_384, 32
    # Sequences whose prefill is done decode while later ones still prefill (decodes go first): leave room for
    # those tokens too, so that nothing finishes or is preempted during the timed (and profiled) steps.
    max_new = s.decode_steps + 2 * profile_steps + s.num_seqs * s.seq_tokens // budget + 2 * BLOCK_SIZE
    sched, prefill_s = _decoding_scheduler(s, budget, max_new)
    sampled = {f"r{i}": [7] for i in range(s.num_seqs)}  # the model's part, prepared once
    schedule_ms: list[float] = []
    step_ms: list[float] = []
    with no_gc():
        for _ in range(s.decode_steps):
            t0 = clock.read()
            out = sched.schedule()
            t1 = clock.read()
            sched.update(out, sampled)
            t2 = clock.read()
            schedule_ms.append((t1 - t0) / 1e6)
            step_ms.append((t2 - t0) / 1e6)
            assert len(out.scheduled) == s.num_seqs and not out.preempted
    assert sched.num_running == s.num_seqs and sched.stats.num_preemptions == 0

    def rerun(whole_step: bool) -> Callable[[], object]:
        def run() -> None:
            for _ in range(profile_steps):
                t0 = clock.start()
                out = sched.schedule()
                if not whole_step:
                    clock.stop(t0)
                sched.update(out, sampled)
                if whole_step:
                    clock.stop(t0)

        return run

    note = f"{s.num_seqs} seqs x {s.seq_tokens} tokens decoding; {s.decode_steps} steps (prefill: {prefill_s:.1f} s)"
    per_seq = statistics.median(step_ms) * 1e3 / s.num_seqs
    return [
        Figure("Scheduler.schedule()", statistics.median(schedule_ms), _spread(schedule_ms), "ms/step", AIM_STEP_MS,
               note, rerun(False)),
        Figure("Scheduler.schedule() + update()", statistics.median(step_ms), _spread(step_ms), "ms/step",
               AIM_STEP_MS, "one decode step of bookkeeping", rerun(True)),
        Figure("... per sequence", per_seq, "", "us/seq", None, "schedule() + update() / sequences"),
    ]  # fmt: skip


def _spread(samples: list[float]) -> str:
    ordered = sorted(samples)
    return f"min {ordered[0]:.3f}, p90 {ordered[int(0.9 * (len(ordered) - 1))]:.3f}, max {ordered[-1]:.3f}"


# ---------------------------------------------------------------- report


def python_speed() -> str:
    """A yardstick for comparing machines: the cost of an empty Python function call."""
    timer = timeit.Timer("f()", "def f(): pass")
    best = min(timer.repeat(5, 200_000)) / 200_000 * 1e9
    return f"an empty function call costs {best:.0f} ns (timeit, best of 5)"


def load_note(load: float | None) -> str:
    """The load average at the start, with a warning when other processes competed for the cores."""
    if load is None:
        return "unknown"
    note = f"{load:.2f} (1-minute average at start, {num_cores()} cores)"
    if load > num_cores() / 2:
        note += ": other processes were competing for the CPU, so figures are inflated (rerun when idle)"
    return note


@dataclass
class CoreResult(Reported):
    """The bookkeeping figures of one run, and how they were taken.

    Example:
        >>> settings = CoreSettings.for_run(quick=True)
        >>> figures = [Figure("BlockManager.allocate (free heap)", 0.05, "min 0.04, max 0.06", "us/block", 2.0),
        ...            Figure("Scheduler.schedule()", 1.5, "", "ms/step", 1.0)]
        >>> result = CoreResult(True, settings, "wall", figures, seconds=1.0, machine="laptop", load=None,
        ...     python_speed="fast")
        >>> result.missed
        ['Scheduler.schedule()']
        >>> print(result.markdown().splitlines()[0])
        ### 5. Bookkeeping core: blocks, prefix trie, scheduler (quick workload)
    """

    quick: bool
    settings: CoreSettings
    clock: str
    figures: list[Figure]
    seconds: float
    machine: str
    load: float | None
    python_speed: str
    timer: Clock | None = field(default=None, repr=False)  # the clock the figures' re-runs read

    @property
    def missed(self) -> list[str]:
        """The operations that missed their aim."""
        return [f.name for f in self.figures if f.ok is False]

    def section(self) -> Section:
        """The report: workload, machine, how it was measured, and one row per operation."""
        s = self.settings
        workload = (
            f"BlockManager, BlockTables and PrefixTrie calls on blocks of {BLOCK_SIZE} tokens (per-block figures: "
            f"calls of {BATCH} blocks; tables of {TABLE_TOKENS} tokens), and one Scheduler step with {s.num_seqs} "
            f"running sequences of {s.seq_tokens} tokens"
        )
        measured = (
            f"median of {s.runs} runs per figure, each timing many repetitions with {CLOCKS[self.clock].__name__} "
            f"around the operation alone (setup and clean-up untimed); gc paused while timing; load "
            f"{load_note(self.load)}; total {self.seconds:.1f} s"
        )
        rows = []
        for f in self.figures:
            aim = "" if f.aim is None else f"<= {f.aim:g}"
            status = "" if f.ok is None else ("ok" if f.ok else "MISSED")
            rows.append([f.name, f"{f.median:.3f}", f.unit, aim, status, f.spread, f.note])
        figures = Table(["operation", "median", "unit", "aim", "status", "spread", "notes"], rows,
                        align=["---", "---:", "---", "---:", "---", "---", "---"])  # fmt: skip
        missed = self.missed
        verdict = f"Missed aims: {'; '.join(missed)}." if missed else "Every aim met."
        header = Header(self.quick, "none: plain-Python bookkeeping (no tensors, no torch)",
                        f"{self.machine}; {self.python_speed}")  # fmt: skip
        return Section(
            "5. Bookkeeping core: blocks, prefix trie, scheduler", header, workload, measured,
            body=[figures, verdict],
            quick_note=QUICK_NOTE.replace("a smaller model and fewer tokens", "fewer repetitions"),
        )  # fmt: skip


def core_benchmark(
    quick: bool = False, *, clock: str = "wall", num_seqs: int = 256, seq_tokens: int = 2048
) -> CoreResult:
    """Time the bookkeeping operations (see the module docstring); ``clock="cpu"`` on a busy machine.

    Example:
        >>> result = core_benchmark(quick=True, num_seqs=4, seq_tokens=64)  # doctest: +SKIP
        >>> result.figures[0].name  # doctest: +SKIP
        'BlockManager.allocate (free heap)'
    """
    timer = Clock(clock)
    settings = CoreSettings.for_run(quick, num_seqs, seq_tokens)
    load = load_average()
    began = time.perf_counter()
    # Each run collects garbage before its timed region; with torch and transformers loaded (a `pagedcore bench` run)
    # a full collection takes ~0.5 s. Freezing what exists now keeps those collections to the benchmark's own objects.
    gc.collect()
    gc.freeze()
    try:
        figures = [
            *bench_block_manager(settings, timer),
            *bench_append_slot(settings, timer),
            *bench_trie(settings, timer),
            *bench_scheduler(settings, timer),
        ]
    finally:
        gc.unfreeze()
    seconds = time.perf_counter() - began
    return CoreResult(quick, settings, clock, figures, seconds, machine_info(), load, python_speed(), timer)


def profile_report(result: CoreResult, top: int = 15) -> str:
    """A cProfile of one more run of each operation that missed its aim, its timed regions only.

    Example:
        >>> profile_report(core_benchmark(quick=True, num_seqs=4, seq_tokens=64))  # doctest: +SKIP
        '\\n## cProfile: PrefixTrie.insert (one block under parent)\\n...'
    """
    sections = []
    for figure in result.figures:
        if figure.ok is not False or figure.rerun is None or result.timer is None:
            continue
        result.timer.profiler = profiler = cProfile.Profile()
        try:
            figure.rerun()
        finally:
            result.timer.profiler = None
        buffer = io.StringIO()
        pstats.Stats(profiler, stream=buffer).strip_dirs().sort_stats("tottime").print_stats(top)
        sections.append(f"\n## cProfile: {figure.name}\n\n```\n{buffer.getvalue().strip()}\n```\n")
    return "".join(sections)


def run(ctx: BenchContext) -> CoreResult:
    """The registry's entry point: the benchmark with the run's quick setting (it uses no model)."""
    return core_benchmark(ctx.quick)
