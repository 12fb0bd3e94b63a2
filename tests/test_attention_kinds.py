"""Attention kinds: each rule agrees with its definition, checked exhaustively on small cases."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedcore import ConfigError
from pagedcore.attention_kinds import ChunkedAttention, FullAttention, SlidingWindow, attention_kind

KINDS = st.one_of(
    st.just(FullAttention()), st.integers(1, 12).map(SlidingWindow), st.integers(1, 12).map(ChunkedAttention)
)


@given(kind=KINDS, query=st.integers(0, 40), key=st.integers(0, 40))
def test_sees_first_visible_and_last_query_seeing_agree(kind, query, key):
    sees = bool(kind.sees(query, key))
    assert sees == (kind.first_visible(query) <= key <= query)
    last = kind.last_query_seeing(key)
    assert sees == (key <= query and (last is None or query <= last))


@given(kind=KINDS, past=st.integers(0, 40), query_length=st.integers(1, 8))
def test_mask_sizes_cover_exactly_the_keys_the_first_query_sees_on(kind, past, query_length):
    kv_length, kv_offset = kind.mask_sizes(past, query_length)
    if isinstance(kind, ChunkedAttention):  # transformers' sizes for it: a window of `chunk`, whatever the alignment
        assert kv_offset == max(0, past - kind.chunk + 1) <= kind.first_visible(past)
    else:
        assert kv_offset == kind.first_visible(past)  # the first new query's first key
    assert kv_offset + kv_length == past + query_length  # up to the last new key


def held_by_steps(kind, start, steps, block_size):
    """Blocks one sequence holds after each step of a schedule from ``start``, dropping what no query sees first."""
    computed, peaks = start, []
    for n in steps:
        peaks.append(kind.blocks_held(computed, n, block_size))
        computed += n
    return peaks


@given(
    kind=KINDS,
    block_size=st.integers(1, 5),
    num_tokens=st.integers(1, 40),
    chunk=st.one_of(st.none(), st.integers(1, 12)),
    start=st.integers(0, 10),
)
def test_max_blocks_is_the_worst_step_of_any_schedule(kind, block_size, num_tokens, chunk, start):
    if start >= num_tokens:
        assert kind.max_blocks(num_tokens, block_size, chunk=chunk, start=start) == 0
        return
    # Every step starts at some computed position c >= start and takes at most chunk (or what is left) positions;
    # blocks held grow with the step's size, so the worst schedule takes the most it can at the worst c.
    worst = max(
        kind.blocks_held(c, min(chunk or num_tokens, num_tokens - c), block_size) for c in range(start, num_tokens)
    )
    assert kind.max_blocks(num_tokens, block_size, chunk=chunk, start=start) == worst
    # ... and it is reached: some schedule of steps of at most chunk positions holds that many at once.
    c = next(
        c
        for c in range(start, num_tokens)
        if kind.blocks_held(c, min(chunk or num_tokens, num_tokens - c), block_size) == worst
    )
    steps = [1] * (c - start) + [min(chunk or num_tokens, num_tokens - c)]
    assert max(held_by_steps(kind, start, steps, block_size)) == worst


def test_full_attention_keeps_everything():
    full = FullAttention()
    assert full.first_needed_block(1000, 16) == 0 and full.can_truncate(3, 0, 4)
    assert full.max_blocks(33, 16, chunk=1) == 3 and full.max_cache_length == -1
    assert not full.is_sliding and attention_kind(None) is attention_kind(None)


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "8"])
def test_a_bad_window_is_a_config_error(window):
    with pytest.raises(ConfigError, match="sliding window"):
        SlidingWindow(window)


@given(chunk=st.integers(1, 12), query=st.integers(0, 60), key=st.integers(0, 60))
def test_a_chunked_query_sees_its_own_chunk_only(chunk, query, key):
    kind = ChunkedAttention(chunk)
    assert bool(kind.sees(query, key)) == (key <= query and key // chunk == query // chunk)
    # the keys any query may see are within transformers' window of `chunk` tokens: the mask sizes cover them
    assert kind.first_visible(query) >= query - chunk + 1


def test_chunked_attention_gives_finished_chunks_back():
    kind = ChunkedAttention(8)
    assert kind.is_sliding and kind.sliding_window is None and kind.max_cache_length == 8
    assert kind.first_needed_block(16, 4) == 4  # a query at 16 starts chunk 2: blocks 0-3 (positions 0-15) go
    assert kind.first_needed_block(15, 4) == 2
    assert kind.max_blocks(1000, 4, chunk=1) == 2 and attention_kind(kind) is kind


@pytest.mark.parametrize("chunk", [0, -1, 1.5, None])
def test_a_bad_chunk_size_is_a_config_error(chunk):
    with pytest.raises(ConfigError, match="chunk size"):
        ChunkedAttention(chunk)
