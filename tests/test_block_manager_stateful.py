"""Property-based test of BlockManager + PrefixTrie bookkeeping (hypothesis state machine).

The test keeps its own model of who holds which block, what each block contains and which namespace cached it,
drives random allocate / retain / release / free / insert (of full chains, and of chains whose last block is partly
filled) / match / evict, and after every step checks that the manager agrees: free + evictable + in use == total,
each ref count equals the number of holders, no block is both free and referenced, every prefix hit (to the token)
serves only registered positions of blocks of the asked namespace whose content equals the prompt (also with tokens
whose tuple hashes collide), and the trie keeps a root for exactly the namespaces with a cached block.
Namespaces include ``1`` and ``True``, equal in Python but distinct namespaces.
"""

from __future__ import annotations

import sys

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedcore import (
    BlockManager,
    DoubleReleaseError,
    InvalidBlockError,
    OutOfBlocksError,
    PrefixTrie,
    SharedBlockError,
)

BLOCK = 2
NUM_BLOCKS = 8
NAMESPACES = [None, "a", 1, True]  # 1 == True, yet two namespaces
M = sys.hash_info.modulus  # hash(n) == hash(n + M): tokens 0 and M (1 and M + 1) collide in every tuple hash


def tokens_of(alphabet: list[int]) -> st.SearchStrategy[list[int]]:
    return st.lists(st.sampled_from(alphabet), min_size=BLOCK, max_size=4 * BLOCK)


def typed(namespace: object) -> tuple[type, object]:
    return type(namespace), namespace


class BlockBookkeeping(RuleBasedStateMachine):
    tokens_st = tokens_of([0, 1, 2])  # tiny alphabet: many equal blocks (drawn in the rules: subclasses change it)

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK)
        self.trie = PrefixTrie(self.bm)
        self.holders: dict[int, list[int]] = {}  # holder -> blocks it holds, in chain order
        self.content: dict[int, tuple[int, ...]] = {}  # block -> tokens written into it
        self.namespace_of: dict[int, object] = {}  # block -> the namespace that cached it (valid while cached)
        self.registered: dict[int, int] = {}  # block -> positions registered, for blocks cached partly filled
        self.next_holder = 0

    # ---------------------------------------------------------------- helpers
    def refs(self, block: int) -> int:
        return sum(block in held for held in self.holders.values())

    def new_holder(self, blocks: list[int]) -> None:
        self.holders[self.next_holder] = blocks
        self.next_holder += 1

    def snapshot(self) -> tuple:
        refs = tuple(self.bm.ref_count(b) for b in range(NUM_BLOCKS))
        return refs, self.bm.num_free_blocks, self.trie.num_cached_blocks

    # ---------------------------------------------------------------- rules
    @rule(n=st.integers(0, NUM_BLOCKS + 1), data=st.data())
    def allocate(self, n, data):
        tokens = data.draw(self.tokens_st)
        if self.bm.can_allocate(n):
            ids = self.bm.allocate(n)
            for i, block in enumerate(ids):  # "compute" KV for some tokens into each block
                self.registered.pop(block, None)
                self.content[block] = tuple((tokens * (n + 1))[i * BLOCK : (i + 1) * BLOCK])
            if ids:
                self.new_holder(ids)
        else:
            before = self.snapshot()
            try:
                self.bm.allocate(n)
            except OutOfBlocksError:
                pass
            else:
                raise AssertionError("allocate should have failed")
            assert self.snapshot() == before

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def release_holder(self, data):
        holder = data.draw(st.sampled_from(sorted(self.holders)))
        blocks = self.holders.pop(holder)
        self.bm.release(blocks[::-1])

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free_holder(self, data):
        holder = data.draw(st.sampled_from(sorted(self.holders)))
        blocks = self.holders[holder]
        if all(self.refs(b) == 1 for b in blocks):
            self.bm.free(blocks)
            del self.holders[holder]
        else:
            before = self.snapshot()
            try:
                self.bm.free(blocks)
            except SharedBlockError:
                pass
            else:
                raise AssertionError("free of a shared block should fail")
            assert self.snapshot() == before

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def fork_holder(self, data):
        holder = data.draw(st.sampled_from(sorted(self.holders)))
        self.new_holder(self.bm.fork(self.holders[holder]))

    @precondition(lambda self: self.holders)
    @rule(data=st.data(), namespace=st.sampled_from(NAMESPACES))
    def insert_holder(self, data, namespace):
        holder = data.draw(st.sampled_from(sorted(self.holders)))
        blocks = self.holders[holder]
        tokens = [t for b in blocks for t in self.content[b]]
        # A chain is insertable only if no block of it is cached for other content elsewhere.
        try:
            canonical = self.trie.insert(tokens, blocks, namespace)
        except InvalidBlockError as exc:
            # A block of this chain is cached at another position (e.g. in another namespace): refused whole.
            if "already cached" not in str(exc):
                raise
            return
        for i, (own, can) in enumerate(zip(blocks, canonical)):
            assert self.content[can] == self.content[own]
            if own == can:
                self.namespace_of[own] = namespace
                self.registered.pop(own, None)
            else:  # switch to the cached block, give ours back
                self.bm.retain([can])
                self.bm.release([own])
                blocks[i] = can

    @precondition(lambda self: self.holders)
    @rule(data=st.data(), namespace=st.sampled_from(NAMESPACES), used=st.integers(1, BLOCK - 1))
    def insert_partial_holder(self, data, namespace, used):
        """Register a holder's chain with its last block partly filled (a finished chat turn's last block)."""
        holder = data.draw(st.sampled_from(sorted(self.holders)))
        blocks = self.holders[holder]
        *full, last = blocks
        try:
            canonical = self.trie.insert([t for b in full for t in self.content[b]], full, namespace)
        except InvalidBlockError as exc:
            if "already cached" not in str(exc):
                raise
            return
        for i, (own, can) in enumerate(zip(full, canonical)):
            if own == can:
                self.namespace_of[own] = namespace
            else:
                self.bm.retain([can])
                self.bm.release([own])
                blocks[i] = can
        parent = canonical[-1] if canonical else None
        if self.bm.is_cached(last):
            with pytest.raises(InvalidBlockError, match="already cached"):
                self.trie.insert_partial(self.content[last][:used], last, namespace, parent=parent)
            return
        if self.trie.insert_partial(self.content[last][:used], last, namespace, parent=parent):
            self.namespace_of[last] = namespace
            self.registered[last] = used
        else:
            assert not self.bm.is_cached(last)

    @rule(data=st.data(), namespace=st.sampled_from(NAMESPACES))
    def match_and_hold(self, data, namespace):
        tokens = data.draw(self.tokens_st)
        match = self.trie.match(tokens, namespace)
        assert len(match.block_ids) == -(-match.num_tokens // BLOCK)
        for i, block in enumerate(match.block_ids):
            used = min(BLOCK, match.num_tokens - i * BLOCK)  # to the token: the last block may be used in part
            served = self.content[block][:used]
            assert served == tuple(tokens[i * BLOCK : i * BLOCK + used]), "served another prompt's KV"
            assert used == BLOCK or self.registered.get(block, BLOCK) >= used, "served positions never registered"
            assert typed(self.namespace_of[block]) == typed(namespace), "served another namespace's KV"
        if match.block_ids:
            self.bm.retain(match.block_ids)
            self.new_holder(list(match.block_ids))

    @rule(block=st.integers(0, NUM_BLOCKS - 1))
    def double_release_is_refused(self, block):
        if self.refs(block) == 0:
            before = self.snapshot()
            try:
                self.bm.release([block])
            except DoubleReleaseError:
                pass
            else:
                raise AssertionError("release of an unreferenced block should fail")
            assert self.snapshot() == before

    @rule()
    def evict_everything(self):
        n = self.bm.num_available_blocks
        ids = self.bm.allocate(n)
        for block in ids:
            self.content.pop(block, None)
        self.bm.free(ids)
        assert self.bm.num_evictable_blocks == 0

    @rule()
    def clear_cache(self):
        self.trie.clear()
        assert self.trie.num_cached_blocks == 0

    # ---------------------------------------------------------------- invariants
    @invariant()
    def bookkeeping_agrees(self):
        self.bm.check_invariants()
        self.trie.check_invariants()
        used = 0
        for block in range(NUM_BLOCKS):
            assert self.bm.ref_count(block) == self.refs(block), f"block {block}"
            used += self.refs(block) > 0
        assert self.bm.num_free_blocks + self.bm.num_evictable_blocks + used == NUM_BLOCKS

    @invariant()
    def roots_are_the_namespaces_with_a_cached_block(self):
        cached = {typed(self.namespace_of[b]) for b in range(NUM_BLOCKS) if self.bm.is_cached(b)}
        assert {typed(ns) for ns in self.trie.namespaces()} == cached
        assert self.trie.num_namespaces == len(cached)

    def teardown(self):
        for blocks in self.holders.values():
            self.bm.release(blocks[::-1])
        self.holders.clear()
        assert self.bm.num_used_blocks == 0, "blocks leaked"
        self.bm.check_invariants()


class CollidingTokensBookkeeping(BlockBookkeeping):
    # Blocks such as (0, 1), (M, 1), (0, M + 1) and (M, M + 1) all have one tuple hash: only content tells them apart.
    tokens_st = tokens_of([0, 1, M, M + 1])


TestBlockBookkeeping = BlockBookkeeping.TestCase
TestBlockBookkeeping.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCollidingTokens = CollidingTokensBookkeeping.TestCase
TestCollidingTokens.settings = settings(max_examples=75, stateful_step_count=40, deadline=None)
