"""One pool, several holders: an Engine and ``enable()``d ``generate`` calls on the same pool, from two threads.

The pool's bookkeeping lock (``pool.lock``) is the one lock that guards its blocks for every holder: every change
to a block's state, by the Engine or by a cache, happens while it is held, so both can run at once and the
bookkeeping stays consistent; each keeps the output it has alone.
"""

from __future__ import annotations

import threading

import pytest
import torch
from models import FIRST_TOKEN, VOCAB, tiny_model
from transformers import DynamicCache

from pagedcore import BlockManager
from pagedcore.adapters import transformers as pc
from pagedcore.adapters.transformers import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

_COMMANDS = ("allocate", "retain", "release", "free", "append_slot", "mark_cached", "uncache")


def prompts(seed: int, count: int, shared: int = 9) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    prefix = torch.randint(FIRST_TOKEN, VOCAB, (shared,), generator=rng).tolist()
    return [prefix + torch.randint(FIRST_TOKEN, VOCAB, (3 + i,), generator=rng).tolist() for i in range(count)]


def reference(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, cache=DynamicCache(config=model.config)
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture
def unlocked_changes(monkeypatch):
    """Block-state changes made without the pool's lock, as ``(command, thread name)``, for the pools registered."""
    watched: dict[int, object] = {}  # id(block manager) -> its pool's lock
    seen: list[tuple[str, str]] = []

    def watch(command: str):
        original = getattr(BlockManager, command)

        def checked(self, *args, **kwargs):
            lock = watched.get(id(self))
            if lock is not None and not lock.is_held():
                seen.append((command, threading.current_thread().name))
            return original(self, *args, **kwargs)

        monkeypatch.setattr(BlockManager, command, checked)

    for command in _COMMANDS:
        watch(command)

    def register(pool) -> None:
        for group in pool.kv.groups:
            watched[id(group.block_manager)] = pool.lock

    seen_and_register = (seen, register)
    return seen_and_register


def test_every_block_change_holds_the_pool_lock(unlocked_changes):
    seen, register = unlocked_changes
    model = tiny_model("llama")
    pool = pc.enable(model, num_blocks=128, block_size=4)
    register(pool)
    try:
        work = prompts(0, 4)
        with Engine(model, pool=pool, max_num_batched_tokens=16) as engine:
            engine.generate(work, SamplingParams(max_new_tokens=6), use_tqdm=False)  # chunked prefills, decodes
            rid = engine.add_request(work[0], SamplingParams(max_new_tokens=50))
            engine.step()
            engine.abort(rid)
            engine.step()
        model.generate(torch.tensor([work[1][:12], work[2][:12]]), max_new_tokens=3, do_sample=False)
        out = model.generate(torch.tensor([work[3]]), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        out.cache.release()
    finally:
        pc.disable(model)
    assert not seen, f"block state changed without pool.lock: {sorted(set(seen))}"
    assert pool.kv.num_used_blocks == 0
    pool.check_invariants()


def test_an_engine_and_enabled_generate_share_a_pool_from_two_threads():
    model = tiny_model("llama")
    engine_work, generate_work = prompts(1, 6), prompts(1, 6, shared=9)[::-1]  # the same shared prefix
    want_engine = [reference(model, p, 8) for p in engine_work]
    want_generate = [reference(model, p, 5) for p in generate_work]
    pool = pc.enable(model, num_blocks=96, block_size=4)
    results: dict[str, object] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run_engine(engine: Engine) -> None:
        try:
            start.wait()
            for _ in range(3):
                outs = engine.generate(engine_work, SamplingParams(max_new_tokens=8), use_tqdm=False)
                results.setdefault("engine", []).append([o.token_ids for o in outs])  # type: ignore[union-attr]
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    def run_generate() -> None:
        try:
            start.wait()
            for _ in range(3):
                got = [
                    model.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False)[0, len(p) :].tolist()
                    for p in generate_work
                ]
                results.setdefault("generate", []).append(got)  # type: ignore[union-attr]
        except BaseException as exc:
            errors.append(exc)

    try:
        with Engine(model, pool=pool, max_num_batched_tokens=24) as engine:
            threads = [
                threading.Thread(target=run_engine, args=(engine,), name="engine"),
                threading.Thread(target=run_generate, name="generate"),
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        pc.disable(model)
    assert not errors, errors
    assert results["engine"] == [want_engine] * 3
    assert results["generate"] == [want_generate] * 3
    assert pool.kv.num_used_blocks == 0, "blocks leaked"
    pool.check_invariants()
    assert pool.num_hit_tokens > 0  # they did share: later calls hit what the other holder cached
