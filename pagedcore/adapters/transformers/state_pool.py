"""The tensors of a pool's recurrent-state slots, and how many slots a pool gets.

A :class:`StatePool` holds, for every recurrent state of the model (:class:`~.state_spec.StateShape`: a layer's conv or
recurrent state number ``i``), one tensor ``(num_slots, *shape)``: slot ``s`` of every tensor together is one
sequence's state (the core's :class:`~pagedcore.state_slots.StateSlots` owns which slot is whose). A tensor is made on
the device and dtype of the first state its layer stores, as the KV tensors are (models split over devices work), or
from the probed shapes before a load from a store below the pool. Copy-on-write copies and empty starts
(:meth:`StatePool.apply`) act on every tensor; a slot's bytes (:meth:`StatePool.read`, :meth:`StatePool.write`) are
every state in layer order, C-contiguous.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedcore.errors import ConfigError, PoolMismatchError
from pagedcore.state_slots import StateSlots

from .state_spec import StateShape, StateSpec, probe_states, state_bytes

__all__ = ["DEFAULT_STATE_SLOTS", "StatePlan", "StatePool", "plan_states", "state_stats"]

DEFAULT_STATE_SLOTS = 64
"""State slots of a pool sized by neither ``state_slots`` nor ``memory_budget`` (live states and snapshots)."""

Key = tuple[int, str, int]  # (layer, "conv" / "recurrent", state index)


@dataclass(frozen=True)
class StatePlan:
    """How a pool of a model with recurrent states is split: its KV budget (None: sized by blocks), its state
    slots, and the states' shapes when known.

    Example:
        >>> StatePlan(None, 8, None).num_slots
        8
    """

    kv_budget: int | None
    num_slots: int
    shapes: list[StateShape] | None


def plan_states(
    spec: StateSpec,
    model: Any,
    *,
    state_slots: int | None,
    memory_budget: int | None,
    kv_bytes_per_block: int,
    dtype: torch.dtype,
) -> StatePlan:
    """The state slots of a new pool and what is left of ``memory_budget`` (bytes) for the KV blocks.

    ``state_slots`` given: that many (the rest of a budget goes to the blocks). A budget alone: half of it to the
    slots (the whole budget in a model of state layers only), sized by the states the model keeps
    (:func:`~.state_spec.probe_states`). Neither: :data:`DEFAULT_STATE_SLOTS`.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_hybrid
        >>> model = tiny_hybrid()
        >>> spec = StateSpec.from_config(model.config)
        >>> plan = plan_states(spec, model, state_slots=None, memory_budget=1 << 20, kv_bytes_per_block=2048,
        ...     dtype=torch.float32)
        >>> plan.num_slots, plan.kv_budget + plan.num_slots * state_bytes(plan.shapes) == 1 << 20
        (28, True)
    """
    if not spec.has_states:
        return StatePlan(memory_budget, 0, [])
    shapes = probe_states(model, spec, dtype) if memory_budget is not None else None
    if state_slots is not None:
        slots = int(state_slots)
    elif memory_budget is None:
        slots = DEFAULT_STATE_SLOTS
    else:
        if not shapes:
            raise ConfigError(
                f"cannot size the recurrent-state slots of {spec.model_type!r} from memory_budget (its state sizes "
                "could not be read from the model): give state_slots= as well"
            )
        share = memory_budget if kv_bytes_per_block == 0 else memory_budget // 2
        slots = share // state_bytes(shapes)
    if slots < 1:
        raise ConfigError(f"{spec.model_type!r} keeps recurrent states: the pool needs at least one state slot")
    kv_budget = memory_budget
    if memory_budget is not None and shapes:
        kv_budget = memory_budget - slots * state_bytes(shapes)
    return StatePlan(kv_budget, slots, shapes)


class StatePool:
    """The state tensors of a pool (see the module docstring).

    Args:
        spec: the model's state layers.
        num_slots: slots per tensor.
        shapes: the states' shapes when known (probed), else learned from the first state each stores.

    Example:
        >>> from pagedcore.adapters.transformers.state_spec import StateShape, StateSpec
        >>> pool = StatePool(StateSpec("demo", {0: 1}), num_slots=4, shapes=None)
        >>> conv = pool.tensor((0, "conv", 0), torch.ones(2, 3, 4))   # made from the first state stored
        >>> conv.shape, pool.slot_nbytes()
        (torch.Size([4, 3, 4]), 48)
        >>> conv[1] = 5.0; pool.apply([(1, 2), (None, 1)]); conv[2, 0, 0].item(), conv[1, 0, 0].item()
        (5.0, 0.0)
    """

    def __init__(self, spec: StateSpec, num_slots: int, shapes: list[StateShape] | None) -> None:
        self.spec = spec
        self.num_slots = num_slots
        self._shapes = {(s.layer, s.kind, s.index): s for s in shapes} if shapes else None
        self._tensors: dict[Key, torch.Tensor] = {}

    @property
    def shapes(self) -> list[StateShape] | None:
        """Every state's shape and dtype (probed, or learned from the tensors made so far), or None."""
        if self._shapes is not None:
            return list(self._shapes.values())
        if not self._tensors:
            return None
        return [StateShape(k[0], k[1], k[2], tuple(t.shape[1:]), t.dtype) for k, t in sorted(self._tensors.items())]

    def slot_nbytes(self) -> int:
        """Bytes of one slot over every state (0 while unknown)."""
        shapes = self.shapes
        return state_bytes(shapes) if shapes else 0

    def allocated_bytes(self) -> int:
        """Bytes of the state tensors made so far."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def get(self, key: Key) -> torch.Tensor | None:
        """The tensor of one state, or None before it stored anything."""
        return self._tensors.get(key)

    def tensor(self, key: Key, like: torch.Tensor) -> torch.Tensor:
        """The tensor of one state, made at the first call from ``like`` (a batch of that state: shape, dtype and
        device). Raises :class:`PoolMismatchError` for a state the tensor cannot hold (the model was converted, or
        the pool was built for another one)."""
        tensor = self._tensors.get(key)
        if tensor is None:
            known = None if self._shapes is None else self._shapes.get(key)
            if known is not None and tuple(like.shape[1:]) != known.shape:
                raise PoolMismatchError(
                    f"layer {key[0]}'s {key[1]} state {key[2]} has shape {tuple(like.shape[1:])} per sequence but "
                    f"the pool was sized for {known.shape}"
                )
            with torch.inference_mode(False):  # outlives the forward: never an inference tensor
                tensor = torch.zeros(self.num_slots, *like.shape[1:], dtype=like.dtype, device=like.device)
            self._tensors[key] = tensor
        elif like.dtype != tensor.dtype or like.device != tensor.device or like.shape[1:] != tensor.shape[1:]:
            raise PoolMismatchError(
                f"layer {key[0]} now keeps a {key[1]} state {tuple(like.shape[1:])} of {like.dtype} on {like.device} "
                f"but this pool holds {tuple(tensor.shape[1:])} of {tensor.dtype} on {tensor.device}: the model was "
                "converted (or is another model) after the pool stored states; release its caches and "
                "pool.rebuild()"
            )
        return tensor

    def complete(self) -> bool:
        """Whether every state has its tensor (known only once the shapes are)."""
        return self._shapes is not None and all(key in self._tensors for key in self._shapes)

    def create(self, device: torch.device, probe: Callable[[], list[StateShape] | None]) -> bool:
        """Make every state's tensor now (before a load into a slot), from the shapes ``probe()`` reads off the
        model when they are not known yet. False when they cannot be known."""
        if self._shapes is None:
            shapes = probe()
            if not shapes:
                return False
            self._shapes = {(s.layer, s.kind, s.index): s for s in shapes}
        for key, shape in self._shapes.items():
            if key not in self._tensors:
                self.tensor(key, torch.empty(0, *shape.shape, dtype=shape.dtype, device=device))
        return True

    def apply(self, copies: list[tuple[int | None, int]]) -> None:
        """Perform ``(source, destination)`` slot copies in every state (a source of None: empty the destination)."""
        for source, destination in copies:
            for tensor in self._tensors.values():
                if source is None:
                    tensor[destination].zero_()
                else:
                    tensor[destination].copy_(tensor[source])

    def read(self, slot: int) -> list[torch.Tensor]:
        """A copy of every state of a slot, in layer order."""
        return [self._tensors[key][slot].clone(memory_format=torch.contiguous_format) for key in sorted(self._tensors)]

    def write(self, slot: int, payload: bytes) -> None:
        """Copy a slot's bytes (as :meth:`read` gives them, in layer order) into its states."""
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for key in sorted(self._tensors):
            target = self._tensors[key][slot]
            size = target.numel() * target.element_size()
            target.copy_(raw[offset : offset + size].view(target.dtype).view(target.shape).to(target.device))
            offset += size
        if offset != len(payload):
            raise ValueError(f"write: a payload of {len(payload)} bytes for a state slot of {offset}")

    def drop(self) -> None:
        """Forget every tensor (a rebuild: they are made again at the next states stored)."""
        self._tensors.clear()

    def placement(self) -> tuple[torch.dtype, torch.device] | None:
        """``(dtype, device)`` of the first state tensor, or None before any."""
        first = next(iter(self._tensors.values()), None)
        return None if first is None else (first.dtype, first.device)


def state_stats(slots: StateSlots | None, states: StatePool | None) -> dict[str, int]:
    """The state fields of a pool's :class:`~.pool.MemoryStats` (none for a pool without state slots).

    Example:
        >>> state_stats(None, None)
        {}
    """
    if slots is None or states is None:
        return {}
    each = states.slot_nbytes()
    return {
        "state_slots": slots.num_slots,
        "snapshots": slots.num_snapshots,
        "state_capacity_bytes": each * slots.num_slots,
        "state_used_bytes": each * slots.num_used,
        "state_cached_bytes": each * slots.num_evictable,
    }
