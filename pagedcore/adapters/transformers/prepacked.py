"""Prepacked linear weights for the Engine's forwards on the CPU: each float32 ``nn.Linear`` weight kept a second time
in oneDNN's packed layout, so a step of a few rows does not repack the weight inside every GEMM call.

Why: on the CPU, MKL's ``sgemm`` behind ``F.linear`` packs the weight into its blocked layout on every call; with the
few rows of a decode step that copy costs as much as the multiplication (``scripts/prepack_bench.py`` measures each
layout: ``F.linear``, a pre-transposed ``mm``, MKL's packed GEMM, oneDNN's packed GEMM). One row is a matrix-vector
product that packs nothing, so one-row calls stay on ``F.linear`` (:data:`MIN_ROWS`).

Exactness first: a pack is used only while its weight is the one it was made from (the same tensor, version counter
and data pointer: an optimizer step, ``load_state_dict`` or a replaced parameter all change one of them), outside
autograd, in float32 on the CPU; otherwise the layer computes with ``F.linear`` as before, and the stale pack is
rebuilt at its next use. The runner also drops every pack when its weights epoch changes (the pool's
:class:`~.weights.WeightsWatch`: :meth:`PrepackedLinears.refresh`). Only the runner's own forwards use the packs
(:meth:`PrepackedLinears.active`, per thread); the model's other users (``generate``, ``enable()``d calls, a
training step) run the stock layer. The cost is memory: a second copy of the linear weights. Opt-in
(``Engine(prepack=True)``): the packed GEMM sums in another order, so logits move by float noise and a greedy
near-tie can go the other way than ``generate`` (docs/benchmarks.md measured one such token in 32 requests).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import row_kernel
from .graph_ops import graph_op
from .linear_routes import MAX_ROUTES, NO_ROUTE, PLAIN, Route, Routes
from .row_split import MAX_ROWS, RowSplit, contiguous, split_blocks, split_linear
from .weights import transparent_forward

__all__ = [
    "MIN_ROWS",
    "ROW_LINEAR",
    "LayerForward",
    "PrepackedLinears",
    "WeightStamp",
    "active_linears",
    "installed_forward",
    "resolve_prepack",
    "row_linear",
]

MIN_ROWS = 2  # a one-row call is a GEMV, which packs nothing: F.linear is as fast (scripts/prepack_bench.py)
PACK_ROWS = 16  # the row count oneDNN is told to expect when it lays a weight out (decode batches)
_STATE = threading.local()  # .active: the PrepackedLinears whose runner's forward this thread is in
# oneDNN's packed linear, as inductor's freezing pass emits it for CPU float32 linears (torch's own ops)
_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise")  # noqa: B009
_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight")  # noqa: B009


def resolve_prepack(prepack: bool | str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a runner prepacks: ``True``, ``False`` or ``"auto"`` (on the CPU in float32, where oneDNN's packed
    GEMM serves a decode step's few rows faster than ``F.linear``).

    Example:
        >>> resolve_prepack("auto", torch.device("cpu"), torch.float32), resolve_prepack("auto", torch.device("cpu"),
        ...     torch.bfloat16)
        (True, False)
    """
    if prepack is True or prepack is False:
        return prepack
    if prepack != "auto":
        from pagedcore.errors import ConfigError

        raise ConfigError(f'prepack must be True, False or "auto", got {prepack!r}', param="prepack")
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


@dataclass
class WeightStamp:
    """What a copy of a weight was made from: the tensor, its version counter and its data pointer (an optimizer step,
    ``load_state_dict`` or a replaced parameter changes one of them). The prepacked linears and the head's screen
    (:mod:`.head_screen`) remake their copies when the stamp is no longer :meth:`fresh`.

    Example:
        >>> weight = torch.ones(2, 2)
        >>> stamp = WeightStamp.of(weight)
        >>> stamp.fresh(weight), (weight.mul_(2), stamp.fresh(weight))[1]
        (True, False)
    """

    weight: weakref.ref[torch.Tensor]
    version: int
    pointer: int

    @classmethod
    def of(cls, weight: torch.Tensor) -> WeightStamp:
        """The stamp of ``weight`` as it is now."""
        version = weight._version  # noqa: SLF001 (torch's version counter: every in-place change bumps it)
        return cls(weakref.ref(weight), version, weight.data_ptr())

    def fresh(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` is the tensor stamped, unchanged since."""
        version = weight._version  # noqa: SLF001
        return self.weight() is weight and version == self.version and weight.data_ptr() == self.pointer


@dataclass
class _Pack:
    """A weight's packed copy and what it was made from."""

    stamp: WeightStamp
    packed: torch.Tensor


class PrepackedLinears:
    """The packed weights of ``model``'s float32 CPU ``nn.Linear`` layers (see the module docstring); each layer's
    ``forward`` routes through :meth:`linear` until :meth:`close`.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> model = tiny_llama()
        >>> packs = PrepackedLinears(model)
        >>> x = torch.randn(1, 3, model.config.hidden_size)
        >>> with torch.inference_mode():
        ...     plain = model.model.layers[0].mlp.up_proj(x)
        ...     with packs.active():
        ...         packed = model.model.layers[0].mlp.up_proj(x)
        >>> torch.allclose(packed, plain, atol=1e-5), packs.num_packed > 0
        (True, True)
        >>> packs.close(); "forward" in vars(model.model.layers[0].mlp.up_proj)
        False
    """

    def __init__(self, model: Any, *, pack: bool = True, split: bool = True, kernel: bool = True) -> None:
        self._packs: dict[int, _Pack] = {}
        self._pack_rows = pack  # False: no packs; few-row calls split across the threads (exact: row_split.py)
        self._split = split  # False: no call is split (F.linear where no pack serves)
        # kernel: the few-row calls may also take row_kernel.py's C kernel (where exact and faster)
        self._row_split = RowSplit(row_kernel.load() if split and kernel else None)
        self._threads = torch.get_num_threads()  # the running forward's (active): a compiled step's split reads it
        self._key = id(self)  # a compiled step finds the settled ways by it (_settled)
        self._op_routes = Routes(8 * MAX_ROUTES)  # few_rows' routes, by weight id and input shape
        _SPLITS[self._key] = self._row_split
        self._lock = threading.Lock()
        self._epoch: int | None = None
        # the layers given a forward, weakly: one the model drops (replaced, quantized in place) is freed at once
        self._modules: list[weakref.ref[torch.nn.Linear]] = []
        for module in model.modules():
            if type(module) is torch.nn.Linear and "forward" not in vars(module) and _packable(module.weight):
                module.forward = _Forward(self, module)  # type: ignore[method-assign,assignment]
                self._modules.append(weakref.ref(module))

    @property
    def packs_rows(self) -> bool:
        """Whether packs serve this runner's calls of 2+ rows (``Engine(prepack=True)``)."""
        return self._pack_rows

    @property
    def num_packed(self) -> int:
        """Layers holding a pack now."""
        return len(self._packs)

    @property
    def packed_bytes(self) -> int:
        """Bytes of the weights the packs copy (the memory prepacking costs)."""
        alive = [m for ref in self._modules if (m := ref()) is not None]
        return sum(m.weight.numel() * m.weight.element_size() for m in alive if id(m) in self._packs)

    def refresh(self, epoch: int) -> None:
        """The weights epoch the runner checked: a new one drops every pack (each is rebuilt at its next use)."""
        if epoch != self._epoch:
            with self._lock:
                self._packs.clear()
                self._epoch = epoch

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The packs serve this thread's linear layers in the block (the runner's forward)."""
        before = getattr(_STATE, "active", None)
        _STATE.active = self
        self._threads = torch.get_num_threads()
        try:
            yield
        finally:
            _STATE.active = before

    @property
    def row_split(self) -> RowSplit:
        """The few-row calls' split across the threads (:mod:`.row_split`: exact, per shape where faster)."""
        return self._row_split

    def few_rows(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, through the row split where this runner splits rows (the compiled step's
        :data:`ROW_LINEAR` op and the fused head call it): straight through a settled route by the weight parameter
        and the input's shape where there is one (:mod:`.linear_routes`), as a layer's own ``forward`` does."""
        if not self._split:
            return F.linear(x, weight, bias)
        key = (id(weight), x.shape)
        out = self._op_routes.serve(key, x, weight, bias, mine=not torch.is_grad_enabled())
        if out is not None:
            return out
        out = self._row_split.linear(x, weight, bias)
        if isinstance(weight, torch.nn.Parameter) and self._op_routes.wants(key):
            self._op_routes.keep(key, self.route(x, weight, bias, packs_serve=False))
        return out

    def linear(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` inside :meth:`active` (float32, no autograd): a few rows through the layer's pack when
        packing (from the weight it was packed from), else through :class:`~.row_split.RowSplit` (one row always;
        up to :data:`~.row_split.MAX_ROWS` rows, and past them where it has the C kernel); else ``F.linear``."""
        weight, bias = module.weight, module.bias
        if torch.compiler.is_compiling():
            return self._traced(x, weight, bias)
        if not self._serves(x, weight):
            return F.linear(x, weight, bias)
        rows = x.numel() // x.shape[-1]
        # past MAX_ROWS (a prefill chunk) the row split serves only where it has the kernel (exact and faster there)
        split_serves = rows <= MAX_ROWS or self._row_split.kernel is not None
        if self._split and (rows == 1 or (not self._pack_rows and split_serves)):
            return self._row_split.linear(x, weight, bias)
        if not self._pack_rows or rows < MIN_ROWS:
            return F.linear(x, weight, bias)
        pack = self._packs.get(id(module))
        if pack is None or not pack.stamp.fresh(weight):
            pack = self._pack(module)
        return _LINEAR(x, pack.packed, bias, "none", [], "")

    def _serves(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether a call may take another way than ``F.linear`` here: inside this runner's forward in this thread,
        no autograd, float32 on the CPU."""
        return (
            getattr(_STATE, "active", None) is self
            and not torch.is_grad_enabled()
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and _packable(weight)
        )

    def route(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, packs_serve: bool
    ) -> Route | None:
        """The route of later calls of this weight with inputs of ``x``'s shape, after a call through :meth:`linear`
        (``packs_serve``: the packs serve its calls of 2+ rows) or :meth:`few_rows`: the kernel's call where the row
        split settled this shape and row count on it, :data:`.linear_routes.PLAIN` where it settled on ``F.linear``,
        :data:`.linear_routes.NO_ROUTE` where another way serves it (the split, the packs; or no split at all), None
        while it is still undecided (or where this call could not tell: another thread, autograd, another dtype or
        device, a dispatch mode)."""
        if not self._serves(x, weight) or not x.shape[-1] or torch._C._len_torch_dispatch_stack():  # noqa: SLF001
            return None
        rows = x.numel() // x.shape[-1]
        if rows > MAX_ROWS:  # a prefill chunk's shape: never a route (the routes would fill with them)
            return None
        kernel = self._row_split.kernel
        if not self._split or (packs_serve and rows > 1) or kernel is None or not contiguous(weight, bias):
            return NO_ROUTE
        threads = torch.get_num_threads()
        shape = (int(weight.shape[0]), int(weight.shape[1]), bias is not None)
        if (way := self._row_split.settled(shape, rows, threads)) is None:
            return None
        if way != "kernel":
            return PLAIN if way == "plain" else NO_ROUTE
        order = self._row_split.kernel_order(shape, rows, threads)
        if order is None or not x.is_contiguous() or not kernel.fits(x, weight, bias):
            return None
        return Route(kernel.prepared(x, weight, bias, order, threads), weight, bias)

    def exact_route(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Route | None:
        """The kernel's call for inputs of ``x``'s shape through this weight wherever the row split found its bits
        equal to ``F.linear``'s at this row count, whichever way its trials chose (:meth:`.row_split.RowSplit.
        exact_order`), else None: what the decode tape (:mod:`.decode_tape`) runs for a layer whose route settled
        on ``F.linear`` or the split, timed alone."""
        kernel = self._row_split.kernel
        if kernel is None or not x.is_contiguous() or not contiguous(weight, bias) or not kernel.fits(x, weight, bias):
            return None
        rows, threads = x.numel() // x.shape[-1], torch.get_num_threads()
        shape = (int(weight.shape[0]), int(weight.shape[1]), bias is not None)
        order = self._row_split.exact_order(shape, rows, threads)
        return None if order is None else Route(kernel.prepared(x, weight, bias, order, threads), weight, bias)

    def _traced(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """A compiled step's linear call: the row split's settled way for the graph's row count, traced (a batched
        product over views of the weight, or ``F.linear``: inductor calls the GEMM from its generated code), else
        one opaque op whose split is decided when the graph runs (:data:`ROW_LINEAR`)."""
        fits = self._split and x.dtype == torch.float32 and x.device.type == "cpu" and _packable(weight)
        if not fits or torch.is_grad_enabled():
            return F.linear(x, weight, bias)
        threads = self._threads  # the thread count of the runner's forward (a guard: another count recompiles)
        if contiguous(weight, bias):
            shape = (int(weight.shape[0]), int(weight.shape[1]), bias is not None)
            way = _settled(self._key, shape, x.numel() // x.shape[-1], threads)
            blocks = split_blocks(shape[0], threads)
            if way == "split" and blocks is not None:
                return split_linear(x, weight, bias, blocks)
            if way == "plain":
                return F.linear(x, weight, bias)
        return ROW_LINEAR(x, weight, bias)

    def _pack(self, module: torch.nn.Linear) -> _Pack:
        weight = module.weight
        with torch.no_grad():
            packed = _REORDER(weight.detach(), PACK_ROWS)
        pack = _Pack(WeightStamp.of(weight), packed)
        with self._lock:
            self._packs[id(module)] = pack
        return pack

    def close(self) -> None:
        """Give every layer its own ``forward`` back and drop the packs."""
        for ref in self._modules:
            module = ref()
            if module is not None and isinstance(vars(module).get("forward"), _Forward):
                del module.forward
        self._modules.clear()
        self._packs.clear()
        self._op_routes.clear()


@transparent_forward
class LayerForward:
    """A ``forward`` a runner installed on one of its model's layers (this module's linears, the fused greedy head of
    :mod:`.argmax_head`): what :func:`installed_forward` finds.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> model = tiny_llama()
        >>> packs = PrepackedLinears(model)
        >>> isinstance(installed_forward(model.lm_head), LayerForward)
        True
        >>> packs.close(); installed_forward(model.lm_head) is None
        True
    """


def installed_forward(module: Any) -> LayerForward | None:
    """The ``forward`` an open runner installed on ``module``, if any (another Engine's, on a model two share).

    Example:
        >>> installed_forward(torch.nn.Linear(2, 2)) is None
        True
    """
    forward = vars(module).get("forward")
    return forward if isinstance(forward, LayerForward) else None


class _Forward(LayerForward):
    """A packed layer's ``forward`` (an object, so :meth:`PrepackedLinears.close` knows its own), with its settled
    routes by input shape (:mod:`.linear_routes`: the kernel's call without the checks on the way to it)."""

    def __init__(self, packs: PrepackedLinears, module: torch.nn.Linear) -> None:
        self._packs = weakref.ref(packs)
        self._module = weakref.ref(module)
        self._routes = Routes(MAX_ROUTES)

    def route(self, x: torch.Tensor) -> Route | None:
        """The route this layer holds for inputs of ``x``'s shape, if any (the decode tape's question:
        :mod:`.decode_tape`)."""
        return self._routes.get(x.shape)

    def routes_removed(self) -> int:
        """:attr:`.linear_routes.Routes.removed` of this layer's routes (a route the tape holds is still the
        layer's while it has not moved)."""
        return self._routes.removed

    def exact_route(self, x: torch.Tensor) -> Route | None:
        """:meth:`PrepackedLinears.exact_route` for this layer's weight and bias (None once its linears closed)."""
        packs, module = self._packs(), self._module()
        return None if packs is None or module is None else packs.exact_route(x, module.weight, module.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        packs, module = self._packs(), self._module()
        assert module is not None
        if packs is None:
            return F.linear(x, module.weight, module.bias)
        if torch.compiler.is_compiling():
            return packs.linear(module, x)
        weight, bias = module.weight, module.bias
        mine = getattr(_STATE, "active", None) is packs and not torch.is_grad_enabled()
        out = self._routes.serve(x.shape, x, weight, bias, mine=mine)
        if out is not None:
            return out
        out = packs.linear(module, x)
        if self._routes.wants(x.shape):
            self._routes.keep(x.shape, packs.route(x, weight, bias, packs_serve=packs.packs_rows))
        return out


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as one op a compiled decode step calls without tracing into it: inside a
    runner's forward (:func:`active_linears`) through its row split (:meth:`PrepackedLinears.few_rows`), which
    checks each row count's bits and times both ways when the step runs; elsewhere ``F.linear``. (Traced, inductor
    would call the same one-thread GEMV for a one-row linear: ``mm`` is an extern call there too.)

    Example:
        >>> weight, x = torch.randn(256, 32), torch.randn(1, 32)
        >>> torch.equal(row_linear(x, weight, None), F.linear(x, weight))
        True
    """
    linears = active_linears()
    return F.linear(x, weight, bias) if linears is None else linears.few_rows(x, weight, bias)


def _row_linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


ROW_LINEAR = graph_op("row_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", row_linear, _row_linear_shape)


_SPLITS: weakref.WeakValueDictionary[int, RowSplit] = weakref.WeakValueDictionary()  # by their linears' id


@torch._dynamo.assume_constant_result  # noqa: SLF001 (a settled way never changes: the graph keeps it, no guard)
def _settled(key: int, shape: tuple[int, int, bool], rows: int, threads: int) -> str | None:
    split = _SPLITS.get(key)
    return None if split is None else split.settled(shape, rows, threads)


def active_linears() -> PrepackedLinears | None:
    """The runner's linear layers whose forward this thread is in (:meth:`PrepackedLinears.active`), if any.

    Example:
        >>> active_linears() is None
        True
    """
    return getattr(_STATE, "active", None)


def _packable(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
