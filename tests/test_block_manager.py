"""BlockManager: the safe version of the design note's interface, each bad input, atomicity."""

from __future__ import annotations

import copy
import tracemalloc

import pytest

from pagedcore import (
    BlockManager,
    ConfigError,
    DoubleReleaseError,
    InvalidBlockError,
    OutOfBlocksError,
    PagedCoreError,
    PluginError,
    PrefixTrie,
    SharedBlockError,
)


def snapshot(bm: BlockManager) -> tuple:
    return (
        [bm.ref_count(b) for b in range(bm.num_blocks)],
        [bm.is_cached(b) for b in range(bm.num_blocks)],
        bm.num_free_blocks,
        bm.num_evictable_blocks,
    )


@pytest.mark.parametrize("num_blocks", [0, -1, 1.5, True, "4"])
def test_bad_num_blocks(num_blocks):
    with pytest.raises(ConfigError, match="num_blocks"):
        BlockManager(num_blocks, 16)


@pytest.mark.parametrize("block_size", [0, -16, None])
def test_bad_block_size(block_size):
    with pytest.raises(ConfigError, match="block_size"):
        BlockManager(4, block_size)


def test_allocate_gives_ref_one_and_is_all_or_nothing():
    bm = BlockManager(4, 16)
    ids = bm.allocate(3)
    assert sorted(ids) == [0, 1, 2]
    assert all(bm.ref_count(b) == 1 for b in ids)
    before = snapshot(bm)
    with pytest.raises(OutOfBlocksError, match="2 blocks requested but only 1") as info:
        bm.allocate(2)
    assert info.value.requested == 2 and info.value.available == 1
    assert snapshot(bm) == before
    assert bm.can_allocate(1) and not bm.can_allocate(2)
    bm.check_invariants()


def test_blocks_freed_in_any_order_come_back_as_one_increasing_run():
    """The lowest free ids first. A prefix-cache reset frees each chain root first; with the most recently freed
    taken first, the next sequence got its blocks in decreasing order, which the torch backend cannot read as one
    view of the pool (it gathered every layer's keys at every decode step)."""
    bm = BlockManager(16, 4)
    trie = PrefixTrie(bm)
    ids = bm.allocate(4)
    trie.insert(list(range(16)), ids)
    bm.release(ids[::-1])  # tail first: cached, evictable
    trie.clear()  # the reset: root first onto the free heap
    assert bm.allocate(4) == ids
    bm.free(ids[2:])
    bm.free(ids[:2])  # uncached, in two calls
    assert bm.allocate(3) == ids[:3] and bm.allocate(2) == [ids[3], 4]  # the lowest free first, then a new id
    bm.check_invariants()


def test_allocate_rejects_negative():
    bm = BlockManager(4, 16)
    with pytest.raises(InvalidBlockError, match="-1"):
        bm.allocate(-1)
    assert bm.allocate(0) == []


def test_release_goes_free_unless_cached():
    bm = BlockManager(4, 2)
    trie = PrefixTrie(bm)
    a, b = bm.allocate(2)
    trie.insert([1, 2], [a])
    bm.release([b, a])
    assert bm.num_free_blocks == 3  # b (never cached) plus the two untouched
    assert bm.num_evictable_blocks == 1  # a is cached: its content stays reusable
    bm.check_invariants()


def test_double_release_is_an_error_and_changes_nothing():
    bm = BlockManager(4, 16)
    a, b = bm.allocate(2)
    bm.release([a])
    before = snapshot(bm)
    with pytest.raises(DoubleReleaseError, match=rf"\[{a}\]"):
        bm.release([b, a])  # b is fine, a is at 0: nothing may change, b included
    assert snapshot(bm) == before
    assert bm.ref_count(b) == 1


def test_free_of_shared_block_raises_instead_of_recycling():
    bm = BlockManager(4, 16)
    (a,) = bm.allocate(1)
    bm.retain([a])
    before = snapshot(bm)
    with pytest.raises(SharedBlockError, match=rf"{a} \(ref 2\)"):
        bm.free([a])
    assert snapshot(bm) == before
    bm.release([a])
    bm.free([a])
    assert bm.num_free_blocks == 4
    with pytest.raises(DoubleReleaseError):
        bm.free([a])


def test_free_of_cached_block_keeps_it_evictable():
    bm = BlockManager(2, 2)
    trie = PrefixTrie(bm)
    (a,) = bm.allocate(1)
    trie.insert([5, 6], [a])
    bm.free([a])
    assert bm.num_evictable_blocks == 1 and bm.num_free_blocks == 1
    assert trie.match([5, 6, 7]).block_ids == [a]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([7], "out of range"),
        ([-1], "out of range"),
        ([0, 0], "more than once"),
        (["x"], "not an integer"),
        ([True], "not an integer"),
        ([1.0], "not an integer"),
    ],
)
@pytest.mark.parametrize("op", ["retain", "release", "free"])
def test_bad_ids_are_typed_errors_naming_the_value(op, ids, message):
    bm = BlockManager(4, 16)
    bm.allocate(2)
    before = snapshot(bm)
    with pytest.raises(InvalidBlockError, match=message) as info:
        getattr(bm, op)(ids)
    assert isinstance(info.value, PagedCoreError)
    assert str(ids[0]) in str(info.value) or repr(ids[0]) in str(info.value)
    assert snapshot(bm) == before


def test_retain_of_free_block_is_refused():
    bm = BlockManager(4, 16)
    with pytest.raises(InvalidBlockError, match="free"):
        bm.retain([2])
    assert bm.num_free_blocks == 4


def test_numpy_like_ints_are_accepted():
    class Index:
        def __init__(self, v):
            self.v = v

        def __index__(self):
            return self.v

    bm = BlockManager(4, 16)
    a = bm.allocate(1)[0]
    bm.retain([Index(a)])
    assert bm.ref_count(a) == 2


def test_retain_revives_cached_block_out_of_evictable_pool():
    bm = BlockManager(2, 2)
    trie = PrefixTrie(bm)
    (a,) = bm.allocate(1)
    trie.insert([1, 2], [a])
    bm.release([a])
    assert bm.num_evictable_blocks == 1
    bm.retain([a])
    assert bm.num_evictable_blocks == 0 and bm.ref_count(a) == 1
    # Now it cannot be evicted: only one block can be had.
    assert bm.allocate(1) != [a]
    with pytest.raises(OutOfBlocksError):
        bm.allocate(1)


def test_lru_eviction_order_and_trie_is_told():
    evicted: list[list[int]] = []
    bm = BlockManager(3, 1, on_evict=evicted.append)
    trie = PrefixTrie(bm)
    for token in (10, 20, 30):
        (b,) = bm.allocate(1)
        trie.insert([token], [b])
        bm.release([b])
    # Least recently released first.
    got = bm.allocate(2)
    assert len(evicted) == 1 and sorted(evicted[0]) == sorted(got)
    assert trie.match([10]).block_ids == [] and trie.match([20]).block_ids == []
    assert trie.match([30]).num_tokens == 1
    bm.check_invariants()
    trie.check_invariants()


def test_evicting_a_parent_drops_its_subtree():
    bm = BlockManager(4, 1)
    trie = PrefixTrie(bm)
    parent, child = bm.allocate(2)
    trie.insert([1, 2], [parent, child])
    # Release the parent first (as a sliding window would), keep the child held.
    bm.release([parent])
    other = bm.allocate(3)  # 2 free + evict the parent
    assert parent in other
    assert not bm.is_cached(child)  # unreachable without its parent
    assert trie.match([1, 2]).block_ids == []
    bm.release([child])
    assert bm.num_free_blocks == 1  # child went straight to free, not evictable
    bm.check_invariants()
    trie.check_invariants()


def test_on_evict_listener_failure_does_not_corrupt():
    def boom(ids):
        raise RuntimeError("observer bug")

    bm = BlockManager(1, 1, on_evict=boom)
    trie = PrefixTrie(bm)
    (a,) = bm.allocate(1)
    trie.insert([1], [a])
    bm.release([a])
    assert bm.allocate(1) == [a]
    bm.check_invariants()


class TestAppendSlot:
    def test_grows_at_block_boundary(self):
        bm = BlockManager(4, 2)
        table = bm.allocate(1)
        out = bm.append_slot(table, num_tokens=1)
        assert out.block_ids == table and not out.new_block_ids and not out.copies
        out = bm.append_slot(table, num_tokens=2)
        assert len(out.block_ids) == 2 and out.new_block_ids == out.block_ids[1:]

    def test_copy_on_write_of_shared_last_block(self):
        bm = BlockManager(4, 4)
        table = bm.allocate(1)
        forked = bm.fork(table)
        out = bm.append_slot(table, num_tokens=3, num_new_tokens=1)
        assert out.copies == [(table[0], out.block_ids[0])]
        assert bm.ref_count(table[0]) == 1  # the fork alone holds the original now
        assert forked == table
        bm.check_invariants()

    def test_copy_on_write_of_cached_partial_block(self):
        bm = BlockManager(4, 4)
        trie = PrefixTrie(bm)
        table = bm.allocate(1)
        trie.insert([1, 2, 3, 4], table)
        # A sequence reusing the first 3 tokens of the cached block must not write into it.
        out = bm.append_slot(table, num_tokens=3, num_new_tokens=1)
        assert out.copies and out.block_ids != table
        assert trie.match([1, 2, 3, 4]).block_ids == table

    def test_no_copy_when_block_is_full(self):
        bm = BlockManager(4, 2)
        table = bm.allocate(1)
        bm.fork(table)
        out = bm.append_slot(table, num_tokens=2, num_new_tokens=1)
        assert not out.copies and out.block_ids[0] == table[0]

    def test_atomic_when_short(self):
        bm = BlockManager(2, 2)
        table = bm.allocate(1)
        bm.fork(table)
        before = snapshot(bm)
        with pytest.raises(OutOfBlocksError):
            bm.append_slot(table, num_tokens=1, num_new_tokens=3)  # copy + 1 more block: 2 needed, 1 free
        assert snapshot(bm) == before

    @pytest.mark.parametrize(("tokens", "count"), [(0, 1), (5, 1), (2, 3)])
    def test_table_length_must_match_tokens(self, tokens, count):
        bm = BlockManager(8, 2)
        table = bm.allocate(count)
        with pytest.raises(InvalidBlockError, match="needs"):
            bm.append_slot(table, num_tokens=tokens)

    def test_bad_counts(self):
        bm = BlockManager(8, 2)
        with pytest.raises(InvalidBlockError, match="num_new_tokens"):
            bm.append_slot([], 0, -1)
        with pytest.raises(InvalidBlockError, match="not held"):
            bm.append_slot([3], 1, 1)


def test_queries_have_no_side_effects():
    bm = BlockManager(4, 2)
    trie = PrefixTrie(bm)
    a = bm.allocate(2)
    trie.insert([1, 2, 3, 4], a)
    before = snapshot(bm)
    clone = copy.deepcopy(before)
    for b in range(4):
        bm.ref_count(b)
        bm.is_cached(b)
    bm.can_allocate(3)
    _ = (bm.num_free_blocks, bm.num_evictable_blocks, bm.num_used_blocks, bm.num_cached_blocks, bm.usage)
    trie.match([1, 2, 3, 4])
    assert snapshot(bm) == clone


def test_repr_mentions_counts():
    assert "free=4" in repr(BlockManager(4, 16))


# ---------------------------------------------------------------- size: per-block state is built lazily


def test_a_huge_pool_costs_nothing_until_used():
    # Issue 9.14: BlockManager(10**8) took 20 s and 5 GB before a block was used. Never-used blocks cost nothing now:
    # building a million-block manager allocates a constant few hundred bytes, not ~50 per block.
    tracemalloc.start()
    try:
        bm = BlockManager(10**6, 16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, f"building 10**6 blocks allocated {peak} bytes"
    assert bm.num_free_blocks == 10**6 and bm.num_used_blocks == 0 and bm.usage == 0.0


def test_the_largest_pool_works_at_both_ends():
    top = BlockManager.MAX_NUM_BLOCKS
    bm = BlockManager(top, 16)
    assert bm.allocate(2) == [0, 1]
    assert bm.ref_count(top - 1) == 0 and not bm.is_cached(top - 1)
    with pytest.raises(InvalidBlockError, match="free"):
        bm.retain([top - 1])
    with pytest.raises(DoubleReleaseError, match=str(top - 1)):
        bm.release([top - 1])
    with pytest.raises(InvalidBlockError, match="out of range"):
        bm.release([top])
    assert bm.num_free_blocks == top - 2
    bm.free([0, 1])
    assert bm.num_free_blocks == top


@pytest.mark.parametrize("num_blocks", [2**31, 10**12])
def test_an_absurd_pool_size_is_a_config_error_naming_it(num_blocks):
    with pytest.raises(ConfigError, match=rf"num_blocks {num_blocks} .*{BlockManager.MAX_NUM_BLOCKS}"):
        BlockManager(num_blocks, 16)


def test_reuse_order_is_lowest_new_id_after_most_recently_freed():
    # The lazy free list hands out ids exactly as the eager stack did: recycled blocks (last freed first), then
    # never-used ids in increasing order.
    bm = BlockManager(8, 2)
    a = bm.allocate(3)
    bm.free([a[1]])
    bm.free([a[0]])
    assert bm.allocate(4) == [a[0], a[1], 3, 4]
    bm.check_invariants()


def test_num_cached_blocks_follows_the_cache():
    bm = BlockManager(8, 2)
    trie = PrefixTrie(bm)
    ids = bm.allocate(3)
    trie.insert([1, 2, 3, 4, 5, 6], ids)
    assert bm.num_cached_blocks == 3
    bm.release(ids[::-1])
    bm.allocate(7)  # 5 free + 2 evicted leaves first
    assert bm.num_cached_blocks == 1
    trie.clear()
    assert bm.num_cached_blocks == 0
    bm.check_invariants()


class _Misbehaving:
    """An LRU eviction policy (a plugin's) whose ``pop()`` can be told to misbehave: ``fault(order)`` decides what
    the ``n``-th pop returns from the victim it took (or raises)."""

    name = "misbehaving"

    def __init__(self, fault):
        self.order: dict[int, None] = {}
        self.fault = fault
        self.pops = 0

    def add(self, block_id):
        self.order[block_id] = None

    def remove(self, block_id):
        del self.order[block_id]

    def pop(self):
        self.pops += 1
        victim = next(iter(self.order))
        del self.order[victim]
        return self.fault(self.pops, victim)

    def __len__(self):
        return len(self.order)

    def __contains__(self, block_id):
        return block_id in self.order


def _pool_with_cached_chains(policy):
    """Block 0 held by a sequence; two cached chains of two blocks each, evictable (4 blocks, 0 free)."""
    evicted: list[list[int]] = []
    bm = BlockManager(5, 2, eviction_policy=policy, on_evict=evicted.append)
    trie = PrefixTrie(bm)
    bm.allocate(1)
    for tokens in ([1, 2, 3, 4], [5, 6, 7, 8]):
        ids = bm.allocate(2)
        trie.insert(tokens, ids)
        bm.release(ids[::-1])
    return bm, trie, evicted


def _forget_victim(policy: _Misbehaving, victim: int) -> None:
    policy.order[victim] = None  # pop() "returned" another id but still holds its own victim


@pytest.mark.parametrize(
    ("fault", "problem"),
    [
        (lambda n, victim: 0, r"returned 0, a block in use \(1 holder"),
        (lambda n, victim: 10**6, "returned 1000000, not a block of this pool"),
        (lambda n, victim: "x", "returned 'x', not a block id"),
        (lambda n, victim: None, "returned None, not a block id"),
        (lambda n, victim: 2, "returned 2, a block it already returned"),  # the first victim is block 2
    ],
    ids=["held", "out-of-range", "str", "none", "twice"],
)
def test_an_eviction_policy_naming_a_wrong_victim_is_refused_and_changes_nothing(fault, problem):
    policy = _Misbehaving(lambda n, victim: victim)
    bm, trie, evicted = _pool_with_cached_chains(policy)
    policy.fault = fault
    before = snapshot(bm)
    with pytest.raises(PluginError, match=rf"eviction policy 'misbehaving' \(.*_Misbehaving\): pop\(\) {problem}"):
        bm.allocate(2)
    assert snapshot(bm) == before and bm.num_evicted == 0 and evicted == []
    assert trie.match([1, 2, 3, 4]).num_tokens == 4 and trie.match([5, 6, 7, 8]).num_tokens == 4
    bm.check_invariants()
    policy.fault = lambda n, victim: victim  # the policy mended: the pool works as before
    assert len(bm.allocate(3)) == 3 and bm.num_evicted >= 3
    bm.check_invariants()


def test_an_eviction_policy_that_keeps_its_victim_is_refused():
    policy = _Misbehaving(lambda n, victim: victim)
    bm, _, _ = _pool_with_cached_chains(policy)

    def keep(n, victim):
        _forget_victim(policy, victim)
        return victim

    policy.fault = keep
    before = snapshot(bm)
    with pytest.raises(PluginError, match="a block it still holds"):
        bm.allocate(1)
    assert snapshot(bm) == before
    bm.check_invariants()


def test_an_eviction_policy_that_raises_midway_leaves_allocate_all_or_nothing():
    def second_raises(n, victim):
        if n == 2:
            raise RuntimeError("policy bug")
        return victim

    bm, trie, evicted = _pool_with_cached_chains(_Misbehaving(second_raises))
    before = snapshot(bm)
    with pytest.raises(PluginError, match=r"eviction policy 'misbehaving' .*pop\(\) raised RuntimeError: policy bug"):
        bm.allocate(2)  # two victims: the first would have been evicted before the second pop raised
    assert snapshot(bm) == before and bm.num_evicted == 0 and evicted == []
    assert trie.match([1, 2, 3, 4]).num_tokens == 4 and trie.match([5, 6, 7, 8]).num_tokens == 4
    bm.check_invariants()


def test_victims_not_needed_after_a_subtree_left_go_back_to_the_policy():
    # LRU order: the parent of chain A first; evicting it frees its child too, so the second victim is not needed.
    bm = BlockManager(4, 1)
    trie = PrefixTrie(bm)
    a = bm.allocate(2)
    trie.insert([1, 2], a)
    bm.release(a)  # parent first: LRU takes it first, its child leaves with it
    b = bm.allocate(2)
    trie.insert([7, 8], b)
    bm.release(b[::-1])
    assert sorted(bm.allocate(2)) == sorted(a)
    assert trie.match([7, 8]).num_tokens == 2 and bm.num_evicted == 2
    bm.check_invariants()


def test_a_victim_a_parent_made_unneeded_keeps_its_place_in_the_lru_order():
    # LRU order [p, x, c, y]: c is p's child. Two blocks are needed: evicting p frees c with it, so x is not.
    bm = BlockManager(4, 1)
    trie = PrefixTrie(bm)
    p, c = bm.allocate(2)
    trie.insert([1, 2], [p, c])
    (x,) = bm.allocate(1)
    trie.insert([9], [x])
    (y,) = bm.allocate(1)
    trie.insert([8], [y])
    for block_id in (p, x, c, y):
        bm.release([block_id])
    assert sorted(bm.allocate(2)) == sorted([p, c])
    assert trie.contains(x) and trie.contains(y)
    assert bm.allocate(1) == [x]  # still the least recently released; it used to go back as the most recent
    assert trie.contains(y) and bm.num_evicted == 3
    bm.check_invariants()
    trie.check_invariants()
