"""LoRA adapters in the Engine: requests that name an adapter, and the runner's set of adapters they use.

A request names its adapter (``Request(..., lora="sql")``, ``add_request(..., lora=...)``, ``generate(...,
lora=...)``; the server's ``model=<adapter name>``). The runner owns the adapters (:class:`AdapterSet`: loading,
the weights, the forward that applies each row's adapter; the transformers runner's is
:class:`~pagedcore.adapters.transformers.lora.LoraAdapters`); the Engine owns which requests use which
(:class:`AdapterRequests`):

- **namespaces**: at admission the request's prefix-cache namespace is narrowed to its adapter's current version
  (:class:`~pagedcore.block_keys.AdapterNamespace`), so the prefix cache, the tiers below the pool and the router
  never serve a base-model prefix to an adapter's request, one adapter's to another's, or an old version's after
  its weights changed (:meth:`KVPool.close_scope <pagedcore.kv_pool.KVPool.close_scope>`);
- **residency**: at most ``max_loras`` adapters are in the model at once (:class:`LoRAConfig`). A request whose
  adapter is in the model joins the scheduler at once; one whose adapter is not waits here, outside the scheduler,
  until the runner can load it at the start of a step (unloading the least recently used adapter no scheduled request
  uses); the adapters of scheduled requests stay in the model until those requests finish;
- **use**: an adapter unloaded or replaced while requests use it stays (in the model or in host memory) until the
  last of them finishes, so a request always runs with the weights it was admitted with.

Example:
    >>> LoRAConfig(max_loras=4, max_lora_rank=8).max_loras
    4
    >>> AdapterRequests(None).narrow(Request([1, 2], lora="sql"))
    Traceback (most recent call last):
    ...
    pagedcore.errors.AdapterError: lora='sql': this Engine serves no LoRA adapters (build it with enable_lora=True)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from pagedcore.block_keys import namespace_scope
from pagedcore.errors import AdapterError, ConfigError, InvalidRequestError, PagedCoreError
from pagedcore.scheduler import Scheduler
from pagedcore.validation import integer

from .request import Request, RequestState

__all__ = ["AdapterInfo", "AdapterRequests", "AdapterSet", "LoRAConfig", "loras_per_prompt"]


@dataclass(frozen=True)
class LoRAConfig:
    """An Engine's LoRA settings (vLLM's names).

    Args:
        max_loras: the most adapters in the model at once (vLLM's default, 1); more may be loaded: they wait in
            host memory and the least recently used one no scheduled request uses makes room.
        max_lora_rank: adapters of a higher rank are refused when loaded (vLLM's default, 16).

    Example:
        >>> LoRAConfig(max_loras=0)
        Traceback (most recent call last):
        ...
        pagedcore.errors.ConfigError: max_loras must be an integer >= 1, got 0
    """

    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            object.__setattr__(self, name, integer(name, getattr(self, name), minimum=1, error=ConfigError))


@dataclass(frozen=True)
class AdapterInfo:
    """One loaded adapter, as :meth:`AdapterSet.adapters` lists it.

    Attributes:
        name: the name requests give.
        path: where it was loaded from.
        version: the identity of its weights (a digest; part of its requests' prefix-cache namespace).
        rank: its LoRA rank (the largest over its layers).
        resident: whether it is in the model now (else in host memory, loaded again when a request needs it).

    Example:
        >>> AdapterInfo("sql", "/adapters/sql", "3f2a", 8, False).rank
        8
    """

    name: str
    path: str
    version: str
    rank: int
    resident: bool


@runtime_checkable
class AdapterSet(Protocol):
    """A runner's adapters (``runner.adapters``): what the Engine asks of them. Registration (``load``, ``unload``)
    may come from any thread; ``schedule(..., load=True)`` only at the start of a step (the runner may change the
    model there), under the Engine's lock.

    Example:
        >>> sorted(name for name in vars(AdapterSet) if not name.startswith("_"))   # doctest: +NORMALIZE_WHITESPACE
        ['adapters', 'config', 'load', 'narrow', 'release', 'schedule', 'unload', 'use']
    """

    @property
    def config(self) -> LoRAConfig: ...

    def narrow(self, namespace: Hashable, name: str) -> Hashable:
        """The namespace of a request for adapter ``name`` (its current version); raises
        :class:`~pagedcore.errors.AdapterNotFoundError` for a name not loaded."""
        ...

    def use(self, namespace: Hashable) -> None:
        """A request of this namespace was queued: its adapter version stays until :meth:`release`."""
        ...

    def schedule(self, namespace: Hashable, *, load: bool) -> bool:
        """Whether a request of this namespace may join the scheduler now: its adapter is in the model (``load``: or
        can be put there now, making room by the least recently used adapter no scheduled request uses). When True,
        the adapter stays in the model until :meth:`release`."""
        ...

    def release(self, namespace: Hashable, *, scheduled: bool) -> None:
        """A request of this namespace finished (``scheduled``: it had joined the scheduler)."""
        ...

    def load(self, name: str, path: str, *, replace: bool = False) -> AdapterInfo:
        """Load an adapter's files under ``name`` (``replace``: a new version of a loaded one)."""
        ...

    def unload(self, name: str) -> None:
        """Stop serving ``name`` (requests using it finish first)."""
        ...

    def adapters(self) -> list[AdapterInfo]:
        """The adapters loaded, in load order."""
        ...


class AdapterRequests:
    """The Engine's side of LoRA (see the module docstring): which requests use which adapter, and the ones waiting
    for their adapter to enter the model.

    Args:
        adapters: the runner's :class:`AdapterSet` (None: the runner serves no adapters; requests naming one are
            refused).

    Example:
        >>> AdapterRequests(None).enabled
        False
    """

    def __init__(self, adapters: AdapterSet | None) -> None:
        self.adapters = adapters
        self._held: dict[str, RequestState] = {}  # waiting for their adapter to enter the model, in arrival order
        self._using: dict[str, bool] = {}  # request id -> it joined the scheduler (for those with an adapter)

    @property
    def enabled(self) -> bool:
        """Whether the runner serves adapters."""
        return self.adapters is not None

    @property
    def num_held(self) -> int:
        """Requests waiting for their adapter to enter the model."""
        return len(self._held)

    def require(self) -> AdapterSet:
        """The runner's adapters; raises :class:`~pagedcore.errors.AdapterError` when it has none."""
        if self.adapters is None:
            raise AdapterError("this Engine serves no LoRA adapters (build it with enable_lora=True)", param="lora")
        return self.adapters

    def narrow(self, request: Request) -> Request:
        """``request`` with its namespace narrowed to its adapter's current version (unchanged without one)."""
        if request.lora is None:
            return request
        if not isinstance(request.lora, str) or not request.lora:
            raise InvalidRequestError(f"lora must be an adapter's name, got {request.lora!r}", param="lora")
        try:
            namespace = self.require().narrow(request.namespace, request.lora)
        except AdapterError as exc:
            raise type(exc)(f"lora={request.lora!r}: {exc}", param="lora") from exc
        return replace(request, namespace=namespace)

    def enqueue(self, request: RequestState, scheduler: Scheduler) -> None:
        """Queue a validated request: into the scheduler, or here until its adapter can enter the model."""
        seq, rid = request.sequence, request.request_id
        assert seq is not None
        if self.adapters is None or namespace_scope(seq.namespace) is None:
            scheduler.add(seq)
            return
        if rid not in self._using:
            self.adapters.use(seq.namespace)
            self._using[rid] = False
        try:
            if self.adapters.schedule(seq.namespace, load=False):
                self._using[rid] = True
                scheduler.add(seq)
            else:
                self._held[rid] = request
        except BaseException:
            self.finish(request)
            raise

    def admit(self, scheduler: Scheduler, fail: Callable[[RequestState, str], None]) -> None:
        """At the start of a step (the runner may change the model now): schedule the waiting requests whose adapter
        is, or can now be put, in the model; fail those whose adapter cannot be loaded at all."""
        if not self._held or self.adapters is None:
            return
        for request_id, request in list(self._held.items()):
            if request.is_done:  # aborted while it waited
                self._held.pop(request_id)
                continue
            seq = request.sequence
            assert seq is not None
            try:
                if not self.adapters.schedule(seq.namespace, load=True):
                    continue
                self._held.pop(request_id)
                self._using[request_id] = True
                scheduler.add(seq)
            except PagedCoreError as exc:  # its adapter cannot be loaded, or the pool was rebuilt smaller
                self._held.pop(request_id, None)
                fail(request, f"{type(exc).__name__}: {exc}")

    def finish(self, request: RequestState) -> None:
        """A request is done: its adapter version may go (once no other request uses it)."""
        scheduled = self._using.pop(request.request_id, None)
        self._held.pop(request.request_id, None)
        if scheduled is not None and self.adapters is not None and request.sequence is not None:
            self.adapters.release(request.sequence.namespace, scheduled=scheduled)


def loras_per_prompt(lora: str | Sequence[str | None] | None, count: int) -> list[str | None]:
    """``generate``'s ``lora=``: one adapter name (or None) for every prompt, or one per prompt.

    Example:
        >>> loras_per_prompt("sql", 2), loras_per_prompt(["a", None], 2)
        (['sql', 'sql'], ['a', None])
    """
    if lora is None or isinstance(lora, str):
        return [lora] * count
    names = list(lora)
    if len(names) != count:
        raise InvalidRequestError(f"{len(names)} lora names for {count} prompts", param="lora")
    return names
