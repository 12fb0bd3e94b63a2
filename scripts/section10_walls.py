"""The Engine alone on section 10's workloads (``pagedcore bench --only peers``), kept and warmed as that section
keeps it, for A/B runs of two trees or two settings in turn: one process per run, so a tree is chosen with
``PYTHONPATH`` (a ``git worktree`` of the parent) and a setting with the environment (``PAGEDCORE_ROW_KERNEL_WIDE=0``).

Per workload: one Engine sized for it and warmed untimed on the workload itself; then ``--serves`` timed serves,
each after an untimed serve of the workload's warm batch (as the section times each peer); prints the workload and
its best wall in seconds, tab-separated.

    python scripts/section10_walls.py [--threads 1] [--only "batch 16,32 x"]
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from transformers import PreTrainedModel

from pagedcore.benchmarks.common import bench_model, blocks_for
from pagedcore.benchmarks.native import PeerWorkload, _timed, workloads
from pagedcore.benchmarks.peers import EnginePeer, EngineSession, Serve, kept_engine


class _Kept:
    """The kept Engine as a peer whose every session is the kept one's (native._timed opens one per serve)."""

    def __init__(self, session: EngineSession) -> None:
        self._session = session

    def session(self, model: PreTrainedModel) -> contextlib.AbstractContextManager[Serve]:
        return self._session.session(model)


def wall(model: PreTrainedModel, w: PeerWorkload, serves: int) -> float:
    tokens = [len(p) + n for b in (w.batch, w.warm) for p, n in zip(b.prompts, b.new_tokens)]
    peer = EnginePeer(num_blocks=sum(blocks_for(t) for t in tokens) + 8, max_seqs=max(w.batch.size, w.warm.size))
    with contextlib.ExitStack() as stack:
        kept = _Kept(kept_engine(stack, model, peer, w.batch))
        return min(_timed(model, kept, w).seconds for _ in range(serves))  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", default="", help="comma-separated starts of workload labels (default: all)")
    parser.add_argument("--serves", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = bench_model()
    starts = [s for s in args.only.split(",") if s]
    for w in workloads(False, model.config.vocab_size):
        if not starts or any(w.label.startswith(s) for s in starts):
            print(f"{w.label}\t{wall(model, w, args.serves):.3f}", flush=True)


if __name__ == "__main__":
    main()
