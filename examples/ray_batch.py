"""Offline batch generation with Ray Data: a few thousand prompts, one Engine per worker.

Needs: the `ray` extra (`pip install 'pagedcore[ray]'`, in `all`).

    python examples/ray_batch.py                       # 2000 prompts, 2 workers, the built-in model
    python examples/ray_batch.py --prompts 5000 --workers 4 --model path/to/model --max-new-tokens 64

The prompts share a handful of long prefixes (as instructions or few-shot examples do), so each worker's prefix cache
serves most prompt tokens. Bounded: it generates for ``--prompts`` prompts and stops; it starts a local Ray cluster
unless one is running (``ray.init`` was called, or ``RAY_ADDRESS`` names one), and shuts down what it started.
"""

from __future__ import annotations

import argparse
import random
import time

PREFIXES = 8


def prompts(count: int, seed: int = 0) -> list[str]:
    """``count`` prompts: one of a few long shared prefixes, then a short question of their own."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    prefixes = [f"Instructions {i}: " + "".join(rng.choice(letters) for _ in range(96)) for i in range(PREFIXES)]
    return [f"{prefixes[i % PREFIXES]} Q{i}: " + "".join(rng.choice(letters) for _ in range(8)) for i in range(count)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2, help="Ray Data actors, one Engine each")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--model", default=None, help="checkpoint folder or hub name (default: the built-in model)")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--quick", action="store_true", help="100 prompts of 4 new tokens on one worker")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.workers, args.max_new_tokens = 100, 1, 4

    import ray

    from pagedcore.serve.ray import GenerateBatch, ModelSpec

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(log_to_driver=False)
    try:
        start = time.perf_counter()
        dataset = ray.data.from_items([{"prompt": p} for p in prompts(args.prompts)])
        generated = dataset.map_batches(
            GenerateBatch,
            fn_constructor_kwargs={
                "model": ModelSpec(path=args.model, threads=max(1, int(args.cpus_per_worker))),
                "max_new_tokens": args.max_new_tokens,
                "do_sample": False,
            },
            compute=ray.data.ActorPoolStrategy(size=args.workers),
            batch_size=args.batch_size,
            num_cpus=args.cpus_per_worker,
        )
        rows = generated.select_columns(["generated_token_ids", "num_prompt_tokens", "num_cached_tokens", "error"])
        count = tokens = prompt_tokens = cached = failed = 0
        for batch in rows.iter_batches(batch_size=256):
            count += len(batch["error"])
            failed += sum(bool(error) for error in batch["error"])
            tokens += sum(len(ids) for ids in batch["generated_token_ids"])
            prompt_tokens += int(batch["num_prompt_tokens"].sum())
            cached += int(batch["num_cached_tokens"].sum())
        elapsed = time.perf_counter() - start
    finally:
        if started_ray:
            ray.shutdown()
    print(
        f"{count} prompts ({failed} failed) on {args.workers} workers in {elapsed:.1f} s: {count / elapsed:.1f} "
        f"prompts/s, {tokens / elapsed:.0f} tokens/s; prefix cache served {cached / max(prompt_tokens, 1):.0%} of "
        "the prompt tokens"
    )
    return 0 if failed == 0 and count == args.prompts else 1


if __name__ == "__main__":
    raise SystemExit(main())
