"""PagedCache: a transformers ``Cache`` whose keys and values live in a paged, ref-counted pool.

``model.generate(**inputs, cache=PagedCache(model))`` gives the same output as ``DynamicCache``. Each batch row
owns a :class:`~pagedcore.block_tables.BlockTables`; the rectangular batch that transformers sees is mapped onto
the rows: row ``r``'s first ``pad[r]`` positions are left padding (never stored: a zero slot stands in for them)
and position ``p >= pad[r]`` is the row's token ``p - pad[r]``. KV memory held is therefore the real tokens
rounded up to whole blocks. Beam search permutes block tables and reference counts, forks share blocks with
copy-on-write, ``crop`` truncates tables, and sliding-window layers give back blocks that left their window.

Each layer (:class:`PagedLayer`) owns its update, as transformers' own layers do. Before each forward of the model
the cache was made for, the model's forward pre-hook (:mod:`.forward_hooks`) hands the cache the forward's attention
mask and the shared state (:mod:`.cache_state`) reserves the forward once, on the host (:mod:`.forward_plan`: the
padding is read from the mask; a row that is not left-padded stores every position and the standard mask hides what
it hides); every layer then writes its keys and values and gathers what its attention reads, with indices built
there (no data-dependent Python per layer: a compiled forward has no graph break). Padding declared up front with
:meth:`PagedCache.attach_prefix` (``enable`` does) must agree with the mask. A cache made without a model (from a
pool or a config) reserves at its first layer and, not knowing the mask, stores every position of a padded batch:
correct, just less frugal. Such a cache does not vouch for what its rows store, so it registers nothing in the prefix
cache. ``layers[i].keys`` / ``.values`` are what a ``DynamicCache`` layer holds after the same calls (a copy gathered
from the blocks), and ``copy.deepcopy(cache)`` forks the rows (shared blocks, copy-on-write).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Hashable, Sequence
from typing import Any, SupportsIndex

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer

from pagedcore.attention import write_kv
from pagedcore.attention_kinds import AttentionKind
from pagedcore.block_tables import BlockTables
from pagedcore.capacity import Reservation
from pagedcore.config import PoolConfig
from pagedcore.errors import ConfigError, InvalidBlockError
from pagedcore.kv_pool import PoolMatch

from .attention import CONTEXT_KEY, LAYER_KEY, WEIGHTS_KEY
from .cache_state import CacheState, Row, Step
from .cache_stats import CacheMemoryStats
from .forward_hooks import watch
from .pool import PagedKVPool
from .probe import cache_path
from .spec import text_config
from .state_cache import PagedStateLayer, StateCacheMixin
from .state_spec import StateSpec

__all__ = ["CacheMemoryStats", "PagedCache", "PagedHybridLayer", "PagedLayer"]


def _release_soon(state: CacheState) -> None:
    state.pool.lock.call_soon(state.release)


class PagedLayer(CacheLayerMixin):
    """One layer of a :class:`PagedCache`: writes its keys and values into its KV group's blocks and returns what
    its attention reads. transformers' ``Cache.update`` hands each layer's keys to it, as to its own layers.

    The first layer of a forward has the shared state reserve the forward for every layer (slots in every group);
    each layer then writes its own keys and values. Its kind (:class:`~pagedcore.attention_kinds.AttentionKind`)
    gives the mask sizes transformers builds masks from.

    Example:
        >>> import torch
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> cache = PagedCache(tiny_llama(), num_blocks=8, block_size=4)
        >>> layer = cache.layers[0]
        >>> keys = torch.randn(1, 2, 3, 16)   # (batch, kv_heads, new tokens, head_dim)
        >>> out_keys, _ = layer.update(keys, keys.clone())   # as Cache.update calls it: written, then gathered
        >>> torch.equal(out_keys, keys), layer.get_seq_length(), layer.get_mask_sizes(1)
        (True, 3, (4, 0))
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, state: CacheState, layer_idx: int, group: int, kind: AttentionKind) -> None:
        # CacheLayerMixin.__init__ is not called: it would assign ``keys`` / ``values``, which are read from the pool.
        self._state = state
        self.layer_idx = layer_idx
        self.group = group
        self.kind = kind
        self.sliding_window = kind.max_cache_length if kind.is_sliding else None  # a chunked layer's: its chunk
        self.is_sliding = kind.is_sliding
        self.record_past = False
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the pool creates its tensors on first write."""

    @property
    def keys(self) -> torch.Tensor | None:
        """This layer's keys as a ``DynamicCache`` layer holds them after the same calls: ``(batch, kv_heads,
        positions, head_dim)``, every rectangular position of every row (a sliding layer: the last ``window - 1``),
        **a copy** gathered from the blocks at each access (writing to it changes nothing). Left padding that the
        cache did not store reads as zeros (``DynamicCache`` holds the pad tokens' keys there, which the mask hides).
        None before anything was stored."""
        return self._held(0)

    @keys.setter
    def keys(self, value: Any) -> None:
        raise AttributeError("PagedLayer.keys is gathered from the pool's blocks and cannot be assigned")

    @property
    def values(self) -> torch.Tensor | None:
        """This layer's values, as :attr:`keys` (a copy)."""
        return self._held(1)

    @values.setter
    def values(self, value: Any) -> None:
        raise AttributeError("PagedLayer.values is gathered from the pool's blocks and cannot be assigned")

    def _held(self, which: int) -> torch.Tensor | None:
        state = self._state
        tensors = state.pool.layer_tensors(self.layer_idx)
        length = state.layer_len[self.layer_idx]
        if tensors is None or not state.rows or state.released:
            return None
        start = self.kind.mask_sizes(length, 0)[1]  # what transformers' layer of this kind keeps
        with state.pool.lock:
            index = state.gather_index(self.group, start, length - start)
        flat = tensors[which].view(-1, *tensors[which].shape[2:])
        held = flat.index_select(0, index.view(-1).to(flat.device))
        return held.view(len(state.rows), length - start, *flat.shape[1:]).transpose(1, 2)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this layer's new keys and values and return what its attention reads.

        With ``attn_implementation="paged"`` the attention reads the pool directly and this returns the inputs;
        otherwise it returns the layer's keys and values gathered from the blocks, ``(batch, kv_heads, kv_len,
        head_dim)``, zero at padding positions.
        """
        state = self._state
        state.check_live()
        model_kwargs = kwargs.get("kwargs")
        if not isinstance(model_kwargs, dict):
            model_kwargs = None
        batch, _, q_len, _ = key_states.shape
        keys = key_states.transpose(1, 2).reshape(batch * q_len, *key_states.shape[1:2], key_states.shape[-1])
        values = value_states.transpose(1, 2).reshape(batch * q_len, *value_states.shape[1:2], value_states.shape[-1])
        # Before any bookkeeping: raises PoolMismatchError, changing nothing, for keys the pool cannot hold.
        key_cache, value_cache = state.pool.layer_kv(self.layer_idx, keys, values)
        positions = model_kwargs.get("position_ids") if model_kwargs is not None else None
        device = key_states.device
        step = state.forward_step(self.layer_idx, batch, q_len, positions, model_kwargs is not None, device)
        # From here on tensor operations on indices the step built on the host (no data-dependent Python): a compiled
        # forward writes through an index tensor, never a slice at an offset that changes every step.
        index = step.real_index_on(device)
        if index is not None:
            keys, values = keys.index_select(0, index), values.index_select(0, index)
        slots = step.write_slots(self.group, device, as_tensor=torch.compiler.is_compiling())
        write_kv(key_cache, value_cache, keys, values, slots)
        context = step.context
        if context is not None and context.trace is not None:  # a probe forward (probe.py)
            context.trace.stored(self.layer_idx, key_states, value_states, returns_new=model_kwargs is not None)
        if step.wants_weights and model_kwargs is not None:
            model_kwargs[WEIGHTS_KEY] = True
        if step.context is not None and model_kwargs is not None:
            model_kwargs[CONTEXT_KEY] = step.context
            model_kwargs[LAYER_KEY] = self.layer_idx
            return key_states, value_states
        return self.gather(key_cache, value_cache, device)

    def gather(
        self, key_cache: torch.Tensor, value_cache: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values this forward's attention reads, ``(batch, kv_heads, kv_len, head_dim)``, as
        transformers' own layers return them (the window's keys only, in a sliding layer)."""
        step = self._state.step
        assert step is not None
        keys = key_cache.view(-1, *key_cache.shape[2:])
        values = value_cache.view(-1, *value_cache.shape[2:])
        start, kv_len, index = self._read(step, device)
        if start is not None:  # one row whose slots are one contiguous run: a view, no copy (traced: symbolic ints)
            k = keys.narrow(0, start, kv_len).unsqueeze(0)
            v = values.narrow(0, start, kv_len).unsqueeze(0)
        else:  # the index's shape gives every size (traced: no host integer to compare with)
            assert index is not None
            k = keys.index_select(0, index.view(-1)).view(*index.shape, *keys.shape[1:])
            v = values.index_select(0, index.view(-1)).view(*index.shape, *values.shape[1:])
        return k.transpose(1, 2), v.transpose(1, 2)

    def _read(self, step: Step, device: torch.device) -> tuple[int | None, int, torch.Tensor | None]:
        """``(view start or None, kv_len, gather index or None)`` of this layer's group in this forward: built by
        :meth:`CacheState.prepare` (a view of one contiguous run or a gather index, eager and compiled alike), else
        here, once per device (another device, or a paged-attention forward that falls back to dense attention)."""
        state, group = self._state, self.group
        read = step.reads[group] if device == step.device else None
        if read is not None and (read[2] is not None or read[3] is not None):
            kv_len, _, start, index = read
            return start, kv_len, index
        kv_len, kv_offset = self.kind.mask_sizes(step.plan.start, step.plan.q_len)
        start = step.memo(("view", group, kv_offset), lambda: state.view_start(group, kv_offset, kv_len))
        if start is not None:
            return start, kv_len, None
        index = step.tensor(("gather", group, kv_offset), device, lambda: state.gather_index(group, kv_offset, kv_len))
        return None, kv_len, index

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the keys :meth:`update` will return (transformers' rules, by its kind)."""
        step = self._state.open_step()
        if step is not None and step.reads:
            kv_len, kv_offset, _, index = step.reads[self.group]
            # traced: the gather index's length, as the keys update returns, or the view's (the step's own ints)
            return (kv_len if index is None else index.shape[-1]), kv_offset
        return self.kind.mask_sizes(self._state.layer_len[self.layer_idx], query_length)

    def get_seq_length(self) -> int:
        """Positions stored (padding included)."""
        step = self._state.open_step()
        return step.plan.start if step is not None else self._state.layer_len[self.layer_idx]

    def get_max_length(self) -> int:
        """-1, or the window of a sliding layer."""
        return self.kind.max_cache_length

    def activate_past_recording(self, **kwargs: Any) -> None:
        """Keep sliding-window blocks until the next ``crop`` (assisted decoding rolls back through it). transformers
        passes every layer its state options (``recurrent_states_to_keep``): an attention layer has none to keep."""
        self.record_past = True


class PagedHybridLayer(PagedStateLayer, PagedLayer):  # type: ignore[override]
    """A layer that keeps recurrent states and keys and values (Falcon-H1, Zamba2's hybrid layers: transformers'
    ``LinearAttentionAndFullAttentionLayer``): its states in the pool's state slots, its keys and values in its KV
    group's blocks.

    Example:
        >>> import torch
        >>> from transformers import AutoConfig, AutoModelForCausalLM
        >>> config = AutoConfig.for_model("falcon_h1", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=100, mamba_n_heads=8, mamba_d_head=16,
        ...     mamba_d_ssm=128, mamba_d_state=16, mamba_chunk_size=8)
        >>> model = AutoModelForCausalLM.from_config(config).eval()
        >>> cache = PagedCache(model, num_blocks=8, block_size=4)
        >>> _ = model(torch.tensor([[5, 6, 7]]), cache=cache)
        >>> layer = cache.layers[0]
        >>> type(layer).__name__, layer.keys.shape, layer.recurrent_states[0].shape
        ('PagedHybridLayer', torch.Size([1, 2, 3, 16]), torch.Size([1, 8, 16, 16]))
    """

    def __init__(
        self, state: CacheState, layer_idx: int, group: int, kind: AttentionKind, number_of_states: int
    ) -> None:
        PagedLayer.__init__(self, state, layer_idx, group, kind)
        assert state.states is not None
        PagedStateLayer.__init__(self, state.states, lambda: state.rows, layer_idx, number_of_states)

    def get_max_length(self) -> int:
        """-1, or the window of a sliding layer."""
        return PagedLayer.get_max_length(self)

    def get_seq_length(self) -> int:
        """Positions stored, as its attention part counts them (transformers' linear-attention mixin, earlier in
        the MRO, counts a ``cumulative_length_linear`` that these slots do not keep)."""
        return PagedLayer.get_seq_length(self)


class PagedCache(StateCacheMixin, Cache):
    """A drop-in ``Cache`` for ``model.generate`` backed by a paged pool.

    Args:
        model: the model (or its config) the cache serves.
        pool: a :class:`PagedKVPool` to take blocks from (e.g. one shared with other caches); a private pool is
            created when omitted, with ``config`` (a :class:`~pagedcore.config.PoolConfig`) or the keyword
            arguments that build one (``num_blocks`` / ``memory_budget`` / ``block_size`` / ``kv_layout``).
        config: the private pool's settings.
        num_blocks: blocks of the private pool.
        memory_budget: bytes (or ``"2GiB"``) of the private pool.
        block_size: tokens per block of the private pool.
        kv_layout: memory layout of the private pool (see :class:`PagedKVPool`); default ``"auto"``: each head's keys
            contiguous on the CPU, where single-sequence attention then reads them as fast as ``DynamicCache``'s.
        namespace: prefix-cache namespace used by :meth:`attach_prefix` and :meth:`cache_prefixes`.
        attention_backend: attention backend name for ``attn_implementation="paged"`` (default: the plugins').
        state_slots: recurrent-state slots of the private pool (a model with recurrent-state layers: one per row,
            more for the snapshots its rows keep; see :class:`PagedKVPool`).
        reservation: blocks reserved for this cache on a shared pool (:meth:`KVPool.reserve
            <pagedcore.kv_pool.KVPool.reserve>`, sized by :meth:`~pagedcore.kv_pool.KVPool.worst_case`): its rows draw
            from it, so a ``generate`` within it cannot run out half-way (see :attr:`reservation`).

    Example:
        >>> import torch
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import PagedCache
        >>> model = tiny_llama()
        >>> cache = PagedCache(model, num_blocks=64, block_size=16)
        >>> out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, cache=cache)
        >>> cache.get_seq_length(), cache.memory_stats().tokens
        (6, 6)
    """

    def __new__(cls, model: Any = None, *args: Any, pool: PagedKVPool | None = None, **kwargs: Any) -> PagedCache:
        # A model that requires a cache class of its own (MiniMax) gets a PagedCache that is one.
        spec = pool.state_spec if pool is not None else None
        if spec is None and model is not None:
            spec = StateSpec.from_config(text_config(model))
        if cls is PagedCache and spec is not None and spec.custom_cache:
            return super().__new__(_custom_cache_class(spec.model_type))
        return super().__new__(cls)

    def __init__(
        self,
        model: Any = None,
        *,
        pool: PagedKVPool | None = None,
        config: PoolConfig | None = None,
        num_blocks: int | None = None,
        memory_budget: int | float | str | None = None,
        block_size: int | None = None,
        namespace: Hashable = None,
        attention_backend: str | None = None,
        kv_layout: str | None = None,
        reservation: Reservation | None = None,
        state_slots: int | None = None,
    ) -> None:
        settings = PoolConfig.of(
            config,
            num_blocks=num_blocks,
            memory_budget=memory_budget,
            block_size=block_size,
            kv_layout=kv_layout,
            state_slots=state_slots,
        )
        if pool is None and model is None:
            raise ConfigError("PagedCache needs a model (or config) or a pool")
        shared = pool is not None
        pool = PagedKVPool.resolve(model, pool, settings, kv_layout="auto")
        with pool.closed_on_failure(not shared):
            if shared:
                pool.check_weights()  # a shared pool forgets prefixes computed before a weight update
            if pool.states is not None and not isinstance(model, torch.nn.Module):
                raise ConfigError(
                    f"a PagedCache for {pool.spec.model_type!r}, whose layers keep recurrent states, needs the model "
                    "itself (PagedCache(model, ...)): its forward hook prepares each forward's state slots"
                )
            self._pool = pool
            model_config = text_config(model) if model is not None else None
            self._state = CacheState(
                pool,
                pool.spec.num_layers,
                config=model_config,
                namespace=namespace,
                attention_backend=attention_backend,
            )
            self._state.reservation = reservation
            Cache.__init__(self, layers=self._make_layers(pool))  # not super(): MiniMax's cache class comes next
            self._state.layers = self.layers
            # A cache dropped without release() gives its blocks back when garbage collected (deferred to a moment when
            # no bookkeeping call is in progress: a collection may run in the middle of one).
            self._finalizer = weakref.finalize(self, _release_soon, self._state)
            self._owner = threading.get_ident()
            # The model's forward pre-hook tells the cache each forward's attention mask before layer 0 (forward_hooks).
            self._model = weakref.ref(model) if isinstance(model, torch.nn.Module) else None
            if self._model is not None:
                watch(model, PagedCache)
                # Exact or refused: a one-time probe of this model says whether its layers may read the pool (probe.py).
                self._state.paged_reads = cache_path(model, pool, PagedCache, attention_backend) == "paged"

    def _make_layers(self, pool: PagedKVPool) -> list[Any]:
        state, states = self._state, self._state.states
        layers: list[Any] = []
        for i, spec in enumerate(pool.spec.layers):
            count = pool.state_spec.layers.get(i)
            if count is not None and states is not None and not spec.has_cache:
                layers.append(PagedStateLayer(states, lambda: state.rows, i, count))
            elif not spec.has_cache:
                layers.append(DummyLayer())
            elif count is not None:
                group = pool.group_of(i)
                layers.append(PagedHybridLayer(state, i, group, pool.kv.groups[group].kind, count))
            else:
                group = pool.group_of(i)
                layers.append(PagedLayer(state, i, group, pool.kv.groups[group].kind))
        return layers

    # ------------------------------------------------------------------ what the model's forward hooks call
    def before_forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        attention_mask: Any = None,
        position_ids: torch.Tensor | None = None,
        output_attentions: bool = False,
        kwargs_reach: bool = True,
    ) -> dict[str, Any] | None:
        """Reserve the coming forward for every layer, before layer 0: the padding is read from ``attention_mask`` (2-D,
        ``(batch, past + new)``; None: no padding). With ``output_attentions`` paged attention returns the attention
        weights (see :func:`~.attention.paged_attention_forward`). The indices every layer reads through are built here,
        so a ``torch.compile``'d forward only indexes with tensors. The forward pre-hook of the model the cache was made
        for calls it with the forward's arguments; call it yourself only for a forward that hook does not see (a
        submodule called directly). A forward whose mask is not left padding stores every position (the standard mask
        then hides what it hides, exactly as with ``DynamicCache``). Returns keyword arguments the hook adds to the
        forward (the paged-attention context, for a model with KV-shared layers: they call no ``update`` that could
        hand it to them), or None; ``kwargs_reach=False`` says the forward cannot take them.

        Example:
            >>> import torch
            >>> from pagedcore.adapters.transformers.testing import tiny_llama
            >>> model = tiny_llama()
            >>> cache = PagedCache(model, num_blocks=16, block_size=4)
            >>> ids, mask = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
            >>> _ = model(ids, attention_mask=mask, cache=cache)    # the hook called before_forward(...)
            >>> cache.row_padding(), cache.row_tokens()
            ([1, 0], [2, 3])
            >>> right = PagedCache(model, num_blocks=16, block_size=4)   # right padding: stored densely
            >>> _ = model(ids, attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]), cache=right)
            >>> right.row_padding(), right.row_tokens()
            ([0, 0], [3, 3])
        """
        inputs = input_ids if input_ids is not None else inputs_embeds
        if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2:
            return None
        known = attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2)
        batch, q_len = int(inputs.shape[0]), int(inputs.shape[1])
        self._state.begin_forward(
            batch,
            q_len,
            attention_mask,
            position_ids,
            inputs.device,
            mask_known=known,
            weights=bool(output_attentions),
            kwargs_reach=kwargs_reach,
        )
        return self._state.shared_kwargs()

    def after_forward(self) -> None:
        """After a forward (also one that raised): give back a reservation that no layer used, so a forward that
        failed before storing anything leaves the cache as it was. The model's forward hook calls it.

        Example:
            >>> from pagedcore.adapters.transformers.testing import tiny_llama
            >>> cache = PagedCache(tiny_llama(), num_blocks=16, block_size=4)
            >>> cache.before_forward(input_ids=torch.tensor([[5, 6, 7]])); cache.pool.kv.num_used_blocks
            1
            >>> cache.after_forward(); cache.pool.kv.num_used_blocks, cache.get_seq_length()
            (0, 0)
        """
        self._state.end_forward()

    # ------------------------------------------------------------------ what generate and the models call
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys and values of ``layer_idx`` and return what its attention reads: transformers'
        ``Cache.update``, which hands them to the layer (:meth:`PagedLayer.update`)."""
        self._state.check_live()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions stored (padding included) for a layer (the first cached layer for layers without one)."""
        if layer_idx >= len(self.layers):
            return 0
        if not isinstance(self.layers[layer_idx], PagedLayer):
            first = self._first_kv_layer()
            if first is None:  # no attention layer (Mamba-2): the cache's own count
                return self._state.positions_before()
            layer_idx = first
        layer = self.layers[layer_idx]
        assert isinstance(layer, PagedLayer)
        return layer.get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the keys ``update`` will return for ``layer_idx`` (transformers' rules)."""
        if not isinstance(self.layers[layer_idx], PagedLayer):
            first = self._first_kv_layer()
            if first is None:
                return query_length + self._state.positions_before(), 0
            layer_idx = first
        layer = self.layers[layer_idx]
        assert isinstance(layer, PagedLayer)
        return layer.get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """-1 (no fixed maximum: the pool decides), or the window of a sliding layer."""
        if layer_idx is None:
            return -1
        return int(self.layers[layer_idx].get_max_length())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` becomes old row ``beam_idx[i]`` by sharing its blocks (no tensor copy)."""
        self._state.select([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Fork every row ``repeats`` times (rows share blocks; copy-on-write on the first write)."""
        self._state.select([i for i in range(len(self._state.rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows ``indices``."""
        self._state.select([int(i) for i in torch.as_tensor(indices).tolist()])

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
        state.crop(tokens_to_remove)

    def reset(self) -> None:
        """Give every block back and start empty (the cache can be used again)."""
        state = self._state
        state.release()
        state.length = 0
        state.layer_len = [0] * len(state.layer_len)
        state.exact = True
        state.released = False
        for layer in self.layers:
            if hasattr(layer, "record_past"):
                layer.record_past = False
        state.weights_version = None

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
    def namespace(self) -> Hashable:
        """The prefix-cache namespace the rows' blocks are registered in."""
        return self._state.namespace

    @namespace.setter
    def namespace(self, value: Hashable) -> None:
        self._state.namespace = value

    @property
    def reservation(self) -> Reservation | None:
        """The reservation the rows' growth draws from (None: the cache takes unreserved blocks as it grows, and
        can run out in the middle of ``generate`` when other holders fill the pool). ``enable()`` sets one for each
        call. Never blocks other holders reserved, with or without one.

        Example:
            >>> import torch
            >>> from pagedcore.adapters.transformers import PagedKVPool
            >>> from pagedcore.adapters.transformers.testing import tiny_llama
            >>> from pagedcore.capacity import Demand
            >>> model = tiny_llama()
            >>> pool = PagedKVPool(model, num_blocks=16, block_size=4)
            >>> with pool.lock:   # the pool's bookkeeping lock guards reservations too
            ...     reservation = pool.kv.reserve(pool.kv.worst_case(Demand(3, 6)))   # 8 positions: 2 blocks
            >>> cache = PagedCache(model, pool=pool, reservation=reservation)
            >>> _ = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=False, cache=cache)
            >>> reservation.remaining, pool.kv.num_used_blocks                       # both drawn
            ((0,), 2)
            >>> with pool.lock:
            ...     reservation.release()
            >>> cache.release(); pool.kv.num_used_blocks, pool.kv.num_reserved_blocks
            (0, 0)
        """
        return self._state.reservation

    @reservation.setter
    def reservation(self, value: Reservation | None) -> None:
        with self._pool.lock:
            self._state.reservation = value
            for row in self._state.rows:
                row.blocks.reservation = value

    @property
    def weights_version(self) -> int | None:
        """The pool's :attr:`~PagedKVPool.weights_version` when the rows were first computed (None before): the
        weights the keys and values of a kept ``generate`` result (``out.cache``) come from."""
        return self._state.weights_version

    @property
    def attention_backend(self) -> str | None:
        """The attention backend name for ``attn_implementation="paged"`` (None: the plugins' choice)."""
        return self._state.attention_backend

    @attention_backend.setter
    def attention_backend(self, value: str | None) -> None:
        self._state.attention_backend = value

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
        slots = sum(row.blocks.num_held_slots() for row in state.rows)
        return CacheMemoryStats(
            rows=len(state.rows),
            tokens=sum(row.blocks.num_tokens for row in state.rows),
            padding_tokens=sum(row.pad for row in state.rows),
            blocks=blocks,
            held_bytes=held,
            token_bytes=token_bytes // pool.block_size,
            state_slots=slots,
            state_bytes=0 if pool.states is None else slots * pool.states.slot_nbytes(),
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
        rows: list[Row] = []
        with self._pool.lock:
            try:
                for r, (match, pad) in enumerate(zip(matches, pads)):
                    used_pad = min(pad, length)
                    blocks = BlockTables(self._pool.kv, state.reservation)
                    rows.append(Row(blocks, used_pad, pad, list(prompts[r]) if prompts is not None else None))
                    if length > used_pad:
                        if match is None:
                            raise InvalidBlockError(f"attach_prefix: a row needs {length - used_pad} cached tokens")
                        blocks.attach(match, length - used_pad)
                        if not state.recording_past():  # attached blocks are cached already
                            blocks.drop_out_of_window(length - used_pad)
            except Exception:
                for row in rows:
                    row.blocks.release()
                raise
        state.rows = rows
        state.length = length
        state.layer_len = [length] * len(state.layer_len)
        state.attached = True
        state.weights_version = self._pool.weights_version

    def take_rows(
        self, sources: Sequence[PagedCache], pads: Sequence[int], prompts: Sequence[Sequence[int]], length: int
    ) -> None:
        """Start an empty cache at rectangular position ``length`` from the rows of one-row caches of the same pool,
        which are left empty: row ``r`` is ``min(pads[r], length)`` positions of left padding (never stored), then
        ``sources[r]``'s tokens, the first of ``prompts[r]``. ``enable()``'s prefill of a model with recurrent-state
        layers computes each row alone, then hands the rows to the call's cache this way."""
        state = self._check_live()
        tokens = [source.row_tokens()[0] if source.row_tokens() else 0 for source in sources]
        if state.rows or state.length or len(sources) != len(pads) or length < 0:
            raise InvalidBlockError(f"take_rows: {len(sources)} rows into a cache holding {state.length} positions")
        if any(min(pad, length) + n != length for pad, n in zip(pads, tokens)):
            raise InvalidBlockError(f"take_rows: rows of {tokens} tokens after {list(pads)} do not end at {length}")
        rows = [source.give_row() for source in sources]
        state.rows = [Row(row.blocks, min(pad, length), pad, list(p)) for row, pad, p in zip(rows, pads, prompts)]
        state.length = length
        state.layer_len = [length] * len(state.layer_len)
        state.attached = True
        self.reservation = self.reservation  # the rows draw from this cache's reservation

    def give_row(self) -> Row:
        """Hand the one row of a one-row cache to another cache (:meth:`take_rows`); this cache is left empty."""
        state = self._check_live()
        if len(state.rows) != 1:
            raise InvalidBlockError(f"give_row: the cache holds {len(state.rows)} rows, not one")
        row = state.rows[0]
        state.rows, state.length, state.step = [], 0, None  # (a row of no token yet is handed over empty)
        state.layer_len = [0] * len(state.layer_len)
        return row

    def cache_prefixes(self, token_ids: Sequence[Sequence[int]]) -> None:
        """Register every row's blocks in the pool's prefix cache: its full blocks and its partly filled last one
        (a prompt continuing the row inside that block reuses its positions; writing on in this cache then copies
        that block first). ``token_ids[r]`` are row ``r``'s real tokens (no padding), at least as many as the row
        stores.

        Does nothing for a cache that stored positions it could not tell from padding (a row whose mask is not left
        padding, or a padded batch whose mask the cache never saw and whose padding :meth:`attach_prefix` did not
        declare): its blocks would not hold the keys and values of those tokens at those positions. Nor for rows
        filled before the model's weights changed (:meth:`PagedKVPool.check_weights`, run here first).
        """
        state = self._check_live()
        if not state.exact:
            return
        with self._pool.lock:
            self._pool.check_weights()  # rows computed before a weight update register nothing (their epoch is old)
            for row, tokens in zip(state.rows, token_ids):
                row.blocks.cache_partial_block(tokens, row.blocks.num_tokens, self.namespace)

    def fork(self) -> PagedCache:
        """A new cache on the same pool whose rows share this cache's blocks (copy-on-write: the first write to a
        shared block copies it), at the same length. ``copy.copy(cache)`` and ``copy.deepcopy(cache)`` give one,
        so code that copies ``past_key_values`` to reuse a prompt (transformers' "re-use a cache" recipe) works
        without copying any tensor; each copy holds its blocks until released.

        Example:
            >>> import copy, torch
            >>> from pagedcore.adapters.transformers.testing import tiny_llama
            >>> model = tiny_llama()
            >>> cache = PagedCache(model, num_blocks=16, block_size=4)
            >>> _ = model(torch.tensor([[5, 6, 7, 8, 9]]), cache=cache)
            >>> twin = copy.deepcopy(cache)
            >>> twin.get_seq_length(), twin.pool is cache.pool, torch.equal(twin.layers[0].keys, cache.layers[0].keys)
            (5, True, True)
            >>> cache.pool.kv.num_used_blocks   # 2 blocks, shared
            2
        """
        state = self._check_live()
        model = self._model() if self._model is not None else None
        clone = PagedCache(
            model if model is not None else state.config,
            pool=self._pool,
            namespace=state.namespace,
            attention_backend=state.attention_backend,
        )
        clone._state.adopt(state)
        return clone

    def __copy__(self) -> PagedCache:
        return self.fork()

    def __deepcopy__(self, memo: dict[int, Any]) -> PagedCache:
        return self.fork()

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        """Refused (``pickle``, ``torch.save``): the keys and values are rows of a pool's blocks, which a pickle
        cannot carry (nor the pool's lock and the model it serves); ``copy.deepcopy`` forks the cache instead."""
        raise TypeError(
            "a PagedCache cannot be pickled (pickle, torch.save): its keys and values live in blocks of its pool, "
            "shared with other caches, and are not copied out; save the generated token ids (or a DynamicCache) "
            "instead, or fork it in memory with copy.deepcopy(cache)"
        )

    def row_tokens(self) -> list[int]:
        """Real tokens stored per row."""
        return [row.blocks.num_tokens for row in self._state.rows]

    def row_padding(self) -> list[int]:
        """Unstored left-padding positions per row."""
        return [row.pad for row in self._state.rows]

    def __repr__(self) -> str:
        state, tokens = self._state, sum(r.blocks.num_tokens for r in self._state.rows)
        return f"PagedCache(rows={len(state.rows)}, length={state.length}, tokens={tokens}, pool={self._pool!r})"

    # ------------------------------------------------------------------ internals
    def _check_live(self) -> CacheState:
        self._state.check_live()
        return self._state

    def _first_kv_layer(self) -> int | None:
        return next((i for i, layer in enumerate(self.layers) if isinstance(layer, PagedLayer)), None)


@functools.cache
def _custom_cache_class(model_type: str) -> type[PagedCache]:
    """A :class:`PagedCache` that is also the cache class ``model_type`` requires (MiniMax: ``MiniMaxCache``, its
    linear-attention states served by :class:`~.state_cache.StateCacheMixin`)."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    def length(self: PagedCache) -> int:
        return len(self.layers)

    return type("PagedMiniMaxCache", (PagedCache, MiniMaxCache), {"__len__": length, "__module__": __name__})
