"""Benchmarks of the transformers adapter, each run side by side with its peers in one process and reported as ratios.

1. :func:`prefix_benchmark`: a long shared "system prompt" + many questions, ``enable(model)`` vs plain ``generate``.
2. :func:`cold_benchmark`: one sequence without any reuse, ``PagedCache`` (sdpa and ``attn_implementation="paged"``)
   vs ``DynamicCache``.
3. :func:`memory_benchmark`: KV bytes reserved per byte of real tokens for a mixed-length, left-padded batch.
4. :func:`engine_benchmark`: many requests sharing a prefix: :class:`Engine` vs ``generate`` one request at a time,
   ``generate`` on the padded batch and transformers' own continuous batching.

Every benchmark takes ``quick`` (a smaller model and workload, a smoke run that fits in seconds) and ``progress``
(tqdm bars), builds the benchmark-sized Llama with random weights unless given a ``model``, and returns a dataclass
with the raw measurements whose ``markdown()`` renders the workload, model, machine and the ratios next to their aims.
:func:`run_all` runs the four and writes ``results.md`` and ``engine.png``.

Timings are wall-clock (``time.perf_counter``) on whatever else the machine is doing: compare figures measured on a
quiet machine only. Each benchmark warms its code paths up before timing.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    GenerationConfig,
    LlamaConfig,
    PreTrainedModel,
    StaticCache,
)
from transformers.generation.streamers import BaseStreamer

from .cache import PagedCache
from .engine import Engine
from .pool import PagedKVPool
from .prefix_caching import disable, enable
from .sampling import SamplingParams
from .spec import ModelKVSpec

__all__ = [
    "BENCHMARKS",
    "ColdResult",
    "EngineResult",
    "MemoryResult",
    "PeerResult",
    "PrefixResult",
    "bench_config",
    "bench_model",
    "cold_benchmark",
    "engine_benchmark",
    "machine_info",
    "memory_benchmark",
    "prefix_benchmark",
    "run_all",
    "run_one",
    "script_main",
    "torch_threads",
    "write_chart",
]

PAD = 0
FIRST_TOKEN = 3  # prompts draw token ids from FIRST_TOKEN .. vocab - 1 (0, 1, 2: pad, bos, eos)
BLOCK_SIZE = 16

AIM_TTFT_SPEEDUP = 5.0
AIM_PREFIX_PREFILL_RATIO = 1.1
AIM_COLD_SLOWDOWN = 1.10
AIM_MEMORY_RATIO = 1.05
AIM_ENGINE_PREFILL_RATIO = 1.05
ONE_AT_A_TIME = "generate, one at a time"
PADDED_BATCH = "generate, padded batch"
HF_CONTINUOUS = "transformers continuous batching"
ENGINE = "pagedcore Engine"
AIM_ENGINE_SPEEDUP = {ONE_AT_A_TIME: 3.0, PADDED_BATCH: 1.5, HF_CONTINUOUS: 3.0}

_FULL_MODEL: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
# --quick: fewer layers, narrower, smaller vocabulary (same head dim and GQA ratio as the full model).
_QUICK_MODEL: dict[str, Any] = {
    **_FULL_MODEL,
    "vocab_size": 8000,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
}


# ---------------------------------------------------------------------------------------------------- model, machine
def bench_config(quick: bool = False, **overrides: Any) -> LlamaConfig:
    """The benchmark Llama's config (the smaller ``--quick`` one with ``quick=True``), with ``overrides`` applied.

    Example:
        >>> config = bench_config(quick=True)
        >>> config.num_hidden_layers, config.hidden_size, config.num_key_value_heads, config.vocab_size
        (4, 256, 1, 8000)
        >>> bench_config(num_hidden_layers=2).num_hidden_layers   # the full model with fewer layers
        2
    """
    fields = {**(_QUICK_MODEL if quick else _FULL_MODEL), "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2}
    return LlamaConfig(**{**fields, **overrides})


def bench_model(
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    quick: bool = False,
    attn_implementation: str = "sdpa",
    **overrides: Any,
) -> PreTrainedModel:
    """The benchmark-sized Llama with random weights (hidden 512, 8 layers, 8 heads, 2 KV heads, vocab 32000).

    ``quick=True`` builds the smaller model of ``--quick`` runs (hidden 256, 4 layers, 4 heads, 1 KV head, vocab
    8000). The model comes back in eval mode with ``attn_implementation="sdpa"``; its generation config has no eos
    token (generations run to ``max_new_tokens``) and pad token 0. No weights are downloaded.

    Example:
        >>> model = bench_model(quick=True, num_hidden_layers=1)   # the quick model, cut to one layer
        >>> model.config.hidden_size, model.config.num_hidden_layers, model.training
        (256, 1, False)
        >>> model.generation_config.eos_token_id is None, model.generation_config.pad_token_id
        (True, 0)
    """
    torch.manual_seed(seed)
    config = bench_config(quick, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model


def machine_info() -> str:
    """CPU model (from /proc/cpuinfo), cores, torch and transformers versions, torch threads and the load average.

    Every report quotes it, so that figures are read next to the machine that measured them.

    Example:
        >>> machine_info()  # doctest: +ELLIPSIS
        '... cores; torch ... threads), transformers ...; Python ...'
    """
    cpu = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = ""
    with contextlib.suppress(OSError, AttributeError):
        load = f"; load average {os.getloadavg()[0]:.2f} at start"
    return (
        f"{cpu}, {cores} cores; torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__}; Python {platform.python_version()}{load}"
    )


def describe_model(model: PreTrainedModel) -> str:
    """One line: architecture, sizes, parameter count, dtype."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    params = sum(p.numel() for p in model.parameters())
    return (
        f"Llama with random weights: {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} "
        f"heads / {c.num_key_value_heads} KV heads (head dim {head_dim}), intermediate {c.intermediate_size}, vocab "
        f"{c.vocab_size}; {params / 1e6:.1f}M parameters, {str(model.dtype).removeprefix('torch.')}"
    )


def kv_bytes_per_token(model: PreTrainedModel) -> int:
    """Bytes one token's keys and values take over all layers, in the model's dtype."""
    return ModelKVSpec.from_model(model).bytes_per_block(1, model.dtype)


def cache_tensor_bytes(cache: Any) -> int:
    """Bytes of the key and value tensors of a transformers cache (``DynamicCache`` / ``StaticCache``) as allocated."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


# ---------------------------------------------------------------------------------------------------- helpers
def _tokens(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(count)]


def _bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=False, disable=not enabled, dynamic_ncols=True)


def _percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in 0..100)."""
    data = sorted(values)
    if not data:
        return math.nan
    k = (len(data) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)


def _generate(model: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
    """``model.generate`` (typed loosely: the stubs see ``nn.Module`` attributes as tensors)."""
    return model.generate(*args, **kwargs)  # type: ignore[operator]


def _greedy(model: PreTrainedModel, ids: list[int], new: int, **kwargs: Any) -> list[int]:
    out = _generate(model, torch.tensor([ids]), max_new_tokens=new, do_sample=False, **kwargs)
    return list(out[0, len(ids) :].tolist())


def _blocks(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-tokens // block_size)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _x(value: float) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.2f}x"


def _status(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _header(title: str, quick: bool, workload: str, model: str, machine: str, measured: str) -> str:
    suffix = " (quick workload)" if quick else ""
    lines = [f"### {title}{suffix}", ""]
    if quick:
        lines += ["**Quick workload**: a smaller model and fewer tokens; a smoke run, not the reference figures.", ""]
    lines += [f"- Workload: {workload}", f"- Model: {model}", f"- Machine: {machine}", f"- Measured: {measured}", ""]
    return "\n".join(lines) + "\n"


class _FirstTokenClock(BaseStreamer):
    """A streamer that timestamps the first generated token (``generate`` first puts the prompt, then each token)."""

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


class _ForwardCounter:
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
def _counting(model: PreTrainedModel) -> Iterator[_ForwardCounter]:
    counter = _ForwardCounter(model)
    try:
        yield counter
    finally:
        counter.close()


@contextlib.contextmanager
def _attn(model: PreTrainedModel, implementation: str) -> Iterator[None]:
    """Switch the model's attention implementation for the block (restored afterwards)."""
    before = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if implementation != before:
        model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        if (getattr(model.config, "_attn_implementation", None) or "sdpa") != before:
            model.set_attn_implementation(before)


def _model_for(model: PreTrainedModel | None, quick: bool, seed: int) -> PreTrainedModel:
    return model if model is not None else bench_model(seed, quick=quick)


# ---------------------------------------------------------------------------------------------------- 1. prefix
@dataclass
class PrefixResult:
    """Shared system prompt + questions: ``enable(model)``-ed generate vs plain generate (DynamicCache).

    Times are per question, in seconds; TTFT is from the ``generate`` call to the streamer receiving the first token.

    Example:
        Two questions after a 512-token system prompt; the first enabled question is cold (it caches the prompt):

        >>> result = PrefixResult(quick=True, model="Llama", machine="laptop", system_tokens=512,
        ...     question_tokens=[30, 34], new_tokens=8, ttft_plain=[0.5, 0.5], ttft_enabled=[0.5, 0.0625],
        ...     time_plain=[1.0, 1.0], time_enabled=[1.0, 0.5], prefill_plain=1088, prefill_enabled=576,
        ...     hit_tokens=512, query_tokens=1088, mismatches=[])
        >>> result.unique_tokens, result.prefill_ratio
        (576, 1.0)
        >>> round(result.ttft_speedup, 2), result.warm_ttft_speedup, round(result.total_speedup, 2)
        (1.78, 8.0, 1.33)
        >>> print(result.markdown().splitlines()[0])
        ### 1. Prefix caching: shared system prompt (quick workload)
    """

    quick: bool
    model: str
    machine: str
    system_tokens: int
    question_tokens: list[int]
    new_tokens: int
    ttft_plain: list[float]
    ttft_enabled: list[float]
    time_plain: list[float]
    time_enabled: list[float]
    prefill_plain: int
    prefill_enabled: int
    hit_tokens: int
    query_tokens: int
    mismatches: list[int]

    @property
    def unique_tokens(self) -> int:
        """The system prompt once plus every question."""
        return self.system_tokens + sum(self.question_tokens)

    @property
    def ttft_speedup(self) -> float:
        """Mean TTFT of plain generate / mean TTFT with prefix caching."""
        return statistics.fmean(self.ttft_plain) / statistics.fmean(self.ttft_enabled)

    @property
    def warm_ttft_speedup(self) -> float:
        """The same over the questions after the first (the first one computes the system prompt)."""
        return statistics.fmean(self.ttft_plain[1:]) / statistics.fmean(self.ttft_enabled[1:])

    @property
    def total_speedup(self) -> float:
        """Total time of plain generate / total time with prefix caching."""
        return sum(self.time_plain) / sum(self.time_enabled)

    @property
    def prefill_ratio(self) -> float:
        """Prefill tokens computed with prefix caching / unique tokens."""
        return self.prefill_enabled / self.unique_tokens

    def markdown(self) -> str:
        """The report: workload, model, machine, figures and ratios with their aims."""
        n = len(self.question_tokens)
        workload = (
            f"a {self.system_tokens}-token system prompt followed by {n} different questions of "
            f"{min(self.question_tokens)}-{max(self.question_tokens)} tokens (mean "
            f"{statistics.fmean(self.question_tokens):.0f}), {self.new_tokens} new tokens each, greedy; one "
            "`generate` call per question, batch 1"
        )
        measured = (
            "TTFT = time from the `generate` call to a streamer receiving the first generated token (same call as the "
            "total time); the two modes alternate question by question (plain first on even questions) after one "
            "untimed warm-up call each on an unrelated prompt. Prefill tokens computed: enabled = prompt tokens minus "
            "prefix hits (pool counters `num_query_tokens - num_hit_tokens`); plain = every prompt token. The first "
            "enabled question is cold: it computes the system prompt and caches it."
        )
        head = _header(
            "1. Prefix caching: shared system prompt", self.quick, workload, self.model, self.machine, measured
        )
        mean = statistics.fmean
        figures = _table(
            ["", "plain generate (DynamicCache)", "generate + `enable(model)`"],
            [
                [
                    "mean TTFT, all questions",
                    f"{mean(self.ttft_plain) * 1e3:.1f} ms",
                    f"{mean(self.ttft_enabled) * 1e3:.1f} ms",
                ],
                ["TTFT, first question", f"{self.ttft_plain[0] * 1e3:.1f} ms", f"{self.ttft_enabled[0] * 1e3:.1f} ms"],
                [
                    "mean TTFT, questions 2..",
                    f"{mean(self.ttft_plain[1:]) * 1e3:.1f} ms",
                    f"{mean(self.ttft_enabled[1:]) * 1e3:.1f} ms",
                ],
                ["total time", f"{sum(self.time_plain):.2f} s", f"{sum(self.time_enabled):.2f} s"],
                ["prefill tokens computed", self.prefill_plain, self.prefill_enabled],
                ["prefix hits / looked-up prompt tokens", "-", f"{self.hit_tokens} / {self.query_tokens}"],
                ["unique tokens (system prompt + questions)", self.unique_tokens, self.unique_tokens],
            ],
        )
        ratios = _table(
            ["ratio", "value", "aim", "status"],
            [
                ["TTFT speedup (mean plain / mean enabled)", _x(self.ttft_speedup), f"≥ {AIM_TTFT_SPEEDUP:g}x",
                 _status(self.ttft_speedup >= AIM_TTFT_SPEEDUP)],
                ["TTFT speedup, questions 2.. only", _x(self.warm_ttft_speedup), "-", "-"],
                ["total-time speedup", _x(self.total_speedup), "-", "-"],
                ["prefill tokens computed / unique tokens (enabled)", f"{self.prefill_ratio:.3f}",
                 f"≤ {AIM_PREFIX_PREFILL_RATIO:g}", _status(self.prefill_ratio <= AIM_PREFIX_PREFILL_RATIO)],
                ["prefill tokens computed / unique tokens (plain)", f"{self.prefill_plain / self.unique_tokens:.3f}",
                 "-", "-"],
            ],
        )  # fmt: skip
        same = (
            f"identical for all {n} questions"
            if not self.mismatches
            else f"**differ** for questions {self.mismatches} (of {n})"
        )
        return f"{head}{figures}\n\n{ratios}\n\nGreedy outputs of the two modes: {same}.\n"


def prefix_benchmark(
    quick: bool = False, progress: bool = True, *, model: PreTrainedModel | None = None, seed: int = 0
) -> PrefixResult:
    """Shared system prompt (1024 tokens) + 16 questions of ~32 tokens, 32 new tokens each (quick: 512 / 10 / 8).

    Compares ``generate`` with automatic prefix caching (:func:`enable`) against plain ``generate`` with a
    ``DynamicCache``; see :class:`PrefixResult`.

    Example:
        >>> model = bench_model(quick=True)   # what quick=True builds when no model is given
        >>> model.config.num_hidden_layers
        4
        >>> result = prefix_benchmark(quick=True, progress=False, model=model)  # doctest: +SKIP
        >>> result.system_tokens, len(result.question_tokens), result.mismatches  # doctest: +SKIP
        (512, 10, [])
        >>> print(result.markdown())  # doctest: +SKIP
        ### 1. Prefix caching: shared system prompt (quick workload)
        ...
    """
    system_len, questions, (q_lo, q_hi), new = (512, 10, (24, 40), 8) if quick else (1024, 16, (24, 40), 32)
    model = _model_for(model, quick, seed)
    vocab = model.config.vocab_size
    rng = random.Random(seed + 1)
    system = _tokens(rng, system_len, vocab)
    prompts = [system + _tokens(rng, rng.randint(q_lo, q_hi), vocab) for _ in range(questions)]
    warm = _tokens(rng, 64, vocab)
    capacity = _blocks(system_len) + sum(_blocks(len(p) - system_len + new) + 1 for p in prompts) + _blocks(64 + 4) + 4
    pool = enable(model, num_blocks=capacity, block_size=BLOCK_SIZE)
    machine = machine_info()
    try:
        with torch.inference_mode():
            # plain: an explicit cache makes the enabled generate step aside
            _greedy(model, warm, 4, cache=DynamicCache(config=model.config))
            _greedy(model, warm, 4)  # enabled
        query0, hit0 = pool.num_query_tokens, pool.num_hit_tokens
        ttft: dict[str, list[float]] = {"plain": [], "enabled": []}
        total: dict[str, list[float]] = {"plain": [], "enabled": []}
        outputs: dict[str, list[list[int]]] = {"plain": [], "enabled": []}
        bar = _bar(2 * questions, "prefix: plain vs enable()", progress)
        for i, prompt in enumerate(prompts):
            for mode in ("plain", "enabled") if i % 2 == 0 else ("enabled", "plain"):
                clock = _FirstTokenClock()
                extra: dict[str, Any] = {"cache": DynamicCache(config=model.config)} if mode == "plain" else {}
                with torch.inference_mode():
                    start = time.perf_counter()
                    tokens = _greedy(model, prompt, new, streamer=clock, **extra)
                    end = time.perf_counter()
                assert clock.first_token_time is not None
                ttft[mode].append(clock.first_token_time - start)
                total[mode].append(end - start)
                outputs[mode].append(tokens)
                bar.update(1)
        bar.close()
        queried, hits = pool.num_query_tokens - query0, pool.num_hit_tokens - hit0
    finally:
        disable(model)
    return PrefixResult(
        quick=quick,
        model=describe_model(model),
        machine=machine,
        system_tokens=system_len,
        question_tokens=[len(p) - system_len for p in prompts],
        new_tokens=new,
        ttft_plain=ttft["plain"],
        ttft_enabled=ttft["enabled"],
        time_plain=total["plain"],
        time_enabled=total["enabled"],
        prefill_plain=sum(len(p) for p in prompts),
        prefill_enabled=queried - hits,
        hit_tokens=hits,
        query_tokens=queried,
        mismatches=[i for i, (a, b) in enumerate(zip(outputs["plain"], outputs["enabled"])) if a != b],
    )


# ---------------------------------------------------------------------------------------------------- 2. cold
COLD_DYNAMIC = "DynamicCache (sdpa)"
COLD_PAGED = "PagedCache (sdpa, compatible mode)"
COLD_PAGED_ATTN = 'PagedCache + attn_implementation="paged"'


@dataclass
class ColdResult:
    """One sequence, no reuse: wall time of ``generate`` per cache, each run ``repeats`` times (seconds).

    Example:
        >>> base, paged = "DynamicCache (sdpa)", "PagedCache (sdpa, compatible mode)"
        >>> result = ColdResult(quick=True, model="Llama", machine="laptop", prompt_tokens=256, new_tokens=64,
        ...     times={base: [1.0, 1.25, 1.0], paged: [1.0, 1.5, 1.125]}, identical={base: True, paged: True})
        >>> result.median(paged), result.slowdown(paged)   # vs a median of 1.0 s for DynamicCache
        (1.125, 1.125)
    """

    quick: bool
    model: str
    machine: str
    prompt_tokens: int
    new_tokens: int
    times: dict[str, list[float]]
    identical: dict[str, bool]

    def median(self, variant: str) -> float:
        """Median wall time of a variant."""
        return statistics.median(self.times[variant])

    def slowdown(self, variant: str) -> float:
        """Median wall time of ``variant`` / median of ``DynamicCache``."""
        return self.median(variant) / self.median(COLD_DYNAMIC)

    def markdown(self) -> str:
        """The report: workload, model, machine, figures and slowdown ratios with their aim."""
        repeats = len(next(iter(self.times.values())))
        workload = (
            f"one sequence, {self.prompt_tokens}-token prompt, {self.new_tokens} new tokens, greedy, batch 1 (no "
            "prefix reuse)"
        )
        measured = (
            f"wall time of one `generate` call; one untimed warm-up per variant, then {repeats} rounds running every "
            "variant once, the order rotating each round to spread drift; median over the rounds. The PagedCache "
            "variants take their blocks from a pool created once beforehand (as a server would), so the pool's "
            "allocation is not timed; the DynamicCache grows its tensors inside the timed call."
        )
        head = _header("2. Cold generation: PagedCache vs DynamicCache", self.quick, workload, self.model, self.machine,
                       measured)  # fmt: skip
        rows = []
        for variant, times in self.times.items():
            ratio = self.slowdown(variant)
            is_base = variant == COLD_DYNAMIC
            rows.append(
                [
                    variant,
                    f"{self.median(variant):.3f} s",
                    f"{min(times):.3f} / {max(times):.3f} s",
                    f"{self.new_tokens / self.median(variant):.1f}",
                    "1.00 (baseline)" if is_base else f"{ratio:.3f}",
                    "-" if is_base else f"≤ {AIM_COLD_SLOWDOWN:.2f}",
                    "-" if is_base else _status(ratio <= AIM_COLD_SLOWDOWN),
                    "reference" if is_base else ("yes" if self.identical[variant] else "**no**"),
                ]
            )
        table = _table(
            [
                "cache",
                "median wall",
                "min / max",
                "new tokens/s",
                "time / DynamicCache",
                "aim",
                "status",
                "same greedy tokens",
            ],
            rows,
        )
        return f"{head}{table}\n"


def cold_benchmark(
    quick: bool = False,
    progress: bool = True,
    *,
    model: PreTrainedModel | None = None,
    seed: int = 0,
    repeats: int | None = None,
) -> ColdResult:
    """One sequence, 512-token prompt, 256 new tokens (quick: 256 / 64): ``PagedCache`` (sdpa and paged attention)
    vs ``DynamicCache``; median of ``repeats`` rounds (default 5) after one warm-up each.

    Example:
        >>> model = bench_model(quick=True)   # what quick=True builds when no model is given
        >>> model.config.hidden_size
        256
        >>> result = cold_benchmark(quick=True, progress=False, model=model, repeats=3)  # doctest: +SKIP
        >>> list(result.times)  # doctest: +SKIP
        ['DynamicCache (sdpa)', 'PagedCache (sdpa, compatible mode)', 'PagedCache + attn_implementation="paged"']
        >>> result.slowdown('PagedCache + attn_implementation="paged"') <= 1.10  # the aim  # doctest: +SKIP
        True
    """
    prompt_len, new = (256, 64) if quick else (512, 256)
    repeats = repeats if repeats is not None else 5
    model = _model_for(model, quick, seed)
    rng = random.Random(seed + 2)
    prompt = _tokens(rng, prompt_len, model.config.vocab_size)
    pool = PagedKVPool(model, num_blocks=_blocks(prompt_len + new) + 2, block_size=BLOCK_SIZE)
    machine = machine_info()

    def run(variant: str, max_new: int) -> tuple[float, list[int]]:
        if variant == COLD_DYNAMIC:
            cache: Any = DynamicCache(config=model.config)
            implementation = "sdpa"
        else:
            cache = PagedCache(model, pool=pool)
            implementation = "paged" if variant == COLD_PAGED_ATTN else "sdpa"
        with _attn(model, implementation), torch.inference_mode():
            start = time.perf_counter()
            tokens = _greedy(model, prompt, max_new, cache=cache)
            elapsed = time.perf_counter() - start
        if isinstance(cache, PagedCache):
            cache.release()
        return elapsed, tokens

    variants = [COLD_DYNAMIC, COLD_PAGED, COLD_PAGED_ATTN]
    bar = _bar(len(variants) * (repeats + 1), "cold: PagedCache vs DynamicCache", progress)
    for variant in variants:
        run(variant, min(new, 16))
        bar.update(1)
    times: dict[str, list[float]] = {v: [] for v in variants}
    tokens: dict[str, list[int]] = {}
    for r in range(repeats):
        for variant in variants[r % len(variants) :] + variants[: r % len(variants)]:
            elapsed, out = run(variant, new)
            times[variant].append(elapsed)
            tokens.setdefault(variant, out)
            bar.update(1)
    bar.close()
    return ColdResult(
        quick=quick,
        model=describe_model(model),
        machine=machine,
        prompt_tokens=prompt_len,
        new_tokens=new,
        times=times,
        identical={v: tokens[v] == tokens[COLD_DYNAMIC] for v in variants},
    )


# ---------------------------------------------------------------------------------------------------- 3. memory
@dataclass
class MemoryRow:
    """KV bytes one cache reserved for the batch."""

    cache: str
    reserved_bytes: int
    how: str
    identical: bool


@dataclass
class MemoryResult:
    """Mixed-length left-padded batch: KV bytes reserved per byte of real tokens, per cache.

    Example:
        Prompts of 20 and 40 tokens, 5 new tokens, 256 KV bytes per token; blocks of 16 tokens hold 24 + 44 tokens in
        2 + 3 blocks, a ``StaticCache`` reserves 2 rows x 45 positions:

        >>> rows = [MemoryRow("PagedCache", 5 * 16 * 256, "blocks held", True),
        ...         MemoryRow("StaticCache", 2 * 45 * 256, "preallocated", True)]
        >>> result = MemoryResult(quick=True, model="Llama", machine="laptop", prompt_lengths=[20, 40], new_tokens=5,
        ...     bytes_per_token=256, rows=rows, pool_capacity_bytes=65536)
        >>> result.stored_tokens, result.real_bytes
        (68, 17408)
        >>> round(result.ratio("PagedCache"), 3), round(result.ratio("StaticCache"), 3)
        (1.176, 1.324)
    """

    quick: bool
    model: str
    machine: str
    prompt_lengths: list[int]
    new_tokens: int
    bytes_per_token: int
    rows: list[MemoryRow]
    pool_capacity_bytes: int

    @property
    def stored_tokens(self) -> int:
        """Real tokens stored: every prompt token and every generated token but the last (never fed back)."""
        return sum(n + self.new_tokens - 1 for n in self.prompt_lengths)

    @property
    def real_bytes(self) -> int:
        """Bytes the real tokens need: stored tokens x per-token KV bytes."""
        return self.stored_tokens * self.bytes_per_token

    def ratio(self, cache: str) -> float:
        """Reserved bytes / real-token bytes of one cache."""
        row = next(r for r in self.rows if r.cache == cache)
        return row.reserved_bytes / self.real_bytes

    def markdown(self) -> str:
        """The report: workload, model, machine, bytes and ratios with the aim."""
        batch = len(self.prompt_lengths)
        workload = (
            f"a batch of {batch} prompts of {sorted(self.prompt_lengths)} tokens (seeded, left-padded to "
            f"{max(self.prompt_lengths)}), {self.new_tokens} new tokens, greedy, one `generate` call"
        )
        measured = (
            f"after `generate`; real-token bytes = {self.stored_tokens} stored tokens (prompt + generated - 1 per row: "
            f"the last sampled token is never stored) x {self.bytes_per_token} bytes of keys and values per token over "
            "all layers"
        )
        head = _header("3. KV memory of a mixed-length batch", self.quick, workload, self.model, self.machine, measured)
        rows = []
        for row in self.rows:
            ratio = row.reserved_bytes / self.real_bytes
            paged = row.cache.startswith("PagedCache")
            rows.append(
                [
                    row.cache,
                    _mib(row.reserved_bytes),
                    _mib(self.real_bytes),
                    f"{ratio:.3f}",
                    f"≤ {AIM_MEMORY_RATIO:.2f}" if paged else "-",
                    _status(ratio <= AIM_MEMORY_RATIO) if paged else "-",
                    "reference"
                    if row.cache == "DynamicCache (left padding)"
                    else ("yes" if row.identical else "**no**"),
                    row.how,
                ]
            )
        table = _table(
            ["cache", "KV bytes reserved", "real-token bytes", "reserved / real", "aim", "status", "same greedy tokens",
             "how reserved bytes are measured"],
            rows,
        )  # fmt: skip
        note = (
            f"\nThe PagedCache took its blocks from a pool of {_mib(self.pool_capacity_bytes)} (sized for this batch; "
            "a pool is shared by every cache and request that uses it, so only the blocks held count for this batch).\n"
        )
        return f"{head}{table}\n{note}"


def memory_benchmark(
    quick: bool = False, progress: bool = True, *, model: PreTrainedModel | None = None, seed: int = 0
) -> MemoryResult:
    """8 prompts of 64-1024 tokens (quick: 4 of 32-256), left padding, 128 new tokens (quick: 16): KV bytes reserved
    / real-token bytes for ``PagedCache``, ``DynamicCache`` and ``StaticCache``.

    Example:
        >>> model = bench_model(quick=True)   # what quick=True builds when no model is given
        >>> model.config.num_key_value_heads
        1
        >>> result = memory_benchmark(quick=True, progress=False, model=model)  # doctest: +SKIP
        >>> [row.cache for row in result.rows]  # doctest: +SKIP
        ['PagedCache', 'DynamicCache (left padding)', 'StaticCache']
        >>> result.ratio("PagedCache") <= 1.05  # the aim  # doctest: +SKIP
        True
    """
    batch, (lo, hi), new = (4, (32, 256), 16) if quick else (8, (64, 1024), 128)
    model = _model_for(model, quick, seed)
    rng = random.Random(seed + 3)
    lengths = [lo, hi] + [rng.randint(lo, hi) for _ in range(batch - 2)]
    rng.shuffle(lengths)
    prompts = [_tokens(rng, n, model.config.vocab_size) for n in lengths]
    width = max(lengths)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    pool = PagedKVPool(model, num_blocks=sum(_blocks(n + new) for n in lengths) + 4, block_size=BLOCK_SIZE)
    machine = machine_info()

    def run(cache: Any) -> list[list[int]]:
        with torch.inference_mode():
            out = _generate(model, ids, attention_mask=mask, max_new_tokens=new, do_sample=False, cache=cache)
        return out[:, width:].tolist()

    bar = _bar(3, "memory: KV bytes per cache", progress)
    dynamic = DynamicCache(config=model.config)
    reference = run(dynamic)
    bar.update(1)
    paged = PagedCache(model, pool=pool)
    paged_out = run(paged)
    stats = paged.memory_stats()
    paged.release()
    bar.update(1)
    static = StaticCache(config=model.config, max_cache_len=width + new)
    static_out = run(static)
    bar.update(1)
    bar.close()
    rows = [
        MemoryRow(
            "PagedCache",
            stats.held_bytes,
            f"`memory_stats().held_bytes`: {stats.blocks} blocks of {BLOCK_SIZE} tokens held ({stats.tokens} tokens "
            f"stored, {stats.padding_tokens} padding positions not stored)",
            paged_out == reference,
        ),
        MemoryRow(
            "DynamicCache (left padding)",
            cache_tensor_bytes(dynamic),
            f"bytes of its key/value tensors: {batch} rows x {width + new - 1} positions",
            True,
        ),
        MemoryRow(
            "StaticCache",
            cache_tensor_bytes(static),
            f"bytes of its preallocated key/value tensors: {batch} rows x max_cache_len {width + new}",
            static_out == reference,
        ),
    ]
    return MemoryResult(
        quick=quick,
        model=describe_model(model),
        machine=machine,
        prompt_lengths=lengths,
        new_tokens=new,
        bytes_per_token=kv_bytes_per_token(model),
        rows=rows,
        pool_capacity_bytes=pool.memory_stats().capacity_bytes,
    )


# ---------------------------------------------------------------------------------------------------- 4. engine
@dataclass
class PeerResult:
    """One way of serving the engine benchmark's requests.

    Attributes:
        name: the peer.
        wall: seconds from the start to the last request's completion (None when the peer could not run).
        latencies: per request, seconds from the start (all requests arrive at once) to its completion.
        generated_tokens: useful generated tokens (each request's own ``max_new_tokens``).
        prefill_computed: prompt positions computed (real tokens; see ``padding_computed``).
        padding_computed: padding positions computed besides (padded batch).
        peak_kv_bytes: KV memory at the peak; ``kv_how`` says how it was obtained.
        mismatches: requests whose greedy tokens differ from the one-at-a-time reference.
        error: why the peer could not run ("n/a (reason)").
        note: anything the reader needs to interpret the row.
        tokens: per request, its greedy tokens.
        counted_positions: positions the model computed, counted by a forward hook.
        decode_positions: of those, the decode positions (one per generated token after the first, per row run).

    Example:
        >>> PeerResult("pagedcore Engine", wall=2.0, latencies=[1.25, 2.0], generated_tokens=96).tokens_per_second
        48.0
        >>> PeerResult("transformers continuous batching", error="n/a (ImportError: ...)").tokens_per_second is None
        True
    """

    name: str
    wall: float | None = None
    latencies: list[float] = field(default_factory=list)
    generated_tokens: int = 0
    prefill_computed: int | None = None
    padding_computed: int = 0
    peak_kv_bytes: int | None = None
    kv_how: str = ""
    mismatches: list[int] = field(default_factory=list)
    error: str | None = None
    note: str = ""
    tokens: list[list[int]] | None = field(default=None, repr=False)
    counted_positions: int | None = None
    decode_positions: int = 0

    @property
    def tokens_per_second(self) -> float | None:
        """Useful generated tokens per second of wall time."""
        return self.generated_tokens / self.wall if self.wall else None


@dataclass
class EngineResult:
    """Requests sharing a prefix served by the Engine and its peers (see :class:`PeerResult`).

    Example:
        >>> peers = [PeerResult("generate, one at a time", wall=6.0, generated_tokens=24),
        ...          PeerResult("pagedcore Engine", wall=1.5, generated_tokens=24)]
        >>> result = EngineResult(quick=True, model="Llama", machine="laptop", prefix_tokens=256,
        ...     unique_lengths=[8, 16], new_tokens=[8, 16], peers=peers, engine_config="", hf_config="")
        >>> result.prompt_tokens, result.unique_tokens
        (536, 280)
        >>> result.speedup("generate, one at a time"), result.peer("pagedcore Engine").tokens_per_second
        (4.0, 16.0)
    """

    quick: bool
    model: str
    machine: str
    prefix_tokens: int
    unique_lengths: list[int]
    new_tokens: list[int]
    peers: list[PeerResult]
    engine_config: str
    hf_config: str

    @property
    def unique_tokens(self) -> int:
        """The shared prefix once plus every request's own tokens."""
        return self.prefix_tokens + sum(self.unique_lengths)

    @property
    def prompt_tokens(self) -> int:
        """All prompt tokens of all requests."""
        return len(self.unique_lengths) * self.prefix_tokens + sum(self.unique_lengths)

    def peer(self, name: str) -> PeerResult:
        """The result of one peer."""
        return next(p for p in self.peers if p.name == name)

    def speedup(self, name: str) -> float | None:
        """Wall time of ``name`` / wall time of the Engine."""
        other, engine = self.peer(name).wall, self.peer(ENGINE).wall
        return other / engine if other and engine else None

    def markdown(self) -> str:
        """The report: workload, model, machine, per-peer figures and the Engine's ratios with their aims."""
        n = len(self.unique_lengths)
        workload = (
            f"{n} requests: a shared {self.prefix_tokens}-token prefix followed by "
            f"{min(self.unique_lengths)}-{max(self.unique_lengths)} unique tokens, "
            f"{min(self.new_tokens)}-{max(self.new_tokens)} new tokens each (seeded), greedy, eos ignored; all "
            f"requests arrive at once. {self.prompt_tokens} prompt tokens, {self.unique_tokens} unique, "
            f"{sum(self.new_tokens)} tokens to generate"
        )
        measured = (
            "wall time from the start to the last completion, one run per peer after an untimed warm-up of its code "
            "path; tokens/s = the requests' own generated tokens / wall time; latency of a request = its completion "
            "time since the start (one at a time: cumulative; padded batch: every request completes at the end; "
            "continuous batching and Engine: when the request finished). Prefill tokens computed: Engine = "
            "`stats().prompt_tokens_computed`; every peer also cross-checked by counting the positions each model "
            "forward computes (minus one decode position per generated token after the first)."
        )
        head = _header("4. Continuous batching with a shared prefix", self.quick, workload, self.model, self.machine,
                       measured)  # fmt: skip
        rows = []
        for p in self.peers:
            if p.error is not None:
                rows.append([p.name, p.error, "n/a", "n/a", "n/a", "n/a", "n/a", "n/a"])
                continue
            prefill = "n/a" if p.prefill_computed is None else f"{p.prefill_computed}"
            if p.padding_computed:
                prefill += f" (+{p.padding_computed} padding)"
            kv = "n/a" if p.peak_kv_bytes is None else _mib(p.peak_kv_bytes)
            rows.append(
                [
                    p.name,
                    f"{p.wall:.2f} s",
                    f"{p.tokens_per_second:.1f}",
                    f"{_percentile(p.latencies, 50):.2f} s",
                    f"{_percentile(p.latencies, 99):.2f} s",
                    prefill,
                    f"{kv} ({p.kv_how})",
                    "reference"
                    if p.name == ONE_AT_A_TIME
                    else (f"{len(p.mismatches)} of {n}" if p.mismatches else "0"),
                ]
            )
        table = _table(
            ["peer", "wall", "gen tokens/s", "p50 latency", "p99 latency", "prefill tokens computed", "peak KV",
             "greedy mismatches vs one-at-a-time"],
            rows,
        )  # fmt: skip
        ratio_rows = []
        for name, aim in AIM_ENGINE_SPEEDUP.items():
            s = self.speedup(name)
            ratio_rows.append(
                [
                    f"Engine speedup vs {name} (wall)",
                    "n/a" if s is None else _x(s),
                    f"≥ {aim:g}x",
                    "n/a" if s is None else _status(s >= aim),
                ]
            )
        engine = self.peer(ENGINE)
        if engine.prefill_computed is not None:
            r = engine.prefill_computed / self.unique_tokens
            ratio_rows.append(
                [
                    "Engine prefill tokens computed / unique tokens",
                    f"{r:.3f}",
                    f"≤ {AIM_ENGINE_PREFILL_RATIO:g}",
                    _status(r <= AIM_ENGINE_PREFILL_RATIO),
                ]
            )
        ratios = _table(["ratio", "value", "aim", "status"], ratio_rows)
        notes = [f"- Engine: {self.engine_config}.", f"- {HF_CONTINUOUS}: {self.hf_config}."]
        notes += [f"- {p.name}: {p.note}" for p in self.peers if p.note]
        mism = [p for p in self.peers if p.mismatches and p.name != ONE_AT_A_TIME]
        notes += [f"- {p.name}: greedy tokens differ from one-at-a-time for requests {p.mismatches}." for p in mism]
        return f"{head}{table}\n\n{ratios}\n\n" + "\n".join(notes) + "\n"


def engine_benchmark(
    quick: bool = False, progress: bool = True, *, model: PreTrainedModel | None = None, seed: int = 0
) -> EngineResult:
    """32 requests: a shared 512-token prefix + 16-64 unique tokens, 16-64 new tokens each (quick: 16 requests,
    256-token prefix, 8-32 unique, 8-16 new). Compares the :class:`Engine` with ``generate`` one request at a time,
    ``generate`` on the left-padded batch and transformers' continuous batching; see :class:`EngineResult`.

    Example:
        >>> model = bench_model(quick=True)   # what quick=True builds when no model is given
        >>> model.config.vocab_size
        8000
        >>> result = engine_benchmark(quick=True, progress=False, model=model)  # doctest: +SKIP
        >>> [peer.name for peer in result.peers]  # doctest: +SKIP
        ['generate, one at a time', 'generate, padded batch', 'transformers continuous batching', 'pagedcore Engine']
        >>> result.speedup("generate, one at a time") >= 3.0  # the aim  # doctest: +SKIP
        True
    """
    if quick:
        count, prefix_len, (u_lo, u_hi), (n_lo, n_hi) = 16, 256, (8, 32), (8, 16)
    else:
        count, prefix_len, (u_lo, u_hi), (n_lo, n_hi) = 32, 512, (16, 64), (16, 64)
    model = _model_for(model, quick, seed)
    vocab = model.config.vocab_size
    rng = random.Random(seed + 4)
    prefix = _tokens(rng, prefix_len, vocab)
    prompts = [prefix + _tokens(rng, rng.randint(u_lo, u_hi), vocab) for _ in range(count)]
    news = [rng.randint(n_lo, n_hi) for _ in range(count)]
    warm = [_tokens(rng, 24, vocab) for _ in range(2)]
    num_blocks = sum(_blocks(len(p) + n) for p, n in zip(prompts, news)) + 8
    budget = prefix_len  # tokens per step: 512 (the Engine's default) in the full workload, scaled down with --quick
    machine = machine_info()

    runs: list[tuple[str, Callable[[], PeerResult]]] = [
        (ONE_AT_A_TIME, lambda: _one_at_a_time(model, prompts, news, warm, progress)),
        (PADDED_BATCH, lambda: _padded_batch(model, prompts, news, warm)),
        (HF_CONTINUOUS, lambda: _hf_continuous(model, prompts, news, warm, num_blocks, budget, progress)),
        (ENGINE, lambda: _engine(model, prompts, news, warm, num_blocks, budget, progress)),
    ]
    peers: list[PeerResult] = []
    bar = _bar(len(runs), "engine benchmark: peers", progress)
    for name, fn in runs:
        bar.set_postfix_str(name)
        try:
            peer = fn()
        except Exception as exc:  # a peer that cannot run keeps its row with the reason
            peer = PeerResult(name, error=f"n/a ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
        peers.append(peer)
        bar.update(1)
    bar.close()
    reference = peers[0].tokens
    for peer in peers:
        if reference is not None and peer.tokens is not None:
            peer.mismatches = [i for i, (a, b) in enumerate(zip(reference, peer.tokens)) if a != b]
        if peer.counted_positions is not None and peer.error is None:
            computed = peer.counted_positions - peer.decode_positions - peer.padding_computed
            if peer.prefill_computed is None:
                peer.prefill_computed = computed
            elif computed != peer.prefill_computed:
                peer.note += f" Forward-hook count of prefill positions: {computed} (differs from its own counter)."
    return EngineResult(
        quick=quick,
        model=describe_model(model),
        machine=machine,
        prefix_tokens=prefix_len,
        unique_lengths=[len(p) - prefix_len for p in prompts],
        new_tokens=news,
        peers=peers,
        engine_config=(
            f"block size {BLOCK_SIZE}, {num_blocks} blocks (room for every request without sharing), "
            f"max_num_batched_tokens {budget} (tokens computed per step; the same budget for transformers' continuous "
            f"batching), max_num_seqs {count}, prefix caching on, created inside the timed run; "
            "peak KV = `stats().kv_peak_used_bytes` (blocks held at the peak; the pool reserves its capacity up front)"
        ),
        hf_config=(
            f"`model.continuous_batching_context_manager` + `add_request(max_new_tokens=...)` per request, the code "
            "path `generate_batch` wraps (`generate_batch` itself takes one `max_new_tokens` for all requests); "
            f"requests added in the order `generate_batch` uses (sorted by prompt when block sharing is on); "
            f"`ContinuousBatchingConfig(page_size={BLOCK_SIZE}, num_blocks={num_blocks}, max_batch_tokens={budget}, "
            f"max_requests_per_batch={count}, allow_block_sharing=True)`, no warm-up (CUDA-graph capture only), "
            "manager created inside the timed run as `generate_batch` does; peak KV = its preallocated cache tensor "
            "(used blocks at the peak are not exposed)"
        ),
    )


def _one_at_a_time(
    model: PreTrainedModel, prompts: list[list[int]], news: list[int], warm: list[list[int]], progress: bool
) -> PeerResult:
    with torch.inference_mode():
        _greedy(model, warm[0], 2, cache=DynamicCache(config=model.config))
    peer = PeerResult(ONE_AT_A_TIME, kv_how="measured: largest DynamicCache, tensor bytes")
    tokens: list[list[int]] = []
    peak = 0
    bar = _bar(len(prompts), ONE_AT_A_TIME, progress)
    with _counting(model) as counter, torch.inference_mode():
        start = time.perf_counter()
        for prompt, new in zip(prompts, news):
            cache = DynamicCache(config=model.config)
            tokens.append(_greedy(model, prompt, new, cache=cache))
            peer.latencies.append(time.perf_counter() - start)
            peak = max(peak, cache_tensor_bytes(cache))
            bar.update(1)
        peer.wall = time.perf_counter() - start
    bar.close()
    peer.generated_tokens = sum(len(t) for t in tokens)
    peer.peak_kv_bytes = peak
    peer.tokens = tokens
    peer.counted_positions = counter.positions
    peer.decode_positions = sum(n - 1 for n in news)
    return peer


def _padded_batch(
    model: PreTrainedModel, prompts: list[list[int]], news: list[int], warm: list[list[int]]
) -> PeerResult:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    longest = max(news)
    with torch.inference_mode():
        w = torch.tensor([warm[0], [PAD] * 8 + warm[1][8:]])
        m = torch.tensor([[1] * len(warm[0]), [0] * 8 + [1] * (len(warm[1]) - 8)])
        _generate(model, w, attention_mask=m, max_new_tokens=2, do_sample=False)
    cache = DynamicCache(config=model.config)
    with _counting(model) as counter, torch.inference_mode():
        start = time.perf_counter()
        out = _generate(model, ids, attention_mask=mask, max_new_tokens=longest, do_sample=False, cache=cache)
        wall = time.perf_counter() - start
    tokens = [out[i, width : width + n].tolist() for i, n in enumerate(news)]
    peer = PeerResult(
        PADDED_BATCH,
        wall=wall,
        latencies=[wall] * len(prompts),
        generated_tokens=sum(news),
        prefill_computed=sum(len(p) for p in prompts),
        padding_computed=sum(width - len(p) for p in prompts),
        peak_kv_bytes=cache_tensor_bytes(cache),
        kv_how="measured: DynamicCache tensor bytes at the end",
        note=(
            f"one `generate` call with max_new_tokens={longest} (the largest), each request's output truncated to its "
            f"own max_new_tokens; it computes {len(prompts) * longest} tokens for {sum(news)} useful ones, and every "
            "request completes at the end"
        ),
    )
    peer.tokens = tokens
    peer.counted_positions = counter.positions
    peer.decode_positions = len(prompts) * (longest - 1)  # every row runs `longest` steps
    return peer


def _hf_continuous(
    model: PreTrainedModel,
    prompts: list[list[int]],
    news: list[int],
    warm: list[list[int]],
    num_blocks: int,
    budget: int,
    progress: bool,
) -> PeerResult:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    generation_config = GenerationConfig(
        do_sample=False, eos_token_id=-1, pad_token_id=PAD, max_new_tokens=max(news), bos_token_id=1
    )

    def config() -> Any:
        return ContinuousBatchingConfig(
            page_size=BLOCK_SIZE,
            num_blocks=num_blocks,
            max_batch_tokens=budget,
            max_requests_per_batch=len(prompts),
            allow_block_sharing=True,
        )

    def serve(batch: list[list[int]], limits: list[int], bar: Any) -> tuple[dict[int, Any], int | None]:
        results: dict[int, Any] = {}
        reserved = None
        with model.continuous_batching_context_manager(  # type: ignore[operator]
            generation_config=generation_config,
            continuous_batching_config=config(),
            block=True,
            timeout=30,
            warmup=False,
        ) as manager:
            order = sorted(range(len(batch)), key=lambda i: batch[i], reverse=True)
            ids = {}
            for i in order:
                rid = manager.add_request(batch[i], request_id=f"r{i}", max_new_tokens=limits[i], eos_token_id=-1)
                if rid is None:
                    raise RuntimeError(f"the continuous batching manager refused request {i}")
                ids[rid] = i
            while len(results) < len(batch):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("the continuous batching thread stopped before every request finished")
                    continue
                if result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                    done = result.lifespan[1] if result.lifespan[1] > 0 else time.perf_counter()
                    results[ids[result.request_id]] = (result, done)
                    bar.update(1)
            processor = getattr(manager, "batch_processor", None)
            tensor = getattr(getattr(processor, "cache", None), "cache_tensor", None)
            if isinstance(tensor, torch.Tensor):
                reserved = tensor.numel() * tensor.element_size()
        return results, reserved

    with _attn(model, "sdpa"):
        serve(warm, [2, 2], _bar(0, "", False))
    bar = _bar(len(prompts), HF_CONTINUOUS, progress)
    with _attn(model, "sdpa"), _counting(model) as counter:
        start = time.perf_counter()
        results, reserved = serve(prompts, news, bar)
        stopped = time.perf_counter()
    bar.close()
    tokens = [list(results[i][0].generated_tokens) for i in range(len(prompts))]
    latencies = [results[i][1] - start for i in range(len(prompts))]
    wall = max(latencies)
    peer = PeerResult(
        HF_CONTINUOUS,
        wall=wall,
        latencies=latencies,
        generated_tokens=sum(len(t) for t in tokens),
        peak_kv_bytes=reserved,
        kv_how="reserved: preallocated cache tensor",
        note=(
            "prefill tokens computed counted with a forward hook (it reports no counter of its own); wall time ends "
            "at the last request's completion: stopping the manager's thread afterwards took "
            f"{stopped - start - wall:.2f} s more, which `generate_batch` also waits for but is not counted here."
        ),
    )
    peer.tokens = tokens
    peer.counted_positions = counter.positions
    peer.decode_positions = sum(n - 1 for n in news)
    return peer


def _engine(
    model: PreTrainedModel,
    prompts: list[list[int]],
    news: list[int],
    warm: list[list[int]],
    num_blocks: int,
    budget: int,
    progress: bool,
) -> PeerResult:
    with Engine(model, num_blocks=64, block_size=BLOCK_SIZE) as engine:
        engine.generate(warm, SamplingParams(max_new_tokens=2, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in news]
    with _counting(model) as counter:
        start = time.perf_counter()
        with Engine(
            model,
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=budget,
            max_num_seqs=len(prompts),
        ) as engine:
            outputs = engine.generate(prompts, params, use_tqdm=progress)
            wall = time.perf_counter() - start
            stats = engine.stats()
    errors = [o.error for o in outputs if o.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    peer = PeerResult(
        ENGINE,
        wall=wall,
        latencies=[(o.metrics.finish_time or start) - start for o in outputs],
        generated_tokens=stats.generated_tokens,
        prefill_computed=stats.prompt_tokens_computed,
        peak_kv_bytes=stats.kv_peak_used_bytes,
        kv_how="measured: blocks held at the peak",
        note=(
            f"{stats.num_steps} steps, {stats.num_preemptions} preemptions, prefix hits {stats.prefix_hit_tokens} of "
            f"{stats.prefix_query_tokens} looked-up prompt tokens."
        ),
    )
    peer.tokens = [o.token_ids for o in outputs]
    peer.counted_positions = counter.positions
    peer.decode_positions = sum(n - 1 for n in news)
    return peer


# ---------------------------------------------------------------------------------------------------- all
def write_chart(path: str | os.PathLike[str], engine: EngineResult, prefix: PrefixResult | None = None) -> None:
    """A PNG (matplotlib, Agg): wall time and generated tokens/s of the engine benchmark's peers, and the prefix
    benchmark's mean TTFT when given.

    Example:
        >>> import tempfile
        >>> engine = EngineResult(quick=True, model="Llama", machine="laptop", prefix_tokens=256,
        ...     unique_lengths=[8, 16], new_tokens=[8, 16], engine_config="", hf_config="",
        ...     peers=[PeerResult("generate, one at a time", wall=6.0, generated_tokens=24),
        ...            PeerResult("pagedcore Engine", wall=1.5, generated_tokens=24)])
        >>> path = Path(tempfile.gettempdir()) / "engine.png"
        >>> write_chart(path, engine)  # doctest: +SKIP
        >>> path.exists()  # doctest: +SKIP
        True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if prefix is not None else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))
    names = [p.name for p in engine.peers]
    labels = [n.replace("generate, ", "generate\n").replace(" continuous", "\ncontinuous") for n in names]
    colors = ["#999999", "#bbbbbb", "#7a9cc6", "#d9822b"]
    walls = [p.wall or 0.0 for p in engine.peers]
    rates = [p.tokens_per_second or 0.0 for p in engine.peers]
    for ax, values, title, unit, fmt in (
        (axes[0], walls, "wall time (lower is better)", "s", "{:.2f}"),
        (axes[1], rates, "generated tokens/s (higher is better)", "tok/s", "{:.0f}"),
    ):
        bars = ax.bar(range(len(values)), values, color=colors[: len(values)])
        ax.set_xticks(range(len(values)), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit)
        for rect, peer, value in zip(bars, engine.peers, values):
            text = "n/a" if peer.error is not None else fmt.format(value)
            ax.annotate(text, (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center", va="bottom",
                        fontsize=8)  # fmt: skip
    if prefix is not None:
        ax = axes[2]
        values = [statistics.fmean(prefix.ttft_plain) * 1e3, statistics.fmean(prefix.ttft_enabled) * 1e3]
        bars = ax.bar([0, 1], values, color=["#999999", "#d9822b"])
        ax.set_xticks([0, 1], ["plain generate", "generate +\nenable()"], fontsize=8)
        ax.set_title(f"prefix benchmark: mean TTFT ({prefix.ttft_speedup:.1f}x)", fontsize=10)
        ax.set_ylabel("ms")
        for rect, value in zip(bars, values):
            ax.annotate(f"{value:.0f}", (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center",
                        va="bottom", fontsize=8)  # fmt: skip
    suffix = " (quick workload)" if engine.quick else ""
    fig.suptitle(
        f"{len(engine.unique_lengths)} requests sharing a {engine.prefix_tokens}-token prefix{suffix}", fontsize=11
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


BENCHMARKS: dict[str, Callable[..., Any]] = {
    "prefix": prefix_benchmark,
    "cold": cold_benchmark,
    "memory": memory_benchmark,
    "engine": engine_benchmark,
}


def run_one(name: str, quick: bool = False, progress: bool = True, threads: int | None = None) -> str:
    """Run one benchmark of :data:`BENCHMARKS` (``"prefix"``, ``"cold"``, ``"memory"``, ``"engine"``); returns its
    markdown.

    Example:
        >>> sorted(BENCHMARKS)
        ['cold', 'engine', 'memory', 'prefix']
        >>> print(run_one("memory", quick=True, progress=False, threads=1))  # doctest: +SKIP
        ### 3. KV memory of a mixed-length batch (quick workload)
        ...
    """
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose from {sorted(BENCHMARKS)}")
    with torch_threads(threads):
        return str(BENCHMARKS[name](quick, progress).markdown())


def script_main(name: str, argv: list[str] | None = None, description: str = "") -> int:
    """The command line of the ``examples/bench_*.py`` scripts: run benchmark ``name`` and print its markdown.

    Options: ``--quick``, ``--out FILE`` (also write the report), ``--threads N``, ``--no-progress``.

    Example:
        >>> script_main("memory", ["--quick", "--no-progress", "--threads", "1"])  # doctest: +SKIP
        ### 3. KV memory of a mixed-length batch (quick workload)
        ...
        0
    """
    parser = argparse.ArgumentParser(description=description.splitlines()[0] if description else None)
    parser.add_argument("--quick", action="store_true", help="smaller model and workload (a smoke run)")
    parser.add_argument("--out", type=Path, help="also write the markdown report to this file")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    markdown = run_one(name, quick=args.quick, progress=not args.no_progress, threads=args.threads)
    print(markdown)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(markdown)
    return 0


def run_all(
    quick: bool = False,
    out_dir: str | os.PathLike[str] = "bench-out",
    progress: bool = True,
    threads: int | None = None,
) -> str:
    """Run the four benchmarks on one model; write ``out_dir/results.md`` and ``out_dir/engine.png``.

    ``threads``: torch intra-op threads for the run (default: torch's, one per core). Returns the markdown of all
    tables.

    Example:
        >>> bench_config(quick=True).num_hidden_layers   # the model a quick run builds and shares between the four
        4
        >>> markdown = run_all(quick=True, out_dir="bench-out", progress=False, threads=1)  # doctest: +SKIP
        >>> markdown.splitlines()[0]  # doctest: +SKIP
        '# pagedcore benchmarks (quick workload)'
        >>> sorted(p.name for p in Path("bench-out").iterdir())  # doctest: +SKIP
        ['engine.png', 'results.md']
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with torch_threads(threads):
        model = bench_model(quick=quick)
        prefix = prefix_benchmark(quick, progress, model=model)
        cold = cold_benchmark(quick, progress, model=model)
        memory = memory_benchmark(quick, progress, model=model)
        engine = engine_benchmark(quick, progress, model=model)
        machine = machine_info()
    elapsed = time.perf_counter() - started
    title = "# pagedcore benchmarks" + (" (quick workload)" if quick else "")
    intro = (
        f"Run on {machine}; {elapsed:.0f} s in all. Wall-clock figures depend on what else the machine is "
        "doing: compare figures measured on a quiet machine."
    )
    markdown = "\n\n".join(
        [title, intro, prefix.markdown(), cold.markdown(), memory.markdown(), engine.markdown(), "![](engine.png)\n"]
    )
    (out / "results.md").write_text(markdown)
    write_chart(out / "engine.png", engine, prefix)
    return markdown
