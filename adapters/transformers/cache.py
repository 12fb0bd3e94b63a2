"""PagedCache: a transformers ``Cache`` whose keys and values live in a paged, ref-counted pool.

``model.generate(**inputs, cache=PagedCache(model))`` gives the same output as ``DynamicCache``. Each batch row
owns a :class:`~pagedcore.block_tables.BlockTables`; the rectangular batch that transformers sees is mapped onto
the rows: row ``r``'s first ``pad[r]`` positions are left padding (never stored: a zero slot stands in for them)
and position ``p >= pad[r]`` is the row's token ``p - pad[r]``. KV memory held is therefore the real tokens
rounded up to whole blocks. Beam search permutes block tables and reference counts, forks share blocks with
copy-on-write, ``crop`` truncates tables, and sliding-window layers give back blocks that left their window.

Padding is read from the ``position_ids`` that reach ``update`` through the model's kwargs, or declared up front
with :meth:`PagedCache.attach_prefix` (``enable`` does: it reads the attention mask). A model that calls ``update``
without its kwargs (GPT-NeoX, Falcon, Bloom, GPT-Neo, CTRL) and no declared padding, or a batch whose positions do not
look like left padding, stores every position instead, and attention falls back to the standard mask: correct, just
less frugal. Such a cache does not vouch for what its rows store, so it registers nothing in the prefix cache.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer

from pagedcore.attention import PagedAttentionMetadata, write_kv
from pagedcore.block_tables import BlockTables
from pagedcore.errors import ConfigError, InvalidBlockError, OutOfBlocksError
from pagedcore.kv_pool import PoolMatch

from .attention import ATTN_IMPLEMENTATION, CONTEXT_KEY, ForwardContext
from .pool import PagedKVPool
from .spec import text_config

__all__ = ["CacheMemoryStats", "PagedCache"]


@dataclass(frozen=True)
class CacheMemoryStats:
    """KV memory held by one cache.

    Attributes:
        rows: batch rows.
        tokens: real tokens stored, summed over rows (padding excluded).
        padding_tokens: left-padding positions that are not stored.
        blocks: block references held, summed over rows and KV groups.
        held_bytes: bytes of the blocks held (what the cache keeps from other users of the pool).
        token_bytes: bytes the stored tokens themselves need (``held_bytes`` minus partly filled blocks).

    Example:
        A left-padded batch of a 3-token and a 5-token prompt, 2 new tokens each: the padding is not stored.

        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        ...     num_hidden_layers=2, intermediate_size=128, vocab_size=100)).eval()
        >>> ids = torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 9]])
        >>> mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
        >>> cache = PagedCache(model, num_blocks=16, block_size=4)
        >>> _ = model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0, cache=cache)
        >>> stats = cache.memory_stats()
        >>> stats.rows, stats.tokens, stats.padding_tokens, stats.blocks   # rows of 4 and 6 tokens: 1 + 2 blocks
        (2, 10, 2, 3)
        >>> stats.held_bytes, stats.token_bytes
        (6144, 5120)
    """

    rows: int
    tokens: int
    padding_tokens: int
    blocks: int
    held_bytes: int
    token_bytes: int


class _Row:
    __slots__ = ("blocks", "declared_pad", "pad", "prompt")

    def __init__(
        self, blocks: BlockTables, pad: int = 0, declared_pad: int | None = None, prompt: Sequence[int] | None = None
    ) -> None:
        self.blocks = blocks
        self.pad = pad  # leading rectangular positions that are padding and not stored
        self.declared_pad = declared_pad  # the row's whole left padding, when declared by attach_prefix
        self.prompt = prompt  # the row's first real tokens, when declared: registered before a window drops them

    def copy(self) -> _Row:
        """A row sharing this one's blocks (copy-on-write)."""
        return _Row(self.blocks.fork(), self.pad, self.declared_pad, self.prompt)


@dataclass
class _Step:
    """One forward's bookkeeping, shared by all layers."""

    batch: int
    q_len: int
    start: int  # rectangular length before the forward
    real_new: list[int]  # per row, real (stored) tokens among the q_len new positions
    real_index: torch.Tensor | None  # flat (row * q_len + t) indices of stored tokens; None when all are stored
    slots: list[list[int]]  # per group, the slot of every stored new token (row-major)
    context: ForwardContext | None = None
    _on: dict[Any, torch.Tensor] = field(default_factory=dict)

    def tensor(self, key: Any, device: torch.device, build: Any) -> torch.Tensor:
        cached = self._on.get((key, device))
        if cached is None:
            cached = self._on[(key, device)] = build().to(device)
        return cached


class _State:
    """Everything a PagedCache owns; layers and the finalizer share it (no reference back to the cache)."""

    def __init__(self, pool: PagedKVPool, num_layers: int) -> None:
        self.pool = pool
        self.rows: list[_Row] = []
        self.layer_len = [0] * num_layers
        self.length = 0  # rectangular positions with a slot (or a pad) after the latest reservation
        self.step: _Step | None = None
        # Unstored positions are exactly the left padding, and the rows store their real tokens at positions 0, 1, ...
        # The paged path may then skip the mask, and the rows' full blocks may be registered in the prefix cache.
        self.exact = True
        self.released = False

    def release(self) -> None:
        with self.pool.lock:
            for row in self.rows:
                row.blocks.release()
        self.rows = []
        self.step = None


def _release_soon(state: _State) -> None:
    state.pool.lock.call_soon(state.release)


class _PagedLayer(CacheLayerMixin):
    """A layer view of the shared state (transformers inspects ``cache.layers``)."""

    is_compileable = False
    is_croppable = True

    def __init__(self, state: _State, layer_idx: int, sliding_window: int | None) -> None:
        super().__init__()
        self._state = state
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.record_past = False
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the pool creates its tensors on first write."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("PagedCache layers are updated through PagedCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return _mask_sizes(self._state.layer_len[self.layer_idx], query_length, self.sliding_window)

    def get_seq_length(self) -> int:
        return self._state.layer_len[self.layer_idx]

    def get_max_length(self) -> int:
        return self.sliding_window if self.sliding_window is not None else -1

    def activate_past_recording(self) -> None:
        self.record_past = True


def _mask_sizes(past: int, query_length: int, window: int | None) -> tuple[int, int]:
    """``(kv_length, kv_offset)`` exactly as transformers' dynamic (sliding) layers report them."""
    if window is None:
        return past + query_length, 0
    offset = max(past - window + 1, 0)
    return past - offset + query_length, offset


class PagedCache(Cache):
    """A drop-in ``Cache`` for ``model.generate`` backed by a paged pool.

    Args:
        model: the model (or its config) the cache serves.
        pool: a :class:`PagedKVPool` to take blocks from (e.g. one shared with other caches); a private pool is
            created when omitted, sized by ``num_blocks`` / ``memory_budget`` / ``block_size``.
        num_blocks: blocks of the private pool.
        memory_budget: bytes (or ``"2GiB"``) of the private pool.
        block_size: tokens per block of the private pool.
        namespace: prefix-cache namespace used by :meth:`attach_prefix` and :meth:`cache_prefixes`.
        attention_backend: attention backend name for ``attn_implementation="paged"`` (default: the plugins').

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from pagedcore.adapters.transformers import PagedCache
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        ...     num_hidden_layers=2, intermediate_size=128, vocab_size=100)).eval()
        >>> cache = PagedCache(model, num_blocks=64, block_size=16)
        >>> out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, cache=cache)
        >>> cache.get_seq_length(), cache.memory_stats().tokens
        (6, 6)
    """

    def __init__(
        self,
        model: Any = None,
        *,
        pool: PagedKVPool | None = None,
        num_blocks: int | None = None,
        memory_budget: int | float | str | None = None,
        block_size: int | None = None,
        namespace: Hashable = None,
        attention_backend: str | None = None,
    ) -> None:
        if pool is None:
            if model is None:
                raise ConfigError("PagedCache needs a model (or config) or a pool")
            pool = PagedKVPool(model, num_blocks=num_blocks, memory_budget=memory_budget, block_size=block_size)
        else:
            if num_blocks is not None or memory_budget is not None:
                raise ConfigError("num_blocks / memory_budget size a private pool: not with pool=")
            if model is not None:
                pool.bind(model)
        self._config = text_config(model) if model is not None else None
        self._pool = pool
        self._state = _State(pool, pool.spec.num_layers)
        self.namespace = namespace
        self.attention_backend = attention_backend
        layers: list[Any] = []
        for i, spec in enumerate(pool.spec.layers):
            layers.append(_PagedLayer(self._state, i, spec.sliding_window) if spec.has_cache else DummyLayer())
        super().__init__(layers=layers)
        # A cache dropped without release() gives its blocks back when garbage collected (deferred to a moment when
        # no bookkeeping call is in progress: a collection may run in the middle of one).
        self._finalizer = weakref.finalize(self, _release_soon, self._state)
        self._owner = threading.get_ident()

    # ------------------------------------------------------------------ what generate and the models call
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys and values of ``layer_idx`` and return what its attention reads.

        With ``attn_implementation="paged"`` the attention reads the pool directly and this returns the inputs;
        otherwise it returns the layer's keys and values gathered from the blocks, ``(batch, kv_heads, kv_len,
        head_dim)``, zero at padding positions.
        """
        state = self._check_live()
        model_kwargs = kwargs.get("kwargs")
        if not isinstance(model_kwargs, dict):
            model_kwargs = None
        batch, _, q_len, _ = key_states.shape
        keys = key_states.transpose(1, 2).reshape(batch * q_len, *key_states.shape[1:2], key_states.shape[-1])
        values = value_states.transpose(1, 2).reshape(batch * q_len, *value_states.shape[1:2], value_states.shape[-1])
        # Before any bookkeeping: raises PoolMismatchError, changing nothing, for keys the pool cannot hold.
        key_cache, value_cache = self._pool.layer_kv(layer_idx, keys, values)
        past = state.layer_len[layer_idx]
        if past == state.length:
            positions = model_kwargs.get("position_ids") if model_kwargs is not None else None
            self._begin_step(batch, q_len, positions, model_kwargs is not None)
        step = state.step
        if step is None or past + q_len != state.length or batch != step.batch or q_len != step.q_len:
            raise RuntimeError(
                f"PagedCache: layer {layer_idx} got {q_len} new tokens at length {past} but this forward reserved "
                f"{state.length - past} (batch {batch}); every layer must see the same tokens in one forward"
            )
        state.layer_len[layer_idx] += q_len
        group = self._pool.group_of(layer_idx)
        device = key_states.device
        if step.real_index is not None:
            index = step.tensor("real", device, lambda: step.real_index)
            keys, values = keys.index_select(0, index), values.index_select(0, index)
        slots = step.tensor(("slots", group), device, lambda: torch.tensor(step.slots[group], dtype=torch.long))
        write_kv(key_cache, value_cache, keys, values, slots)
        if step.context is not None and model_kwargs is not None:
            model_kwargs[CONTEXT_KEY] = step.context
            return key_states, value_states
        return self._gather(layer_idx, group, key_cache, value_cache, device)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions stored (padding included) for a layer (the first cached layer for layers without one)."""
        if layer_idx >= len(self.layers):
            return 0
        if isinstance(self.layers[layer_idx], DummyLayer):
            layer_idx = self._first_cached_layer()
        return self._state.layer_len[layer_idx]

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the keys ``update`` will return for ``layer_idx`` (transformers' rules)."""
        if isinstance(self.layers[layer_idx], DummyLayer):
            layer_idx = self._first_cached_layer()
        window = self._pool.spec.layers[layer_idx].sliding_window
        return _mask_sizes(self._state.layer_len[layer_idx], query_length, window)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """-1 (no fixed maximum: the pool decides), or the window of a sliding layer."""
        if layer_idx is None:
            return -1
        return int(self.layers[layer_idx].get_max_length())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` becomes old row ``beam_idx[i]`` by sharing its blocks (no tensor copy)."""
        self._select([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Fork every row ``repeats`` times (rows share blocks; copy-on-write on the first write)."""
        self._select([i for i in range(len(self._state.rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows ``indices``."""
        self._select([int(i) for i in torch.as_tensor(indices).tolist()])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (assisted decoding rejects draft tokens this way).

        ``crop(0)`` gives back sliding-window blocks kept while past recording was on.
        """
        state = self._check_live()
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        new_length = max(0, state.length + tokens_to_remove)
        with self._pool.lock:
            if tokens_to_remove < 0:
                # Check every row before truncating any: a row whose kept positions need sliding-window blocks that
                # were already given back makes truncate raise, and raising after earlier rows were truncated left
                # the cache half-cropped (rows shorter than its length).
                bs = self._pool.block_size
                for row in state.rows:
                    keep = max(0, new_length - min(row.pad, new_length))
                    for g in self._pool.kv.groups:
                        window = g.sliding_window
                        if window is not None and max(0, keep - window + 1) < row.blocks.num_dropped(g.index) * bs:
                            raise InvalidBlockError(
                                f"crop({tokens_to_remove}): the kept positions need keys that already left the "
                                f"{window}-token window and were given back; call activate_past_recording() before "
                                "the forwards you may want to crop"
                            )
                for row in state.rows:
                    row.pad = min(row.pad, new_length)
                    row.blocks.truncate(max(0, new_length - row.pad))
            # Also while past recording is on: a crop is the rollback point, after which transformers' sliding layers
            # shrink back to their window too. Skipping the drop then (the earlier code) kept every sliding block of an
            # assisted / prompt-lookup generation until the cache was released.
            for row in state.rows:
                self._drop_out_of_window(row, row.blocks.num_tokens)
        state.length = new_length
        state.layer_len = [min(n, new_length) for n in state.layer_len]
        state.step = None

    def reset(self) -> None:
        """Give every block back and start empty (the cache can be used again)."""
        state = self._state
        state.release()
        state.length = 0
        state.layer_len = [0] * len(state.layer_len)
        state.exact = True
        state.released = False

    def release(self) -> None:
        """Give every block back to the pool for good; using the cache afterwards raises."""
        self._state.release()
        self._state.released = True

    @property
    def is_compileable(self) -> bool:
        return False

    # ------------------------------------------------------------------ pagedcore extras
    @property
    def pool(self) -> PagedKVPool:
        """The pool the blocks come from."""
        return self._pool

    @property
    def batch_size(self) -> int:
        """Rows (``-1`` before the first forward)."""
        return len(self._state.rows) or -1

    def memory_stats(self) -> CacheMemoryStats:
        """KV memory this cache holds (padding is not stored)."""
        state = self._state
        pool = self._pool
        held = 0
        token_bytes = 0
        blocks = 0
        for row in state.rows:
            for g in pool.kv.groups:
                count = len(row.blocks.table(g.index))
                blocks += count
                held += count * pool.block_bytes(g.index)
            token_bytes += row.blocks.num_tokens * sum(pool.block_bytes(g.index) for g in pool.kv.groups)
        return CacheMemoryStats(
            rows=len(state.rows),
            tokens=sum(row.blocks.num_tokens for row in state.rows),
            padding_tokens=sum(row.pad for row in state.rows),
            blocks=blocks,
            held_bytes=held,
            token_bytes=token_bytes // pool.block_size,
        )

    def attach_prefix(
        self,
        matches: Sequence[PoolMatch | None],
        pads: Sequence[int],
        length: int,
        prompts: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Start an empty cache whose row ``r`` begins with ``pads[r]`` positions of left padding, and take its first
        ``length`` rectangular positions from prefix hits: ``min(pads[r], length)`` padding positions, then the row's
        first ``length - pads[r]`` tokens from ``matches[r]`` (None where none are taken). Used by :func:`enable`;
        ``length=0`` only declares the padding.

        Declared padding is never stored, also for models whose attention calls ``update`` without ``position_ids``
        (GPT-NeoX, Falcon, Bloom): the rows then store exactly their real tokens, which :meth:`cache_prefixes`
        needs. The attention mask of the forwards must hide exactly that padding (``generate`` builds it so).
        ``prompts[r]``, row ``r``'s real prompt tokens, lets the cache register their full blocks before a sliding
        window gives them back (at the end of the call they would be gone).
        """
        state = self._check_live()
        if state.rows or state.length:
            raise InvalidBlockError("attach_prefix: the cache is not empty")
        if len(matches) != len(pads) or length < 0 or any(p < 0 for p in pads) or len(prompts or pads) != len(pads):
            raise InvalidBlockError(f"attach_prefix: {len(matches)} matches for pads {list(pads)}, length {length}")
        rows: list[_Row] = []
        with self._pool.lock:
            try:
                for r, (match, pad) in enumerate(zip(matches, pads)):
                    used_pad = min(pad, length)
                    blocks = BlockTables(self._pool.kv)
                    rows.append(_Row(blocks, used_pad, pad, list(prompts[r]) if prompts is not None else None))
                    if length > used_pad:
                        if match is None:
                            raise InvalidBlockError(f"attach_prefix: a row needs {length - used_pad} cached tokens")
                        blocks.attach(match, length - used_pad)
                        if not self._recording_past():  # attached blocks are cached already
                            blocks.drop_out_of_window(length - used_pad)
            except Exception:
                for row in rows:
                    row.blocks.release()
                raise
        state.rows = rows
        state.length = length
        state.layer_len = [length] * len(state.layer_len)

    def cache_prefixes(self, token_ids: Sequence[Sequence[int]]) -> None:
        """Register every row's full blocks in the pool's prefix cache. ``token_ids[r]`` are row ``r``'s real
        tokens (no padding), at least as many as the row stores.

        Does nothing for a cache that stored positions it could not tell from padding (a model that calls ``update``
        without ``position_ids`` and no padding declared by :meth:`attach_prefix`, or padding in the middle of a
        row): its blocks would not hold the keys and values of those tokens at those positions.
        """
        state = self._check_live()
        if not state.exact:
            return
        with self._pool.lock:
            for row, tokens in zip(state.rows, token_ids):
                row.blocks.cache_full_blocks(tokens, row.blocks.num_tokens, self.namespace)

    def row_tokens(self) -> list[int]:
        """Real tokens stored per row."""
        return [row.blocks.num_tokens for row in self._state.rows]

    def row_padding(self) -> list[int]:
        """Unstored left-padding positions per row."""
        return [row.pad for row in self._state.rows]

    def __repr__(self) -> str:
        state = self._state
        return (
            f"PagedCache(rows={len(state.rows)}, length={state.length}, "
            f"tokens={sum(r.blocks.num_tokens for r in state.rows)}, pool={self._pool!r})"
        )

    # ------------------------------------------------------------------ internals
    def _check_live(self) -> _State:
        state = self._state
        if state.released:
            raise InvalidBlockError(
                "this PagedCache was released (its blocks went back to the pool). With enable(), pass the whole "
                "conversation to generate() again: its prefix is served from the pool's prefix cache"
            )
        return state

    def _first_cached_layer(self) -> int:
        return next(i for i, layer in enumerate(self.layers) if not isinstance(layer, DummyLayer))

    def _recording_past(self) -> bool:
        return any(getattr(layer, "record_past", False) for layer in self.layers)

    def _uses_paged_attention(self) -> bool:
        return self._config is not None and getattr(self._config, "_attn_implementation", None) == ATTN_IMPLEMENTATION

    def _begin_step(self, batch: int, q_len: int, positions: Any, has_kwargs: bool) -> None:
        state = self._state
        pool = self._pool
        with pool.lock:
            if not state.rows and state.length == 0:
                state.rows = [_Row(BlockTables(pool.kv)) for _ in range(batch)]
            if len(state.rows) != batch:
                raise ValueError(
                    f"PagedCache holds {len(state.rows)} rows but the forward has batch size {batch}; use "
                    "batch_repeat_interleave / batch_select_indices to change the batch"
                )
            before = [row.blocks.num_tokens for row in state.rows]
            pads, exact = self._step_padding(positions, batch, q_len, before)
            if not self._recording_past():
                for row, n in zip(state.rows, before):
                    self._drop_out_of_window(row, n)
            grown: list[int] = []
            try:
                for r, row in enumerate(state.rows):
                    pool.copy_blocks(row.blocks.append(q_len - pads[r]))
                    grown.append(r)
            except OutOfBlocksError as exc:
                for r in grown:
                    state.rows[r].blocks.truncate(before[r])
                held = sum(row.blocks.num_held_blocks() for row in state.rows)
                raise OutOfBlocksError(
                    f"the pool ({pool.num_blocks} blocks of {pool.block_size} tokens per KV group) cannot hold "
                    f"{q_len} more tokens for {batch} rows; this cache holds {held} blocks. Use a larger pool "
                    f"(num_blocks / memory_budget). Detail: {exc}",
                    requested=exc.requested,
                    available=exc.available,
                ) from exc
            for r, row in enumerate(state.rows):
                if before[r] == 0:
                    row.pad += pads[r]
            real_new = [q_len - p for p in pads]
            slots = [
                [
                    s
                    for r, row in enumerate(state.rows)
                    for s in row.blocks.slots(g.index, before[r], before[r] + real_new[r])
                ]
                for g in pool.kv.groups
            ]
        real_index = None
        if any(pads):
            real_index = torch.tensor(
                [r * q_len + t for r in range(batch) for t in range(pads[r], q_len)], dtype=torch.long
            )
        state.length += q_len
        state.exact = state.exact and exact
        step = _Step(batch, q_len, state.length - q_len, real_new, real_index, slots)
        if state.exact and has_kwargs and self._uses_paged_attention():
            step.context = self._context(before, real_new, real_index, slots)
        state.step = step

    def _drop_out_of_window(self, row: _Row, next_position: int) -> None:
        """Give back the row's sliding-window blocks no query at ``next_position`` or later sees, registering its
        declared prompt's full blocks first: once given back they could not be registered at the end of the call,
        and a prefix hit needs the chain from the first block in every group."""
        if not row.blocks.has_sliding_groups:
            return
        if row.prompt is not None and self._state.exact:
            row.blocks.cache_full_blocks(row.prompt, row.blocks.num_tokens, self.namespace)
        row.blocks.drop_out_of_window(next_position)

    def _step_padding(self, positions: Any, batch: int, q_len: int, before: list[int]) -> tuple[list[int], bool]:
        """Per row, how many of this forward's positions are padding, and whether that is exact (see ``_State``).

        Declared padding (attach_prefix) decides; ``position_ids``, when the model passes them, must agree with it.
        Without a declaration the positions decide (:func:`_left_padding`).
        """
        rows = self._state.rows
        if any(row.declared_pad is None for row in rows):
            return _left_padding(positions, batch, q_len, before)
        start = self._state.length
        pads = []
        for row, n in zip(rows, before):
            declared = row.declared_pad
            assert declared is not None
            pads.append(min(max(declared - start, 0), q_len) if n == 0 else 0)
        if positions is None:
            return pads, True
        if not any(pads):  # the common case (every decode step): no tensor work beyond _left_padding's fast path
            derived, exact = _left_padding(positions, batch, q_len, before)
            return pads, exact and not any(derived)
        return pads, _positions_fit(positions, pads, batch, q_len, before)

    def _context(
        self, before: list[int], real_new: list[int], real_index: torch.Tensor | None, slots: list[list[int]]
    ) -> ForwardContext:
        pool = self._pool
        rows = [r for r, n in enumerate(real_new) if n > 0]
        metas: list[PagedAttentionMetadata | None] = []
        for g in pool.kv.groups:
            per_row_slots = []
            cursor = 0
            for n in real_new:
                per_row_slots.append(slots[g.index][cursor : cursor + n])
                cursor += n
            metas.append(
                PagedAttentionMetadata.build(
                    block_size=pool.block_size,
                    query_lens=[real_new[r] for r in rows],
                    seq_lens=[before[r] + real_new[r] for r in rows],
                    block_offsets=[self._state.rows[r].blocks.num_dropped(g.index) for r in rows],
                    tables=[self._state.rows[r].blocks.table(g.index) for r in rows],
                    slots=[per_row_slots[r] for r in rows],
                    sliding_window=g.sliding_window,
                    pad_block=pool.pad_block,
                )
            )
        state = self._state
        # The dense fallback for a mask the paged path cannot honour (ForwardContext.mask_matches). A weak reference:
        # the state (kept alive by the finalizer) holds this context, so a strong one would keep the cache forever.
        gather = weakref.WeakMethod(self._gather)

        def dense(layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
            method = gather()
            tensors = pool.layer_tensors(layer_idx)
            if method is None or tensors is None:
                raise RuntimeError(f"PagedCache: layer {layer_idx} has nothing stored to attend to")
            return method(layer_idx, pool.group_of(layer_idx), *tensors, tensors[0].device)

        return ForwardContext(
            pool,
            metas,
            real_index,
            self.attention_backend,
            pads=[row.pad for row in state.rows],
            length=state.length,
            dense=dense,
        )

    def _gather(
        self, layer_idx: int, group: int, key_cache: torch.Tensor, value_cache: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        state = self._state
        step = state.step
        assert step is not None
        window = self._pool.spec.layers[layer_idx].sliding_window
        kv_len, kv_offset = _mask_sizes(step.start, step.q_len, window)
        index = step.tensor(("gather", group, kv_offset), device, lambda: self._gather_index(group, kv_offset, kv_len))
        batch = step.batch
        keys = key_cache.view(-1, *key_cache.shape[2:])
        values = value_cache.view(-1, *value_cache.shape[2:])
        if index.dim() == 1:  # one row whose slots are one contiguous run: a view, no copy
            start = int(index[0])
            k = keys[start : start + kv_len].unsqueeze(0)
            v = values[start : start + kv_len].unsqueeze(0)
        else:
            k = keys.index_select(0, index.view(-1)).view(batch, kv_len, *keys.shape[1:])
            v = values.index_select(0, index.view(-1)).view(batch, kv_len, *values.shape[1:])
        return k.transpose(1, 2), v.transpose(1, 2)

    def _gather_index(self, group: int, kv_offset: int, kv_len: int) -> torch.Tensor:
        """Slot of every rectangular position ``kv_offset .. kv_offset + kv_len - 1`` of every row (pads -> the
        zero block). A single contiguous row is returned as its first slot only (1-D)."""
        bs = self._pool.block_size
        pad_slot = self._pool.pad_block * bs
        rows = self._state.rows
        if len(rows) == 1 and kv_len > 0:
            start = _contiguous_start(rows[0], group, kv_offset, kv_len, bs)
            if start is not None:  # the common single-sequence case: a view, decided without tensor work
                return torch.tensor([start], dtype=torch.long)
        gathered = []
        for row in rows:
            first_real = max(kv_offset - row.pad, 0)
            n_pad = max(0, min(row.pad, kv_offset + kv_len) - kv_offset)
            count = kv_len - n_pad
            table = torch.tensor(row.blocks.table(group), dtype=torch.long)
            j = torch.arange(first_real, first_real + count) - row.blocks.num_dropped(group) * bs
            real = table[j // bs] * bs + j % bs
            gathered.append(torch.cat([torch.full((n_pad,), pad_slot, dtype=torch.long), real]))
        return torch.stack(gathered)

    def _select(self, indices: list[int]) -> None:
        state = self._check_live()
        if indices == list(range(len(state.rows))):
            return
        with self._pool.lock:
            bad = [i for i in indices if not 0 <= i < len(state.rows)]
            if bad:
                raise IndexError(f"rows {bad} do not exist (the cache holds {len(state.rows)})")
            new_rows = [state.rows[i].copy() for i in indices]
            for row in state.rows:
                row.blocks.release()
        state.rows = new_rows
        state.step = None


def _contiguous_start(row: _Row, group: int, kv_offset: int, kv_len: int, block_size: int) -> int | None:
    """The first slot of rectangular positions ``kv_offset .. kv_offset + kv_len - 1`` of ``row`` when they are
    all stored in one contiguous run of slots (consecutive blocks, no padding among them), else None."""
    if row.pad > kv_offset:
        return None
    first = kv_offset - row.pad - row.blocks.num_dropped(group) * block_size
    table = row.blocks.table(group)
    lo, hi = first // block_size, (first + kv_len - 1) // block_size
    if hi >= len(table) or table[hi] - table[lo] != hi - lo:
        return None
    if any(table[i + 1] != table[i] + 1 for i in range(lo, hi)):
        return None
    return table[lo] * block_size + first % block_size


def _left_padding(positions: Any, batch: int, q_len: int, before: list[int]) -> tuple[list[int], bool]:
    """Per row, how many of the new positions are left padding (from ``position_ids``), and whether the
    positions are exactly explained by left padding. Rows that do not fit the pattern store every position."""
    none = [0] * batch
    if q_len == 1 and isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[1] == 1:
        # Decode step: one new position per row, which must be the row's next one (no tensor work beyond .tolist()).
        values = positions[:, 0].tolist()
        if len(values) == 1 and batch > 1:
            values = values * batch
        if len(values) == batch and all(v == n for v, n in zip(values, before)):
            return none, True
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        return none, False
    pos = positions.detach().to("cpu", torch.long)
    if pos.shape[0] == 1 and batch > 1:
        pos = pos.expand(batch, -1)
    if tuple(pos.shape) != (batch, q_len) or q_len == 0:
        return none, False
    prior = torch.tensor(before, dtype=torch.long)
    pads = q_len - (pos[:, -1] + 1 - prior)
    fits = (pads >= 0) & (pads < q_len) & _fits(pos, pads, prior, q_len)
    exact = bool(fits.all())
    return [int(p) if ok else 0 for p, ok in zip(pads.tolist(), fits.tolist())], exact


def _positions_fit(positions: Any, pads: list[int], batch: int, q_len: int, before: list[int]) -> bool:
    """Whether ``position_ids`` are exactly those of rows whose first ``pads[r]`` new positions are padding."""
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        return False
    pos = positions.detach().to("cpu", torch.long)
    if pos.shape[0] == 1 and batch > 1:
        pos = pos.expand(batch, -1)
    if tuple(pos.shape) != (batch, q_len):
        return False
    pad = torch.tensor(pads, dtype=torch.long)
    return bool(_fits(pos, pad, torch.tensor(before, dtype=torch.long), q_len).all())


def _fits(pos: torch.Tensor, pads: torch.Tensor, prior: torch.Tensor, q_len: int) -> torch.Tensor:
    """Per row: padding only before a row's first token (position 0 there, as generate makes it), then positions
    that continue the ``prior`` stored ones."""
    t = torch.arange(q_len)
    is_pad = t[None, :] < pads[:, None]
    expected = prior[:, None] + t[None, :] - pads[:, None]
    return ((pads == 0) | (prior == 0)) & torch.where(is_pad, pos == 0, pos == expected).all(dim=1)
