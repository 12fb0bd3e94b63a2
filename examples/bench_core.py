"""Benchmark of the plain-Python bookkeeping core: block operations, prefix trie, eviction, one scheduler step.

Prints a markdown table with the measured cost next to its aim (2 us per block operation, 1 ms per scheduler step)
and the machine it ran on. Every figure is the median over several runs; a run times many repetitions with
``time.perf_counter_ns`` around the operation alone (setup and clean-up stay outside the timed region), with the
garbage collector paused as ``timeit`` does.

Usage:
    python examples/bench_core.py                 # full run (about 20 s on an idle machine)
    python examples/bench_core.py --quick         # fewer repetitions (a few seconds)
    python examples/bench_core.py --out bench.md  # also write the report to a file
    python examples/bench_core.py --profile       # append a cProfile of every operation that misses its aim
    python examples/bench_core.py --clock cpu     # process CPU time instead of wall time (on a busy machine)
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import platform
import pstats
import random
import statistics
import sys
import time
import timeit
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pagedcore import BlockManager, BlockTables, KVPool, PrefixTrie, Scheduler, SchedulerConfig, Sequence

BLOCK_SIZE = 16
BATCH = 64  # blocks per call in the per-block figures
TABLE_TOKENS = 2048  # a sequence of 2k tokens: a table of 128 blocks
AIM_BLOCK_US = 2.0
AIM_STEP_MS = 1.0

CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.process_time_ns}
ns = CLOCKS["wall"]  # what every timed region reads; main() may switch it to process CPU time
_profiler: cProfile.Profile | None = None  # set while an operation is re-run for --profile


def start() -> int:
    """Open a timed region (and the profiler, when one is re-running this operation)."""
    if _profiler is not None:
        _profiler.enable()
    return ns()


def stop(t0: int) -> int:
    """Close a timed region; returns its nanoseconds."""
    elapsed = ns() - t0
    if _profiler is not None:
        _profiler.disable()
    return elapsed


@dataclass(frozen=True)
class Settings:
    runs: int  # runs per figure; the median is reported
    batches: int  # calls of BATCH blocks per run
    calls: int  # calls per run for per-call figures
    decode_steps: int  # timed scheduler steps
    num_seqs: int
    seq_tokens: int


@dataclass(frozen=True)
class Result:
    name: str
    median: float
    spread: str
    unit: str  # "us/block", "us/call", "ms/step", ...
    aim: float | None
    note: str = ""
    rerun: Callable[[], object] | None = None  # runs the operation once more (its timed regions get profiled)

    @property
    def ok(self) -> bool | None:
        return None if self.aim is None else self.median <= self.aim


@contextmanager
def no_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def block_result(
    name: str, run: Callable[[], tuple[int, int]], s: Settings, note: str = "", unit: str = "us/block"
) -> Result:
    """Runs ``run`` (which returns ``(elapsed_ns, units)``) ``s.runs`` times; microseconds per unit."""
    samples = []
    for _ in range(s.runs):
        with no_gc():
            elapsed, units = run()
        samples.append(elapsed / units / 1e3)
    spread = f"min {min(samples):.3f}, max {max(samples):.3f}"
    return Result(name, statistics.median(samples), spread, unit, AIM_BLOCK_US, note, run)


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


def bench_block_manager(s: Settings) -> list[Result]:
    n = BATCH * s.batches
    bm = BlockManager(n, BLOCK_SIZE)

    def allocate() -> tuple[int, int]:
        t0 = start()
        held = [bm.allocate(BATCH) for _ in range(s.batches)]
        elapsed = stop(t0)
        for ids in held:
            bm.free(ids)
        return elapsed, n

    def holders(op: str) -> Callable[[], tuple[int, int]]:
        """retain (ref 1 -> 2) or release (ref 2 -> 1) of held blocks."""

        def run() -> tuple[int, int]:
            held = [bm.allocate(BATCH) for _ in range(s.batches)]
            if op == "release":
                for ids in held:
                    bm.retain(ids)
            call = bm.retain if op == "retain" else bm.release
            t0 = start()
            for ids in held:
                call(ids)
            elapsed = stop(t0)
            for ids in held:
                bm.release(ids)
                if op == "retain":
                    bm.release(ids)
            return elapsed, n

        return run

    def to_zero(op: str) -> Callable[[], tuple[int, int]]:
        """release or free of blocks held once: back to the free stack."""

        def run() -> tuple[int, int]:
            held = [bm.allocate(BATCH) for _ in range(s.batches)]
            call = bm.release if op == "release" else bm.free
            t0 = start()
            for ids in held:
                call(ids[::-1])
            return stop(t0), n

        return run

    cached_bm = BlockManager(n, BLOCK_SIZE)
    trie = PrefixTrie(cached_bm)
    rng = random.Random(0)
    chains = [chain_tokens(rng, BATCH, first=c) for c in range(s.batches)]

    def release_cached() -> tuple[int, int]:
        held = cached_chains(cached_bm, trie, chains)
        t0 = start()
        for ids in held:
            cached_bm.release(ids[::-1])  # tail first, as a finished sequence does
        elapsed = stop(t0)
        trie.clear()
        return elapsed, n

    def evict() -> tuple[int, int]:
        for ids in cached_chains(cached_bm, trie, chains):
            cached_bm.release(ids[::-1])
        assert cached_bm.num_evictable_blocks == n
        t0 = start()
        held = [cached_bm.allocate(BATCH) for _ in range(s.batches)]
        elapsed = stop(t0)
        for ids in held:
            cached_bm.free(ids)
        return elapsed, n

    note = f"calls of {BATCH} blocks"
    return [
        block_result("BlockManager.allocate (free stack)", allocate, s, note),
        block_result("BlockManager.retain (ref 1 -> 2)", holders("retain"), s, note),
        block_result("BlockManager.release (ref 2 -> 1)", holders("release"), s, note),
        block_result("BlockManager.release (ref 1 -> 0, to free)", to_zero("release"), s, note),
        block_result("BlockManager.free (ref 1 -> 0, to free)", to_zero("free"), s, note),
        block_result("BlockManager.release (ref 1 -> 0, cached: to LRU)", release_cached, s, note),
        block_result("allocate with LRU eviction (all evictable)", evict, s, note + "; evicts trie leaves"),
    ]


def bench_append_slot(s: Settings) -> list[Result]:
    table_blocks = TABLE_TOKENS // BLOCK_SIZE
    bm = BlockManager(table_blocks + s.calls + 1, BLOCK_SIZE)
    table = bm.allocate(table_blocks)
    half_full = TABLE_TOKENS - BLOCK_SIZE // 2  # last block half full and private: no block needed

    def within_block() -> tuple[int, int]:
        t0 = start()
        for _ in range(s.calls):
            bm.append_slot(table, half_full, 1)
        return stop(t0), s.calls

    def new_block() -> tuple[int, int]:
        t0 = start()
        out = [bm.append_slot(table, TABLE_TOKENS, 1) for _ in range(s.calls)]  # each allocates one block
        elapsed = stop(t0)
        bm.free([o.new_block_ids[0] for o in out])
        return elapsed, s.calls

    pool = KVPool(-(-(TABLE_TOKENS + s.calls) // BLOCK_SIZE) + 1, BLOCK_SIZE)

    def tables() -> tuple[int, int]:
        seq = BlockTables(pool)
        seq.append(TABLE_TOKENS)
        t0 = start()
        for _ in range(s.calls):
            seq.append(1)
        elapsed = stop(t0)
        seq.release()
        return elapsed, s.calls

    note = f"table of {table_blocks} blocks"
    return [
        block_result("BlockManager.append_slot, decode (no new block)", within_block, s, note, "us/call"),
        block_result("BlockManager.append_slot, decode (new block)", new_block, s, note, "us/call"),
        block_result(
            "BlockTables.append(1), decode (amortized)",
            tables,
            s,
            f"what the scheduler calls; a new block every {BLOCK_SIZE} steps",
            "us/call",
        ),
    ]


# ---------------------------------------------------------------- prefix trie


def bench_trie(s: Settings) -> list[Result]:
    chain = TABLE_TOKENS // BLOCK_SIZE
    count = max(1, s.batches // 4)  # chains per run
    bm = BlockManager(chain * count, BLOCK_SIZE)
    trie = PrefixTrie(bm)
    rng = random.Random(2)
    chains = [chain_tokens(rng, chain, first=c) for c in range(count)]

    def insert() -> tuple[int, int]:
        held = [bm.allocate(chain) for _ in chains]
        t0 = start()
        for tokens, ids in zip(chains, held):
            trie.insert(tokens, ids)
        elapsed = stop(t0)
        trie.clear()
        for ids in held:
            bm.free(ids)
        return elapsed, chain * count

    def insert_under_parent() -> tuple[int, int]:
        held = [bm.allocate(chain) for _ in chains]
        elapsed = 0
        for tokens, ids in zip(chains, held):
            trie.insert(tokens[:BLOCK_SIZE], ids[:1])
            t0 = start()
            for i in range(1, chain):
                trie.insert(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], ids[i : i + 1], parent=ids[i - 1])
            elapsed += stop(t0)
        trie.clear()
        for ids in held:
            bm.free(ids)
        return elapsed, (chain - 1) * count

    results = [
        block_result("PrefixTrie.insert (new chain)", insert, s, f"{count} chains of {chain} blocks"),
        block_result("PrefixTrie.insert (one block under parent)", insert_under_parent, s, "as a growing sequence"),
    ]
    for ids in cached_chains(bm, trie, chains):
        bm.release(ids[::-1])
    repeats = max(1, s.calls // 100)

    def match() -> tuple[int, int]:
        t0 = start()
        for _ in range(repeats):
            for tokens in chains:
                trie.match(tokens)
        return stop(t0), repeats * chain * count

    assert trie.match(chains[0]).num_tokens == TABLE_TOKENS
    return [block_result("PrefixTrie.match", match, s, f"full hit of {chain} blocks"), *results]


# ---------------------------------------------------------------- scheduler


def bench_scheduler(s: Settings) -> list[Result]:
    budget = 16_384
    profile_steps = 32
    # Sequences whose prefill is done decode while later ones still prefill (decodes go first): leave room for
    # those tokens too, so that nothing finishes or is preempted during the timed (and profiled) steps.
    max_new = s.decode_steps + 2 * profile_steps + s.num_seqs * s.seq_tokens // budget + 2 * BLOCK_SIZE
    blocks_per_seq = -(-(s.seq_tokens + max_new) // BLOCK_SIZE)
    num_blocks = int(s.num_seqs * blocks_per_seq / 0.98) + 1  # + the 1% admission watermark
    pool = KVPool(num_blocks, BLOCK_SIZE)
    sched = Scheduler(pool, SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=s.num_seqs))
    rng = random.Random(3)
    for i in range(s.num_seqs):
        # Distinct prompts; lengths staggered over a block so block boundaries are crossed on different steps.
        length = s.seq_tokens - i % BLOCK_SIZE
        sched.add(Sequence(f"r{i}", [i, *(rng.randrange(32_000) for _ in range(length - 1))], max_new_tokens=max_new))
    t_prefill = time.perf_counter()
    while sched.num_waiting or any(seq.num_uncomputed_tokens > 1 for seq in sched.sequences()):
        out = sched.schedule()
        sched.update(out, {item.request_id: [7] for item in out.scheduled if item.sample})
    prefill_s = time.perf_counter() - t_prefill
    sampled = {f"r{i}": [7] for i in range(s.num_seqs)}  # the model's part, prepared once

    schedule_ms: list[float] = []
    step_ms: list[float] = []
    with no_gc():
        for _ in range(s.decode_steps):
            t0 = ns()
            out = sched.schedule()
            t1 = ns()
            sched.update(out, sampled)
            t2 = ns()
            schedule_ms.append((t1 - t0) / 1e6)
            step_ms.append((t2 - t0) / 1e6)
            assert len(out.scheduled) == s.num_seqs and not out.preempted
    assert sched.num_running == s.num_seqs and sched.stats.num_preemptions == 0

    def rerun(whole_step: bool) -> Callable[[], object]:
        def run() -> None:
            for _ in range(profile_steps):
                t0 = start()
                out = sched.schedule()
                if not whole_step:
                    stop(t0)
                sched.update(out, sampled)
                if whole_step:
                    stop(t0)

        return run

    def spread(samples: list[float]) -> str:
        ordered = sorted(samples)
        return f"min {ordered[0]:.3f}, p90 {ordered[int(0.9 * (len(ordered) - 1))]:.3f}, max {ordered[-1]:.3f}"

    note = f"{s.num_seqs} seqs x {s.seq_tokens} tokens decoding; {s.decode_steps} steps (prefill: {prefill_s:.1f} s)"
    per_seq = statistics.median(step_ms) * 1e3 / s.num_seqs
    return [
        Result("Scheduler.schedule()", statistics.median(schedule_ms), spread(schedule_ms), "ms/step", AIM_STEP_MS,
               note, rerun(False)),
        Result("Scheduler.schedule() + update()", statistics.median(step_ms), spread(step_ms), "ms/step",
               AIM_STEP_MS, "one decode step of bookkeeping", rerun(True)),
        Result("... per sequence", per_seq, "", "us/seq", None, "schedule() + update() / sequences"),
    ]  # fmt: skip


# ---------------------------------------------------------------- report


def num_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    python = f"{platform.python_implementation()} {platform.python_version()}"
    return f"{cpu}, {num_cores()} cores available; {python} on {platform.system()} {platform.machine()}"


def python_speed() -> str:
    """A yardstick for comparing machines: the cost of an empty Python function call."""
    timer = timeit.Timer("f()", "def f(): pass")
    best = min(timer.repeat(5, 200_000)) / 200_000 * 1e9
    return f"an empty function call costs {best:.0f} ns (timeit, best of 5)"


def load_note(load: float) -> str:
    note = f"{load:.2f} (1-minute average at start, {num_cores()} cores)"
    if load > num_cores() / 2:
        note += ": other processes were competing for the CPU, so figures are inflated (rerun when idle)"
    return note


def report(results: list[Result], s: Settings, quick: bool, seconds: float, load: float, clock: str) -> str:
    lines = [
        "# pagedcore core benchmark",
        "",
        f"- machine: {machine()}",
        f"- python speed: {python_speed()}",
        f"- load: {load_note(load)}",
        f"- mode: {'quick' if quick else 'full'}: median of {s.runs} runs per figure; block size {BLOCK_SIZE}; "
        f"clock {CLOCKS[clock].__name__}; gc paused while timing; total {seconds:.1f} s",
        "",
        "| operation | median | unit | aim | status | spread | notes |",
        "|---|---:|---|---:|---|---|---|",
    ]
    for r in results:
        aim = "" if r.aim is None else f"<= {r.aim:g}"
        status = "" if r.ok is None else ("ok" if r.ok else "MISSED")
        lines.append(f"| {r.name} | {r.median:.3f} | {r.unit} | {aim} | {status} | {r.spread} | {r.note} |")
    missed = [r.name for r in results if r.ok is False]
    lines += ["", f"Missed aims: {'; '.join(missed)}." if missed else "Every aim met."]
    return "\n".join(lines) + "\n"


def profile_report(result: Result, top: int = 15) -> str:
    """cProfile of one more run of ``result``'s operation, its timed regions only."""
    global _profiler
    assert result.rerun is not None
    _profiler = cProfile.Profile()
    try:
        result.rerun()
        buffer = io.StringIO()
        pstats.Stats(_profiler, stream=buffer).strip_dirs().sort_stats("tottime").print_stats(top)
    finally:
        _profiler = None
    return f"\n## cProfile: {result.name}\n\n```\n{buffer.getvalue().strip()}\n```\n"


def main(argv: list[str] | None = None) -> int:
    global ns
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a few seconds)")
    parser.add_argument("--out", type=Path, help="also write the markdown report to this file")
    parser.add_argument("--profile", action="store_true", help="append a cProfile of each operation missing its aim")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="wall time (default) or CPU time")
    parser.add_argument("--num-seqs", type=int, default=256, help="running sequences in the scheduler step")
    parser.add_argument("--seq-tokens", type=int, default=2048, help="tokens per sequence in the scheduler step")
    args = parser.parse_args(argv)
    ns = CLOCKS[args.clock]
    if args.quick:
        settings = Settings(runs=7, batches=32, calls=5_000, decode_steps=64, num_seqs=args.num_seqs,
                            seq_tokens=args.seq_tokens)  # fmt: skip
    else:
        settings = Settings(runs=11, batches=64, calls=20_000, decode_steps=256, num_seqs=args.num_seqs,
                            seq_tokens=args.seq_tokens)  # fmt: skip

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    began = time.perf_counter()
    results = [*bench_block_manager(settings), *bench_append_slot(settings), *bench_trie(settings)]
    results += bench_scheduler(settings)
    text = report(results, settings, args.quick, time.perf_counter() - began, load, args.clock)
    if args.profile:
        text += "".join(profile_report(r) for r in results if r.ok is False and r.rerun is not None)
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
