"""A linear layer's settled route per input shape, for the Engine's eager decode steps on the CPU (issue 33.2): the C
kernel's call straight from the layer's ``forward`` once every check on the way to it has been passed and its way can
no longer change.

Why: a decode step calls each linear layer once, and the way from the layer's ``forward`` to the kernel
(:meth:`.prepacked.PrepackedLinears.linear`, :meth:`.row_split.RowSplit.linear`, :meth:`.row_kernel.RowKernel.linear`)
re-derives at each call what the first calls decided: about 17 µs a call on the benchmark box, a millisecond a step of
the small model's 56 linears (``python scripts/route_bench.py``).

Exactness first: a route is made only where the row split has settled a layer's shape and row count on the kernel
(its bits checked equal to ``F.linear``'s, in the order it found: :meth:`~.row_split.RowSplit.kernel_order`), and a
settled way never changes. Each call still checks, cheaply, what the route was made for: the same weight and bias
tensors, still float32, contiguous and of their shapes; a float32 contiguous CPU input of the same shape (the routes
are keyed by it); the same thread count; no dispatch mode recording the ops. The layer's forward checks its own part
(the runner's forward active in this thread, no autograd, not compiling). Anything else takes the full way, which
is where the checks' answers came from.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable

import torch
import torch.nn.functional as F

from .row_kernel import PreparedCall

__all__ = ["MAX_ROUTES", "NO_ROUTE", "PLAIN", "Route", "Routes"]

MAX_ROUTES = 512  # shapes kept per layer at most (a decode step's shape per row count: 256 at most, then prefill's)


class Route:
    """One layer's kernel call for one input shape (see the module docstring).

    Example:
        >>> from pagedcore.adapters.transformers import row_kernel
        >>> kernel, weight, x = row_kernel.load(), torch.randn(64, 32), torch.randn(1, 32)
        >>> order = None if kernel is None else kernel.exact_order(x, weight, None, torch.nn.functional.linear(x,
        ...     weight), torch.get_num_threads())
        >>> route = None if order is None else Route(kernel.prepared(x, weight, None, order, torch.get_num_threads()),
        ...     weight, None)
        >>> route is None or (route.serves(x, weight, None), route.serves(x, weight.clone(), None)) == (True, False)
        True
        >>> route is None or torch.equal(route(x, weight, None), torch.nn.functional.linear(x, weight))
        True
    """

    __slots__ = ("_bias", "_bias_shape", "_call", "_threads", "_weight", "_weight_shape")

    def __init__(self, call: PreparedCall, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self._call: PreparedCall | None = call
        self._weight = weakref.ref(weight)  # (a weak reference: a replaced weight is not kept alive by its route)
        self._bias = None if bias is None else weakref.ref(bias)
        self._weight_shape = weight.shape
        self._bias_shape = None if bias is None else bias.shape
        self._threads = torch.get_num_threads()

    def serves(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether this route computes ``F.linear(x, weight, bias)`` for an input of its shape (the caller looked
        the route up by ``x.shape``)."""
        return (
            self.holds_weights(weight, bias)
            and x.dtype is torch.float32
            and x.is_cpu
            and x.is_contiguous()
            and torch.get_num_threads() == self._threads
            and not torch._C._len_torch_dispatch_stack()  # noqa: SLF001 (a mode records the ops: the op form for it)
        )

    def holds_weights(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """The weights' part of :meth:`serves`: ``weight`` and ``bias`` are the tensors the route was made for,
        float32, contiguous, of their shapes. For a caller that checks the rest once for all its routes (the decode
        tape: its inputs are its own buffers, the thread count and the dispatch modes are the step's)."""
        return (
            self._weight() is weight
            and (bias is None if self._bias is None else bias is not None and self._bias() is bias)
            and weight.dtype is torch.float32
            and weight.is_contiguous()
            and weight.shape == self._weight_shape
            and (bias is None or (bias.shape == self._bias_shape and bias.is_contiguous()))
            and (bias is None or bias.dtype is torch.float32)
        )

    def made_for(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` is the tensor this route was made for (it is alive and the same)."""
        return self._weight() is weight

    def outdated(self, weight: torch.Tensor) -> bool:
        """Whether this route should be made again for a call that did not :meth:`serves`: another weight tensor now
        (a replaced parameter; a recycled id), or another thread count (the row split settles each anew)."""
        return not self.made_for(weight) or torch.get_num_threads() != self._threads

    def c_call(self) -> tuple[int, tuple[int, ...]] | None:
        """The kernel call's C function address and its arguments after the four pointers
        (:meth:`.row_kernel.PreparedCall.c_call`); None for a way that is not the kernel (:data:`PLAIN`,
        :data:`NO_ROUTE`)."""
        return None if self._call is None else self._call.c_call()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` through the kernel, for what :meth:`serves`."""
        assert self._call is not None
        return self._call(x, weight, bias)


class _Fixed(Route):
    """A shape whose way settled on other than the kernel (see :data:`NO_ROUTE` and :data:`PLAIN`)."""

    __slots__ = ()

    def __init__(self) -> None:
        self._call = None

    def serves(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        return False

    def holds_weights(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        return False

    def made_for(self, weight: torch.Tensor) -> bool:
        return False

    def outdated(self, weight: torch.Tensor) -> bool:
        return False


NO_ROUTE: Route = _Fixed()  # settled on the row split, or the packs serve it: the full way, without asking again
PLAIN: Route = _Fixed()  # settled on F.linear itself: F.linear straight (exact whatever changed since; only the
# speed of another way, were the threads changed, is forgone)


class Routes:
    """Routes by key, at most ``limit``: a layer's by input shape, the compiled step's op's by (weight id, shape). The
    one rule both follow: :meth:`serve` answers a call its route serves (``F.linear`` straight for :data:`PLAIN`),
    drops a route that is :meth:`Route.outdated`, and leaves the rest to the full way; :meth:`wants` says whether
    the full way's call should then :meth:`keep` a new one.

    Example:
        >>> routes, x, weight = Routes(4), torch.randn(1, 8), torch.randn(8, 8)
        >>> routes.serve("k", x, weight, None, mine=True) is None, routes.wants("k")
        (True, True)
        >>> routes.keep("k", PLAIN); torch.equal(routes.serve("k", x, weight, None, mine=True), F.linear(x, weight))
        True
    """

    __slots__ = ("_limit", "_removed", "_table")

    def __init__(self, limit: int) -> None:
        self._table: dict[Hashable, Route] = {}
        self._limit = limit
        self._removed = 0  # routes dropped so far: a key's route changes only after its removal

    def serve(
        self, key: Hashable, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, mine: bool
    ) -> torch.Tensor | None:
        """The call's output through its route, or None for the full way (``mine``: inside the runner's forward
        in this thread, no autograd)."""
        route = self._table.get(key)
        if route is PLAIN:  # F.linear's bits whatever changed (a recycled id included)
            return F.linear(x, weight, bias)
        if route is None or route is NO_ROUTE or not mine:
            return None
        if route.serves(x, weight, bias):
            return route(x, weight, bias)
        if route.outdated(weight):  # a replaced weight, another thread count: made again after this call
            del self._table[key]
            self._removed += 1
        return None

    @property
    def removed(self) -> int:
        """How many times a route was dropped (a held route is the same object until its key's is dropped)."""
        return self._removed

    def get(self, key: Hashable) -> Route | None:
        """The route held for ``key``, if any."""
        return self._table.get(key)

    def wants(self, key: Hashable) -> bool:
        """Whether a route for ``key`` is to be made after the full way's call (none held, room left)."""
        return key not in self._table and len(self._table) < self._limit

    def keep(self, key: Hashable, route: Route | None) -> None:
        """Hold ``route`` for ``key`` (None: nothing yet, asked again next call)."""
        if route is not None:
            self._table[key] = route

    def __len__(self) -> int:
        return len(self._table)

    def keys(self) -> list[Hashable]:
        """The keys held (for tests and reports)."""
        return list(self._table)

    def __getitem__(self, key: Hashable) -> Route:
        return self._table[key]

    def clear(self) -> None:
        """Drop every route."""
        self._table.clear()
        self._removed += 1
