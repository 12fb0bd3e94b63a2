"""The start-up heap frozen in a serving process (``pagedcore/cli/gc_heap.py``): garbage collected first, what is
alive frozen, cycles made later still collected, ``PAGEDCORE_GC_FREEZE=0`` honoured; and ``scripts/gc_pauses.py``,
which measures the pauses it removes. Each freeze runs in a subprocess: frozen objects in the test process would
never be collected as cycles again (tests that wait for a model's collection would fail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

CHILD = textwrap.dedent(
    """
    import gc, json, sys, weakref
    from pagedcore.cli.gc_heap import freeze_startup_heap

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    gc.disable()  # no pass of its own before the freeze: only freeze_startup_heap collects the garbage
    garbage = cycle()  # unreachable at once, collectable only as a cycle
    kept = Node(); kept.me = kept  # alive: frozen
    frozen = freeze_startup_heap()
    gc.enable()
    later = cycle()  # made after the freeze: still the collector's
    gc.collect()
    print(json.dumps({"frozen": frozen, "count": gc.get_freeze_count(), "garbage_gone": garbage() is None,
                      "later_gone": later() is None, "kept_frozen": all(o is not kept for o in gc.get_objects())}))
    """
)


def run_child(**env: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env={**ENV, **env},
                          timeout=120, check=True)  # fmt: skip
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_start_up_heap_is_frozen_after_its_garbage_is_collected():
    out = run_child()
    assert out["garbage_gone"] is True  # collected first: never frozen
    assert isinstance(out["frozen"], int) and out["frozen"] > 0 and out["frozen"] == out["count"]
    assert out["kept_frozen"] is True  # the live object left the generations the collector walks
    assert out["later_gone"] is True  # a cycle made after the freeze is collected as before


@pytest.mark.parametrize("value", ["0", " 0 "])
def test_pagedcore_gc_freeze_0_leaves_the_heap_to_the_collector(value):
    out = run_child(PAGEDCORE_GC_FREEZE=value)
    assert out["frozen"] is None and out["count"] == 0 and out["kept_frozen"] is False
    assert out["garbage_gone"] is True and out["later_gone"] is True


def test_the_serve_command_says_when_the_heap_is_left_alone(monkeypatch, capsys):
    from pagedcore.serve import cli

    monkeypatch.setenv("PAGEDCORE_GC_FREEZE", "0")  # so this process's heap is not frozen
    cli._freeze_heap()
    assert capsys.readouterr().err == (
        "pagedcore serve: start-up heap left to the garbage collector (PAGEDCORE_GC_FREEZE=0)\n"
    )


def test_the_pauses_script_measures_both_heaps():
    """``scripts/gc_pauses.py`` (docs/benchmarks.md, "Garbage-collector pauses"), half a second per process."""
    path = ROOT / "scripts" / "gc_pauses.py"
    done = subprocess.run([sys.executable, str(path), "engine", "--seconds", "0.5"], capture_output=True, text=True,
                          env=ENV, timeout=300, check=True)  # fmt: skip
    rows = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert [row["mode"] for row in rows] == ["as is", "frozen"]
    assert rows[0]["frozen"] == 0 and rows[1]["frozen"] > 100_000
    for row in rows:
        assert row["requests"] >= 64 and row["steps"] > 0
        p50, p99, most = row["step_gap_ms"]
        assert 0 < p50 <= p99 <= most


@pytest.mark.parametrize(("name", "frozen"), [("SERVE_REPLICA::app#EngineReplica#a1", True), ("local", False)])
def test_a_ray_serve_replica_freezes_its_start_up_heap_and_a_local_one_does_not(monkeypatch, name, frozen):
    """A Ray Serve replica builds its Engine in Ray's process for it: its start-up heap is frozen as ``pagedcore
    serve``'s is; an ``EngineReplica`` made in a program of its own (``local``) leaves that program's heap alone."""
    pytest.importorskip("ray.serve")
    from pagedcore.serve.ray import EngineReplica, ModelSpec
    from pagedcore.serve.ray import replica as replica_module

    calls: list[str] = []
    monkeypatch.setattr(replica_module, "_replica_name", lambda: name)
    monkeypatch.setattr(replica_module, "freeze_startup_heap", lambda: calls.append("freeze") or 1)
    tiny = ModelSpec(builtin_overrides={"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128})
    replica = EngineReplica(tiny, {"num_blocks": 16, "block_size": 8})
    try:
        assert replica.name == name
        assert calls == (["freeze"] if frozen else [])
    finally:
        replica.shutdown()
