"""Benchmark 1: a long shared system prompt + many questions, ``enable(model)``-ed generate vs plain generate."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from transformers import PreTrainedModel

from pagedcore.adapters.transformers import disable, enable

from .chart import Panel
from .common import BLOCK_SIZE, blocks_for, random_tokens
from .context import BenchContext
from .peers import DYNAMIC, ENABLED, CacheKind, mismatches
from .report import RATIO_HEADERS, Aim, Header, Reported, Section, Table, ratio
from .runner import FirstTokenClock, Runner, Timed, clock

__all__ = ["PrefixResult", "run"]

AIM_TTFT_SPEEDUP = Aim(5.0, at_most=False, fmt="{:g}x")
AIM_PREFIX_PREFILL_RATIO = Aim(1.1)
MODES = {"plain": DYNAMIC, "enabled": ENABLED}  # plain: an explicit cache makes the enabled generate step aside


@dataclass
class PrefixResult(Reported):
    """Shared system prompt + questions: ``enable(model)``-ed generate vs plain generate (DynamicCache).

    Times are per question, in seconds; TTFT is from the ``generate`` call to the streamer receiving the first token.

    Example:
        Two questions after a 512-token system prompt; the first enabled question is cold (it caches the prompt):

        >>> result = PrefixResult(Header(True, "Llama", "laptop"), system_tokens=512,
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

    head: Header
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

    def section(self) -> Section:
        """The report: workload, model, machine, figures and ratios with their aims, the chart's TTFT panel."""
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
        same = (
            f"identical for all {n} questions"
            if not self.mismatches
            else f"**differ** for questions {self.mismatches} (of {n})"
        )
        suffix = " (quick workload)" if self.head.quick else ""
        return Section(
            "1. Prefix caching: shared system prompt", self.head, workload, measured,
            body=[self._figures(), self._ratios(), f"Greedy outputs of the two modes: {same}."],
            panels=self._panels(),
            chart_title=f"a {self.system_tokens}-token system prompt + {n} questions{suffix}",
        )  # fmt: skip

    def _figures(self) -> Table:
        mean, ms = statistics.fmean, "{:.1f} ms".format
        plain, enabled = self.ttft_plain, self.ttft_enabled
        return Table(
            ["", "plain generate (DynamicCache)", "generate + `enable(model)`"],
            [
                ["mean TTFT, all questions", ms(mean(plain) * 1e3), ms(mean(enabled) * 1e3)],
                ["TTFT, first question", ms(plain[0] * 1e3), ms(enabled[0] * 1e3)],
                ["mean TTFT, questions 2..", ms(mean(plain[1:]) * 1e3), ms(mean(enabled[1:]) * 1e3)],
                ["total time", f"{sum(self.time_plain):.2f} s", f"{sum(self.time_enabled):.2f} s"],
                ["prefill tokens computed", self.prefill_plain, self.prefill_enabled],
                ["prefix hits / looked-up prompt tokens", "-", f"{self.hit_tokens} / {self.query_tokens}"],
                ["unique tokens (system prompt + questions)", self.unique_tokens, self.unique_tokens],
            ],
        )

    def _ratios(self) -> Table:
        return Table(
            RATIO_HEADERS,
            [
                AIM_TTFT_SPEEDUP.row("TTFT speedup (mean plain / mean enabled)", ratio(self.ttft_speedup),
                                     self.ttft_speedup),
                ["TTFT speedup, questions 2.. only", ratio(self.warm_ttft_speedup), "-", "-"],
                ["total-time speedup", ratio(self.total_speedup), "-", "-"],
                AIM_PREFIX_PREFILL_RATIO.row("prefill tokens computed / unique tokens (enabled)",
                                             f"{self.prefill_ratio:.3f}", self.prefill_ratio),
                ["prefill tokens computed / unique tokens (plain)", f"{self.prefill_plain / self.unique_tokens:.3f}",
                 "-", "-"],
            ],
        )  # fmt: skip

    def _panels(self) -> list[Panel]:
        """The chart's panel: mean TTFT of the two modes, in milliseconds."""
        values = [statistics.fmean(self.ttft_plain) * 1e3, statistics.fmean(self.ttft_enabled) * 1e3]
        labels = ["plain generate", "generate +\nenable()"]
        title = f"prefix benchmark: mean TTFT ({self.ttft_speedup:.1f}x)"
        return [Panel(title, "ms", labels, values, "{:.0f}", ("#999999", "#d9822b"))]


def _ask(model: PreTrainedModel, kind: CacheKind, prompt: list[int], new: int) -> Timed:
    """One question: the call's wall time, its tokens, and its time to the first token."""
    stamp = FirstTokenClock()
    with kind.cache(model, len(prompt) + new) as cache:
        start = clock(model.device)
        out = kind.greedy(model, prompt, new, cache, streamer=stamp)
        end = clock(model.device)
    assert stamp.first_token_time is not None
    return Timed(end - start, out, stamp.first_token_time - start)


def run(ctx: BenchContext) -> PrefixResult:
    """Shared system prompt (1024 tokens) + 16 questions of ~32 tokens, 32 new tokens each (quick: 512 / 10 / 8).

    Compares ``generate`` with automatic prefix caching (:func:`~pagedcore.adapters.transformers.enable`) against
    plain ``generate`` with a ``DynamicCache``; see :class:`PrefixResult`.

    Example:
        >>> from pagedcore.benchmarks import BenchOptions
        >>> ctx = BenchContext(BenchOptions(quick=True, progress=False, model_size="tiny"))
        >>> result = run(ctx)  # doctest: +SKIP
        >>> result.system_tokens, len(result.question_tokens), result.mismatches  # doctest: +SKIP
        (512, 10, [])
        >>> print(result.markdown())  # doctest: +SKIP
        ### 1. Prefix caching: shared system prompt (quick workload)
        ...
    """
    quick, model, seed = ctx.quick, ctx.model(), ctx.options.seed
    system_len, questions, (q_lo, q_hi), new = (512, 10, (24, 40), 8) if quick else (1024, 16, (24, 40), 32)
    vocab = model.config.vocab_size
    rng = random.Random(seed + 1)
    system = random_tokens(rng, system_len, vocab)
    prompts = [system + random_tokens(rng, rng.randint(q_lo, q_hi), vocab) for _ in range(questions)]
    warm = random_tokens(rng, 64, vocab)
    capacity = blocks_for(system_len) + sum(blocks_for(len(p) - system_len + new) + 1 for p in prompts)
    capacity += blocks_for(64 + 4) + 4
    pool = enable(model, num_blocks=capacity, block_size=BLOCK_SIZE)
    try:
        with Runner(ctx, "prefix: plain vs enable()", 2 * questions + 2) as runner:
            runner.warm_up(list(MODES), lambda mode: MODES[mode].run(model, warm, 4))
            query0, hit0 = pool.num_query_tokens, pool.num_hit_tokens
            trials = runner.rounds(list(MODES), questions, lambda mode, i: _ask(model, MODES[mode], prompts[i], new))
        queried, hits = pool.num_query_tokens - query0, pool.num_hit_tokens - hit0
    finally:
        disable(model)
    plain, enabled = trials.runs["plain"], trials.runs["enabled"]
    return PrefixResult(
        head=runner.header(),
        system_tokens=system_len,
        question_tokens=[len(p) - system_len for p in prompts],
        new_tokens=new,
        ttft_plain=[t.first_token or 0.0 for t in plain],
        ttft_enabled=[t.first_token or 0.0 for t in enabled],
        time_plain=[t.seconds for t in plain],
        time_enabled=[t.seconds for t in enabled],
        prefill_plain=sum(len(p) for p in prompts),
        prefill_enabled=queried - hits,
        hit_tokens=hits,
        query_tokens=queried,
        mismatches=mismatches(trials.outputs("plain"), trials.outputs("enabled")),
    )
