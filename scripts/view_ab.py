"""A lone sequence's decode step with its keys read as one view of the pool against the same keys gathered, in one
process (issue 33, stop 54: the BlockManager hands out the lowest free ids first, so a sequence alone gets consecutive
blocks after a prefix-cache reset, where it got them in decreasing order and was gathered).

``python scripts/view_ab.py [0|1]`` (1: ``Engine(compile=True)``): the small benchmark Llama, 2 threads, a 128-token
prompt + 64 new tokens, the prefix cache reset before each run; the gather is forced by making the torch backend's
``contiguous_start`` answer None. Decode ms per step = (the 65-token run - the 1-token run) / their steps' difference;
8 rounds, the two ways alternating, medians; prints whether the greedy tokens were equal.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.benchmarks.common import bench_model
from pagedcore.plugins import torch_backend

ROUNDS = 8


def main() -> None:
    compiled = len(sys.argv) > 1 and sys.argv[1] == "1"
    torch.set_num_threads(2)
    real = torch_backend.contiguous_start
    gather = {"on": False}
    torch_backend.contiguous_start = lambda *a: None if gather["on"] else real(*a)
    engine = Engine(bench_model(size="small"), compile=compiled)
    prompt = [torch.randint(3, 30000, (128,), generator=torch.Generator().manual_seed(0)).tolist()]

    def run(new: int) -> tuple[float, int, list[int]]:
        engine.reset_prefix_cache()
        steps, start = engine.stats().num_steps, time.perf_counter()
        out = engine.generate(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start, engine.stats().num_steps - steps, list(out[0].token_ids)

    for on in (False, True, False, True):  # warm-up (compiles the bucket when compiled)
        gather["on"] = on
        run(65)
    per_step: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, list[int]] = {}
    for r in range(ROUNDS):
        for on in (False, True) if r % 2 == 0 else (True, False):
            gather["on"] = on
            (short, short_steps, _), (long, long_steps, tokens[on]) = run(1), run(65)
            per_step[on].append((long - short) / (long_steps - short_steps) * 1e3)
    view, gathered = statistics.median(per_step[False]), statistics.median(per_step[True])
    print(f"compile={compiled}: view {view:.2f} ms/step, gathered {gathered:.2f} ms/step, gathered/view "
          f"{gathered / view:.3f}, greedy tokens equal: {tokens[False] == tokens[True]}")  # fmt: skip


if __name__ == "__main__":
    main()
