"""LoRA adapters of a transformers model, served per request: the runner's :class:`~pagedcore.engine.lora.AdapterSet`.

:class:`LoraAdapters` owns the adapters an Engine serves: each loaded adapter's files in host memory
(:mod:`.lora_files`: read and checked when loaded), which of them are in the model (at most ``max_loras``; PEFT
injects them, ``PeftModel.add_adapter`` and ``set_peft_model_state_dict``, under internal names), their versions and
the requests using each version, and the forward that applies each token's adapter.

**One forward, many adapters.** The Engine packs every scheduled token of every sequence into one row, so PEFT's
mixed-batch inference (``adapter_names``, one per batch row) cannot tell the rows' adapters apart. The adapters are
injected with PEFT and kept disabled (a plain forward of the model is the base model's, for every other user of it);
a forward hook on each LoRA layer adds, for each adapter of the step, ``lora_B(lora_A(x[rows])) * scaling`` to the
rows of that adapter's tokens (index tensors built once per step; the output layer's rows are the logits rows kept).
The arithmetic is PEFT's for a batch of one adapter, ``(result + delta).to(result.dtype)``, so each row computes what
``PeftModel.generate`` computes with that adapter alone. ``scripts/lora_mixed.py`` measures mixed batches against one
adapter at a time (docs/benchmarks.md).

**Weights and caches.** The pool's weights watch is told to leave adapters apart (``PagedKVPool.watch_adapters_apart``):
injecting, evicting or deleting adapters is no change of the base model, so the base model's and other adapters'
prefixes stay. Each adapter in the model has its own small watch (its tensors' version counters and data pointers,
its scaling): when its weights change in place, it gets a new version and the pool closes the old version's scope
(:meth:`KVPool.close_scope <pagedcore.kv_pool.KVPool.close_scope>`): exactly its prefixes are forgotten, and requests
still carrying the old version neither read nor file prefixes under it.

**When the model changes.** Registration (:meth:`LoraAdapters.load`, :meth:`LoraAdapters.unload`) may come from
any thread and never touches the model; the model changes only at the start of a step, under the Engine's lock, when
no forward runs: :meth:`LoraAdapters.schedule` with ``load=True`` (an adapter enters the model, the least recently
used one no scheduled request uses leaving to make room) and :meth:`LoraAdapters.maintain` (unloaded or replaced
versions no request uses leave; changed weights are noticed).
"""

from __future__ import annotations

import copy
import functools
import itertools
import threading
import warnings
import weakref
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pagedcore.block_keys import AdapterNamespace
from pagedcore.engine.lora import AdapterInfo, LoRAConfig
from pagedcore.errors import AdapterError, AdapterNotFoundError, ConfigError
from pagedcore.scheduler import ScheduledSequence

from .hook_ids import transparent_hook
from .lora_files import AdapterFiles, adapter_digest, read_adapter
from .pool import PagedKVPool

__all__ = ["LoraAdapters", "LoraStep"]

_SERVED: weakref.WeakKeyDictionary[torch.nn.Module, LoraAdapters] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class LoraStep:
    """Which packed rows each adapter in the model applies to in one forward.

    Attributes:
        tokens: internal adapter name -> the packed token indices of its sequences (on the model's device).
        logits: the same for the rows the output layer computes (the logits rows kept).
        num_tokens: tokens in the step (a group covering all of them needs no gather).

    Example:
        >>> LoraStep({}, {}, 0).tokens
        {}
    """

    tokens: dict[str, torch.Tensor]
    logits: dict[str, torch.Tensor]
    num_tokens: int


@dataclass(eq=False)
class _Adapter:
    """One version of one adapter: its files, where it is, who uses it."""

    name: str
    files: AdapterFiles
    version: str
    labels: set[str] = field(default_factory=set)  # versions requests carry (older ones after in-place changes)
    internal: str | None = None  # its name in the model while it is there
    users: int = 0  # unfinished requests of this version
    scheduled: int = 0  # of them, those in the scheduler (the adapter must stay in the model)
    retired: bool = False  # unloaded or replaced: goes once no request uses it
    used_at: int = 0
    watch: _Watch | None = None  # while it is in the model
    changed: bool = False  # its weights changed in place since they were read

    def info(self) -> AdapterInfo:
        return AdapterInfo(self.name, self.files.path, self.version, self.files.rank, self.internal is not None)


class LoraAdapters:
    """The adapters one Engine serves on one transformers model (see the module docstring).

    Args:
        model: the base model (PEFT's LoRA layers are injected into it, disabled; :meth:`close` takes them out).
        pool: the model's pool (its weights watch leaves adapters apart from now on).
        config: ``max_loras`` and ``max_lora_rank``.
        keeps_logits: the model's forward takes ``logits_to_keep`` (its output layer sees only the kept rows).

    Example:
        >>> import tempfile, torch
        >>> from peft import LoraConfig, get_peft_model
        >>> from pagedcore.adapters.transformers import Engine
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> folder = tempfile.mkdtemp()
        >>> config = LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)
        >>> with torch.random.fork_rng():                     # random weights, the global generator left as it was
        ...     get_peft_model(tiny_llama(), config).save_pretrained(folder)
        ...     base = tiny_llama()
        >>> with Engine(base, num_blocks=32, block_size=4, enable_lora=True) as engine:
        ...     info = engine.loras.load("sql", folder)
        ...     (out,) = engine.generate([[1, 2, 3]], {"max_new_tokens": 2}, lora="sql", use_tqdm=False)
        >>> info.rank, len(out.token_ids)
        (4, 2)
    """

    def __init__(self, model: Any, pool: PagedKVPool, config: LoRAConfig, *, keeps_logits: bool = True) -> None:
        if _SERVED.get(model) is not None:
            raise ConfigError("this model's LoRA adapters are served by another Engine already; close it first")
        carried = next((name for name, module in model.named_modules() if hasattr(module, "lora_A")), None)
        if carried is not None:  # the Engine disables every LoRA layer and takes them all out at close
            raise ConfigError(
                f"the model already carries PEFT LoRA layers ({carried}): enable_lora serves adapters from their "
                "saved folders on the base model; save yours (save_pretrained) and load it into the Engine, or "
                "merge_and_unload() it into the model first"
            )
        self.model = model
        self.pool = pool
        self._config = config
        self._keeps_logits = keeps_logits
        self._lock = threading.RLock()  # registration (any thread) against the Engine's calls
        self._by_name: dict[str, _Adapter] = {}  # the current version of each loaded name, in load order
        self._by_label: dict[tuple[str, str], _Adapter] = {}  # (name, version) -> the version it names
        self._resident: list[_Adapter] = []
        self._peft: Any = None  # the PeftModel wrapping the model, made at the first injection
        self._hooks: dict[torch.nn.Module, Any] = {}
        self._head = model.get_output_embeddings()
        self._local = threading.local()
        self._serials = itertools.count()
        pool.watch_adapters_apart()
        _SERVED[model] = self

    @property
    def config(self) -> LoRAConfig:
        """The settings."""
        return self._config

    # ------------------------------------------------------------------ registration (any thread)
    def load(self, name: str, path: str, *, replace: bool = False) -> AdapterInfo:
        """Read the adapter in folder ``path`` and serve it as ``name`` (it enters the model when a request needs
        it). ``replace``: a new version of a loaded ``name`` (vLLM's ``load_inplace``): requests already using the
        old one finish with it. Raises :class:`~pagedcore.errors.AdapterError` (name taken, files refused)."""
        if not isinstance(name, str) or not name or name != name.strip():
            raise AdapterError(f"an adapter's name is a non-empty string without surrounding spaces, got {name!r}")
        with self._lock:
            if name in self._by_name and not replace:
                raise AdapterError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        files = read_adapter(path, self.model, max_rank=self._config.max_lora_rank)  # slow: not under the lock
        with self._lock, self.pool.lock:
            old = self._by_name.get(name)
            if old is not None and not replace:
                raise AdapterError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
            entry = self._by_label.get((name, files.version))
            if entry is not None and entry.version != files.version:  # an older label of weights changed in place
                raise AdapterError(
                    f"adapter {name!r}: requests of these weights' earlier load are still running on weights changed "
                    "since; load it again when they finish"
                )
            if entry is None:
                entry = _Adapter(name, files, files.version, {files.version})
                self._by_label[(name, files.version)] = entry
            entry.retired = False
            if old is not None and old is not entry:
                self._retire(old)
            self._by_name.pop(name, None)
            self._by_name[name] = entry
            self.pool.kv.open_scope(_scope(name, files.version))  # its weights are this version (again)
            return entry.info()

    def unload(self, name: str) -> None:
        """Stop serving ``name``: new requests naming it are refused; those using it finish first, then it leaves
        the model. Raises :class:`~pagedcore.errors.AdapterNotFoundError` for a name not loaded."""
        with self._lock:
            entry = self._by_name.pop(name, None)
            if entry is None:
                raise AdapterNotFoundError(f"The lora adapter '{name}' cannot be found.", param="lora_name")
            self._retire(entry)

    def adapters(self) -> list[AdapterInfo]:
        """The adapters served, in load order."""
        with self._lock:
            return [entry.info() for entry in self._by_name.values()]

    # ------------------------------------------------------------------ the Engine's requests
    def narrow(self, namespace: Hashable, name: str) -> Hashable:
        """The namespace of a request for ``name``: its current version's."""
        with self._lock:
            entry = self._by_name.get(name)
            if entry is None:
                raise AdapterNotFoundError(f"no adapter {name!r} is loaded")
            return AdapterNamespace(namespace, name, entry.version)

    def use(self, namespace: Hashable) -> None:
        """A request of ``namespace`` was queued."""
        with self._lock:
            self._entry(namespace).users += 1

    def schedule(self, namespace: Hashable, *, load: bool) -> bool:
        """Whether a request of ``namespace`` may be scheduled now (see :class:`~pagedcore.engine.lora.AdapterSet`);
        with ``load`` (only at the start of a step) its adapter enters the model when there is room."""
        with self._lock:
            entry = self._entry(namespace)
            if entry.internal is None and not (load and self._make_room()):
                return False
            if entry.internal is None:
                self._inject(entry)
            entry.scheduled += 1
            entry.used_at = next(self._serials)
            return True

    def release(self, namespace: Hashable, *, scheduled: bool) -> None:
        """A request of ``namespace`` finished."""
        with self._lock:
            entry = self._entry(namespace)
            entry.users -= 1
            entry.scheduled -= scheduled
            if not entry.users:  # no request carries its older labels any more (nor, once retired, any label)
                keep = {entry.version} if not entry.retired or entry.internal is not None else set()
                self._drop_labels(entry, keep)

    # ------------------------------------------------------------------ the start of a step (no forward runs)
    def maintain(self) -> int:
        """Notice adapters whose weights changed in place (their old version's prefixes are forgotten), and take the
        retired versions no request uses out of the model. Returns the cached blocks forgotten."""
        forgotten = 0
        with self._lock:
            for entry in list(self._resident):
                if entry.retired and not entry.users:
                    self._evict(entry)
                    self._drop_labels(entry, set())
                elif entry.watch is not None and entry.watch.moved():
                    forgotten += self._changed(entry)
        return forgotten

    def step(
        self, scheduled: Sequence[ScheduledSequence], keep: Sequence[int], device: torch.device
    ) -> LoraStep | None:
        """Which rows each adapter applies to in this step's forward (under the lock); None when no row uses one."""
        owners: list[str | None] = []
        with self._lock:
            for item in scheduled:
                ns = item.sequence.namespace
                internal = None
                if type(ns) is AdapterNamespace:
                    internal = self._entry(ns).internal
                    if internal is None:
                        raise AdapterError(f"adapter {ns.adapter!r} is not in the model for a scheduled request")
                owners.extend([internal] * item.num_new_tokens)
        if not any(owners):
            return None
        rows = owners  # the output layer's rows: every token's, the kept ones', or the last one's (logits_to_keep=1)
        if self._keeps_logits:
            rows = [owners[i] for i in keep] if keep else owners[-1:]
        return LoraStep(_groups(owners, device), _groups(rows, device), len(owners))

    @contextmanager
    def applied(self, step: LoraStep | None) -> Iterator[None]:
        """The forward run inside applies ``step``'s adapters (this thread only: other users of the model, e.g.
        ``enable()``d ``generate`` calls, get the base model)."""
        self._local.step = step
        try:
            yield
        finally:
            self._local.step = None

    def close(self) -> None:
        """Take every adapter and hook out of the model: it is the base model again."""
        with self._lock:
            for handle in self._hooks.values():
                handle.remove()
            self._hooks.clear()
            if self._peft is not None:
                with self.pool.lock:
                    self._peft.base_model.unload()  # PEFT's layers replaced by their base layers again
                self._peft = None
            for entry in self._resident:
                entry.internal = entry.watch = None
            self._resident.clear()
            _SERVED.pop(self.model, None)

    # ------------------------------------------------------------------ internals
    def _entry(self, namespace: Hashable) -> _Adapter:
        assert type(namespace) is AdapterNamespace
        entry = self._by_label.get((namespace.adapter, namespace.version))
        if entry is None:
            raise AdapterNotFoundError(f"adapter {namespace.adapter!r} version {namespace.version} is gone")
        return entry

    def _retire(self, entry: _Adapter) -> None:
        entry.retired = True
        if not entry.users and entry.internal is None:
            self._drop_labels(entry, set())

    def _drop_labels(self, entry: _Adapter, keep: set[str]) -> None:
        for label in entry.labels - keep:
            if self._by_label.get((entry.name, label)) is entry:
                del self._by_label[(entry.name, label)]
        entry.labels &= keep

    def _make_room(self) -> bool:
        if len(self._resident) < self._config.max_loras:
            return True
        idle = [entry for entry in self._resident if not entry.scheduled]
        if not idle:
            return False
        self._evict(min(idle, key=lambda entry: entry.used_at))
        return True

    def _inject(self, entry: _Adapter) -> None:
        """Put ``entry`` into the model (PEFT's LoRA layers, disabled), checking PEFT took every weight."""
        from peft import PeftModel, set_peft_model_state_dict

        internal = f"pagedcore_lora_{next(self._serials)}"
        config = copy.deepcopy(entry.files.config)
        config.inference_mode = True
        config.init_lora_weights = True  # the file's weights replace them: no initialiser may touch the base layers
        with self.pool.lock, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PEFT's notes on active adapters: none is active here
            try:
                if self._peft is None:
                    self._peft = PeftModel(self.model, config, adapter_name=internal)
                else:
                    self._peft.add_adapter(internal, config)
                result = set_peft_model_state_dict(self._peft, entry.files.state, adapter_name=internal)
            except Exception as exc:  # PEFT refused what the file checks let through
                self._forget(internal)
                raise AdapterError(f"PEFT could not load {entry.name!r}: {type(exc).__name__}: {exc}") from exc
            layers = self._layers(internal)
            variants = [layer for layer in layers if internal in getattr(layer, "lora_variant", {})]
            missing = [key for key in getattr(result, "missing_keys", ()) if f".{internal}." in key]
            if getattr(result, "unexpected_keys", None) or variants or not layers or missing:
                self._forget(internal)
                raise AdapterError(
                    f"PEFT could not load {entry.name!r} as plain LoRA on this model's linear layers"
                    + (f": its file has no weights for {missing[0]} (and {len(missing) - 1} more)" if missing else "")
                )
            self._settle()
        entry.internal = internal
        entry.watch = _Watch(layers, internal)
        self._resident.append(entry)

    def _forget(self, internal: str) -> None:
        """Take a half-injected adapter out again (under the pool's lock)."""
        if self._peft is not None and internal in self._peft.peft_config:
            self._peft.delete_adapter(internal)
        for module in self.model.modules():  # PEFT leaves layers it made before failing
            for attr in ("lora_A", "lora_B"):
                parts = getattr(module, attr, None)
                if isinstance(parts, torch.nn.ModuleDict) and internal in parts:
                    del parts[internal]
        if self._peft is None:  # the first injection failed inside PeftModel(): unwrap what it wrapped
            wrapped = [(name, m) for name, m in self.model.named_modules() if hasattr(m, "lora_A")]
            for name, module in wrapped:
                parent, _, child = name.rpartition(".")
                setattr(self.model.get_submodule(parent) if parent else self.model, child, module.base_layer)

    def _evict(self, entry: _Adapter) -> None:
        """Take ``entry`` out of the model (its weights stay in host memory, as they are now)."""
        internal = entry.internal
        assert internal is not None
        if entry.changed:
            from peft import get_peft_model_state_dict

            state = get_peft_model_state_dict(self._peft, adapter_name=internal)
            entry.files = replace(entry.files, state={k: v.detach().to("cpu").clone() for k, v in state.items()})
        with self.pool.lock, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._peft.delete_adapter(internal)
        entry.internal = entry.watch = None
        self._resident.remove(entry)

    def _changed(self, entry: _Adapter) -> int:
        """``entry``'s weights changed in place: a new version; the old one's scope is closed."""
        assert entry.internal is not None
        layers = self._layers(entry.internal)
        old = entry.version
        live = {f"{i}.{k}": v for i, layer in enumerate(layers) for k, v in _adapter_tensors(layer, entry.internal)}
        entry.version = adapter_digest(entry.files.config, live, seed=("changed:" + old).encode())
        entry.changed = True
        entry.labels.add(entry.version)
        entry.watch = _Watch(layers, entry.internal)
        self._by_label[(entry.name, entry.version)] = entry
        with self.pool.lock:
            forgotten = self.pool.kv.close_scope(_scope(entry.name, old))
            self.pool.kv.open_scope(_scope(entry.name, entry.version))
        return forgotten

    def _layers(self, internal: str) -> list[torch.nn.Module]:
        return [m for m in self.model.modules() if internal in getattr(m, "lora_A", {})]

    def _settle(self) -> None:
        """Every LoRA layer disabled (a plain forward is the base model's) and hooked."""
        for module in self.model.modules():
            if hasattr(module, "lora_A") and hasattr(module, "enable_adapters"):
                module.enable_adapters(False)
                if module not in self._hooks:
                    hook = transparent_hook(
                        functools.partial(self._apply, head=module is self._head or module.base_layer is self._head)
                    )
                    self._hooks[module] = module.register_forward_hook(hook)

    def _apply(self, module: Any, args: tuple[Any, ...], output: torch.Tensor, *, head: bool) -> torch.Tensor:
        """The forward hook: each adapter's delta on the rows of its tokens (see the module docstring)."""
        if torch.compiler.is_compiling():
            return output  # the compiled decode step runs only steps without adapter rows
        step: LoraStep | None = getattr(self._local, "step", None)
        if step is None:
            return output
        x = args[0].reshape(-1, args[0].shape[-1])
        out = output.reshape(-1, output.shape[-1])
        for internal, rows in (step.logits if head else step.tokens).items():
            if internal not in module.lora_A:
                continue
            lora_a, lora_b = module.lora_A[internal], module.lora_B[internal]
            every = rows.numel() == out.shape[0]
            sub = (x if every else x.index_select(0, rows)).to(lora_a.weight.dtype)
            delta = lora_b(lora_a(sub)) * module.scaling[internal]
            if every:
                out = (out + delta).to(output.dtype)
            else:
                out = out.index_copy(0, rows, (out.index_select(0, rows) + delta).to(output.dtype))
        return out.reshape(output.shape)


def _scope(name: str, version: str) -> tuple[str, str, str]:
    """The pool's scope of an adapter version (:func:`~pagedcore.block_keys.namespace_scope`)."""
    return ("adapter", name, version)


def _groups(owners: Sequence[str | None], device: torch.device) -> dict[str, torch.Tensor]:
    """Row indices per adapter (rows without one: none)."""
    rows: dict[str, list[int]] = {}
    for index, owner in enumerate(owners):
        if owner is not None:
            rows.setdefault(owner, []).append(index)
    return {owner: torch.tensor(indices, dtype=torch.long, device=device) for owner, indices in rows.items()}


def _adapter_tensors(layer: Any, internal: str) -> Iterator[tuple[str, torch.Tensor]]:
    for attr in ("lora_A", "lora_B"):
        for key, tensor in layer.get_submodule(attr)[internal].named_parameters():
            yield f"{attr}.{key}", tensor


class _Watch:
    """An adapter's weights in the model: its tensors' version counters and data pointers, and its scalings."""

    def __init__(self, layers: list[Any], internal: str) -> None:
        self._internal = internal
        self._layers = [weakref.ref(layer) for layer in layers]
        self._tensors = [weakref.ref(t) for layer in layers for _, t in _adapter_tensors(layer, internal)]
        self._last = self._state()

    def moved(self) -> bool:
        """Whether they changed since the watch was made (a tensor or layer gone counts)."""
        return self._state() != self._last

    def _state(self) -> tuple[Any, ...] | None:
        tensors, layers = [ref() for ref in self._tensors], [ref() for ref in self._layers]
        if any(t is None for t in tensors) or any(layer is None for layer in layers):
            return None
        # The version counter is torch's record of in-place writes; it has no public accessor.
        marks = tuple((t._version, t.data_ptr()) for t in tensors if t is not None)  # noqa: SLF001
        return (marks, tuple(layer.scaling.get(self._internal) for layer in layers if layer is not None))
