"""The family matrix: every causal-LM model type in the four modes, against stock ``generate``.

:func:`run_family` builds a family tiny (:mod:`family_configs`), runs stock ``generate`` with a ``DynamicCache``
(the reference: a left-padded batch of two prompts, and each prompt alone), then each mode on the same weights:

- ``cache``: ``generate(..., cache=PagedCache(model))`` on the padded batch;
- ``enable``: ``enable(model)``, then the padded batch twice (the second call should hit the first's prefixes);
- ``engine``: ``Engine(model).generate`` on the two prompts, with chunked prefill (a budget of 8 tokens);
- ``paged``: the model loaded with ``attn_implementation="paged"``, ``generate`` with a ``PagedCache``.

Each mode's :class:`Outcome` is ``exact`` (greedy tokens identical and every step's fp32 logits within 1e-4),
``refused`` (an :class:`~pagedcore.errors.UnsupportedModelError` where the cache, ``enable`` or the Engine is set
up, or transformers refusing ``attn_implementation="paged"``), ``wrong`` or ``crash`` (neither is ever accepted).
The expected outcomes are :data:`family_expected.EXPECTED`; ``docs/families.md`` is made from them
(``scripts/families_page.py``).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch
from family_configs import tiny_config
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig

import pagedcore.adapters.transformers as pc
from pagedcore import UnsupportedModelError
from pagedcore.adapters.transformers.probe import verdicts

__all__ = ["MODES", "Outcome", "run_family"]

MODES = ("cache", "enable", "engine", "paged")
NEW_TOKENS = 8
ATOL = 1e-4
PROMPTS = ([5, 9, 30, 41, 7, 8, 100, 12, 13, 14, 60, 22], [77, 78, 79, 80, 81, 82, 83, 84, 85])


@dataclass(frozen=True)
class Outcome:
    """One mode's result: ``status`` (``exact``, ``refused``, ``wrong``, ``crash``), ``path`` (how an exact run
    went, when not the usual way: ``padded`` / ``gathered``, the compatible paths; ``no prefix hits`` for an
    ``enable()`` whose second call reused nothing), ``detail`` (the refusal's message, where tokens differ, the
    exception)."""

    status: str
    path: str = ""
    detail: str = ""

    def label(self) -> str:
        """``status`` with its path, as the expectations and the docs page write it."""
        if self.status == "exact" and self.path:
            return f"exact ({self.path})"
        return self.status


def _model(model_type: str, attn: str | None) -> torch.nn.Module:
    config = tiny_config(model_type)
    torch.manual_seed(0)
    kwargs = {} if attn is None else {"attn_implementation": attn}
    model = AutoModelForCausalLM.from_config(config, **kwargs).eval()
    # A clean generation config: the matrix checks the cache and attention, not a checkpoint's defaults (Whisper's
    # begin_suppress_tokens, MPT's use_cache=False)
    model.generation_config = GenerationConfig(pad_token_id=0, eos_token_id=None, use_cache=True)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    return ids, mask


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, **kwargs: Any) -> Any:
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
        return_dict_in_generate=True, output_logits=True, **kwargs,
    )  # fmt: skip


def _difference(got: Any, want: Any) -> str:
    """Where ``got`` departs from ``want`` (tokens, then logits), or "" when they agree."""
    if got.sequences.tolist() != want.sequences.tolist():
        return f"tokens {got.sequences[:, -NEW_TOKENS:].tolist()} != {want.sequences[:, -NEW_TOKENS:].tolist()}"
    for step, (g, w) in enumerate(zip(got.logits, want.logits)):
        error = float((g.float() - w.float()).abs().max())
        if error > ATOL:
            return f"logits differ by {error:.2g} at step {step}"
    return ""


def _cache_path(model: Any) -> str:
    cache = next((v for v in reversed(verdicts(model)) if v.kind == "cache"), None)
    return "" if cache is None or cache.path == "paged" else str(cache.path)


def _mode_cache(model: Any, want: Any, paged: bool = False) -> Outcome:
    try:
        cache = pc.PagedCache(model, num_blocks=64, block_size=4)
    except UnsupportedModelError as exc:
        return Outcome("refused", detail=str(exc))
    got = _generate(model, *_batch(), cache=cache)
    cache.release()
    diff = _difference(got, want)
    if diff:
        return Outcome("wrong", detail=diff)
    return Outcome("exact", _cache_path(model) if paged else "")


def _mode_enable(model: Any, want: Any) -> Outcome:
    try:
        pool = pc.enable(model, num_blocks=64, block_size=4)
    except UnsupportedModelError as exc:
        return Outcome("refused", detail=str(exc))
    try:
        diffs = [_difference(_generate(model, *_batch()), want) for _ in range(2)]
    finally:
        pc.disable(model)
    if any(diffs):
        return Outcome("wrong", detail=next(d for d in diffs if d))
    return Outcome("exact", "" if pool.num_hit_tokens else "no prefix hits")


def _mode_engine(model: Any, alone: list[Any]) -> Outcome:
    try:
        engine = pc.Engine(model, num_blocks=64, block_size=4, max_num_batched_tokens=8)
    except UnsupportedModelError as exc:
        return Outcome("refused", detail=str(exc))
    with engine:
        outs = engine.generate([list(p) for p in PROMPTS], max_new_tokens=NEW_TOKENS, do_sample=False,
                               output_logits=True, use_tqdm=False)  # fmt: skip
        # greedy alone, nothing else read from the logits: the runner may take the argmax itself (argmax_head.py)
        plain = engine.generate([list(p) for p in PROMPTS], max_new_tokens=NEW_TOKENS, do_sample=False, use_tqdm=False)
    for out, again, want, prompt in zip(outs, plain, alone, PROMPTS):
        if out.error is not None or again.error is not None:
            return Outcome("crash", detail=str(out.error or again.error))
        if out.token_ids != want.sequences[0, len(prompt) :].tolist():
            return Outcome("wrong", detail=f"tokens {out.token_ids} != {want.sequences[0, len(prompt) :].tolist()}")
        if again.token_ids != out.token_ids:
            return Outcome("wrong", detail=f"greedy-only tokens {again.token_ids} != {out.token_ids}")
        for step, (g, w) in enumerate(zip(out.samples[0].logits or [], want.logits)):
            # relative to the largest logit, as the probe's tolerance: stock generate's own steps differ from one
            # forward over the sequence by up to 4e-4 on the chunked linear-attention families (Qwen3-Next, Kimi)
            if float((g.float() - w[0].float()).abs().max()) > ATOL * max(1.0, float(w[0].float().abs().max())):
                return Outcome("wrong", detail=f"logits differ at step {step}")
    # a model with recurrent-state layers is not probed (its state steps are what tests/test_hybrid_engine.py checks)
    engine_verdict = next((v for v in reversed(verdicts(model)) if v.kind == "engine"), None)
    path = "paged" if engine_verdict is None else engine_verdict.path
    return Outcome("exact", "" if path == "paged" else str(path))


def _mode_paged(model_type: str, want: Any) -> Outcome:
    try:
        model = _model(model_type, "paged")
    except (ValueError, ImportError, KeyError) as exc:  # transformers refuses the attention implementation
        return Outcome("refused", detail=f"transformers: {type(exc).__name__}: {exc}")
    if model.config.get_text_config(decoder=True)._attn_implementation != "paged":
        return Outcome("refused", detail="transformers keeps its own attention (no AttentionInterface)")
    return _mode_cache(model, want, paged=True)


def run_family(model_type: str, modes: tuple[str, ...] = MODES) -> dict[str, Outcome]:
    """Every mode of ``model_type`` (see the module docstring); a mode that raises where it should not is a
    ``crash`` with the exception."""
    model = _model(model_type, None)
    ids, mask = _batch()
    want = _generate(model, ids, mask, cache=DynamicCache(config=model.config))
    alone = [_generate(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long),
                       cache=DynamicCache(config=model.config)) for p in PROMPTS]  # fmt: skip
    runs = {
        "cache": lambda: _mode_cache(model, want),
        "enable": lambda: _mode_enable(model, want),
        "engine": lambda: _mode_engine(model, alone),
        "paged": lambda: _mode_paged(model_type, want),
    }
    outcomes = {}
    for mode in modes:
        try:
            outcomes[mode] = runs[mode]()
        except Exception as exc:
            outcomes[mode] = Outcome("crash", detail=f"{type(exc).__name__}: {str(exc)[:300]}")
        gc.collect()
    return outcomes
