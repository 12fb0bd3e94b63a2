"""Benchmark 2: one sequence without any reuse, ``PagedCache`` (sdpa and ``attn_implementation="paged"``) vs
``DynamicCache``."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from pagedcore.adapters.transformers import PagedCache, PagedKVPool

from .common import (
    BLOCK_SIZE,
    attn,
    bench_model,
    blocks_for,
    clock,
    describe_model,
    greedy,
    progress_bar,
    random_tokens,
)
from .context import BenchContext
from .report import aim_status, machine_info, section_header, table

__all__ = ["ColdResult", "cold_benchmark"]

AIM_COLD_SLOWDOWN = 1.10
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
        head = section_header("2. Cold generation: PagedCache vs DynamicCache", self.quick, workload, self.model,
                              self.machine, measured)  # fmt: skip
        rows = []
        for variant, times in self.times.items():
            slowdown = self.slowdown(variant)
            is_base = variant == COLD_DYNAMIC
            rows.append(
                [
                    variant,
                    f"{self.median(variant):.3f} s",
                    f"{min(times):.3f} / {max(times):.3f} s",
                    f"{self.new_tokens / self.median(variant):.1f}",
                    "1.00 (baseline)" if is_base else f"{slowdown:.3f}",
                    "-" if is_base else f"≤ {AIM_COLD_SLOWDOWN:.2f}",
                    "-" if is_base else aim_status(slowdown <= AIM_COLD_SLOWDOWN),
                    "reference" if is_base else ("yes" if self.identical[variant] else "**no**"),
                ]
            )
        headers = ["cache", "median wall", "min / max", "new tokens/s", "time / DynamicCache", "aim", "status",
                   "same greedy tokens"]  # fmt: skip
        return f"{head}{table(headers, rows)}\n"


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
    model = model if model is not None else bench_model(seed, quick=quick)
    rng = random.Random(seed + 2)
    prompt = random_tokens(rng, prompt_len, model.config.vocab_size)
    pool = PagedKVPool(model, num_blocks=blocks_for(prompt_len + new) + 2, block_size=BLOCK_SIZE)
    machine = machine_info()

    def run_variant(variant: str, max_new: int) -> tuple[float, list[int]]:
        if variant == COLD_DYNAMIC:
            cache: Any = DynamicCache(config=model.config)
            implementation = "sdpa"
        else:
            cache = PagedCache(model, pool=pool)
            implementation = "paged" if variant == COLD_PAGED_ATTN else "sdpa"
        with attn(model, implementation), torch.inference_mode():
            start = clock(model.device)
            out = greedy(model, prompt, max_new, cache=cache)
            elapsed = clock(model.device) - start
        if isinstance(cache, PagedCache):
            cache.release()
        return elapsed, out

    variants = [COLD_DYNAMIC, COLD_PAGED, COLD_PAGED_ATTN]
    bar = progress_bar(len(variants) * (repeats + 1), "cold: PagedCache vs DynamicCache", progress)
    for variant in variants:
        run_variant(variant, min(new, 16))
        bar.update(1)
    times: dict[str, list[float]] = {v: [] for v in variants}
    outputs: dict[str, list[int]] = {}
    for r in range(repeats):
        for variant in variants[r % len(variants) :] + variants[: r % len(variants)]:
            elapsed, out = run_variant(variant, new)
            times[variant].append(elapsed)
            outputs.setdefault(variant, out)
            bar.update(1)
    bar.close()
    return ColdResult(
        quick=quick,
        model=describe_model(model),
        machine=machine,
        prompt_tokens=prompt_len,
        new_tokens=new,
        times=times,
        identical={v: outputs[v] == outputs[COLD_DYNAMIC] for v in variants},
    )


def run(ctx: BenchContext) -> ColdResult:
    """The registry's entry point: the benchmark on the run's model."""
    return cold_benchmark(ctx.quick, ctx.progress, model=ctx.model(), seed=ctx.options.seed)
