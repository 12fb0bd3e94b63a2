"""What a :class:`~pagedcore.adapters.transformers.PagedCache` and its layers share: the rows' blocks, the layers'
lengths, and each forward's reservation.

Per forward, :class:`CacheState` reserves the forward once for all layers, on the host, before layer 0: the
model's forward pre-hook calls :meth:`CacheState.begin_forward` with the forward's attention mask (a cache that
knows no model, or a forward the hook did not see, reserves at its first layer instead).
:func:`~.forward_plan.plan_forward` says which rows grow by how many real tokens (the padding read from the mask),
then the reservation gives back sliding-window blocks no query will see, grows every row or none
(:func:`pagedcore.block_tables.append_all`) and computes, once, every index the layers use (a :class:`Step`: the new
tokens' slots in every KV group, what each group's attention reads). Each layer then only writes its own keys and
values and gathers what its attention reads (``PagedLayer.update``): tensor operations on those indices, with no
data-dependent Python, so a compiled forward has no graph break there. A forward that raised before any layer
stored its keys is given back (:meth:`CacheState.end_forward`).

The state never refers back to the cache object, so a cache dropped without ``release()`` can be garbage collected;
its finalizer releases the state's blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedcore.attention import PagedAttentionMetadata, contiguous_start, to_device
from pagedcore.block_tables import BlockTables, append_all
from pagedcore.capacity import Reservation
from pagedcore.errors import InvalidBlockError, OutOfBlocksError

from .attention import ATTN_IMPLEMENTATION, CONTEXT_KEY, ForwardContext
from .forward_plan import ForwardPlan, MaskRows, plan_forward
from .pool import PagedKVPool
from .state_cache import CacheStates

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
    """One forward's reservation, shared by all layers, with the indices every layer of a group uses.

    Attributes:
        plan: what the forward stores (rows, real tokens, padding).
        slots: per KV group, the slot of every stored new token (row-major).
        real_index: flat indices of the stored tokens among ``batch * q_len`` (None: all are stored).
        context: what ``attn_implementation="paged"`` reads (None: the layers return gathered keys instead).
        device: where :meth:`CacheState.prepare` put the indices below (None: built by each layer when first
            needed, per device).
        hooked: reserved before the forward by the model's forward pre-hook (given back if no layer stores).

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
    device: torch.device | None = None
    hooked: bool = False
    open: bool = False  # reserved by the hook for the forward now running (until the forward hook closes it)
    wants_weights: bool = False  # the forward was asked for attention weights (paged attention then returns them)
    new_rows: bool = False  # the rows were created by this forward (given back with it)
    was_exact: bool = True  # the cache's exactness before this forward
    # Per KV group, on ``device``: the new tokens' slots, the first of them when they are consecutive, and what
    # the group's attention reads: (kv_len, kv_offset, first slot of a contiguous run or None, gather index or None).
    write_index: list[torch.Tensor] = field(default_factory=list, repr=False)
    write_run: list[int | None] = field(default_factory=list, repr=False)
    reads: list[tuple[int, int, int | None, torch.Tensor | None]] = field(default_factory=list, repr=False)
    real_on: torch.Tensor | None = field(default=None, repr=False)
    _on: dict[Any, torch.Tensor] = field(default_factory=dict, repr=False)
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # Rectangular positions per row after this forward, computed here on the host: each layer stores it as its
        # length, and a compiled forward must store a value it reads, not a sum it computes (inductor's generated
        # code loses the symbols of such an int output of a graph that resumes after a graph break:
        # ``NameError: name 's14' is not defined``, see docs/limits.md).
        self.end = self.plan.start + self.plan.q_len

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

    def real_index_on(self, device: torch.device) -> torch.Tensor | None:
        """``real_index`` on ``device`` (None when every new position is stored)."""
        if self.real_index is None:
            return None
        if device == self.device:
            return self.real_on
        real_index = self.real_index
        return self.tensor("real", device, lambda: real_index)

    def write_slots(self, group: int, device: torch.device, *, as_tensor: bool = False) -> torch.Tensor | int:
        """Where ``write_kv`` puts the group's new tokens: their first slot when they are consecutive slots (every
        decode step of a sequence within its blocks), else their slots as a tensor on ``device``. ``as_tensor``
        always gives the tensor (a compiled forward writes through an index, never a slice at a changing offset).

        Example:
            >>> plan = ForwardPlan(batch=1, q_len=2, start=0, before=(0,), pads=(0,), exact=True)
            >>> Step(plan, [[4, 5]], None).write_slots(0, torch.device("cpu")), Step(plan, [[4, 9]], None).write_slots(
            ...     0, torch.device("cpu")).tolist()
            (4, [4, 9])
        """
        if device == self.device:
            run = self.write_run[group]
            return self.write_index[group] if as_tensor or run is None else run
        slots = self.slots[group]
        run = self.memo(("run", group), lambda: _run_start(slots))
        if run is not None and not as_tensor:
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
        self.cached_layers = [i for i, layer in enumerate(pool.spec.layers) if layer.has_cache]
        self.length = 0  # rectangular positions with a slot (or a pad) after the latest reservation
        self.step: Step | None = None
        # Unstored positions are exactly the left padding, and the rows store their real tokens at positions 0, 1, ...
        # The paged path may then skip the mask, and the rows' full blocks may be registered in the prefix cache.
        self.exact = True
        self.released = False
        self.attached = False  # made by enable() (attach_prefix, take_rows): generate is given the whole prompt
        # The rows' recurrent states, for a model with state layers (their slots are the rows' BlockTables').
        self.states = (
            CacheStates(pool.states, pool.lock, rollback=not pool.state_spec.custom_cache)
            if pool.states is not None
            else None
        )
        # Whether a paged-attention model's layers read the pool (the probe found that exact), or return their keys
        # gathered from the blocks (:mod:`.probe`: the model changes its keys after update, say).
        self.paged_reads = True

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
    def begin_forward(
        self,
        batch: int,
        q_len: int,
        mask: Any,
        positions: Any,
        device: torch.device,
        *,
        mask_known: bool = True,
        weights: bool = False,
        kwargs_reach: bool = True,
    ) -> None:
        """Reserve the next forward for every layer, on the host, before layer 0 (the model's forward pre-hook calls
        this): ``mask`` is the forward's attention mask (None: none, every position a token), ``positions`` its
        ``position_ids``, ``device`` where its layers' indices go. ``mask_known=False`` (a 4-D or unrecognised mask):
        the padding is not read from it. ``weights``: the forward asked for attention weights. ``kwargs_reach``: the
        forward takes keyword arguments the hook may add (:meth:`shared_kwargs`). Raises, with nothing reserved, like
        the reservation of a layer."""
        self.check_live()
        if q_len == 0:
            return
        rows = None
        if mask_known:
            width = self.length + q_len
            rows = MaskRows.of(mask if isinstance(mask, torch.Tensor) else None, batch=batch, width=width)
            if mask is None and not self.cached_layers and len(self.rows) == batch:
                # A model without attention layers (Mamba-2) drops the mask after its prefill: no new padding.
                rows = MaskRows(width, tuple(min(row.pad, width) for row in self.rows), (True,) * batch)
        self._begin(batch, q_len, positions, True, mask=rows, device=device, hooked=True, kwargs_reach=kwargs_reach)
        step = self.step
        if step is not None:
            step.open = True
            step.wants_weights = weights and self.uses_paged_attention()
            if self.states is not None:
                self._begin_states(step, device)

    def _begin_states(self, step: Step, device: torch.device) -> None:
        """Make every row's state slot its own before the forward (given back with the reservation on failure)."""
        assert self.states is not None
        try:
            self.states.begin(self.rows, previous=step.plan.start > 0, device=device)
        except Exception:
            step.open = False
            self.end_forward()
            raise

    def shared_kwargs(self) -> dict[str, Any] | None:
        """Keyword arguments for the forward :meth:`begin_forward` reserved: its paged-attention context, when the
        model has KV-shared layers (which call no ``update``, so only the forward's own keyword arguments reach
        their attention). None otherwise."""
        step = self.step
        if step is None or step.context is None or not any(x.keeps == "shared" for x in self.pool.spec.layers):
            return None
        return {CONTEXT_KEY: step.context}

    def end_forward(self) -> None:
        """After the forward (also one that raised): a reservation made by :meth:`begin_forward` that no layer used
        (the forward failed before storing anything, or never called ``update``) is given back."""
        wrote = self.states is not None and self.states.end()  # the states handed out go back to the slots
        step = self.step
        if step is None or not step.hooked:
            return
        step.open = False  # the forward ended: between forwards the positions are all of them (positions_before)
        if self.length != step.end or wrote:
            return
        start = step.plan.start
        if any(self.layer_len[i] != start for i in self.cached_layers):
            return  # layers stored their keys: the forward happened (or failed half-way, as a DynamicCache would)
        with self.pool.lock:
            if step.new_rows:
                for row in self.rows:
                    row.blocks.release()
                self.rows = []
            else:
                for row, n, pad in zip(self.rows, step.plan.before, step.plan.pads):
                    row.blocks.truncate(n)
                    if n == 0:
                        row.pad -= pad
        self.length = start
        self.exact = step.was_exact
        self.step = None

    def forward_step(
        self, layer_idx: int, batch: int, q_len: int, positions: Any, has_kwargs: bool, device: torch.device
    ) -> Step:
        """The reservation of the forward that gives layer ``layer_idx`` ``q_len`` new positions per row: made before
        the forward (:meth:`begin_forward`) or by its first layer (its length is the cache's), shared by the others.
        Reads and writes host integers only, no tensor; traced by ``torch.compile`` in a forward the hook reserved,
        it only stores the host's new length (see :meth:`open_step`)."""
        step = self.open_step()
        if step is not None:
            self.layer_len[layer_idx] = step.end
            return step
        past = self.layer_len[layer_idx]
        step = self.step
        if step is not None and step.hooked and (batch, q_len) != (step.plan.batch, step.plan.q_len):
            self.end_forward()  # the model changed its input's shape inside the forward: reserve what the layer sees
        if past == self.length:
            self._begin(batch, q_len, positions, has_kwargs, device=device)
        step = self.step
        if step is None or past != step.plan.start or batch != step.plan.batch or q_len != step.plan.q_len:
            raise RuntimeError(
                f"PagedCache: layer {layer_idx} got {q_len} new tokens at length {past} but this forward reserved "
                f"{self.length - past} (batch {batch}); every layer must see the same tokens in one forward"
            )
        self.layer_len[layer_idx] = step.end
        return step

    def open_step(self) -> Step | None:
        """While ``torch.compile`` traces a forward the forward pre-hook reserved: that reservation, whose host
        values (the past length, each group's mask sizes and gather index) then answer every question a layer or
        the mask builder asks, so the trace compares no integer with another (None otherwise, and in eager).

        torch 2.13's inductor loses symbols that a guard equated with others (``NameError: name 's12' is not
        defined``, docs/limits.md), and comparing a layer's length with the reservation's makes such guards."""
        if not torch.compiler.is_compiling():
            return None
        step = self.step
        return step if step is not None and step.open and step.device is not None else None

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
        """Slot of every rectangular position ``kv_offset .. kv_offset + kv_len - 1`` of every row (pads, and
        positions whose blocks were given back, -> the zero block: a chunked layer's mask sizes reach into the
        previous chunk, which its mask hides), ``(rows, kv_len)``."""
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
            real = torch.where(j >= 0, blocks[j.clamp(min=0) // bs] * bs + j.clamp(min=0) % bs, pad_slot)
            gathered.append(torch.cat([torch.full((n_pad,), pad_slot, dtype=torch.long), real]))
        return torch.stack(gathered)

    def _begin(
        self,
        batch: int,
        q_len: int,
        positions: Any,
        has_kwargs: bool,
        *,
        mask: MaskRows | None = None,
        device: torch.device | None = None,
        hooked: bool = False,
        kwargs_reach: bool = False,
    ) -> None:
        pool = self.pool
        with pool.lock:
            new_rows = not self.rows and self.length == 0
            if new_rows:
                self.rows = [Row(BlockTables(pool.kv, self.reservation)) for _ in range(batch)]
                self.weights_version = pool.weights_version
            if len(self.rows) != batch:
                raise ValueError(
                    f"PagedCache holds {len(self.rows)} rows but the forward has batch size {batch}; use "
                    "batch_repeat_interleave / batch_select_indices to change the batch"
                )
            try:
                plan = plan_forward(
                    start=self.length,
                    before=[row.blocks.num_tokens for row in self.rows],
                    row_pads=[row.pad for row in self.rows],
                    declared=[row.declared_pad for row in self.rows],
                    q_len=q_len,
                    positions=positions,
                    mask=mask,
                )
                slots = self._reserve(plan)
            except Exception:
                if new_rows:
                    self.rows = []
                raise
        step = Step(plan, slots, plan.real_index, hooked=hooked, new_rows=new_rows, was_exact=self.exact)
        self.length += q_len
        self.exact = self.exact and plan.exact
        # KV-shared layers call no update: the context reaches them only through the forward's keyword arguments,
        # which the forward pre-hook adds (shared_kwargs). Without it they attend over what their source's update
        # returns, which must then be its gathered keys: no context.
        shared = any(layer.keeps == "shared" for layer in pool.spec.layers)
        reads = self.paged_reads and self.uses_paged_attention()
        if self.exact and has_kwargs and reads and (kwargs_reach or not shared):
            step.context = self._context(step)
        if device is not None:
            self.prepare(step, device)
        self.step = step

    def prepare(self, step: Step, device: torch.device) -> None:
        """Build, once per forward, every index the layers use on ``device``: the stored tokens among the new
        positions, each group's write slots, and (without a paged-attention context) what each group's attention
        reads: a view of one contiguous run, or a gather index. The layers then do tensor operations only."""
        plan = step.plan
        step.device = device
        step.real_on = None if step.real_index is None else to_device(step.real_index, device)
        for group in self.pool.kv.groups:
            g = group.index
            slots = step.slots[g]
            step.write_run.append(_run_start(slots))
            step.write_index.append(to_device(torch.tensor(slots, dtype=torch.long), device))
            kv_len, kv_offset = group.kind.mask_sizes(plan.start, plan.q_len)
            start = index = None
            if step.context is None:  # a view where one fits (eager or compiled); the gather index otherwise
                start = self.view_start(g, kv_offset, kv_len)
                if start is None:
                    index = to_device(self.gather_index(g, kv_offset, kv_len), device)
            step.reads.append((kv_len, kv_offset, start, index))

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
                    kind=g.kind,
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
            pads=None if plan.from_mask else [row.pad for row in self.rows],  # the mask hides exactly those
            length=self.length,
            dense=dense,
            query_len=plan.q_len,
            new_tokens=real_new,
        )

    # ------------------------------------------------------------------ commands between forwards
    def drop_out_of_window(self, row: Row, next_position: int) -> None:
        """Give back the row's sliding-window blocks no query at ``next_position`` or later sees, registering its
        declared prompt's full blocks first: once given back they could not be registered at the end of the call,
        and a prefix hit needs the chain from the first block in every group."""
        if not row.blocks.has_sliding_groups:
            return
        if not self.exact and not all(g.kind.is_relative for g in self.pool.kv.groups):
            return  # rows storing what they cannot tell from padding: their chunks' starts are not known, keep all
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
        if self.states is not None:
            self.states.select(indices)

    def crop(self, tokens_to_remove: int) -> None:
        """:meth:`PagedCache.crop <.cache.PagedCache.crop>` (``tokens_to_remove <= 0``): every check first (the rows'
        sliding-window blocks here, the recorded states by :meth:`.state_cache.CacheStates.crop` before it writes),
        so a refused crop changes nothing; then the states put back, the rows truncated and the blocks that left a
        window given back."""
        new_length = max(0, self.length + tokens_to_remove)
        with self.pool.lock:  # reentrant: the states' writes take it too
            # A row whose kept positions need sliding-window blocks already given back makes truncate raise: checked
            # for every row before any is truncated (raising half-way left the cache half-cropped).
            for row in self.rows if tokens_to_remove < 0 else ():
                if not row.blocks.can_truncate(max(0, new_length - min(row.pad, new_length))):
                    raise InvalidBlockError(
                        f"crop({tokens_to_remove}): the kept positions need keys that already left a sliding "
                        "window and were given back; call activate_past_recording() before the forwards you "
                        "may want to crop"
                    )
            if self.states is not None:
                self.states.crop(self.rows, tokens_to_remove)
            for row in self.rows if tokens_to_remove < 0 else ():
                row.pad = min(row.pad, new_length)
                row.blocks.truncate(max(0, new_length - row.pad))
            # Also while past recording is on: a crop is the rollback point, after which transformers' sliding layers
            # shrink back to their window too (skipping the drop kept every sliding block of an assisted generation).
            for row in self.rows:
                self.drop_out_of_window(row, row.blocks.num_tokens)
        self.length = new_length
        self.layer_len = [min(n, new_length) for n in self.layer_len]
        self.step = None

    def adopt(self, source: CacheState) -> None:
        """Become a copy of ``source`` (an empty state of the same pool): its rows forked (shared blocks,
        copy-on-write), its lengths, exactness and the layers' past recording."""
        source.check_live()
        if self.rows or source.pool is not self.pool:
            raise InvalidBlockError("adopt: the state is not empty or uses another pool")
        with self.pool.lock:
            self.rows = [row.copy() for row in source.rows]
        self.length = source.length
        self.layer_len = list(source.layer_len)
        self.exact = source.exact
        if self.states is not None and source.states is not None:
            self.states.history = dict(source.states.history)
            self.states.states_before = {key: list(states) for key, states in source.states.states_before.items()}
            self.states.recording, self.states.keep = source.states.recording, source.states.keep
        self.weights_version = source.weights_version
        for mine, theirs in zip(self.layers, source.layers):
            if hasattr(mine, "record_past"):
                mine.record_past = getattr(theirs, "record_past", False)

    def release(self) -> None:
        """Give every row's blocks (and state slots) back."""
        if self.states is not None:
            self.states.reset()
        with self.pool.lock:
            for row in self.rows:
                row.blocks.release()
        self.rows = []
        self.step = None

    def positions_before(self) -> int:
        """Rectangular positions per row before the forward now running (all of them between forwards)."""
        step = self.step
        return step.plan.start if step is not None and step.open else self.length
