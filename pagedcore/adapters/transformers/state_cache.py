"""The recurrent states of a :class:`~pagedcore.adapters.transformers.PagedCache`: its state layers, and what each
forward reads and writes.

Each batch row's :class:`~pagedcore.block_tables.BlockTables` holds its state slot (:mod:`pagedcore.state_slots`); the
tensors are the pool's (:class:`~.state_pool.StatePool`). Before a forward (the model's forward pre-hook,
:meth:`CacheStates.begin`), every row's slot is made its own (copy-on-write: a fork or a restored snapshot is copied
first, a row's first state starts empty) and the rows' slots are put in one index. The model then asks for and
updates its states the way it does with transformers' ``LinearAttentionLayer`` (``get_conv_state``,
``update_conv_state``, ``get_recurrent_state``, ``update_recurrent_state``, MiniMax's ``get_linear_cache`` /
``set_linear_cache``): it gets the batch's states as one tensor, a view of the pool when the rows' slots are one
ascending run (its in-place updates land in the slots), else a copy that the end of the forward
(:meth:`CacheStates.end`) writes back to the slots, in-place updates included (the decode kernels update conv and SSM
states in place). Everything else follows transformers' rules: a state exists once the cache holds a position, a
prefill shorter than the convolution is padded with zeros, and while past recording is on (assisted decoding) a conv
state keeps every input until a ``crop`` (layers with a recurrent state cannot be cropped, as in transformers).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from pagedcore.block_tables import BlockTables
from pagedcore.errors import InvalidBlockError

from .state_pool import Key, StatePool


class Row(Protocol):
    """What the states read of a cache's row (:class:`~.cache_state.Row` is one): its block tables, which hold its
    state slot."""

    @property
    def blocks(self) -> BlockTables: ...


__all__ = ["CacheStates", "PagedStateLayer", "StateStep"]


class StateStep:
    """One forward's states: the rows' slots, their index, and the copies handed out to write back.

    Example:
        >>> step = StateStep([4, 5, 6], previous=True, device=torch.device("cpu"))
        >>> step.start, StateStep([4, 6], previous=True, device=torch.device("cpu")).start
        (4, None)
    """

    def __init__(self, slots: list[int], *, previous: bool, device: torch.device) -> None:
        self.slots = slots
        self.previous = previous  # the rows had positions before this forward: their states exist
        self.device = device
        run = slots and all(b - a == 1 for a, b in itertools.pairwise(slots))
        self.start: int | None = slots[0] if run else None  # the rows' slots are one ascending run: views
        self.index: torch.Tensor | None = None
        self.working: dict[Key, torch.Tensor] = {}  # copies handed out, written back at the end
        self.wrote = False  # some state layer stored a state in this forward

    def index_on(self, device: torch.device) -> torch.Tensor:
        if self.index is None or self.index.device != device:
            self.index = torch.tensor(self.slots, dtype=torch.long, device=device)
        return self.index


class CacheStates:
    """What a cache's state layers share (the cache's :class:`~.cache_state.CacheState` owns one).

    Args:
        pool: the pool's state tensors.
        lock: the pool's bookkeeping lock.

    Example:
        >>> import torch
        >>> from pagedcore.adapters.transformers import PagedCache
        >>> from pagedcore.adapters.transformers.testing import tiny_hybrid
        >>> model = tiny_hybrid()
        >>> cache = PagedCache(model, num_blocks=8, block_size=4)
        >>> cache.before_forward(input_ids=torch.tensor([[5, 6]]))   # the forward hook does this: slots, index
        >>> cache.get_conv_state(0) is None        # the row's first forward: no state yet, as transformers says
        True
        >>> _ = cache.update_recurrent_state(torch.ones(1, 4, 16, 16), 0)   # what layer 0 computed
        >>> cache.after_forward()                  # written back to the row's slot (here a view of it already)
        >>> cache.layers[0].recurrent_states[0].sum().item(), cache.memory_stats().state_slots
        (1024.0, 1)
    """

    def __init__(self, pool: StatePool, lock: Any, *, rollback: bool = True) -> None:
        self.pool = pool
        self.lock = lock
        self.step: StateStep | None = None
        self.history: dict[Key, torch.Tensor] = {}  # conv inputs kept whole while past recording is on
        self.recording = False
        # While recording, each recurrent state's earlier values (as transformers' layer keeps them: the state before
        # each forward, then the intermediate ones a multi-token forward hands over), until the next crop. A model
        # whose layers hand over none (MiniMax) cannot roll back: ``rollback`` False.
        self.rollback = rollback
        self.keep = 0  # recurrent_states_to_keep: the intermediate states a recording forward computes
        self.states_before: dict[Key, list[torch.Tensor]] = {}

    # ------------------------------------------------------------------ a forward
    def begin(self, rows: Sequence[Row], *, previous: bool, device: torch.device) -> None:
        """Before a forward: each row's slot made its own (the copies done), the rows' slots indexed."""
        self.end()
        with self.lock:
            for row in rows:
                row.blocks.write_state(lambda copy: self.pool.apply([copy]))
        slots = [row.blocks.state_slot for row in rows]
        assert all(slot is not None for slot in slots)
        self.start([s for s in slots if s is not None], previous=previous, device=device)

    def start(self, slots: list[int], *, previous: bool, device: torch.device) -> None:
        """Before a forward whose rows' slots are their own already (the Engine's runner makes them so when it
        prepares a step, under the pool's lock): index them. ``previous``: the rows' states hold tokens."""
        self.end()
        self.step = StateStep(slots, previous=previous, device=device)

    def end(self) -> bool:
        """After a forward: write the copies handed out back to the rows' slots. Returns whether a state layer
        stored a state in it."""
        step, self.step = self.step, None
        if step is None:
            return False
        for key, copy in step.working.items():
            tensor = self.pool.get(key)
            assert tensor is not None
            tensor.index_copy_(0, step.index_on(tensor.device), copy)
        return step.wrote

    def open(self, layer: int) -> StateStep:
        step = self.step
        if step is None:
            raise RuntimeError(
                f"PagedCache: state layer {layer} was called outside a forward the cache was prepared for; the "
                "model's forward hook prepares it (call cache.before_forward(...) yourself before calling a submodule "
                "of the model directly)"
            )
        return step

    def batch(self, step: StateStep, key: Key, like: torch.Tensor | None = None) -> torch.Tensor | None:
        """The rows' states of ``key`` as one tensor: a view of the pool, or a copy written back at the end. None
        while the state has no tensor (and ``like`` does not make it)."""
        held = step.working.get(key)
        if held is not None:
            return held
        tensor = self.pool.get(key) if like is None else self.pool.tensor(key, like)
        if tensor is None:
            return None
        if step.start is not None:
            return tensor.narrow(0, step.start, len(step.slots))
        held = step.working[key] = tensor.index_select(0, step.index_on(tensor.device))
        return held

    def get(self, layer: int, kind: str, index: int) -> torch.Tensor | None:
        """``get_conv_state`` / ``get_recurrent_state``: the rows' state, None before their first one."""
        step = self.open(layer)
        if not step.previous:
            return None
        key = (layer, kind, index)
        if kind == "conv" and self.recording and key in self.history:
            return self.history[key]
        step.wrote = True  # handed out: decode kernels update it in place
        return self.batch(step, key)

    def update_conv(self, layer: int, index: int, new: torch.Tensor, kernel: int | None) -> torch.Tensor:
        """``update_conv_state``: store the last ``kernel`` inputs, return the inputs the convolution sees."""
        step = self.open(layer)
        key = (layer, "conv", index)
        width = new.shape[-1] if kernel is None else kernel
        if step.previous:
            before = self.history.get(key) if self.recording else None
            if before is None:
                before = self.batch(step, key)
            full = new if before is None else torch.cat([before.to(new.dtype), new], dim=-1)
        else:
            full = new
            if not self.recording and full.shape[-1] < width:
                full = torch.nn.functional.pad(full, (width - full.shape[-1], 0), value=0)
        last = full[..., -width:]
        if last.shape[-1] < width:  # recording a prefill shorter than the convolution: its slot is padded
            last = torch.nn.functional.pad(last, (width - last.shape[-1], 0), value=0)
        target = self.batch(step, key, like=last)
        assert target is not None
        target.copy_(last)
        if self.recording:
            self.history[key] = full
        step.wrote = True
        return full

    def update_recurrent(self, layer: int, index: int, new: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """``update_recurrent_state``: store the new state; return the stored one. A list is a recording forward's
        last states (the final one last): the others are kept to roll back through, with the state before it."""
        later: list[torch.Tensor] = []
        if not isinstance(new, torch.Tensor):
            *later, new = new
        step = self.open(layer)
        key = (layer, "recurrent", index)
        target = self.batch(step, key, like=new)
        assert target is not None
        if self.recording and self.rollback:  # the state before this forward, then the intermediate ones
            before = target.clone() if step.previous else torch.zeros_like(target)
            self.states_before.setdefault(key, []).extend([before, *(state.to(target.dtype) for state in later)])
        target.copy_(new)
        step.wrote = True
        return target

    # ------------------------------------------------------------------ between forwards
    def has_kind(self, layer: int, kind: str) -> bool:
        """Whether the layer keeps a state of ``kind`` (known once some cache of the pool stored one)."""
        shapes = self.pool.shapes or []
        return any(s.layer == layer and s.kind == kind for s in shapes)

    def read(self, rows: Sequence[Row], key: Key) -> torch.Tensor | None:
        """The rows' states of ``key`` as a copy (None before any)."""
        tensor = self.pool.get(key)
        slots = [row.blocks.state_slot for row in rows]
        if tensor is None or not rows or any(slot is None for slot in slots):
            return None
        return tensor.index_select(0, torch.tensor(slots, dtype=torch.long, device=tensor.device))

    def select(self, indices: list[int]) -> None:
        """Rows were reordered or forked: the recorded conv inputs and recurrent states follow them."""
        for key, held in self.history.items():
            self.history[key] = held.index_select(0, torch.tensor(indices, dtype=torch.long, device=held.device))
        for key, states in self.states_before.items():
            self.states_before[key] = [
                state.index_select(0, torch.tensor(indices, dtype=torch.long, device=state.device)) for state in states
            ]

    def check_crop(self, tokens_to_remove: int) -> None:
        """Raise unless :meth:`crop` can put every state back by ``-tokens_to_remove`` tokens (nothing changes)."""
        if not self.rollback and any(s.kind == "recurrent" for s in self.pool.shapes or []):
            raise InvalidBlockError(
                "crop: this model's recurrent (linear-attention) state cannot be rolled back (its layers hand over no "
                "intermediate states); transformers refuses assisted decoding with its own cache as well"
            )
        if not self.recording:
            raise RuntimeError(
                "`crop` was called, but the current layer does not track past states. Call `activate_past_recording` "
                "before `crop` to be able to rollback the cache."
            )
        remove = -tokens_to_remove
        for key, full in self.history.items():
            if full.shape[-1] - remove < self._width(key):
                raise InvalidBlockError(
                    f"crop: {remove} tokens back, but layer {key[0]}'s conv state recorded {full.shape[-1]} inputs"
                )
        for key, states in self.states_before.items() if remove else ():
            if remove > len(states):
                raise InvalidBlockError(
                    f"crop: {remove} tokens back, but layer {key[0]}'s recurrent state was recorded for {len(states)}"
                )

    def crop(self, rows: Sequence[Row], tokens_to_remove: int) -> None:
        """``crop``: put conv states back by ``-tokens_to_remove`` inputs and recurrent states to their value
        ``-tokens_to_remove`` tokens ago, as transformers' layers do (past recording must have been on; checked
        first: a refused crop changes nothing); the recorded recurrent states are dropped, as there."""
        self.check_crop(tokens_to_remove)
        remove = -tokens_to_remove
        for key, full in list(self.history.items()):
            width = self._width(key)
            kept = full[..., -width:] if remove == 0 else full[..., -remove - width : -remove]
            self.history[key] = kept
            self.write_rows(rows, key, kept)
        for key, states in self.states_before.items() if remove else ():
            self.write_rows(rows, key, states[-remove])
        self.states_before.clear()

    def write_rows(self, rows: Sequence[Row], key: Key, values: torch.Tensor) -> None:
        """Put ``values`` (one per row) into the rows' slots of ``key`` (each made its own first)."""
        with self.lock:
            for row in rows:
                row.blocks.write_state(lambda copy: self.pool.apply([copy]))
        tensor = self.pool.tensor(key, values)
        slots = torch.tensor([row.blocks.state_slot for row in rows], dtype=torch.long, device=tensor.device)
        tensor.index_copy_(0, slots, values.to(tensor.dtype))

    def reset(self) -> None:
        """Forget the recorded inputs and states and any open forward (the rows' slots go with the rows)."""
        self.step = None
        self.history.clear()
        self.states_before.clear()

    def _width(self, key: Key) -> int:
        tensor = self.pool.get(key)
        assert tensor is not None
        return int(tensor.shape[-1])


class PagedStateLayer(LinearAttentionCacheLayerMixin):
    """A layer of a :class:`~pagedcore.adapters.transformers.PagedCache` that keeps recurrent states (a
    linear-attention, state-space or short-convolution layer): its states live in the pool's state slots, one per row.
    ``conv_states`` / ``recurrent_states`` are what a ``LinearAttentionLayer`` holds after the same calls (copies
    gathered from the slots); ``has_previous_state`` whether the rows have states.

    Example:
        >>> import torch
        >>> from transformers import DynamicCache
        >>> from pagedcore.adapters.transformers import PagedCache
        >>> from pagedcore.adapters.transformers.testing import tiny_hybrid
        >>> model = tiny_hybrid()
        >>> paged, stock = PagedCache(model, num_blocks=8, block_size=4), DynamicCache(config=model.config)
        >>> for cache in (paged, stock):
        ...     _ = model(torch.tensor([[5, 6, 7]]), cache=cache)
        >>> layer = paged.layers[0]
        >>> type(layer).__name__, torch.equal(layer.recurrent_states[0], stock.layers[0].recurrent_states[0])
        ('PagedStateLayer', True)
    """

    is_compileable = False
    supports_early_init = False

    def __init__(self, states: CacheStates, rows: Any, layer_idx: int, number_of_states: int) -> None:
        # LinearAttentionCacheLayerMixin.__init__ is not called: its dicts would hold tensors the slots hold.
        self._states = states
        self._rows = rows  # () -> the cache's rows
        self.layer_idx = layer_idx
        self.number_of_states = number_of_states
        self.record_past = False
        self.is_initialized = True
        self.device = None
        self.dtype = None

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: the pool makes the state tensors at their first write."""

    def update_conv_state(
        self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """Store the last ``conv_kernel_size`` inputs of a conv state; return the inputs the convolution sees."""
        return self._states.update_conv(self.layer_idx, state_idx, conv_states, conv_kernel_size)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        """Store a recurrent state."""
        return self._states.update_recurrent(self.layer_idx, state_idx, recurrent_states)

    @property
    def conv_states(self) -> dict[int, torch.Tensor | None]:  # type: ignore[override]
        """Per state index, the rows' conv states (a copy gathered from the slots)."""
        return {i: self._states.read(self._rows(), (self.layer_idx, "conv", i)) for i in range(self.number_of_states)}

    @property
    def recurrent_states(self) -> dict[int, torch.Tensor | None]:  # type: ignore[override]
        """Per state index, the rows' recurrent states (a copy gathered from the slots)."""
        return {
            i: self._states.read(self._rows(), (self.layer_idx, "recurrent", i)) for i in range(self.number_of_states)
        }

    @property
    def has_previous_state(self) -> dict[int, bool]:  # type: ignore[override]
        """Per state index, whether the rows hold a state."""
        held = bool(self._rows()) and all(row.blocks.state_slot is not None for row in self._rows())
        return dict.fromkeys(range(self.number_of_states), held)

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]  # transformers' class attribute; known per layer here
        """Whether ``crop`` can put the layer back (once it holds a state): conv states through their recorded
        inputs; recurrent states through their recorded values, as transformers 5.25's layers do, unless the model
        hands over no intermediate states (MiniMax, whose own cache cannot be cropped either)."""
        layer, states = self.layer_idx, self._states
        recurrent = states.has_kind(layer, "recurrent")
        return (states.has_kind(layer, "conv") or recurrent) and (states.rollback or not recurrent)

    @property
    def recurrent_states_to_keep(self) -> int:  # type: ignore[override]  # set by transformers; the cache's here
        """The intermediate recurrent states a forward computes while recording (transformers' models read it)."""
        return self._states.keep

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs: Any) -> None:
        """Keep conv inputs whole and recurrent states' earlier values until the next ``crop`` (assisted decoding
        rolls back through them); a recording forward computes its last ``recurrent_states_to_keep`` states."""
        self.record_past = True
        self._states.recording = True
        self._states.keep = int(recurrent_states_to_keep or 0)

    def increase_count(self, state_idx: int = 0) -> None:
        """transformers' decode kernels update a conv state in place and count the token here (5.25); a row's
        positions are its block tables', so there is nothing to count (the in-place update lands in the slot: a view
        of it, or a copy written back after the forward)."""

    def get_max_length(self) -> int:
        """-1: a state has no length."""
        return -1


class StateCacheMixin:
    """The ``Cache`` methods transformers' linear-attention layers call, for a cache whose ``_state`` (a
    :class:`~.cache_state.CacheState`) has :class:`CacheStates`; and MiniMax's ``get_linear_cache`` /
    ``set_linear_cache``."""

    _state: Any
    layers: list[Any]

    def _states_of(self, layer_idx: int) -> CacheStates:
        states = self._state.states
        if states is None or not isinstance(self.layers[layer_idx], LinearAttentionCacheLayerMixin):
            raise ValueError(f"layer {layer_idx} keeps no recurrent state")
        self._state.check_live()
        return states

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The rows' conv state ``state_idx`` of ``layer_idx`` (None before their first one)."""
        return self._states_of(layer_idx).get(layer_idx, "conv", state_idx)

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        """Store a conv state (its last ``conv_kernel_size`` inputs); return the inputs the convolution sees."""
        self._states_of(layer_idx)
        return self.layers[layer_idx].update_conv_state(conv_states, state_idx, **kwargs)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The rows' recurrent state ``state_idx`` of ``layer_idx`` (None before their first one)."""
        return self._states_of(layer_idx).get(layer_idx, "recurrent", state_idx)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        """Store a recurrent state."""
        return self._states_of(layer_idx).update_recurrent(layer_idx, state_idx, recurrent_states)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """Whether the rows hold states (transformers' rule: after the first forward)."""
        if layer_idx is None:
            layer_idx = next(
                (i for i in range(len(self.layers) - 1, -1, -1) if isinstance(self.layers[i], PagedStateLayer)), None
            )
            if layer_idx is None:
                raise ValueError("`has_previous_state` can only be called on LinearAttention layers")
        if layer_idx >= len(self.layers):
            return False
        held = self._states_of(layer_idx)
        step = held.step
        if step is not None:
            return step.previous or step.wrote
        return all(self.layers[layer_idx].has_previous_state.values())

    def snapshot(self) -> int:
        """Keep every row's recurrent state at this point as a snapshot, filed beside the row's block when the row's
        blocks are registered (:meth:`cache_prefixes`): a later prompt sharing the row's tokens so far resumes there.
        Returns the snapshots taken (0 for a model without state layers). ``enable()``'s prefill takes them at the
        pool's snapshot points."""
        state = self._state
        state.check_live()
        with state.pool.lock:
            return sum(row.blocks.snapshot() for row in state.rows)

    @property
    def is_linear(self) -> list[bool]:
        """Per layer, whether it keeps a recurrent state only (transformers' rule). For a model without attention
        layers in a cache ``enable()`` made (:meth:`attach_prefix`, :meth:`take_rows`), none: ``generate`` is then
        given the whole prompt (or conversation) and feeds only the tokens after what the cache holds, as it does for
        models with attention layers (before transformers 5.25 stock ``generate`` never sliced such a model's input:
        there, pass it only the new tokens to continue a cache of your own; from 5.25 on it slices every model's)."""
        linear = [
            isinstance(layer, PagedStateLayer) and not isinstance(layer, CacheLayerMixin) for layer in self.layers
        ]
        if self._state.attached and all(linear):
            return [False] * len(linear)
        return linear

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        """MiniMax: the rows' linear-attention state of ``layer_idx`` (None before their first one)."""
        return self.get_recurrent_state(layer_idx)

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        """MiniMax: store the rows' linear-attention state of ``layer_idx``."""
        self.update_recurrent_state(linear_cache, layer_idx)
