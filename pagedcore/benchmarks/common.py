"""What the model benchmarks share: the benchmark model, workload helpers and the measuring tools.

- Model: :func:`bench_config` / :func:`bench_model` build a Llama with random weights in one of the
  :data:`~pagedcore.benchmarks.options.MODEL_SIZES` (or the quick model), on any device and dtype;
  :func:`describe_model`, :func:`kv_bytes_per_token`, :func:`cache_tensor_bytes` describe and measure it.
- Workloads: seeded token lists (:func:`random_tokens`), block counts, left-padded batches on the model's device.
- Measuring: :func:`clock` (``time.perf_counter`` after waiting for the device's queued work, so GPU timings end
  when the work does), a streamer that stamps the first generated token, a forward hook that counts the positions
  the model computes, :func:`torch_threads`, progress bars and percentiles.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from pagedcore.adapters.transformers import ModelKVSpec

from .options import MODEL_SIZES, QUICK_MODEL

__all__ = ["bench_config", "bench_model", "cache_tensor_bytes", "describe_model", "kv_bytes_per_token", "torch_threads"]

PAD = 0
FIRST_TOKEN = 3  # prompts draw token ids from FIRST_TOKEN .. vocab - 1 (0, 1, 2: pad, bos, eos)
BLOCK_SIZE = 16


# ---------------------------------------------------------------------------------------------------- model
def bench_config(quick: bool = False, size: str | None = None, **overrides: Any) -> LlamaConfig:
    """The benchmark Llama's config: ``size`` of :data:`~pagedcore.benchmarks.options.MODEL_SIZES`, else the small
    model (the smaller quick one with ``quick=True``), with ``overrides`` applied.

    Example:
        >>> config = bench_config(quick=True)
        >>> config.num_hidden_layers, config.hidden_size, config.num_key_value_heads, config.vocab_size
        (4, 256, 1, 8000)
        >>> bench_config(num_hidden_layers=2).num_hidden_layers   # the small model with fewer layers
        2
        >>> bench_config(size="1b").hidden_size, bench_config(quick=True, size="tiny").hidden_size
        (2048, 64)
    """
    shape = MODEL_SIZES[size] if size is not None else (QUICK_MODEL if quick else MODEL_SIZES["small"])
    fields = {**shape, "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2}
    return LlamaConfig(**{**fields, **overrides})


def bench_model(
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    quick: bool = False,
    size: str | None = None,
    device: torch.device | str = "cpu",
    attn_implementation: str = "sdpa",
    **overrides: Any,
) -> PreTrainedModel:
    """The benchmark Llama with random weights (see :func:`bench_config`), on ``device`` in ``dtype``.

    The weights are drawn on the CPU in float32 from ``seed`` and then moved, so every device and dtype gets the same
    model. It comes back in eval mode with ``attn_implementation="sdpa"``; its generation config has no eos token
    (generations run to ``max_new_tokens``) and pad token 0. No weights are downloaded.

    Example:
        >>> model = bench_model(quick=True, num_hidden_layers=1)   # the quick model, cut to one layer
        >>> model.config.hidden_size, model.config.num_hidden_layers, model.training
        (256, 1, False)
        >>> model.generation_config.eos_token_id is None, model.generation_config.pad_token_id
        (True, 0)
        >>> bench_model(size="tiny", dtype=torch.bfloat16).dtype
        torch.bfloat16
    """
    torch.manual_seed(seed)
    config = bench_config(quick, size, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model = model.to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model


def describe_model(model: PreTrainedModel) -> str:
    """One line: architecture, sizes, parameter count, dtype (and the device when it is not the CPU).

    Example:
        >>> describe_model(bench_model(size="tiny"))  # doctest: +ELLIPSIS
        'Llama with random weights: 2 layers, hidden 64, 2 heads / 1 KV heads (head dim 32), ... float32'
    """
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    params = sum(p.numel() for p in model.parameters())
    where = "" if model.device.type == "cpu" else f" on {model.device}"
    return (
        f"Llama with random weights: {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} "
        f"heads / {c.num_key_value_heads} KV heads (head dim {head_dim}), intermediate {c.intermediate_size}, vocab "
        f"{c.vocab_size}; {params / 1e6:.1f}M parameters, {str(model.dtype).removeprefix('torch.')}{where}"
    )


def kv_bytes_per_token(model: PreTrainedModel) -> int:
    """Bytes one token's keys and values take over all layers, in the model's dtype.

    Example:
        >>> kv_bytes_per_token(bench_model(size="tiny"))   # 2 layers x (K + V) x 1 KV head x 32 x 4 bytes
        512
    """
    return ModelKVSpec.from_model(model).bytes_per_block(1, model.dtype)


def cache_tensor_bytes(cache: Any) -> int:
    """Bytes of the key and value tensors of a transformers cache (``DynamicCache`` / ``StaticCache``) as allocated.

    Example:
        >>> from transformers import DynamicCache
        >>> cache = DynamicCache()
        >>> _ = cache.update(torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8), 0)   # 3 positions, float32
        >>> cache_tensor_bytes(cache)
        192
    """
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


# ---------------------------------------------------------------------------------------------------- workloads
def random_tokens(rng: random.Random, count: int, vocab: int) -> list[int]:
    """``count`` token ids drawn from ``FIRST_TOKEN .. vocab - 1`` (never pad, bos or eos)."""
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(count)]


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks that hold ``tokens`` tokens."""
    return -(-tokens // block_size)


def left_padded(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of the prompts left-padded to the longest, on ``device``."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


# ---------------------------------------------------------------------------------------------------- generation
def generate(model: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
    """``model.generate`` (typed loosely: the stubs see ``nn.Module`` attributes as tensors)."""
    return model.generate(*args, **kwargs)  # type: ignore[operator]


def greedy(model: PreTrainedModel, ids: list[int], new: int, **kwargs: Any) -> list[int]:
    """Greedy ``generate`` of one prompt on the model's device; returns the new tokens."""
    out = generate(model, torch.tensor([ids], device=model.device), max_new_tokens=new, do_sample=False, **kwargs)
    return list(out[0, len(ids) :].tolist())


@contextlib.contextmanager
def attn(model: PreTrainedModel, implementation: str) -> Iterator[None]:
    """Switch the model's attention implementation for the block (restored afterwards)."""
    before = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if implementation != before:
        model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        if (getattr(model.config, "_attn_implementation", None) or "sdpa") != before:
            model.set_attn_implementation(before)


class ForwardCounter:
    """Counts the positions the model computes (a forward pre-hook; works in any thread that runs the model)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.positions = 0
        self.forwards = 0
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if isinstance(ids, torch.Tensor):
            self.positions += ids.shape[0] * ids.shape[1]
            self.forwards += 1

    def close(self) -> None:
        """Remove the hook."""
        self._handle.remove()


@contextlib.contextmanager
def counting(model: PreTrainedModel) -> Iterator[ForwardCounter]:
    """A :class:`ForwardCounter` on ``model`` for the block."""
    counter = ForwardCounter(model)
    try:
        yield counter
    finally:
        counter.close()


# ---------------------------------------------------------------------------------------------------- measuring
def check_outputs(outputs: Sequence[Any]) -> None:
    """Raise :class:`RuntimeError` when an Engine output carries an error: a benchmark measures finished requests only.

    Example:
        >>> from types import SimpleNamespace
        >>> check_outputs([SimpleNamespace(error=None)])
        >>> check_outputs([SimpleNamespace(error=None), SimpleNamespace(error="boom")])
        Traceback (most recent call last):
        ...
        RuntimeError: 1 requests failed: boom
    """
    errors = [o.error for o in outputs if o.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class FirstTokenClock(BaseStreamer):
    """A streamer that timestamps the first generated token (``generate`` first puts the prompt, then each token).

    ``generate`` hands the streamer tokens copied to the CPU, so the stamp waits for the device to compute them.
    """

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_time: float | None = None

    def put(self, value: Any) -> None:
        """Called by ``generate`` with the prompt, then with every new token."""
        self.puts += 1
        if self.puts == 2:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        """Called by ``generate`` at the end."""


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(threads)`` (no change for None); restored afterwards.

    On a machine where other jobs compete for the cores, one thread gives steadier (if slower) figures than as many
    threads as cores, whose synchronisation suffers whenever one of them is descheduled.

    Example:
        >>> before = torch.get_num_threads()
        >>> with torch_threads(1):
        ...     torch.get_num_threads()
        1
        >>> torch.get_num_threads() == before
        True
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar that vanishes when done (or a disabled one)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=False, disable=not enabled, dynamic_ncols=True)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in 0..100); NaN for no values."""
    data = sorted(values)
    if not data:
        return math.nan
    k = (len(data) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)
