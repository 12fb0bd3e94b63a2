"""Attention kinds: each rule agrees with its definition, checked exhaustively on small cases."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedcore import ConfigError
from pagedcore.attention_kinds import FullAttention, SlidingWindow, attention_kind

KINDS = st.one_of(st.just(FullAttention()), st.integers(1, 12).map(SlidingWindow))


@given(kind=KINDS, query=st.integers(0, 40), key=st.integers(0, 40))
def test_sees_first_visible_and_last_query_seeing_agree(kind, query, key):
    sees = bool(kind.sees(query, key))
    assert sees == (kind.first_visible(query) <= key <= query)
    last = kind.last_query_seeing(key)
    assert sees == (key <= query and (last is None or query <= last))


@given(kind=KINDS, past=st.integers(0, 40), query_length=st.integers(1, 8))
def test_mask_sizes_cover_exactly_the_keys_the_first_query_sees_on(kind, past, query_length):
    kv_length, kv_offset = kind.mask_sizes(past, query_length)
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
