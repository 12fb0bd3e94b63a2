"""PrefixTrie: longest match, duplicates, namespaces, collisions, counters, clearing."""

from __future__ import annotations

import pytest

from pagedcore import BlockManager, ConfigError, InvalidBlockError, PrefixTrie


@pytest.fixture
def bm() -> BlockManager:
    return BlockManager(16, 2)


def cached_chain(bm, trie, tokens, namespace=None):
    ids = bm.allocate(len(tokens) // bm.block_size)
    trie.insert(tokens, ids, namespace)
    bm.release(ids[::-1])
    return ids


def test_longest_full_block_match(bm):
    trie = PrefixTrie(bm)
    ids = cached_chain(bm, trie, [1, 2, 3, 4, 5, 6])
    assert trie.match([1, 2, 3, 4, 9, 9]).block_ids == ids[:2]
    assert trie.match([1, 2, 3, 4, 5, 6, 7]).num_tokens == 6
    assert trie.match([1, 2, 3]).block_ids == ids[:1]  # a partial last block never matches
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


def test_colliding_hash_never_serves_other_content(bm):
    trie = PrefixTrie(bm, hash_fn=lambda tokens: 42)
    x = cached_chain(bm, trie, [1, 2])
    y = cached_chain(bm, trie, [3, 4])
    assert trie.match([1, 2]).block_ids == x
    assert trie.match([3, 4]).block_ids == y
    assert trie.match([5, 6]).block_ids == []
    trie.check_invariants()


def test_counters_make_a_hit_rate(bm):
    trie = PrefixTrie(bm)
    assert trie.hit_rate == 0.0
    trie.record(10, 4)
    trie.record(10, 0)
    assert (trie.num_query_tokens, trie.num_hit_tokens, trie.hit_rate) == (20, 4, 0.2)
    with pytest.raises(ValueError, match="hits"):
        trie.record(1, 2)


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
