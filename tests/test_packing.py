"""pack_tokens: a decode step's packing (slots from the stacked tables at once) equals the sequence-by-sequence one,
over full, sliding-window and chunked groups, shared prefixes and sequences of every length; a position that is not
held is refused as ``BlockTables.slots`` refuses it."""

from __future__ import annotations

import os
import random

import pytest
import torch

from pagedcore import KVPool, Scheduler, SchedulerConfig, SequenceState
from pagedcore.attention_kinds import ChunkedAttention
from pagedcore.engine import packing
from pagedcore.errors import InvalidBlockError
from pagedcore.scheduler import ScheduledSequence


def _same(a: packing.PackedTokens, b: packing.PackedTokens) -> None:
    assert (a.input_ids, a.position_ids) == (b.input_ids, b.position_ids)
    for x, y in zip(a.metadata, b.metadata, strict=True):
        assert (x.query_lens, x.seq_lens, x.block_offsets) == (y.query_lens, y.seq_lens, y.block_offsets)
        assert torch.equal(x.block_tables, y.block_tables) and x.block_tables.dtype == y.block_tables.dtype
        assert torch.equal(x.slot_mapping, y.slot_mapping) and x.slot_mapping.dtype == y.slot_mapping.dtype
        assert (x.sliding_window, x.pad_block, x.group_kind) == (y.sliding_window, y.pad_block, y.group_kind)


@pytest.mark.parametrize("windows", [(None,), (None, 6), (None, ChunkedAttention(8)), (5,)])
def test_decode_packing_equals_the_row_by_row_packing(windows) -> None:
    rng = random.Random(len(windows))
    kv = KVPool(96, 4, windows)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64))
    shared = [rng.randrange(50) for _ in range(9)]
    for i in range(7):
        prompt = shared + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        sched.add(SequenceState(f"s{i}", prompt, max_new_tokens=rng.randrange(3, 30)))
    decodes = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        items = plan.scheduled
        if all(item.num_new_tokens == 1 for item in items):
            decodes += 1
            _same(packing._pack_decode(items, kv), packing._pack_rows(items, kv))
        sched.update(plan, {item.request_id: [rng.randrange(50)] for item in items if item.sample})
    assert decodes > 10


def test_a_position_not_held_is_refused() -> None:
    kv = KVPool(8, 4)
    sched = Scheduler(kv, SchedulerConfig())
    sched.add(SequenceState("a", [1, 2, 3], max_new_tokens=4))
    plan = sched.schedule()
    sched.update(plan, {"a": [7]})
    (item,) = plan.scheduled
    beyond = ScheduledSequence(item.sequence, 3, 1, True, 1)  # the new token, before a schedule gave it a slot
    with pytest.raises(InvalidBlockError, match="not held"):
        packing._pack_decode([beyond], kv)
    with pytest.raises(InvalidBlockError, match="not held"):
        packing._pack_rows([beyond], kv)


def test_pack_tokens_gathers_from_its_threshold(monkeypatch) -> None:
    kv = KVPool(64, 4)
    sched = Scheduler(kv, SchedulerConfig())
    for i in range(packing.GATHER_FROM):
        sched.add(SequenceState(f"s{i}", [i + 1, 2], max_new_tokens=3))
    plan = sched.schedule()
    sched.update(plan, {item.request_id: [5] for item in plan.scheduled})
    items = sched.schedule().scheduled
    calls: list[int] = []
    real = packing._pack_decode
    monkeypatch.setattr(packing, "_pack_decode", lambda s, k: calls.append(len(s)) or real(s, k))
    _same(packing.pack_tokens(items, kv), packing._pack_rows(items, kv))
    packing.pack_tokens(items[1:], kv)
    assert calls == [packing.GATHER_FROM]


def test_the_host_stages_script_times_every_stage_of_decode_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """``scripts/host_stages.py`` (docs/benchmarks.md, "The host step's bookkeeping") at a small point, with the model
    and with a stand-in forward: every stage of every timed step is a decode step's, and each median is a time."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "host_stages.py"
    spec = importlib.util.spec_from_file_location("host_stages", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from pagedcore.engine.detokenizer import IncrementalDetokenizer

    decoded: list[int] = []
    step = IncrementalDetokenizer.step
    monkeypatch.setattr(IncrementalDetokenizer, "step", lambda self, token: decoded.append(token) or step(self, token))
    for forward, texts in (("model", False), ("stream-small", True)):  # the model; a stand-in, texts decoded
        decoded.clear()
        figures = script.measure("tiny", rows=4, steps=3, forward=forward, tokenizer=texts)
        assert bool(decoded) == texts  # --tokenizer decodes every running sequence's tokens; without it, none
        host = ["host"] if forward == "model" else []  # section 8's host time, from the model's forward hooks
        assert list(figures) == [*script.STAGES, "sum", "cpu-host", "step", *host]
        assert all(value > 0 for value in figures.values())
        assert figures["sum"] >= max(figures[name] for name in script.STAGES)
        assert figures["step"] > figures["sum"]  # the whole step: the forward and the host stages
    with pytest.raises(ValueError, match="forward must be one of"):
        script.measure("tiny", rows=4, steps=3, forward="fast")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--pair runs one process per core: needs two cores")
def test_the_host_stages_script_runs_two_checkouts_at_once_on_swapped_cores() -> None:
    """``scripts/host_stages.py --pair`` (how docs/benchmarks.md compares two checkouts): per round one line per
    checkout, each on its own core, the cores swapped from one round to the next."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("host_stages", root / "scripts" / "host_stages.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = ["--size", "tiny", "--rows", "4", "--steps", "2", "--forward", "stream-small"]
    lines = script.pair([str(root), str(root)], 2, args)
    first, second = sorted(os.sched_getaffinity(0))[:2]
    assert [(r, core) for r, _, core, _ in lines] == [(1, first), (1, second), (2, second), (2, first)]
    assert all("schedule" in line and "cpu-host" in line for *_, line in lines)
    with pytest.raises(SystemExit, match="two checkouts"):
        script.pair([str(root)], 1, args)
