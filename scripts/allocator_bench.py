"""The Engine under each memory allocator a CPU user can pick, side by side (issue 33.2: "measure allocator settings
(glibc malloc thresholds, jemalloc/tcmalloc via the environment) for the Engine process").

Each allocator runs in a fresh worker process of this script (glibc reads its tuning, and ``LD_PRELOAD`` its
replacement, when a process starts), the workers' order rotating from round to round:

- ``glibc``: glibc's malloc with its defaults (every ``MALLOC_*_`` variable removed);
- ``glibc tuned``: the thresholds CPU users of CTranslate2 set (``pagedcore.benchmarks.ct2.TUNED_MALLOC``: freed
  memory kept instead of unmapped, so a step's large tensors reuse pages instead of faulting in new zeroed ones);
- ``glibc mallopt``: what ``PAGEDCORE_MALLOC=tuned`` makes ``pagedcore generate``, ``serve`` and ``bench`` do at
  start-up (:func:`pagedcore.cli.malloc.tune_malloc`: the same settings through ``mallopt`` in the running process);
- ``jemalloc`` / ``tcmalloc``: the library preloaded, where this machine has it (else reported as missing);
- ``... THP`` (e.g. ``glibc THP``): the same with torch's ``THP_MEM_ALLOC_ENABLE=1`` (its CPU allocator asks the
  kernel for transparent huge pages, ``madvise(MADV_HUGEPAGE)``, on every tensor of 2 MiB or more: the weights a
  decode step streams and the step's logits then cross 2 MiB pages, not 4 KiB ones); the worker reports the huge
  pages it got (``AnonHugePages``), which is 0 where the kernel's THP setting is ``never``.

A worker builds the benchmark model (``--size``), then per batch size an untimed warm-up and ``timed`` runs as
``scripts/engine_ab.py`` times them: the prefill alone, and decode ms per step (the difference of a run with
``--new`` new tokens and the prefill-only run, over the difference of their steps), wall time, the page faults of
a prefill-only run (the process's minor faults: fresh pages mapped in) and the process's peak RSS. Prints a table
of medians over the rounds and each allocator's ratio to glibc's defaults, and whether every allocator gave the same
greedy tokens.

    python scripts/allocator_bench.py [--size small] [--threads 1] [--batches 1,16,64] [--rounds 3]
        [--allocators "glibc,glibc THP,tcmalloc,tcmalloc THP"]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

LIBRARIES = {  # the allocators this script preloads, by the file names Debian/Ubuntu install them under
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so.1", "libjemalloc.so"),
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so"),
}
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def find_library(name: str) -> str | None:
    """The path of allocator ``name``'s shared library on this machine, or None."""
    for folder in LIBRARY_DIRS:
        for file in LIBRARIES[name]:
            path = Path(folder) / file
            if path.exists():
                return str(path)
    return None


def allocator_env(name: str) -> dict[str, str] | None:
    """A worker's environment for allocator ``name`` (None: its library is not installed here)."""
    from pagedcore.benchmarks.ct2 import TUNED_MALLOC, worker_env

    if name.endswith(" THP"):
        env = allocator_env(name.removesuffix(" THP"))
        if env is not None:
            env["THP_MEM_ALLOC_ENABLE"] = "1"
        return env
    env = worker_env(TUNED_MALLOC if name == "glibc tuned" else None)
    env.pop("LD_PRELOAD", None)
    env.pop("PAGEDCORE_MALLOC", None)
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    if name == "glibc mallopt":
        env["PAGEDCORE_MALLOC"] = "tuned"
    if name in LIBRARIES:
        library = find_library(name)
        if library is None:
            return None
        env["LD_PRELOAD"] = library
    return env


def huge_pages_mib() -> float:
    """This process's anonymous memory on transparent huge pages now, MiB (0 where the kernel does not say)."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / 1024
    return 0.0


def worker(args: argparse.Namespace) -> None:
    """One allocator's measurements, as one JSON line on stdout."""
    import torch

    from pagedcore.adapters.transformers import Engine, SamplingParams
    from pagedcore.benchmarks.common import bench_model
    from pagedcore.cli.malloc import tune_malloc

    asked = os.environ.get("PAGEDCORE_MALLOC") == "tuned"
    assert tune_malloc().tuned is asked, "the worker's malloc is not the one its name says"
    torch.set_num_threads(args.threads)
    model = bench_model(size=args.size)
    vocab = model.config.vocab_size
    out: dict[str, object] = {"batches": {}}
    with Engine(model, num_blocks=4096, block_size=16, max_num_seqs=256) as engine:

        def run(batch: list[list[int]], new: int) -> tuple[float, int, list[list[int]]]:
            engine.pool.clear_prefix_cache()
            steps, start = engine.stats().num_steps, time.perf_counter()
            outputs = engine.generate(batch, SamplingParams(max_new_tokens=new, ignore_eos=True), use_tqdm=False)
            return time.perf_counter() - start, engine.stats().num_steps - steps, [list(o.token_ids) for o in outputs]

        def faults() -> int:
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

        for size in [int(b) for b in args.batches.split(",")]:
            g = torch.Generator().manual_seed(size)
            batch = [torch.randint(3, vocab, (args.prompt,), generator=g).tolist() for _ in range(size)]
            run(batch, 3)  # warm-up
            decode, prefill, faulted = [], [], []
            for _ in range(args.timed):
                before = faults()
                first, first_steps, _ = run(batch, 1)
                faulted.append(faults() - before)
                whole, whole_steps, tokens = run(batch, args.new)
                decode.append((whole - first) / (whole_steps - first_steps))
                prefill.append(first)
            out["batches"][str(size)] = {  # type: ignore[index]
                "decode_ms": statistics.median(decode) * 1e3,
                "prefill_ms": statistics.median(prefill) * 1e3,
                "prefill_faults": statistics.median(faulted),
                "tokens": tokens,
            }
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["huge_mib"] = huge_pages_mib()
    print(json.dumps(out), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=33)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timed", type=int, default=2, help="timed runs per batch size in each worker")
    parser.add_argument("--allocators", default="glibc,glibc tuned,glibc mallopt,jemalloc,tcmalloc")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    names = [n.strip() for n in args.allocators.split(",")]
    envs = {name: allocator_env(name) for name in names}
    for name, env in envs.items():
        if env is None:
            print(f"# {name}: not installed here ({', '.join(LIBRARIES[name])} in none of {', '.join(LIBRARY_DIRS)})")
    names = [n for n in names if envs[n] is not None]
    print(f"# {args.size} model, {args.threads} thread(s), prompts {args.prompt} + {args.new} new, {args.rounds} "
          f"rounds, wall time; load average {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    passed = [a for a in sys.argv[1:] if a != "--worker"] if argv is None else list(argv)
    results: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            done = subprocess.run([sys.executable, __file__, *passed, "--worker"], env=envs[name], capture_output=True,
                                  text=True, check=False)  # fmt: skip
            if done.returncode != 0:
                print(f"# {name} failed: {done.stderr.strip().splitlines()[-1:]}")
                return 1
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"# round {r + 1} done; load average {os.getloadavg()[0]:.2f}", flush=True)
    batches = args.batches.split(",")
    print("| allocator | " + " | ".join(f"batch {b}: decode ms/step, prefill ms, prefill page faults" for b in batches)
          + " | peak RSS MiB | huge pages MiB | vs glibc (decode) |")  # fmt: skip
    print("|---|" + "---|" * (len(batches) + 3))
    base = {b: statistics.median(r["batches"][b]["decode_ms"] for r in results[names[0]]) for b in batches}
    tokens = {n: [r["batches"][b]["tokens"] for r in results[n] for b in batches] for n in names}
    for name in names:
        cells, ratios = [], []
        for b in batches:
            d = statistics.median(r["batches"][b]["decode_ms"] for r in results[name])
            p = statistics.median(r["batches"][b]["prefill_ms"] for r in results[name])
            f = statistics.median(r["batches"][b]["prefill_faults"] for r in results[name])
            cells.append(f"{d:.2f}, {p:.0f}, {f:.0f}")
            ratios.append(f"{base[b] / d:.2f}x")
        rss = statistics.median(r["peak_rss_mib"] for r in results[name])
        huge = statistics.median(r["huge_mib"] for r in results[name])
        print(f"| {name} | " + " | ".join(cells) + f" | {rss:.0f} | {huge:.0f} | {' / '.join(ratios)} |")
    same = all(t == tokens[names[0]] for t in tokens.values())
    print(f"# greedy tokens identical across allocators: {same}; load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
