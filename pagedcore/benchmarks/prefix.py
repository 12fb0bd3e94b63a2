"""Benchmark 1: a long shared system prompt + many questions, ``enable(model)``-ed generate vs plain generate."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from pagedcore.adapters.transformers import disable, enable

from .chart import Panel
from .common import (
    BLOCK_SIZE,
    FirstTokenClock,
    bench_model,
    blocks_for,
    clock,
    describe_model,
    greedy,
    progress_bar,
    random_tokens,
)
from .context import BenchContext
from .report import aim_status, machine_info, ratio, section_header, table

__all__ = ["PrefixResult", "prefix_benchmark"]

AIM_TTFT_SPEEDUP = 5.0
AIM_PREFIX_PREFILL_RATIO = 1.1


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
        head = section_header(
            "1. Prefix caching: shared system prompt", self.quick, workload, self.model, self.machine, measured
        )
        mean = statistics.fmean
        figures = table(
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
        ratios = table(
            ["ratio", "value", "aim", "status"],
            [
                ["TTFT speedup (mean plain / mean enabled)", ratio(self.ttft_speedup), f"≥ {AIM_TTFT_SPEEDUP:g}x",
                 aim_status(self.ttft_speedup >= AIM_TTFT_SPEEDUP)],
                ["TTFT speedup, questions 2.. only", ratio(self.warm_ttft_speedup), "-", "-"],
                ["total-time speedup", ratio(self.total_speedup), "-", "-"],
                ["prefill tokens computed / unique tokens (enabled)", f"{self.prefill_ratio:.3f}",
                 f"≤ {AIM_PREFIX_PREFILL_RATIO:g}", aim_status(self.prefill_ratio <= AIM_PREFIX_PREFILL_RATIO)],
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

    def chart_panels(self) -> list[Panel]:
        """The chart's panel: mean TTFT of the two modes, in milliseconds."""
        values = [statistics.fmean(self.ttft_plain) * 1e3, statistics.fmean(self.ttft_enabled) * 1e3]
        return [
            Panel(
                f"prefix benchmark: mean TTFT ({self.ttft_speedup:.1f}x)",
                "ms",
                ["plain generate", "generate +\nenable()"],
                values,
                "{:.0f}",
                ("#999999", "#d9822b"),
            )
        ]

    def chart_title(self) -> str:
        """The chart's title when no engine benchmark ran."""
        suffix = " (quick workload)" if self.quick else ""
        return f"a {self.system_tokens}-token system prompt + {len(self.question_tokens)} questions{suffix}"


def prefix_benchmark(
    quick: bool = False, progress: bool = True, *, model: PreTrainedModel | None = None, seed: int = 0
) -> PrefixResult:
    """Shared system prompt (1024 tokens) + 16 questions of ~32 tokens, 32 new tokens each (quick: 512 / 10 / 8).

    Compares ``generate`` with automatic prefix caching (:func:`~pagedcore.adapters.transformers.enable`) against
    plain ``generate`` with a ``DynamicCache``; see :class:`PrefixResult`.

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
    model = model if model is not None else bench_model(seed, quick=quick)
    vocab = model.config.vocab_size
    rng = random.Random(seed + 1)
    system = random_tokens(rng, system_len, vocab)
    prompts = [system + random_tokens(rng, rng.randint(q_lo, q_hi), vocab) for _ in range(questions)]
    warm = random_tokens(rng, 64, vocab)
    capacity = blocks_for(system_len) + sum(blocks_for(len(p) - system_len + new) + 1 for p in prompts)
    capacity += blocks_for(64 + 4) + 4
    pool = enable(model, num_blocks=capacity, block_size=BLOCK_SIZE)
    machine = machine_info()
    try:
        with torch.inference_mode():
            # plain: an explicit cache makes the enabled generate step aside
            greedy(model, warm, 4, cache=DynamicCache(config=model.config))
            greedy(model, warm, 4)  # enabled
        query0, hit0 = pool.num_query_tokens, pool.num_hit_tokens
        ttft: dict[str, list[float]] = {"plain": [], "enabled": []}
        total: dict[str, list[float]] = {"plain": [], "enabled": []}
        outputs: dict[str, list[list[int]]] = {"plain": [], "enabled": []}
        bar = progress_bar(2 * questions, "prefix: plain vs enable()", progress)
        for i, prompt in enumerate(prompts):
            for mode in ("plain", "enabled") if i % 2 == 0 else ("enabled", "plain"):
                stamp = FirstTokenClock()
                extra: dict[str, Any] = {"cache": DynamicCache(config=model.config)} if mode == "plain" else {}
                with torch.inference_mode():
                    start = clock(model.device)
                    out = greedy(model, prompt, new, streamer=stamp, **extra)
                    end = clock(model.device)
                assert stamp.first_token_time is not None
                ttft[mode].append(stamp.first_token_time - start)
                total[mode].append(end - start)
                outputs[mode].append(out)
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


def run(ctx: BenchContext) -> PrefixResult:
    """The registry's entry point: the benchmark on the run's model."""
    return prefix_benchmark(ctx.quick, ctx.progress, model=ctx.model(), seed=ctx.options.seed)
