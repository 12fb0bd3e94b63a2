"""The roofline floor of a workload: the least time this machine needs for it, step by step, from the two limits a
forward can hit. A step takes at least its FLOPs at the best measured GEMM rate (:func:`~.floor.matmul_rate`) and at
least the bytes it must move at the measured memory bandwidth (:func:`memory_bandwidth`, a STREAM-like copy and read
in the same run): the weights once (every linear layer and the LM head; the embedding table is only looked up), the keys
and values its attention reads, and the logits it writes. The floor is the sum over the workload's steps of the
larger of the two. A decode step of a few rows is bound by the bytes (every weight read for a handful of rows), a
prefill chunk by the FLOPs; the compute floor (:mod:`.floor`) counts only the second, so it cannot say how far a
weight-bound decode step is from the machine's limit.

- :class:`Request`: one request as a serving loop must compute it (positions already cached, prompt, new tokens).
- :func:`serving_steps`: the steps an ideal continuous batcher with a token budget runs: the prompts' uncached
  positions in budget-sized chunks, then one decode step per generated token after the first, every request still
  generating a row of it.
- :func:`memory_bandwidth`: bytes/s of a copy and of a read of arrays of a given size, the best.
  :func:`machine_limits` takes the better of arrays far larger than the caches and arrays the size of the model's
  weights: a machine whose last-level cache holds much of the weights between steps (a 480 MiB L3 and a 161 MB
  model: 24.6 against 18.3 GB/s for one thread's read) streams them faster than memory, and a floor timed at memory
  speed alone was beaten by CTranslate2 (0.87x at batch 1, docs/benchmarks.md).
- :class:`Roofline`: a workload's floor (seconds, FLOPs, bytes, the steps bound by memory), :func:`roofline`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .floor import ModelShape, Segment, matmul_rate, segments_flops

__all__ = ["MachineLimits", "Request", "Roofline", "machine_limits", "memory_bandwidth", "roofline",
           "serving_steps", "step_bytes"]  # fmt: skip

COPY_MIB = 256  # each array of the bandwidth copy: far larger than any CPU's last-level cache


@dataclass(frozen=True)
class Request:
    """One request as a serving loop computes it: positions ``[cached, prompt)`` of its prompt (the rest comes from
    the prefix cache), then ``new`` tokens (the first from the prompt's last position, each other one a decode step).

    Example:
        >>> Request(prompt=544, new=64, cached=512).uncached
        32
    """

    prompt: int
    new: int
    cached: int = 0

    @property
    def uncached(self) -> int:
        """Prompt positions to compute."""
        return self.prompt - self.cached


def serving_steps(requests: Sequence[Request], budget: int = 512) -> list[list[Segment]]:
    """The steps of ``requests`` served together: the prompts' uncached positions packed into steps of ``budget``
    positions (in order; a prompt's last chunk makes one row of logits), then decode step ``k = 1 .. max(new) - 1``
    with one row for each request whose ``new > k``. Each step is its sequences' :class:`~.floor.Segment` s.

    Example:
        >>> steps = serving_steps([Request(6, 3), Request(6, 2, cached=4)], budget=4)
        >>> [[(s.start, s.count, s.logits) for s in step] for step in steps]
        [[(0, 4, 0)], [(4, 2, 1), (4, 2, 1)], [(6, 1, 1), (6, 1, 1)], [(7, 1, 1)]]
    """
    steps: list[list[Segment]] = []
    current: list[Segment] = []
    room = budget
    for r in requests:
        start = r.cached
        while start < r.prompt:
            n = min(room, r.prompt - start)
            current.append(Segment(start, n, 1 if start + n == r.prompt else 0))
            start, room = start + n, room - n
            if room == 0:
                steps.append(current)
                current, room = [], budget
    if current:
        steps.append(current)
    for k in range(1, max((r.new for r in requests), default=0)):
        steps.append([Segment(r.prompt + k - 1, 1, 1) for r in requests if r.new > k])
    return steps


def step_bytes(shape: ModelShape, step: Iterable[Segment], dtype_bytes: int = 4, logits_bytes: int = 4) -> int:
    """Bytes one step must move at least: every linear weight and the LM head once, the keys and values of each
    sequence's context up to its last position (once per step), the logits rows it writes (float32).

    Example:
        >>> shape = ModelShape(layers=2, hidden=64, intermediate=128, heads=2, kv_heads=1, head_dim=32, vocab=512)
        >>> weights = (shape.linear_flops_per_token + shape.head_flops) // 2 * 4
        >>> step_bytes(shape, [Segment(9, 1, 1)]) == weights + 10 * 2 * 2 * 1 * 32 * 4 + 512 * 4
        True
    """
    weights = (shape.linear_flops_per_token + shape.head_flops) // 2 * dtype_bytes
    kv_per_position = shape.layers * 2 * shape.kv_heads * shape.head_dim * dtype_bytes
    kv = sum((s.start + s.count) * kv_per_position for s in step if s.count)
    logits = sum(s.logits for s in step) * shape.vocab * logits_bytes
    return weights + kv + logits


def memory_bandwidth(
    device: torch.device | str = "cpu",
    *,
    mib: int = COPY_MIB,
    repeats: int = 5,
    dtype: torch.dtype = torch.float32,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Bytes/s this machine moves between memory and its cores, STREAM-like: the larger of a copy between two
    ``mib``-MiB arrays (``dst.copy_(src)``, each byte counted once read and once written, as STREAM counts it) and a
    read of one (a matrix-vector product over it: what a one-row linear layer does to its weights), each the best of
    ``repeats`` timed passes after an untimed one: a floor is a lower bound. ``clock`` as
    :func:`~.floor.matmul_rate`'s.

    Example:
        >>> memory_bandwidth(mib=8, repeats=2) > 1e8
        True
    """
    device = torch.device(device)
    count = mib * 2**20 // torch.tensor([], dtype=dtype).element_size()
    src = torch.ones(count, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    matrix, vector = src.view(1024, -1), torch.ones(1024, dtype=dtype, device=device)
    size = src.numel() * src.element_size()
    copy = 2 * size / _best(device, repeats, lambda: dst.copy_(src), clock)
    read = size / _best(device, repeats, lambda: torch.mv(matrix.t(), vector), clock)
    return max(copy, read)


def _best(device: torch.device, repeats: int, fn: Any, clock: Callable[[], float]) -> float:
    """The shortest of ``repeats`` timed calls of ``fn`` after an untimed one."""
    best = float("inf")
    for attempt in range(repeats + 1):
        _sync(device)
        start = clock()
        fn()
        _sync(device)
        if attempt:
            best = min(best, clock() - start)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class MachineLimits:
    """This machine's two limits, measured in the run: the best GEMM rate with ``F.linear``'s bits (FLOP/s on the
    model's weight shapes with ``rows`` rows: :func:`~.floor.matmul_rate`) and the bandwidth (bytes/s), the best over
    arrays of ``sizes_mib`` MiB.

    Example:
        >>> MachineLimits(rate=1.5e11, bandwidth=2e10, rows=512).describe()  # doctest: +ELLIPSIS
        "150.0 GFLOP/s (best rate with `F.linear`'s bits on the model's weight shapes, 512 rows) and 20.0 GB/s ..."
    """

    rate: float
    bandwidth: float
    rows: int
    sizes_mib: tuple[int, ...] = (COPY_MIB,)

    def describe(self) -> str:
        """One line: both limits and how they were measured."""
        sizes = " and ".join(f"{mib} MiB" for mib in self.sizes_mib)
        return (f"{self.rate / 1e9:.1f} GFLOP/s (best rate with `F.linear`'s bits on the model's weight shapes, "
                f"{self.rows} rows) and {self.bandwidth / 1e9:.1f} GB/s (STREAM-like: the best of a copy and a read, "
                f"of arrays of {sizes})")  # fmt: skip


def machine_limits(
    model: Any, *, rows: int = 512, repeats: int = 5, clock: Callable[[], float] = time.perf_counter
) -> MachineLimits:
    """Both limits for ``model``'s shapes, device and dtype (:func:`~.floor.matmul_rate`, :func:`memory_bandwidth`),
    timed with ``clock``; the bandwidth the better of :data:`COPY_MIB`-MiB arrays and arrays the size of the weights a
    step reads (the module docstring).

    Example:
        >>> from pagedcore.benchmarks.common import bench_model
        >>> limits = machine_limits(bench_model(size="tiny"), rows=16, repeats=1)
        >>> limits.rate > 0 and limits.bandwidth > 0
        True
    """
    shape = ModelShape.from_config(model.config)
    rate = matmul_rate(shape, model.device, model.dtype, rows=rows, repeats=repeats, clock=clock)
    weights = step_bytes(shape, [], dtype_bytes=torch.tensor([], dtype=model.dtype).element_size())
    sizes = tuple(dict.fromkeys((COPY_MIB, max(1, -(-weights // 2**20)))))
    bandwidth = max(memory_bandwidth(model.device, mib=mib, repeats=repeats, clock=clock) for mib in sizes)
    return MachineLimits(rate, bandwidth, rows, sizes)


@dataclass(frozen=True)
class Roofline:
    """A workload's roofline floor: per step the larger of its FLOPs at ``limits.rate`` and its bytes at
    ``limits.bandwidth``, summed.

    Example:
        >>> r = Roofline(seconds=1.2, compute_seconds=0.5, memory_seconds=0.9, flops=5e10, bytes=1.8e10, steps=10,
        ...              memory_bound=8, limits=MachineLimits(1e11, 2e10, 512))
        >>> r.describe()  # doctest: +ELLIPSIS
        "10 steps (8 bound by memory): 0.050 TFLOP and 18.0 GB moved ... = 1.20 s"
    """

    seconds: float
    compute_seconds: float
    memory_seconds: float
    flops: float
    bytes: float
    steps: int
    memory_bound: int
    limits: MachineLimits

    def describe(self) -> str:
        """One line: steps, FLOPs, bytes, the limits, the floor."""
        return (f"{self.steps} steps ({self.memory_bound} bound by memory): {self.flops / 1e12:.3f} TFLOP and "
                f"{self.bytes / 1e9:.1f} GB moved at {self.limits.describe()} = {self.seconds:.2f} s")  # fmt: skip


def roofline(model: Any, requests: Sequence[Request], limits: MachineLimits, budget: int = 512) -> Roofline:
    """The :class:`Roofline` of ``requests`` served with a token ``budget`` per step (:func:`serving_steps`) on
    ``model``'s shapes and dtype, at ``limits``.

    Example:
        >>> from pagedcore.benchmarks.common import bench_model
        >>> model = bench_model(size="tiny")
        >>> r = roofline(model, [Request(128, 16)] * 2, MachineLimits(rate=1e9, bandwidth=1e12, rows=512))
        >>> r.steps, r.memory_bound, round(r.seconds, 6) == round(r.compute_seconds, 6)   # compute-bound
        (16, 0, True)
    """
    shape = ModelShape.from_config(model.config)
    dtype_bytes = torch.tensor([], dtype=model.dtype).element_size()
    seconds = compute = memory = flops = moved = 0.0
    bound = 0
    steps = serving_steps(requests, budget)
    for step in steps:
        f, b = segments_flops(shape, step), step_bytes(shape, step, dtype_bytes)
        c, m = f / limits.rate, b / limits.bandwidth
        seconds, compute, memory, flops, moved = seconds + max(c, m), compute + c, memory + m, flops + f, moved + b
        bound += m > c
    return Roofline(seconds, compute, memory, flops, moved, len(steps), bound, limits)
