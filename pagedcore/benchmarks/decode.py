"""Benchmark 6: decode time per token against context length, ``PagedCache`` (stock sdpa attention and
``attn_implementation="paged"``) vs ``DynamicCache`` and ``StaticCache``, on the run's model and on a narrower-headed
one (fewer layers, half the vocabulary), where the cache's own cost weighs more against the model's.

One ``generate`` call per (model, context, cache): a prompt of ``context - new_tokens`` tokens, then ``new_tokens``
greedy tokens, so the decode steps read contexts up to ``context``. A streamer stamps every generated token; the
decode time per token is the time from the first token (the end of the prefill) to the last, divided by the decode
steps in between. The prefill is not timed.
"""

from __future__ import annotations

import contextlib
import functools
import random
import statistics
from dataclasses import dataclass

from transformers import PreTrainedModel

from pagedcore.adapters.transformers import PagedKVPool

from . import peers
from .common import BLOCK_SIZE, blocks_for, describe_model, model_from_config, random_tokens
from .context import BenchContext
from .plots import Curve, LineChart, LinePanel
from .report import Aim, Header, Reported, Section, Table
from .runner import Runner, Timed, TokenStamps

__all__ = ["DecodeResult", "narrow_model", "run"]

KINDS = {kind.name: kind for kind in (peers.DYNAMIC, peers.STATIC, peers.PAGED_SDPA, peers.PAGED_ATTN)}
DYNAMIC, STATIC, PAGED_SDPA, PAGED_ATTN = KINDS
VARIANTS = tuple(KINDS)
AIM_DECODE_RATIO = Aim(1.00, fmt="{:.2f}")  # PagedCache decode time / DynamicCache decode time, both attention paths
CHART = "decode.png"
HEADERS = ["context", "DynamicCache", "StaticCache", "PagedCache (sdpa)", "PagedCache (paged attn)",
           "paged sdpa / Dynamic", "paged attn / Dynamic", "aim", "status", "same greedy tokens"]  # fmt: skip


def narrow_model(model: PreTrainedModel, seed: int = 0) -> PreTrainedModel:
    """A model shaped like ``model`` with a quarter fewer layers and half the vocabulary (the small model's 8 layers
    and 32000 tokens give 6 layers and 16000), random weights drawn from ``seed``, same dtype and device.

    Example:
        >>> from pagedcore.benchmarks.common import bench_model
        >>> narrow = narrow_model(bench_model(size="tiny"))
        >>> narrow.config.num_hidden_layers, narrow.config.vocab_size, narrow.config.hidden_size
        (1, 256, 64)
    """
    config = model.config
    fields = {
        **config.to_dict(),
        "num_hidden_layers": max(1, config.num_hidden_layers * 3 // 4),
        "vocab_size": config.vocab_size // 2,
    }
    return model_from_config(type(config).from_dict(fields), seed, model.dtype, model.device)


def _label(model: PreTrainedModel) -> str:
    return f"{model.config.num_hidden_layers} layers, vocab {model.config.vocab_size}"


@dataclass
class DecodePoint:
    """One model at one context: per cache, the decode seconds per token of each round, and whether its greedy
    tokens equal DynamicCache's."""

    model: str
    context: int
    times: dict[str, list[float]]
    identical: dict[str, bool]

    def ms(self, variant: str) -> float:
        """Median decode milliseconds per token."""
        return 1000 * statistics.median(self.times[variant])

    def ratio(self, variant: str) -> float:
        """Median decode time of ``variant`` / DynamicCache's."""
        return statistics.median(self.times[variant]) / statistics.median(self.times[DYNAMIC])


@dataclass
class DecodeResult(Reported):
    """Decode time per token by model, context and cache.

    Example:
        >>> point = DecodePoint("8 layers, vocab 32000", 512,
        ...     {DYNAMIC: [0.020, 0.022], STATIC: [0.021, 0.021], PAGED_SDPA: [0.022, 0.022], PAGED_ATTN: [0.02, 0.02]},
        ...     {v: True for v in VARIANTS})
        >>> result = DecodeResult(Header(True, "**8 layers, vocab 32000**: Llama", "laptop"),
        ...     labels=["8 layers, vocab 32000"], new_tokens=32, repeats=2, points=[point])
        >>> round(point.ms(DYNAMIC), 3), round(point.ratio(PAGED_SDPA), 3), result.missed()
        (21.0, 1.048, ['8 layers, vocab 32000 at 512: PagedCache (sdpa) 1.048x'])
    """

    head: Header  # its model: every model's label and description
    labels: list[str]  # the models' labels, in the order they ran
    new_tokens: int
    repeats: int
    points: list[DecodePoint]

    @property
    def contexts(self) -> list[int]:
        """The contexts measured, ascending."""
        return sorted({p.context for p in self.points})

    def missed(self) -> list[str]:
        """The (model, context, paged path) points above the aim."""
        return [
            f"{p.model} at {p.context}: {v} {p.ratio(v):.3f}x"
            for p in self.points
            for v in (PAGED_SDPA, PAGED_ATTN)
            if not AIM_DECODE_RATIO.met(p.ratio(v))
        ]

    def section(self) -> Section:
        """The report: workload, models, machine, a table per model, the ratios with their aim, the line chart."""
        workload = (
            f"one sequence per `generate` call, greedy, batch 1: a prompt of (context - {self.new_tokens}) random "
            f"tokens, then {self.new_tokens} new tokens, so the last decode step reads the whole context; contexts "
            f"{', '.join(map(str, self.contexts))}; every cache on each of the {len(self.labels)} models"
        )
        measured = (
            "decode time per token = (stamp of the last generated token - stamp of the first) / decode steps between "
            "them, stamped by a streamer (the prefill is not timed); one untimed warm-up per cache and model at the "
            "smallest context; per model and context, every cache prefills the prompt once (untimed), then "
            f"{self.repeats} rounds alternate the caches (the order rotating each round), each round cropping every "
            "cache back to the prompt but its last token and decoding again; median over the rounds. Each PagedCache "
            "variant takes its blocks from a pool of its own per model, created beforehand, with "
            "`kv_layout=\"auto\"` as PagedCache's private pool (each KV head's keys contiguous on the CPU); "
            "DynamicCache grows its tensors, StaticCache is allocated for the context when its cache is created."
        )
        body: list[Table | str] = [
            Table(HEADERS, [_row(p) for p in self.points if p.model == label],
                  caption=f"**{label}**: decode milliseconds per token, median")
            for label in self.labels
        ]  # fmt: skip
        missed, total = self.missed(), 2 * len(self.points)
        body.append(
            f"All {total} (model, context, paged path) points meet the aim."
            if not missed
            else f"{len(missed)} of {total} (model, context, paged path) points above the aim: {'; '.join(missed)}."
        )
        return Section("6. Decode time per token: PagedCache vs DynamicCache and StaticCache", self.head, workload,
                       measured, body=body, line_charts=[self._chart()])  # fmt: skip

    def _chart(self) -> LineChart:
        """``decode.png``: a panel per model, decode ms per token against context, a curve per cache."""
        panels = []
        for label in self.labels:
            points = [p for p in self.points if p.model == label]
            curves = [Curve(v, [p.context for p in points], [p.ms(v) for p in points]) for v in VARIANTS]
            panels.append(LinePanel(label, "context (tokens)", "decode ms / token (lower is better)", curves))
        suffix = " (quick workload)" if self.head.quick else ""
        return LineChart(CHART, f"Decode time per token, batch 1{suffix}", panels, "decode time per token")


def _row(p: DecodePoint) -> list[object]:
    worst = max(p.ratio(PAGED_SDPA), p.ratio(PAGED_ATTN))
    differ = [v for v in VARIANTS[1:] if not p.identical[v]]
    same = "yes (all four)" if not differ else f"**no**: {', '.join(differ)}"
    return [p.context, *[f"{p.ms(v):.2f}" for v in VARIANTS], f"{p.ratio(PAGED_SDPA):.3f}",
            f"{p.ratio(PAGED_ATTN):.3f}", AIM_DECODE_RATIO.text, AIM_DECODE_RATIO.status(worst), same]  # fmt: skip


def _decode(model: PreTrainedModel, variant: str, prompt: list[int], cache: object, max_new: int) -> Timed:
    """Decode ``max_new`` tokens after ``prompt``; the seconds per decode step and the tokens. A cache that holds the
    prompt already is cropped back to all but its last token first, so only that token is computed before the decode
    steps (the prompt's prefill is done once per cache, not once per round)."""
    held = cache.get_seq_length()  # type: ignore[attr-defined]
    if held:
        cache.crop(len(prompt) - 1 - held)  # type: ignore[attr-defined]
    stamps = TokenStamps()
    out = KINDS[variant].greedy(model, prompt, max_new, cache, streamer=stamps)
    return Timed(stamps.per_decode_step(), out)


def _point(
    runner: Runner,
    model: PreTrainedModel,
    label: str,
    prompt: list[int],
    pools: dict[str, PagedKVPool],
    new: int,
    repeats: int,
) -> DecodePoint:
    """Every cache on one model at one context: the prompt's prefill once each (untimed), then the rounds."""
    context = len(prompt) + new
    with contextlib.ExitStack() as stack:
        caches = {v: stack.enter_context(KINDS[v].cache(model, context, pools.get(v))) for v in VARIANTS}
        runner.warm_up(VARIANTS, lambda v: _decode(model, v, prompt, caches[v], 2))
        trials = runner.rounds(VARIANTS, repeats, lambda v, r: _decode(model, v, prompt, caches[v], new))
    first = {v: trials.outputs(v)[0] for v in VARIANTS}
    times = {v: trials.seconds(v) for v in VARIANTS}
    return DecodePoint(label, context, times, {v: first[v] == first[DYNAMIC] for v in VARIANTS})  # fmt: skip


def run(
    ctx: BenchContext,
    *,
    narrow: PreTrainedModel | None = None,
    contexts: tuple[int, ...] | None = None,
    new_tokens: int | None = None,
    repeats: int | None = None,
) -> DecodeResult:
    """Decode ms per token at contexts 512, 2048, 4096 (quick: 128, 256, 512) with 32 new tokens (quick: 8), every
    cache on ``model`` and on ``narrow`` (default :func:`narrow_model` of it), median of ``repeats`` rounds (default
    7; quick 2). Each cache prefills a context's prompt once; every round crops it back and decodes again.

    Example:
        >>> from pagedcore.benchmarks import BenchOptions
        >>> ctx = BenchContext(BenchOptions(quick=True, progress=False, model_size="tiny"))
        >>> result = run(ctx, contexts=(48,), new_tokens=4, repeats=1)
        >>> [(p.model, p.context) for p in result.points], all(result.points[0].identical.values())
        ([('2 layers, vocab 512', 48), ('1 layers, vocab 256', 48)], True)
    """
    quick, model, seed = ctx.quick, ctx.model(), ctx.options.seed
    contexts = contexts or ((128, 256, 512) if quick else (512, 2048, 4096))
    new = new_tokens or (8 if quick else 32)
    repeats = repeats or (2 if quick else 7)
    if new < 2 or min(contexts) <= new:
        raise ValueError(f"need 2 <= new_tokens < every context, got {new} for {contexts}")
    narrow = narrow if narrow is not None else narrow_model(model, seed)
    rng = random.Random(seed + 6)
    models = {_label(m): m for m in (model, narrow)}
    prompts = {c: random_tokens(rng, c - new, narrow.config.vocab_size) for c in contexts}
    # A pool per model and paged variant (both caches of a context live at once; as a PagedCache's own pool, each
    # sequence grows into consecutive blocks), kv_layout="auto" as a PagedCache's own pool.
    pools = {label: {v: PagedKVPool(m, num_blocks=blocks_for(max(contexts)) + 2, block_size=BLOCK_SIZE,
                                    kv_layout="auto") for v in (PAGED_SDPA, PAGED_ATTN)}
             for label, m in models.items()}  # fmt: skip
    smallest = prompts[min(contexts)]

    def warm_up(m: PreTrainedModel, label: str, v: str) -> None:  # untimed, at the smallest context; no prefill kept
        with KINDS[v].cache(m, min(contexts), pools[label].get(v)) as cache:
            _decode(m, v, smallest, cache, 4)

    total = len(models) * len(VARIANTS) * (1 + len(contexts) * (1 + repeats))
    with Runner(ctx, "decode: caches", total) as runner:
        for label, m in models.items():
            runner.warm_up(VARIANTS, functools.partial(warm_up, m, label))
        points = [_point(runner, m, label, prompts[c], pools[label], new, repeats)
                  for label, m in models.items() for c in contexts]  # fmt: skip
    described = "; ".join(f"**{label}**: {describe_model(m)}" for label, m in models.items())
    return DecodeResult(
        head=runner.header(described),
        labels=list(models),
        new_tokens=new,
        repeats=repeats,
        points=points,
    )
