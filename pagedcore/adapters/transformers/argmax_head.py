"""The greedy choice fused into the model's output projection, for the Engine's steps on the CPU (issue 33.3: greedy
choice without a separate full pass over the logits).

A step whose every row only takes its argmax (greedy, no log-probabilities, no returned logits, no logits
processor, no grammar, no prompt scores: :attr:`ForwardBatch.argmax_only
<pagedcore.engine.runner.ForwardBatch.argmax_only>`) does not need its ``(rows, vocab)`` logits. Computed whole, they
are written to memory by the head's GEMM (32 MB at 256 rows of a 32000-token vocabulary: more than the caches hold)
and read back by the sampler's argmax. Here the head's call inside the model's forward projects its input a chunk of
the vocabulary at a time (:func:`chunk_columns`), takes each chunk's argmax while its logits are still in the caches
and returns an empty tensor (nothing reads it): :class:`~pagedcore.engine.runner.ArgmaxTokens` come back instead of
logits. The pass stays inside the forward, so that what times a model's forward (a profiler, ``pagedcore bench``'s
forward hooks) times the head's pass with it.

Exactness first: the tokens are those the sampler would pick from the logits transformers' own head computes.

1. The model must return its head's output untouched (no softcapping, scaling or other op after the head, one head
   call per forward): the first eligible step runs the normal way with the head's output recorded and compares it
   with the logits the model returned; a model that changed them does not take this path. What the model's code
   does after the head is fixed, but hooks are not: the check runs again whenever the forward hooks of the head or
   of the model, the model's class or instance ``forward``, or the global forward hooks change (a hook on the head
   would be handed the chunked way's empty output).
2. The chunked GEMM must give the bits of the whole one: a BLAS may sum in another order for another shape, so the
   first eligible step of each row count (and thread count) runs the normal way and computes three of its chunks
   beside it (the first, the second and the last: every chunk between has the second's shape, and its weight's
   alignment), compared bit for bit; a shape whose bits differ keeps the normal path.
3. A row whose chunks hold a NaN or an infinite maximum, or no finite value, is what the sampler handles
   (:func:`~pagedcore.engine.sampling.greedy_tokens`' reference ops, or the row's failure): the head then computes
   the step's whole logits (its own GEMM), which the model returns as usual.

A third way, where the row kernel builds or torch has fbgemm's float16-weight GEMM (x86) and the head has no bias:
the screen (:mod:`.head_screen`) computes approximate logits from a quarter (the kernel's int8 copy) or half
(fbgemm's float16 one) of the head's bytes, keeps the columns whose
approximate logit is within a proven bound of the row's maximum, and computes those columns exactly with ``F.linear``
on their gathered weight rows; the first maximal one is the token. Per shape (rows, exact columns, threads) the first
such step also computes the whole GEMM and checks the exact columns' bits and the bound itself (a failed bound turns
the screen off, with a warning); a shape whose bits differ, or a step the screen cannot serve (non-finite values,
candidates over a quarter of the vocabulary), takes the chunks. With the screen one-row steps take this path too.

Which way is fastest depends on the machine's caches and the row count: where the whole logits fit in a large
last-level cache, reading them back is cheap and the chunks' smaller GEMMs can lose (docs/benchmarks.md, "The greedy
choice inside the head"); the screen wins where the head's weight read dominates (few rows). So each power-of-two
bucket of row counts (per thread count) is measured in the Engine's own steps: its first :data:`TRIALS` steps each
way, in turn, take their tokens by the chunks, by the whole GEMM and one argmax pass over it (what the logits path
costs) or by the screen, timed inside the head (a shape's check step and the making of the screen's copy are not
timed); the way with the lower median time per row serves the bucket from then on (:attr:`ArgmaxHead.ways`). Every
way gives the same tokens, so the choice changes only the time.

Only the runner's own forwards take this path (per thread, inside :meth:`ArgmaxHead.step`): ``generate``, an
``enable()``d call or a training step on another thread runs the head's plain ``F.linear``. The head is used as it is
at each call (its weight after an optimizer step too): nothing is cached but the answers of the checks, which depend
on the model's code and the GEMM's shapes, not on the weights' values, and the screen's low-precision copy, remade
when the weight changes. Installed only on a plain float32 ``nn.Linear`` head on the CPU whose ``forward`` nobody
replaced (prepacked linears take the head first: then not).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pagedcore.adapters.transformers import head_screen
from pagedcore.adapters.transformers.graph_ops import graph_op
from pagedcore.adapters.transformers.hook_ids import counted, global_hooks
from pagedcore.adapters.transformers.prepacked import LayerForward, active_linears
from pagedcore.adapters.transformers.row_kernel import RowKernel
from pagedcore.engine.runner import ArgmaxTokens
from pagedcore.engine.sampling import numpy_greedy

__all__ = ["HEAD_CALL", "MIN_ROWS", "TRIALS", "ArgmaxCounts", "ArgmaxHead", "chunk_columns", "head_call"]

logger = logging.getLogger(__name__)
_STATE = threading.local()  # .call: the _Call of the ArgmaxHead.step this thread is in
CHUNK_BYTES = 512 << 10  # one chunk's logits: about an L2 cache's worth (scripts/argmax_head_bench.py)
MIN_COLUMNS, MAX_COLUMNS = 512, 4096
MIN_ROWS = 2  # one row: the whole head is a matrix-vector product, faster than its chunks (lm_head_greedy_bench.py)
TRIALS = 3  # steps each way before a bucket of row counts keeps the faster (module docstring)
WAYS = ("chunks", "whole", "screen")  # the screen: where the row kernel or fbgemm's float16 GEMM exists (head_screen)
_clock = time.perf_counter  # the trials' clock (a test drives its own)


def chunk_columns(rows: int) -> int:
    """Vocabulary columns per chunk for ``rows`` rows: the power of two whose float32 logits come closest below
    :data:`CHUNK_BYTES`, within 512 and 4096 columns.

    Example:
        >>> chunk_columns(1), chunk_columns(64), chunk_columns(256), chunk_columns(4096)
        (4096, 2048, 512, 512)
    """
    fit = CHUNK_BYTES // (4 * max(rows, 1))
    return min(MAX_COLUMNS, max(MIN_COLUMNS, 1 << (fit.bit_length() - 1) if fit else 0))


@dataclass
class ArgmaxCounts:
    """The fused head's counters: ``steps`` served by it (tokens taken inside the head), of which ``whole`` by the
    whole GEMM and one pass and ``screened`` by the screen (:mod:`.head_screen`; each the bucket's faster way,
    or its trial), ``checks`` (eligible steps run the normal way to check a model or a shape, or whose screen
    checked a shape), ``fallbacks`` (steps whose logits held a NaN or an infinity: the sampler's rules).

    Example:
        >>> ArgmaxCounts().steps
        0
    """

    steps: int = 0
    whole: int = 0
    screened: int = 0
    checks: int = 0
    fallbacks: int = 0


@dataclass
class _Call:
    """One :meth:`ArgmaxHead.step` in progress: whether the head takes the argmax itself (``capture``), what it saw,
    the tokens it took."""

    head: ArgmaxHead
    capture: bool
    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    tokens: list[int] | None = None
    padded: int = 0  # a compiled step's bucket: the head's input has this many rows, the step's rows first
    way: str = "chunks"
    screened: bool = False  # the tokens came from the screen (its way can fall back to the chunks)


class ArgmaxHead:
    """The fused greedy head of ``model`` (see the module docstring); build it with :meth:`install`.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> model = tiny_llama().eval()
        >>> head = ArgmaxHead.install(model)
        >>> ids = torch.tensor([[1, 5, 9], [3, 4, 2]])
        >>> def logits():
        ...     return model(ids, logits_to_keep=1).logits[:, -1]
        >>> with torch.inference_mode():
        ...     first, second = head.step(logits, 2), head.step(logits, 2)   # the first checks, the second is fused
        >>> second.tokens == first.argmax(-1).tolist(), head.counts
        (True, ArgmaxCounts(steps=1, whole=0, screened=0, checks=1, fallbacks=0))
        >>> head.close(); "forward" in vars(model.lm_head)
        False
    """

    def __init__(
        self, module: torch.nn.Linear, way: str = "auto", kernel: RowKernel | None = None, model: Any = None
    ) -> None:
        if way not in ("auto", *WAYS):
            raise ValueError(f"way must be 'auto', 'chunks', 'whole' or 'screen', got {way!r}")
        screens = module.bias is None and (kernel is not None or head_screen.available())
        if way == "screen" and not screens:
            raise ValueError(
                "way='screen' needs a low-precision product (the row kernel's, or fbgemm's: torch's x86 CPU build) and "
                "a head without bias"
            )
        self._module_ref = weakref.ref(module)  # (weakly: a head replaced in the model is freed, not kept by this)
        self._model_ref = weakref.ref(model) if model is not None else None  # whose forward returns the head's output
        self._around: tuple[Any, ...] | None = None  # what check 1's answer was found with (:meth:`_hooks_around`)
        self._screen = head_screen.HeadScreen(kernel) if screens else None
        self._screen_shapes: dict[tuple[int, int, int], bool] = {}  # (rows, columns, threads): bits and bound hold
        self._ways_here = WAYS if screens else WAYS[:2]
        self._min_rows = 1 if screens else MIN_ROWS  # one row: the screen reads a quarter or half of the GEMV's bytes
        self._plain: bool | None = None  # the model returns the head's output untouched (check 1)
        self._exact: dict[tuple[int, int], bool] = {}  # (rows, threads): the chunks' bits are the whole GEMM's
        self._way = way  # "auto": each bucket's measured faster way; else that way always
        self._ways: dict[tuple[int, int], str] = {}  # (bucket's first row count, threads): the faster way
        self._trials: dict[tuple[int, int], dict[str, list[float]]] = {}  # seconds per row, each way, so far
        self.counts = ArgmaxCounts()
        module.forward = _Forward(self)  # type: ignore[method-assign,assignment]

    @classmethod
    def install(cls, model: Any, kernel: RowKernel | None = None) -> ArgmaxHead | None:
        """The fused head of ``model``, or None where it does not apply (module docstring); its screen's product by
        ``kernel`` where given (:class:`~.head_screen.HeadScreen`)."""
        module = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if type(module) is not torch.nn.Linear or "forward" in vars(module):
            return None
        return cls(module, kernel=kernel, model=model) if _fusable(module.weight) else None

    @property
    def ways(self) -> dict[tuple[int, int], str]:
        """The way each measured bucket keeps: ``(first row count of the bucket, threads) -> "chunks" | "whole"``;
        a bucket serves the row counts from its first up to twice that, exclusive."""
        return dict(self._ways)

    def step(self, forward: Callable[[], torch.Tensor], rows: int, padded: int = 0) -> torch.Tensor | ArgmaxTokens:
        """One argmax-only step of ``rows`` rows: ``forward()`` runs the model and returns its logits ``(rows,
        vocab)`` (a view of the head's output); returns the rows' tokens, or the float32 logits where the row count
        (:data:`MIN_ROWS`), a check or a row's values say so. ``padded``: a compiled decode step's bucket of rows
        (:mod:`.compiled`), whose head sees ``padded`` rows, the step's ``rows`` first."""
        module = self._module_ref()
        if module is None:
            return forward().float()  # the head replaced
        around = self._hooks_around(module)
        if around != self._around:  # a hook added or removed around the head since check 1: it runs again
            self._around, self._plain = around, None
        if rows < self._min_rows or self._plain is False or not _fusable(module.weight):
            return forward().float()  # e.g. the head converted to bf16 since
        call = _Call(self, capture=bool(self._plain), padded=padded)
        with _calling(call):
            logits = forward()  # with capture: the head's pass runs inside the model's forward (:meth:`_head`)
        if not call.capture:
            self.counts.checks += 1
            self._check_model(call, logits)
            if self._plain:
                self._check_chunks(call.inputs[0], call.outputs[0])
            return logits.float()
        if len(call.inputs) != 1:  # not the one head call check 1 saw: the logits path from here on (the forward
            self._plain = False  # runs again, writing the same slots, as after a failed compiled step)
            return forward().float()
        if call.tokens is None:  # a shape checked now, or unlike the whole GEMM, or a NaN / infinite maximum
            return logits.float()  # the model's own logits: the head computed them whole
        self.counts.steps += 1
        self.counts.whole += call.way == "whole"
        self.counts.screened += call.screened
        return ArgmaxTokens(call.tokens[:rows] if padded else call.tokens)

    def _head(self, call: _Call, x: torch.Tensor) -> torch.Tensor:
        """The head's call inside a captured step's forward: the rows' tokens, taken by the bucket's way (a chunk at
        a time, the output then empty: the model returns it and nothing reads it; or the whole GEMM and one pass),
        else the whole logits for the sampler (a new shape, checked beside it; a shape whose chunks differ; a NaN or
        an infinite maximum). Inside the forward, so that whatever times the model's forward times the head's pass
        too."""
        call.inputs.append(x)
        if len(call.inputs) > 1:
            return self._linear(x)
        key = (x.numel() // x.shape[-1], torch.get_num_threads())
        exact = self._exact.get(key)
        if exact is None:  # a new shape: the whole GEMM (this step's logits) and the chunks' bits compared
            self.counts.checks += 1
            whole = self._linear(x)
            self._check_chunks(x, whole)
            return whole
        if not exact:
            return self._linear(x)
        bucket = (1 << (key[0].bit_length() - 1), key[1])
        call.way = self._next_way(bucket)
        timed = True
        if call.way == "screen":
            self._screen_ready()  # the screen's copy (re)made outside the timing, once per weights
        start = _clock()
        if call.way == "whole":
            out = self._linear(x)
            call.tokens = _whole_argmax(out)
        else:
            if call.way == "screen":
                call.tokens, timed, call.screened = self._screened(x)
            else:
                call.tokens = self._argmax(x)
            out = x.new_empty(*x.shape[:-1], 0)  # the model returns it; nothing reads it
        if call.tokens is None:  # a NaN or an infinite maximum: the model returns the whole logits, the sampler rules
            self.counts.fallbacks += 1
            return out if call.way == "whole" else self._linear(x)
        if bucket not in self._ways and self._way == "auto" and timed:
            self._record(bucket, call.way, (_clock() - start) / key[0])
        return out

    def _next_way(self, bucket: tuple[int, int]) -> str:
        """The way this step of ``bucket`` takes: the forced one, the bucket's faster one, or its next trial (the
        two ways alternate, the chunks first)."""
        if self._way != "auto":
            return self._way
        kept = self._ways.get(bucket)
        if kept is not None:
            return kept
        times = self._trials.setdefault(bucket, {way: [] for way in self._ways_here})
        return min(self._ways_here, key=lambda way: len(times[way]))  # the fewest trials so far, in WAYS order

    def _record(self, bucket: tuple[int, int], way: str, seconds: float) -> None:
        """One trial's time per row; after :data:`TRIALS` each way the bucket keeps the lower median."""
        times = self._trials[bucket]
        times[way].append(seconds)
        if all(len(t) >= TRIALS for t in times.values()):
            medians = {w: statistics.median(t) for w, t in times.items()}
            self._ways[bucket] = min(self._ways_here, key=medians.__getitem__)  # a tie: the earlier in WAYS
            del self._trials[bucket]

    def close(self) -> None:
        """Give the head its own ``forward`` back."""
        module = self._module_ref()
        if module is not None and isinstance(vars(module).get("forward"), _Forward):
            del module.forward

    @property
    def _module(self) -> torch.nn.Linear:
        """The head module, alive wherever this is read: inside its own call, or a step that found it alive."""
        module = self._module_ref()
        assert module is not None, "the head module was collected"
        return module

    # ------------------------------------------------------------------ the checks
    def _hooks_around(self, module: torch.nn.Linear) -> tuple[Any, ...]:
        """What may change the model's output after the head's, beyond the model's code, which check 1 saw once: the
        forward hooks of the head and of the model (:mod:`.hook_ids`), the model's class and a ``forward`` set on it,
        and the global forward hooks. A hook on the head gets the chunked way's empty output and the model returns
        what the hook made of it: check 1 runs again whenever this changes (a hook on the head then keeps the
        logits path while it is there)."""
        model = self._model_ref() if self._model_ref is not None else None
        own = (counted(module._forward_hooks), counted(module._forward_pre_hooks))  # noqa: SLF001
        if model is None:
            return (own, global_hooks())
        theirs = (counted(model._forward_hooks), counted(model._forward_pre_hooks))  # noqa: SLF001
        return (own, theirs, type(model), id(vars(model).get("forward")), global_hooks())

    def _check_model(self, call: _Call, logits: torch.Tensor) -> None:
        """Check 1: one head call, whose output the model returned as it was."""
        if len(call.outputs) != 1:
            self._plain = False
            return
        out = _rows(call.outputs[0])
        if call.padded and out.shape[0] == call.padded:  # a compiled step's bucket: the padding rows dropped
            out = out[: logits.shape[0]]
        self._plain = out.shape == logits.shape and out.dtype == logits.dtype and same_bits(out, logits)

    def _check_chunks(self, x: torch.Tensor, whole: torch.Tensor) -> None:
        """Check 2, for the rows and threads of ``x``: the chunks' GEMMs give the bits of the whole one. The first,
        the second and the last chunk are computed (every chunk between has the second's shape and its weight's
        alignment): a check costs a few chunks, not a second head."""
        rows = x.numel() // x.shape[-1]
        weight, bias = self._module.weight, self._module.bias
        columns, vocab = chunk_columns(rows), weight.shape[0]
        exact = True
        starts = {0, columns if columns < vocab else 0, (vocab - 1) // columns * columns}
        for a in sorted(starts):
            b = min(a + columns, vocab)
            chunk = F.linear(x, weight[a:b], None if bias is None else bias[a:b])
            if not same_bits(chunk, whole[..., a:b]):
                exact = False
                break
        self._exact[(rows, torch.get_num_threads())] = exact

    # ------------------------------------------------------------------ the screen
    def _screen_ready(self) -> None:
        """Make the screen's copy of the head's weight now if it is missing or stale (not in a timed trial)."""
        if self._screen is not None:
            self._screen.prepare(self._module.weight)

    def _screened(self, x: torch.Tensor) -> tuple[list[int] | None, bool, bool]:
        """The rows' tokens by the screen (:mod:`.head_screen`), whether the step may be timed and whether the
        screen gave the tokens. A shape
        ``(rows, exact columns, threads)`` seen for the first time is checked against the whole GEMM: the exact
        columns' bits, and every approximate logit within its row's bound (a bound that fails turns the screen off:
        it would be a fault in its derivation). A step the screen cannot serve takes the chunks' argmax."""
        screen = self._screen
        step = None if screen is None else screen.screen(x, self._module.weight)
        if step is None or step.tokens is None:
            return self._argmax(x), True, False  # the screen's own work is part of this way's cost
        rows = step.exact.shape[0]
        key = (rows, len(step.columns), torch.get_num_threads())
        good = self._screen_shapes.get(key)
        if good is None:
            self.counts.checks += 1
            whole = _rows(self._linear(x))
            good = same_bits(step.exact, whole[:, torch.from_numpy(step.columns)])
            apart = (step.approx.double() - whole.double()).abs().amax(dim=1).numpy()
            if not (apart <= step.bound).all():
                logger.warning("pagedcore: the head screen's bound failed on this machine; the screen is off")
                self._screen, self._ways_here = None, WAYS[:2]
                self._trials.clear()
                self._ways = {b: w for b, w in self._ways.items() if w != "screen"}
                good = False
            self._screen_shapes[key] = good
            return _whole_argmax(whole), False, False  # this step's tokens: the whole GEMM's
        if not good:
            return self._argmax(x), True, False
        return step.tokens, True, True

    # ------------------------------------------------------------------ the fused pass
    def called(self, x: torch.Tensor) -> torch.Tensor:
        """The head's call (its ``forward``, or the compiled step's op): inside this thread's :meth:`step` the pass
        that records or takes the tokens; every other call is ``nn.Linear``'s own."""
        call: _Call | None = getattr(_STATE, "call", None)
        if call is None or call.head is not self:
            return self._linear(x)
        if call.capture:
            return self._head(call, x)
        call.inputs.append(x)
        out = self._linear(x)
        call.outputs.append(out)
        return out

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        """The head's own GEMM (``nn.Linear.forward``); in the runner's forward split across the threads where that
        gives its bits faster (:mod:`.row_split`)."""
        weight, bias = self._module.weight, self._module.bias
        if torch.is_grad_enabled() or not _fusable(weight):
            return F.linear(x, weight, bias)
        linears = active_linears()
        return F.linear(x, weight, bias) if linears is None else linears.few_rows(x, weight, bias)

    def _argmax(self, x: torch.Tensor) -> list[int] | None:
        """The first maximal column of each row of the head's output, a chunk at a time (two numpy calls a chunk:
        its argmax and the values there; the chunks' winners are compared once, after the last); None when a
        row's maximum is a NaN or an infinity, or it has no finite value (the sampler's cases)."""
        weight, bias = self._module.weight, self._module.bias
        rows, vocab = x.numel() // x.shape[-1], weight.shape[0]
        columns = chunk_columns(rows)
        every = np.arange(rows)
        count = -(-vocab // columns)
        index = np.empty((count, rows), dtype=np.int64)
        value = np.empty((count, rows), dtype=np.float32)
        for k in range(count):
            a, b = k * columns, min((k + 1) * columns, vocab)
            chunk = F.linear(x, weight[a:b], None if bias is None else bias[a:b]).detach().numpy().reshape(rows, b - a)
            index[k] = chunk.argmax(axis=1)  # the first maximal column in the chunk (a NaN's, if it holds one)
            value[k] = chunk[every, index[k]]
        winner = value.argmax(axis=0)  # the first chunk holding the row's maximum (a NaN's, if any)
        top = value[winner, every]
        if not np.isfinite(top).all():
            return None
        return (index[winner, every] + winner * columns).tolist()


class _Forward(LayerForward):
    """The head's ``forward`` while installed: the runner's step on this thread records or skips the GEMM; every
    other call is ``nn.Linear``'s own."""

    def __init__(self, head: ArgmaxHead) -> None:
        self._head = weakref.ref(head)
        self._key = id(head)  # the compiled step's op finds the head by it (_INSTALLED)
        _INSTALLED[self._key] = head

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        head = self._head()
        assert head is not None
        if torch.compiler.is_compiling():  # one opaque op in the graph: what the call does is decided when it runs
            weight, bias = head._module.weight, head._module.bias  # noqa: SLF001
            fits = _fusable(weight) and not torch.is_grad_enabled()
            return HEAD_CALL(x, weight, bias, self._key) if fits else F.linear(x, weight, bias)
        return head.called(x)


_INSTALLED: weakref.WeakValueDictionary[int, ArgmaxHead] = weakref.WeakValueDictionary()  # by id: the installed heads


def head_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, head: int) -> torch.Tensor:
    """The head's call inside a compiled decode step (:mod:`.compiled`), as one op the graph does not trace into:
    :meth:`ArgmaxHead.called` of the installed head ``head`` (its ``id``), so a compiled argmax-only step takes its
    tokens inside the head as an eager one does. The op's output always has the logits' shape: where the head took
    the tokens itself (and returns no logits) it is an uninitialized tensor that nothing reads.

    Example:
        >>> weight, x = torch.randn(256, 32), torch.randn(1, 32)
        >>> torch.equal(head_call(x, weight, None, 0), F.linear(x, weight))   # no head installed by that id
        True
    """
    owner = _INSTALLED.get(head)
    out = F.linear(x, weight, bias) if owner is None else owner.called(x)
    return out if out.shape[-1] == weight.shape[0] else x.new_empty((*x.shape[:-1], weight.shape[0]))


def _head_call_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, head: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


HEAD_CALL = graph_op(
    "argmax_head(Tensor x, Tensor weight, Tensor? bias, int head) -> Tensor", head_call, _head_call_shape
)


@contextlib.contextmanager
def _calling(call: _Call) -> Iterator[None]:
    """This thread is in ``call`` for the block."""
    before = getattr(_STATE, "call", None)
    _STATE.call = call
    try:
        yield
    finally:
        _STATE.call = before


def _whole_argmax(logits: torch.Tensor) -> list[int] | None:
    """The first maximal column of each row of the whole logits (the sampler's numpy pass); None when a row's
    maximum is a NaN or an infinity, or it has no finite value (the sampler's cases)."""
    tokens, finite = numpy_greedy(_rows(logits))
    return tokens if all(finite) else None


def _fusable(weight: torch.Tensor) -> bool:
    """A float32 weight on the CPU (numpy reads the chunks)."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # an integer view of each element size


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaNs with the same payload agree; ``0.0`` and ``-0.0`` do not).

    Example:
        >>> same_bits(torch.tensor([0.0, float("nan")]), torch.tensor([0.0, float("nan")]))
        True
        >>> same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
        False
    """
    bits = _BITS.get(a.element_size())
    if a.shape != b.shape or a.dtype != b.dtype or bits is None:
        return False
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """``(rows, vocab)`` of the head's output ``(..., rows, vocab)`` with one batch row (the packed step's)."""
    return logits.reshape(-1, logits.shape[-1])
