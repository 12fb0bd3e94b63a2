"""What a :class:`~pagedcore.adapters.transformers.PagedCache` and its layers share: the rows' blocks, the layers'
lengths, and each forward's reservation.

Per forward, the first layer that sees new keys has :class:`CacheState` reserve the forward once for all layers:
:func:`~.forward_plan.plan_forward` says which rows grow by how many real tokens (the padding read from the
positions), then the reservation gives back sliding-window blocks no query will see, grows every row or none
(:func:`pagedcore.block_tables.append_all`) and computes the new tokens' slots in every KV group (a :class:`Step`).
Each layer then writes its own keys and values and gathers what its attention reads (``PagedLayer.update``).

The state never refers back to the cache object, so a cache dropped without ``release()`` can be garbage collected;
its finalizer releases the state's blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedcore.attention import PagedAttentionMetadata, contiguous_start
from pagedcore.block_tables import BlockTables, append_all
from pagedcore.capacity import Reservation
from pagedcore.errors import InvalidBlockError, OutOfBlocksError

from .attention import ATTN_IMPLEMENTATION, ForwardContext
from .forward_plan import ForwardPlan, plan_forward
from .pool import PagedKVPool

__all__ = ["CacheState", "Row", "Step"]


class Row:
    """One batch row: its blocks, and the left padding it does not store.

    Example:
        >>> from pagedcore import KVPool
        >>> row = Row(BlockTables(KVPool(num_blocks=4, block_size=2)), pad=3)
        >>> row.copy().pad
        3
    """

    __slots__ = ("blocks", "declared_pad", "pad", "prompt")

    def __init__(
        self, blocks: BlockTables, pad: int = 0, declared_pad: int | None = None, prompt: Sequence[int] | None = None
    ) -> None:
        self.blocks = blocks
        self.pad = pad  # leading rectangular positions that are padding and not stored
        self.declared_pad = declared_pad  # the row's whole left padding, when declared by attach_prefix
        self.prompt = prompt  # the row's first real tokens, when declared: registered before a window drops them

    def copy(self) -> Row:
        """A row sharing this one's blocks (copy-on-write)."""
        return Row(self.blocks.fork(), self.pad, self.declared_pad, self.prompt)


@dataclass
class Step:
    """One forward's reservation, shared by all layers.

    Attributes:
        plan: what the forward stores (rows, real tokens, padding).
        slots: per KV group, the slot of every stored new token (row-major).
        real_index: flat indices of the stored tokens among ``batch * q_len`` (None: all are stored).
        context: what ``attn_implementation="paged"`` reads (None: the layers return gathered keys instead).

    Example:
        >>> plan = ForwardPlan(batch=1, q_len=2, start=0, before=(0,), pads=(0,), exact=True)
        >>> step = Step(plan, [[4, 5]], None)
        >>> step.tensor("slots", torch.device("cpu"), lambda: torch.tensor(step.slots[0])).tolist()
        [4, 5]
    """

    plan: ForwardPlan
    slots: list[list[int]]
    real_index: torch.Tensor | None
    context: ForwardContext | None = None
    _on: dict[Any, torch.Tensor] = field(default_factory=dict, repr=False)
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False)

    def tensor(self, key: Any, device: torch.device, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``build()`` on ``device``, built once per forward and device (layers split over devices share it)."""
        cached = self._on.get((key, device))
        if cached is None:
            cached = self._on[(key, device)] = build().to(device)
        return cached

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()``, computed once per forward (what every layer of a group derives alike)."""
        if key in self._memo:
            return self._memo[key]
        value = self._memo[key] = build()
        return value

    def write_slots(self, group: int, device: torch.device) -> torch.Tensor | int:
        """Where ``write_kv`` puts the group's new tokens: their first slot when they are consecutive slots (every
        decode step of a sequence within its blocks), else their slots as a tensor on ``device``.

        Example:
            >>> plan = ForwardPlan(batch=1, q_len=2, start=0, before=(0,), pads=(0,), exact=True)
            >>> Step(plan, [[4, 5]], None).write_slots(0, torch.device("cpu")), Step(plan, [[4, 9]], None).write_slots(
            ...     0, torch.device("cpu")).tolist()
            (4, [4, 9])
        """
        slots = self.slots[group]
        run = self.memo(("run", group), lambda: _run_start(slots))
        if run is not None:
            return int(run)
        return self.tensor(("slots", group), device, lambda: torch.tensor(slots, dtype=torch.long))


def _run_start(slots: list[int]) -> int | None:
    """The first slot when ``slots`` are consecutive (and not empty), else None."""
    if not slots or slots[-1] - slots[0] != len(slots) - 1:
        return None
    return slots[0] if all(b - a == 1 for a, b in itertools.pairwise(slots)) else None


class CacheState:
    """Everything a PagedCache owns; its layers and its finalizer share it (no reference back to the cache).

    Args:
        pool: the pool the blocks come from.
        num_layers: the model's decoder layers.
        config: the model's text config (None when built from a pool alone): its attention implementation decides
            whether forwards get a paged-attention context.
        namespace: prefix-cache namespace for registering the rows' blocks.
        attention_backend: backend name for the paged-attention context.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama_config
        >>> state = CacheState(PagedKVPool(tiny_llama_config(), num_blocks=8), num_layers=2)
        >>> state.length, state.rows, state.exact
        (0, [], True)
    """

    def __init__(
        self,
        pool: PagedKVPool,
        num_layers: int,
        *,
        config: Any = None,
        namespace: Hashable = None,
        attention_backend: str | None = None,
    ) -> None:
        self.pool = pool
        self.config = config
        self.namespace = namespace
        self.attention_backend = attention_backend
        self.layers: list[Any] = []  # the cache's layers (set by the cache): past recording, the dense fallback
        self.reservation: Reservation | None = None  # what the rows' growth draws from (PagedCache.reservation)
        self.rows: list[Row] = []
        self.layer_len = [0] * num_layers
        self.length = 0  # rectangular positions with a slot (or a pad) after the latest reservation
        self.step: Step | None = None
        # Unstored positions are exactly the left padding, and the rows store their real tokens at positions 0, 1, ...
        # The paged path may then skip the mask, and the rows' full blocks may be registered in the prefix cache.
        self.exact = True
        self.released = False

    # ------------------------------------------------------------------ queries
    def check_live(self) -> None:
        """Raise for a released cache."""
        if self.released:
            raise InvalidBlockError(
                "this PagedCache was released (its blocks went back to the pool). With enable(), pass the whole "
                "conversation to generate() again: its prefix is served from the pool's prefix cache"
            )

    def recording_past(self) -> bool:
        """Whether a layer records its past (assisted decoding): sliding-window blocks are then kept until a crop."""
        return any(getattr(layer, "record_past", False) for layer in self.layers)

    def uses_paged_attention(self) -> bool:
        """Whether the model attends with ``attn_implementation="paged"`` (then forwards get a context)."""
        return self.config is not None and getattr(self.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION

    # ------------------------------------------------------------------ one forward
    def forward_step(self, layer_idx: int, batch: int, q_len: int, positions: Any, has_kwargs: bool) -> Step:
        """The reservation of the forward that gives layer ``layer_idx`` ``q_len`` new positions per row: made by
        the first layer of a forward (its length is the cache's), shared by the others."""
        past = self.layer_len[layer_idx]
        if past == self.length:
            self._begin(batch, q_len, positions, has_kwargs)
        step = self.step
        if step is None or past + q_len != self.length or batch != step.plan.batch or q_len != step.plan.q_len:
            raise RuntimeError(
                f"PagedCache: layer {layer_idx} got {q_len} new tokens at length {past} but this forward reserved "
                f"{self.length - past} (batch {batch}); every layer must see the same tokens in one forward"
            )
        self.layer_len[layer_idx] += q_len
        return step

    def view_start(self, group: int, kv_offset: int, kv_len: int) -> int | None:
        """The first slot when the batch is one row whose rectangular positions ``kv_offset .. kv_offset + kv_len
        - 1`` are one contiguous run of slots (then its keys are a view of the pool), else None."""
        rows = self.rows
        if len(rows) != 1 or rows[0].pad > kv_offset:
            return None
        row = rows[0]  # the common single-sequence case: decided without tensor work
        table, dropped = row.blocks.table(group), row.blocks.num_dropped(group)
        return contiguous_start(table, kv_offset - row.pad, kv_len, self.pool.block_size, dropped)

    def gather_index(self, group: int, kv_offset: int, kv_len: int) -> torch.Tensor:
        """Slot of every rectangular position ``kv_offset .. kv_offset + kv_len - 1`` of every row (pads -> the
        zero block), ``(rows, kv_len)``."""
        bs = self.pool.block_size
        pad_slot = self.pool.pad_block * bs
        rows = self.rows
        gathered = []
        for row in rows:
            first_real = max(kv_offset - row.pad, 0)
            n_pad = max(0, min(row.pad, kv_offset + kv_len) - kv_offset)
            count = kv_len - n_pad
            blocks = torch.tensor(row.blocks.table(group), dtype=torch.long)
            j = torch.arange(first_real, first_real + count) - row.blocks.num_dropped(group) * bs
            real = blocks[j // bs] * bs + j % bs
            gathered.append(torch.cat([torch.full((n_pad,), pad_slot, dtype=torch.long), real]))
        return torch.stack(gathered)

    def _begin(self, batch: int, q_len: int, positions: Any, has_kwargs: bool) -> None:
        pool = self.pool
        with pool.lock:
            if not self.rows and self.length == 0:
                self.rows = [Row(BlockTables(pool.kv, self.reservation)) for _ in range(batch)]
            if len(self.rows) != batch:
                raise ValueError(
                    f"PagedCache holds {len(self.rows)} rows but the forward has batch size {batch}; use "
                    "batch_repeat_interleave / batch_select_indices to change the batch"
                )
            plan = plan_forward(
                start=self.length,
                before=[row.blocks.num_tokens for row in self.rows],
                declared=[row.declared_pad for row in self.rows],
                q_len=q_len,
                positions=positions,
            )
            slots = self._reserve(plan)
        self.length += q_len
        self.exact = self.exact and plan.exact
        step = Step(plan, slots, plan.real_index)
        if self.exact and has_kwargs and self.uses_paged_attention():
            step.context = self._context(step)
        self.step = step

    def _reserve(self, plan: ForwardPlan) -> list[list[int]]:
        """Give back what left the windows, grow every row by its real tokens (all rows or none), and return the new
        tokens' slots per group. Raises :class:`OutOfBlocksError` with the pool as it was."""
        rows, pool = self.rows, self.pool
        if not self.recording_past():
            for row, n in zip(rows, plan.before):
                self.drop_out_of_window(row, n)
        real_new = plan.real_new
        try:
            append_all([row.blocks for row in rows], real_new, pool.copy_blocks)
        except OutOfBlocksError as exc:
            held = sum(row.blocks.num_held_blocks() for row in rows)
            raise OutOfBlocksError(
                f"the pool ({pool.num_blocks} blocks of {pool.block_size} tokens per KV group) cannot hold "
                f"{plan.q_len} more tokens for {plan.batch} rows; this cache holds {held} blocks. Use a larger pool "
                f"(num_blocks / memory_budget). Detail: {exc}",
                requested=exc.requested,
                available=exc.available,
            ) from exc
        for row, n, pad in zip(rows, plan.before, plan.pads):
            if n == 0:
                row.pad += pad
        return [
            [s for row, n, new in zip(rows, plan.before, real_new) for s in row.blocks.slots(g.index, n, n + new)]
            for g in pool.kv.groups
        ]

    def _context(self, step: Step) -> ForwardContext:
        pool, plan = self.pool, step.plan
        real_new = plan.real_new
        rows = [r for r, n in enumerate(real_new) if n > 0]
        metas: list[PagedAttentionMetadata | None] = []
        for g in pool.kv.groups:
            per_row_slots = []
            cursor = 0
            for n in real_new:
                per_row_slots.append(step.slots[g.index][cursor : cursor + n])
                cursor += n
            metas.append(
                PagedAttentionMetadata.build(
                    block_size=pool.block_size,
                    query_lens=[real_new[r] for r in rows],
                    seq_lens=[plan.before[r] + real_new[r] for r in rows],
                    block_offsets=[self.rows[r].blocks.num_dropped(g.index) for r in rows],
                    tables=[self.rows[r].blocks.table(g.index) for r in rows],
                    slots=[per_row_slots[r] for r in rows],
                    sliding_window=g.sliding_window,
                    pad_block=pool.pad_block,
                )
            )
        layers = self.layers  # the dense fallback's gather (ForwardContext.mask_matches) is the layer's own

        def dense(layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
            tensors = pool.layer_tensors(layer_idx)
            if tensors is None:
                raise RuntimeError(f"PagedCache: layer {layer_idx} has nothing stored to attend to")
            gathered: tuple[torch.Tensor, torch.Tensor] = layers[layer_idx].gather(*tensors, tensors[0].device)
            return gathered

        return ForwardContext(
            pool,
            metas,
            step.real_index,
            self.attention_backend,
            pads=[row.pad for row in self.rows],
            length=self.length,
            dense=dense,
        )

    # ------------------------------------------------------------------ commands between forwards
    def drop_out_of_window(self, row: Row, next_position: int) -> None:
        """Give back the row's sliding-window blocks no query at ``next_position`` or later sees, registering its
        declared prompt's full blocks first: once given back they could not be registered at the end of the call,
        and a prefix hit needs the chain from the first block in every group."""
        if not row.blocks.has_sliding_groups:
            return
        if row.prompt is not None and self.exact:
            row.blocks.cache_full_blocks(row.prompt, row.blocks.num_tokens, self.namespace)
        row.blocks.drop_out_of_window(next_position)

    def select(self, indices: list[int]) -> None:
        """Row ``i`` becomes old row ``indices[i]``, sharing its blocks (beam search, forks, selection)."""
        self.check_live()
        if indices == list(range(len(self.rows))):
            return
        with self.pool.lock:
            bad = [i for i in indices if not 0 <= i < len(self.rows)]
            if bad:
                raise IndexError(f"rows {bad} do not exist (the cache holds {len(self.rows)})")
            new_rows = [self.rows[i].copy() for i in indices]
            for row in self.rows:
                row.blocks.release()
        self.rows = new_rows
        self.step = None

    def release(self) -> None:
        """Give every row's blocks back."""
        with self.pool.lock:
            for row in self.rows:
                row.blocks.release()
        self.rows = []
        self.step = None
