"""PrefixTrie: longest match, duplicates, namespaces (bounded, typed), hash collisions, counters, clearing."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedcore import BlockManager, ConfigError, InvalidBlockError, PrefixMatch, PrefixTrie


@pytest.fixture
def bm() -> BlockManager:
    return BlockManager(16, 2)


def cached_chain(bm, trie, tokens, namespace=None):
    ids = bm.allocate(len(tokens) // bm.block_size)
    trie.insert(tokens, ids, namespace)
    bm.release(ids[::-1])
    return ids


def test_longest_match_to_the_token(bm):
    trie = PrefixTrie(bm)
    ids = cached_chain(bm, trie, [1, 2, 3, 4, 5, 6])
    assert trie.match([1, 2, 3, 4, 9, 9]).block_ids == ids[:2]
    assert trie.match([1, 2, 3, 4, 5, 6, 7]).num_tokens == 6
    # A prompt ending inside a cached block, or branching off inside one, uses that block's leading positions.
    assert trie.match([1, 2, 3]) == PrefixMatch(ids[:2], 3)
    assert trie.match([1, 2, 3, 9, 5]) == PrefixMatch(ids[:2], 3)
    assert trie.match([1, 9]) == PrefixMatch(ids[:1], 1)
    assert trie.match([2, 1]).block_ids == []
    assert trie.match([]).block_ids == []


def test_insert_keeps_existing_block_for_same_content(bm):
    trie = PrefixTrie(bm)
    first = cached_chain(bm, trie, [1, 2, 3, 4])
    mine = bm.allocate(3)
    canonical = trie.insert([1, 2, 3, 4, 5, 6], mine)
    assert canonical[:2] == first and canonical[2] == mine[2]
    assert not bm.is_cached(mine[0]) and bm.is_cached(mine[2])
    trie.check_invariants()


def test_insert_needs_enough_tokens_and_is_atomic(bm):
    trie = PrefixTrie(bm)
    ids = bm.allocate(2)
    with pytest.raises(InvalidBlockError, match="need 4 tokens"):
        trie.insert([1, 2, 3], ids)
    other = bm.allocate(1)
    trie.insert([7, 7], other)
    # The second block is cached for other content: nothing of this insert may happen.
    with pytest.raises(InvalidBlockError, match="already cached"):
        trie.insert([1, 2, 3, 4], [ids[0], other[0]])
    assert not bm.is_cached(ids[0])
    assert trie.num_cached_blocks == 1
    trie.check_invariants()


BAD_IDS = [1.5, "3", None, True]  # a float, a numeric string, None, a bool (True == 1 as a dict key)


@pytest.mark.parametrize("bad", BAD_IDS)
@pytest.mark.parametrize("where", ["token", "new block", "cached block"])
@pytest.mark.parametrize("call", ["insert", "insert under a parent", "insert_partial"])
def test_non_integer_token_or_block_ids_are_refused_and_change_nothing(bm, bad, where, call):
    trie = PrefixTrie(bm)
    root, cached_child = bm.allocate(2)
    trie.insert([1, 2], [root])
    trie.insert([3, 4], [cached_child], parent=root)
    (mine,) = bm.allocate(1)
    tokens = [3, 4] if where == "cached block" else [5, 6]  # [3, 4]: content already cached under root
    if where == "token":
        tokens[1] = bad
    block = mine if where == "token" else bad
    before = (trie.num_cached_blocks, trie.match([1, 2, 3, 4]), trie.match([1, 2, 5, 6]), bm.num_cached_blocks)
    refused = {
        "insert": lambda: trie.insert([1, 2, *tokens], [root, block]),
        "insert under a parent": lambda: trie.insert(tokens, [block], parent=root),
        "insert_partial": lambda: trie.insert_partial(tokens[1:], block, parent=root),
    }[call]
    with pytest.raises(InvalidBlockError, match=f"{call.split()[0]}: (token ids must be integers|block id .* not an)"):
        refused()
    after = (trie.num_cached_blocks, trie.match([1, 2, 3, 4]), trie.match([1, 2, 5, 6]), bm.num_cached_blocks)
    assert after == before and not bm.is_cached(mine) and bm.ref_count(mine) == 1
    trie.check_invariants()
    bm.check_invariants()


def test_integer_like_token_and_block_ids_are_cached_as_ints(bm):
    np = pytest.importorskip("numpy")
    trie = PrefixTrie(bm)
    (block,) = bm.allocate(1)
    assert trie.insert([np.int64(7), -2], [np.int64(block)]) == [block]  # negative ids: encoder inputs use them
    _, tokens = trie.chain(block)
    assert tokens == [7, -2] and all(type(t) is int for t in tokens)
    assert trie.match([7, -2]).block_ids == [block]
    trie.check_invariants()


def test_insert_of_free_block_is_refused(bm):
    trie = PrefixTrie(bm)
    with pytest.raises(InvalidBlockError, match="not in use"):
        trie.insert([1, 2], [5])
    assert trie.num_cached_blocks == 0


def test_namespaces_never_match_each_other(bm):
    trie = PrefixTrie(bm)
    a = cached_chain(bm, trie, [1, 2, 3, 4], namespace="tenant-a")
    assert trie.match([1, 2, 3, 4], "tenant-a").block_ids == a
    assert trie.match([1, 2, 3, 4], "tenant-b").block_ids == []
    assert trie.match([1, 2, 3, 4]).block_ids == []  # the default namespace is a namespace too
    b = cached_chain(bm, trie, [1, 2, 3, 4], namespace="tenant-b")
    assert set(a).isdisjoint(b)
    assert sorted(trie.namespaces(), key=str) == ["tenant-a", "tenant-b"]


def test_unhashable_namespace_is_a_config_error(bm):
    trie = PrefixTrie(bm)
    ids = bm.allocate(1)
    with pytest.raises(ConfigError, match="hashable"):
        trie.insert([1, 2], ids, namespace=["x"])


def test_counters_make_a_hit_rate(bm):
    trie = PrefixTrie(bm)
    assert trie.hit_rate == 0.0
    trie.record(10, 4)
    trie.record(10, 0)
    assert (trie.num_query_tokens, trie.num_hit_tokens, trie.hit_rate) == (20, 4, 0.2)


@pytest.mark.parametrize(
    ("args", "param", "message"),
    [
        ((1, 2), "num_hit_tokens", r"num_hit_tokens \(2\) must be <= num_query_tokens \(1\)"),
        ((-1, 0), "num_query_tokens", "num_query_tokens must be an integer >= 0, got -1"),
        ((4, -1), "num_hit_tokens", "num_hit_tokens must be an integer >= 0, got -1"),
        ((4.0, 1), "num_query_tokens", "num_query_tokens must be an integer >= 0, got 4.0"),
        ((4, "1"), "num_hit_tokens", "num_hit_tokens must be an integer >= 0, got '1'"),
    ],
)
def test_bad_counts_are_a_config_error_naming_the_argument_and_count_nothing(bm, args, param, message):
    trie = PrefixTrie(bm)
    trie.record(10, 4)
    with pytest.raises(ConfigError, match=message) as caught:
        trie.record(*args)
    assert caught.value.param == param
    assert (trie.num_query_tokens, trie.num_hit_tokens) == (10, 4)


def test_eviction_takes_leaves_first(bm):
    small = BlockManager(3, 1)
    trie = PrefixTrie(small)
    chain = small.allocate(3)
    trie.insert([1, 2, 3], chain)
    small.release(chain[::-1])  # tail first, as a finished sequence does
    assert small.allocate(1) == [chain[2]]  # the leaf goes first
    assert trie.match([1, 2, 3]).block_ids == chain[:2]
    trie.check_invariants()


def test_clear_and_clear_namespace(bm):
    trie = PrefixTrie(bm)
    cached_chain(bm, trie, [1, 2], "a")
    held = bm.allocate(1)
    trie.insert([3, 4], held, "b")
    assert trie.clear_namespace("a") == 1
    assert trie.match([1, 2], "a").block_ids == []
    assert trie.clear() == 1
    assert bm.num_cached_blocks == 0 and bm.ref_count(held[0]) == 1  # still held by its owner
    bm.release(held)
    assert bm.num_free_blocks == 16


def test_remove_drops_descendants(bm):
    trie = PrefixTrie(bm)
    ids = cached_chain(bm, trie, [1, 2, 3, 4, 5, 6])
    assert trie.remove(ids[1]) == [ids[1], ids[2]]
    assert trie.match([1, 2, 3, 4, 5, 6]).block_ids == ids[:1]
    bm.check_invariants()
    trie.check_invariants()


def test_one_trie_per_manager(bm):
    PrefixTrie(bm)
    with pytest.raises(ConfigError, match="another prefix cache"):
        PrefixTrie(bm)


# ---------------------------------------------------------------- namespaces: bounded, and keyed by type and value


def test_ten_thousand_namespaces_keep_the_trie_bounded_by_the_pool():
    # Issue 9.10: every namespace ever used kept a root for ever (per-tenant namespaces grow host memory without
    # bound). A root goes with its namespace's last cached block, so the trie never holds more than the pool.
    bm = BlockManager(16, 2)
    trie = PrefixTrie(bm)
    most = 0
    for i in range(10_000):
        cached_chain(bm, trie, [1, 2, 3, 4], namespace=f"tenant-{i}")  # evicts older tenants' blocks
        most = max(most, trie.num_namespaces)
    assert trie.num_cached_blocks <= 16
    assert trie.num_namespaces == len(trie.namespaces()) <= 8  # two blocks per tenant, 16 blocks
    assert most <= 8
    trie.check_invariants()
    bm.check_invariants()


def test_a_root_goes_with_its_last_block_whatever_removes_it(bm):
    trie = PrefixTrie(bm)
    ids = cached_chain(bm, trie, [1, 2, 3, 4], namespace="a")
    cached_chain(bm, trie, [5, 6], namespace="b")
    held = bm.allocate(1)
    trie.insert([7, 8], held, namespace="c")
    assert trie.num_namespaces == 3
    trie.remove(ids[0])  # a's whole chain
    assert sorted(trie.namespaces()) == ["b", "c"] and trie.num_namespaces == 2
    assert trie.clear_namespace("b") == 1
    assert trie.namespaces() == ["c"] and trie.num_namespaces == 1
    bm.release(held)
    bm.allocate(bm.num_available_blocks)  # evicts c's block
    assert trie.namespaces() == [] and trie.num_namespaces == 0
    trie.check_invariants()


@pytest.mark.parametrize(
    "namespaces",
    [(1, 1.0, True), (0, 0.0, False, None), (("t", 1), ("t", True), ("t", 1.0)), (frozenset({1}), frozenset({1.0}))],
)
def test_namespaces_that_compare_equal_but_differ_in_type_are_distinct(bm, namespaces):
    # Issue 9.13: namespaces followed dict-key equality, so 1, 1.0 and True shared one cache.
    trie = PrefixTrie(bm)
    blocks = {}
    for i, namespace in enumerate(namespaces):
        assert trie.match([1, 2], namespace).block_ids == [], f"{namespace!r} sees another namespace's block"
        blocks[i] = cached_chain(bm, trie, [1, 2], namespace=namespace)
    assert len({b for chain in blocks.values() for b in chain}) == len(namespaces)
    for i, namespace in enumerate(namespaces):
        assert trie.match([1, 2], namespace).block_ids == blocks[i]
    assert trie.num_namespaces == len(namespaces)
    assert [repr(ns) for ns in trie.namespaces()] == [repr(ns) for ns in namespaces]
    assert trie.clear_namespace(namespaces[0]) == 1
    assert trie.num_namespaces == len(namespaces) - 1
    trie.check_invariants()


def test_the_scheduler_keeps_equal_but_differently_typed_namespaces_apart():
    from fake_model import FakeModel, run_to_completion

    from pagedcore import KVPool, Scheduler, SchedulerConfig, SequenceState

    pool = KVPool(num_blocks=16, block_size=2)
    sched = Scheduler(pool, SchedulerConfig(max_num_batched_tokens=64))
    model = FakeModel(sched)
    prompt = list(range(3, 12))
    for request_id, namespace in (("int", 1), ("bool", True), ("float", 1.0), ("int again", 1)):
        sched.add(SequenceState(request_id, prompt, max_new_tokens=2, namespace=namespace))
    done = run_to_completion(sched, model)
    assert [done[r].num_cached_tokens for r in ("int", "bool", "float", "int again")] == [0, 0, 0, 8]
    assert pool.num_used_blocks == 0
    pool.check_invariants()


def test_an_unhashable_namespace_is_a_config_error_in_every_call(bm):
    trie = PrefixTrie(bm)
    for bad in (["x"], ("t", ["x"]), {"a": 1}):
        with pytest.raises(ConfigError, match="hashable"):
            trie.match([1, 2], bad)
        with pytest.raises(ConfigError, match="hashable"):
            trie.clear_namespace(bad)
    assert trie.num_cached_blocks == 0


# ---------------------------------------------------------------- children keyed by content: collisions are harmless

MODULUS = sys.hash_info.modulus  # hash(n) == hash(n + MODULUS) for every int n >= 0, so tuples collide at will


def test_blocks_whose_tuple_hashes_collide_never_share_a_cache_entry(bm):
    trie = PrefixTrie(bm)
    a, b = (1, 2), (1 + MODULUS, 2)
    assert hash(a) == hash(b) and a != b  # a real collision of Python's tuple hash
    x = cached_chain(bm, trie, list(a))
    assert trie.match(list(b)).block_ids == []  # same hash, other content: no hit
    y = cached_chain(bm, trie, list(b))
    assert x != y
    assert trie.match(list(a)).block_ids == x and trie.match(list(b)).block_ids == y
    # Colliding second blocks under one parent: the chain decides block by block.
    parent = [7, 7]
    p1 = cached_chain(bm, trie, [*parent, 3, 4])
    p2 = trie.insert([*parent, 3 + MODULUS, 4], [p1[0], *bm.allocate(1)])
    assert p2[0] == p1[0] and p2[1] != p1[1]
    bm.release([p2[1]])
    assert trie.match([*parent, 3, 4]).block_ids == p1
    assert trie.match([*parent, 3 + MODULUS, 4]).block_ids == p2
    trie.check_invariants()


def test_colliding_blocks_through_the_scheduler_read_only_their_own_tokens():
    # What the removed block-hasher plugin's constant-hash test proved, with real collisions of Python's tuple hash:
    # the fake model asserts that every position a query reads holds exactly the token written there.
    from fake_model import FakeModel, run_to_completion

    from pagedcore import KVPool, Scheduler, SchedulerConfig, SequenceState

    pool = KVPool(num_blocks=32, block_size=4)
    sched = Scheduler(pool, SchedulerConfig(max_num_batched_tokens=64))
    model = FakeModel(sched)
    p1 = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    prompts = {
        "p1": p1,
        "p2": [1, 2, 3, 4, 5 + MODULUS, 6, 7, 8, 9],  # same first block; second block collides with p1's
        "p3": [1 + MODULUS, 2, 3, 4, 5, 6, 7, 8, 9],  # first block collides with p1's, then p1's second block
        "p4": list(p1),
    }
    assert hash(tuple(prompts["p2"][4:8])) == hash(tuple(p1[4:8]))
    assert hash(tuple(prompts["p3"][:4])) == hash(tuple(p1[:4]))
    tables: dict[str, list[int]] = {}
    cached_tokens: dict[str, int] = {}
    for rid, prompt in prompts.items():
        sched.add(SequenceState(rid, prompt, max_new_tokens=1))
        out = sched.schedule()
        tables[rid] = out.scheduled[0].block_tables[0]
        done = {seq.request_id: seq for seq in sched.update(out, model.step(out))}
        done.update(run_to_completion(sched, model))
        cached_tokens[rid] = done[rid].num_cached_tokens
    assert cached_tokens == {"p1": 0, "p2": 4, "p3": 0, "p4": 8}
    assert tables["p2"][0] == tables["p1"][0] and tables["p2"][1] != tables["p1"][1]
    assert not set(tables["p3"][:2]) & set(tables["p1"][:2] + tables["p2"][:2])
    assert tables["p4"][:2] == tables["p1"][:2]
    # 5 full blocks and the partly filled last blocks of p1, p2 and p3 (p4's is p1's again: not registered twice).
    assert pool.num_cached_blocks == 5 + 3 and pool.num_used_blocks == 0
    pool.check_invariants()


def test_the_scheduler_does_not_hold_a_request_back_for_another_namespace_prefill():
    # A waiting request is held back while a running one computes the blocks it could hit: only in its own
    # namespace. 1 == True, but a request in namespace True can never hit blocks computed in namespace 1.
    from pagedcore import KVPool, Scheduler, SchedulerConfig, SequenceState

    sched = Scheduler(KVPool(num_blocks=32, block_size=2), SchedulerConfig(max_num_batched_tokens=64))
    prompt = list(range(3, 13))
    sched.add(SequenceState("int", prompt, max_new_tokens=1, namespace=1))
    sched.add(SequenceState("bool", prompt, max_new_tokens=1, namespace=True))
    sched.add(SequenceState("int again", prompt, max_new_tokens=1, namespace=1))
    out = sched.schedule()
    assert [item.request_id for item in out.scheduled] == ["int", "bool"]  # "int again" waits to hit "int"'s blocks
    for item in out.scheduled:
        sched.abort(item.request_id)
    sched.abort("int again")
    assert sched.pool.num_used_blocks == 0


def test_a_partial_block_is_no_parent_and_a_refused_insert_changes_nothing():
    """A partial block has no children: ``insert(..., parent=partial)`` is refused like ``insert_partial`` is (it used
    to hang full blocks under it, which the tiered store's load did once it counted a partial match as whole)."""
    bm = BlockManager(num_blocks=4, block_size=2)
    trie = PrefixTrie(bm)
    full, partial, child = bm.allocate(3)
    trie.insert([1, 2], [full])
    assert trie.insert_partial([3], partial, parent=full)
    for refused in (
        lambda: trie.insert([3, 4], [child], parent=partial),
        lambda: trie.insert_partial([5], child, parent=partial),
    ):
        with pytest.raises(InvalidBlockError, match="not a full block"):
            refused()
    assert trie.match([1, 2, 3, 4]) == PrefixMatch([full, partial], 3) and not bm.is_cached(child)
    trie.check_invariants()


# One block under a parent (a growing sequence's newest block) takes a fast path when the ids come as a list; as a
# tuple they take the general path. Both tries see the same calls and must answer and end the same, errors included.
@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 9), st.integers(0, 9), st.integers(0, 2), st.sampled_from([None, "a"])), max_size=30
    )
)
def test_one_block_under_a_parent_answers_as_the_general_path_does(calls):
    tries = []
    for _ in range(2):
        bm = BlockManager(12, 2)
        trie = PrefixTrie(bm)
        held = bm.allocate(10)  # ids 0..9; 10, 11 never allocated
        bm.free([held[8]])  # in range, not in use
        trie.insert([1, 2], [held[0]])
        trie.insert_partial([1], held[1], parent=held[0])  # covered by a later block [1, 2] under it
        tries.append((bm, trie))
    for parent, block, token, namespace in calls:
        tokens = [token, token + 1, 5]  # a third token past the block: ignored, as the general path ignores it
        block_id = block if block < 9 else 11  # 11: a block never allocated
        outcomes = []
        for (bm, trie), ids in zip(tries, ([block_id], (block_id,))):
            try:
                outcomes.append(("ok", trie.insert(tokens, ids, namespace, parent=parent)))
            except (InvalidBlockError, ConfigError) as exc:
                outcomes.append((type(exc).__name__, str(exc)))
            trie.check_invariants()
            bm.check_invariants()
        assert outcomes[0] == outcomes[1]
    (_, a), (_, b) = tries
    assert a.num_cached_blocks == b.num_cached_blocks
    for first in range(3):
        for second in range(4):
            probe = [1, 2, first, first + 1, second, second + 1]
            assert a.match(probe) == b.match(probe) and a.match(probe, "a") == b.match(probe, "a")
