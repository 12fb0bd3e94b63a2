"""Two Engine settings side by side on ``pagedcore bench``'s multi-turn chat (section 7), in one process, with the
padded batch per turn as the section's reference.

``python scripts/chat_ab.py --a row_kernel=False --b row_kernel=True [--rounds 5] [--threads 2]``: the section's
workload (8 conversations x 4 turns, seed 0 + 7 as the section's), the small benchmark model; each side one Engine
kept for every round (as the section keeps it) on its own copy of the model, warmed untimed on the chat itself; then
``--rounds`` rounds, each running the padded batch and both sides (the sides' order alternating), every run a
session that first forgets the cached prefixes. Prints each side's median wall, its speedup over the padded batch's
median (the section's figure), B's speedup over A round by round, and whether every reply of both sides equals the
padded batch's. Wall time; this box's other load moves all three alike within a round.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import random
import statistics
import sys
from dataclasses import dataclass
from typing import Any

import torch
from engine_ab import settings

from pagedcore.adapters.transformers import Engine
from pagedcore.benchmarks import chat
from pagedcore.benchmarks.common import BLOCK_SIZE, bench_model
from pagedcore.benchmarks.peers import EnginePeer, PaddedBatch


@dataclass(frozen=True)
class SetEngine(EnginePeer):
    """The section's Engine with extra keyword arguments."""

    extra: Any = None

    def engine(self, model: Any) -> Engine:
        return Engine(model, num_blocks=self.num_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=self.budget,
                      max_num_seqs=self.max_seqs, **(self.extra or {}))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="")
    parser.add_argument("--b", default="")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = bench_model(size="small")
    work = chat.section_workload(random.Random(7), model.config.vocab_size, quick=False)
    blocks = chat.engine_blocks(work)
    padded = PaddedBatch(name="padded")
    print(f"# A = {args.a or 'defaults'}, B = {args.b or 'defaults'}; {args.threads} threads; load "
          f"{os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    walls: dict[str, list[float]] = {"padded": [], "A": [], "B": []}
    replies: dict[str, list[Any]] = {"padded": [], "A": [], "B": []}
    with contextlib.ExitStack() as stack:
        sides = {}
        for side, text in (("A", args.a), ("B", args.b)):
            peer = SetEngine(num_blocks=blocks, max_seqs=work.conversations, extra=settings(text))
            own = copy.deepcopy(model)  # an Engine installs its forwards on its model's layers
            sides[side] = (own, stack.enter_context(peer.kept(own)))
            chat.serve_chat(own, sides[side][1], work)  # warm-up, untimed
        chat.serve_chat(model, padded, work)
        for r in range(args.rounds):
            order = ["padded", "A", "B"] if r % 2 == 0 else ["padded", "B", "A"]
            for name in order:
                own, peer = (model, padded) if name == "padded" else sides[name]
                timed = chat.serve_chat(own, peer, work)
                walls[name].append(timed.seconds)
                replies[name].append(timed.output.replies)
            pad, a, b = walls["padded"][-1], walls["A"][-1], walls["B"][-1]
            print(f"round {r}: padded {pad:.2f} s, A {a:.2f} s, B {b:.2f} s (A / B {a / b:.2f}x); load "
                  f"{os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    reference = statistics.median(walls["padded"])
    same = all(r == replies["padded"][0] for name in ("A", "B") for r in replies[name])
    for name in ("A", "B"):
        wall = statistics.median(walls[name])
        print(f"{name}: median {wall:.2f} s (min {min(walls[name]):.2f}), {reference / wall:.2f}x the padded batch's "
              f"{reference:.2f} s")  # fmt: skip
    ratios = [a / b for a, b in zip(walls["A"], walls["B"], strict=True)]
    print(f"A / B per round: median {statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)}); "
          f"replies identical to the padded batch's: {same}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
