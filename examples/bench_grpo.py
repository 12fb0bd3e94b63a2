"""GRPO rollouts side by side: TRL's default ``generate``, TRL's ``use_transformers_paged`` (transformers' continuous
batching) and pagedcore (``enable()`` on TRL's default path), in one run on one machine (docs/benchmarks.md).
Needs: the `rl` extra (TRL and datasets: `pip install -e '.[rl]'`).

The workload of issue 30: GRPO with G = 8 generations per prompt, 4 prompts per step, prompts of 256 tokens (the
first 64 a system prompt they all share), 64 completion tokens, 5 optimizer steps, on a tiny Llama-shaped model
built from a config (random weights). For each path: rollout seconds per step and the prompt positions the model
computed; greedy completions compared with TRL's default (identical expected), sampled ones with matched seeds
compared by their distribution; stale prefix hits over the 5 steps counted by an audit the trainer tells of each
optimizer step (pagedcore). Then the peak memory of a GRPO step (peak RSS, reset at each step's start) with the
pool asleep during training (``sleep_when_training``) and without.

    python examples/bench_grpo.py              # the full workload (minutes on a laptop CPU)
    python examples/bench_grpo.py --quick      # a smoke run of the same code (seconds)
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

MODES = ("trl", "paged", "pagedcore")
LABELS = {
    "trl": "TRL default generate",
    "paged": "TRL use_transformers_paged",
    "pagedcore": "pagedcore (enable)",
    "trl, seed 1": "TRL default generate, seed 1",
}


def _load_grpo() -> Any:
    path = Path(__file__).resolve().parent / "grpo_trl.py"
    spec = importlib.util.spec_from_file_location("example_grpo_trl", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


grpo = _load_grpo()


class PeakMemory(TrainerCallback):
    """Peak resident memory of each training step (Linux: ``VmHWM``, reset at the step's start through
    ``/proc/self/clear_refs``), and the pool's tensors at the step's end."""

    def __init__(self, pool: Any) -> None:
        self.pool, self.peaks, self.pool_bytes = pool, [], []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.peaks.append(_status("VmHWM"))
        self.pool_bytes.append(self.pool.memory_stats().allocated_bytes if self.pool is not None else 0)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def workload(options: argparse.Namespace) -> dict[str, Any]:
    sizes = {
        "hidden_size": options.hidden,
        "intermediate_size": 3 * options.hidden,
        "num_hidden_layers": options.layers,
    }
    return {
        "steps": options.steps,
        "num_generations": options.generations,
        "prompts_per_step": options.prompts,
        "completion_tokens": options.completion_tokens,
        "learning_rate": 1e-5,
        "pool_tokens": options.pool_tokens,
        "sizes": sizes,
    }


def one_run(
    mode: str, options: argparse.Namespace, *, greedy: bool, sleep: bool = False, memory: bool = False, seed: int = 0
):
    """A GRPO run of ``mode`` from the same initial weights and data; returns the run and the memory callback."""
    settings = workload(options)
    sizes = settings.pop("sizes")
    vocab = options.vocab
    dataset = grpo.prompt_dataset(
        options.steps * options.prompts, options.prompt_tokens, vocab, system_tokens=options.system_tokens, seed=1
    )
    model = grpo.tiny_model(vocab, seed=0, num_attention_heads=4, **sizes)
    peak: list[PeakMemory] = []

    def before_train(trainer: Any, pool: Any) -> None:
        if memory:
            peak.append(PeakMemory(pool))
            trainer.add_callback(peak[0])

    extra = {}
    if mode == "paged":  # sized for the workload: the default sizes its tensors from the free memory (35 s a call)
        extra["transformers_continuous_batching_config"] = {"num_blocks": 64, "max_batch_tokens": 2048}
    run = grpo.train(
        mode, model, grpo.word_tokenizer(vocab), dataset, greedy=greedy, sleep=sleep, before_train=before_train,
        seed=seed, **settings, **extra,
    )  # fmt: skip
    return run, (peak[0] if peak else None)


def _distribution(runs: dict[str, Any]) -> dict[str, str]:
    """Sampled completions of each path against TRL's default: identical rows, and the total variation distance
    between their token frequencies and between each step's mean reward."""
    base = runs["trl"]
    base_tokens = collections.Counter(t for r in base.rollouts for row in r.completions for t in row)
    out = {}
    for mode, run in runs.items():
        rows = [(a, b) for r, s in zip(run.rollouts, base.rollouts) for a, b in zip(r.completions, s.completions)]
        same = sum(a == b for a, b in rows) / max(len(rows), 1)
        tokens = collections.Counter(t for r in run.rollouts for row in r.completions for t in row)
        total, base_total = sum(tokens.values()), sum(base_tokens.values())
        tv = 0.5 * sum(abs(tokens[t] / total - base_tokens[t] / base_total) for t in set(tokens) | set(base_tokens))
        lengths = statistics.mean(len(row) for r in run.rollouts for row in r.completions)
        out[mode] = f"identical rows {same:.0%}, token-frequency TV distance {tv:.3f}, mean length {lengths:.1f}"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--system-tokens", type=int, default=64)
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--pool-tokens", type=int, default=32768, help="the pool's capacity (enable()'s default)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 steps of a small workload")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    parser.add_argument("--memory-run", choices=("kept", "sleep"), help=argparse.SUPPRESS)  # one, in this process
    argv = sys.argv[1:] if argv is None else argv
    options = parser.parse_args(argv)
    if options.quick:
        options.steps, options.generations, options.prompts = 2, 4, 2
        options.prompt_tokens, options.system_tokens, options.completion_tokens = 48, 16, 8
        options.hidden, options.layers, options.vocab, options.pool_tokens = 64, 2, 256, 4096
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if options.memory_run is not None:
        memory_run(options, options.memory_run == "sleep")
        return 0
    print(f"load before: {os.getloadavg()[0]:.2f} (1 min), threads {torch.get_num_threads()}", flush=True)
    print(
        f"workload: G={options.generations}, {options.prompts} prompts/step of {options.prompt_tokens} tokens "
        f"({options.system_tokens} shared), {options.completion_tokens} completion tokens, {options.steps} steps; "
        f"Llama hidden {options.hidden}, {options.layers} layers, 4 heads / 2 KV heads, vocab {options.vocab}, fp32",
        flush=True,
    )
    report(options)
    engine_groups(options)
    if not options.no_memory:
        memory(options, argv)
    print(f"load after: {os.getloadavg()[0]:.2f} (1 min)")
    return 0


def report(options: argparse.Namespace) -> None:
    results: dict[bool, dict[str, Any]] = {}
    for greedy in (True, False):
        results[greedy] = {}
        for mode in MODES:
            started = time.perf_counter()
            run, _ = one_run(mode, options, greedy=greedy)
            results[greedy][mode] = run
            print(f"  ({'greedy' if greedy else 'sampled'} {mode}: {time.perf_counter() - started:.0f} s)", flush=True)
    # The sampling noise to compare distributions against: TRL's default again, with another seed.
    results[False]["trl, seed 1"], _ = one_run("trl", options, greedy=False, seed=1)
    for greedy, runs in results.items():
        print(f"\n{'greedy (do_sample=False)' if greedy else 'sampled (temperature 1, seed 0)'}:")
        base = statistics.mean(r.seconds for r in runs["trl"].rollouts)
        for mode in MODES:
            run = runs[mode]
            seconds = [r.seconds for r in run.rollouts]
            prompt = statistics.mean(r.prompt_positions for r in run.rollouts)
            total = statistics.mean(r.positions for r in run.rollouts)
            mean, median = statistics.mean(seconds), statistics.median(seconds)
            forwards = {k: statistics.mean(r.forward_seconds[k] for r in run.rollouts) for k in ("prompt", "decode")}
            print(
                f"  {LABELS[mode]:28s} rollout {mean:6.2f} s/step (median {median:.2f}; {base / mean:4.2f}x TRL's), "
                f"prompt positions {prompt:7.0f}/step of {total:7.0f}; forwards: prompt {forwards['prompt']:.2f} s, "
                f"decode {forwards['decode']:.2f} s; per step {[round(x, 2) for x in seconds]}"
            )
        pc_run = runs["pagedcore"]
        print(f"  stale prefix hits after each step: {pc_run.stale_after_step}; prefix hits {pc_run.hits_after_step}")
        if greedy:
            for mode in ("paged", "pagedcore"):
                same = [r.completions == s.completions for r, s in zip(runs[mode].rollouts, runs["trl"].rollouts)]
                print(f"  {LABELS[mode]}: completions identical to TRL's default at every step: {all(same)} {same}")
        else:
            for mode, line in _distribution(runs).items():
                print(f"  {LABELS[mode]}: {line}")


def engine_groups(options: argparse.Namespace) -> None:
    """The same groups as separate requests arriving together at an Engine: the prompt tokens it computes."""
    from pagedcore.adapters.transformers import Engine, SamplingParams

    sizes = workload(options)["sizes"]
    model = grpo.tiny_model(options.vocab, seed=0, num_attention_heads=4, **sizes).eval()
    generator = torch.Generator().manual_seed(1)
    draw = lambda n: torch.randint(3, options.vocab, (n,), generator=generator).tolist()  # noqa: E731
    system = draw(options.system_tokens)
    print(f"\nEngine: {options.prompts} prompts x {options.generations} requests arriving together:")
    for length in (options.prompt_tokens, options.prompt_tokens - 6):  # on a block boundary, and 6 tokens short of one
        prompts = [system + draw(length - options.system_tokens) for _ in range(options.prompts)]
        requests = [p for p in prompts for _ in range(options.generations)]
        params = SamplingParams(max_new_tokens=options.completion_tokens, temperature=1.0, seed=0)
        with Engine(model, num_blocks=-(-options.pool_tokens // 16), block_size=16) as engine:
            engine.generate(requests, params, use_tqdm=False)
            computed = engine.scheduler.stats.num_prompt_tokens_computed
        distinct = options.system_tokens + options.prompts * (length - options.system_tokens)
        total = len(requests) * length
        print(f"  prompts of {length}: {computed} prompt tokens computed of {total} (distinct {distinct})")


def memory(options: argparse.Namespace, argv: list[str]) -> None:
    """Each configuration in a fresh process (a process that ran other trainings keeps their freed memory)."""
    print("\npeak memory of a GRPO step (peak RSS from the step's start; the pool's tensors at its end):", flush=True)
    for sleep in (False, True):
        command = [sys.executable, __file__, *argv, "--memory-run", "sleep" if sleep else "kept"]
        lines = subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()
        print(next(line for line in lines if line.startswith("  pool")), flush=True)


def memory_run(options: argparse.Namespace, sleep: bool) -> None:
    _, peak = one_run("pagedcore", options, greedy=False, sleep=sleep, memory=True)
    mib = [round(p / 2**20) for p in peak.peaks]
    pool = [round(b / 2**20, 1) for b in peak.pool_bytes]
    label = "pool asleep during training" if sleep else "pool kept                  "
    print(f"  {label}: peak RSS per step {mib} MiB (max {max(mib)}), pool tensors at step end {pool} MiB")


if __name__ == "__main__":
    raise SystemExit(main())
