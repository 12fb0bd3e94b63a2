"""Namespace identity and chained block keys have one owner (pagedcore.block_keys, issue 27.5): the trie, the
scheduler, the tiers' keys and the Ray router agree on which namespaces are one (issue 26.2: NaN namespaces were
apart in memory and one on disk; -0.0 and 0.0 one in memory and two on disk)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedcore.block_keys import chain_keys, namespace_bytes, namespace_key, prefix_hashes
from pagedcore.block_manager import BlockManager
from pagedcore.errors import ConfigError
from pagedcore.prefix_trie import PrefixTrie

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.sampled_from([0.0, -0.0, 1.0, 2.5, math.inf, -math.inf]),
    st.sampled_from(["", "a", "1", "tenant"]),
    st.sampled_from([b"", b"a", b"1"]),
)
namespaces = st.recursive(scalars, lambda inner: st.tuples(inner) | st.tuples(inner, inner), max_leaves=4)


@given(namespaces, namespaces)
def test_two_namespaces_are_one_in_memory_exactly_when_they_are_one_on_disk_and_in_the_router(a, b):
    same_memory = namespace_key(a) == namespace_key(b)
    assert same_memory == (namespace_bytes(a) == namespace_bytes(b))
    assert same_memory == (prefix_hashes([1] * 8, 4, a) == prefix_hashes([1] * 8, 4, b))
    assert same_memory == (
        chain_keys("fp", 0, namespace_bytes(a), [1, 2], 2) == chain_keys("fp", 0, namespace_bytes(b), [1, 2], 2)
    )


def test_the_trie_keeps_apart_what_the_store_keeps_apart():
    manager = BlockManager(8, 2)
    trie = PrefixTrie(manager)
    trie.insert([1, 2, 3, 4], manager.allocate(2), namespace=0.0)
    # 0.0 == -0.0 in Python, and the trie took them for one namespace while the store's keys told them apart.
    assert trie.match([1, 2, 3, 4], namespace=-0.0).num_tokens == 0
    assert trie.match([1, 2, 3, 4], namespace=0.0).num_tokens == 4


@pytest.mark.parametrize("namespace", [math.nan, ("tenant", math.nan), frozenset({math.nan})])
def test_a_nan_namespace_is_refused(namespace):
    manager = BlockManager(8, 2)
    trie = PrefixTrie(manager)
    with pytest.raises(ConfigError, match="NaN"):
        trie.insert([1, 2], manager.allocate(1), namespace=namespace)
    with pytest.raises(ConfigError, match="NaN"):
        trie.match([1, 2], namespace=namespace)


def test_namespaces_without_a_stable_encoding_keep_an_in_memory_identity_and_no_routed_hashes():
    token = object()
    assert namespace_bytes(token) is None and namespace_key(token) == namespace_key(token)
    assert namespace_key(frozenset({1})) != namespace_key(frozenset({True}))
    assert prefix_hashes([1] * 8, 4, token) == ()
    with pytest.raises(ConfigError, match="hashable"):
        namespace_key(["a"])
