"""LoRA adapters in the Engine: 32 requests over 4 adapters in mixed batches vs one adapter at a time (issue 31).

``python scripts/lora_mixed.py [THREADS] [--quick]``: the benchmark Llama (``bench_model``, fp32, random weights) and
4 PEFT adapters of it (rank 16 on every linear layer, random weights) saved to a temporary folder and loaded into one
Engine (``enable_lora=True, max_loras=4``). 32 prompts of 64 tokens, 8 per adapter, 32 greedy new tokens each:

- **mixed**: all 32 in one ``generate`` call, the adapters interleaved (each step's one forward mixes them);
- **one at a time**: 4 ``generate`` calls of 8 requests, one adapter each;
- **base**: the same 32 requests without adapters (what the adapters' deltas cost).

The prefix cache is cleared before every run; one untimed warm-up of each mode, then 3 rounds with the modes' order
rotating. Prints each mode's median seconds and generated tokens per second, the mixed/one-at-a-time ratio and
whether mixed and one-at-a-time gave identical tokens.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch
from peft import LoraConfig, get_peft_model

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.benchmarks.common import bench_model

ADAPTERS = ("a", "b", "c", "d")
PER_ADAPTER, PROMPT, NEW = 8, 64, 32
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapters(folder: str, quick: bool) -> dict[str, str]:
    """Each adapter of ``ADAPTERS`` saved with PEFT under ``folder`` (random A and B: each changes the answers)."""
    paths = {}
    for seed, name in enumerate(ADAPTERS):
        torch.manual_seed(100 + seed)
        config = LoraConfig(r=16, lora_alpha=32, target_modules=LINEAR, init_lora_weights=False)
        get_peft_model(bench_model(quick=quick), config).save_pretrained(f"{folder}/{name}")
        paths[name] = f"{folder}/{name}"
    return paths


def run(engine: Engine, mode: str, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    """Seconds for ``mode``'s runs of all the prompts, and their tokens in the prompts' order."""
    params = SamplingParams(max_new_tokens=NEW)  # greedy
    loras = [ADAPTERS[i % len(ADAPTERS)] for i in range(len(prompts))]
    engine.pool.clear_prefix_cache()
    start = time.perf_counter()
    if mode == "mixed":
        outs = engine.generate(prompts, params, lora=loras, use_tqdm=False)
    elif mode == "base":
        outs = engine.generate(prompts, params, use_tqdm=False)
    else:
        outs = [None] * len(prompts)
        for name in ADAPTERS:
            rows = [i for i, lora in enumerate(loras) if lora == name]
            for i, out in zip(rows, engine.generate([prompts[i] for i in rows], params, lora=name, use_tqdm=False)):
                outs[i] = out
    seconds = time.perf_counter() - start
    return seconds, [list(out.token_ids) for out in outs]


def main() -> None:
    threads = int(next((a for a in sys.argv[1:] if a.isdigit()), "1"))
    quick = "--quick" in sys.argv
    torch.set_num_threads(threads)
    model = bench_model(quick=quick)
    g = torch.Generator().manual_seed(0)
    count = PER_ADAPTER * len(ADAPTERS)
    prompts = [torch.randint(3, model.config.vocab_size, (PROMPT,), generator=g).tolist() for _ in range(count)]
    modes = ["mixed", "one at a time", "base"]
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    tokens: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as folder:
        paths = save_adapters(folder, quick)
        with Engine(model, num_blocks=1024, block_size=16, enable_lora=True, max_loras=4, max_num_seqs=32) as engine:
            for name, path in paths.items():
                engine.loras.load(name, path)
            for mode in modes:  # warm-up
                _, tokens[mode] = run(engine, mode, prompts)
            for round_ in range(3):
                for mode in modes[round_:] + modes[:round_]:
                    times[mode].append(run(engine, mode, prompts)[0])
    shape = f"{PROMPT}-token prompts, {NEW} new tokens, {threads} thread(s)"
    print(f"{count} requests over {len(ADAPTERS)} adapters, {shape}")
    for mode in modes:
        median = statistics.median(times[mode])
        print(f"{mode:>14}: {median:.2f} s, {count * NEW / median:.0f} tokens/s  (runs: {times[mode]})")
    ratio = statistics.median(times["one at a time"]) / statistics.median(times["mixed"])
    print(f"mixed is {ratio:.2f}x one adapter at a time")
    print(f"identical tokens, mixed vs one at a time: {tokens['mixed'] == tokens['one at a time']}")
    print(f"adapters change the answers: {tokens['mixed'] != tokens['base']}")


if __name__ == "__main__":
    main()
