"""Benchmark 6: decode time per token against context length, ``PagedCache`` (stock sdpa attention and
``attn_implementation="paged"``) vs ``DynamicCache`` and ``StaticCache``, on the run's model and on a narrower-headed
one (fewer layers, half the vocabulary), where the cache's own cost weighs more against the model's.

One ``generate`` call per (model, context, cache): a prompt of ``context - new_tokens`` tokens, then ``new_tokens``
greedy tokens, so the decode steps read contexts up to ``context``. A streamer stamps every generated token; the
decode time per token is the time from the first token (the end of the prefill) to the last, divided by the decode
steps in between. The prefill is not timed.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel, StaticCache
from transformers.generation.streamers import BaseStreamer

from pagedcore.adapters.transformers import PagedCache, PagedKVPool

from .common import (
    BLOCK_SIZE,
    PAD,
    attn,
    bench_model,
    blocks_for,
    describe_model,
    greedy,
    progress_bar,
    random_tokens,
)
from .context import BenchContext
from .plots import Curve, LinePanel
from .report import aim_status, machine_info, section_header, table

__all__ = ["DecodeResult", "TokenStamps", "decode_benchmark", "narrow_model"]

DYNAMIC = "DynamicCache (sdpa)"
STATIC = "StaticCache (sdpa)"
PAGED_SDPA = "PagedCache (sdpa)"
PAGED_ATTN = 'PagedCache + attn_implementation="paged"'
VARIANTS = (DYNAMIC, STATIC, PAGED_SDPA, PAGED_ATTN)
AIM_DECODE_RATIO = 1.00  # PagedCache decode time / DynamicCache decode time, both attention paths
CHART = "decode.png"


class TokenStamps(BaseStreamer):
    """A streamer that stamps every generated token (``generate`` puts the prompt first, then each new token, copied
    to the CPU: a stamp waits for the device to compute its token).

    Example:
        >>> stamps = TokenStamps()
        >>> for value in ("prompt", 1, 2, 3):
        ...     stamps.put(value)
        >>> len(stamps.stamps), stamps.per_decode_step() >= 0
        (3, True)
    """

    def __init__(self) -> None:
        self.puts = 0
        self.stamps: list[float] = []

    def put(self, value: Any) -> None:
        """Called by ``generate`` with the prompt, then with every new token."""
        self.puts += 1
        if self.puts > 1:
            self.stamps.append(time.perf_counter())

    def end(self) -> None:
        """Called by ``generate`` at the end."""

    def per_decode_step(self) -> float:
        """Seconds from the first generated token to the last, per decode step between them."""
        if len(self.stamps) < 2:
            raise ValueError("a decode time needs at least two generated tokens")
        return (self.stamps[-1] - self.stamps[0]) / (len(self.stamps) - 1)


def narrow_model(model: PreTrainedModel, seed: int = 0) -> PreTrainedModel:
    """A model shaped like ``model`` with a quarter fewer layers and half the vocabulary (the small model's 8 layers
    and 32000 tokens give 6 layers and 16000), random weights drawn from ``seed``, same dtype and device.

    Example:
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
    torch.manual_seed(seed)
    narrow = AutoModelForCausalLM.from_config(type(config).from_dict(fields), attn_implementation="sdpa")
    narrow = narrow.to(device=model.device, dtype=model.dtype).eval()
    narrow.generation_config.eos_token_id = None
    narrow.generation_config.pad_token_id = PAD
    return narrow


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
class DecodeResult:
    """Decode time per token by model, context and cache.

    Example:
        >>> point = DecodePoint("8 layers, vocab 32000", 512,
        ...     {DYNAMIC: [0.020, 0.022], STATIC: [0.021, 0.021], PAGED_SDPA: [0.022, 0.022], PAGED_ATTN: [0.02, 0.02]},
        ...     {v: True for v in VARIANTS})
        >>> result = DecodeResult(quick=True, models={"8 layers, vocab 32000": "Llama"}, machine="laptop",
        ...     new_tokens=32, repeats=2, points=[point])
        >>> round(point.ms(DYNAMIC), 3), round(point.ratio(PAGED_SDPA), 3), result.missed()
        (21.0, 1.048, ['8 layers, vocab 32000 at 512: PagedCache (sdpa) 1.048x'])
    """

    quick: bool
    models: dict[str, str]  # label -> description
    machine: str
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
            if p.ratio(v) > AIM_DECODE_RATIO
        ]

    def markdown(self) -> str:
        """The report: workload, models, machine, a table per model and the ratios with their aim."""
        workload = (
            f"one sequence per `generate` call, greedy, batch 1: a prompt of (context - {self.new_tokens}) random "
            f"tokens, then {self.new_tokens} new tokens, so the last decode step reads the whole context; contexts "
            f"{', '.join(map(str, self.contexts))}; every cache on each of the {len(self.models)} models"
        )
        models = "; ".join(f"**{label}**: {desc}" for label, desc in self.models.items())
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
        head = section_header("6. Decode time per token: PagedCache vs DynamicCache and StaticCache", self.quick,
                              workload, models, self.machine, measured)  # fmt: skip
        parts = [head]
        headers = ["context", "DynamicCache", "StaticCache", "PagedCache (sdpa)", "PagedCache (paged attn)",
                   "paged sdpa / Dynamic", "paged attn / Dynamic", "aim", "status", "same greedy tokens"]  # fmt: skip
        for label in self.models:
            rows = []
            for p in (p for p in self.points if p.model == label):
                worst = max(p.ratio(PAGED_SDPA), p.ratio(PAGED_ATTN))
                same = [v for v in VARIANTS[1:] if not p.identical[v]]
                rows.append(
                    [
                        p.context,
                        *[f"{p.ms(v):.2f}" for v in VARIANTS],
                        f"{p.ratio(PAGED_SDPA):.3f}",
                        f"{p.ratio(PAGED_ATTN):.3f}",
                        f"≤ {AIM_DECODE_RATIO:.2f}",
                        aim_status(worst <= AIM_DECODE_RATIO),
                        "yes (all four)" if not same else f"**no**: {', '.join(same)}",
                    ]
                )
            parts.append(f"**{label}**: decode milliseconds per token, median\n\n{table(headers, rows)}\n")
        missed = self.missed()
        total = 2 * len(self.points)
        parts.append(
            f"All {total} (model, context, paged path) points meet the aim."
            if not missed
            else f"{len(missed)} of {total} (model, context, paged path) points above the aim: {'; '.join(missed)}."
        )
        parts.append(f"\n![decode time per token]({CHART})\n")
        return "\n".join(parts)

    def plots(self) -> dict[str, tuple[str, list[LinePanel]]]:
        """``decode.png``: a panel per model, decode ms per token against context, a curve per cache."""
        panels = []
        for label in self.models:
            points = [p for p in self.points if p.model == label]
            curves = [Curve(v, [p.context for p in points], [p.ms(v) for p in points]) for v in VARIANTS]
            panels.append(LinePanel(label, "context (tokens)", "decode ms / token (lower is better)", curves))
        suffix = " (quick workload)" if self.quick else ""
        return {CHART: (f"Decode time per token, batch 1{suffix}", panels)}


def decode_benchmark(
    quick: bool = False,
    progress: bool = True,
    *,
    model: PreTrainedModel | None = None,
    narrow: PreTrainedModel | None = None,
    seed: int = 0,
    contexts: tuple[int, ...] | None = None,
    new_tokens: int | None = None,
    repeats: int | None = None,
) -> DecodeResult:
    """Decode ms per token at contexts 512, 2048, 4096 (quick: 128, 256, 512) with 32 new tokens (quick: 8), every
    cache on ``model`` and on ``narrow`` (default :func:`narrow_model` of it), median of ``repeats`` rounds (default
    7; quick 2). Each cache prefills a context's prompt once; every round crops it back and decodes again.

    Example:
        >>> result = decode_benchmark(quick=True, progress=False, model=bench_model(size="tiny"))  # doctest: +SKIP
        >>> [p.context for p in result.points]  # doctest: +SKIP
        [128, 256, 512, 128, 256, 512]
    """
    contexts = contexts or ((128, 256, 512) if quick else (512, 2048, 4096))
    new = new_tokens or (8 if quick else 32)
    repeats = repeats or (2 if quick else 7)
    if new < 2 or min(contexts) <= new:
        raise ValueError(f"need 2 <= new_tokens < every context, got {new} for {contexts}")
    model = model if model is not None else bench_model(seed, quick=quick)
    narrow = narrow if narrow is not None else narrow_model(model, seed)
    machine = machine_info()
    rng = random.Random(seed + 6)
    models = {_label(m): m for m in (model, narrow)}
    prompts = {c: random_tokens(rng, c - new, narrow.config.vocab_size) for c in contexts}
    # A pool per model and paged variant (both caches of a context live at once; as a PagedCache's own pool, each
    # sequence grows into consecutive blocks), kv_layout="auto" as a PagedCache's own pool.
    pools = {(label, v): PagedKVPool(m, num_blocks=blocks_for(max(contexts)) + 2, block_size=BLOCK_SIZE,
                                     kv_layout="auto")
             for label, m in models.items() for v in (PAGED_SDPA, PAGED_ATTN)}  # fmt: skip

    def new_cache(label: str, variant: str, context: int) -> Any:
        m = models[label]
        if variant == DYNAMIC:
            return DynamicCache(config=m.config)
        if variant == STATIC:
            return StaticCache(config=m.config, max_cache_len=context)
        return PagedCache(m, pool=pools[(label, variant)])

    def run(label: str, variant: str, context: int, cache: Any, max_new: int) -> tuple[float, list[int]]:
        """Decode ``max_new`` tokens after the context's prompt. A cache that holds the prompt already is cropped
        back to all but its last token first, so only that token is computed before the decode steps (the prompt's
        prefill is done once per cache, not once per round)."""
        m = models[label]
        prompt = prompts[context]
        held = cache.get_seq_length()
        if held:
            cache.crop(len(prompt) - 1 - held)
        stamps = TokenStamps()
        with attn(m, "paged" if variant == PAGED_ATTN else "sdpa"), torch.inference_mode():
            out = greedy(m, prompt, max_new, cache=cache, streamer=stamps)
        return stamps.per_decode_step(), out

    bar = progress_bar(len(models) * len(VARIANTS) * (1 + len(contexts) * (1 + repeats)), "decode: caches", progress)
    for label in models:
        for variant in VARIANTS:  # untimed warm-up at the smallest context
            cache = new_cache(label, variant, min(contexts))
            try:
                run(label, variant, min(contexts), cache, 4)
            finally:
                if isinstance(cache, PagedCache):
                    cache.release()
            bar.update(1)
    points = {(label, c): DecodePoint(label, c, {v: [] for v in VARIANTS}, {}) for label in models for c in contexts}
    outputs: dict[tuple[str, int, str], list[int]] = {}
    for label in models:
        for c in contexts:
            caches = {v: new_cache(label, v, c) for v in VARIANTS}
            try:
                for variant in VARIANTS:  # the prompt's prefill, untimed, once per cache
                    run(label, variant, c, caches[variant], 2)
                    bar.update(1)
                for r in range(repeats):
                    order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
                    for variant in order:
                        per_token, out = run(label, variant, c, caches[variant], new)
                        points[(label, c)].times[variant].append(per_token)
                        outputs.setdefault((label, c, variant), out)
                        bar.update(1)
            finally:
                for cache in caches.values():
                    if isinstance(cache, PagedCache):
                        cache.release()
    bar.close()
    for (label, c), point in points.items():
        point.identical = {v: outputs[(label, c, v)] == outputs[(label, c, DYNAMIC)] for v in VARIANTS}
    return DecodeResult(
        quick=quick,
        models={label: describe_model(m) for label, m in models.items()},
        machine=machine,
        new_tokens=new,
        repeats=repeats,
        points=list(points.values()),
    )


def run(ctx: BenchContext) -> DecodeResult:
    """The registry's entry point: the benchmark on the run's model and its narrower-headed variant."""
    return decode_benchmark(ctx.quick, ctx.progress, model=ctx.model(), seed=ctx.options.seed)
