"""Property-based test of BlockManager + PrefixTrie bookkeeping (hypothesis state machine).

The test keeps its own model of who holds which block and what each block contains, drives random allocate /
retain / release / free / insert / match / evict, and after every step checks that the manager agrees: free +
evictable + in use == total, each ref count equals the number of holders, no block is both free and referenced,
and every prefix hit serves blocks whose content equals the prompt (also with a deliberately colliding hash).
"""

from __future__ import annotations

import hypothesis.strategies as st
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
tokens_st = st.lists(st.integers(0, 2), min_size=BLOCK, max_size=4 * BLOCK)  # tiny alphabet: many equal blocks


class BlockBookkeeping(RuleBasedStateMachine):
    hash_fn = None

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK)
        self.trie = PrefixTrie(self.bm, hash_fn=self.hash_fn)
        self.holders: dict[int, list[int]] = {}  # holder -> blocks it holds, in chain order
        self.content: dict[int, tuple[int, ...]] = {}  # block -> tokens written into it
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
    @rule(n=st.integers(0, NUM_BLOCKS + 1), tokens=tokens_st)
    def allocate(self, n, tokens):
        if self.bm.can_allocate(n):
            ids = self.bm.allocate(n)
            for i, block in enumerate(ids):  # "compute" KV for some tokens into each block
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
    @rule(data=st.data(), namespace=st.sampled_from([None, "a"]))
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
            if own != can:  # switch to the cached block, give ours back
                self.bm.retain([can])
                self.bm.release([own])
                blocks[i] = can

    @rule(tokens=tokens_st, namespace=st.sampled_from([None, "a"]))
    def match_and_hold(self, tokens, namespace):
        match = self.trie.match(tokens, namespace)
        for i, block in enumerate(match.block_ids):
            assert self.content[block] == tuple(tokens[i * BLOCK : (i + 1) * BLOCK]), "served another prompt's KV"
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

    def teardown(self):
        for blocks in self.holders.values():
            self.bm.release(blocks[::-1])
        self.holders.clear()
        assert self.bm.num_used_blocks == 0, "blocks leaked"
        self.bm.check_invariants()


class CollidingHashBookkeeping(BlockBookkeeping):
    @staticmethod
    def hash_fn(tokens):  # every block collides: only the token comparison tells them apart
        return 0


TestBlockBookkeeping = BlockBookkeeping.TestCase
TestBlockBookkeeping.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCollidingHash = CollidingHashBookkeeping.TestCase
TestCollidingHash.settings = settings(max_examples=75, stateful_step_count=40, deadline=None)
