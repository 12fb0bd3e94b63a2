"""The direct layers' decode step as one C call: every decoder layer's C calls, in the direct layers' order with
their arguments, on a tape that ``decode_tape.c`` runs (issue 33.2).

Why: at one decoding row a step of the benchmark's Llama makes about a hundred calls from Python into C (seven
linears, two norms, the rotary embedding with the KV store and the attention per layer, and torch's small ops between
them), and the Python around each costs more than many of the calls themselves: about 14 µs around a linear's 17,
34 µs around the attention's 19, 28 µs around the rotary embedding's store (each piece timed alone; docs/benchmarks.md,
"The decode step as one C call"; ``scripts/direct_toggles_ab.py --part tape`` times the tape against them).

What runs: for a step of ``R`` rows, once every call it would make has settled (each linear on the row kernel
through its route, :mod:`.linear_routes`, or, where its trials chose ``F.linear``, through the kernel's order whose
bits were found equal to ``F.linear``'s, :meth:`.prepacked.PrepackedLinears.exact_route`; the norms summed in
torch's order, :class:`~.direct_layers.DirectKernel`; the attention on the torch backend's decode kernel,
:meth:`~pagedcore.plugins.torch_backend.TorchPagedAttention.decode_rows`), a tape is written with each call's
function pointer and arguments into buffers of its own, and a step then copies the embedding into the first buffer,
writes this step's pointers (the rotary tables, the slots, the decode rows) into the tape, and runs it. The residual
additions and ``silu(gate) * up`` run in the tape's C as torch's CPU kernels compute them (``decode_tape.c``; the
SiLU's width checked against torch's bits once).

Exactness first: each call on the tape is the call the Python would make, with the same arguments, so the same bits;
each tape runs in the step whose calls wrote it, after the Python layers, and the two last hidden states are compared
to the bit (:meth:`Tapes.check_new`; a tape that step could not run: at its first step, :meth:`Tapes.hidden`),
turning the tape off for good with a warning where they differ. Each step checks, before it
runs a tape, that the model still calls what the tape calls (the base model's decoder layers, and each submodule the
tape calls still the one its parent holds by that attribute: a layer replaced, a PEFT adapter injected; the tape
holds every module and the pool's tensors weakly, so a replaced module is freed and the weights watch sees its
tensors go, and a pool that sleeps or is rebuilt frees its memory), and what each
call's own path checks: of every linear what its route's :meth:`~.linear_routes.Route.serves`
checks (the same weight tensors and data, float32, contiguous, of their shapes, the same thread count, no dispatch
mode), its route unmoved and its forward the runner's, unhooked; every called norm and activation still plain (no
hook, no instance ``forward``), the pool's tensors the same, and the torch backend's decode rows for every
KV group (every sequence decoding). Anything else runs the Python layers. ``PAGEDCORE_DECODE_TAPE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pagedcore.c_library import build, can_build_avx2
from pagedcore.plugins import decode_kernel as decode_kernel_module
from pagedcore.plugins.torch_backend import TorchPagedAttention

from .argmax_head import same_bits
from .attention import CONTEXT_KEY, ForwardContext
from .layer_attention import pool_read
from .linear_routes import Route
from .prepacked import _Forward as PackedForward
from .prepacked import active_linears

__all__ = ["ENV", "GRAIN_SIZE", "DecodeTapeKernel", "Tapes", "load", "silu_chunk"]

logger = logging.getLogger("pagedcore")

ENV = "PAGEDCORE_DECODE_TAPE"
RECORD = 24  # int64 slots per record (decode_tape.c)
OP_NORM, OP_LINEAR, OP_ROPE, OP_ATTEND, OP_ADD, OP_SILU_MUL = 1, 2, 3, 4, 5, 6
MAX_TAPES = 256  # row counts kept at most


def _bits(value: float) -> int:
    """A float32's bits in an int64 slot (decode_tape.c's ``as_float``)."""
    return int(np.array([value], dtype=np.float32).view(np.int32)[0]) & 0xFFFFFFFF


def _address(function: Any) -> int:
    return int(ctypes.cast(function, ctypes.c_void_p).value or 0)


class DecodeTapeKernel:
    """``decode_tape.c`` loaded, with torch's own vectorized ``exp`` for its SiLU (Sleef's, from libtorch_cpu).

    Example:
        >>> kernel, gate, up = load(), torch.randn(2, 40), torch.randn(2, 40)
        >>> kernel is None or torch.equal(kernel.silu_mul(gate, up), F.silu(gate) * up)
        True
    """

    def __init__(self, library: ctypes.CDLL, exp8: int) -> None:
        self._run = library.run_tape
        self._run.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        self._run.restype = ctypes.c_int64
        self._silu = library.silu_mul
        self._silu.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        self._silu.restype = None
        self.exp8 = exp8
        self._widths: dict[int, bool] = {}
        self._lock = threading.Lock()

    def run(self, tape: np.ndarray) -> int:
        """Run ``tape`` (records of :data:`RECORD` int64): 0, or 1 + the index of a record its callee refused."""
        return int(self._run(tape.ctypes.data, tape.shape[0]))

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``F.silu(gate) * up`` of contiguous float32 tensors, in the C code (for tests and the width check)."""
        out = torch.empty_like(gate)
        n = gate.numel()
        self._silu(gate.data_ptr(), up.data_ptr(), out.data_ptr(), n, silu_chunk(n, torch.get_num_threads()), self.exp8)
        return out

    def silu_as_torch(self, width: int) -> bool:
        """Whether the C code's ``silu(g) * u`` has torch's bits for rows of ``width`` (checked once per width, on
        values over twelve orders of magnitude of both signs, with infinities and NaNs)."""
        with self._lock:
            if width not in self._widths:
                generator = torch.Generator().manual_seed(width)
                scales = torch.logspace(-6, 6, 8, dtype=torch.float32).unsqueeze(1)
                gate = torch.randn(8, width, generator=generator) * scales
                gate.view(-1)[:: max(1, width // 3)] = float("inf")
                gate.view(-1)[1 :: max(1, width // 2)] = float("-inf")
                gate.view(-1)[2 :: max(1, width // 2)] = float("nan")
                up = torch.randn(8, width, generator=generator)
                self._widths[width] = same_bits(self.silu_mul(gate, up), F.silu(gate) * up)
            return self._widths[width]


GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: elements below which torch's elementwise kernels run on one thread


def silu_chunk(n: int, threads: int) -> int:
    """The elements of each thread's part where torch's SiLU over ``n`` contiguous elements runs on ``threads``
    threads (``TensorIterator::for_each`` and ``at::parallel_for``): each part's loop ends in its own scalar tail.

    Example:
        >>> silu_chunk(1536, 2), silu_chunk(65536, 2), silu_chunk(40000, 4), silu_chunk(40000, 1)
        (1536, 32768, 20000, 40000)
    """
    if n < GRAIN_SIZE or threads < 2:
        return n
    parts = min(threads, -(-n // GRAIN_SIZE))
    return -(-n // parts)


_SOURCE = Path(__file__).with_name("decode_tape.c")
_SOURCE_TEXT = _SOURCE.read_text() if _SOURCE.is_file() else None  # read with this module (see c_library)
_FLAGS = ("-O2", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")
_LOCK = threading.Lock()
_LOADED: list[DecodeTapeKernel | None] = []


def load() -> DecodeTapeKernel | None:
    """The process's tape kernel, built at the first call; None where it cannot serve (no AVX2 torch on x86-64 Linux,
    no C compiler, no Sleef ``exp`` in libtorch_cpu, or ``PAGEDCORE_DECODE_TAPE=0``).

    Example:
        >>> load() is load()
        True
    """
    with _LOCK:
        if not _LOADED:
            _LOADED.append(_build())
        return _LOADED[0]


def _build() -> DecodeTapeKernel | None:
    if not can_build_avx2(ENV):  # (its switch, PAGEDCORE_DECODE_TAPE=0, included)
        return None
    library = build("decode_tape", _SOURCE_TEXT, _FLAGS)
    if library is None:
        return None
    try:
        torch_cpu = ctypes.CDLL(str(Path(torch.__file__).with_name("lib") / "libtorch_cpu.so"))
        exp8 = _address(torch_cpu.Sleef_expf8_u10)
    except (OSError, AttributeError):
        return None
    return DecodeTapeKernel(library, exp8) if exp8 else None


class _NotYet(Exception):
    pass


class _Never(Exception):
    pass


class _Linear:
    """A linear on the tape: what its layer's own call would check, held so that one step checks it quickly."""

    @property
    def module(self) -> Any:
        """The linear module (None once collected)."""
        return self._module()

    def __init__(self, module: Any, forward: PackedForward, check: Route, source: torch.Tensor) -> None:
        weight: torch.Tensor | None = module._parameters.get("weight")  # noqa: SLF001
        bias: torch.Tensor | None = module._parameters.get("bias")  # noqa: SLF001
        if weight is None or weight is not module.weight or bias is not module.bias:
            raise _Never("a linear whose weight is not its parameter")
        assert weight is not None
        self._module = weakref.ref(module)  # (weakly: a replaced layer is not kept alive by its tape)
        self.forward, self.check, self.source = forward, check, source
        self.removed = forward.routes_removed()
        self.pointers = (weight.data_ptr(), 0 if bias is None else bias.data_ptr())

    def holds(self) -> bool:
        """:meth:`.linear_routes.Route.serves` of the tape's input: its weights' part here (the same weight tensors,
        float32, contiguous, of their shapes) at the tape's addresses, the layer's route unmoved, its forward the
        runner's and unhooked; the rest once for the tape (:func:`_calls_hold`: the thread count, no dispatch mode;
        the input is the tape's own buffer, checked when it was written)."""
        module = self._module()
        if module is None or module.__dict__.get("forward") is not self.forward:
            return False
        if module._compiled_call_impl is not None:  # noqa: SLF001
            return False
        if module._forward_hooks or module._forward_pre_hooks:  # noqa: SLF001
            return False
        if module._backward_hooks or module._backward_pre_hooks:  # noqa: SLF001
            return False
        if self.forward.routes_removed() != self.removed:
            return False
        parameters = module._parameters  # noqa: SLF001 (module.weight's own lookup, without __getattr__)
        weight: torch.Tensor | None = parameters.get("weight")
        bias: torch.Tensor | None = parameters.get("bias")
        if weight is None or not self.check.holds_weights(weight, bias):  # the input, threads, modes: _calls_hold
            return False
        return (weight.data_ptr(), 0 if bias is None else bias.data_ptr()) == self.pointers  # the tape's addresses


class _Norm:
    """A norm on the tape: its weight and epsilon as the tape reads them."""

    @property
    def module(self) -> Any:
        """The norm module (None once collected)."""
        return self._module()

    def __init__(self, module: Any, width: int) -> None:
        weight: torch.Tensor | None = module._parameters.get("weight")  # noqa: SLF001
        if weight is None or weight is not module.weight:
            raise _Never("a norm whose weight is not its parameter")
        assert weight is not None
        if weight.dtype != torch.float32 or weight.shape != (width,) or not weight.is_contiguous():
            raise _Never("a norm's weight the C code does not read")
        self._module = weakref.ref(module)
        self.eps, self.pointer = module.variance_epsilon, weight.data_ptr()
        self.weight = weakref.ref(weight)

    def holds(self) -> bool:
        module = self._module()
        if module is None:
            return False
        weight: torch.Tensor | None = module._parameters.get("weight")  # noqa: SLF001
        if weight is None:
            return False
        held = self.weight()
        if held is None or weight is not held or weight.data_ptr() != self.pointer:
            return False
        if weight.dtype is not torch.float32 or not weight.is_contiguous():
            return False
        return bool(module.variance_epsilon == self.eps)


class _Tape:
    """One row count's tape: its records and buffers, what each call stands for, and where each step's pointers
    go (``patches``: record, slot, what, KV group)."""

    def __init__(self, rows: int, threads: int) -> None:
        self.rows, self.threads = rows, threads
        self.records: list[list[int]] = []
        self.buffers: dict[str, torch.Tensor] = {}
        self.linears: list[_Linear] = []
        # modules that must stay exactly of their class and unhooked (weakly held, as every module of a tape)
        self.plain: list[tuple[weakref.ref[Any], type[Any]]] = []
        # where the layers' forward finds each module the tape calls: the decoder layers the base model runs, and
        # (parent, attribute, module) for each submodule the writer followed (a layer's attention, its linears...)
        self.layers: list[weakref.ref[Any]] = []
        self.tree: list[tuple[weakref.ref[Any], str, weakref.ref[Any]]] = []
        self.norms: list[_Norm] = []
        self.pools: dict[int, int] = {}  # KV group -> a layer of it (whose key/value caches the attention reads)
        # each layer's key and value caches, weakly: a pool that sleeps or is rebuilt frees them (the tape is then
        # stale: written again)
        self.layer_pools: list[tuple[int, weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]] = []
        self.windows: dict[int, int | None] = {}  # group -> the window its layers hand the attention
        # each attention module with what the tape took of it as numbers (its scale, head size, layer index and
        # window): set by a caller between steps, they must be read again (the records hold the old ones)
        self.settings: list[tuple[weakref.ref[Any], tuple[Any, ...]]] = []
        self.window_of: Callable[[Any], int | None] = _no_window
        self.patches: list[tuple[int, int, str, int]] = []
        self.head_dim = self.groups_per_kv = 0
        self.where = np.zeros(0, dtype=np.int64)  # each patch's element of the flat tape
        self.keys: list[tuple[str, int]] = []  # the distinct (what, group) the patches take, each step's values
        self.key_of = np.zeros(0, dtype=np.int64)  # per patch: its key's index (a layer's patches repeat the keys)
        self.tape = np.zeros((0, RECORD), dtype=np.int64)
        self.keep: dict[Any, Any] = {}  # this step's tensors the tape points into
        self.verified = False
        self.stale = False  # a layer's pool is another now

    def buffer(self, name: str, width: int) -> torch.Tensor:
        if name not in self.buffers:
            self.buffers[name] = torch.empty(1, self.rows, width, dtype=torch.float32)
        return self.buffers[name]

    def add(self, record: list[int], patches: tuple[tuple[int, str, int], ...] = ()) -> None:
        for slot, what, group in patches:
            self.patches.append((len(self.records), slot, what, group))
        self.records.append(record + [0] * (RECORD - len(record)))

    def finish(self) -> _Tape:
        self.tape = np.array(self.records, dtype=np.int64)
        self.where = np.array([r * RECORD + s for r, s, _, _ in self.patches], dtype=np.int64)
        index: dict[tuple[str, int], int] = {}
        self.key_of = np.array([index.setdefault((what, group), len(index)) for _, _, what, group in self.patches],
                               dtype=np.int64)  # fmt: skip
        self.keys = list(index)
        return self


class Tapes:
    """The direct layers' tapes by row count (see the module docstring), for one model.

    Example:
        >>> from pagedcore.adapters.transformers import Engine, SamplingParams
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> model = tiny_llama()
        >>> engine = Engine(model, num_blocks=32, block_size=4)
        >>> reference = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=12, do_sample=False)
        >>> out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=12))
        >>> out[0].token_ids == reference[0, 3:].tolist()
        True
    """

    def __init__(self, kernel: DecodeTapeKernel) -> None:
        self._kernel = kernel
        self._tapes: dict[int, _Tape | None] = {}  # None: this row count is not taped
        self.off = False
        self.runs = 0  # steps a tape ran

    def __len__(self) -> int:
        return sum(tape is not None for tape in self._tapes.values())

    def hidden(self, direct: Any, inner: Any, layers: list[Any], hidden: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor | None:  # fmt: skip
        """The last hidden states before the final norm through this row count's tape, or None (the caller runs the
        Python layers): no tape yet, or not valid this step. A tape's first step is checked against the Python
        layers (``direct.layers_hidden``), which then write the same slots again."""
        tape = None if self.off or hidden.dim() != 3 else self._tapes.get(hidden.shape[1])
        if tape is None:
            return None
        if tape.stale or not _calls_hold(tape, layers):  # a module, weight, route or pool changed: written again
            del self._tapes[tape.rows]
            return None
        if not self._step_fits(tape, hidden, cos, sin, kwargs):
            return None
        out = self._run(tape, hidden)
        if out is None:  # a callee refused its arguments: the Python layers redo the step (and write its slots)
            return None
        if not tape.verified:
            theirs: torch.Tensor = direct.layers_hidden(inner, hidden, cos, sin, kwargs)
            if not self._verify(tape, out, theirs):
                return theirs
        self.runs += 1
        return out

    def check_new(self, direct: Any, inner: Any, layers: list[Any], hidden: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, kwargs: dict[str, Any], theirs: torch.Tensor) -> None:  # fmt: skip
        """After the Python layers computed ``theirs`` from ``hidden`` and :meth:`offer` wrote this row count's tape:
        check the tape at once on this step's inputs, so that its first step to serve runs it alone (a row count
        met a few steps a run was otherwise checked a run later, at twice a step's cost). The tape writes this step's
        keys and values again, the same bits where it is right; where it is not, the Python layers write them once
        more and the tape is off. A tape this step does not fit is checked at its first step (:meth:`hidden`)."""
        tape = None if self.off or hidden.dim() != 3 else self._tapes.get(hidden.shape[1])
        if tape is None or tape.verified or not _calls_hold(tape, layers):
            return
        if not self._step_fits(tape, hidden, cos, sin, kwargs):
            return
        out = self._run(tape, hidden)
        if out is None or not self._verify(tape, out, theirs):
            direct.layers_hidden(inner, hidden, cos, sin, kwargs)  # this step's slots as the Python layers write them

    def _run(self, tape: _Tape, hidden: torch.Tensor) -> torch.Tensor | None:
        """``tape`` run on ``hidden`` (its pointers patched for this step): the last hidden states, or None (and the
        tape off, with a warning) where a callee refused its arguments."""
        tape.buffers["hidden"].copy_(hidden)
        failed = self._kernel.run(tape.tape)
        tape.keep.clear()
        if failed:
            logger.warning("pagedcore: the decode tape's record %d was refused: the Python layers run", failed - 1)
            self.off = True
            return None
        return tape.buffers["hidden"].clone()

    def _verify(self, tape: _Tape, out: torch.Tensor, theirs: torch.Tensor) -> bool:
        """Whether the tape's first output has the Python layers' bits (False: the tape off for good, a warning)."""
        if not same_bits(out, theirs):
            logger.warning("pagedcore: the decode tape gave other hidden states than the direct layers: the "
                           "Python layers run from here on")  # fmt: skip
            self.off = True
            return False
        tape.verified = True
        return True

    def offer(self, classes: Any, layers: list[Any], direct: Any, hidden: torch.Tensor, cos: torch.Tensor,
              kwargs: dict[str, Any]) -> None:  # fmt: skip
        """After a step the Python layers ran: write this row count's tape where every call has settled (``layers``:
        the decoder layers the base model runs; ``direct``: the direct layers' :class:`~.direct_layers.DirectKernel`,
        whose norm and rotary store the tape calls)."""
        rows = hidden.shape[1] if hidden.dim() == 3 else 0
        if self.off or rows in self._tapes or len(self._tapes) >= MAX_TAPES or hidden.shape[0] != 1:
            return
        try:
            self._tapes[rows] = _write(self._kernel, classes, layers, direct, hidden, cos, kwargs).finish()
        except _NotYet:
            return
        except _Never as why:
            logger.debug("pagedcore: no decode tape for %d rows: %s", rows, why)
            self._tapes[rows] = None

    def _step_fits(self, tape: _Tape, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kwargs: dict[str, Any]) -> bool:  # fmt: skip
        """This step is one the tape computes: its inputs' shapes, the runner's forward, the thread count."""
        rows = tape.rows
        if hidden.shape != tape.buffers["hidden"].shape or hidden.dtype != torch.float32:
            return False
        if active_linears() is None or torch.get_num_threads() != tape.threads:
            return False
        if cos.shape != (1, rows, tape.head_dim) or sin.shape != cos.shape or cos.dtype != torch.float32:
            return False
        if sin.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous():
            return False
        return self._patch(tape, kwargs["cache"], kwargs.get(CONTEXT_KEY), cos, sin)

    def _patch(self, tape: _Tape, cache: Any, ctx: Any, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """This step's pointers into the tape (False: a pool, the slots or the decode rows are not the tape's)."""
        if type(ctx) is not ForwardContext or ctx.trace is not None or ctx.real_index is not None:
            return False
        if ctx.new_tokens is not None:
            return False
        pool = ctx.pool
        caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, keys, values in tape.layer_pools:
            _, key_cache, value_cache = pool_read(pool, layer)
            if key_cache is not keys() or value_cache is not values():
                tape.stale = True  # written again after this step
                return False
            caches[layer] = key_cache, value_cache
        backend = pool.attention_backend(cos.device, torch.float32, ctx.backend)
        if type(backend) is not TorchPagedAttention:
            return False
        found: dict[tuple[str, int], int] = {("cos", 0): cos.data_ptr(), ("sin", 0): sin.data_ptr()}
        longest = 1
        query = tape.buffers["rotated"].view(tape.rows, -1, tape.head_dim)
        for group, layer in tape.pools.items():
            key_cache, value_cache = caches[layer]
            meta = ctx.metadata[group] if group < len(ctx.metadata) else None
            window = tape.windows[group]
            if meta is None or (window is not None and meta.sliding_window != window):
                return False
            rows = backend.decode_rows(query, key_cache, value_cache, meta)
            if rows is None or len(rows.rows) != tape.rows:
                return False
            slots = cache.slots(layer, cos.device)
            if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.numel() != tape.rows:
                return False
            tape.keep[group] = (rows, slots)
            found.update({
                ("slots", group): slots.data_ptr(), ("tables", group): rows.tables.data_ptr(),
                ("width", group): rows.tables.shape[1], ("rows", group): rows.rows.data_ptr(),
                ("table_rows", group): rows.table_rows.data_ptr(), ("first", group): rows.first.data_ptr(),
                ("length", group): rows.length.data_ptr(), ("dropped", group): rows.dropped.data_ptr(),
                ("max_length", group): rows.max_length,
            })  # fmt: skip
            longest = max(longest, rows.max_length)
        scratch = torch.empty(tape.threads * tape.groups_per_kv * longest, dtype=torch.float32)
        tape.keep["scratch"] = scratch
        found[("scratch", 0)] = scratch.data_ptr()
        pointers = np.array([found[key] for key in tape.keys], dtype=np.int64)
        tape.tape.reshape(-1)[tape.where] = pointers[tape.key_of]
        return True


def _calls_hold(tape: _Tape, layers: list[Any]) -> bool:
    """What each call's own path checks of its module, once for the step (module docstring): ``layers`` (the decoder
    layers the base model runs now) and each submodule the tape calls still the ones it was written from, each
    reached by the same attribute (a layer, a linear or a norm replaced, a PEFT adapter injected: the tape would run
    the old ones); every called norm and activation still of its class and unhooked (``DirectLayers.serves`` checks
    the bypassed modules each step), every norm's and linear's weight the tape's (the same tensor and data), every
    linear's route the tape's and still serving it, no dispatch mode recording the ops."""
    if torch._C._len_torch_dispatch_stack() or torch.get_num_threads() != tape.threads:  # noqa: SLF001
        return False  # (each route serves the thread count it was made for, the tape's: checked when written)
    if len(layers) != len(tape.layers) or any(ref() is not layer for ref, layer in zip(tape.layers, layers)):
        return False
    module: Any
    for parent_ref, name, ref in tape.tree:  # parents first: each checked against the model's tree above it
        parent, module = parent_ref(), ref()
        if parent is None or module is None or parent._modules.get(name) is not module:  # noqa: SLF001
            return False
    for ref, cls in tape.plain:
        module = ref()
        if type(module) is not cls or module._forward_hooks or module._forward_pre_hooks:  # noqa: SLF001
            return False
        if module._backward_hooks or module._backward_pre_hooks or "forward" in module.__dict__:  # noqa: SLF001
            return False
    window = tape.window_of
    for ref, taken in tape.settings:
        attn = ref()
        if attn is None or (attn.scaling, attn.head_dim, attn.layer_idx, window(attn)) != taken:
            return False
    return all(norm.holds() for norm in tape.norms) and all(linear.holds() for linear in tape.linears)


def _no_window(attention: Any) -> int | None:
    """A tape with no attention layer reads no window."""
    return None


def _write(kernel: DecodeTapeKernel, classes: Any, layers: list[Any], direct: Any, hidden: torch.Tensor,
           cos: torch.Tensor, kwargs: dict[str, Any]) -> _Tape:  # fmt: skip
    """The tape of a step of ``hidden``'s rows of this model: the direct layers' calls with their arguments (raises
    :class:`_NotYet` where a call has not settled, :class:`_Never` where one never will be a C call)."""
    ctx = kwargs.get(CONTEXT_KEY)
    if type(ctx) is not ForwardContext:
        raise _Never("not the Engine's packed forward")
    tape = _Tape(hidden.shape[1], torch.get_num_threads())
    writer = _Writer(kernel, direct, classes, ctx, tape, int(hidden.shape[-1]))
    for layer in layers:
        tape.layers.append(weakref.ref(layer))
        writer.layer(layer, cos)
    tape = writer.tape
    if not tape.pools:
        raise _Never("no attention layers")
    if not _calls_hold(tape, layers):  # a hooked module: asked again next step
        raise _NotYet
    return tape


class _Writer:
    """Writes a tape's records, layer by layer, from the modules and their settled calls."""

    def __init__(self, kernel: DecodeTapeKernel, direct: Any, classes: Any, ctx: ForwardContext, tape: _Tape,
                 width: int) -> None:  # fmt: skip
        decode = decode_kernel_module.load()
        if direct is None or decode is None or direct._lanes is None:  # noqa: SLF001
            raise _Never("no C kernels")
        if direct.sums_as_torch(torch.zeros(1, width)) is False:
            raise _Never("the norm's sum is not torch's at this width")
        self.kernel, self.classes, self.ctx, self.tape, self.width = kernel, classes, ctx, tape, width
        self.direct = direct
        self.lanes = direct._lanes  # noqa: SLF001
        self.norm_fn, self.rope_fn = _address(direct._norm), _address(direct._rope)  # noqa: SLF001
        self.attend_fn = _address(decode._function)  # noqa: SLF001

    def child(self, parent: Any, name: str) -> Any:
        """``parent``'s submodule ``name`` (what ``parent.name`` finds), recorded with where it was found: each step
        checks the model still has it there (:func:`_calls_hold`)."""
        module = parent._modules.get(name)  # noqa: SLF001
        if module is None:
            raise _Never(f"no submodule {name}")
        self.tape.tree.append((weakref.ref(parent), name, weakref.ref(module)))
        return module

    def norm(self, module: Any, source: torch.Tensor, target: torch.Tensor, width: int | None = None) -> None:
        """A norm over rows of ``width`` (the hidden size; a head's for Qwen3's query and key norms)."""
        width = width or self.width
        norm = _Norm(module, width)
        if width != self.width and self.direct.sums_as_torch(torch.zeros(1, width)) is False:
            raise _Never("the norm's sum is not torch's at this width")
        self.tape.plain.append((weakref.ref(module), self.classes.norm))
        self.tape.norms.append(norm)
        self.tape.add([OP_NORM, self.norm_fn, source.data_ptr(), norm.pointer, _bits(norm.eps), target.data_ptr(),
                       source.numel() // width, width, self.lanes])  # fmt: skip

    def linear(self, module: Any, source: torch.Tensor, name: str) -> torch.Tensor:
        forward = module.__dict__.get("forward")
        if not isinstance(forward, PackedForward):
            raise _Never("a linear without the runner's forward")
        route = forward.route(source)
        if route is None:
            raise _NotYet
        # Settled on F.linear or the split, timed alone: the kernel's call where its bits were found F.linear's
        # (on the tape it costs its C time alone; another way would break the tape).
        check = route if route.c_call() is not None else forward.exact_route(source)
        call = None if check is None else check.c_call()
        if check is None or call is None:
            raise _Never("a linear the row kernel does not compute with F.linear's bits")
        weight, bias = module.weight, module.bias
        if not check.serves(source, weight, bias):
            raise _NotYet
        target = self.tape.buffer(name, int(weight.shape[0]))
        linear = _Linear(module, forward, check, source)
        self.tape.linears.append(linear)
        function, args = call
        self.tape.add([OP_LINEAR, function, source.data_ptr(), *linear.pointers, target.data_ptr(), *args])
        return target

    def layer(self, layer: Any, cos: torch.Tensor) -> None:
        """One decoder layer: LlamaDecoderLayer.forward's steps, as the direct layers run them."""
        tape, classes, width = self.tape, self.classes, self.width
        attention, mlp = self.child(layer, "self_attn"), self.child(layer, "mlp")
        act = self.child(mlp, "act_fn")
        if type(act) not in _silu_classes():
            raise _Never("an activation other than SiLU")
        tape.plain.append((weakref.ref(act), type(act)))
        hidden, normed = tape.buffer("hidden", width), tape.buffer("normed", width)
        after, projected = tape.buffer("after_attention", width), tape.buffer("projected", width)
        self.norm(self.child(layer, "input_layernorm"), hidden, normed)
        q, k, v = (self.linear(self.child(attention, "q_proj"), normed, "q"),
                   self.linear(self.child(attention, "k_proj"), normed, "k"),
                   self.linear(self.child(attention, "v_proj"), normed, "v"))  # fmt: skip
        if classes.head_norms:  # Qwen3Attention: each query and key head normalized before the rotary embedding
            d = int(attention.head_dim)
            q_normed, k_normed = tape.buffer("q_normed", q.shape[-1]), tape.buffer("k_normed", k.shape[-1])
            self.norm(self.child(attention, "q_norm"), q, q_normed, d)
            self.norm(self.child(attention, "k_norm"), k, k_normed, d)
            q, k = q_normed, k_normed
        attended = self.attention(attention, q, k, v, cos)
        if self.linear(self.child(attention, "o_proj"), attended, "projected") is not projected:
            raise _Never("an output projection not of the hidden size")
        tape.add([OP_ADD, hidden.data_ptr(), projected.data_ptr(), after.data_ptr(), tape.rows * width])
        self.norm(self.child(layer, "post_attention_layernorm"), after, normed)
        gate = self.linear(self.child(mlp, "gate_proj"), normed, "gate")
        up = self.linear(self.child(mlp, "up_proj"), normed, "up")
        if gate.shape != up.shape or not self.kernel.silu_as_torch(int(gate.shape[-1])):
            raise _Never("a SiLU whose bits are not torch's at this width")
        product = tape.buffer("product", int(gate.shape[-1]))
        n = gate.numel()
        tape.add([OP_SILU_MUL, gate.data_ptr(), up.data_ptr(), product.data_ptr(), n, silu_chunk(n, tape.threads),
                  self.kernel.exp8])  # fmt: skip
        down = self.linear(self.child(mlp, "down_proj"), product, "down")
        if down.shape != hidden.shape:
            raise _Never("an MLP whose output is not the hidden size")
        tape.add([OP_ADD, after.data_ptr(), down.data_ptr(), hidden.data_ptr(), tape.rows * width])

    def attention(self, attention: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cos: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The rotary embedding with the KV store, and the decode kernel's attention: their records."""
        tape, rows, spec = self.tape, self.tape.rows, self.ctx.pool.spec
        index = attention.layer_idx
        layer_spec = spec.layers[index]
        if spec.source(index) != index or layer_spec.latent is not None or layer_spec.query_temperature is not None:
            raise _Never("a layer that reads another's keys, a latent, or a query temperature")
        d = int(attention.head_dim)
        heads, kv_heads = q.shape[-1] // d, k.shape[-1] // d
        dv = v.shape[-1] // max(1, kv_heads)
        if cos.shape != (1, rows, d) or d % 2 or not kv_heads or heads % kv_heads:
            raise _Never("a rotary table or heads the kernels do not take")
        group, keys, values = pool_read(self.ctx.pool, index)
        if keys.dtype != torch.float32 or values.dtype != torch.float32 or not keys.is_contiguous():
            raise _Never("a pool layout the kernels do not read")
        if not values.is_contiguous() or keys.shape[-2:] != (kv_heads, d) or values.shape[-2:] != (kv_heads, dv):
            raise _Never("a pool layout the kernels do not read")
        window = self.classes.window(attention)
        if tape.windows.setdefault(group, window) != window:
            raise _Never("layers of one KV group with different windows")
        tape.head_dim, tape.groups_per_kv = d, heads // kv_heads
        tape.window_of = self.classes.window
        tape.settings.append((weakref.ref(attention), (attention.scaling, attention.head_dim, index, window)))
        tape.layer_pools.append((index, weakref.ref(keys), weakref.ref(values)))
        tape.pools.setdefault(group, index)
        rotated, attended = tape.buffer("rotated", heads * d), tape.buffer("attended", heads * dv)
        tape.add([OP_ROPE, self.rope_fn, q.data_ptr(), heads * d, k.data_ptr(), kv_heads * d, v.data_ptr(),
                  kv_heads * dv, 0, 0, rotated.data_ptr(), keys.data_ptr(), values.data_ptr(), 0, rows, heads, kv_heads,
                  d, dv],
                 ((8, "cos", 0), (9, "sin", 0), (13, "slots", group)))  # fmt: skip
        tape.add([OP_ATTEND, self.attend_fn, rotated.data_ptr(), keys.data_ptr(), values.data_ptr(), 0, 0, 0, 0, 0, 0,
                  0, rows, heads, kv_heads, d, dv, int(keys.shape[1]), _bits(attention.scaling), attended.data_ptr(),
                  0, 0, tape.threads],
                 ((5, "tables", group), (6, "width", group), (7, "rows", group), (8, "table_rows", group),
                  (9, "first", group), (10, "length", group), (11, "dropped", group), (20, "scratch", 0),
                  (21, "max_length", group)))  # fmt: skip
        return attended


def _silu_classes() -> tuple[type[Any], ...]:
    from transformers.activations import SiLUActivation

    return (SiLUActivation, torch.nn.SiLU)
