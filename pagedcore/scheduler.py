"""Continuous-batching scheduler over :class:`~pagedcore.sequence.SequenceState` objects.

One mechanism covers prefill, chunked prefill, prefix hits and decode: every sequence has a number of computed
tokens that catches up with its number of tokens, within a per-step token budget. Each step:

1. running sequences, decodes first, then unfinished prefills, oldest first; a sequence that cannot get its blocks
   preempts a running sequence not yet scheduled (by recompute: its blocks go back, it is re-queued at the front and
   later re-hits its own cached prefix), possibly itself, chosen by the policy;
2. waiting sequences in the policy's order (none after a preemption in this step), each starting from its longest
   cached prefix, admitted only when its blocks can be had with a small watermark left free; one that cannot is not
   overtaken. A request whose next prompt block another running sequence is computing right now waits a step (later
   requests may go ahead), so requests that arrive together with a common prefix compute it once and share it.

**Policies** (:attr:`SchedulerConfig.policy`): ``"fair"`` (the default) admits round-robin over namespaces (tenants),
the namespace with the fewest running sequences first and first come first served within one, and under memory
pressure preempts the newest sequence of the namespace running the most, so one tenant's burst cannot delay another
tenant's first token by more than a slot's wait; with one namespace it is ``"fcfs"``. ``"fcfs"``: first come first
served, the newest preempted. ``"priority"``: the lowest :attr:`SequenceState.priority` first (vLLM's convention),
first come first served among equals, the highest value (the newest among equals) preempted first.

**Capacity.** A request is refused when its worst case (:meth:`KVPool.worst_case
<pagedcore.kv_pool.KVPool.worst_case>`) could never fit. Admission is optimistic (its first step must fit, later
growth preempts), and it never takes blocks other holders reserved. The scheduler holds a reservation of its own for
what its running sequences may still allocate, brought up to date whenever another holder reserves (and every step
while another holder has a reservation): an ``enable()``d call sharing the pool cannot reserve those blocks.

The model is not the scheduler's concern: :meth:`Scheduler.schedule` says what to compute, the caller computes it
and hands the sampled tokens to :meth:`Scheduler.update`.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence

from pagedcore.block_keys import namespace_key
from pagedcore.block_tables import BlockTables, Copy
from pagedcore.capacity import Demand
from pagedcore.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    OutOfBlocksError,
    PluginError,
    RequestNotFoundError,
)
from pagedcore.kv_pool import KVPool, PoolMatch
from pagedcore.plugin_manager import PluginManager
from pagedcore.scheduler_config import POLICIES, SchedulerConfig, SchedulerStats
from pagedcore.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedcore.sequence import FinishReason, SequenceState, SequenceStatus
from pagedcore.state_planner import StatePlanner
from pagedcore.validation import token_ids

__all__ = ["POLICIES", "ScheduledSequence", "Scheduler", "SchedulerConfig", "SchedulerOutput", "SchedulerStats"]

logger = logging.getLogger(__name__)


class Scheduler:
    """Continuous batching over a :class:`~pagedcore.kv_pool.KVPool`.

    Args:
        pool: the KV block bookkeeping (one group per attention kind).
        config: limits; see :class:`SchedulerConfig`.
        plugins: receives the request events; none by default.

    Example:
        >>> pool = KVPool(num_blocks=8, block_size=4)
        >>> sched = Scheduler(pool, SchedulerConfig(max_num_batched_tokens=16))
        >>> sched.add(SequenceState("a", [1, 2, 3, 4, 5], max_new_tokens=2))
        >>> step = sched.schedule()
        >>> [(s.request_id, s.token_ids, s.sample) for s in step.scheduled]
        [('a', [1, 2, 3, 4, 5], True)]
        >>> sched.update(step, {"a": [9]})                      # the model sampled token 9
        []
        >>> step = sched.schedule()
        >>> [(s.token_ids, s.start) for s in step.scheduled]    # decode: compute token 9 at position 5
        [([9], 5)]
        >>> [seq.output_token_ids for seq in sched.update(step, {"a": [7]})]
        [[9, 7]]
    """

    def __init__(self, pool: KVPool, config: SchedulerConfig | None = None, *, plugins: PluginManager | None = None):
        self._pool = pool
        self._config = config if config is not None else SchedulerConfig()
        self._plugins = plugins
        # Insertion-ordered maps keyed by request id: O(1) removal, FIFO iteration, newest-first via reversed().
        self._waiting: OrderedDict[str, SequenceState] = OrderedDict()
        self._running: dict[str, SequenceState] = {}
        self._by_id: dict[str, SequenceState] = {}
        self._peaks: dict[str, tuple[int, ...]] = {}  # per waiting or running id: its worst case per group
        self._awaited: set[str] = set()  # running ids whose prompt's partly filled last block a waiting one awaits
        self._keys: dict[str, Hashable] = {}  # per waiting or running id: its namespace's identity (namespace_key)
        self._running_per_key: dict[Hashable, int] = {}  # running sequences per namespace (none: absent)
        self.stats = SchedulerStats()
        self._step = 0  # schedule() calls so far
        self._pending: int | None = None  # the step update() records next (the latest planned; None: recorded)
        self._failed: dict[str, str] = {}  # the step being planned: requests failed while planning it (why)
        bs = pool.block_size
        self._watermark_blocks = int(self._config.watermark * pool.num_blocks)  # every group has num_blocks blocks
        self._bs = bs
        self._has_sliding = any(g.kind.is_sliding for g in pool.groups)
        self._none = [0] * pool.num_resources
        # A model with recurrent-state layers: its sequences' state slots and snapshots (state_planner.py).
        cfg = self._config
        self._states = (
            None
            if pool.states is None
            else StatePlanner(pool, caching=cfg.enable_prefix_caching, watermark=cfg.watermark)
        )
        # What the running sequences may still allocate, held back from other holders of the pool (resized lazily:
        # before another holder reserves, and every step while one holds a reservation).
        self._reservation = pool.reserve(self._none)
        pool.add_claimant(self)

    # ------------------------------------------------------------------ queries
    @property
    def config(self) -> SchedulerConfig:
        """The limits."""
        return self._config

    @property
    def pool(self) -> KVPool:
        """The KV block bookkeeping."""
        return self._pool

    @property
    def num_waiting(self) -> int:
        """Sequences queued."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Sequences holding blocks."""
        return len(self._running)

    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self._waiting or self._running)

    def get(self, request_id: str) -> SequenceState:
        """The waiting or running sequence with this id."""
        try:
            return self._by_id[request_id]
        except KeyError:
            raise RequestNotFoundError(f"no waiting or running request {request_id!r}") from None

    def sequences(self) -> list[SequenceState]:
        """Waiting then running sequences."""
        return [*self._waiting.values(), *self._running.values()]

    def max_new_tokens(self, num_prompt_tokens: int) -> int | None:
        """The most new tokens one sequence with a prompt of this length can ever be given here: the largest
        ``max_new_tokens`` :meth:`check_admissible` accepts for it (0: none; None: any), in one exact query of the
        pool (:meth:`~pagedcore.kv_pool.KVPool.max_new_tokens`) with this scheduler's token budget.

        Example:
            >>> sched = Scheduler(KVPool(num_blocks=2, block_size=2))
            >>> sched.max_new_tokens(3)   # 3 + 2 new tokens store 4 positions: 2 blocks
            2
        """
        return self._pool.max_new_tokens(num_prompt_tokens, chunk=self._config.max_num_batched_tokens)

    def worst_case(self, seq: SequenceState) -> tuple[int, ...]:
        """Per group, the most blocks ``seq`` holds while it runs here alone: its prompt and new tokens, a step of
        at most ``max_num_batched_tokens`` at a time (the pool's :meth:`~pagedcore.kv_pool.KVPool.worst_case`).
        Parallel samples are not multiplied: they can run one at a time, preempting each other.

        Example:
            >>> Scheduler(KVPool(num_blocks=8, block_size=4)).worst_case(SequenceState("a", [1] * 10, max_new_tokens=7))
            (4,)
        """
        cfg = self._config
        snapshots = self._states is not None and cfg.enable_prefix_caching
        demand = Demand(
            seq.num_prompt_tokens, seq.max_new_tokens, chunk=cfg.max_num_batched_tokens, snapshots=snapshots
        )
        return self._pool.worst_case(demand)

    # ------------------------------------------------------------------ commands
    def add(self, seq: SequenceState) -> None:
        """Queue a new sequence. Raises when it can never fit in the pool, or its id is taken."""
        if not isinstance(seq, SequenceState):
            raise InvalidRequestError(f"add: expected a SequenceState, got {type(seq).__name__}")
        if seq.request_id in self._by_id:
            raise DuplicateRequestError(f"request id {seq.request_id!r} is already waiting or running")
        if seq.status is not SequenceStatus.WAITING or seq.blocks is not None or seq.num_computed_tokens:
            raise InvalidRequestError(f"request {seq.request_id!r} was already scheduled once; add a new SequenceState")
        peaks = self._check(seq)
        self._peaks[seq.request_id] = peaks
        self._keys[seq.request_id] = namespace_key(seq.namespace)
        self._enqueue(seq)

    def check_admissible(self, seq: SequenceState) -> None:
        """Raise ``InvalidRequestError`` when ``seq`` could never run under these limits (more parallel samples
        than ``max_num_seqs``, more tokens than the pool holds); changes nothing. :meth:`add` checks it too, so a
        caller can validate a batch of requests before queuing any of them.

        Example:
            >>> sched = Scheduler(KVPool(num_blocks=2, block_size=2))
            >>> sched.check_admissible(SequenceState("a", [1, 2, 3], max_new_tokens=2))   # 4 positions: 2 blocks
            >>> sched.check_admissible(SequenceState("a", [1, 2, 3], max_new_tokens=3))
            Traceback (most recent call last):
            ...
            pagedcore.errors.InvalidRequestError: the request can never fit: 3 prompt tokens + 3 new tokens need 3 ...
        """
        self._check(seq)

    def _check(self, seq: SequenceState) -> tuple[int, ...]:
        # The messages name no request id: a server hands them to its client, who knows its own request.
        cfg = self._config
        if seq.priority and cfg.policy != "priority":
            raise InvalidRequestError(
                f"priority {seq.priority} needs the scheduling policy 'priority' (this one is {cfg.policy!r})",
                param="priority",
            )
        if seq.num_samples > self._config.max_num_seqs:
            raise InvalidRequestError(
                f"n={seq.num_samples} parallel samples are more than the {self._config.max_num_seqs} sequences that "
                "run at once (max_num_seqs)",
                param="n",
            )
        peaks = self.worst_case(seq)
        for short in self._pool.capacity_shortfalls(peaks):
            prompt_alone = Demand(seq.num_prompt_tokens, 1, chunk=self._config.max_num_batched_tokens)
            too_long = bool(self._pool.capacity_shortfalls(self._pool.worst_case(prompt_alone)))
            raise InvalidRequestError(
                f"the request can never fit: {seq.num_prompt_tokens} prompt tokens + {seq.max_new_tokens} new tokens "
                f"need {short.needed} blocks of {self._bs} tokens in KV group {short.group}, but the pool has "
                f"{short.available}",
                param="prompt" if too_long else "max_new_tokens",
            )
        return peaks

    def abort(self, request_id: str) -> list[SequenceState]:
        """Stop a request and its parallel samples; their blocks go back at once. Returns the aborted sequences."""
        victims = [s for s in self.sequences() if s.group_id == request_id or s.request_id == request_id]
        if not victims:
            raise RequestNotFoundError(f"no waiting or running request {request_id!r}")
        for seq in victims:
            self._finish(seq, FinishReason.ABORT)
        self.stats.num_aborted += len(victims)
        self._settle_reservation()
        return victims

    def fail(self, request_ids: Sequence[str]) -> list[SequenceState]:
        """Finish these sequences with ``FinishReason.ERROR`` (e.g. their step raised); blocks go back at once."""
        return self.finish(request_ids, FinishReason.ERROR)

    def finish(self, request_ids: Sequence[str], reason: FinishReason | str) -> list[SequenceState]:
        """Finish these waiting or running sequences (ids of other ones are skipped) with ``reason`` (a
        :class:`FinishReason` or its value), e.g. STOP when their text reached a stop string; their blocks go back at
        once, so no later step computes them. Another reason raises :class:`InvalidRequestError`, changing nothing."""
        try:
            reason = FinishReason(reason)
        except ValueError:
            values = ", ".join(repr(r.value) for r in FinishReason)
            raise InvalidRequestError(
                f"finish: reason must be one of {values}, got {reason!r}", param="reason"
            ) from None
        done = [self._by_id[r] for r in request_ids if r in self._by_id]
        for seq in done:
            self._finish(seq, reason)
        self._settle_reservation()
        return done

    def schedule(self) -> SchedulerOutput:
        """Plan the next step: which tokens of which sequences to compute, with their slots and block tables."""
        budget = self._config.max_num_batched_tokens
        self._failed = {}
        plan: list[tuple[SequenceState, int]] = []
        planned: set[int] = set()
        copies: list[Copy] = []
        preempted: list[str] = []

        decodes: list[tuple[SequenceState, int]] = []
        prefills: list[tuple[SequenceState, int]] = []
        for seq in self._running.values():
            uncomputed = seq.num_uncomputed_tokens
            (decodes if uncomputed == 1 and seq.num_computed_tokens else prefills).append((seq, uncomputed))
        if self._config.policy == "priority":  # the most urgent first: they get the budget, the others are preempted
            decodes.sort(key=_priority)
            prefills.sort(key=_priority)
        running, states = SequenceStatus.RUNNING, self._states
        if states is not None:
            states.begin()
        for seq, uncomputed in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not running:
                continue  # preempted earlier in this step
            num_new = uncomputed if uncomputed < budget else budget
            try:
                if states is not None:
                    num_new = states.chunk(seq.num_computed_tokens, num_new)
                    grown = None
                else:  # the common case first: the tables grow without preempting (a decode: a few comparisons)
                    grown = _tables(seq).try_append(num_new)
                if grown is None:
                    grown = self._grow(seq, num_new, planned, preempted)
            except PluginError as exc:  # the pool's eviction policy failed: this sequence fails, the step goes on
                self._fail_planned(seq, exc)
                continue
            if grown is None:
                continue
            if grown:
                copies.extend(grown)
            plan.append((seq, num_new))
            planned.add(id(seq))
            budget -= num_new

        if not preempted:
            budget = self._admit(budget, plan, copies)

        scheduled = [self._scheduled(seq, num_new) for seq, num_new in plan]
        if states is not None:  # the snapshot points of each chunk, as far as the slots left allow
            points = [states.points(item.sequence, item.start, item.end) for item in scheduled]
            for item, granted in zip(scheduled, states.grant(points, self._reservation)):
                item.snapshots = granted
        if self._failed:  # as finish() does: the failed sequences' blocks are no longer held back for them
            self._settle_reservation()
        self.stats.num_steps += 1
        self._step += 1
        self._pending = self._step
        return SchedulerOutput(scheduled, copies, preempted, self._step, self._failed)

    def _grow(self, seq: SequenceState, num_new: int, planned: set[int], preempted: list[str]) -> list[Copy] | None:
        """Grow a running sequence's tables by ``num_new`` positions (and count the state slot its write takes),
        preempting the policy's victims while they cannot be had; None when ``seq`` itself was preempted."""
        blocks, states = _tables(seq), self._states
        grown = blocks.try_append(num_new)
        while grown is None or (states is not None and not states.can_write(blocks)):
            victim = self._victim(planned)
            assert victim is not None  # ``seq`` itself is unplanned
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is seq:
                return None
            if grown is None:
                grown = blocks.try_append(num_new)
        if states is not None:
            states.promise(blocks)
        return grown

    def update(self, output: SchedulerOutput, sampled: Mapping[str, Sequence[int]]) -> list[SequenceState]:
        """Record a computed step: the latest :meth:`schedule`'s output, once (a replayed or superseded one raises
        :class:`InvalidRequestError`). ``sampled[request_id]`` holds the token ids (integers >= 0) sampled for every
        scheduled sequence with ``sample=True`` (``num_samples`` tokens at a forking step, else one). Bad input
        raises, naming the request and the value, and changes nothing; so does a forking step whose samples' ids
        (``"<id>#1"`` ..) another request holds (:class:`DuplicateRequestError`: abort one, then update again).

        Returns the sequences that finished in this step (forked samples included).
        """
        live = self._checked(output, sampled)
        self._pending = None
        finished: list[SequenceState] = []
        cache = self._config.enable_prefix_caching
        sliding = self._has_sliding
        computed = prompt_computed = 0
        for item, tokens in live:
            seq = item.sequence
            blocks = _tables(seq)
            end = item.start + item.num_new_tokens
            seq.num_computed_tokens = end
            computed += item.num_new_tokens
            prompt_len = seq.num_prompt_tokens
            if item.start < prompt_len:
                prompt_computed += min(end, prompt_len) - item.start
            if cache:
                blocks.cache_full_blocks(seq.token_ids, end, seq.namespace)
                if item.sample and seq.request_id in self._awaited:  # its prompt is done: share its last block
                    self._awaited.discard(seq.request_id)
                    blocks.cache_partial_block(seq.token_ids, end, seq.namespace)
            # One pass for all three outcomes: no token (a prefill chunk), one token, or the forking step's tokens.
            family = [seq, *self._fork(seq, item.num_samples - 1)] if item.num_samples > 1 else (seq,)
            for member, token in zip(family, tokens):
                if token is not None:
                    reason = member.append_token(token)
                    if reason is not None:
                        self._finish(member, reason)
                        finished.append(member)
                        continue
                if sliding:
                    assert member.blocks is not None
                    member.blocks.drop_out_of_window(end)
        self.stats.num_computed_tokens += computed
        self.stats.num_prompt_tokens_computed += prompt_computed
        self._settle_reservation()
        return finished

    def _checked(
        self, output: SchedulerOutput, sampled: Mapping[str, Sequence[int]]
    ) -> list[tuple[ScheduledSequence, Sequence[int | None]]]:
        """:meth:`update`'s input, validated before anything changes: the step's live items (those not aborted or
        failed since it was planned), each with its sampled tokens (:data:`_NO_TOKEN` when it samples none)."""
        if output.step != self._pending:  # a replayed step, or one planned before the latest schedule()
            why = "was recorded already" if output.step == self._step else f"is not the latest planned ({self._step})"
            raise InvalidRequestError(
                f"update: step {output.step} {why}: update takes the latest schedule()'s output, once"
            )
        live: list[tuple[ScheduledSequence, Sequence[int | None]]] = []
        running, by_id = SequenceStatus.RUNNING, self._by_id
        for item in output.scheduled:
            seq = item.sequence
            if seq.status is not running or by_id.get(seq.request_id) is not seq:
                continue  # aborted or failed after the step was planned
            if not item.sample:
                live.append((item, _NO_TOKEN))
                continue
            if item.num_samples > 1:  # a forking step: its samples' ids must be free (update must not fail halfway)
                taken = [rid for rid in _fork_ids(seq, item.num_samples - 1) if rid in by_id]
                if taken:
                    raise DuplicateRequestError(
                        f"update: request {seq.request_id!r} forks into {taken}, ids already in use by other requests; "
                        "nothing was recorded (abort one of them, then update again)",
                        param="request_id",
                    )
            tokens = sampled.get(seq.request_id, ())
            if type(tokens) is not list or len(tokens) != item.num_samples:
                tokens = _sampled(seq.request_id, tokens, item.num_samples)
            for token in tokens:  # the hot path: a plain int >= 0 costs two comparisons
                if type(token) is not int or token < 0:
                    tokens = _sampled(seq.request_id, tokens, item.num_samples)
                    break
            live.append((item, tokens))
        return live

    def refresh_reservation(self) -> None:
        """Hold back, for the running sequences, the blocks they may still allocate before they finish (each one's
        worst case less what its tables hold), as far as other holders leave room. The pool calls it before it grants
        a reservation to another holder (this scheduler is a :class:`~pagedcore.kv_pool.Claimant`), so an
        ``enable()``d call sharing the pool cannot reserve what the running requests need to grow.

        Example:
            >>> pool = KVPool(num_blocks=16, block_size=4)
            >>> sched = Scheduler(pool)
            >>> sched.add(SequenceState("a", [1] * 6, max_new_tokens=20))   # 25 positions at most: 7 blocks
            >>> _ = sched.schedule()                                        # the prompt holds 2
            >>> pool.reserve([12])
            Traceback (most recent call last):
            ...
            pagedcore.errors.OutOfBlocksError: reserve: KV group 0 cannot spare 12 blocks: 9 of its 16 are ...
        """
        needs = list(self._none)
        slots = self._pool.state_resource
        for seq in self._running.values():
            assert seq.blocks is not None
            peaks = self._peaks[seq.request_id]
            for g, count in enumerate(seq.blocks.blocks_to_peak(peaks)):
                needs[g] += count
            if slots is not None:  # the state slots it may still take
                needs[slots] += max(0, peaks[slots] - seq.blocks.num_held_slots())
        self._reservation.resize(needs)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` on inconsistent state (tests and debugging)."""
        self._pool.check_invariants()
        assert len(self._running) <= self._config.max_num_seqs, "more sequences running than max_num_seqs"
        ids = [s.request_id for s in self.sequences()]
        assert len(ids) == len(set(ids)) == len(self._by_id), "request ids are not unique"
        for seq in self._waiting.values():
            assert seq.status is SequenceStatus.WAITING and seq.blocks is None
        for seq in self._running.values():
            assert seq.status is SequenceStatus.RUNNING and seq.blocks is not None
            assert seq.blocks.num_tokens >= seq.num_computed_tokens
            for g in range(len(self._pool.groups)):
                assert seq.blocks.table_array(g).tolist() == seq.blocks.table(g), "a stale BlockTables.table_array"
        running = [self._keys[s.request_id] for s in self._running.values()]
        assert {k: running.count(k) for k in set(running)} == self._running_per_key, "running counts per namespace"
        assert set(self._peaks) == set(self._keys) == set(self._by_id), "per-request state of unknown requests"
        held = sum(s.blocks.num_held_blocks() for s in self._running.values() if s.blocks is not None)
        refs = sum(g.block_manager.ref_count(b) for g in self._pool.groups for b in range(g.block_manager.num_blocks))
        assert held == refs, f"sequences hold {held} block references, the pool counts {refs}"
        states = self._pool.states
        if states is not None:
            held = sum(s.blocks.num_held_slots() for s in self._running.values() if s.blocks is not None)
            refs = sum(states.ref_count(slot) for slot in range(states.num_slots))
            assert held == refs, f"sequences hold {held} state slot references, the slots count {refs}"

    # ------------------------------------------------------------------ internals
    def _enqueue(self, seq: SequenceState, *, front: bool = False) -> None:
        self._by_id[seq.request_id] = seq
        self._waiting[seq.request_id] = seq
        if front:
            self._waiting.move_to_end(seq.request_id, last=False)

    def _victim(self, planned: set[int]) -> SequenceState | None:
        """The running sequence not yet planned in this step that the policy preempts first."""
        policy = self._config.policy
        newest_first = (seq for seq in reversed(self._running.values()) if id(seq) not in planned)
        if policy == "fcfs":
            return next(newest_first, None)
        if policy == "priority":  # max keeps the first of equals: the newest of the least urgent
            return max(newest_first, key=lambda seq: seq.priority, default=None)
        counts, keys = self._running_per_key, self._keys  # fair: the newest of the namespace running the most
        return max(newest_first, key=lambda seq: counts[keys[seq.request_id]], default=None)

    def _preempt(self, seq: SequenceState) -> None:
        assert seq.blocks is not None
        if self._config.enable_prefix_caching:  # it re-hits its own prefix, to the token
            seq.blocks.cache_partial_block(seq.token_ids, seq.num_computed_tokens, seq.namespace)
        seq.blocks.release()
        seq.blocks = None
        del self._running[seq.request_id]
        self._count_running(seq, -1)
        if self._states is not None:
            self._states.forget(seq.request_id)
        seq.status = SequenceStatus.WAITING
        computed = seq.num_computed_tokens
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._waiting[seq.request_id] = seq
        self._waiting.move_to_end(seq.request_id, last=False)
        self._emit("pagedcore_request_preempted", request_id=seq.request_id, num_computed_tokens=computed)

    def _admit(self, budget: int, plan: list[tuple[SequenceState, int]], copies: list[Copy]) -> int:
        cfg = self._config
        if budget == 0 or not self._waiting:
            return budget  # before the count below: a decode step of hundreds of rows admits nobody most steps
        # Count the samples running sequences will still fork into, so a fork never exceeds max_num_seqs.
        width = sum(_width(s) for s in self._running.values())
        if width >= cfg.max_num_seqs:
            return budget
        for seq in self._admission_order():
            if budget == 0 or width + _width(seq) > cfg.max_num_seqs:
                break
            match = None
            reads = cfg.enable_prefix_caching and seq.read_prefix_cache
            if reads:
                self._pool.load_prefix(seq.token_ids, seq.namespace)  # the tiers below the pool, if any
                # With state slots a hit is a snapshot's position, which must leave a token to compute.
                limit = None if self._states is None else seq.num_tokens - 1
                match = self._pool.match(seq.token_ids, seq.namespace, max_tokens=limit)
            if match is not None and self._prefix_in_flight(seq, match.num_tokens):
                # A running sequence is computing this prompt's next blocks right now: wait a step and hit them
                # in the cache instead of computing them twice (later requests may go ahead meanwhile).
                continue
            blocks = self._start_blocks(seq, budget, match)
            if blocks is None:
                break  # a request that cannot get its blocks is not overtaken
            hit, num_new = blocks.num_tokens, min(seq.num_tokens - blocks.num_tokens, budget)
            if self._states is not None:
                self._states.admitted(seq, match, hit)
                self._states.promise(blocks)
                num_new = self._states.chunk(hit, num_new)
            if not self._first_append(seq, blocks, num_new, copies):
                continue  # it failed (the pool's eviction policy did); the others may still be admitted
            del self._waiting[seq.request_id]
            seq.blocks = blocks
            seq.num_computed_tokens = hit
            seq.num_cached_tokens = hit
            seq.status = SequenceStatus.RUNNING
            self._running[seq.request_id] = seq
            self._count_running(seq, 1)
            width += _width(seq)
            plan.append((seq, num_new))
            budget -= num_new
            self.stats.num_admitted += 1
            if reads:  # a sequence that does not read the cache makes no query (vLLM's count too)
                self._pool.record(seq.num_tokens, hit)
                self._emit(
                    "pagedcore_prefix_hit",
                    request_id=seq.request_id,
                    num_query_tokens=seq.num_tokens,
                    num_hit_tokens=hit,
                    namespace=seq.namespace,
                    block_ids=match.head(hit, self._bs) if match is not None else (),
                )
            self._emit(
                "pagedcore_request_admitted",
                request_id=seq.request_id,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_cached_tokens=hit,
            )
        return budget

    def _first_append(self, seq: SequenceState, blocks: BlockTables, num_new: int, copies: list[Copy]) -> bool:
        """``blocks.append(num_new)`` for ``seq``'s admission (all groups or none), its copies added to ``copies``.
        When it raises anyway ``blocks`` go back, its prefix hit's too (they would be held by nobody): a
        :class:`PluginError` (the pool's eviction policy, a plugin's code, failed) fails ``seq`` alone (False),
        anything else the step."""
        try:
            copies.extend(blocks.append(num_new))
            return True
        except BaseException as exc:
            blocks.release()
            if self._states is not None:
                self._states.forget(seq.request_id)
            if not isinstance(exc, PluginError):
                raise
            self._fail_planned(seq, exc)
            return False

    def _fail_planned(self, seq: SequenceState, exc: PluginError) -> None:
        """Fail ``seq`` while planning a step (its blocks' eviction policy failed), reported in the step's
        :attr:`~pagedcore.scheduler_output.SchedulerOutput.failed` under its request's id."""
        logger.error("pagedcore: request %r failed: %s", seq.request_id, exc)
        self._finish(seq, FinishReason.ERROR)
        self._failed.setdefault(seq.group_id, f"{type(exc).__name__}: {exc}")

    def _admission_order(self) -> list[SequenceState]:
        """The waiting sequences in the order the policy admits them."""
        waiting = list(self._waiting.values())  # first come first served, preempted ones at the front
        policy = self._config.policy
        if policy == "priority":
            waiting.sort(key=lambda seq: seq.priority)  # stable: first come first served among equals
        elif policy == "fair" and len(waiting) > 1:
            queues: dict[Hashable, list[SequenceState]] = {}
            for seq in waiting:
                queues.setdefault(self._keys[seq.request_id], []).append(seq)
            if len(queues) > 1:
                # The namespace running the fewest sequences first (the oldest first among equals), then turn by turn.
                counts = self._running_per_key
                order = sorted(queues.values(), key=lambda queue: counts.get(self._keys[queue[0].request_id], 0))
                turns = itertools.zip_longest(*order)
                waiting = [seq for turn in turns for seq in turn if seq is not None]
        return waiting

    def _count_running(self, seq: SequenceState, change: int) -> None:
        key = self._keys[seq.request_id]
        count = self._running_per_key.get(key, 0) + change
        if count:
            self._running_per_key[key] = count
        else:
            del self._running_per_key[key]

    def _settle_reservation(self) -> None:
        """Keep the scheduler's reservation current while another holder has one; give it back when none has."""
        if self._pool.has_reservations(excluding=self._reservation):
            self.refresh_reservation()
        elif self._reservation.active:
            self._reservation.resize(self._none)

    def _prefix_in_flight(self, seq: SequenceState, num_cached: int) -> bool:
        """Whether a running sequence of the same namespace has the same tokens as ``seq`` up to the end of the
        block after ``seq``'s cached prefix (or, within the prompt's last block, up to its last token), and has not
        computed them yet (it is being prefilled). That sequence then registers its prompt's partly filled last
        block when its prompt is done (:meth:`update`), so that ``seq`` (a GRPO group's other samples) reuses all
        but its last token."""
        end = min(num_cached + self._bs, seq.num_tokens - 1)  # the last token is always computed
        if end <= num_cached:
            return False  # nothing more of this prompt could be shared
        tokens, namespace = seq.token_ids, namespace_key(seq.namespace)
        for other in self._running.values():
            if other.num_computed_tokens >= end or other.num_tokens < end:
                continue
            if namespace_key(other.namespace) != namespace:  # the trie's identity: 1 and True are two namespaces
                continue
            theirs = other.token_ids
            if theirs[num_cached:end] == tokens[num_cached:end] and theirs[:num_cached] == tokens[:num_cached]:
                self._awaited.add(other.request_id)
                return True
        return False

    def _start_blocks(self, seq: SequenceState, budget: int, match: PoolMatch | None) -> BlockTables | None:
        """Blocks for ``seq``'s first step (prefix hit attached), or None when they cannot be had now."""
        reserve = self._watermark_blocks if self._running else 0
        hit, states = 0, self._states
        if match is not None:
            hit = min(match.num_tokens, seq.num_tokens - 1)  # the last token is always computed (for its logits)
        if states is not None:  # a hit is exactly a snapshot's position, or none
            candidates = [states.hit(seq, match)] if match is not None else [0]
        else:
            candidates = [hit] if hit % self._bs == 0 else [hit, hit - hit % self._bs]  # partial hit needs a copy
        for num_hit in candidates:
            blocks = BlockTables(self._pool, self._reservation)
            if match is not None and num_hit:
                try:
                    blocks.attach(match, num_hit)
                except OutOfBlocksError:  # reviving its cached blocks would take blocks other holders reserved
                    continue
                blocks.drop_out_of_window(num_hit)
            fits = blocks.can_append(min(seq.num_tokens - num_hit, budget), reserve=reserve)
            if fits and (states is None or states.can_write(blocks, admitting=bool(self._running))):
                return blocks
            blocks.release()
        return None

    def _scheduled(self, seq: SequenceState, num_new: int) -> ScheduledSequence:
        end = seq.num_computed_tokens + num_new
        sample = end == seq.num_tokens
        num_samples = (seq.num_samples if seq.needs_fork else 1) if sample else 0
        return ScheduledSequence(seq, seq.num_computed_tokens, num_new, sample, num_samples)

    def _fork(self, parent: SequenceState, count: int) -> list[SequenceState]:
        assert parent.blocks is not None
        children = []
        for k, request_id in enumerate(_fork_ids(parent, count), 1):
            assert request_id not in self._by_id, "update's validation checks the fork ids first"
            child = parent.child(request_id, k)
            child.blocks = parent.blocks.fork()
            child.status = SequenceStatus.RUNNING
            self._by_id[child.request_id] = child
            self._peaks[child.request_id] = self._peaks[parent.request_id]
            self._keys[child.request_id] = self._keys[parent.request_id]
            self._running[child.request_id] = child
            self._count_running(child, 1)
            children.append(child)
        parent.mark_forked()
        return children

    def _finish(self, seq: SequenceState, reason: FinishReason) -> None:
        self._awaited.discard(seq.request_id)
        if seq.blocks is not None:
            if self._config.enable_prefix_caching and reason in _KEEPS_KV:
                # The next chat turn continues it inside its last block: register that block's computed positions.
                seq.blocks.cache_partial_block(seq.token_ids, seq.num_computed_tokens, seq.namespace)
            seq.blocks.release()
            seq.blocks = None
        if seq.status is SequenceStatus.RUNNING:
            del self._running[seq.request_id]
            self._count_running(seq, -1)
        elif seq.status is SequenceStatus.WAITING:
            del self._waiting[seq.request_id]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._by_id.pop(seq.request_id, None)
        self._peaks.pop(seq.request_id, None)
        self._keys.pop(seq.request_id, None)
        if self._states is not None:
            self._states.forget(seq.request_id)
        if reason is not FinishReason.ABORT:
            self.stats.num_finished += 1
        self._emit(
            "pagedcore_request_finished",
            request_id=seq.request_id,
            finish_reason=reason.value,
            num_output_tokens=seq.num_output_tokens,
        )

    def _emit(self, hook: str, **kwargs: object) -> None:
        if self._plugins is not None:
            self._plugins.emit(hook, **kwargs)


_NO_TOKEN: tuple[None] = (None,)
# Finishes whose computed keys and values are complete: an abort may come while a forward writes the sequence's
# blocks, and a failed step may have written some layers only.
_KEEPS_KV = frozenset({FinishReason.STOP, FinishReason.LENGTH})


def _sampled(request_id: str, tokens: object, count: int) -> list[int]:
    """The ``count`` token ids sampled for ``request_id`` (the rule: :func:`~pagedcore.validation.token_ids`), or
    :class:`InvalidRequestError` naming the request and the values."""
    ids = token_ids(tokens, name=f"update: request {request_id!r}: sampled token ids", allow_empty=True)
    if len(ids) != count:
        raise InvalidRequestError(f"update: request {request_id!r} needs {count} sampled tokens, got {len(ids)}")
    return ids


def _fork_ids(parent: SequenceState, count: int) -> list[str]:
    """The request ids of a parent's ``count`` forked samples: ``"<parent>#1"`` .. ``"<parent>#<count>"``."""
    return [f"{parent.request_id}#{k}" for k in range(1, count + 1)]


def _priority(item: tuple[SequenceState, int]) -> int:
    return item[0].priority


def _width(seq: SequenceState) -> int:
    """Running slots a sequence takes once it has forked into its parallel samples."""
    return seq.num_samples if seq.needs_fork else 1


def _tables(seq: SequenceState) -> BlockTables:
    """A running sequence's block tables (it always holds them)."""
    blocks = seq.blocks
    assert blocks is not None
    return blocks
