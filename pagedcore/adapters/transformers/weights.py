"""The weights a pool's keys and values were computed with: a cheap fingerprint and a watch that notices it move.

A prefix cache serves keys and values computed earlier, which are right only while the model would compute the same
ones. :class:`WeightsWatch` follows one model and says when that may no longer hold (:meth:`WeightsWatch.check`);
the pool (:meth:`~pagedcore.adapters.transformers.PagedKVPool.check_weights`) then forgets its cached prefixes.

What the fingerprint covers:

- every parameter and buffer (rotary ``inv_freq`` included): which tensor object it is, its in-place version counter
  (``tensor._version``, which every in-place op bumps: optimizer steps, ``load_state_dict``'s ``copy_``,
  ``with torch.no_grad(): p.add_(...)``) and its data pointer (``p.data = ...``, ``model.to(...)``);
- steps of ``torch.optim`` optimizers over those tensors (fused kernels, ``AdamW(fused=True)``, bump no version
  counter): a global optimizer step post-hook counts them per tensor;
- the module structure: a submodule, parameter or buffer added or replaced (PEFT adapters injected or unloaded,
  ``merge_and_unload``, ``model.lm_head.weight = nn.Parameter(...)``, ``load_state_dict(assign=True)``, a module
  without tensors such as an activation: ``mlp.act_fn = nn.GELU()``): torch's global registration hooks count
  registrations on the model's modules, and the watch walks the module tree again after one, comparing the modules
  (by identity) and the tensors; and the children of each ``ModuleList`` and ``Sequential`` (their ``insert`` and
  ``del`` edit the container's dict without a registration: a layer inserted or deleted), compared by identity at
  every check;
- each module's settings: its public attributes that hold a number, a string or a flag (a norm's
  ``variance_epsilon``, an attention's ``scaling``; not ``training``, ``gradient_checkpointing`` or
  ``name_or_path``, which change no output), a ``forward`` set on the instance (``module.forward = ...``, as
  Liger's or accelerate's patches do; pagedcore's own, :func:`transparent_forward`, compute the module's forward and
  do not count), its children (a layer written straight into its parent's ``_modules``, as torch's quantization
  and fusion do, while the old one lives on) and its forward hooks and pre-hooks, with the global ones (a steering
  vector added to a layer's output; by handle, :mod:`.hook_ids` says which count): compared where the caller asks
  (``check(settings=True)``, a few tens of microseconds for a hundred modules: ``enable()``d calls each time, the
  Engine in steps that may admit a request);
- the state of PEFT tuner layers (any module with ``active_adapters``, ``merged_adapters`` and
  ``disable_adapters``): which adapters are active, merged (``merge_adapter`` writes through ``.data``, which no
  version counter sees), disabled (``disable_adapter()``), and their scaling;
- the model's ``training`` flag (dropout changes what a forward computes).

**Adapters served per request** (an Engine's LoRA adapters, :mod:`.lora`): a watch made with ``adapters_apart=True``
watches the base model only. A tuner layer's own tensors (everything of it but its ``base_layer``) are the adapters',
which their owner watches one by one; a wrapped layer's base tensors keep their unwrapped names (``q_proj.weight``,
not ``q_proj.base_layer.weight``), and of a tuner layer's state only what changes a plain forward counts (adapters
merged into the base weights, or enabled ones applied to every row). So injecting, replacing or deleting an adapter
is no change of the base model (its prefixes and its content hash stay), while every change above still is.

Not covered (call ``reset_prefix_cache()`` after them): writes through ``.data`` outside PEFT (``p.data.copy_(w)``),
direct writes into a module's ``_parameters`` (accelerate's ``set_module_tensor_to_device``) or, between checks
that leave the settings out, its ``_modules`` (outside torch's sequence containers), parameters created as inference
tensors (they have no version counter), settings held elsewhere than a
module's public attributes of a number, string or flag (the config object's fields read at each forward, private
attributes, one set from or to None, a class's attributes or methods patched). Tensors on the ``meta`` device
(accelerate's offloaded weights between forwards, which it replaces at every forward) count by name, dtype and shape
only: their data is elsewhere, and the watch never calls ``data_ptr`` on them.

The check reads each tensor's version counter and data pointer through weak references (the watch never keeps a
replaced parameter alive): tens of microseconds for a model of a hundred tensors, about a thousandth of a forward
(docs/limits.md; ``examples/weights_check_cost.py``). The module tree is walked again only after a registration on
one of the model's modules (not on the temporary containers models build in their forward).

The fingerprint is an in-process one (:class:`WeightsFingerprint`: which watch, how many moves it saw, where the
weights are); a persisted key (a store below the pool, shared across processes and restarts: :mod:`pagedcore.kv_tiers`)
extends it with :meth:`WeightsWatch.content_hash`, a hash of every parameter's and buffer's name, dtype, shape and
bytes and of every module's name, class and settings (not its instance ``forward``: no name says what one computes),
computed once per :attr:`WeightsWatch.epoch` (about a second per GB on a CPU), without changing the callers of
:meth:`WeightsWatch.check`. A model with tensors on the meta device has no content hash (its data is elsewhere).
"""

from __future__ import annotations

import hashlib
import itertools
import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules import module as torch_module
from torch.optim import optimizer as torch_optimizer
from torch.utils.weak import WeakIdKeyDictionary

from . import hook_ids

__all__ = ["WeightsFingerprint", "WeightsWatch", "transparent_forward"]

Placement = tuple[torch.dtype, torch.device] | None
"""The ``(dtype, device)`` of a model's first parameter not on the meta device (what its keys are computed in)."""


@dataclass
class _Events:
    """Process-wide counters that torch's global hooks bump (installed once, by the first watch): the hooks are
    global, so what they count is too; each watch compares the counters with what they were at its last check."""

    registrations: int = 0  # modules, parameters and buffers registered on a module of a watched model
    optimizer_steps: int = 0  # steps of any torch.optim optimizer
    installed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    stepped: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # tensor -> optimizer steps over it
    # Every module of every watched model, as of its last walk. Registrations elsewhere do not count: models build
    # temporary containers in their forward (Llama's ``self.layers[:n]`` makes a ModuleList at every call).
    watched: weakref.WeakSet[torch.nn.Module] = field(default_factory=weakref.WeakSet)


_EVENTS = _Events()


def _on_registration(module: Any, name: str, value: Any) -> None:
    if torch.compiler.is_compiling():
        # Traced (a module registered inside a compiled function): not a change of the model's weights, and dynamo
        # would guard on the WeakSet's contents, which fails once a watched model is collected (a compile failure).
        return
    if module in _EVENTS.watched:
        _EVENTS.registrations += 1  # returns None: torch registers the value unchanged


def _on_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    _EVENTS.optimizer_steps += 1
    stepped = _EVENTS.stepped
    for group in optimizer.param_groups:
        for param in group["params"]:
            stepped[param] = stepped.get(param, 0) + 1


def _install_hooks() -> None:
    with _EVENTS.lock:
        if _EVENTS.installed:
            return
        torch_module.register_module_module_registration_hook(_on_registration)
        torch_module.register_module_parameter_registration_hook(_on_registration)
        torch_module.register_module_buffer_registration_hook(_on_registration)
        torch_optimizer.register_optimizer_step_post_hook(_on_optimizer_step)
        _EVENTS.installed = True


@dataclass(frozen=True)
class WeightsFingerprint:
    """Which weights a pool's keys and values were computed with, within this process.

    Two fingerprints are equal when they come from the same watch and no move was seen between them.

    Attributes:
        watch: the watch's serial number (one per model a pool watched, unique in the process).
        epoch: moves the watch had seen (:attr:`WeightsWatch.epoch`).
        placement: ``(dtype, device)`` of the model's first parameter off the meta device, or None.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> watch = WeightsWatch(tiny_llama())
        >>> fp = watch.fingerprint()
        >>> fp.epoch, fp.placement, fp == watch.fingerprint()
        (0, (torch.float32, device(type='cpu')), True)
    """

    watch: int
    epoch: int
    placement: Placement


@dataclass
class _Walk:
    """What one walk of the module tree found: the structure and the references the quick check reads."""

    names: tuple[str, ...]  # "p:name" / "b:name" of every parameter and buffer, in order
    refs: list[weakref.ref[torch.Tensor]]  # the same tensors
    meta: tuple[Any, ...]  # per tensor: (dtype, shape) when on the meta device (identity-free), else None
    plain: list[weakref.ref[torch.Tensor]]  # tensors whose version counter and data pointer can be read
    others: list[weakref.ref[torch.Tensor]]  # the rest: they count by identity (a dead one means a new walk)
    frequencies: list[weakref.ref[torch.Tensor]]  # rotary inv_freq buffers: by identity and data pointer only
    tuners: list[tuple[str, weakref.ref[Any]]]  # PEFT tuner layers
    first: weakref.ref[torch.Tensor] | None  # the first parameter off the meta device (placement)
    # torch's ModuleList and Sequential of the model, each with its children then (their insert() and del edit the
    # container's dict without a registration: compared at every check)
    containers: list[tuple[weakref.ref[torch.nn.Module], list[Callable[[], torch.nn.Module | None]]]]
    modules: list[weakref.ref[torch.nn.Module]]  # every module, in named_modules() order
    # the modules whose forwards make up the (base) model's computation, in order: with adapters apart, those of
    # PEFT tuner layers are left out but their base layers' (a module without tensors replaced, an activation say,
    # is a registration that changes no tensor: compared after each one)
    structure: list[weakref.ref[torch.nn.Module]]
    settings: _Settings  # the settings of ``structure``'s modules then (compared where asked: check())


_SCALARS = (bool, int, float, str)  # not None: attributes a forward fills in later (Qwen2-VL's rope_deltas) start so
# plain attributes that change no output: the mode (the training flag counts apart), gradient checkpointing, where the
# weights were loaded from
_NOT_SETTINGS = frozenset({"training", "gradient_checkpointing", "name_or_path"})
_TRANSPARENT: list[tuple[type, ...]] = [()]  # pagedcore's own instance forwards (the class's computation)


def transparent_forward(cls: type[Any]) -> type[Any]:
    """Class decorator: instances of ``cls`` (and of its subclasses) set as a module's ``forward`` compute what the
    module's own forward does (the runner's packed linears, the fused greedy head), so the watch's settings check
    does not count them.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> @transparent_forward
        ... class Own:
        ...     def __init__(self, module):
        ...         self.module = module
        ...     def __call__(self, x):
        ...         return type(self.module).forward(self.module, x)
        >>> model = tiny_llama()
        >>> watch = WeightsWatch(model)
        >>> model.lm_head.forward = Own(model.lm_head)
        >>> watch.check()
        False
        >>> model.lm_head.forward = lambda x: 2 * type(model.lm_head).forward(model.lm_head, x)
        >>> watch.check(settings=False), watch.check(), watch.epoch
        (False, True, 1)
    """
    _TRANSPARENT[0] = (*_TRANSPARENT[0], cls)
    return cls


@dataclass
class _Settings:
    """The settings of a walk's modules as it found them: per module its public plain attributes (numbers, strings,
    flags: a norm's ``variance_epsilon``, an attention's ``scaling``; :func:`_setting_names`), the ``forward`` set
    on the instance, and its children (a write into its ``_modules``, which runs no registration hook: torch's
    quantization and fusion swap layers so); held as columns, so that a check is a few passes over lists."""

    modules: list[weakref.ref[torch.nn.Module]]
    reads: list[Callable[[dict[str, Any]], Any]]  # per module: its attributes' values, read from its __dict__
    values: list[Any]
    forwards: list[int | None]  # per module: id() of an instance forward other than a transparent one, else None
    sizes: list[int]  # per module: how many children it has
    parents: list[int]  # the modules with children (indices), whose children ``children`` holds in a row
    children: list[Callable[[], torch.nn.Module | None]]  # the parents' children, weakly, in order
    pre: list[bool]  # per module: whether its forward pre-hooks count (not a PEFT tuner layer's: hook_ids)
    hooks: list[tuple[int, ...]]  # the forward hooks that count: per hooked module (index, ids...), the global last
    apart: bool  # adapters apart: a PEFT tuner layer counts as its base layer (loading an adapter changes nothing)

    @classmethod
    def of(cls, modules: list[torch.nn.Module], apart: bool) -> _Settings:
        fields = [module.__dict__ for module in modules]
        reads = [_reader(_setting_names(found)) for found in fields]
        values = [read(found) for read, found in zip(reads, fields)]
        sizes = [len(found["_modules"]) for found in fields]
        parents = [i for i, size in enumerate(sizes) if size]
        children = _children([child for i in parents for child in _own_children(fields[i], apart).values()])
        refs = [weakref.ref(module) for module in modules]
        pre = [not _is_tuner(module) for module in modules]
        hooks = _hooks(fields, pre)
        return cls(refs, reads, values, _forwards(fields), sizes, parents, children, pre, hooks, apart)

    def hold(self) -> bool:
        """Every module alive with the same settings."""
        modules = [ref() for ref in self.modules]
        if None in modules:
            return False
        fields = [module.__dict__ for module in modules]
        try:
            values = [read(found) for read, found in zip(self.reads, fields)]
        except KeyError:  # an attribute deleted
            return False
        if values != self.values or _forwards(fields) != self.forwards or _hooks(fields, self.pre) != self.hooks:
            return False
        if [len(found["_modules"]) for found in fields] != self.sizes:
            return False
        apart = self.apart
        now = [child for i in self.parents for child in _own_children(fields[i], apart).values()]
        return [child() for child in self.children] == now  # (modules compare by identity)


def _hooks(fields: list[dict[str, Any]], pre: list[bool]) -> list[tuple[int, ...]]:
    """The forward hooks that count (:mod:`.hook_ids`): the modules' (``fields``: their ``__dict__``s), then the
    global ones."""
    return [*hook_ids.module_hooks(fields, pre), hook_ids.global_hooks()]


def _own_children(fields: dict[str, Any], apart: bool) -> dict[str, Any]:
    """A module's children (from its ``__dict__``); with adapters apart, each PEFT tuner layer as its base layer."""
    found: dict[str, Any] = fields["_modules"]
    if not apart or not any(_is_tuner(child) for child in found.values() if child is not None):
        return found
    return {
        name: child.base_layer if child is not None and _is_tuner(child) else child for name, child in found.items()
    }


def _reader(names: list[str]) -> Callable[[dict[str, Any]], Any]:
    return operator.itemgetter(*names) if names else _no_settings


def _no_settings(fields: dict[str, Any]) -> None:
    """What a module without settings reads."""
    return None


def _forwards(fields: list[dict[str, Any]]) -> list[int | None]:
    """Per module (its ``__dict__``): ``id()`` of a ``forward`` set on the instance, None where there is none or it is
    pagedcore's own (:func:`transparent_forward`)."""
    found = [item.get("forward") for item in fields]
    if found.count(None) == len(found):
        return found
    transparent = _TRANSPARENT[0]
    return [None if forward is None or isinstance(forward, transparent) else id(forward) for forward in found]


def _setting_names(fields: dict[str, Any]) -> list[str]:
    """The names of a module's settings among its attributes (``fields``: its ``__dict__``)."""
    return [name for name, value in fields.items()
            if type(value) in _SCALARS and not name.startswith("_") and name not in _NOT_SETTINGS]  # fmt: skip


_serials = itertools.count()
_TUNER_TYPES: dict[type, bool] = {}


class WeightsWatch:
    """Follows one model's weights and says when they moved (see the module docstring for what counts).

    Args:
        model: a ``torch.nn.Module`` (held weakly: the watch never keeps it alive).
        adapters_apart: watch the base model only: PEFT adapters are served per request and watched by their owner
            (see "Adapters served per request" in the module docstring).

    Example:
        >>> import torch
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> model = tiny_llama()
        >>> watch = WeightsWatch(model)
        >>> watch.check()                                  # nothing changed since the watch was made
        False
        >>> with torch.no_grad():
        ...     _ = model.lm_head.weight.mul_(2)           # an in-place update
        >>> watch.check(), watch.check(), watch.epoch      # seen once
        (True, False, 1)
        >>> _ = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
        >>> watch.check()                                  # generate changes nothing
        False
    """

    def __init__(self, model: torch.nn.Module, *, adapters_apart: bool = False) -> None:
        _install_hooks()
        self._apart = adapters_apart
        self._model = weakref.ref(model)
        self._serial = next(_serials)
        self._epoch = 0
        self._registrations = _EVENTS.registrations
        self._optimizer_steps = _EVENTS.optimizer_steps
        self._walk = _walk(model, adapters_apart)
        self._num_walks = 1
        state = self._state(model, self._walk)
        assert state is not None  # the tensors were just walked
        self._last = state
        self._steps = _steps(self._walk)
        self._placement = _placement(self._walk)
        self._content: tuple[int, str | None] | None = None  # (epoch, hash) once content_hash computed it

    @property
    def epoch(self) -> int:
        """How many moves :meth:`check` has seen, each optimizer step over the model's tensors counted (two steps
        between checks add 2): the pool's :attr:`~pagedcore.adapters.transformers.PagedKVPool.weights_version`."""
        return self._epoch

    @property
    def num_walks(self) -> int:
        """How many times the watch walked the module tree (once when made, then after each registration on the
        model or a tensor gone); every other check reads only the tensors it holds."""
        return self._num_walks

    @property
    def adapters_apart(self) -> bool:
        """Whether the watch leaves PEFT adapters to their owner (see the module docstring)."""
        return self._apart

    @property
    def placement(self) -> Placement:
        """``(dtype, device)`` of the model's first parameter off the meta device, as of the last check."""
        return self._placement

    def fingerprint(self) -> WeightsFingerprint:
        """The fingerprint as of the last :meth:`check`."""
        return WeightsFingerprint(self._serial, self._epoch, self._placement)

    def check(self, *, settings: bool = True) -> bool:
        """Whether the weights moved since the last check (or since the watch was made); records what it saw.

        ``settings``: also compare each module's settings (its plain attributes, a norm's ``variance_epsilon`` or an
        attention's ``scaling``, and a ``forward`` set on the instance) with the last walk's: a few tens of
        microseconds more, so the Engine asks for it only in steps that may admit a request (a prefix lookup);
        a change found is a move like any other. False once the model was garbage collected (nothing computes with
        it any more).
        """
        model = self._model()
        if model is None:
            return False
        walk = self._walk
        if _EVENTS.registrations != self._registrations or not _containers_hold(walk):
            return self._rewalk(model)
        state = self._state(model, walk)
        if state is None:  # a tensor is gone (replaced without a registration, e.g. by accelerate's offload hooks)
            return self._rewalk(model)
        moved = state != self._last
        if settings and not _settings_hold(walk):
            walk.settings = _Settings.of([m for ref in walk.structure if (m := ref()) is not None], self._apart)
            moved = True
        count = 1
        if _EVENTS.optimizer_steps != self._optimizer_steps:
            self._optimizer_steps = _EVENTS.optimizer_steps
            steps = _steps(walk)
            moved = moved or steps != self._steps
            count = _most_steps(self._steps, steps)
            self._steps = steps
        if moved:
            self._moved(state, walk, count)
        return moved

    def modules(self, model: torch.nn.Module) -> list[torch.nn.Module] | None:
        """Every module of ``model`` as of the last walk, where that walk is still the model's tree (no registration
        on it since, each ``ModuleList``'s and ``Sequential``'s children the same, none collected): what a check of
        every module at every step can read instead of walking the tree. None otherwise (walk it), and for a model
        other than the watched one.

        Example:
            >>> from pagedcore.adapters.transformers.testing import tiny_llama
            >>> model = tiny_llama()
            >>> watch = WeightsWatch(model)
            >>> watch.modules(model) == list(model.modules())
            True
            >>> model.model.layers.insert(0, model.model.layers[1])   # no registration: the container differs
            >>> watch.modules(model) is None, watch.check(), watch.modules(model) == list(model.modules())
            (True, True, True)
        """
        walk = self._walk
        if self._model() is not model or _EVENTS.registrations != self._registrations or not _containers_hold(walk):
            return None
        modules = [module for ref in walk.modules if (module := ref()) is not None]
        return modules if len(modules) == len(walk.modules) else None

    def content_hash(self, *, fresh: bool = False) -> str | None:
        """A hash of the model's tensors (names, dtypes, shapes, bytes), the same in every process that loaded the
        same weights: computed at the first call of each :attr:`epoch` (``fresh=True``: again now, after a change
        no check can see). None when a tensor is on the meta device or the model is gone.

        Example:
            >>> import torch
            >>> from pagedcore.adapters.transformers.testing import tiny_llama
            >>> model = tiny_llama()
            >>> watch = WeightsWatch(model)
            >>> before = watch.content_hash()
            >>> copy = tiny_llama(); _ = copy.load_state_dict(model.state_dict())
            >>> before == WeightsWatch(copy).content_hash()     # the same weights in another model object
            True
            >>> with torch.no_grad():
            ...     _ = model.lm_head.weight.add_(1)
            >>> watch.check(), watch.content_hash() != before
            (True, True)
        """
        cached = self._content
        if cached is not None and cached[0] == self._epoch and not fresh:
            return cached[1]
        model = self._model()
        digest = None if model is None else _content_hash(model, self._apart)
        self._content = (self._epoch, digest)
        return digest

    def tuners_hooked(self) -> bool:
        """Whether a PEFT tuner layer of the model carries a forward pre-hook: PEFT's per-call ``adapter_names``
        (mixed-batch inference) and ``alora_offsets`` choose each row's adapter that way, which no weight shows."""
        return any(getattr(ref(), "_forward_pre_hooks", None) for _, ref in self._walk.tuners)

    # ------------------------------------------------------------------ internals
    def _rewalk(self, model: torch.nn.Module) -> bool:
        self._registrations = _EVENTS.registrations
        self._optimizer_steps = _EVENTS.optimizer_steps
        old, new = self._walk, _walk(model, self._apart)
        self._num_walks += 1
        state = self._state(model, new)
        assert state is not None
        steps = _steps(new)
        moved = not _same_structure(old, new, self._apart) or state != self._last or steps != self._steps
        moved = moved or not _settings_hold(old)  # set with the registration: the new walk took the new ones
        count = _most_steps(self._steps, steps) if len(steps) == len(self._steps) else 1
        self._walk, self._steps = new, steps
        if moved:
            self._moved(state, new, count)
        return moved

    def _moved(self, state: tuple[Any, ...], walk: _Walk, count: int = 1) -> None:
        self._last = state
        self._epoch += max(count, 1)  # each optimizer step since the last check is one update
        self._placement = _placement(walk)

    def _state(self, model: torch.nn.Module, walk: _Walk) -> tuple[Any, ...] | None:
        """The quick part: version counters, data pointers, adapter states, the training flag (None: a tensor died)."""
        refs = walk.plain
        tensors = [t for ref in refs if (t := ref()) is not None]
        frequencies = [t for ref in walk.frequencies if (t := ref()) is not None]
        if len(tensors) != len(refs) or len(frequencies) != len(walk.frequencies):
            return None
        if any(ref() is None for ref in walk.others):
            return None
        # The version counter is torch's record of in-place writes; it has no public accessor.
        versions = tuple([t._version for t in tensors])  # noqa: SLF001
        pointers = tuple([t.data_ptr() for t in (*tensors, *frequencies)])
        if self._apart:  # only what a plain forward of the base model applies: merged or enabled adapters
            states = ((name, _base_effect(ref())) for name, ref in walk.tuners)
            adapters = tuple(item for item in states if item[1] != ((), ()))
        else:
            adapters = tuple(_tuner_state(ref()) for _, ref in walk.tuners)
        return (model.training, versions, pointers, adapters)


def _walk(model: torch.nn.Module, apart: bool = False) -> _Walk:
    names: list[str] = []
    refs: list[weakref.ref[torch.Tensor]] = []
    meta: list[Any] = []
    plain: list[weakref.ref[torch.Tensor]] = []
    others: list[weakref.ref[torch.Tensor]] = []
    frequencies: list[weakref.ref[torch.Tensor]] = []
    first: weakref.ref[torch.Tensor] | None = None
    for name, tensor, is_param in _tensors(model, apart):
        ref = weakref.ref(tensor)
        names.append(("p:" if is_param else "b:") + name)
        refs.append(ref)
        on_meta = tensor.device.type == "meta"
        meta.append((tensor.dtype, tuple(tensor.shape)) if on_meta else None)
        if not is_param and name.endswith("inv_freq") and not on_meta:
            frequencies.append(ref)  # transformers rewrites longrope's in place at every forward, with equal values
        else:
            (plain if not on_meta and _readable(tensor) else others).append(ref)
        if is_param and first is None and not on_meta:
            first = ref
    tuners: list[tuple[str, weakref.ref[Any]]] = []
    containers: list[tuple[weakref.ref[torch.nn.Module], list[Callable[[], torch.nn.Module | None]]]] = []
    modules: list[weakref.ref[torch.nn.Module]] = []
    structure: list[weakref.ref[torch.nn.Module]] = []
    tuned: list[str] = []  # with adapters apart: the tuner layers' names (their own modules are the adapters')
    watched = _EVENTS.watched
    for module_name, module in model.named_modules():
        watched.add(module)
        module_ref = weakref.ref(module)
        modules.append(module_ref)
        tuner = _is_tuner(module)
        if _computes(module_name, tuner, tuned, apart):
            structure.append(module_ref)
        if tuner:
            tuners.append((module_name, module_ref))
            tuned.append(module_name)
        if isinstance(module, _SEQUENCES):
            containers.append((weakref.ref(module), _children(module._modules.values())))  # noqa: SLF001
    settings = _Settings.of([module for ref in structure if (module := ref()) is not None], apart)
    return _Walk(tuple(names), refs, tuple(meta), plain, others, frequencies, tuners, first, containers, modules,
                 structure, settings)  # fmt: skip


def _computes(name: str, tuner: bool, tuned: list[str], apart: bool) -> bool:
    """Whether module ``name`` is part of the (base) model's computation: every module, or with adapters apart
    neither a tuner layer (``tuner``) nor a part of one but its base layer (``tuned``: the tuner layers met so far;
    ``named_modules()`` gives a layer's parts right after it)."""
    return not apart or not (tuner or (bool(tuned) and _adapter_part(name, tuned[-1])))


def _base_modules(model: torch.nn.Module, apart: bool) -> Iterator[tuple[str, torch.nn.Module]]:
    """The modules of the (base) model's computation with their names (``apart``: a base layer's unwrapped)."""
    tuned: list[str] = []
    for name, module in model.named_modules():
        tuner = _is_tuner(module)
        if _computes(name, tuner, tuned, apart):
            yield (name.replace(".base_layer", "") if apart else name), module
        if tuner:
            tuned.append(name)


def _adapter_part(name: str, tuner: str) -> bool:
    """Whether module ``name`` lies inside tuner layer ``tuner`` but not in its base layer."""
    if not name.startswith(tuner + "."):
        return False
    rest = name[len(tuner) + 1 :]
    return rest != "base_layer" and not rest.startswith("base_layer.")


_SEQUENCES = (torch.nn.ModuleList, torch.nn.Sequential)


def _children(found: Iterable[torch.nn.Module | None]) -> list[Callable[[], torch.nn.Module | None]]:
    """Modules (a module's ``_modules``' values), weakly, in order (an empty slot as a reference that reads None)."""
    return [_no_module if child is None else weakref.ref(child) for child in found]


def _no_module() -> None:
    """A slot registered empty, as a reference that reads None."""
    return None


def _containers_hold(walk: _Walk) -> bool:
    """Each ModuleList and Sequential of the walk still holds the children it held then, in order (what ``insert``
    and ``del``, which run no registration hook, change)."""
    for ref, children in walk.containers:
        module = ref()
        if module is None or [child() for child in children] != list(module._modules.values()):  # noqa: SLF001
            return False  # (modules compare by identity)
    return True


def _settings_hold(walk: _Walk) -> bool:
    """Every module of the walk's structure alive with the settings the walk found."""
    return len(walk.settings.modules) == len(walk.structure) and walk.settings.hold()


def _tensors(model: torch.nn.Module, apart: bool = False) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """The model's parameters and buffers (``apart``: its base model's, under their unwrapped names)."""
    skip = _adapter_tensors(model) if apart else set()
    for kind, items in ((True, model.named_parameters()), (False, model.named_buffers())):
        for name, tensor in items:
            if id(tensor) in skip:
                continue
            yield (name.replace(".base_layer.", ".") if apart else name), tensor, kind


def _adapter_tensors(model: torch.nn.Module) -> set[int]:
    """The ids of every tuner layer's own tensors (everything of it but its base layer's)."""
    ids: set[int] = set()
    for module in model.modules():
        if _is_tuner(module):
            base = getattr(module, "base_layer", None)
            keep = {id(t) for t in base.parameters()} | {id(t) for t in base.buffers()} if base is not None else set()
            ids.update(id(t) for t in (*module.parameters(), *module.buffers()) if id(t) not in keep)
    return ids


def _content_hash(model: torch.nn.Module, apart: bool = False) -> str | None:
    digest = hashlib.blake2b(digest_size=32)
    for name, tensor, _ in _tensors(model, apart):
        if tensor.device.type == "meta":
            return None
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    for name, module in _base_modules(model, apart):  # what computes with them: each module's class and settings
        fields = module.__dict__
        settings = sorted((key, repr(fields[key])) for key in _setting_names(fields))
        kind = type(module)
        digest.update(f"{name}\0{kind.__module__}.{kind.__qualname__}\0{settings}\0".encode())
    return digest.hexdigest()


def _readable(tensor: torch.Tensor) -> bool:
    """Whether the tensor has a version counter and a data pointer (inference tensors and storage-less wrapper
    subclasses have not: they count by identity only)."""
    try:
        tensor.data_ptr()
        _ = tensor._version  # noqa: SLF001
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


def _same_structure(old: _Walk, new: _Walk, apart: bool = False) -> bool:
    if len(old.structure) != len(new.structure) or any(o() is not n() for o, n in zip(old.structure, new.structure)):
        return False  # a module added, removed or replaced (one without tensors too: an activation)
    if old.names != new.names or old.meta != new.meta or (not apart and len(old.tuners) != len(new.tuners)):
        return False
    for o, n, meta in zip(old.refs, new.refs, old.meta):
        if meta is None and o() is not n():  # the same tensor objects (meta tensors are replaced at every forward)
            return False
    return apart or all(a == b and ra() is rb() for (a, ra), (b, rb) in zip(old.tuners, new.tuners))


def _steps(walk: _Walk) -> tuple[int, ...]:
    stepped = _EVENTS.stepped
    return tuple([stepped.get(t, 0) if (t := ref()) is not None else -1 for ref in walk.refs])


def _most_steps(before: tuple[int, ...], after: tuple[int, ...]) -> int:
    """The most optimizer steps any one tensor took between two readings of :func:`_steps` (1 at least)."""
    return max([b - a for a, b in zip(before, after) if a >= 0 and b >= 0] + [1])


def _placement(walk: _Walk) -> Placement:
    tensor = walk.first() if walk.first is not None else None
    return None if tensor is None else (tensor.dtype, tensor.device)


def _is_tuner(module: torch.nn.Module) -> bool:
    """A PEFT tuner layer (``peft.tuners.tuners_utils.BaseTunerLayer``), recognised by its interface."""
    kind = type(module)
    known = _TUNER_TYPES.get(kind)
    if known is None:
        known = _TUNER_TYPES[kind] = all(
            hasattr(kind, name) for name in ("active_adapters", "merged_adapters", "disable_adapters")
        )
    return known


def _base_effect(module: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What a tuner layer adds to a plain forward of its base layer: adapters merged into its weights, and the
    adapters it applies to every row unless disabled."""
    if module is None:
        return ((), ())
    enabled = () if module.disable_adapters else tuple(module.active_adapters)
    return (tuple(module.merged_adapters), enabled)


def _tuner_state(module: Any) -> tuple[Any, ...]:
    if module is None:
        return ()
    scaling = vars(module).get("scaling")
    return (
        tuple(module.active_adapters),
        tuple(module.merged_adapters),
        bool(module.disable_adapters),
        tuple(scaling.items()) if isinstance(scaling, dict) else None,
    )
