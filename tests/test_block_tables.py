"""KVPool and BlockTables: groups, prefix attach, copy-on-write, sliding windows, forks, truncation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedcore import (
    BlockTables,
    ConfigError,
    InvalidBlockError,
    KVPool,
    LRUEvictionPolicy,
    OutOfBlocksError,
    PluginError,
)


def finished_sequence(pool, tokens, namespace=None):
    seq = BlockTables(pool)
    seq.append(len(tokens))
    seq.cache_full_blocks(tokens, len(tokens), namespace)
    seq.release()


def test_pool_validates_windows():
    with pytest.raises(ConfigError, match="window"):
        KVPool(4, 2, sliding_windows=(None, 0))
    with pytest.raises(ConfigError, match="at least one group"):
        KVPool(4, 2, sliding_windows=())


def test_append_slots_and_release():
    pool = KVPool(8, 4)
    seq = BlockTables(pool)
    assert seq.append(6) == []
    assert seq.slots(0, 0, 6) == [0, 1, 2, 3, 4, 5]
    seq.append(3)
    assert seq.num_tokens == 9 and len(seq.table(0)) == 3
    with pytest.raises(InvalidBlockError, match="not held"):
        seq.slots(0, 5, 10)
    seq.release()
    seq.release()  # idempotent
    assert pool.num_used_blocks == 0
    with pytest.raises(InvalidBlockError, match="released"):
        seq.append(1)


def test_append_is_atomic_across_groups():
    pool = KVPool(2, 2, sliding_windows=(None, 2))
    seq = BlockTables(pool)
    seq.append(4)
    with pytest.raises(OutOfBlocksError, match="group 0"):
        seq.append(1)
    assert seq.num_tokens == 4
    assert [g.block_manager.num_used_blocks for g in pool.groups] == [2, 2]


class _FailingLRU(LRUEvictionPolicy):
    """LRU whose ``pop()`` raises while ``failing`` (a plugin's policy with a bug)."""

    failing = False

    def pop(self) -> int:
        if self.failing:
            raise RuntimeError("policy bug")
        return super().pop()


def test_a_group_whose_eviction_policy_fails_undoes_the_groups_grown_before_it():
    policies: list[_FailingLRU] = []
    pool = KVPool(
        8, 2, sliding_windows=(None, None), eviction_policy=lambda: policies.append(_FailingLRU()) or policies[-1]
    )
    finished_sequence(pool, [1, 2, 3, 4, 5, 6])
    finished_sequence(pool, [100, 101, 102, 103])  # evictable, 2 blocks a group
    seq = BlockTables(pool)
    seq.attach(pool.match([1, 2, 3, 4, 5, 6]), 5)  # ends inside a cached block: the next write copies it
    holder = BlockTables(pool)
    holder.append(6)  # the free blocks: growing takes an eviction in every group
    tables, used = [seq.table(i) for i in range(2)], [g.block_manager.num_used_blocks for g in pool.groups]
    policies[1].failing = True  # group 0 grows (copy-on-write, evicting), then group 1's pop() raises
    with pytest.raises(PluginError, match="pop\\(\\) raised RuntimeError: policy bug"):
        seq.append(1)
    assert seq.num_tokens == 5 and [seq.table(i) for i in range(2)] == tables
    assert [g.block_manager.num_used_blocks for g in pool.groups] == used  # group 0's new block went back
    pool.check_invariants()
    policies[1].failing = False
    assert len(seq.append(1)) == 2 and seq.num_tokens == 6  # a copy in each group, as before the failure
    seq.release()
    holder.release()
    assert pool.num_used_blocks == 0
    pool.check_invariants()


def test_try_append_grows_like_append_or_changes_nothing():
    """``try_append`` (the scheduler's check-then-grow in one call) inside a private block, at a block boundary in
    every group, short of the ``reserve`` it must leave (None, nothing changed), and on released tables (refused)."""
    pool = KVPool(8, 4, sliding_windows=(None, 8))
    seq, twin = BlockTables(pool), BlockTables(pool)
    assert seq.try_append(4) == [] and twin.append(4) == []  # a boundary: one block in each group
    assert seq.try_append(1) == [] and twin.append(1) == []  # starts the second block
    assert seq.try_append(2) == [] and twin.append(2) == []  # inside it: no block
    assert [seq.table(g) for g in (0, 1)] != [twin.table(g) for g in (0, 1)]  # their own blocks, same shapes
    assert [len(seq.table(g)) for g in (0, 1)] == [len(twin.table(g)) for g in (0, 1)] == [2, 2]
    free = [g.block_manager.num_free_blocks for g in pool.groups]
    assert seq.try_append(2, reserve=4) is None  # would leave 3 free blocks per group, not 4
    assert seq.num_tokens == 7 and [g.block_manager.num_free_blocks for g in pool.groups] == free
    assert seq.try_append(2, reserve=3) == [] and seq.num_tokens == 9
    seq.release()
    with pytest.raises(InvalidBlockError, match="released"):
        seq.try_append(4)
    with pytest.raises(InvalidBlockError, match="released"):
        seq.try_append(1)


def test_prefix_attach_with_partial_block_copies_on_write():
    pool = KVPool(8, 4)
    finished_sequence(pool, list(range(8)))
    match = pool.match(list(range(8)))
    assert match.num_tokens == 8
    seq = BlockTables(pool)
    seq.attach(match, 7)  # keep the last prompt token to compute
    assert seq.table(0) == match.block_ids[0]
    copies = seq.append(1)
    assert len(copies) == 1 and copies[0][1] == match.block_ids[0][1]
    assert seq.table(0)[1] != match.block_ids[0][1]
    pool.check_invariants()
    seq.release()
    assert pool.num_used_blocks == 0


def test_duplicate_content_switches_to_the_cached_block():
    pool = KVPool(8, 2)
    a, b = BlockTables(pool), BlockTables(pool)
    a.append(4)
    b.append(4)
    a.cache_full_blocks([1, 2, 3, 4], 4)
    b.cache_full_blocks([1, 2, 3, 4], 4)  # computed the same content concurrently
    assert b.table(0) == a.table(0)
    assert pool.groups[0].block_manager.num_used_blocks == 2
    a.release()
    b.release()
    pool.check_invariants()


def test_sliding_window_drops_blocks_and_keeps_full_group():
    pool = KVPool(16, 4, sliding_windows=(None, 5))
    seq = BlockTables(pool)
    seq.append(12)
    # A query at 12 sees keys > 12 - 5, i.e. from 8 on: blocks 0 and 1 of the sliding group go.
    assert seq.drop_out_of_window(12) == 2
    assert seq.num_dropped(1) == 2 and seq.num_dropped(0) == 0
    assert len(seq.table(0)) == 3 and len(seq.table(1)) == 1
    assert seq.slots(1, 8, 12) == [seq.table(1)[0] * 4 + i for i in range(4)]
    with pytest.raises(InvalidBlockError):
        seq.slots(1, 0, 4)
    seq.append(1)  # still consistent after dropping
    assert seq.num_tokens == 13
    seq.release()
    assert pool.num_used_blocks == 0


def test_sliding_group_keeps_caching_through_its_evictable_head():
    pool = KVPool(16, 2, sliding_windows=(None, 2))
    tokens = list(range(8))
    seq = BlockTables(pool)
    seq.append(4)
    seq.cache_full_blocks(tokens, 4)
    seq.drop_out_of_window(4)
    seq.append(4)
    seq.cache_full_blocks(tokens, 8)
    assert pool.match(tokens).num_tokens == 8
    seq.release()
    pool.check_invariants()


def test_fork_shares_and_copies_on_write():
    pool = KVPool(8, 4)
    parent = BlockTables(pool)
    parent.append(6)
    child = parent.fork()
    assert child.table(0) == parent.table(0)
    copies = child.append(1)
    assert len(copies) == 1  # the shared, partly filled last block
    assert child.table(0)[0] == parent.table(0)[0] and child.table(0)[1] != parent.table(0)[1]
    parent.release()
    child.release()
    assert pool.num_used_blocks == 0


def test_truncate_releases_tail_blocks():
    pool = KVPool(8, 4)
    seq = BlockTables(pool)
    seq.append(10)
    seq.truncate(5)
    assert seq.num_tokens == 5 and len(seq.table(0)) == 2
    with pytest.raises(InvalidBlockError, match="outside"):
        seq.truncate(6)
    seq.truncate(0)
    assert pool.num_used_blocks == 0


def test_truncate_refuses_positions_that_left_the_window():
    pool = KVPool(16, 2, sliding_windows=(None, 2))
    seq = BlockTables(pool)
    seq.append(8)
    seq.drop_out_of_window(8)
    with pytest.raises(InvalidBlockError, match="window"):
        seq.truncate(2)
    assert seq.num_tokens == 8


def test_a_reset_prefix_cache_keeps_what_holders_filled_before_it_out_of_the_cache():
    """After ``KVPool.reset_prefix_cache`` (the model's weights changed) a table filled before it registers nothing,
    nor do its forks; one that starts over (``reset``) or from a hit of the new cache registers again."""
    pool = KVPool(16, 4, sliding_windows=(None, 8))
    old = BlockTables(pool)
    old.append(8)
    old.cache_full_blocks(list(range(8)), 4)
    assert pool.num_cached_blocks == 2  # one block per group
    child = old.fork()
    assert pool.reset_prefix_cache() == 2 and pool.epoch == 1
    old.append(4)
    old.cache_full_blocks(list(range(12)), 12)
    child.cache_full_blocks(list(range(8)), 8)
    assert pool.num_cached_blocks == 0 and pool.match(list(range(12))).num_tokens == 0
    fresh = BlockTables(pool)
    fresh.append(8)
    fresh.cache_full_blocks(list(range(100, 108)), 8)
    assert pool.match(list(range(100, 108))).num_tokens == 8
    hit = BlockTables(pool)
    hit.attach(pool.match(list(range(100, 108))), 8)
    hit.append(4)
    hit.cache_full_blocks(list(range(100, 112)), 12)
    assert pool.match(list(range(100, 112))).num_tokens == 12
    old.reset()
    old.append(4)
    old.cache_full_blocks(list(range(200, 204)), 4)
    assert pool.match(list(range(200, 204))).num_tokens == 4
    for seq in (old, child, fresh, hit):
        seq.release()
    assert pool.num_used_blocks == 0
    pool.check_invariants()


def test_attach_checks():
    pool = KVPool(8, 4)
    finished_sequence(pool, list(range(8)))
    match = pool.match(list(range(8)))
    seq = BlockTables(pool)
    with pytest.raises(InvalidBlockError, match="outside"):
        seq.attach(match, 9)
    seq.append(1)
    with pytest.raises(InvalidBlockError, match="already holds"):
        seq.attach(match, 4)
    seq.release()


@given(
    window=st.integers(1, 12),
    block_size=st.integers(1, 5),
    steps=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=25),
)
def test_drop_out_of_window_gives_back_exactly_what_no_later_query_sees(window, block_size, steps):
    # Each step grows the sequence, then drops for a query position at most its length (decode, or a chunk start).
    # Skipping the work when nothing can go (the decode fast path) must never leave a block held too long.
    pool = KVPool(256, block_size, sliding_windows=(None, window))  # the full group keeps all of up to 150 tokens
    kind = pool.groups[1].kind
    seq = BlockTables(pool)
    expected = 0
    position = 0
    for grow, advance in steps:
        seq.append(grow)
        position = min(seq.num_tokens, position + advance)
        seq.drop_out_of_window(position)
        expected = max(expected, min(kind.first_needed_block(position, block_size), -(-seq.num_tokens // block_size)))
        assert seq.num_dropped(1) == expected and seq.num_dropped(0) == 0
        assert len(seq.table(1)) == -(-seq.num_tokens // block_size) - expected
    seq.release()
    assert pool.num_used_blocks == 0
