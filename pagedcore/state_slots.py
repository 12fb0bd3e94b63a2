"""StateSlots: the fixed-size recurrent-state slots of a model, and the state snapshots kept beside the prefix trie.

Layers that keep a recurrent state instead of per-token keys and values (linear attention, state-space models, short
convolutions: Qwen3.5's Gated DeltaNet, Mamba-2, LFM2's conv layers...) hold one fixed-size state per sequence, the
same size whatever its length. A **slot** is one sequence's state over every such layer of the model (the tensors
live in the framework adapter; this module is plain Python). Slots are allocated, retained and released like blocks,
by the same :class:`~pagedcore.block_manager.BlockManager` rules (one manager over slot ids):

=========  ==========  ==========  ==================================================================
state      ref count   snapshot    meaning
=========  ==========  ==========  ==================================================================
free       0           no          holds nothing
evictable  0           yes         a snapshot in the cache no sequence holds: reused after eviction
in use     >= 1        either      a sequence's live state, or a snapshot a sequence holds or restored
=========  ==========  ==========  ==================================================================

**Copy-on-write.** A forked sequence (``n > 1``, beams, ``num_return_sequences``) shares its parent's slot until it
writes: a forward that updates a slot held by someone else, or registered as a snapshot, first copies it into a fresh
slot (:meth:`StateSlots.must_copy`; :meth:`~pagedcore.block_tables.BlockTables.write_state` applies it).

**Snapshots.** A recurrent state cannot be cut at an arbitrary token, so a prefix hit needs the state *at* the hit's
last position. A snapshot is the state of a sequence after the tokens up to a position inside one node of the prefix
trie (the end of a full block, or any of its tokens: the node's tokens are the prompt's there):
:meth:`StateSlots.register` files the slot under the block id of that node in the pool's anchor KV group and the
number of the block's tokens before it (``offset``, 1 .. ``block_size``). The trie's node is the snapshot's identity:
when the trie drops the block (evicted, cleared, made redundant), :meth:`StateSlots.forget_blocks` drops its snapshots
with it; when slots run short, the least recently used unheld snapshot is evicted on its own (its block stays: a later
hit uses a shallower snapshot). A hit uses the deepest position of its match that has a snapshot
(:meth:`pagedcore.kv_pool.KVPool.match`).

How often a growing sequence takes a snapshot is :attr:`StateSlots.interval` (every ``interval`` blocks of its
prompt); what that costs is one slot per snapshot (the state of every recurrent layer, typically tens to hundreds of
times the keys and values of one block).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable

from pagedcore.block_manager import BlockManager
from pagedcore.errors import ConfigError, OutOfBlocksError
from pagedcore.eviction import EvictionPolicy
from pagedcore.validation import integer

__all__ = ["TOKEN_BY_TOKEN_LIMIT", "StateSlots"]

TOKEN_BY_TOKEN_LIMIT = 32
"""The most tokens a model that continues a cached state only one token at a time (:attr:`StateSlots.resumes_chunks`
false) computes that way after a prefix hit; a longer rest is computed from the start instead."""


class _SnapshotIndex:
    """The manager's cache index: where each snapshot slot is filed (a trie block and a position in it) and back."""

    def __init__(self) -> None:
        self.at: dict[int, dict[int, int]] = {}  # anchor block id -> {tokens of the block before it: slot}
        self.where: dict[int, tuple[int, int]] = {}  # snapshot slot -> (block id, offset)

    def drop_block(self, block_id: int) -> list[int]:  # the manager evicts snapshot slot ``block_id``
        block, offset = self.where.pop(block_id)
        filed = self.at[block]
        del filed[offset]
        if not filed:
            del self.at[block]
        return [block_id]

    def subtree(self, block_id: int, skip: Container[int] = ()) -> list[int]:  # a snapshot slot has no descendants
        return [block_id]


class StateSlots:
    """Ref-counted recurrent-state slots with copy-on-write and snapshots filed under prefix-trie blocks.

    Args:
        num_slots: slots in all (live states and snapshots together).
        interval: a growing sequence snapshots its state every ``interval`` blocks of its prompt (>= 1).
        eviction_policy: orders unheld snapshots for eviction (LRU by default).
        before_evict: ``before_evict(slot, block_id, offset)`` just before an unheld snapshot is evicted to free its
            slot (a tier below the pool writes it down); must not change the slots. Exceptions are logged and
            swallowed.
        resumes_chunks: the model continues a cached state over a forward of several tokens (else only one token
            at a time: Jamba's Mamba layers drop the state in a scan of several tokens); see :attr:`resumes_chunks`.

    Example:
        >>> slots = StateSlots(num_slots=4)
        >>> live = slots.allocate()              # a sequence's state
        >>> slots.register(block_id=7, offset=16, slot=live)  # its state after trie block 7's 16 tokens: a snapshot
        True
        >>> slots.must_copy(live)                # writing on would change the snapshot: copy first
        True
        >>> slots.release(live); slots.snapshot_of(7, 16), slots.deepest(7, 12), slots.num_available
        (0, None, 4)
        >>> slots.forget_blocks([7]), slots.snapshot_of(7, 16), slots.num_free
        (1, None, 4)
    """

    def __init__(
        self,
        num_slots: int,
        *,
        interval: int = 1,
        eviction_policy: EvictionPolicy | None = None,
        before_evict: Callable[[int, int, int], None] | None = None,
        resumes_chunks: bool = True,
    ) -> None:
        self._resumes_chunks = bool(resumes_chunks)
        num_slots = integer("num_slots", num_slots, minimum=1, error=ConfigError, expected="a positive integer")
        self._interval = integer(
            "snapshot interval", interval, minimum=1, error=ConfigError, expected="a positive integer"
        )
        self._index = _SnapshotIndex()
        self._before_evict = before_evict
        self._bm = BlockManager(num_slots, 1, eviction_policy=eviction_policy, before_evict=self._evicting)
        self._bm.attach_cache(self._index)

    # ------------------------------------------------------------------ queries
    @property
    def num_slots(self) -> int:
        """Slots in all."""
        return self._bm.num_blocks

    @property
    def interval(self) -> int:
        """Blocks of a prompt between two snapshots."""
        return self._interval

    @property
    def resumes_chunks(self) -> bool:
        """Whether a forward of several tokens continues a cached state. When not, a sequence whose state holds
        tokens already (a prefix hit, an earlier chunk) computes one token per forward, and a hit is worth resuming
        only when at most :data:`TOKEN_BY_TOKEN_LIMIT` tokens follow it."""
        return self._resumes_chunks

    @property
    def num_used(self) -> int:
        """Slots held by sequences (live states, and snapshots they hold)."""
        return self._bm.num_used_blocks

    @property
    def num_snapshots(self) -> int:
        """Snapshots filed under trie blocks (held or not)."""
        return self._bm.num_cached_blocks

    @property
    def num_evictable(self) -> int:
        """Snapshots no sequence holds: reusable after eviction."""
        return self._bm.num_evictable_blocks

    @property
    def num_free(self) -> int:
        """Slots that hold nothing."""
        return self._bm.num_free_blocks

    @property
    def num_available(self) -> int:
        """Slots :meth:`allocate` can hand out now: free plus evictable."""
        return self._bm.num_available_blocks

    @property
    def num_evicted(self) -> int:
        """Snapshots evicted to free their slot since the slots were made."""
        return self._bm.num_evicted

    def ref_count(self, slot: int) -> int:
        """Holders of ``slot``."""
        return self._bm.ref_count(slot)

    def is_snapshot(self, slot: int) -> bool:
        """Whether ``slot`` is filed as a snapshot."""
        return self._bm.is_cached(slot)

    def must_copy(self, slot: int) -> bool:
        """Whether writing into ``slot`` would change what another holder or the snapshot cache reads."""
        return self._bm.ref_count(slot) > 1 or self._bm.is_cached(slot)

    def snapshot_of(self, block_id: int, offset: int) -> int | None:
        """The snapshot filed in trie block ``block_id`` after ``offset`` of its tokens, or None."""
        return self._index.at.get(block_id, {}).get(offset)

    def deepest(self, block_id: int, limit: int) -> tuple[int, int] | None:
        """``(offset, slot)`` of the snapshot filed deepest in block ``block_id`` within its first ``limit`` tokens."""
        filed = self._index.at.get(block_id)
        if not filed:
            return None
        offsets = [offset for offset in filed if offset <= limit]
        if not offsets:
            return None
        best = max(offsets)
        return best, filed[best]

    def where(self, slot: int) -> tuple[int, int] | None:
        """``(block id, offset)`` a snapshot slot is filed at, or None."""
        return self._index.where.get(slot)

    def snapshots(self) -> list[tuple[int, int, int]]:
        """Every ``(block id, offset, slot)`` snapshot."""
        return [(block, offset, slot) for slot, (block, offset) in self._index.where.items()]

    # ------------------------------------------------------------------ commands
    def allocate(self) -> int:
        """A free slot at reference count 1 (evicting the least recently used unheld snapshot when none is free).
        Raises :class:`~pagedcore.errors.OutOfBlocksError` when every slot is held."""
        if not self._bm.num_available_blocks:
            raise OutOfBlocksError(
                f"no recurrent-state slot can be had: all {self.num_slots} are held by sequences or their snapshots "
                "(use a pool with more state slots: state_slots= / memory_budget=)",
                requested=1,
                available=0,
            )
        return self._bm.allocate(1)[0]

    def retain(self, slot: int) -> None:
        """Add a holder (a fork, a restored snapshot, a snapshot taken)."""
        self._bm.retain([slot])

    def release(self, slot: int) -> None:
        """Drop a holder; an unheld snapshot stays cached (evictable), any other slot becomes free."""
        self._bm.release([slot])

    def register(self, block_id: int, offset: int, slot: int) -> bool:
        """File ``slot`` (held by the caller) as the snapshot after the first ``offset`` tokens of trie block
        ``block_id``. False, changing nothing, when one is filed there already (the caller keeps its slot) or the
        slot is a snapshot filed elsewhere."""
        if offset < 1 or offset in self._index.at.get(block_id, {}) or self._bm.is_cached(slot):
            return False
        self._bm.mark_cached([slot])  # validates: held, not cached
        self._index.at.setdefault(block_id, {})[offset] = slot
        self._index.where[slot] = (block_id, offset)
        return True

    def forget_blocks(self, block_ids: Iterable[int]) -> int:
        """The trie dropped these blocks: their snapshots leave the cache (an unheld one becomes free). Returns how
        many snapshots were dropped."""
        slots: list[int] = []
        for block in block_ids:
            filed = self._index.at.pop(block, None)
            if filed:
                slots.extend(filed.values())
        for slot in slots:
            del self._index.where[slot]
        if slots:
            self._bm.uncache(slots)
        return len(slots)

    def clear(self) -> int:
        """Forget every snapshot (held ones stay their holders'). Returns how many."""
        return self.forget_blocks(list(self._index.at))

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` on inconsistent bookkeeping."""
        self._bm.check_invariants()
        index = self._index
        filed = sum(len(offsets) for offsets in index.at.values())
        assert filed == len(index.where) == self._bm.num_cached_blocks, "snapshot index is off"
        for block, offsets in index.at.items():
            assert offsets, f"block {block} keeps an empty snapshot index"
            for offset, slot in offsets.items():
                assert index.where.get(slot) == (block, offset), f"snapshot {slot} filed at two places"
                assert self._bm.is_cached(slot), f"snapshot slot {slot} is not marked cached"

    def __repr__(self) -> str:
        return (
            f"StateSlots(num_slots={self.num_slots}, used={self.num_used}, snapshots={self.num_snapshots}, "
            f"free={self.num_free})"
        )

    # ------------------------------------------------------------------ internals
    def _evicting(self, slot: int) -> None:
        filed = self._index.where.get(slot)
        if self._before_evict is not None and filed is not None:
            self._before_evict(slot, *filed)
