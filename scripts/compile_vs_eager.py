"""Compiled vs eager Engine decode steps, side by side in one process (docs/benchmarks.md, "Compiled decode").

``python scripts/compile_vs_eager.py [THREADS] [MODEL_SIZE] [BATCHES]``: per batch size (``BATCHES``, comma-separated,
default 1,16), an untimed warm-up run that compiles the buckets, then 3 rounds, the two Engines' order alternating;
per round and Engine the prefill alone (``max_new_tokens=1``) and the same prompts with 48 new tokens (prefix cache
cleared before each): the decode step time is the difference of their ``busy_seconds`` over the difference of their
steps. Prints medians, the speedup and whether the greedy tokens were identical. Each Engine runs on its own copy of
the model (until stop 55 both ran on one).
"""

from __future__ import annotations

import copy
import statistics
import sys

import torch

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.benchmarks.common import bench_model

NEW = 48


def prompts(vocab: int, batch: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (128,), generator=g).tolist() for _ in range(batch)]


def decode_step(engine: Engine, batch: list[list[int]], new: int = NEW) -> tuple[float, list[list[int]]]:
    """Seconds per decode step of ``batch`` on ``engine`` over ``new`` tokens, and its greedy tokens (also
    ``scripts/direct_layers_ab.py``'s)."""
    engine.pool.clear_prefix_cache()
    s0 = engine.stats()
    engine.generate(batch, SamplingParams(max_new_tokens=1), use_tqdm=False)
    s1 = engine.stats()
    engine.pool.clear_prefix_cache()
    outputs = engine.generate(batch, SamplingParams(max_new_tokens=new), use_tqdm=False)
    s2 = engine.stats()
    steps = (s2.num_steps - s1.num_steps) - (s1.num_steps - s0.num_steps)
    seconds = (s2.busy_seconds - s1.busy_seconds) - (s1.busy_seconds - s0.busy_seconds)
    return seconds / steps, [list(o.token_ids) for o in outputs]


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    model = bench_model(size=sys.argv[2] if len(sys.argv) > 2 else "small")
    vocab = model.config.vocab_size
    # Each Engine its own copy of the model: an Engine installs its fused head and its linears' forwards on its
    # model's modules, so on a shared model the second Engine would run the first one's (as engine_ab.py).
    models = {"eager": model, "compiled": copy.deepcopy(model)}
    engines = {
        name: Engine(models[name], num_blocks=2048, block_size=16, max_num_seqs=64, compile=flag)
        for name, flag in (("eager", False), ("compiled", True))
    }
    sizes = [int(b) for b in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1, 16]
    for size in sizes:
        for engine in engines.values():
            engine.generate(prompts(vocab, size, 99), SamplingParams(max_new_tokens=NEW), use_tqdm=False)
        times: dict[str, list[float]] = {name: [] for name in engines}
        same = True
        for r in range(3):
            order = list(engines.items()) if r % 2 == 0 else list(reversed(engines.items()))
            tokens = {}
            for name, engine in order:
                seconds, tokens[name] = decode_step(engine, prompts(vocab, size, r))
                times[name].append(seconds)
            same = same and tokens["eager"] == tokens["compiled"]
        eager, compiled = (statistics.median(times[n]) * 1e3 for n in ("eager", "compiled"))
        stats = engines["compiled"].stats()
        print(f"batch {size}: eager {eager:.2f} ms/step, compiled {compiled:.2f} ms/step, speedup "
              f"{eager / compiled:.2f}x, greedy equal {same}; {stats.compiled_graphs} graphs / "
              f"{stats.compiled_buckets} buckets", flush=True)  # fmt: skip
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
