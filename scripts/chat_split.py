"""Where the multi-turn chat's time goes (``pagedcore bench`` section 7's workload): per peer, the forwards that
computed prompts and those that decoded, their count, seconds and rows (issue 33.4: "chat >= 3x the padded batch").

The same 8 conversations x 4 turns (256-token system prompt, 32-96-token user messages, 16-48 new tokens per
reply) as section 7, the benchmark model, one torch thread; each peer once, then again (the second run is printed
after the first, so a warm-up shows). A forward of more than one row per sequence is a prefill forward (the padded
batch's whole prompts; the Engine's uncached prompt positions), the others decode steps.

    python scripts/chat_split.py [--size small] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

from pagedcore.benchmarks import chat
from pagedcore.benchmarks.common import bench_model
from pagedcore.benchmarks.peers import EnginePeer, PaddedBatch, Peer
from pagedcore.benchmarks.steps import Forward, logging_forwards


def split(forwards: list[Forward], rows: int) -> str:
    """Prefill and decode forwards (at most ``rows`` positions: one per conversation): count, seconds, rows."""
    prefill = [f for f in forwards if f.tokens > rows]
    decode = [f for f in forwards if f.tokens <= rows]
    return (
        f"prefill {len(prefill)} forwards {sum(f.seconds for f in prefill):.2f} s "
        f"{sum(f.tokens for f in prefill)} positions; decode {len(decode)} forwards "
        f"{sum(f.seconds for f in decode):.2f} s {sum(f.tokens for f in decode)} rows "
        f"({1e3 * sum(f.seconds for f in decode) / max(len(decode), 1):.1f} ms each)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="the benchmark options' seed (section 7 uses seed + 7)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = bench_model(size=args.size)
    work = chat.section_workload(random.Random(args.seed + 7), model.config.vocab_size, quick=False)
    blocks = chat.engine_blocks(work)
    print(f"# {args.size} model, {args.threads} thread(s); load average {os.getloadavg()[0]:.2f}")
    for _ in range(2):
        peers: list[tuple[str, Peer]] = [
            ("padded batch per turn", PaddedBatch(name="padded")),
            ("Engine", EnginePeer(num_blocks=blocks, max_seqs=work.conversations)),
        ]
        for name, peer in peers:
            with logging_forwards(model) as log:
                timed = chat.serve_chat(model, peer, work)
            print(f"{name}: wall {timed.seconds:.2f} s; {split(log.forwards, work.conversations)}", flush=True)
    print(f"# load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
