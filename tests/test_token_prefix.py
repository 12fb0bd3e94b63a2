"""Token-granular prefix reuse (issue 23.3): a prompt that continues a cached sequence inside a block (the next chat
turn), branches off inside one, or ends inside one, reuses that block's cached positions, through the Engine,
``enable()`` and ``PagedCache``; every such hit equals recompute (greedy tokens equal, fp32 logits within 1e-4) and
no block leaks. A random tree of conversations over a small pool (hypothesis) checks it all together."""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from models import FIRST_TOKEN, VOCAB, tiny_model
from transformers import DynamicCache

from pagedcore import KVPool
from pagedcore.adapters.transformers import Engine, PagedCache, SamplingParams, enable
from pagedcore.block_tables import BlockTables

BS = 4
TURN1 = list(range(10, 20))  # 10 tokens; with 4 new tokens 13 positions are computed: 3 blocks and 1 position
MESSAGE = [60, 61, 62, 63, 64]


@functools.cache
def model_of(family: str):
    return tiny_model(family)


@functools.lru_cache(maxsize=4096)
def reference(family: str, prompt: tuple[int, ...], new: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and fp32 logits of stock generate with a DynamicCache (the recompute)."""
    model = model_of(family)
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=new,
        do_sample=False,
        cache=DynamicCache(config=model.config),
        return_dict_in_generate=True,
        output_logits=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), [x[0].float() for x in out.logits]


def assert_recomputed(family: str, prompt: list[int], tokens: list[int], logits: list[torch.Tensor]) -> None:
    want_tokens, want_logits = reference(family, tuple(prompt), len(tokens))
    assert tokens == want_tokens
    assert len(logits) == len(want_logits)
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=0)


def engine_turn(engine: Engine, family: str, prompt: list[int], new: int, **kwargs) -> tuple[list[int], int]:
    """One Engine request checked against recompute: its tokens and the prompt positions it computed."""
    before = engine.stats().prompt_tokens_computed
    (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=new, return_logits=True), use_tqdm=False, **kwargs)
    assert out.error is None, out.error
    assert out.samples[0].logits is not None
    assert_recomputed(family, prompt, out.token_ids, out.samples[0].logits)
    assert engine.pool.kv.num_used_blocks == 0, "blocks leaked"
    engine.pool.check_invariants()
    return out.token_ids, engine.stats().prompt_tokens_computed - before


# ---------------------------------------------------------------- the regression: a chat turn continues mid-block
@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: a sliding window of 8 tokens (2 blocks)
def test_engine_next_chat_turn_computes_only_its_unique_tokens(family):
    # Before issue 23.3 the previous turn's partly filled last block was recomputed: 7 positions here, not 6.
    with Engine(model_of(family), num_blocks=32, block_size=BS, max_num_seqs=2) as engine:
        reply, first = engine_turn(engine, family, TURN1, 4)
        assert first == len(TURN1)
        turn2 = TURN1 + reply + MESSAGE
        _, second = engine_turn(engine, family, turn2, 3)
    assert second == 1 + len(MESSAGE)  # the reply's last token (never fed) and the new message: the unique tokens


def test_engine_branch_inside_a_block_and_a_shorter_prompt_reuse_the_blocks_leading_positions():
    with Engine(model_of("llama"), num_blocks=32, block_size=BS, max_num_seqs=2) as engine:
        engine_turn(engine, "llama", TURN1, 2)
        _, branched = engine_turn(engine, "llama", [*TURN1[:6], 90, 91], 2)  # leaves block 1 after 2 positions
        assert branched == 2
        _, shorter = engine_turn(engine, "llama", TURN1[:7], 2)  # ends inside block 1: all but its last token
        assert shorter == 1
        _, other = engine_turn(engine, "llama", [*TURN1, 70], 2, namespace="tenant-b")
        assert other == len(TURN1) + 1  # another namespace sees nothing


def test_a_preempted_request_rehits_its_own_partial_block():
    # 2 sequences of up to 25 positions in a pool of 10 blocks: the newest is preempted and re-hits its own prefix.
    prompts = [list(range(10, 27)), list(range(30, 47))]
    with Engine(model_of("llama"), num_blocks=10, block_size=BS, max_num_seqs=2, max_num_batched_tokens=8) as engine:
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=8, return_logits=True), use_tqdm=False)
        stats = engine.stats()
        assert engine.pool.kv.num_used_blocks == 0
        engine.pool.check_invariants()
    assert stats.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.samples[0].logits is not None
        assert_recomputed("llama", prompt, out.token_ids, out.samples[0].logits)


# ---------------------------------------------------------------- enable() and PagedCache
def test_enable_next_chat_turn_reuses_the_previous_turns_last_block(enabled):
    model = model_of("llama")
    pool = enabled(model, num_blocks=32, block_size=BS)
    first = model.generate(torch.tensor([TURN1]), max_new_tokens=4, do_sample=False)
    turn2 = first[0].tolist() + MESSAGE
    hits = pool.num_hit_tokens
    out = model.generate(
        torch.tensor([turn2]), max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True
    )
    assert pool.num_hit_tokens - hits == len(TURN1) + 4 - 1  # every position turn 1 computed, to the token
    assert_recomputed("llama", turn2, out.sequences[0, len(turn2) :].tolist(), [x[0] for x in out.logits])
    del out
    assert pool.kv.num_used_blocks == 0
    pool.check_invariants()


def test_a_kept_cache_whose_last_block_was_registered_copies_it_before_writing_on(enabled):
    # The returned cache's partly filled last block is in the trie after the call: continuing the cache must copy it,
    # so the cached positions another prompt reuses stay those of turn 1.
    model = model_of("llama")
    pool = enabled(model, num_blocks=48, block_size=BS)
    out = model.generate(torch.tensor([TURN1]), max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    history = out.sequences[0].tolist()
    turn2 = history + MESSAGE
    cont = model.generate(
        torch.tensor([turn2]),
        attention_mask=torch.ones(1, len(turn2), dtype=torch.long),
        cache=out.cache,
        max_new_tokens=3,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    assert_recomputed("llama", turn2, cont.sequences[0, len(turn2) :].tolist(), [x[0] for x in cont.logits])
    branch = [*history[:-1], 77, 78]  # continues turn 1's cached positions, not the kept cache's new ones
    again = model.generate(
        torch.tensor([branch]), max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True
    )
    assert_recomputed("llama", branch, again.sequences[0, len(branch) :].tolist(), [x[0] for x in again.logits])
    out.cache.release()
    del out, cont, again
    assert pool.kv.num_used_blocks == 0
    pool.check_invariants()


def test_paged_cache_prefixes_register_the_partly_filled_last_block():
    model = model_of("llama")
    cache = PagedCache(model, num_blocks=16, block_size=BS)
    out = model.generate(torch.tensor([TURN1]), max_new_tokens=4, do_sample=False, cache=cache)
    cache.cache_prefixes([out[0].tolist()])
    kv = cache.pool.kv
    assert kv.match(out[0].tolist() + MESSAGE).num_tokens == len(TURN1) + 4 - 1
    cache.release()
    assert kv.num_used_blocks == 0
    kv.check_invariants()


# ---------------------------------------------------------------- the core's rules
def test_a_sequence_filled_before_a_reset_registers_no_partial_block():
    pool = KVPool(num_blocks=8, block_size=BS)
    seq = BlockTables(pool)
    seq.append(6)
    pool.reset_prefix_cache()  # the weights changed: what it computed is stale
    seq.cache_partial_block([1, 2, 3, 4, 5, 6], 6)
    assert pool.num_cached_blocks == 0 and pool.match([1, 2, 3, 4, 5, 6, 7]).num_tokens == 0
    seq.release()


def test_a_later_block_holding_the_partial_blocks_tokens_replaces_it():
    pool = KVPool(num_blocks=8, block_size=BS)
    turn = BlockTables(pool)
    turn.append(6)
    turn.cache_partial_block([1, 2, 3, 4, 5, 6], 6)
    partial = turn.table(0)[1]
    turn.release()
    longer = BlockTables(pool)
    longer.attach(pool.match([1, 2, 3, 4, 5, 6, 7, 8]), 6)
    longer.append(2)  # copies the cached partial block, then fills the copy
    longer.cache_full_blocks([1, 2, 3, 4, 5, 6, 7, 8], 8)
    assert longer.table(0)[1] != partial
    assert not pool.groups[0].trie.contains(partial)  # redundant now: it left the cache (and is free)
    assert pool.match([1, 2, 3, 4, 5, 6, 9]).block_ids == ([0, longer.table(0)[1]],)
    longer.release()
    pool.check_invariants()
    assert pool.num_used_blocks == 0 and pool.num_cached_blocks == 2


def test_a_sliding_group_without_its_chain_limits_the_hit_to_whole_blocks():
    pool = KVPool(num_blocks=16, block_size=BS, sliding_windows=(None, 4))
    seq = BlockTables(pool)
    tokens = list(range(1, 11))
    seq.append(10)
    seq.cache_full_blocks(tokens, 10)
    seq.drop_out_of_window(10)
    pool.groups[1].trie.clear()  # the sliding group's chain is gone (evicted)
    seq.cache_partial_block(tokens, 10)
    seq.release()
    assert pool.match([*tokens, 11]).num_tokens == 0  # no group hit is usable without the sliding group's chain
    pool.check_invariants()


# ---------------------------------------------------------------- random trees of conversations
@st.composite
def conversation_nodes(draw):
    """Nodes of a conversation tree: (parent or None, cut, message, new tokens, namespace); the prompt of a node is
    its parent's history (prompt and reply) cut after ``cut`` tokens (modulo its length + 1) and then the message."""
    alphabet = st.sampled_from([FIRST_TOKEN, FIRST_TOKEN + 1, VOCAB - 1])  # small: accidental shared prefixes
    nodes = []
    for i in range(draw(st.integers(2, 7))):
        parent = draw(st.none() | st.integers(0, i - 1)) if i else None
        cut = draw(st.integers(0, 40))
        message = draw(st.lists(alphabet | st.integers(FIRST_TOKEN, VOCAB - 1), min_size=1, max_size=6))
        nodes.append((parent, cut, message, draw(st.integers(1, 5)), draw(st.sampled_from([None, "b"]))))
    return nodes


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=conversation_nodes(),
    path=st.sampled_from(["engine", "enable"]),
    family=st.sampled_from(["llama", "mistral"]),
)
def test_random_conversation_trees_equal_recompute(nodes, path, family):
    model = model_of(family)
    histories: list[list[int]] = []
    computed: dict[object, list[list[int]]] = {None: [], "b": []}  # per namespace: positions some request computed
    engine = Engine(model, num_blocks=14, block_size=BS, max_num_seqs=2) if path == "engine" else None
    pool = enable(model, num_blocks=14, block_size=BS) if engine is None else engine.pool
    try:
        for parent, cut, message, new, namespace in nodes:
            base = histories[parent] if parent is not None else []
            prompt = (base[: cut % (len(base) + 1)] + message)[-24:]  # bounded: it must fit the small pool
            hits = pool.num_hit_tokens
            if engine is not None:
                (out,) = engine.generate(
                    [prompt],
                    SamplingParams(max_new_tokens=new, return_logits=True),
                    use_tqdm=False,
                    namespace=namespace,
                )
                assert out.samples[0].logits is not None
                tokens, logits = out.token_ids, out.samples[0].logits
            else:
                res = model.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=new,
                    do_sample=False,
                    return_dict_in_generate=True,
                    output_logits=True,
                    pagedcore_namespace=namespace,
                )
                tokens, logits = res.sequences[0, len(prompt) :].tolist(), [x[0] for x in res.logits]
                del res
            hit = pool.num_hit_tokens - hits
            # Never a position that was not computed for exactly this prefix, in this namespace.
            assert hit <= max([common_prefix(prompt, c) for c in computed[namespace]], default=0)
            assert hit <= len(prompt) - 1
            assert_recomputed(family, prompt, tokens, logits)
            assert pool.kv.num_used_blocks == 0, "blocks leaked"
            pool.check_invariants()
            history = prompt + tokens
            histories.append(history)
            computed[namespace].append(history[:-1])
    finally:
        if engine is not None:
            engine.close()
        else:
            from pagedcore.adapters.transformers import disable

            disable(model)
