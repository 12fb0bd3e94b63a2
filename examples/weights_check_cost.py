"""What the weights check costs next to the forward it guards (issue 17.1).

Needs: the `transformers` extra (`make demo` installs it); peft for the LoRA rows (in `test`).

Every ``enable()``d ``generate`` call and every Engine step asks the pool whether the model's weights moved
(``PagedKVPool.check_weights``: version counters, data pointers, optimizer steps, PEFT adapter state, module
structure; each module's settings too at ``enable()``d calls and in Engine steps that may admit a request). This
script times that check on the benchmark model (``pagedcore.benchmarks.common.bench_model``: Llama,
hidden 512, 8 layers, vocab 32k) and on the same model with LoRA adapters on its attention (when ``peft`` is
installed), side by side with one decode forward (one token over a 512-token ``DynamicCache``) and one Engine decode
step of 16 sequences, in one run. Figures are medians over several runs; on a shared machine read the ratios, or
use ``--clock cpu``: this thread's CPU time, with torch on one thread so the forwards run in it too (both sides then
count only their own work, whatever else loads the machine; a forward on one thread takes longer than on several).

    python examples/weights_check_cost.py              # the benchmark model, wall time
    python examples/weights_check_cost.py --clock cpu  # CPU time of this thread (torch on one thread)
    python examples/weights_check_cost.py --quick      # the quick benchmark model, fewer repetitions
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache

from pagedcore.adapters.transformers import Engine, PagedKVPool, SamplingParams
from pagedcore.benchmarks.common import bench_model

CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
_clock = CLOCKS["wall"]


def median_us(fn: Callable[[], object], reps: int, runs: int = 5) -> float:
    """Median over ``runs`` of the mean microseconds of ``fn`` over ``reps`` calls (GC paused, as timeit does)."""
    fn()
    results = []
    gc.disable()
    try:
        for _ in range(runs):
            start = _clock()
            for _ in range(reps):
                fn()
            results.append((_clock() - start) / reps / 1e3)
    finally:
        gc.enable()
    return statistics.median(results)


def check_costs(model: torch.nn.Module, reps: int) -> dict[str, float]:
    """Microseconds of one check: unchanged weights (without the modules' settings, as an Engine step that admits
    no request checks, and with them), after an in-place update, after a registration elsewhere."""
    pool = PagedKVPool(model, num_blocks=16)
    pool.check_weights()  # the first check makes the watch
    watch = pool.weights
    assert watch is not None
    norm = next(p for name, p in model.named_parameters() if name.endswith("norm.weight"))  # a small tensor

    def updated() -> None:
        with torch.no_grad():
            norm.add_(0.0)  # bumps its version counter (a few hundred floats), changes no value
        pool.check_weights()  # sees the move: forgets the (empty) prefix cache

    def rewalked() -> None:
        model.register_buffer("probe", None)  # a registration on the model: the next check walks it again
        watch.check()

    unchanged = median_us(lambda: pool.check_weights(settings=False), reps)
    settings = median_us(pool.check_weights, reps)
    with_update = median_us(updated, max(reps // 4, 1))
    walk = median_us(rewalked, max(reps // 20, 1))
    return {"unchanged": unchanged, "with settings": settings, "after an update": with_update, "full walk": walk}


def decode_ms(model: torch.nn.Module, context: int, reps: int) -> float:
    ids = torch.randint(3, model.config.vocab_size, (1, context))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True)
        step = torch.tensor([[5]])

        def one() -> None:
            model(input_ids=step, cache=cache, use_cache=True)
            cache.crop(-1)  # back to the same context

        return median_us(one, reps, runs=3) / 1e3


def engine_step_ms(model: torch.nn.Module, seqs: int, steps: int) -> float:
    prompts = [torch.randint(3, model.config.vocab_size, (128,)).tolist() for _ in range(seqs)]
    with Engine(model, num_blocks=seqs * 16, block_size=16, max_num_batched_tokens=4096) as engine:
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(max_new_tokens=steps + 2))
        engine.step()  # the prefills
        start = _clock()
        for _ in range(steps):
            engine.step()
        elapsed = (_clock() - start) / steps / 1e6
        while engine.has_unfinished():
            engine.step()
    return elapsed


def with_lora(model: torch.nn.Module) -> torch.nn.Module | None:
    if importlib.util.find_spec("peft") is None:
        return None
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return get_peft_model(model, config).base_model.model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the quick benchmark model, fewer repetitions")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="wall time, or this thread's CPU time")
    args = parser.parse_args(argv)
    global _clock
    _clock = CLOCKS[args.clock]
    if args.clock == "cpu":
        torch.set_num_threads(1)  # the forwards run in this thread, so its CPU time counts them
    reps, steps, context, seqs = (100, 2, 128, 4) if args.quick else (2000, 10, 512, 16)
    model = bench_model(quick=args.quick)
    tensors = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
    decode = decode_ms(model, context, 3 if args.quick else 10)
    step = engine_step_ms(model, seqs, steps)
    rows = [("plain", tensors, check_costs(model, reps))]
    lora = with_lora(bench_model(quick=args.quick))
    if lora is not None:
        lora_tensors = sum(1 for _ in lora.parameters()) + sum(1 for _ in lora.buffers())
        rows.append(("LoRA on q/k/v/o", lora_tensors, check_costs(lora, reps)))
    cfg = model.config
    print(
        f"model: Llama hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}; clock: {args.clock}"
    )
    print(
        f"one decode forward (1 token over {context} cached): {decode:.2f} ms; "
        f"one Engine decode step ({seqs} sequences of 128 tokens): {step:.2f} ms"
    )
    print()
    header = ("model", "tensors", "check, unchanged", "with the settings", "after an update",
              "full walk (after a registration)")  # fmt: skip
    print("| " + " | ".join(header) + " | unchanged / decode forward | unchanged / Engine step |")
    print("|---|---|---|---|---|---|---|---|")
    for name, count, cost in rows:
        unchanged = cost["unchanged"]
        print(
            f"| {name} | {count} | {unchanged:.1f} us | {cost['with settings']:.1f} us | "
            f"{cost['after an update']:.1f} us | {cost['full walk']:.0f} us "
            f"| {unchanged / (decode * 1e3):.2%} | {unchanged / (step * 1e3):.2%} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
