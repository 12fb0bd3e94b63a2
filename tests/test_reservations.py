"""Reservations: a call that passed its capacity check can never run out of blocks half-way.

Before reservations the check reserved nothing: two ``enable()``d calls in two threads, each needing 12 of a
pool's 20 blocks, both passed it, and one raised ``OutOfBlocksError`` inside transformers' decode loop after it had
streamed tokens (a ``TextIteratorStreamer`` consumer then waited for ever); an Engine admitting requests on the same
pool took the blocks an ``enable()``d call was counting on, and an ``enable()``d call took the blocks the Engine's
running request needed to grow. Each test below failed that way on the code before the fix.

Now ``KVPool.reserve`` holds a call's worst case (``KVPool.worst_case``) from its check to its end: a second call
that cannot reserve is refused before it generates anything (its streamer is ended), the Engine admits only into
unreserved blocks, and an ``enable()``d call cannot reserve what the Engine's running requests still need.
"""

from __future__ import annotations

import threading

import pytest
import torch
from models import FIRST_TOKEN, VOCAB, tiny_model, tiny_tokenizer
from paged_checks import dynamic
from transformers import TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

from pagedcore import OutOfBlocksError
from pagedcore.adapters import transformers as pc
from pagedcore.adapters.transformers import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4
PROMPT, NEW = 13, 36  # 13 + 36 - 1 = 48 stored positions: 12 blocks of 4


def prompt(seed: int, length: int = PROMPT) -> list[int]:
    return torch.randint(FIRST_TOKEN, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model, tokens: list[int], max_new: int) -> list[int]:
    out = model.generate(torch.tensor([tokens]), max_new_tokens=max_new, do_sample=False, cache=dynamic(model))
    return out[0, len(tokens) :].tolist()


class Lockstep(BaseStreamer):
    """Counts what generate streams; with a barrier, two calls advance one forward at a time together."""

    def __init__(self, barrier: threading.Barrier | None = None, on_put=None) -> None:
        self.barrier = barrier
        self.on_put = on_put
        self.puts = 0
        self.ended = False

    def put(self, value) -> None:
        self.puts += 1
        if self.on_put is not None:
            self.on_put(self.puts)
        if self.barrier is not None and not self.barrier.broken:
            try:
                self.barrier.wait()
            except threading.BrokenBarrierError:
                pass  # the other call ended: go on alone

    def end(self) -> None:
        self.ended = True


def test_two_threads_that_together_overfill_the_pool_fail_before_generating():
    model = tiny_model("llama")
    prompts = [prompt(1), prompt(2)]
    want = [reference(model, p, NEW) for p in prompts]
    pool = pc.enable(model, num_blocks=20, block_size=BLOCK)
    barrier = threading.Barrier(2, timeout=120)
    streamers = [Lockstep(barrier), Lockstep(barrier)]
    results: dict[int, object] = {}

    def call(i: int) -> None:
        try:
            out = model.generate(torch.tensor([prompts[i]]), max_new_tokens=NEW, do_sample=False, streamer=streamers[i])
            results[i] = out[0, PROMPT:].tolist()
        except BaseException as exc:  # the assertions below look at it
            results[i] = exc
        finally:
            barrier.abort()  # the other call goes on alone

    try:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        pc.disable(model)
    failed = [i for i in range(2) if isinstance(results[i], BaseException)]
    assert len(failed) == 1, results  # 24 blocks do not fit in 20: one call is refused
    (loser,) = failed
    assert isinstance(results[loser], OutOfBlocksError)
    assert streamers[loser].puts == 0, "the refused call streamed before it failed"
    assert streamers[loser].ended  # a streamer's consumer is not left waiting
    assert results[1 - loser] == want[1 - loser]
    assert pool.kv.num_used_blocks == 0 and pool.kv.num_reserved_blocks == 0
    pool.check_invariants()


def test_a_refused_call_ends_a_text_iterator_streamer():
    model = tiny_model("llama")
    pool = pc.enable(model, num_blocks=8, block_size=BLOCK)
    streamer = TextIteratorStreamer(tiny_tokenizer(), timeout=60)  # not ended: queue.Empty instead of a hang
    try:
        with pytest.raises(OutOfBlocksError, match="needs up to 12 blocks"):
            model.generate(torch.tensor([prompt(1)]), max_new_tokens=NEW, do_sample=False, streamer=streamer)
    finally:
        pc.disable(model)
    assert "".join(streamer) == ""  # the consumer's loop ends instead of waiting for ever
    assert pool.kv.num_used_blocks == 0


def test_the_engine_admits_only_into_blocks_an_enabled_call_did_not_reserve():
    model = tiny_model("llama")
    mine, theirs = prompt(3), prompt(4, length=40)  # the Engine's request: 40 + 4 - 1 positions, 11 blocks
    want_mine, want_theirs = reference(model, mine, NEW), reference(model, theirs, 4)
    pool = pc.enable(model, num_blocks=20, block_size=BLOCK)
    try:
        with Engine(model, pool=pool, max_num_batched_tokens=64) as engine:
            admitted: list[int] = []

            def engine_steps(puts: int) -> None:
                if puts == 2:  # the call has its first token: the Engine gets a request and steps meanwhile
                    engine.add_request(theirs, SamplingParams(max_new_tokens=4), request_id="theirs")
                    for _ in range(3):
                        engine.step()
                    admitted.append(engine.scheduler.num_running)

            streamer = Lockstep(on_put=engine_steps)
            out = model.generate(torch.tensor([mine]), max_new_tokens=NEW, do_sample=False, streamer=streamer)
            assert out[0, PROMPT:].tolist() == want_mine  # the call did not run out half-way
            assert admitted == [0]  # 11 blocks did not fit beside the call's 12: the request waited
            done = []
            while engine.has_unfinished():
                done.extend(engine.step())
            assert [o.token_ids for o in done] == [want_theirs] and done[0].error is None
    finally:
        pc.disable(model)
    assert pool.kv.num_used_blocks == 0 and pool.kv.num_reserved_blocks == 0
    pool.check_invariants()


def test_an_enabled_call_cannot_take_what_the_engines_running_request_needs():
    model = tiny_model("llama")
    theirs, mine = prompt(5), prompt(6)
    want_theirs = reference(model, theirs, NEW)
    pool = pc.enable(model, num_blocks=20, block_size=BLOCK)
    try:
        with Engine(model, pool=pool, max_num_batched_tokens=64) as engine:
            engine.add_request(theirs, SamplingParams(max_new_tokens=NEW), request_id="theirs")
            for _ in range(3):
                engine.step()  # running: holds 4 blocks, may grow to 12

            streamer = Lockstep(on_put=lambda puts: engine.step())  # the Engine steps while the call generates
            with pytest.raises(OutOfBlocksError, match="needs up to 12 blocks"):
                model.generate(torch.tensor([mine]), max_new_tokens=NEW, do_sample=False, streamer=streamer)
            assert streamer.puts == 0  # refused before generating
            done = []
            while engine.has_unfinished():
                done.extend(engine.step())
            assert [o.token_ids for o in done] == [want_theirs]
            assert engine.stats().num_preemptions == 0  # its blocks were never taken from it
    finally:
        pc.disable(model)
    assert pool.kv.num_used_blocks == 0 and pool.kv.num_reserved_blocks == 0
    pool.check_invariants()


def test_a_batch_that_is_not_left_padded_is_checked_for_every_row():
    # Such a batch takes no prefix hit and stores every position of every row. The check counted one row only,
    # so two rows of 6 blocks passed it in a pool of 11 and ran out in the middle of generate ("cannot hold").
    model = tiny_model("llama")
    ids = torch.tensor([prompt(7), prompt(8)])
    mask = torch.ones_like(ids)
    mask[0, 1] = 0  # a hole: not left padding
    pool = pc.enable(model, num_blocks=11, block_size=BLOCK)
    try:
        with pytest.raises(OutOfBlocksError, match="needs up to 12 blocks"):
            model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    finally:
        pc.disable(model)
    assert pool.kv.num_used_blocks == 0 and pool.memory_stats().allocated_bytes == 0  # nothing ran
