"""pagedcore.validation: the one home of the integer and token-id rules (torch-free)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedcore import InvalidRequestError
from pagedcore.validation import integer, token_ids


@given(st.lists(st.integers(min_value=0, max_value=999), min_size=1))
def test_integer_lists_in_the_vocabulary_come_back_unchanged(ids):
    assert token_ids(ids, vocab_size=1000) == ids
    assert token_ids(tuple(np.array(ids, dtype=np.int64)), vocab_size=1000) == ids


@given(
    st.lists(st.integers(min_value=0, max_value=99), min_size=0, max_size=8),
    st.one_of(
        st.floats(allow_nan=True),
        st.booleans(),
        st.text(max_size=3),
        st.lists(st.integers(), max_size=2),
        st.none(),
    ),
    st.integers(min_value=0, max_value=8),
)
def test_any_non_integer_element_is_refused_by_value(ids, bad, where):
    ids = list(ids)
    ids.insert(min(where, len(ids)), bad)
    with pytest.raises(InvalidRequestError, match="must be integers") as info:
        token_ids(ids, vocab_size=100)
    assert repr(bad)[:20] in str(info.value)


@given(st.lists(st.integers(min_value=-50, max_value=150), min_size=1))
def test_ids_outside_the_vocabulary_are_named(ids):
    outside = [t for t in ids if not 0 <= t < 100]
    if not outside:
        assert token_ids(ids, vocab_size=100) == ids
        return
    with pytest.raises(InvalidRequestError, match="vocabulary") as info:
        token_ids(ids, vocab_size=100)
    assert str(outside[:5]) in str(info.value)


@pytest.mark.parametrize("value", ["5 6", b"56", 5, None, 5.0])
def test_a_non_sequence_is_refused(value):
    with pytest.raises(InvalidRequestError, match="sequence of integers"):
        token_ids(value)


def test_empty():
    with pytest.raises(InvalidRequestError, match="the prompt is empty"):
        token_ids([])
    assert token_ids([], allow_empty=True, name="stop_token_ids") == []


def test_the_name_is_in_every_message():
    for bad in (["x"], [1000], "abc"):
        with pytest.raises(InvalidRequestError, match="stop_token_ids"):
            token_ids(bad, vocab_size=10, name="stop_token_ids")


@pytest.mark.parametrize(
    ("value", "minimum", "ok"),
    [(3, 0, True), (np.int32(3), 0, True), (0, 1, False), (True, 0, False), (2.0, 0, False), ("3", 0, False)],
)
def test_integer(value, minimum, ok):
    if ok:
        assert integer("n", value, minimum=minimum) == 3 and type(integer("n", value)) is int
    else:
        with pytest.raises(InvalidRequestError, match="n must be an integer"):
            integer("n", value, minimum=minimum)


def test_the_core_module_imports_no_torch():
    code = "import sys, pagedcore.validation; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
