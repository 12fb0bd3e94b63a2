"""StatePlanner: the scheduler's rules for a pool with recurrent-state slots (:mod:`pagedcore.state_slots`).

A model whose layers keep a recurrent state (linear attention, state-space, short convolutions) gives each running
sequence one state slot, which the model runner makes the sequence's own before every forward
(:meth:`~pagedcore.block_tables.BlockTables.write_state`: a first state starts empty, a shared or filed one is copied).
The scheduler plans that like blocks, and this class owns the rules:

- **Slots for the step's writes.** A sequence whose next write takes a slot
  (:meth:`~pagedcore.block_tables.BlockTables.needs_state_slot`) is grown only while the pool can spare one more slot
  than the step promised already (:meth:`StatePlanner.can_write`); else the scheduler preempts, as for blocks.
- **Where prompts keep snapshots.** A recurrent state cannot be cut at a token, so a later prompt resumes only where a
  snapshot was taken. Each step's chunk keeps one at every snapshot point it computes (:meth:`StatePlanner.points`):
  every ``snapshot_interval`` blocks of a prompt computed from its start (a prompt resuming a snapshot keeps none
  there: what it shares with others is resumable already, and each point costs its forward one more piece), the
  block boundary where the prompt leaves the cached prefix it matched (later prompts sharing that prefix resume
  there, whatever the interval), and the prompt's last-but-one token (a repeated prompt resumes there). Snapshots
  are optional: the points of a step take only the slots left after every write (:meth:`StatePlanner.grant`, the
  deepest first); the state where a sequence stops is filed anyway
  (:meth:`~pagedcore.block_tables.BlockTables.cache_partial_block`), so a conversation's next turn resumes at the end
  of the reply.
- **Hits and chunks of a model that resumes a state one token at a time** (:attr:`StateSlots.resumes_chunks
  <pagedcore.state_slots.StateSlots.resumes_chunks>` false: Jamba). A hit is taken only when at most
  :data:`~pagedcore.state_slots.TOKEN_BY_TOKEN_LIMIT` tokens follow it, and a sequence whose state holds tokens
  computes one token per step (:meth:`StatePlanner.chunk`); its prompts keep one snapshot, at their last-but-one token.

The runner computes what the plan says: each chunk up to its snapshot points, the state copied into the snapshot slots
it takes there (:meth:`~pagedcore.block_tables.BlockTables.take_snapshots`); the scheduler files them when it
registers the blocks.
"""

from __future__ import annotations

from pagedcore.block_tables import BlockTables
from pagedcore.capacity import Reservation
from pagedcore.errors import ConfigError
from pagedcore.kv_pool import KVPool, PoolMatch
from pagedcore.sequence import SequenceState
from pagedcore.state_slots import TOKEN_BY_TOKEN_LIMIT

__all__ = ["StatePlanner"]


class StatePlanner:
    """The recurrent-state rules of one scheduler (see the module docstring).

    Args:
        pool: a pool with state slots.
        caching: whether the scheduler uses the prefix cache (else no snapshot is taken).
        watermark: fraction of the slots kept free when admitting a sequence while others run.

    Raises :class:`~pagedcore.errors.ConfigError` for a pool with fewer slots than one sequence needs.

    Example:
        >>> pool = KVPool(num_blocks=16, block_size=4, state_slots=4)
        >>> planner = StatePlanner(pool, caching=True)
        >>> seq = SequenceState("a", list(range(3, 13)), max_new_tokens=2)   # 10 tokens: points 4, 8 and 9
        >>> seq.blocks = BlockTables(pool)
        >>> planner.admitted(seq, None, hit=0)   # computed from its start: a snapshot every block
        >>> planner.points(seq, 0, 10), planner.points(seq, 4, 8)
        ([4, 8, 9], [8])
        >>> again = SequenceState("b", list(range(3, 13)), max_new_tokens=2)
        >>> again.blocks = BlockTables(pool)
        >>> planner.admitted(again, None, hit=4)   # resumed a snapshot at 4: only its last-but-one token's
        >>> planner.points(again, 4, 10)
        [9]
    """

    def __init__(self, pool: KVPool, *, caching: bool, watermark: float = 0.0) -> None:
        states = pool.states
        resource = pool.state_resource
        if states is None or resource is None:
            raise ValueError("StatePlanner: the pool has no recurrent-state slots")
        least = 1 + int(caching)  # a sequence's state, and the snapshot it holds (capacity.slots_to_allocate)
        if states.num_slots < least:
            raise ConfigError(
                f"the Engine needs at least {least} recurrent-state slots (a sequence's state"
                + (" and the snapshot it keeps" if caching else "")
                + f"); this pool has {states.num_slots} (state_slots=)",
                param="state_slots",
            )
        self._pool = pool
        self._states = states
        self._resource = resource
        self._caching = caching
        self._bs = pool.block_size
        self._spacing = states.interval * pool.block_size
        self._chunks = states.resumes_chunks
        self._watermark = int(watermark * states.num_slots)
        self._leaves: dict[str, int] = {}  # request id -> where its prompt leaves the cached prefix it matched
        self._cold: set[str] = set()  # request ids admitted without a hit: their prompts keep periodic snapshots
        self._promised = 0  # slots the writes planned in this step take

    @property
    def resumes_chunks(self) -> bool:
        """Whether the model continues a cached state over a forward of several tokens."""
        return self._chunks

    # ------------------------------------------------------------------ admission
    def hit(self, seq: SequenceState, match: PoolMatch) -> int:
        """The tokens of ``match`` (a snapshot's position) ``seq`` resumes: all of them, or none for a model that
        resumes one token at a time when more than :data:`~pagedcore.state_slots.TOKEN_BY_TOKEN_LIMIT` would follow."""
        if not self._chunks and seq.num_tokens - match.num_tokens > TOKEN_BY_TOKEN_LIMIT:
            return 0
        return match.num_tokens

    def admitted(self, seq: SequenceState, match: PoolMatch | None, hit: int) -> None:
        """Note how ``seq`` starts: from nothing (its prompt then keeps a snapshot every ``snapshot_interval``
        blocks), or from a snapshot (its prompt's rest keeps none: the prefix it shares with others is resumable
        already, and a snapshot point would cut its computation in one more forward); and where its prompt leaves
        the cached prefix it matched, when that is a block boundary past its hit, where a snapshot lets later
        prompts sharing the prefix resume it."""
        if not self._chunks or not self._caching:
            return
        if not hit:
            self._cold.add(seq.request_id)
        leaves = 0 if match is None else match.prefix_tokens // self._bs * self._bs
        if hit < leaves < seq.num_prompt_tokens:
            self._leaves[seq.request_id] = leaves

    def forget(self, request_id: str) -> None:
        """``request_id`` left the scheduler (finished, preempted, aborted)."""
        self._leaves.pop(request_id, None)
        self._cold.discard(request_id)

    # ------------------------------------------------------------------ a step
    def begin(self) -> None:
        """A new step: no slot promised yet."""
        self._promised = 0

    def chunk(self, start: int, num_new: int) -> int:
        """The tokens a sequence whose state holds ``start`` tokens computes in this step, of the ``num_new`` the
        budget allows: one once its state holds tokens, for a model that resumes a state one token at a time."""
        if not self._chunks and start and num_new > 1:
            return 1
        return num_new

    def can_write(self, blocks: BlockTables, *, admitting: bool = False) -> bool:
        """Whether the next write of ``blocks``' state can have its slot, after the writes promised in this step (and
        the watermark, when ``admitting`` while others run)."""
        if not blocks.needs_state_slot():
            return True
        reserve = self._watermark if admitting else 0
        available = self._pool.available_blocks(self._resource, blocks.reservation)
        return available - self._promised >= 1 + reserve

    def promise(self, blocks: BlockTables) -> None:
        """Count the slot the next write of ``blocks``' state takes, if any (after :meth:`can_write`)."""
        self._promised += int(blocks.needs_state_slot())

    def points(self, seq: SequenceState, start: int, end: int) -> list[int]:
        """The snapshot points ``seq``'s chunk of positions ``start .. end - 1`` computes (positions ``p`` in
        ``(start, end]``: the state after ``p`` tokens), ascending: none without prefix caching or when its blocks
        can no longer be registered (a weight update since they were filled)."""
        blocks = seq.blocks
        if not self._caching or blocks is None or not blocks.can_register(seq.namespace):
            return []
        last = seq.num_prompt_tokens - 1
        found: set[int] = set()
        if self._chunks:
            spacing = self._spacing
            if seq.request_id in self._cold:
                found.update(range((start // spacing + 1) * spacing, min(end, last) + 1, spacing))
            leaves = self._leaves.get(seq.request_id)
            if leaves is not None and start < leaves <= end:
                found.add(leaves)
        if start < last <= end and (self._chunks or end - last <= 1):
            found.add(last)  # one token at a time: a point may only leave one token of the chunk after it
        return sorted(found)

    def grant(self, points: list[list[int]], reservation: Reservation | None) -> list[tuple[int, ...]]:
        """Of each chunk's snapshot points, those the slots left after the step's writes can hold (for the holder of
        ``reservation``, whose tables take them): every chunk's deepest first, in plan order."""
        left = self._pool.available_blocks(self._resource, reservation) - self._promised
        granted: list[tuple[int, ...]] = []
        for wanted in points:
            keep = max(0, min(len(wanted), left))
            granted.append(tuple(wanted[len(wanted) - keep :]))
            left -= keep
        return granted
