"""The Engine's decode step as CUDA graphs captured from the eager step (``Engine(compile="cudagraphs")``).

A decode step of a small model on a GPU is a few hundred kernel launches, each microseconds of host work around
microseconds of GPU work; a graph replays them with one launch. The inductor path (``compile=True``,
:mod:`.compiled`) does the same after generating code per bucket, which costs tens of seconds of compilation the
first time each (rows, width) bucket is met (the first GPU run: a 12-turn chat took 70 s against 1.5 s for the
padded batch). Here nothing is compiled: the bucketed decode function (:class:`~.compiled.CompiledDecode` run as
Python: the same :class:`~.compiled.DecodeInputs` and :class:`~.compiled.DecodeAttention`) is captured as it runs,
which costs about three eager steps per bucket.

Per bucket, :class:`DecodeGraphs` keeps static copies of the step's input tensors and the graph's output; a step
copies its inputs into them, replays, and returns a copy of its rows' logits. The capture runs the step twice on a
side stream first (each run writes the same keys to the same slots: a rewrite, not a second token), then records it.

What a graph has captured: the addresses of the weights, of the pool's tensors and of its static inputs. So all
graphs are dropped (and captured again at their next step) when the pool's weights version moves (the weights watch:
an optimizer step, new tensors, adapters merged) or any pool tensor moved (the pool was rebuilt). A capture that
raises (an op that waits on the GPU, say) turns graphs off for the runner, which runs that step and all later ones
eagerly, as a failing compiled step does.

The capture itself is behind :class:`GraphCapture` (:class:`CudaGraphCapture` on CUDA), so that tests on the CPU
run the same buckets, static buffers and invalidation with a stand-in that replays by calling the function again.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from pagedcore.engine.runner import CompileCounts
from pagedcore.errors import ConfigError

from .compiled import CompiledDecode, DecodeInputs
from .pool import PagedKVPool

__all__ = [
    "CAPTURE",
    "HOST_READING_ROPE",
    "CudaGraphCapture",
    "DecodeGraphs",
    "GraphCapture",
    "ReplayCapture",
    "TraceCapture",
    "refuse_graphs",
    "resolve_compile",
]

WARMUP_RUNS = 2  # eager runs on the side stream before a capture (lazy initialisations, cuBLAS workspaces)


@runtime_checkable
class GraphCapture(Protocol):
    """Captures a function of static tensors: ``(replay, output)``, where ``replay()`` recomputes ``output`` in
    place from the static tensors' current contents.

    Example:
        >>> isinstance(CudaGraphCapture(), GraphCapture), isinstance(ReplayCapture(), GraphCapture)
        (True, True)
    """

    def capture(self, function: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Run ``function`` (warm-up) and capture it."""
        ...


class CudaGraphCapture:
    """:class:`GraphCapture` with ``torch.cuda.CUDAGraph``: warm-up and capture on one side stream of this capture's
    own (made on the model's device), into one memory pool that every graph of the runner shares (their replays
    never overlap: one step at a time). A :class:`DecodeGraphs` makes a new one, with a new pool, each time it
    drops its graphs.

    A capture that fails part-way leaves torch before 2.12 with its caching allocator still in capture mode (the
    next ``empty_cache`` or capture asserts: pytorch PR 180395) and, in any version, the step on the capture stream.
    So the last warm-up runs with CUDA's sync check as an error (a value read on the host, which a capture refuses,
    fails there, before anything is captured); the stream is put back after a failure; and after one, no Engine of
    this process captures again (:attr:`failed`: ``compile="cudagraphs"`` is refused with it).

    Example:
        >>> CAPTURE is CudaGraphCapture, CudaGraphCapture.failed
        (True, None)
    """

    failed: str | None = None
    """Why a capture of this process failed part-way (None: none did)."""

    def __init__(self) -> None:
        self._pool: Any = None  # torch.cuda.graph_pool_handle(), made at the first capture
        self._side: Any = None  # the warm-up and capture stream, one for every capture: the caching allocator keeps
        # freed blocks per stream, so a new stream per bucket would strand each warm-up's activations

    def capture(self, function: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        if self._pool is None:
            self._pool, self._side = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        side, caller = self._side, torch.cuda.current_stream()
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            for run in range(WARMUP_RUNS):
                with _syncs_refused() if run == WARMUP_RUNS - 1 else contextlib.nullcontext():
                    function()
        caller.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # on the side stream (torch's default capture stream is one per process, on the first device that
            # captured); thread_local: another thread's unrelated CUDA call does not invalidate this capture
            with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
                output = function()
        except BaseException as exc:
            torch.cuda.set_stream(caller)  # torch.cuda.graph puts it back only after a capture that ended well
            CudaGraphCapture.failed = f"{type(exc).__name__}: {exc}"[:300]
            raise
        return graph.replay, output


@contextlib.contextmanager
def _syncs_refused() -> Any:
    """CUDA's sync check as an error while inside: an op that waits on the GPU raises instead of waiting."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class ReplayCapture:
    """:class:`GraphCapture` without CUDA, for tests and rehearsals on the CPU: the output of one call, recomputed in
    place by calling the function again (what a graph's replay does, without the graph).

    Example:
        >>> x = torch.ones(2)
        >>> replay, out = ReplayCapture().capture(lambda: x * 2)
        >>> x += 1; replay(); out.tolist()
        [4.0, 4.0]
    """

    def capture(self, function: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        output = function()

        def replay() -> None:
            output.copy_(function())

        return replay, output


class TraceCapture:
    """:class:`GraphCapture` without CUDA that replays what a graph replays: the ops one run of the function
    dispatched, called again with the values they were called with (Python numbers, shapes, branches taken, tensors
    built from host data: all frozen at capture), against the tensors that existed before it (the static inputs, the
    weights, the pool) and the new results of the ops before them. A step whose Python computes a number or takes a
    branch that a later step would compute otherwise replays it as captured, as a real graph does;
    :class:`ReplayCapture`, which runs the Python again, cannot show that.

    Example:
        >>> x, length = torch.ones(2), [2]
        >>> step = lambda: x * torch.arange(length[0]).sum()   # a Python number (the step's length) in the step
        >>> replays = [capture.capture(step) for capture in (ReplayCapture(), TraceCapture())]
        >>> x += 1; length[0] = 3
        >>> [(replay(), out.tolist())[1] for replay, out in replays]   # the graph keeps arange(2)
        [[6.0, 6.0], [2.0, 2.0]]
    """

    def capture(self, function: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        function()  # a warm-up, as on CUDA
        recorder = _Recorder()
        with recorder:
            output = function()
        records, made = recorder.records, recorder.made

        def replay() -> None:
            fresh: dict[int, torch.Tensor] = {}

            def now(value: Any) -> Any:
                return fresh.get(id(value), value) if isinstance(value, torch.Tensor) and id(value) in made else value

            for op, args, kwargs, out in records:
                result = op(*tree_map(now, args), **tree_map(now, kwargs))
                for old, new in zip(tree_flatten(out)[0], tree_flatten(result)[0]):
                    if isinstance(old, torch.Tensor):
                        fresh[id(old)] = new
            output.copy_(fresh[id(output)])

        return replay, output


class _Recorder(TorchDispatchMode):
    """Every op dispatched inside, with its arguments and results (kept alive, so no id is reused)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[Any, Any, Any, Any]] = []
        self.made: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.records.append((func, args, kwargs, out))
        self.made.update(id(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


CAPTURE: Callable[[], GraphCapture] = CudaGraphCapture
"""The capture :class:`DecodeGraphs` uses (tests on the CPU set a stand-in; ``compile="cudagraphs"`` is refused on
a device without CUDA while this is :class:`CudaGraphCapture`)."""


def resolve_compile(compile: bool | str, device: torch.device) -> str | None:
    """How an Engine with ``compile=`` on ``device`` runs its decode steps: ``"inductor"`` (``True``: compiled
    per bucket, with CUDA graphs on CUDA), ``"cudagraphs"`` (captured per bucket from the eager step, nothing
    compiled: :class:`DecodeGraphs`; CUDA only) or None (``False``: eagerly). ``"auto"`` is eager on every device
    for now: on the CPU each bucket's first compiled step costs seconds of inductor compilation for a step of
    milliseconds (docs/benchmarks.md, "Compiled decode"), and on the first GPU run (an H200, docs/gpu.md) inductor's
    compilations per bucket made a 12-turn chat 46x slower than the padded batch; the captured graphs are not yet
    measured on a GPU.

    Example:
        >>> resolve_compile("auto", torch.device("cpu")), resolve_compile(True, torch.device("cuda"))
        (None, 'inductor')
        >>> resolve_compile("yes", torch.device("cpu"))
        Traceback (most recent call last):
            ...
        pagedcore.errors.ConfigError: compile must be True, False, "auto" or "cudagraphs", got 'yes'
    """
    if compile is True:
        return "inductor"
    if compile is False or compile == "auto":
        return None
    if compile == "cudagraphs":
        if device.type != "cuda" and CAPTURE is CudaGraphCapture:
            raise ConfigError(f'compile="cudagraphs" needs a CUDA device; the model is on {device}', param="compile")
        if CAPTURE is CudaGraphCapture and CudaGraphCapture.failed is not None:
            raise ConfigError(
                'compile="cudagraphs": a CUDA graph capture of this process failed part-way '
                f"({CudaGraphCapture.failed}), after which torch before 2.12 cannot capture again; start a new "
                "process, or serve this model without compile",
                param="compile",
            )
        return "cudagraphs"
    raise ConfigError(f'compile must be True, False, "auto" or "cudagraphs", got {compile!r}', param="compile")


HOST_READING_ROPE = ("dynamic",)
"""Rotary kinds whose forward compares the positions with a bound on the host (transformers'
``dynamic_rope_update``): a capture refuses that read. (``longrope`` chooses its frequencies on the device, in
place, so that graphs replay it.)"""


def refuse_graphs(model: torch.nn.Module) -> None:
    """Raise :class:`~pagedcore.errors.ConfigError` for a model that a captured decode step cannot serve: one whose
    rotary embedding reads the positions on the host (:data:`HOST_READING_ROPE`), or whose weights lie on more than
    one device (a graph is captured on one).

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> refuse_graphs(tiny_llama())
    """
    kinds = _rope_kinds(getattr(model, "config", None))
    reading = sorted(kinds & set(HOST_READING_ROPE))
    if reading:
        raise ConfigError(
            f'compile="cudagraphs": the model\'s rotary embedding ({reading[0]}) compares the positions with a bound '
            "on the host at every forward, which a CUDA graph cannot capture; serve it without compile",
            param="compile",
        )
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        names = ", ".join(sorted(map(str, devices)))
        raise ConfigError(
            f'compile="cudagraphs": the model\'s weights lie on {names}; a CUDA graph is captured on one device',
            param="compile",
        )


def _rope_kinds(config: Any) -> set[str]:
    """Every ``rope_type`` of a config and its sub-configs (``rope_scaling``, ``rope_parameters``, per layer kind)."""
    kinds: set[str] = set()

    def walk(value: Any, depth: int) -> None:
        if depth > 4:
            return
        if isinstance(value, dict):
            kind = value.get("rope_type", value.get("type"))
            if isinstance(kind, str):
                kinds.add(kind)
            for inner in value.values():
                walk(inner, depth + 1)

    for owner in (config, getattr(config, "text_config", None)):
        for name in ("rope_scaling", "rope_parameters"):
            walk(getattr(owner, name, None), 0)
    return kinds


@dataclass
class _Graph:
    inputs: DecodeInputs  # the static tensors the graph reads
    replay: Callable[[], None]
    logits: torch.Tensor  # the static output (rows of the bucket, vocab)


class DecodeGraphs:
    """Decode steps of ``model`` over ``pool`` replayed as one captured graph per bucket (module docstring).

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> model = tiny_llama()
        >>> graphs = DecodeGraphs(model, PagedKVPool(model, num_blocks=8, block_size=4))
        >>> graphs.counts
        CompileCounts(graphs=0, buckets=0, steps=0, failures=0)
    """

    def __init__(self, model: torch.nn.Module, pool: PagedKVPool, capture: GraphCapture | None = None) -> None:
        refuse_graphs(model)
        self.pool = pool
        self._step = CompiledDecode(model, pool, backend=None)  # the bucketed decode function, run as Python
        self._given = capture
        self._capture = capture if capture is not None else CAPTURE()
        self._graphs: dict[tuple[int, ...], _Graph] = {}
        self._stamp: tuple[int, ...] | None = None
        self._lock = threading.Lock()
        self._captures = 0
        self._buckets: set[tuple[int, ...]] = set()
        self._steps = 0
        self.dropped = 0
        """Times every graph was dropped because the weights or the pool moved."""

    @property
    def counts(self) -> CompileCounts:
        """Graphs captured (``graphs``; a bucket captured again after its graphs were dropped counts again),
        distinct buckets, steps replayed."""
        with self._lock:
            return CompileCounts(self._captures, len(self._buckets), self._steps)

    def __call__(self, inputs: DecodeInputs) -> torch.Tensor:
        """The logits ``(inputs.real, vocab)`` of the step's sequences (a copy: the graph's output is rewritten by
        its next replay)."""
        stamp = self._current_stamp()
        if stamp != self._stamp:
            if self._graphs:
                self.dropped += 1
                self._graphs.clear()
                # a new capture, with a new memory pool: the old pool may still hold a block (a workspace made
                # inside a capture), and a pool whose graphs are all gone must not be captured into again
                self._capture = self._given if self._given is not None else CAPTURE()
            self._stamp = stamp
        device = inputs.input_ids.device  # a model on cuda:1 captures and replays there, whatever the current device
        with torch.inference_mode(), torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            graph = self._graphs.get(inputs.key)
            if graph is None:
                graph = self._graphs[inputs.key] = self._record(inputs)
            else:
                _copy_inputs(graph.inputs, inputs)
            graph.replay()
            logits = graph.logits[: inputs.real].clone()
        with self._lock:
            self._buckets.add(inputs.key)
            self._steps += 1
        return logits

    def _record(self, inputs: DecodeInputs) -> _Graph:
        static = DecodeInputs(
            inputs.input_ids.clone(),
            inputs.positions.clone(),
            tuple(t.clone() for t in inputs.tables),
            tuple(t.clone() for t in inputs.slots),
            tuple(t.clone() for t in inputs.starts),
            inputs.real,
        )
        replay, logits = self._capture.capture(lambda: self._step.bucket_logits(static))
        with self._lock:
            self._captures += 1
        return _Graph(static, replay, logits)

    def _current_stamp(self) -> tuple[int, ...]:
        """The weights version and the address of every pool tensor a graph may have captured."""
        pointers = [self.pool.weights_version]
        for layer in range(len(self.pool.spec.layers)):
            for tensor in self.pool.layer_tensors(layer) or ():
                pointers.append(tensor.data_ptr())
        return tuple(pointers)


def _copy_inputs(static: DecodeInputs, inputs: DecodeInputs) -> None:
    """Copy a step's tensors into a graph's static ones (same bucket: same shapes)."""
    static.input_ids.copy_(inputs.input_ids, non_blocking=True)
    static.positions.copy_(inputs.positions, non_blocking=True)
    for group in (
        zip(static.tables, inputs.tables),
        zip(static.slots, inputs.slots),
        zip(static.starts, inputs.starts),
    ):
        for mine, theirs in group:
            mine.copy_(theirs, non_blocking=True)
