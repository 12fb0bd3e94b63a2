"""The pool's settings, validated once (:class:`PoolConfig`), and the one parser of sizes (:func:`parse_size`).

Every holder that builds a pool takes a :class:`PoolConfig` (``PagedKVPool``, ``PagedCache``, ``enable()``, the
``Engine`` through its :class:`~pagedcore.engine.config.EngineConfig`, ``pagedcore serve``'s flags); their keyword
arguments (``num_blocks=``, ``memory_budget=``, ...) are a convenience that builds one. The rules of the settings
live here and nowhere else: which go together (``kv_store`` and its budget), which exclude each other
(``num_blocks`` and ``memory_budget``), what a size is. Plain Python, no torch.

Example:
    >>> PoolConfig(memory_budget="2GiB", block_size=16).memory_budget
    2147483648
    >>> PoolConfig(num_blocks=64, memory_budget="1GiB")
    Traceback (most recent call last):
    ...
    pagedcore.errors.ConfigError: give num_blocks or memory_budget, not both
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from pagedcore.errors import ConfigError
from pagedcore.kv_store import KVStore
from pagedcore.validation import integer

__all__ = ["KV_LAYOUTS", "KVStoreSpec", "PoolConfig", "parse_size", "split_kwargs"]

KVStoreSpec = str | os.PathLike[str] | KVStore | Sequence[str | os.PathLike[str] | KVStore]
"""What ``kv_store=`` takes: a directory, ``"memory://"``, a plugin's location, a :class:`~pagedcore.kv_store.KVStore`,
or a sequence of them (fastest first)."""

KV_LAYOUTS = ("slots", "heads", "auto")
"""How a pool's tensors lie in memory (the adapter's :data:`~pagedcore.adapters.transformers.pool.KV_LAYOUTS` says
what each means); None in a :class:`PoolConfig`: the holder's default."""

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_size(value: object, *, name: str = "size") -> int:
    """A size in bytes: an integer or float (``1_000_000``), or a number with a unit (``"2GiB"``, ``"512 MB"``,
    ``"1.5k"``: B, K/KB, M/MB, G/GB, T/TB in powers of ten, KiB .. TiB in powers of two). Raises
    :class:`~pagedcore.errors.ConfigError` naming ``name`` for anything else (a bool, a negative number, text).

    Example:
        >>> parse_size("1.5 GiB"), parse_size("8MiB"), parse_size("1.5 kb"), parse_size(4096)
        (1610612736, 8388608, 1500, 4096)
        >>> parse_size("lots", name="--kv-store-bytes")
        Traceback (most recent call last):
        ...
        pagedcore.errors.ConfigError: --kv-store-bytes must be a size like 8MiB, 2GiB or 1000000, got 'lots'
    """
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str) and (match := _SIZE.fullmatch(value)) and match.group(2).lower() in _UNITS:
        number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if number is None or not 0 <= number < float("inf"):
        raise ConfigError(f"{name} must be a size like 8MiB, 2GiB or 1000000, got {value!r}", param=name)
    return int(number)


@dataclass(frozen=True)
class PoolConfig:
    """The settings of a new KV pool.

    Args:
        num_blocks: blocks per KV group. Give this or ``memory_budget`` (neither: the pool holds 32,768 tokens).
        memory_budget: bytes for all layers' keys and values together (a size: ``"2GiB"``, ``512_000_000``);
            stored in bytes.
        block_size: tokens per block (None: the default of the model's device, 16 on CPU, 64 on CUDA).
        eviction_policy: name of the eviction policy plugin (None: ``"lru"``).
        kv_layout: how the tensors lie in memory (:data:`KV_LAYOUTS`; None: the holder's default, ``"slots"`` for
            a pool and an Engine, ``"auto"`` for a ``PagedCache``'s own pool).
        kv_store: tiers below the pool (:data:`KVStoreSpec`; :mod:`pagedcore.kv_tiers`).
        kv_store_bytes: the budget of each store given by location (a size); required with them, and only with
            ``kv_store``.
        state_slots: for a model with recurrent-state layers (Qwen3.5, Mamba-2...), its state slots: live
            sequences' states and snapshots together (None: half of ``memory_budget``, all of it in a model without
            attention layers, else the adapter's default). Ignored by models without such layers.
        snapshot_interval: such a model's prompts keep a snapshot of their state every this many blocks (each costs
            a slot), so that later prompts sharing a prefix resume there (None: every block).

    Example:
        >>> PoolConfig(kv_store="/tmp/kv")
        Traceback (most recent call last):
        ...
        pagedcore.errors.ConfigError: kv_store='/tmp/kv' needs kv_store_bytes= (its budget, e.g. '20GiB')
        >>> PoolConfig().is_default, PoolConfig(num_blocks=8).is_default
        (True, False)
    """

    num_blocks: int | None = None
    memory_budget: int | None = None
    block_size: int | None = None
    eviction_policy: str | None = None
    kv_layout: str | None = None
    kv_store: KVStoreSpec | None = None
    kv_store_bytes: int | None = None
    state_slots: int | None = None
    snapshot_interval: int | None = None

    def __post_init__(self) -> None:
        fix = object.__setattr__  # frozen: normalized once, here
        if self.num_blocks is not None and self.memory_budget is not None:
            raise ConfigError("give num_blocks or memory_budget, not both", param="num_blocks")
        for name in ("num_blocks", "block_size", "state_slots", "snapshot_interval"):
            value = getattr(self, name)
            if value is not None:
                fix(self, name, integer(name, value, minimum=1, error=ConfigError, expected="a positive integer"))
        for name in ("memory_budget", "kv_store_bytes"):
            if getattr(self, name) is not None:
                fix(self, name, parse_size(getattr(self, name), name=name))
        if self.eviction_policy is not None and not isinstance(self.eviction_policy, str):
            raise ConfigError(
                f"eviction_policy must be a plugin's name, got {self.eviction_policy!r}", param="eviction_policy"
            )
        if self.kv_layout is not None and self.kv_layout not in KV_LAYOUTS:
            options = ", ".join(map(repr, KV_LAYOUTS))
            raise ConfigError(f"kv_layout must be one of {options}, got {self.kv_layout!r}", param="kv_layout")
        self._check_stores()

    def _check_stores(self) -> None:
        """``kv_store`` and ``kv_store_bytes`` go together: a store given by location needs its budget."""
        if self.kv_store is None:
            if self.kv_store_bytes is not None:
                raise ConfigError(
                    "kv_store_bytes sizes the stores below the pool: give kv_store= too", param="kv_store_bytes"
                )
            return
        for item in self.store_items:
            if isinstance(item, (str, os.PathLike)) and self.kv_store_bytes is None:
                raise ConfigError(
                    f"kv_store={os.fspath(item)!r} needs kv_store_bytes= (its budget, e.g. '20GiB')", param="kv_store"
                )

    @property
    def store_items(self) -> list[str | os.PathLike[str] | KVStore]:
        """The stores ``kv_store`` names, fastest first (empty without stores).

        Example:
            >>> PoolConfig(kv_store=["memory://", "/tmp/kv"], kv_store_bytes="1GiB").store_items
            ['memory://', '/tmp/kv']
        """
        spec = self.kv_store
        if spec is None:
            return []
        return [spec] if isinstance(spec, (str, os.PathLike, KVStore)) else list(spec)

    @property
    def is_default(self) -> bool:
        """Whether no setting was given (what a holder handed an existing pool must have)."""
        return self == PoolConfig()

    @classmethod
    def of(cls, config: PoolConfig | None = None, **kwargs: Any) -> PoolConfig:
        """``config``, or the config the keyword arguments (its fields; None: not given) describe; both only when
        every keyword argument is None.

        Example:
            >>> PoolConfig.of(num_blocks=16, block_size=None).num_blocks
            16
            >>> PoolConfig.of(PoolConfig(num_blocks=8), num_blocks=16)
            Traceback (most recent call last):
            ...
            pagedcore.errors.ConfigError: give config= or the keyword arguments num_blocks, not both
        """
        given = {name: value for name, value in kwargs.items() if value is not None}
        unknown = sorted(set(given) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"not a pool setting: {', '.join(unknown)}")
        if config is None:
            return cls(**given)
        if not isinstance(config, cls):
            raise ConfigError(f"config must be a {cls.__name__}, got {type(config).__name__}")
        if given:
            raise ConfigError(f"give config= or the keyword arguments {', '.join(sorted(given))}, not both")
        return config

    def with_defaults(self, **defaults: Any) -> PoolConfig:
        """This config with ``defaults`` for the settings it leaves None (e.g. a holder's ``kv_layout``).

        Example:
            >>> PoolConfig().with_defaults(kv_layout="auto").kv_layout
            'auto'
        """
        missing = {name: value for name, value in defaults.items() if getattr(self, name) is None}
        return replace(self, **missing) if missing else self


def split_kwargs(kwargs: Mapping[str, Any], *groups: type[Any]) -> list[dict[str, Any]]:
    """``kwargs`` split by which dataclass of ``groups`` has a field of that name (the first one that does);
    a last dict holds the rest.

    Example:
        >>> split_kwargs({"num_blocks": 8, "colour": "red"}, PoolConfig)
        [{'num_blocks': 8}, {'colour': 'red'}]
    """
    parts: list[dict[str, Any]] = [{} for _ in range(len(groups) + 1)]
    names = [{f.name for f in fields(group)} for group in groups]
    for key, value in kwargs.items():
        index = next((i for i, known in enumerate(names) if key in known), len(groups))
        parts[index][key] = value
    return parts
