"""PagedKVPool: a model's paged KV memory (one tensor pair per layer) plus its block bookkeeping and prefix cache.

A pool outlives caches: :class:`~pagedcore.adapters.transformers.PagedCache` objects and the
:class:`~pagedcore.adapters.transformers.Engine` take blocks from it and give them back, and the prefix trie
inside keeps finished sequences' blocks for later prompts. Each layer's tensors are created on the device and
dtype of the first keys that layer stores, so models split over devices (accelerate's ``device_map``) work. Keys of
another dtype or device later (the model was converted with ``.to()``) raise :class:`PoolMismatchError`: the stored
keys and values no longer belong to that model; :meth:`PagedKVPool.rebuild` drops them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Hashable, Iterator
from typing import Any

import torch

from pagedcore.attention import AttentionBackend, default_block_size, to_device
from pagedcore.config import KV_LAYOUTS, KVStoreSpec, PoolConfig, parse_size
from pagedcore.errors import ConfigError, InvalidBlockError, PoolMismatchError
from pagedcore.kv_pool import KVPool
from pagedcore.kv_tiers import KVTiers, TierStats
from pagedcore.plugin_manager import PluginManager, default_plugin_manager

from .kv_io import TensorBlockIO
from .pool_lock import PoolLock
from .pool_memory import layer_tensor
from .pool_stats import MemoryStats
from .pool_stores import close_stores, make_stores
from .spec import ModelKVSpec, text_config
from .state_pool import StatePlan, StatePool, plan_states, state_stats
from .state_spec import StateSpec, probe_states
from .weights import Placement, WeightsWatch

__all__ = ["KV_LAYOUTS", "KVStoreSpec", "MemoryStats", "PagedKVPool", "PoolConfig", "PoolLock", "parse_bytes"]

# How a layer's pool tensors lie in memory (their shape is always (num_blocks + 1, block_size, kv_heads, head_dim)):
# "slots": slot after slot, each slot's heads together (contiguous; what xformers' paged kernels read);
# "heads": head after head (storage (kv_heads, num_blocks + 1, block_size, head_dim), seen through a permuted view),
# so the keys of one head over consecutive blocks are contiguous memory, as DynamicCache's are: attention of a single
# sequence reads them as a view at full speed. Gathers of scattered blocks copy half-size pieces, so batched serving
# (the Engine) keeps "slots". "auto": "heads" on the CPU, "slots" on other devices (decided at the first write).
# The names are pagedcore.config.KV_LAYOUTS (a PoolConfig checks them).

_DEFAULT_TOKENS = 32_768  # default capacity when neither num_blocks nor memory_budget is given

parse_bytes = parse_size  # its old name here: sizes have one parser, pagedcore.config.parse_size


class PagedKVPool:
    """Paged KV memory for one model.

    Args:
        model: the model (or its config) the pool serves.
        config: the pool's settings (:class:`~pagedcore.config.PoolConfig`); or give them as keyword arguments
            (``num_blocks=``, ``memory_budget=``, ...: each is the field of that name), not both:
        num_blocks: blocks per KV group. Give this or ``memory_budget``.
        memory_budget: bytes (or a string like ``"2GiB"``) for all layers' keys and values together: a ceiling. On
            the CPU the pool takes memory as blocks are first written (``memory_stats().reserved_bytes``); on other
            devices each layer's tensors are allocated whole when the layer first stores keys (as vLLM does).
        block_size: tokens per block (default: ``default_block_size`` of the model's device, 16 on CPU, 64 on CUDA).
        eviction_policy: name of the eviction policy plugin to use ("lru" by default).
        kv_layout: how each layer's keys and values lie in memory (:data:`~pagedcore.config.KV_LAYOUTS`):
            ``"slots"`` (default, for batched serving and xformers), ``"heads"`` (each head's keys contiguous over
            consecutive blocks: faster single-sequence decoding, slower scattered gathers) or ``"auto"``
            (``"heads"`` on the CPU, else ``"slots"``). The tensors' shape and indexing are the same in every layout.
        kv_store: tiers below the pool (:data:`~pagedcore.config.KVStoreSpec`; :mod:`pagedcore.kv_tiers`): blocks
            the pool evicts are written there, and a prompt's prefix match continues into them. A directory (it must
            exist and be writable, else :class:`~pagedcore.errors.ConfigError`) persists across restarts and can be
            shared by processes serving the same model.
        kv_store_bytes: the budget of each store given by location (bytes or ``"20GiB"``); required with them.
        state_slots: for a model with recurrent-state layers (Qwen3.5, Mamba-2...; :mod:`.state_pool`), the state
            slots: live sequences' states and snapshots together. Default: half of ``memory_budget`` (all of it in a
            model without attention layers), else :data:`~.state_pool.DEFAULT_STATE_SLOTS`.
        snapshot_interval: such a model's prompts keep a snapshot of their state every this many blocks (each costs
            a slot; see :mod:`pagedcore.state_slots`), so that later prompts sharing a prefix resume there.
        dtype: dtype of the stored keys and values, to size a memory budget (default: the model's dtype).
        plugins: plugin manager for policies, hashing and events (the default one when omitted).

    Without ``num_blocks`` or ``memory_budget`` the pool holds 32,768 tokens.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama_config
        >>> config = tiny_llama_config()
        >>> pool = PagedKVPool(config, memory_budget="1MiB", block_size=16, dtype=torch.float32)
        >>> pool.num_blocks, pool.block_size
        (128, 16)
        >>> PagedKVPool(config, PoolConfig(num_blocks=8), dtype=torch.float32).num_blocks
        8
    """

    def __init__(
        self,
        model: Any,
        config: PoolConfig | None = None,
        *,
        num_blocks: int | None = None,
        memory_budget: int | float | str | None = None,
        block_size: int | None = None,
        eviction_policy: str | None = None,
        kv_layout: str | None = None,
        kv_store: KVStoreSpec | None = None,
        kv_store_bytes: int | float | str | None = None,
        state_slots: int | None = None,
        snapshot_interval: int | None = None,
        dtype: torch.dtype | None = None,
        plugins: PluginManager | None = None,
    ) -> None:
        config = PoolConfig.of(
            config,
            num_blocks=num_blocks,
            memory_budget=memory_budget,
            block_size=block_size,
            eviction_policy=eviction_policy,
            kv_layout=kv_layout,
            kv_store=kv_store,
            kv_store_bytes=kv_store_bytes,
            state_slots=state_slots,
            snapshot_interval=snapshot_interval,
        ).with_defaults(kv_layout="slots")
        self.config = config
        self.spec = ModelKVSpec.from_model(model)
        self._kv_layout = str(config.kv_layout)
        block_size = (
            default_block_size(getattr(model, "device", "cpu")) if config.block_size is None else config.block_size
        )
        self._dtype: torch.dtype = _model_dtype(model) if dtype is None else dtype
        self._config = text_config(model)  # to read a config-only model's state shapes (state_spec.probe_states)
        self.state_spec = StateSpec.from_config(self._config)
        num_blocks, plan = self._sizing(model, config, block_size)
        self.states = StatePool(self.state_spec, plan.num_slots, plan.shapes) if plan.num_slots else None
        self.plugins = plugins if plugins is not None else default_plugin_manager()
        self.kv = self._bookkeeping(config, num_blocks, block_size, plan.num_slots)
        self._layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.spec.num_layers
        self._latents: dict[int, torch.Tensor] = {}  # MLA layers: the one tensor their two views above share
        # Bookkeeping lock: caches and engines of several threads may share one pool. Tensor reads and writes need no
        # lock: each sequence writes only blocks it holds alone (copy-on-write), and cached blocks are never written.
        self.lock = PoolLock()
        self._backends: dict[tuple[str, torch.dtype, str | None], AttentionBackend] = {}
        self._owner: weakref.ref[Any] | None = None
        if isinstance(model, torch.nn.Module):
            self._owner = weakref.ref(model)
        self._weights: WeightsWatch | None = None  # the owner's weights: made by the first check_weights
        self._adapters_apart = False  # the owner's PEFT adapters are served per request (watch_adapters_apart)
        self._stale_tensors = False  # the owner was converted since the tensors were made: rebuild once idle
        self._slept: tuple[torch.device, torch.dtype] | None = None  # where the tensors were before sleep()
        stores, self._made_stores = make_stores(self.plugins, config)  # those made from a location: the pool's
        self._tiers = KVTiers(stores, TensorBlockIO(self)) if stores else None
        self.kv.attach_tiers(self._tiers)

    @classmethod
    def resolve(cls, model: Any, pool: PagedKVPool | None, config: PoolConfig, **defaults: Any) -> PagedKVPool:
        """The pool a holder of ``model`` uses (an Engine, ``enable()``, a ``PagedCache``): a new one with
        ``config`` (``defaults`` for the settings it leaves None), or ``pool`` bound to ``model`` (when not None)
        when given, with no settings (they describe a new pool).

        Example:
            >>> from pagedcore.adapters.transformers.testing import tiny_llama
            >>> model = tiny_llama()
            >>> pool = PagedKVPool.resolve(model, None, PoolConfig(num_blocks=8))
            >>> PagedKVPool.resolve(model, pool, PoolConfig()) is pool
            True
            >>> PagedKVPool.resolve(model, pool, PoolConfig(num_blocks=8))
            Traceback (most recent call last):
            ...
            pagedcore.errors.ConfigError: pool settings (num_blocks=8) make a new pool: not with pool=
        """
        if pool is None:
            return cls(model, config.with_defaults(**defaults))
        if not config.is_default:
            given = ", ".join(f"{name}={value!r}" for name, value in vars(config).items() if value is not None)
            raise ConfigError(f"pool settings ({given}) make a new pool: not with pool=")
        if model is not None:
            pool.bind(model)
        return pool

    def _bookkeeping(self, config: PoolConfig, num_blocks: int, block_size: int, state_slots: int) -> KVPool:
        """The core's block bookkeeping of this pool (its groups, their eviction policy, the state slots)."""
        policy_name = config.eviction_policy
        self.plugins.eviction_policy(policy_name, num_blocks)  # fail now on an unknown policy name
        return KVPool(
            num_blocks,
            block_size,
            self.spec.kinds,
            eviction_policy=lambda: self.plugins.eviction_policy(policy_name, num_blocks),
            on_evict=self._on_evict,
            state_slots=state_slots,
            snapshot_interval=config.snapshot_interval or 1,
            resumes_chunks=self.state_spec.resumes_chunks,
        )

    def _sizing(self, model: Any, config: PoolConfig, block_size: int) -> tuple[int, StatePlan]:
        """Blocks per group, and the recurrent-state slots (what ``memory_budget`` leaves them, or given)."""
        per_block = self.spec.bytes_per_block(block_size, self._dtype)
        plan = plan_states(
            self.state_spec,
            model,
            state_slots=config.state_slots,
            memory_budget=config.memory_budget,
            kv_bytes_per_block=per_block,
            dtype=self._dtype,
        )
        return _block_count(config, plan.kv_budget, block_size, per_block), plan

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        """Blocks per KV group."""
        return self.kv.num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.kv.block_size

    @property
    def kv_layout(self) -> str:
        """``"slots"``, ``"heads"`` or ``"auto"`` as asked (see :data:`KV_LAYOUTS`); :meth:`layout_on` resolves
        ``"auto"`` for a device.

        Example:
            >>> from pagedcore.adapters.transformers.testing import tiny_llama_config
            >>> pool = PagedKVPool(tiny_llama_config(), num_blocks=4, kv_layout="auto")
            >>> pool.kv_layout, pool.layout_on(torch.device("cpu")), pool.layout_on(torch.device("cuda"))
            ('auto', 'heads', 'slots')
        """
        return self._kv_layout

    def layout_on(self, device: torch.device) -> str:
        """The layout of the tensors this pool creates on ``device``: ``"slots"`` or ``"heads"``."""
        if self._kv_layout != "auto":
            return self._kv_layout
        return "heads" if device.type == "cpu" else "slots"

    @property
    def pad_block(self) -> int:
        """The extra, always-zero block at the end of every layer tensor (for padded gathers)."""
        return self.kv.num_blocks

    @property
    def num_query_tokens(self) -> int:
        """Prompt tokens looked up in the prefix cache."""
        return self.kv.num_query_tokens

    @property
    def num_hit_tokens(self) -> int:
        """Prompt tokens served from the prefix cache."""
        return self.kv.num_hit_tokens

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit rate in tokens."""
        return self.kv.hit_rate

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the stored keys and values (of the tensors once created; else the one the pool was sized
        with)."""
        return self._dtype

    @property
    def has_all_tensors(self) -> bool:
        """Whether every layer with a KV cache (and every recurrent state) has its tensors."""
        states = self.states is None or self.states.complete()
        return states and all(t is not None or not layer.has_cache for t, layer in zip(self._layers, self.spec.layers))

    def create_tensors(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Create the missing layers' tensors on ``device`` in ``dtype`` now, before any forward (to load blocks
        from a store below the pool into them). False, creating nothing, for a model whose parameters span devices
        (each layer's tensors must be made where its keys are computed)."""
        owner = self._owner() if self._owner is not None else None
        if owner is not None and len({p.device for p in owner.parameters()}) > 1:
            return False
        with self.lock:
            for layer_idx, layer in enumerate(self.spec.layers):
                if self._layers[layer_idx] is None and layer.has_cache:
                    keys = torch.empty(0, layer.num_kv_heads, layer.head_dim, dtype=dtype, device=device)
                    values = torch.empty(0, layer.num_kv_heads, layer.v_head_dim, dtype=dtype, device=device)
                    self._layers[layer_idx] = self._create(layer_idx, keys, values)
            if self.states is not None:
                source = owner if owner is not None else self._config
                return self.states.create(device, lambda: probe_states(source, self.state_spec, dtype))
        return True

    @property
    def tiers(self) -> KVTiers | None:
        """The stores below the pool (``kv_store=``), or None."""
        return self._tiers

    def tier_stats(self) -> TierStats | None:
        """What the stores below the pool did (:class:`~pagedcore.kv_tiers.TierStats`), or None without them."""
        return None if self._tiers is None else self._tiers.stats()

    def save_kv_store(self, timeout: float | None = 60.0) -> bool:
        """Write every cached block to the stores below the pool now and wait (a clean shutdown: the Engine's
        :meth:`~pagedcore.adapters.transformers.Engine.close` does it), so that a restart finds them. True when
        all was written (or there are no stores).

        Example:
            >>> import tempfile, torch
            >>> from pagedcore.adapters.transformers.testing import tiny_llama
            >>> from pagedcore.adapters.transformers import enable
            >>> model = tiny_llama()
            >>> pool = enable(model, num_blocks=16, block_size=4, kv_store=tempfile.mkdtemp(), kv_store_bytes="1MiB")
            >>> _ = model.generate(torch.arange(1, 10)[None], max_new_tokens=1, do_sample=False)
            >>> pool.save_kv_store(), pool.tier_stats().blocks_written
            (True, 2)
        """
        if self._tiers is None:
            return True
        with self.lock:
            self.check_weights()
            queued = self._tiers.save(self.kv, timeout=0)
        return queued or self._tiers.flush(timeout)

    def close_tiers(self) -> None:
        """Write what the tiers' writer has queued, stop it, and close the stores this pool made from a location (a
        store object given as ``kv_store`` is its caller's, left open): nothing is written down or loaded from here
        on. The holder that made the pool calls it when it closes, or when its build fails after making the pool."""
        if self._tiers is not None:
            self._tiers.close()
        close_stores(self._made_stores)

    @contextlib.contextmanager
    def closed_on_failure(self, made: bool) -> Iterator[None]:
        """``with pool.closed_on_failure(made):`` around the rest of a holder's build: an exception closes the tiers of
        a pool the holder ``made`` (:meth:`close_tiers`: no store's folder stays open behind it) and goes on."""
        try:
            yield
        except BaseException:
            if made:
                self.close_tiers()
            raise

    def group_of(self, layer_idx: int) -> int:
        """The KV group a layer stores into (raises for layers without a cache of their own)."""
        group = self.spec.layer_groups[layer_idx]
        if group is None:
            raise ConfigError(f"layer {layer_idx} has no KV cache of its own")
        return group

    def read_group(self, layer_idx: int) -> int:
        """The KV group whose blocks a layer attends over: its own, or its KV source's (a KV-shared layer)."""
        group = self.spec.read_group(layer_idx)
        if group is None:
            raise ConfigError(f"layer {layer_idx} attends over no cached keys and values")
        return group

    def layer_tensors(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A layer's ``(keys, values)`` pool, each ``(num_blocks + 1, block_size, kv_heads, head_dim)``, or None
        before the layer stored anything. In the ``"heads"`` layout they are permuted views (not contiguous): index
        them, ``view`` the first two dimensions together, but do not assume a contiguous tensor. An MLA layer's
        are the latent and the rotary key, two views of one tensor (:meth:`attention_tensors`)."""
        return self._layers[layer_idx]

    def attention_tensors(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What a layer's paged attention reads as ``(key_cache, value_cache)``: its KV source's tensors (a KV-shared
        layer), and for an MLA layer the whole latent row ``(..., 1, kv_lora_rank + rope_dim)`` as keys and its
        first ``kv_lora_rank`` values as values (a view: attention in the latent space). None before they exist."""
        source = self.spec.source(layer_idx)
        if source is None:
            return None
        latent = self._latents.get(source)
        if latent is not None:
            rank = self.spec.layers[source].head_dim
            return latent, latent[..., :rank]
        return self._layers[source]

    def attention_backend(self, device: torch.device, dtype: torch.dtype, name: str | None = None) -> AttentionBackend:
        """The attention backend the plugins choose for a device type and dtype (looked up once, then cached)."""
        key = (device.type, dtype, name)
        backend = self._backends.get(key)
        if backend is None:
            backend = self._backends[key] = self.plugins.attention_backend(device.type, dtype, name)
        return backend

    def used_bytes(self) -> int:
        """KV bytes of the blocks held now (whole blocks): ``memory_stats().used_bytes``, without the rest."""
        per_group = self._group_block_bytes()
        return sum(per_group[g.index] * g.block_manager.num_used_blocks for g in self.kv.groups)

    def memory_stats(self) -> MemoryStats:
        """KV memory: capacity, what is allocated and taken, used by holders and kept by the prefix cache."""
        per_group = self._group_block_bytes()
        used = self.used_bytes()
        cached = sum(per_group[g.index] * g.block_manager.num_evictable_blocks for g in self.kv.groups)
        allocated = reserved = 0
        for layer_idx, tensors in enumerate(self._layers):
            if tensors is None:
                continue
            size = sum(t.numel() * t.element_size() for t in tensors)
            allocated += size
            if tensors[0].device.type != "cpu":
                reserved += size
                continue
            touched = self.kv.groups[self.group_of(layer_idx)].block_manager.num_touched_blocks
            reserved += size * touched // (self.num_blocks + 1)  # rows of blocks written so far (+ the pad block)
        return MemoryStats(
            capacity_bytes=self.spec.bytes_per_block(self.block_size, self._dtype) * self.num_blocks,
            bytes_per_token=self.spec.bytes_per_token(self._dtype),
            expanded_bytes_per_token=self.spec.expanded_bytes_per_token(self._dtype),
            allocated_bytes=allocated,
            used_bytes=used,
            cached_bytes=cached,
            used_blocks=self.kv.num_used_blocks,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            store_bytes={} if self._tiers is None else {n: s["bytes"] for n, s in self._tiers.stats().stores.items()},
            reserved_bytes=reserved,
            **state_stats(self.kv.states, self.states),
        )

    def block_bytes(self, group: int) -> int:
        """Bytes one block of ``group`` costs over that group's layers."""
        return self._group_block_bytes()[group]

    # ------------------------------------------------------------------ commands
    def bind(self, model: Any) -> None:
        """Check that ``model`` may use this pool, and tie the pool to it.

        A pool holds keys and values computed by one model: its prefix cache must never serve them to another
        (even one with the same shapes). A pool built from a config is tied to the first model that uses it.
        Raises :class:`PoolMismatchError` for another model's pool.
        """
        ModelKVSpec.from_model(model).check_compatible(self.spec)
        if not isinstance(model, torch.nn.Module):
            return  # a config: nothing computed with it yet
        with self.lock:
            owner = self._owner() if self._owner is not None else None
            if owner is model:
                return
            if owner is not None:
                raise PoolMismatchError(
                    f"this pool holds keys and values computed by another {type(owner).__name__} instance; its prefix "
                    "cache would serve them to this model. Give each model its own pool."
                )
            if self._owner is not None:  # its model was garbage collected: what it cached means nothing now
                self.kv.reset_prefix_cache()
            self._owner = weakref.ref(model)
            self._weights = None

    def layer_kv(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's pool tensors, created on the device and dtype of ``keys`` at the first call.

        ``keys``/``values`` are ``(..., kv_heads, head_dim)`` in their last two dimensions.
        """
        tensors = self._layers[layer_idx]
        if tensors is None and torch.compiler.is_compiling():
            # Traced by torch.compile (the first forward of a compiled model): the lock cannot be traced, and the
            # store happens when the compiled forward returns, in this thread.
            tensors = self._layers[layer_idx] = self._create(layer_idx, keys, values)
        elif tensors is None:
            with self.lock:
                tensors = self._layers[layer_idx]
                if tensors is None:
                    tensors = self._create(layer_idx, keys, values)
                    self._layers[layer_idx] = tensors
        k, v = tensors
        if keys.dtype != k.dtype or keys.device != k.device:
            raise PoolMismatchError(
                f"layer {layer_idx} now produces {keys.dtype} keys on {keys.device} but this pool stores {k.dtype} "
                f"keys on {k.device}: the model was converted (.to(), .half()) after the pool stored keys and values, "
                "which belong to the model as it was. Release every cache that uses this pool, then call "
                "pool.rebuild() (drops the stored keys and values and the cached prefixes), or use a new pool. "
                "enable()d generate, an Engine step and a new cache on this pool do this by themselves once no "
                "cache holds blocks."
            )
        if keys.shape[-2:] != k.shape[-2:] or values.shape[-2:] != v.shape[-2:]:
            raise PoolMismatchError(
                f"layer {layer_idx} stores keys {tuple(keys.shape[-2:])} / values {tuple(values.shape[-2:])} "
                f"(kv_heads, head_dim) but the pool holds {tuple(k.shape[-2:])} / {tuple(v.shape[-2:])}: "
                "the pool was built for another model or config"
            )
        return k, v

    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Perform copy-on-write copies ``(group, source, destination)`` in every layer of each group."""
        if not copies:
            return
        for layer_idx, tensors in enumerate(self._layers):
            if tensors is None:
                continue
            group = self.spec.layer_groups[layer_idx]
            pairs = [(src, dst) for g, src, dst in copies if g == group]
            if not pairs:
                continue
            device = tensors[0].device
            src = to_device(torch.tensor([p[0] for p in pairs]), device)  # pinned, non-blocking
            dst = to_device(torch.tensor([p[1] for p in pairs]), device)
            for t in tensors:
                t.index_copy_(0, dst, t.index_select(0, src))

    def rebuild(self) -> int:
        """Drop every layer's keys and values and the whole prefix cache; the tensors are created again, on the
        device and dtype of the next keys stored. For a model converted to another dtype or device (its old keys
        and values mean nothing to it now). Returns the cached blocks forgotten.

        Raises :class:`~pagedcore.errors.InvalidBlockError`, changing nothing, while any cache or request holds
        blocks: release them first (their contents would be lost).

        Example:
            >>> from pagedcore.adapters.transformers.testing import tiny_llama_config
            >>> pool = PagedKVPool(tiny_llama_config(), num_blocks=8)
            >>> pool.rebuild(), pool.memory_stats().allocated_bytes
            (0, 0)
        """
        with self.lock:
            held = self.kv.num_used_blocks
            if held:
                raise InvalidBlockError(
                    f"rebuild: {held} blocks are held by caches or requests; release them first (cache.release(), "
                    "or drop the caches returned by generate)"
                )
            forgotten = self.kv.clear_prefix_cache()
            self._layers = [None] * self.spec.num_layers
            self._latents.clear()
            if self.states is not None:
                self.states.drop()
            self._backends.clear()
            self._stale_tensors = False
            return forgotten

    def sleep(self) -> int:
        """Give the layer tensors' memory back now, e.g. to a training step between two rollouts (vLLM's sleep mode):
        the tensors are dropped and the cached prefixes with them (their keys and values are gone; in a training
        loop the next optimizer step would make them stale anyway; a pool with a ``kv_store`` can
        :meth:`save_kv_store` first). The next write re-creates the tensors where they were (or :meth:`wake` does it
        now). Returns the bytes released.

        Raises :class:`~pagedcore.errors.InvalidBlockError`, changing nothing, while a cache or request holds blocks:
        their keys and values live in these tensors.

        Example:
            >>> import torch
            >>> from pagedcore.adapters.transformers.testing import tiny_llama
            >>> from pagedcore.adapters.transformers import enable
            >>> model = tiny_llama()
            >>> pool = enable(model, num_blocks=16, block_size=4)
            >>> _ = model.generate(torch.arange(1, 10)[None], max_new_tokens=1, do_sample=False)
            >>> pool.sleep(), pool.is_sleeping, pool.kv.num_cached_blocks, pool.memory_stats().allocated_bytes
            (34816, True, 0, 0)
            >>> pool.wake(), pool.is_sleeping                     # or the next generate call re-creates them
            (34816, False)
        """
        with self.lock:
            held = self.kv.num_used_blocks
            if held:
                raise InvalidBlockError(
                    f"sleep: {held} blocks are held by caches or requests and their keys and values live in the "
                    "pool's tensors; release them first (cache.release(), or let the Engine's requests finish)"
                )
            placement = self._placement()
            if placement is None:
                return 0
            stats = self.memory_stats()
            released = stats.allocated_bytes + stats.state_capacity_bytes
            self._slept = placement
            self.kv.reset_prefix_cache()
            self._layers = [None] * self.spec.num_layers
            self._latents.clear()
            if self.states is not None:
                self.states.drop()
            self._stale_tensors = False
            return released

    def _placement(self) -> tuple[torch.device, torch.dtype] | None:
        """Where the pool's tensors are (device, dtype), or None before any."""
        first = next((t for t in self._layers if t is not None), None)
        if first is not None:
            return first[0].device, first[0].dtype
        found = self.states.placement() if self.states is not None else None
        return None if found is None else (found[1], found[0])

    def wake(self) -> int:
        """Re-create the tensors :meth:`sleep` released, now, where they were (else the next write does it, layer by
        layer). Returns the bytes allocated (0: not asleep)."""
        with self.lock:
            placement = self._slept
            if placement is None or self.has_tensors:
                return 0
            self.create_tensors(*placement)
            return self.memory_stats().allocated_bytes

    @property
    def is_sleeping(self) -> bool:
        """Whether :meth:`sleep` released the tensors and nothing re-created them since."""
        return self._slept is not None and not self.has_tensors

    @property
    def has_tensors(self) -> bool:
        """Whether any layer's keys and values (or recurrent states) were stored since the pool was created or
        rebuilt."""
        states = self.states is not None and self.states.placement() is not None
        return states or any(t is not None for t in self._layers)

    def clear_prefix_cache(self, *namespaces: Hashable) -> int:
        """Forget cached prefixes (of the given namespaces, or all). Returns blocks forgotten."""
        with self.lock:
            return self.kv.clear_prefix_cache(*namespaces)

    # ------------------------------------------------------------------ the model's weights
    @property
    def model(self) -> Any:
        """The model the pool is tied to (:meth:`bind`), or None (only a config so far, or it was collected)."""
        return self._owner() if self._owner is not None else None

    @property
    def weights(self) -> WeightsWatch | None:
        """The watch over the weights of the model this pool serves (:mod:`.weights`): None before the first
        :meth:`check_weights`, and for a pool that was never given a model (only a config)."""
        return self._weights

    @property
    def weights_version(self) -> int:
        """Updates of the model's weights the pool has seen (as of its last :meth:`check_weights`, which every
        ``generate`` call and Engine step runs first): each optimizer step over its parameters counts one, also when
        several ran between two checks; any other change (``load_state_dict``, a replaced parameter, an adapter
        switched, ``train()`` / ``eval()``) counts one per check that saw it. 0 until the first check; equal versions
        of one pool mean the same weights. Engine outputs carry the version they were computed with
        (:attr:`RequestOutput.weights_version <pagedcore.adapters.transformers.RequestOutput.weights_version>`)."""
        watch = self._weights
        return 0 if watch is None else watch.epoch

    @property
    def stale_placement(self) -> Placement:
        """``(dtype, device)`` of the stored tensors while the model now computes in another (it was converted and
        blocks are still held, so the pool cannot rebuild yet); None otherwise."""
        if not self._stale_tensors:
            return None
        first = next((t for t in self._layers if t is not None), None)
        if first is None:  # a model without attention layers: its states' placement
            return None if self.states is None else self.states.placement()
        return (first[0].dtype, first[0].device)

    def check_weights(self, *, settings: bool = True) -> int:
        """Notice a change of the model's weights since the last check, and forget what was computed before it.

        When the fingerprint moved (an optimizer step, ``load_state_dict``, a replaced parameter, a PEFT adapter
        loaded, switched, merged or disabled, ``model.train()``: see :mod:`.weights`), every cached prefix is
        forgotten (:meth:`~pagedcore.kv_pool.KVPool.reset_prefix_cache`): no later prompt is served keys and values
        of the old weights. Blocks held by caches and running requests stay theirs: they finish on the keys and
        values they computed (as a ``DynamicCache`` kept across the update would), and are never cached
        afterwards. After a conversion to another dtype or device the tensors are rebuilt as soon as no block is
        held. Returns the cached blocks forgotten. Never raises; tens of microseconds. ``settings``: each module's
        settings too (a norm's ``variance_epsilon``, an attention's ``scaling``, a ``forward`` set on the instance:
        :meth:`.weights.WeightsWatch.check`); the Engine leaves them out of steps that admit no request.

        ``enable()``d ``generate`` runs it at every call, the Engine at every step, a :class:`PagedCache` on a
        shared pool when it is made and before it registers blocks.

        Example:
            >>> import torch
            >>> from pagedcore.adapters.transformers.testing import tiny_llama
            >>> from pagedcore.adapters.transformers import enable
            >>> model = tiny_llama()
            >>> pool = enable(model, num_blocks=16, block_size=4)
            >>> _ = model.generate(torch.arange(1, 10)[None], max_new_tokens=1, do_sample=False)
            >>> pool.check_weights(), pool.kv.num_cached_blocks     # unchanged: the prefixes stay (9 positions)
            (0, 3)
            >>> with torch.no_grad():
            ...     _ = model.lm_head.weight.mul_(0.5)
            >>> pool.check_weights(), pool.kv.num_cached_blocks     # the next generate call would do this
            (3, 0)
        """
        with self.lock:
            watch = self._weights
            if watch is None:
                owner = self._owner() if self._owner is not None else None
                if owner is not None:
                    # the baseline: what is stored was computed with these
                    self._weights = WeightsWatch(owner, adapters_apart=self._adapters_apart)
                return 0
            placement = watch.placement
            forgotten = 0
            if watch.check(settings=settings):
                if watch.placement != placement and self.has_tensors:
                    # Converted: keys of the new dtype or device cannot enter these tensors (layer_kv raises), so
                    # nothing is served or cached from them until the rebuild drops them with the prefixes.
                    self._stale_tensors = True
                else:
                    forgotten = self.kv.reset_prefix_cache()
            if self._stale_tensors and not self.kv.num_used_blocks:
                forgotten += self.rebuild()
            return forgotten

    def watch_adapters_apart(self) -> None:
        """From now on the model's PEFT adapters are served per request, each in its own prefix-cache namespace (an
        Engine's LoRA adapters, :mod:`.lora`): the weights watch covers the base model only, so loading, switching or
        deleting an adapter forgets no prefix, while any change of the base weights still forgets them all
        (:class:`~.weights.WeightsWatch`'s ``adapters_apart``). What changed before this call is checked first.

        Example:
            >>> from pagedcore.adapters.transformers.testing import tiny_llama
            >>> model = tiny_llama()
            >>> pool = PagedKVPool.resolve(model, None, PoolConfig(num_blocks=8))
            >>> pool.watch_adapters_apart(); pool.check_weights(), pool.weights.adapters_apart
            (0, True)
        """
        with self.lock:
            self.check_weights()
            self._adapters_apart = True
            owner = self.model
            if owner is not None and (self._weights is None or not self._weights.adapters_apart):
                self._weights = WeightsWatch(owner, adapters_apart=True)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix now (vLLM's name): for changes the weights fingerprint cannot see (writes
        through ``.data``, forward hooks; see :mod:`.weights`). Blocks held by caches and running requests stay
        theirs and are never cached afterwards. Returns the cached blocks forgotten.

        Example:
            >>> import torch
            >>> from pagedcore.adapters.transformers.testing import tiny_llama
            >>> from pagedcore.adapters.transformers import enable
            >>> model = tiny_llama()
            >>> pool = enable(model, num_blocks=16, block_size=4)
            >>> _ = model.generate(torch.arange(1, 10)[None], max_new_tokens=1, do_sample=False)
            >>> _ = model.lm_head.weight.data.mul_(0.5)         # through .data: no version counter sees it
            >>> pool.reset_prefix_cache(), pool.kv.num_cached_blocks
            (3, 0)
        """
        with self.lock:
            return self.check_weights() + self.kv.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` on inconsistent bookkeeping (tests, debugging)."""
        with self.lock:
            self.kv.check_invariants()

    def __repr__(self) -> str:
        stats = self.memory_stats()
        return (
            f"PagedKVPool({self.spec.model_type}, num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"groups={len(self.kv.groups)}, used_blocks={stats.used_blocks}, "
            f"cached_blocks={self.kv.num_cached_blocks})"
        )

    # ------------------------------------------------------------------ internals
    def _create(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.spec.layers[layer_idx]
        if not layer.has_cache:
            raise PoolMismatchError(f"layer {layer_idx} ({layer.layer_type}) has no KV cache of its own")
        expected = (layer.num_kv_heads, layer.head_dim)
        if tuple(keys.shape[-2:]) != expected or values.shape[-1] != layer.v_head_dim:
            raise PoolMismatchError(
                f"layer {layer_idx} produces keys with (kv_heads, head_dim) = {tuple(keys.shape[-2:])} but the "
                f"pool was sized for {expected} from the config of {self.spec.model_type!r}"
            )
        shape = (self.num_blocks + 1, self.block_size)  # + the zero pad block
        heads_first = self.layout_on(keys.device) == "heads"
        # Never inference tensors, even when the first write happens under torch.inference_mode(): the pool
        # outlives that forward and is updated in place outside it (copy-on-write copies).
        with torch.inference_mode(False):
            if layer.latent is not None:  # the latent and the rotary key side by side: one row per token
                latent = torch.zeros(*shape, 1, layer.latent.width, dtype=keys.dtype, device=keys.device)
                self._latents[layer_idx] = latent
                k, v = latent[..., : layer.head_dim], latent[..., layer.head_dim :]
            else:
                k, v = (layer_tensor(shape, like.shape[-2:], like, heads_first) for like in (keys, values))
        self._dtype = keys.dtype  # what the memory statistics count from now on
        return k, v

    def _group_block_bytes(self) -> list[int]:
        item = self._dtype.itemsize  # not torch.empty(()).element_size(): a tensor per call, read every step
        out = [0] * len(self.kv.groups)
        for layer, group in zip(self.spec.layers, self.spec.layer_groups):
            if group is not None:
                out[group] += self.block_size * layer.token_elements * item
        return out

    def _on_evict(self, group: int, block_ids: list[int]) -> None:
        self.plugins.emit("pagedcore_blocks_evicted", group=group, block_ids=block_ids)


def _block_count(config: PoolConfig, memory_budget: int | None, block_size: int, per_block: int) -> int:
    """The pool's blocks per group: ``num_blocks``, or what ``memory_budget`` (the KV blocks' share of the pool's
    budget) holds, or the default's."""
    if config.num_blocks is not None:
        return config.num_blocks
    if memory_budget is None or per_block == 0:  # no budget, or no attention layer: the blocks index tokens only
        return -(-_DEFAULT_TOKENS // block_size)
    count = memory_budget // per_block
    if count < 1:
        raise ConfigError(
            f"memory budget {memory_budget} bytes holds no block: one block of {block_size} tokens costs "
            f"{per_block} bytes over all layers",
            param="memory_budget",
        )
    return count


def _model_dtype(model: Any) -> torch.dtype:
    """The dtype a pool for ``model`` stores keys and values in: the model's (or its config's), else fp32."""
    dtype = getattr(model, "dtype", None) or getattr(text_config(model), "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype
