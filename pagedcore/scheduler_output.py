"""What :meth:`Scheduler.schedule <pagedcore.scheduler.Scheduler.schedule>` hands its caller: one step's plan
(:class:`SchedulerOutput`), one :class:`ScheduledSequence` per sequence to compute; the caller computes it and hands
the plan back to :meth:`Scheduler.update <pagedcore.scheduler.Scheduler.update>` with the sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedcore.block_tables import BlockTables, Copy
from pagedcore.errors import InvalidRequestError
from pagedcore.sequence import SequenceState

__all__ = ["ScheduledSequence", "SchedulerOutput"]


@dataclass(slots=True)
class ScheduledSequence:
    """What to compute for one sequence in a step.

    The token, slot and block-table views read the sequence's live state: use them before handing the step's
    results to :meth:`~pagedcore.scheduler.Scheduler.update` (which moves the sequence on). They are computed on
    access, so a step over hundreds of decoding sequences costs only what its consumer reads.

    Attributes:
        sequence: the sequence.
        start: position of the first token to compute.
        num_new_tokens: tokens to compute now (positions ``start .. start + num_new_tokens - 1``).
        sample: whether this step computes the sequence's last known token, so a new token must be sampled.
        num_samples: tokens to sample after this step: 0 when not sampling, ``sequence.num_samples`` at the step
            that forks a sequence into its parallel samples, else 1.
        snapshots: a model with recurrent-state layers: the positions in ``(start, end]`` after which the runner
            keeps the state as a snapshot (:meth:`BlockTables.take_snapshots
            <pagedcore.block_tables.BlockTables.take_snapshots>`; :mod:`pagedcore.state_planner`), ascending.

    Example:
        >>> from pagedcore import KVPool, Scheduler
        >>> sched = Scheduler(KVPool(num_blocks=4, block_size=2))
        >>> sched.add(SequenceState("a", [7, 8, 9], max_new_tokens=1))
        >>> (item,) = sched.schedule().scheduled
        >>> item.token_ids, item.start, item.slots, item.block_tables, item.sample
        ([7, 8, 9], 0, ([0, 1, 2],), ([0, 1],), True)
    """

    sequence: SequenceState
    start: int
    num_new_tokens: int
    sample: bool
    num_samples: int
    snapshots: tuple[int, ...] = ()

    @property
    def request_id(self) -> str:
        """The sequence's id."""
        return self.sequence.request_id

    @property
    def end(self) -> int:
        """One past the last position computed in this step (the key length after it)."""
        return self.start + self.num_new_tokens

    @property
    def token_ids(self) -> list[int]:
        """Tokens to compute now."""
        return self.sequence.token_ids[self.start : self.start + self.num_new_tokens]

    @property
    def slots(self) -> tuple[list[int], ...]:
        """Per KV group, the physical slot of every new token."""
        blocks = self._blocks()
        end = self.start + self.num_new_tokens
        return tuple(blocks.slots(g, self.start, end) for g in range(len(blocks.pool.groups)))

    @property
    def block_tables(self) -> tuple[list[int], ...]:
        """Per KV group, the live blocks (logical block ``block_offsets[g]`` first)."""
        blocks = self._blocks()
        return tuple(blocks.table(g) for g in range(len(blocks.pool.groups)))

    @property
    def block_offsets(self) -> tuple[int, ...]:
        """Per KV group, leading logical blocks released by a sliding window."""
        blocks = self._blocks()
        return tuple(blocks.num_dropped(g) for g in range(len(blocks.pool.groups)))

    @property
    def blocks(self) -> BlockTables:
        """The sequence's live block tables (raises :class:`InvalidRequestError` once it holds none)."""
        return self._blocks()

    def _blocks(self) -> BlockTables:
        blocks = self.sequence.blocks
        if blocks is None:
            raise InvalidRequestError(f"request {self.request_id!r} holds no blocks any more (updated or aborted)")
        return blocks


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan.

    Attributes:
        scheduled: sequences to compute, decodes first.
        copies: copy-on-write block copies ``(group, source, destination)`` to perform before the forward.
        preempted: ids of sequences preempted in this step (their blocks are back in the pool).
        step: which :meth:`~pagedcore.scheduler.Scheduler.schedule` call planned it (1, 2, ...):
            :meth:`~pagedcore.scheduler.Scheduler.update` records only the latest one, and once.
        failed: requests (by id; a parallel sample's by its parent's) a sequence of which failed while this step
            was planned, with why: the pool's eviction policy (a plugin's code) failed while its blocks were
            allocated. That sequence is finished (``FinishReason.ERROR``), its blocks back; the others are planned.

    Example:
        >>> from pagedcore import KVPool, Scheduler
        >>> Scheduler(KVPool(num_blocks=4, block_size=2)).schedule().is_empty
        True
    """

    scheduled: list[ScheduledSequence]
    copies: list[Copy] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    step: int = 0
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute."""
        return not self.scheduled
