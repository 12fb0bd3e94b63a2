"""The Engine's decode step with and without the decode attention kernel (:mod:`pagedcore.plugins.decode_kernel`), in
one process: ms per step, medians, and the ratio.

Per batch size one Engine serves ``--batch`` requests of the benchmark model (seeded random prompts of ``--prompt``
tokens, greedy, eos ignored; with ``--shared N`` every prompt starts with the same ``N`` tokens, computed once by an
earlier request and taken from the prefix cache, where the kernel's absence means the cascade, which reads the shared
blocks once for all rows); after their prefills, rounds of ``--steps`` decode steps alternate between the torch
backend with the kernel (where it serves) and without it (its gather-and-SDPA way), the order swapped every round,
so both ways meet the same sequences, pool and machine noise. The contexts grow by ``--steps`` each round.

    CLOCK=wall python scripts/decode_kernel_ab.py [--batches 1,16,64] [--prompt 128] [--shared 0] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Iterator

import torch

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.benchmarks.common import BLOCK_SIZE, bench_model
from pagedcore.plugins import torch_backend
from pagedcore.plugins.decode_kernel import load


@contextlib.contextmanager
def _kernel(on: bool) -> Iterator[None]:
    """The torch backend with (``on``) or without the decode kernel inside the block."""
    chosen = torch_backend._decode_kernel  # noqa: SLF001
    if not on:
        torch_backend._decode_kernel = lambda *args: None  # noqa: SLF001
    try:
        yield
    finally:
        torch_backend._decode_kernel = chosen  # noqa: SLF001


def measure(batch: int, prompt: int, steps: int, rounds: int, size: str, shared: int = 0) -> dict[str, float]:
    """Median ms per decode step with and without the kernel for one batch size."""
    model = bench_model(size=size)
    vocab = model.config.vocab_size
    rng = random.Random(batch)
    new = steps * 2 * rounds + 8
    blocks = batch * (-(-(prompt + new) // BLOCK_SIZE) + 1) + -(-shared // BLOCK_SIZE) * 2 + 8
    engine = Engine(model, num_blocks=blocks, block_size=BLOCK_SIZE, max_num_seqs=batch, max_num_batched_tokens=512)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    prefix = [rng.randrange(vocab) for _ in range(shared)]
    if shared:
        engine.generate([[*prefix, 1]], SamplingParams(max_new_tokens=1), use_tqdm=False)
    for _ in range(batch):
        engine.add_request(prefix + [rng.randrange(vocab) for _ in range(prompt)], params)
    for _ in range(-(-batch * prompt // 512) + 3):  # the prefills, and a few decode steps
        engine.step()
    times: dict[str, list[float]] = {"kernel": [], "gathers": []}
    for r in range(rounds):
        for name in ("kernel", "gathers") if r % 2 == 0 else ("gathers", "kernel"):
            with _kernel(name == "kernel"):
                engine.step()  # the first step of a way builds its plan
                for _ in range(steps):
                    start = time.perf_counter()
                    engine.step()
                    times[name].append((time.perf_counter() - start) * 1e3)
    engine.close()
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt", type=int, default=128, help="each prompt's own tokens")
    parser.add_argument("--shared", type=int, default=0, help="tokens every prompt starts with (docstring)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per way and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size", default="small", help="benchmark model size (pagedcore.benchmarks MODEL_SIZES)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if load() is None:
        raise SystemExit("the decode kernel is not built here (Linux x86-64, AVX2 + FMA, a C compiler)")
    print(f"torch {torch.__version__}, {args.threads} threads, model {args.size}, prompts {args.prompt} own tokens "
          f"after {args.shared} shared")  # fmt: skip
    print("| batch | with the kernel ms/step | without ms/step | speedup |")
    print("|---:|---:|---:|---:|")
    for batch in (int(b) for b in args.batches.split(",")):
        ms = measure(batch, args.prompt, args.steps, args.rounds, args.size, args.shared)
        speedup = ms["gathers"] / ms["kernel"]
        print(f"| {batch} | {ms['kernel']:.2f} | {ms['gathers']:.2f} | {speedup:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
