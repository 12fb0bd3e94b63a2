"""The Engine's decode step with a known family's decoder layers called directly (``direct_layers.py``) against the
model's own forward (``PAGEDCORE_DIRECT_LAYERS=0``), side by side in one process (docs/benchmarks.md, "Decoder
layers called directly").

``python scripts/direct_layers_ab.py [--batches 1,16,64] [--prompt 128] [--rounds 4] [--threads 2] [--size small]``:
two Engines, each on its own copy of the benchmark model (one built with the switch off); per batch size an untimed
warm-up, then ``--rounds`` rounds, the two Engines' order alternating; per round and Engine the prefill alone
(``max_new_tokens=1``) and the same prompts with 40 new tokens (the prefix cache cleared before each): the decode
step is the difference of their ``busy_seconds`` over the difference of their steps. Prints the medians, the ratio
and whether the greedy tokens were identical.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics

import torch
from compile_vs_eager import decode_step  # this folder's (python puts a script's folder first)

from pagedcore.adapters.transformers import Engine
from pagedcore.adapters.transformers.direct_layers import ENV
from pagedcore.benchmarks.common import BLOCK_SIZE, bench_model

NEW = 40


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16,64", help="batch sizes, comma-separated")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per batch size")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--size", default="small", help="benchmark model size")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = bench_model(size=args.size)
    batches = [int(b) for b in args.batches.split(",")]
    engines: dict[str, Engine] = {}
    for name, switch in (("direct", "1"), ("modules", "0")):
        os.environ[ENV] = switch  # read when the runner is built
        engines[name] = Engine(copy.deepcopy(model), num_blocks=max(batches) * 16 + 64, block_size=BLOCK_SIZE,
                               max_num_seqs=max(batches))  # fmt: skip
    os.environ.pop(ENV)
    assert engines["direct"].runner._direct is not None and engines["modules"].runner._direct is None  # noqa: SLF001
    rng = random.Random(0)
    vocab = model.config.vocab_size
    for batch in batches:
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt)] for _ in range(batch)]
        times: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list[list[int]]] = {}
        for round_ in range(args.rounds + 1):
            order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
            for name in order:
                seconds, tokens[name] = decode_step(engines[name], prompts, NEW)
                ms = seconds * 1000
                if round_:  # the first round warms up
                    times[name].append(ms)
        direct, modules = statistics.median(times["direct"]), statistics.median(times["modules"])
        print(
            f"batch {batch}: modules {modules:.2f} ms/step, direct {direct:.2f} ms/step: {modules / direct:.3f}x; "
            f"rounds {[round(t, 2) for t in times['modules']]} vs {[round(t, 2) for t in times['direct']]}; "
            f"same greedy tokens: {tokens['direct'] == tokens['modules']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
