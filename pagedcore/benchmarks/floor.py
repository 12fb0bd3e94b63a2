"""The compute floor of a workload: the FLOPs of the tokens it must compute, divided by this machine's measured matmul
rate at the model's shapes. A serving loop can never finish faster than that; how far above it a run lands is what
the scheduling, the attention and the host work cost.

- :class:`ModelShape`: a Llama-like config's matmul shapes and FLOPs per token (projections, MLP, attention over the
  token's context, the LM head for the rows whose logits are computed).
- :class:`Segment` / :func:`segments_flops`: the work as runs of consecutive positions of one sequence.
- :func:`matmul_rate`: FLOP/s of ``F.linear`` on the model's weight shapes, best of several timed passes.
- :class:`ComputeFloor`: FLOPs, rate, seconds, and how they were obtained (one line for a report).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["ComputeFloor", "ModelShape", "Segment", "compute_floor", "matmul_rate", "segments_flops"]

RATE_ROWS = 512  # rows of the timed matmuls: a full prefill chunk (the Engine's default token budget)


@dataclass(frozen=True)
class ModelShape:
    """The matmul shapes of a decoder-only transformer (Llama layout: q/k/v/o projections, gated MLP, LM head).

    Example:
        >>> shape = ModelShape(layers=2, hidden=64, intermediate=128, heads=2, kv_heads=1, head_dim=32, vocab=512)
        >>> shape.linear_flops_per_token   # 2 x layers x (64*64 + 2*64*32 + 64*64 + 3*64*128)
        147456
        >>> shape.attention_flops(start=0, count=3)   # 4 x layers x heads x head_dim x (1 + 2 + 3) keys
        3072
        >>> shape.head_flops
        65536
    """

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """The shape of a transformers config (``num_hidden_layers``, ``hidden_size``, ... ``vocab_size``).

        Example:
            >>> from transformers import LlamaConfig
            >>> ModelShape.from_config(LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
            ...     num_hidden_layers=2, intermediate_size=128, vocab_size=512)).head_dim
            32
        """
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab=config.vocab_size,
        )

    def weight_shapes(self) -> list[tuple[int, int]]:
        """``(out_features, in_features)`` of one layer's projections and MLP, then the LM head."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = [(q, self.hidden), (kv, self.hidden), (kv, self.hidden), (self.hidden, q)]
        layer += [(self.intermediate, self.hidden)] * 2 + [(self.hidden, self.intermediate)]
        return [*layer, (self.vocab, self.hidden)]

    @property
    def linear_flops_per_token(self) -> int:
        """FLOPs of every layer's projections and MLP for one token (2 per multiply-add)."""
        per_layer = sum(out * inp for out, inp in self.weight_shapes()[:-1])
        return 2 * self.layers * per_layer

    @property
    def head_flops(self) -> int:
        """FLOPs of the LM head for one row of logits."""
        return 2 * self.hidden * self.vocab

    def attention_flops(self, start: int, count: int) -> int:
        """FLOPs of causal attention (scores and weighted values) for positions ``start .. start + count - 1`` of one
        sequence: the token at position ``p`` attends to ``p + 1`` keys."""
        keys = count * start + count * (count + 1) // 2
        return 4 * self.layers * self.heads * self.head_dim * keys


@dataclass(frozen=True)
class Segment:
    """Consecutive positions ``start .. start + count - 1`` of one sequence, computed together, of which ``logits``
    rows need the LM head (1 for a prompt that then samples, ``count`` for decode steps).

    Example:
        >>> Segment(start=512, count=40, logits=1).count
        40
    """

    start: int
    count: int
    logits: int = 1


def segments_flops(shape: ModelShape, segments: Iterable[Segment]) -> int:
    """FLOPs of computing every segment once (the embedding lookup is not a matmul and counts nothing).

    Example:
        >>> shape = ModelShape(layers=2, hidden=64, intermediate=128, heads=2, kv_heads=1, head_dim=32, vocab=512)
        >>> segments_flops(shape, [Segment(0, 3, 1)]) == 3 * shape.linear_flops_per_token + 3072 + shape.head_flops
        True
    """
    total = 0
    for seg in segments:
        total += seg.count * shape.linear_flops_per_token + shape.attention_flops(seg.start, seg.count)
        total += seg.logits * shape.head_flops
    return total


def matmul_rate(
    shape: ModelShape,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    rows: int = RATE_ROWS,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """FLOP/s of ``F.linear`` with ``rows`` input rows over one pass of the model's weight shapes (one layer's and
    the LM head's), the best of ``repeats`` timed passes after one untimed pass. The best pass, because a floor is
    a lower bound: what this machine can do at these shapes when nothing else gets in the way. On the CPU in float32
    where pagedcore's row kernel loads, the same passes are timed again with each weight through the kernel in the
    order whose bits were found equal to ``F.linear``'s (``F.linear`` for a weight none matches), and the faster of
    the two kinds of pass counts: the best rate this machine reaches with ``F.linear``'s bits (on an AMD Zen 5 the
    kernel's 512-bit FMAs reach about twice MKL's). ``clock``: the wall clock, or this thread's CPU time
    (``time.thread_time``) for a floor a loaded machine's waits do not inflate.

    Example:
        >>> shape = ModelShape(layers=1, hidden=64, intermediate=128, heads=2, kv_heads=1, head_dim=32, vocab=512)
        >>> matmul_rate(shape, rows=16, repeats=2) > 0
        True
    """
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    weights = [
        torch.randn(out, inp, generator=gen).to(device=device, dtype=dtype) for out, inp in shape.weight_shapes()
    ]
    inputs = {
        inp: torch.randn(rows, inp, generator=gen).to(device=device, dtype=dtype) for _, inp in shape.weight_shapes()
    }
    flops = sum(2 * rows * w.shape[0] * w.shape[1] for w in weights)
    best = float("inf")
    with torch.inference_mode():
        plain = [partial(F.linear, inputs[w.shape[1]], w) for w in weights]
        for calls in (plain, _kernel_calls(weights, inputs, device, dtype)):
            for attempt in range(repeats + 1 if calls else 0):
                _sync(device)
                start = clock()
                for call in calls:
                    call()
                _sync(device)
                if attempt:  # the first pass warms up (allocations, kernel choice)
                    best = min(best, clock() - start)
    return flops / best


def _kernel_calls(
    weights: list[torch.Tensor], inputs: dict[int, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> list[Callable[[], torch.Tensor]]:
    """One pass over the weights through pagedcore's row kernel in each weight's exact order (``F.linear`` for a
    weight none matches), as calls; none where the kernel does not serve (another device or dtype, no kernel, no
    weight with an exact order)."""
    if device.type != "cpu" or dtype is not torch.float32:
        return []
    from pagedcore.adapters.transformers.row_kernel import load  # the bench's Engine loads it anyway

    kernel, threads = load(), torch.get_num_threads()
    if kernel is None:
        return []
    calls: list[Callable[[], torch.Tensor]] = []
    found = False
    for w in weights:
        x = inputs[w.shape[1]]
        order = kernel.exact_order(x, w, None, F.linear(x, w), threads) if kernel.fits(x, w, None) else None
        calls.append(partial(F.linear, x, w) if order is None else partial(kernel.linear, x, w, None, order, threads))
        found = found or order is not None
    return calls if found else []  # no exact order: the plain pass again


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class ComputeFloor:
    """The least time a workload's FLOPs take at the measured matmul rate.

    Example:
        >>> floor = ComputeFloor(flops=3e11, rate=1.5e11, rows=512, tokens=1774)
        >>> floor.seconds
        2.0
        >>> floor.describe()  # doctest: +ELLIPSIS
        "0.300 TFLOP for 1774 computed positions at 150.0 GFLOP/s ... = 2.00 s"
    """

    flops: float
    rate: float
    rows: int
    tokens: int

    @property
    def seconds(self) -> float:
        """FLOPs / rate."""
        return self.flops / self.rate

    def describe(self) -> str:
        """One line: FLOPs, positions, rate and how it was measured, seconds."""
        return (
            f"{self.flops / 1e12:.3f} TFLOP for {self.tokens} computed positions at {self.rate / 1e9:.1f} GFLOP/s "
            f"(the best rate with `F.linear`'s bits of this machine (`F.linear`, or the row kernel where exact) on "
            f"the weight shapes of the model with {self.rows} rows, "
            f"measured in the run; attention FLOPs counted at the same rate) = {self.seconds:.2f} s"
        )


def compute_floor(model: Any, segments: Iterable[Segment], *, rows: int = RATE_ROWS, repeats: int = 5) -> ComputeFloor:
    """The :class:`ComputeFloor` of ``segments`` on ``model`` (its config's shapes, its device and dtype).

    Example:
        >>> from pagedcore.benchmarks.common import bench_model
        >>> floor = compute_floor(bench_model(size="tiny"), [Segment(0, 64, 1), Segment(64, 7, 7)], rows=16, repeats=1)
        >>> floor.tokens, floor.seconds > 0
        (71, True)
    """
    segments = list(segments)
    shape = ModelShape.from_config(model.config)
    rate = matmul_rate(shape, model.device, model.dtype, rows=rows, repeats=repeats)
    return ComputeFloor(segments_flops(shape, segments), rate, rows, sum(s.count for s in segments))
