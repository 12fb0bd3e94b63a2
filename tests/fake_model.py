"""A fake model for scheduler tests: it stores token ids instead of keys and values, and checks every read.

Each KV group has a "memory" of slots. A step performs the copy-on-write copies, writes each new token's id into
its slot, then checks that every position a query may see (all earlier positions, or the window in a sliding
group) holds the right token in the slot the block table points at. The next token is a deterministic function
of the whole sequence, so a preempted and recomputed sequence must produce exactly what it would have alone.
"""

from __future__ import annotations

from pagedcore import Scheduler, SchedulerOutput, SequenceState

VOCAB = 50


def next_token(tokens: list[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * 31 + t + 7) % 1_000_003
    return h % VOCAB


def reference_output(prompt: list[int], max_new_tokens: int, stop: frozenset[int] = frozenset()) -> list[int]:
    tokens = list(prompt)
    out: list[int] = []
    while len(out) < max_new_tokens:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t in stop:
            break
    return out


class FakeModel:
    def __init__(self, scheduler: Scheduler) -> None:
        pool = scheduler.pool
        self.block_size = pool.block_size
        self.windows = [g.sliding_window for g in pool.groups]
        size = (pool.num_blocks + 1) * pool.block_size
        self.memory: list[list[int | None]] = [[None] * size for _ in pool.groups]

    def step(self, output: SchedulerOutput, samples: dict[str, int] | None = None) -> dict[str, list[int]]:
        bs = self.block_size
        for group, src, dst in output.copies:
            mem = self.memory[group]
            mem[dst * bs : (dst + 1) * bs] = mem[src * bs : (src + 1) * bs]
        sampled: dict[str, list[int]] = {}
        for item in output.scheduled:
            tokens = item.sequence.token_ids
            for g, slots in enumerate(item.slots):
                assert len(slots) == len(item.token_ids)
                for slot, token in zip(slots, item.token_ids):
                    self.memory[g][slot] = token
            for g, window in enumerate(self.windows):
                lo = 0 if window is None else max(0, item.start - window + 1)
                table, offset = item.block_tables[g], item.block_offsets[g]
                for pos in range(lo, item.end):
                    slot = table[pos // bs - offset] * bs + pos % bs
                    assert self.memory[g][slot] == tokens[pos], (
                        f"{item.request_id}: group {g} position {pos} reads {self.memory[g][slot]}, "
                        f"expected {tokens[pos]}"
                    )
            if item.sample:
                first = next_token(tokens[: item.end])
                # Parallel samples get distinct (but deterministic) first tokens.
                sampled[item.request_id] = [(first + k) % VOCAB for k in range(item.num_samples)]
        return sampled


def run_to_completion(sched: Scheduler, model: FakeModel, max_steps: int = 10_000) -> dict[str, SequenceState]:
    """Step until nothing is left, checking the invariants after every step; returns the finished sequences."""
    done: dict[str, SequenceState] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return done
        out = sched.schedule()
        for seq in sched.update(out, model.step(out)):
            done[seq.request_id] = seq
        sched.check_invariants()
    raise AssertionError("did not finish: deadlock or livelock")
