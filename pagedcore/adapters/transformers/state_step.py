"""One Engine step of a model with recurrent-state layers (Qwen3.5, Mamba-2, Jamba...), as the transformers runner
runs it.

An Engine step packs every scheduled token of every sequence into one row; transformers' state layers take rectangular
``(batch, tokens)`` inputs whose rows each continue one state, and a snapshot needs the state at a position inside a
chunk. So such a step runs as several forwards (:meth:`StateSteps.prepare` under the pool's lock, :meth:`StateSteps.
execute` without it):

- before anything runs, every scheduled sequence's state slot is made its own
  (:meth:`~pagedcore.block_tables.BlockTables.write_state`: a first state starts empty, a forked or restored one is
  copied) and the slots of the snapshots the scheduler asked for are taken
  (:meth:`~pagedcore.block_tables.BlockTables.take_snapshots`);
- each chunk is cut at its snapshot points (:attr:`~pagedcore.scheduler.ScheduledSequence.snapshots`) into pieces,
  and after a piece that ends at one its state is copied into the snapshot's slot;
- the pieces run in waves aligned at the chunks' ends (a chunk's pieces one wave after another, every chunk's last
  piece in the last wave); within a wave, pieces of one length that all continue a state (or all start one) run as
  one ``(batch, length)`` forward. So the step's decodes are one ``(batch, 1)`` forward, together with the last
  token of each prompt cut at its last-but-one token;
- attention layers write and read the pool as in any Engine step (:class:`StateStepCache`, paged attention over
  each forward's own metadata); the state layers read and write the rows' slots (:class:`~.state_cache.CacheStates`).

The logits come back in the order the Engine asked for them (:attr:`~pagedcore.engine.runner.ForwardBatch.logit_rows`).
"""

from __future__ import annotations

import bisect
import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, DummyLayer

from pagedcore.attention import long_tensor, to_device, write_kv
from pagedcore.engine.packing import pack_tokens
from pagedcore.engine.runner import ForwardBatch
from pagedcore.errors import OutOfBlocksError
from pagedcore.scheduler import ScheduledSequence

from .attention import CONTEXT_KEY, LAYER_KEY, ForwardContext
from .pool import PagedKVPool
from .state_cache import CacheStates, PagedStateLayer, StateCacheMixin
from .step_batch import PackedLayer

__all__ = ["PreparedStateStep", "StateForward", "StateStepCache", "StateSteps"]


@dataclass
class _Piece:
    """Positions of one sequence computed in one forward, its state slot, and what is kept of it."""

    item: ScheduledSequence  # the sequence and the piece's positions (start, num_new_tokens)
    slot: int  # the sequence's state slot
    snapshot: int | None  # the slot the state after the piece is copied into (its end is a snapshot point)
    keep: dict[int, int] = field(default_factory=dict)  # offset in the piece -> logits row of the step


@dataclass
class StateForward:
    """One forward of a step: ``(batch, length)`` pieces, their slots, and what comes back.

    Attributes:
        input_ids / position_ids: ``(batch, length)``.
        context: the paged-attention context of the forward's rows.
        slot_mapping: per KV group, where the new tokens' keys and values go.
        slots: each row's state slot.
        previous: the rows' states hold tokens (else they start empty).
        keep: offsets in ``length`` whose logits are computed (the union over the rows).
        rows: ``(step row, batch row, index in keep)`` of each logits row the Engine asked for.
        copies: ``(state slot, snapshot slot)`` copies to do after the forward.

    Example:
        >>> from pagedcore import Scheduler, SequenceState
        >>> from pagedcore.adapters.transformers import PagedKVPool
        >>> from pagedcore.adapters.transformers.testing import tiny_hybrid
        >>> model = tiny_hybrid()
        >>> pool = PagedKVPool(model, num_blocks=16, block_size=4)
        >>> scheduler = Scheduler(pool.kv)
        >>> scheduler.add(SequenceState("r", [5, 6, 7, 8, 9, 10], max_new_tokens=2))
        >>> plan = scheduler.schedule()          # the prompt, keeping snapshots after 4 and 5 tokens
        >>> plan.scheduled[0].snapshots
        (4, 5)
        >>> prepared = StateSteps(model, pool, None).prepare(ForwardBatch(plan.scheduled, plan.copies, [5], 6, False))
        >>> [(f.input_ids.shape[1], f.previous, len(f.copies)) for f in prepared.forwards]   # cut at 4 and 5
        [(4, False, 1), (1, True, 1), (1, True, 0)]
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    context: ForwardContext
    slot_mapping: list[torch.Tensor]
    slots: list[int]
    previous: bool
    keep: list[int]
    rows: list[tuple[int, int, int]]
    copies: list[tuple[int | None, int]]


@dataclass(frozen=True)
class PreparedStateStep:
    """A step's forwards, in order, and the logits rows it returns.

    Example:
        >>> PreparedStateStep([], 0).num_forwards
        0
    """

    forwards: list[StateForward]
    num_rows: int

    @property
    def num_forwards(self) -> int:
        """Forwards the step runs."""
        return len(self.forwards)


class StateSteps:
    """The Engine steps of one model with recurrent-state layers (see the module docstring).

    Args:
        model: the model (its attention set to ``"paged"`` by the runner).
        pool: its pool, with state slots.
        attention_backend: the attention backend's name (None: the plugins' choice).

    Example:
        >>> from pagedcore.adapters.transformers import Engine
        >>> from pagedcore.adapters.transformers.testing import tiny_hybrid
        >>> with Engine(tiny_hybrid(), num_blocks=16, block_size=4) as engine:   # its runner steps with one
        ...     (out,) = engine.generate([[5, 6, 7, 8, 9, 10]], max_new_tokens=3, do_sample=False, use_tqdm=False)
        >>> len(out.token_ids)
        3
    """

    def __init__(self, model: Any, pool: PagedKVPool, attention_backend: str | None) -> None:
        assert pool.states is not None
        self.model = model
        self.pool = pool
        self.attention_backend = attention_backend
        self.cache = StateStepCache(pool)
        parameters = inspect.signature(model.forward).parameters
        self._keeps_logits = "logits_to_keep" in parameters
        self._positions = "position_ids" in parameters

    def prepare(self, batch: ForwardBatch) -> PreparedStateStep:
        """Under the pool's lock: the block copies, each sequence's state slot made its own and its snapshot slots
        taken, the chunks cut into pieces and grouped into forwards (see the module docstring)."""
        pool = self.pool
        states = pool.states
        assert states is not None
        pool.copy_blocks(list(batch.copies))
        cut: list[list[_Piece]] = []
        for item in batch.scheduled:
            blocks = item.blocks
            blocks.write_state(lambda copy: states.apply([copy]))
            taken: dict[int, int] = {}
            if item.snapshots:
                try:
                    taken = dict(blocks.take_snapshots(item.snapshots))
                except OutOfBlocksError:  # snapshots are optional: the scheduler granted them, but never fail for one
                    taken = {}
            slot = blocks.state_slot
            assert slot is not None
            cut.append(_cut(item, slot, taken))
        _assign_rows(cut, batch)
        forwards = [self._forward(group) for group in _groups(cut)]
        return PreparedStateStep(forwards, batch.num_rows)

    def _forward(self, group: list[_Piece]) -> StateForward:
        packed = pack_tokens([piece.item for piece in group], self.pool.kv)
        rows, length = len(group), group[0].item.num_new_tokens
        keep = sorted({offset for piece in group for offset in piece.keep})
        where = {offset: i for i, offset in enumerate(keep)}
        kept = [(row, b, where[offset]) for b, piece in enumerate(group) for offset, row in piece.keep.items()]
        context = ForwardContext(self.pool, list(packed.metadata), None, self.attention_backend)
        return StateForward(
            input_ids=long_tensor(packed.input_ids).view(rows, length),
            position_ids=long_tensor(packed.position_ids).view(rows, length),
            context=context,
            slot_mapping=[meta.slot_mapping for meta in packed.metadata],
            slots=[piece.slot for piece in group],
            previous=group[0].item.start > 0,
            keep=keep,
            rows=kept,
            copies=[(piece.slot, piece.snapshot) for piece in group if piece.snapshot is not None],
        )

    def execute(self, prepared: PreparedStateStep, device: torch.device) -> torch.Tensor:
        """Without the lock: the step's forwards in order, each followed by its snapshot copies; float32 logits
        ``(num_rows, vocab)`` in the Engine's order."""
        states = self.pool.states
        assert states is not None
        out: torch.Tensor | None = None
        for forward in prepared.forwards:
            logits = self._run(forward, device)
            if forward.copies:
                states.apply(forward.copies)
            if forward.rows:
                if out is None:
                    out = logits.new_empty(prepared.num_rows, logits.shape[-1], dtype=torch.float32)
                index = [(b, k) for _, b, k in forward.rows]
                picked = logits[[b for b, _ in index], [k for _, k in index]]
                out[torch.tensor([row for row, _, _ in forward.rows], device=out.device)] = picked.float()
        if out is None:
            vocab = self.model.get_output_embeddings().weight.shape[0]
            out = torch.empty(0, vocab, dtype=torch.float32, device=device)
        return out

    def _run(self, forward: StateForward, device: torch.device) -> torch.Tensor:
        """One forward: logits ``(batch, len(keep) or 1, vocab)``."""
        cache = self.cache
        cache.begin(forward.slot_mapping)
        cache.states.start(forward.slots, previous=forward.previous, device=device)
        kwargs: dict[str, Any] = {
            "input_ids": to_device(forward.input_ids, device),
            "cache": cache,
            "use_cache": True,
            CONTEXT_KEY: forward.context,
        }
        if self._positions:
            kwargs["position_ids"] = to_device(forward.position_ids, device)
        keep = forward.keep
        if self._keeps_logits:
            kwargs["logits_to_keep"] = to_device(long_tensor(keep), device) if keep else 1
        try:
            with torch.inference_mode():
                logits = self.model(**kwargs).logits
        finally:
            cache.states.end()  # the copies handed out go back to the slots
        if not self._keeps_logits and keep:
            logits = logits[:, to_device(long_tensor(keep), logits.device)]
        return logits


def _cut(item: ScheduledSequence, slot: int, taken: dict[int, int]) -> list[_Piece]:
    """``item``'s chunk cut at the snapshot points inside it (the state after a piece ending at a point is copied
    into the point's slot)."""
    inside = sorted(p for p in taken if item.start < p < item.end)
    bounds = [item.start, *inside, item.end]
    return [
        _Piece(ScheduledSequence(item.sequence, a, b - a, False, 0), slot, taken.get(b))
        for a, b in itertools.pairwise(bounds)
    ]


def _assign_rows(cut: list[list[_Piece]], batch: ForwardBatch) -> None:
    """Each logits row the Engine asked for (a packed index over the plan's chunks) to the piece computing it."""
    offsets = list(itertools.accumulate((item.num_new_tokens for item in batch.scheduled), initial=0))
    for row, index in enumerate(batch.logit_rows):
        i = bisect.bisect_right(offsets, index) - 1
        position = batch.scheduled[i].start + index - offsets[i]
        piece = next(p for p in cut[i] if p.item.start <= position < p.item.end)
        piece.keep[position - piece.item.start] = row


def _groups(cut: Sequence[list[_Piece]]) -> list[list[_Piece]]:
    """The forwards: waves aligned at the chunks' ends, and in each wave the pieces of one length that all continue
    a state (or all start one), in plan order."""
    waves = max((len(pieces) for pieces in cut), default=0)
    forwards: list[list[_Piece]] = []
    for wave in range(waves):
        groups: dict[tuple[int, bool], list[_Piece]] = {}
        for pieces in cut:
            index = wave - (waves - len(pieces))
            if index >= 0:
                piece = pieces[index]
                groups.setdefault((piece.item.num_new_tokens, piece.item.start > 0), []).append(piece)
        forwards.extend(groups.values())
    return forwards


class _StepStateLayer(PagedStateLayer):
    """A state layer of :class:`StateStepCache` (a hybrid one, Falcon-H1's or Zamba2's, attends too)."""

    def __init__(self, states: CacheStates, layer_idx: int, number_of_states: int, is_sliding: bool) -> None:
        super().__init__(states, tuple, layer_idx, number_of_states)
        self.is_sliding = is_sliding


class _Open:
    """What :class:`~.state_cache.StateCacheMixin` reads of its cache: the states (always live here), and that no
    ``generate`` slices this cache's input (``attached``)."""

    attached = False

    def __init__(self, states: CacheStates) -> None:
        self.states = states

    def check_live(self) -> None:
        """An Engine's cache is never released."""


class StateStepCache(StateCacheMixin, Cache):
    """The cache an Engine forward of a model with recurrent-state layers runs with: each new token's keys and values
    go to its slot in the pool (a ``(batch, length)`` forward, flattened row by row as the forward's metadata lists
    them), the state layers read and write the rows' state slots.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_hybrid
        >>> model = tiny_hybrid()
        >>> cache = StateStepCache(PagedKVPool(model, num_blocks=8, block_size=4))
        >>> [type(layer).__name__ for layer in cache.layers], cache.get_seq_length()
        (['_StepStateLayer', '_StepStateLayer', '_StepStateLayer', 'PackedLayer'], 0)
    """

    def __new__(cls, pool: PagedKVPool) -> StateStepCache:
        if cls is StateStepCache and pool.state_spec.custom_cache:  # MiniMax: its model requires its cache class
            return super().__new__(_custom_class(pool.state_spec.model_type))
        return super().__new__(cls)

    def __init__(self, pool: PagedKVPool) -> None:
        assert pool.states is not None
        self._pool = pool
        self.states = CacheStates(pool.states, pool.lock)
        self._state = _Open(self.states)
        layers: list[Any] = []
        for i, spec in enumerate(pool.spec.layers):
            sliding = spec.kind is not None and spec.kind.is_sliding
            count = pool.state_spec.layers.get(i)
            if count is not None:
                layers.append(_StepStateLayer(self.states, i, count, sliding))
            else:
                layers.append(PackedLayer(sliding) if spec.has_cache else DummyLayer())
        Cache.__init__(self, layers=layers)  # not super(): MiniMax's cache class comes next
        self._slots: list[torch.Tensor] = []
        self._on: dict[tuple[int, torch.device], torch.Tensor] = {}

    def begin(self, slots: list[torch.Tensor]) -> None:
        """Start a forward whose new tokens' keys and values go to ``slots`` (one tensor per KV group)."""
        self._slots = slots
        self._on = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a layer's new keys and values (``(batch, kv_heads, length, dim)``) to their slots; the paged
        attention reads the pool. A layer calling with another module's index (Zamba2's shared attention blocks) has
        its attention told the cache layer it stored."""
        pool = self._pool
        group = pool.group_of(layer_idx)
        batch, heads, length, _ = key_states.shape
        keys = key_states.transpose(1, 2).reshape(batch * length, heads, key_states.shape[-1])
        values = value_states.transpose(1, 2).reshape(batch * length, value_states.shape[1], value_states.shape[-1])
        key_cache, value_cache = pool.layer_kv(layer_idx, keys, values)
        slots = self._on.get((group, keys.device))
        if slots is None:
            slots = self._on[(group, keys.device)] = to_device(self._slots[group], keys.device)
        write_kv(key_cache, value_cache, keys, values, slots)
        model_kwargs = kwargs.get("kwargs")
        if isinstance(model_kwargs, dict):
            model_kwargs[LAYER_KEY] = layer_idx
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """0: a packed forward passes its positions."""
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """The forward's own queries only (the paged attention needs no mask)."""
        return query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False


def _custom_class(model_type: str) -> type[StateStepCache]:
    """A :class:`StateStepCache` that is also the cache class ``model_type`` requires (MiniMax's ``MiniMaxCache``)."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    def length(self: StateStepCache) -> int:
        return len(self.layers)

    return type("MiniMaxStateStepCache", (StateStepCache, MiniMaxCache), {"__len__": length, "__module__": __name__})
