"""Benchmark 2: one sequence without any reuse, ``PagedCache`` (sdpa and ``attn_implementation="paged"``) vs
``DynamicCache``."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, replace

from pagedcore.adapters.transformers import PagedKVPool

from .common import BLOCK_SIZE, blocks_for, random_tokens
from .context import BenchContext
from .peers import DYNAMIC, PAGED_ATTN, PAGED_SDPA, CacheKind
from .report import Aim, Header, Reported, Section, Table
from .runner import Runner, Timed, clock

__all__ = ["ColdResult", "run"]

AIM_COLD_SLOWDOWN = Aim(1.10, fmt="{:.2f}")
VARIANTS = (DYNAMIC, replace(PAGED_SDPA, name="PagedCache (sdpa, compatible mode)"), PAGED_ATTN)
COLD_DYNAMIC, COLD_PAGED, COLD_PAGED_ATTN = (v.name for v in VARIANTS)


@dataclass
class ColdResult(Reported):
    """One sequence, no reuse: wall time of ``generate`` per cache, each run ``repeats`` times (seconds).

    Example:
        >>> base, paged = "DynamicCache (sdpa)", "PagedCache (sdpa, compatible mode)"
        >>> result = ColdResult(Header(True, "Llama", "laptop"), prompt_tokens=256, new_tokens=64,
        ...     times={base: [1.0, 1.25, 1.0], paged: [1.0, 1.5, 1.125]}, identical={base: True, paged: True})
        >>> result.median(paged), result.slowdown(paged)   # vs a median of 1.0 s for DynamicCache
        (1.125, 1.125)
    """

    head: Header
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

    def section(self) -> Section:
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
        headers = ["cache", "median wall", "min / max", "new tokens/s", "time / DynamicCache", "aim", "status",
                   "same greedy tokens"]  # fmt: skip
        rows = [self._row(variant) for variant in self.times]
        title = "2. Cold generation: PagedCache vs DynamicCache"
        return Section(title, self.head, workload, measured, body=[Table(headers, rows)])

    def _row(self, variant: str) -> list[str]:
        times, slowdown, median = self.times[variant], self.slowdown(variant), self.median(variant)
        figures = [
            variant,
            f"{median:.3f} s",
            f"{min(times):.3f} / {max(times):.3f} s",
            f"{self.new_tokens / median:.1f}",
        ]
        if variant == COLD_DYNAMIC:
            return [*figures, "1.00 (baseline)", "-", "-", "reference"]
        same = "yes" if self.identical[variant] else "**no**"
        return [*figures, f"{slowdown:.3f}", AIM_COLD_SLOWDOWN.text, AIM_COLD_SLOWDOWN.status(slowdown), same]


def run(ctx: BenchContext, *, repeats: int | None = None) -> ColdResult:
    """One sequence, 512-token prompt, 256 new tokens (quick: 256 / 64): ``PagedCache`` (sdpa and paged attention)
    vs ``DynamicCache``; median of ``repeats`` rounds (default 5) after one warm-up each.

    Example:
        >>> from pagedcore.benchmarks import BenchOptions
        >>> ctx = BenchContext(BenchOptions(quick=True, progress=False, model_size="tiny"))
        >>> result = run(ctx, repeats=3)  # doctest: +SKIP
        >>> list(result.times)  # doctest: +SKIP
        ['DynamicCache (sdpa)', 'PagedCache (sdpa, compatible mode)', 'PagedCache + attn_implementation="paged"']
        >>> result.slowdown('PagedCache + attn_implementation="paged"') <= 1.10  # the aim  # doctest: +SKIP
        True
    """
    quick, model, seed = ctx.quick, ctx.model(), ctx.options.seed
    prompt_len, new = (256, 64) if quick else (512, 256)
    repeats = repeats if repeats is not None else 5
    rng = random.Random(seed + 2)
    prompt = random_tokens(rng, prompt_len, model.config.vocab_size)
    pool = PagedKVPool(model, num_blocks=blocks_for(prompt_len + new) + 2, block_size=BLOCK_SIZE)
    kinds = {v.name: v for v in VARIANTS}

    def once(kind: CacheKind, max_new: int) -> Timed:
        with kind.cache(model, prompt_len + max_new, pool) as cache:
            start = clock(model.device)
            out = kind.greedy(model, prompt, max_new, cache)
            return Timed(clock(model.device) - start, out)

    with Runner(ctx, "cold: PagedCache vs DynamicCache", len(kinds) * (repeats + 1)) as runner:
        runner.warm_up(list(kinds), lambda name: once(kinds[name], min(new, 16)))
        trials = runner.rounds(list(kinds), repeats, lambda name, r: once(kinds[name], new))
    return ColdResult(
        head=runner.header(),
        prompt_tokens=prompt_len,
        new_tokens=new,
        times={name: trials.seconds(name) for name in kinds},
        identical={name: trials.outputs(name)[0] == trials.outputs(COLD_DYNAMIC)[0] for name in kinds},
    )
