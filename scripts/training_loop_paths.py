"""The Engine's fast paths through what a training loop does to the model it serves (docs/benchmarks.md, "Fast paths
kept through a training loop"): ms per decode step before and after each, in one process.

``python scripts/training_loop_paths.py [THREADS] [MODEL_SIZE]`` (defaults 2, small). Three changes, each applied to
the benchmark model between two measurements:

- ``hidden states``: one call ``model(ids, output_hidden_states=True)`` (a value head's, an embedding call), which
  installs transformers' output recorders on every decoder layer and attention;
- ``checkpointing``: ``gradient_checkpointing_enable()`` and ``train()`` (an RL loop's policy between its
  generations; the benchmark model has no dropout);
- ``update``: an in-place update of every parameter (an optimizer step), after which the first greedy ``generate``
  makes the head screen's int8 copy again (its ms are that first call's, not per step);
- ``lora``: ``get_peft_model`` of the benchmark model with a LoRA (r 8) on q/k/v/o, its weights drawn (a LoRA
  policy): ms per step of the plain model and of the PEFT model, the same decode rows.

Decode rows: a fresh Engine per measurement, ``BATCH`` prompts of 64 random tokens, 64 greedy new tokens (eos
ignored), one untimed run, then the median of 3 runs' wall time per step. The direct layers' steps are printed with
each: 0 means the model's own forward ran. Compare two checkouts with ``PYTHONPATH=<checkout>``.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from typing import Any

import torch

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.benchmarks.common import bench_model

NEW = 64
BATCHES = (1, 16)


def decode_ms(model: Any, rows: int, rng: random.Random, rounds: int = 3) -> tuple[float, int]:
    """Median ms per decode step of a fresh Engine on ``model`` and the direct layers' steps it ran."""
    vocab = model.config.vocab_size
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    with Engine(model, num_blocks=64 + rows * 16, block_size=16, max_num_seqs=max(rows, 2)) as engine:
        engine.generate([[rng.randrange(vocab) for _ in range(64)] for _ in range(rows)], params, use_tqdm=False)
        times = []
        for _ in range(rounds):
            prompts = [[rng.randrange(vocab) for _ in range(64)] for _ in range(rows)]
            started = time.perf_counter()
            engine.generate(prompts, params, use_tqdm=False)
            times.append((time.perf_counter() - started) / NEW * 1000)
        direct = engine.runner._direct  # noqa: SLF001
        return statistics.median(times), 0 if direct is None else direct.counts.steps


def first_greedy_ms(model: Any, rng: random.Random, updates: int = 3) -> tuple[float, list[float], list[float]]:
    """One Engine: a steady greedy ``generate`` (4 prompts x 8 tokens), then per in-place update of every parameter
    the first such call after it and the next one, in ms."""
    vocab = model.config.vocab_size
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)

    def call(engine: Engine) -> float:
        prompts = [[rng.randrange(vocab) for _ in range(32)] for _ in range(4)]
        started = time.perf_counter()
        engine.generate(prompts, params, use_tqdm=False)
        return (time.perf_counter() - started) * 1000

    with Engine(model, num_blocks=256, block_size=16) as engine:
        for _ in range(3):
            call(engine)
        steady = statistics.median(call(engine) for _ in range(3))
        first, then = [], []
        for _ in range(updates):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(1e-6)
            first.append(call(engine))
            then.append(call(engine))
    return steady, first, then


def checkpointing(model: Any) -> Any:
    """``model`` with gradient checkpointing on (transformers' newer name for it where there is one)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    return model


def lora_policy(model: Any) -> Any:
    """``get_peft_model`` of ``model`` with a LoRA of rank 8 on q/k/v/o whose weights are drawn, in eval mode."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False,
                        task_type="CAUSAL_LM")  # fmt: skip
    return get_peft_model(model, config).eval()


def main(argv: list[str]) -> None:
    threads = int(argv[0]) if argv else 2
    size = argv[1] if len(argv) > 1 else "small"
    torch.set_num_threads(threads)
    rng = random.Random(0)
    print(f"{size} model, {threads} threads; ms per decode step (direct layers' steps)")
    model = bench_model(size=size)
    steady, first, then = first_greedy_ms(model, rng)
    print(f"update: first greedy generate after it {', '.join(f'{ms:.0f}' for ms in first)} ms, the next "
          f"{', '.join(f'{ms:.0f}' for ms in then)}, steady {steady:.0f} (4 prompts x 8 tokens)")  # fmt: skip
    changes = {
        "hidden states": lambda m: m(torch.tensor([[1, 2, 3]]), output_hidden_states=True),
        "checkpointing": lambda m: checkpointing(m).train(),
    }
    for name, change in changes.items():
        model = bench_model(size=size)
        before = {rows: decode_ms(model, rows, rng) for rows in BATCHES}
        with torch.no_grad():
            change(model)
        for rows in BATCHES:
            after = decode_ms(model, rows, rng)
            print(f"{name}: batch {rows}: {before[rows][0]:.2f} ms ({before[rows][1]}) before, "
                  f"{after[0]:.2f} ms ({after[1]}) after")  # fmt: skip
    model = bench_model(size=size)
    plain = {rows: decode_ms(model, rows, rng) for rows in BATCHES}
    peft = lora_policy(model)
    for rows in BATCHES:
        ms, steps = decode_ms(peft, rows, rng)
        print(f"lora: batch {rows}: plain model {plain[rows][0]:.2f} ms ({plain[rows][1]}), "
              f"its LoRA policy {ms:.2f} ms ({steps})")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
