"""Capacity at the boundary: a request whose worst case is exactly the pool runs, one block less is refused up front.

The worst case per KV group has one owner (``KVPool.worst_case``, from each group's attention kind), and the pool says
whether it fits (``KVPool.reserve`` / ``capacity_shortfalls``) for the scheduler, the Engine and ``enable()``. Each test
also shows the bound is tight: the run reaches it (so a pool one block smaller could not have held it), where the
formulas it replaced asked for up to 6 blocks more (the scheduler's window + chunk + 2, enable's window + prompt + 2)
or one block more (the scheduler counted the last sampled token, which is never stored).
"""

from __future__ import annotations

import pytest
import torch
from fake_model import FakeModel, reference_output
from models import FIRST_TOKEN, WINDOW, tiny_model
from paged_checks import dynamic
from transformers import DynamicCache

from pagedcore import InvalidRequestError, KVPool, OutOfBlocksError, Scheduler, SchedulerConfig, SequenceState
from pagedcore.adapters import transformers as pc
from pagedcore.adapters.transformers import Engine, PagedCache, SamplingParams
from pagedcore.capacity import Demand

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4


def run_alone(num_blocks: int, windows, prompt: list[int], max_new: int, chunk: int) -> tuple[list[int], int]:
    """Run one sequence alone through the scheduler and the fake model; returns its output and the peak blocks."""
    pool = KVPool(num_blocks, BLOCK, windows)
    sched = Scheduler(pool, SchedulerConfig(max_num_batched_tokens=chunk))
    sched.add(SequenceState("a", prompt, max_new_tokens=max_new))
    model = FakeModel(sched)
    peak = 0
    done = {}
    while sched.has_unfinished():
        step = sched.schedule()
        peak = max(peak, pool.num_used_blocks)
        done.update((s.request_id, s) for s in sched.update(step, model.step(step)))
        sched.check_invariants()
    assert sched.stats.num_preemptions == 0 and pool.num_used_blocks == 0
    return done["a"].output_token_ids, peak


@pytest.mark.parametrize(
    ("windows", "prompt_len", "max_new", "chunk", "blocks"),
    [
        ((None,), 10, 7, 512, 4),  # 10 + 7 - 1 = 16 positions: 4 blocks of 4 (it was refused: "17 need 5")
        ((8,), 24, 20, 6, 4),  # a 6-token chunk at position 18 holds blocks 2..5 (the old formula asked for 6)
        ((8,), 5, 30, 2, 3),  # steps of 2: the window (8) plus a partly filled block on each side
    ],
)
def test_scheduler_runs_at_its_bound_and_refuses_one_block_less(windows, prompt_len, max_new, chunk, blocks):
    prompt = list(range(FIRST_TOKEN, FIRST_TOKEN + prompt_len))
    assert KVPool(blocks, BLOCK, windows).worst_case(Demand(prompt_len, max_new, chunk=chunk)) == (blocks,)
    output, peak = run_alone(blocks, windows, prompt, max_new, chunk)
    assert output == reference_output(prompt, max_new)
    assert peak == blocks  # tight: the run needed every block of the bound
    sched = Scheduler(KVPool(blocks - 1, BLOCK, windows), SchedulerConfig(max_num_batched_tokens=chunk))
    with pytest.raises(InvalidRequestError, match=f"need {blocks} blocks of 4 tokens in KV group 0, but the pool has"):
        sched.add(SequenceState("a", prompt, max_new_tokens=max_new))
    assert not sched.has_unfinished() and sched.pool.num_used_blocks == 0


def test_scheduler_bound_holds_under_preemption_and_budget_sharing():
    # Whatever the chunking (a shared token budget, recompute after preemption from a prefix hit), a sliding
    # sequence never holds more than the bound its pool was checked against.
    pool = KVPool(12, BLOCK, (None, 6))
    sched = Scheduler(pool, SchedulerConfig(max_num_batched_tokens=7, max_num_seqs=8))
    prompts = {f"r{i}": list(range(FIRST_TOKEN + i, FIRST_TOKEN + i + 9 + 3 * i)) for i in range(6)}
    for rid, prompt in prompts.items():
        sched.add(SequenceState(rid, prompt, max_new_tokens=14))
    bound = pool.worst_case(Demand(max(len(p) for p in prompts.values()), 14, chunk=7))[1]
    model = FakeModel(sched)
    done = {}
    while sched.has_unfinished():
        step = sched.schedule()
        for seq in sched.sequences():
            if seq.blocks is not None:
                assert len(seq.blocks.table(1)) <= bound
        done.update((s.request_id, s) for s in sched.update(step, model.step(step)))
    assert sched.stats.num_preemptions > 0
    assert {rid: s.output_token_ids for rid, s in done.items()} == {
        rid: reference_output(p, 14) for rid, p in prompts.items()
    }


def test_engine_at_its_bound_and_one_block_less():
    model = tiny_model("mistral")  # every layer slides over WINDOW = 8 tokens: one KV group
    prompt = list(range(FIRST_TOKEN, FIRST_TOKEN + 24))
    want = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, cache=dynamic(model))
    with Engine(model, num_blocks=4, block_size=BLOCK, max_num_batched_tokens=6) as engine:
        assert engine.pool.kv.worst_case(Demand(24, 20, chunk=6)) == (4,)
        (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=20), use_tqdm=False)
        assert out.error is None and out.token_ids == want[0, 24:].tolist()
        assert engine.stats().num_preemptions == 0 and engine.pool.kv.num_used_blocks == 0
    with (
        Engine(model, num_blocks=3, block_size=BLOCK, max_num_batched_tokens=6) as engine,
        pytest.raises(InvalidRequestError, match="never fit"),
    ):
        engine.add_request(prompt, SamplingParams(max_new_tokens=20))


@pytest.mark.parametrize(("prompt_len", "max_new", "blocks"), [(5, 30, 3), (13, 12, 4)])
def test_enabled_generate_at_its_bound_and_one_block_less(prompt_len, max_new, blocks):
    model = tiny_model("mistral")
    ids = torch.arange(FIRST_TOKEN, FIRST_TOKEN + prompt_len)[None]
    want = model.generate(ids, max_new_tokens=max_new, do_sample=False, cache=dynamic(model))
    pool = pc.enable(model, num_blocks=blocks, block_size=BLOCK)
    try:
        assert torch.equal(model.generate(ids, max_new_tokens=max_new, do_sample=False), want)
    finally:
        pc.disable(model)
    assert pool.kv.num_used_blocks == 0
    small = pc.enable(model, num_blocks=blocks - 1, block_size=BLOCK)
    try:
        with pytest.raises(OutOfBlocksError, match=f"needs up to {blocks} blocks"):
            model.generate(ids, max_new_tokens=max_new, do_sample=False)
        assert small.kv.num_used_blocks == 0 and small.memory_stats().allocated_bytes == 0  # nothing ran
    finally:
        pc.disable(model)
    # Tight: a PagedCache (which has no up-front check) in a pool one block smaller runs out half-way.
    cache = PagedCache(model, num_blocks=blocks - 1, block_size=BLOCK)
    with pytest.raises(OutOfBlocksError, match="cannot hold"):
        model.generate(ids, max_new_tokens=max_new, do_sample=False, cache=cache)
    cache.release()


def test_assisted_decoding_is_checked_as_full_attention():
    # Assisted and prompt-lookup decoding record the cache's past: sliding layers keep their blocks until the next
    # crop, so a window's bound does not hold. Checked against it (4 blocks here), this call ran out half-way
    # ("cannot hold 17 more tokens": the prompt and its first candidates in one forward).
    model = tiny_model("mistral")
    ids = torch.tensor([[5, 6, 7] * 4 + [5]])
    kwargs = {"max_new_tokens": 20, "do_sample": False, "prompt_lookup_num_tokens": 4}
    pool = pc.enable(model, num_blocks=4, block_size=BLOCK)
    try:
        with pytest.raises(OutOfBlocksError, match="needs up to 8 blocks"):
            model.generate(ids, **kwargs)
        assert pool.kv.num_used_blocks == 0
    finally:
        pc.disable(model)
    want = model.generate(ids, cache=DynamicCache(config=model.config), **kwargs)
    pool = pc.enable(model, num_blocks=8, block_size=BLOCK)  # 13 + 20 - 1 = 32 positions
    try:
        assert torch.equal(model.generate(ids, **kwargs), want)
    finally:
        pc.disable(model)
    assert pool.kv.num_used_blocks == 0 and WINDOW == 8


# --------------------------------------------------------------------- the most new tokens that fit (issue 27)
def _largest_fitting(kind, prompt: int, block_size: int, num_blocks: int, chunk: int, limit: int = 400) -> int | None:
    """Oracle: the largest n whose worst case fits, by trying every n (None: every n up to ``limit`` fits)."""
    from pagedcore.capacity import blocks_to_allocate

    fits = [
        n for n in range(1, limit) if blocks_to_allocate(kind, Demand(prompt, n, chunk=chunk), block_size) <= num_blocks
    ]
    assert fits == list(range(1, len(fits) + 1)), "the worst case grows with n"
    return None if len(fits) == limit - 1 else len(fits)


@pytest.mark.parametrize("window", [None, 3, 8, 17])
@pytest.mark.parametrize("block_size", [1, 4, 5])
def test_max_new_tokens_is_the_exact_inverse_of_the_worst_case(window, block_size):
    from pagedcore.attention_kinds import attention_kind
    from pagedcore.capacity import max_new_tokens

    kind = attention_kind(window)
    for num_blocks in (1, 2, 3, 5, 8):
        for prompt in (1, 2, 5, 9, 20):
            for chunk in (1, 3, 8, 64):
                expected = _largest_fitting(kind, prompt, block_size, num_blocks, chunk)
                assert max_new_tokens(kind, prompt, block_size, num_blocks, chunk=chunk) == expected


def test_the_scheduler_admits_exactly_up_to_max_new_tokens():
    pool = KVPool(num_blocks=6, block_size=BLOCK, sliding_windows=(None, 8))
    sched = Scheduler(pool, SchedulerConfig(max_num_batched_tokens=16))
    for prompt in (1, 7, 20, 24, 25):
        room = sched.max_new_tokens(prompt)
        assert room == max(0, 6 * BLOCK - prompt + 1)  # the full-attention group bounds it
        if room:
            sched.check_admissible(SequenceState("a", [5] * prompt, max_new_tokens=room))
        with pytest.raises(InvalidRequestError, match="can never fit"):
            sched.check_admissible(SequenceState("a", [5] * prompt, max_new_tokens=room + 1))
    window_only = Scheduler(KVPool(num_blocks=8, block_size=BLOCK, sliding_windows=(8,)), SchedulerConfig(4))
    assert window_only.max_new_tokens(100) is None  # a window of 8 in steps of 4 never holds 8 blocks
    window_only.check_admissible(SequenceState("a", [5] * 100, max_new_tokens=10**6))


def test_the_engine_answers_the_room_of_its_context_and_its_pool():
    model = tiny_model("llama", max_position_embeddings=64)
    with Engine(model, num_blocks=8, block_size=BLOCK) as engine:  # 8 blocks: 32 positions, under the context
        assert engine.max_new_tokens(10) == 8 * BLOCK - 10 + 1
        assert engine.max_new_tokens(40) == 0
        engine.add_request([5] * 10, SamplingParams(max_new_tokens=engine.max_new_tokens(10)))
        with pytest.raises(InvalidRequestError, match="can never fit") as caught:
            engine.add_request([5] * 10, SamplingParams(max_new_tokens=engine.max_new_tokens(10) + 1))
        assert caught.value.param == "max_new_tokens"
    with Engine(model, num_blocks=64, block_size=BLOCK) as engine:  # 256 positions: the context (64) bounds it
        assert engine.max_new_tokens(10) == 54
