"""Automatic prefix caching for plain ``model.generate``: one line to enable, one to disable.

``enable(model)`` gives the model a long-lived :class:`PagedKVPool` and wraps its ``generate``. Each call then:

1. looks every row's prompt up in the pool's prefix trie (per namespace) and attaches the longest cached prefix
   to a fresh :class:`PagedCache`, always leaving the last prompt token to compute;
2. runs the original ``generate`` with that cache, which feeds only the uncached part of the prompt;
3. registers the rows' full blocks in the trie and releases the call's references.

**Batches and left padding.** ``generate`` sees one rectangular cache length for all rows, so the usable prefix is
the shortest one: with ``pad[r]`` left-padding positions and ``hit[r]`` cached tokens in row ``r``, the first
``L = min_r(pad[r] + hit[r])`` positions are taken from the cache (padding positions cost nothing) and each row
computes the rest. A row whose mask is not left-padded (right padding, holes) turns prefix reuse off for the call.

**Namespaces.** ``with namespace("tenant-a"): model.generate(...)`` or ``model.generate(..., pagedcore_namespace=
"tenant-a")``: prompts in different namespaces never share blocks (a prefix hit is measurably faster, so shared
blocks would let one tenant probe another's prompts by timing; see vLLM's CVE-2025-46570).

``num_return_sequences`` / ``num_beams`` > 1: the prompt is computed once for the unexpanded batch, then every row
is forked; the copies share the prompt's blocks (copy-on-write) instead of recomputing and storing it k times.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import weakref
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from pagedcore.errors import ConfigError, InvalidRequestError, OutOfBlocksError

from .cache import PagedCache
from .pool import PagedKVPool
from .spec import text_config

__all__ = ["disable", "enable", "is_enabled", "namespace", "prefix_pool"]

NAMESPACE_KWARG = "pagedcore_namespace"
_UNSET: Any = object()
_namespace: ContextVar[Any] = ContextVar("pagedcore_namespace", default=_UNSET)
_call_ids = itertools.count()


@dataclass
class _Enabled:
    pool: PagedKVPool
    namespace: Hashable
    attention_backend: str | None
    had_instance_generate: bool
    instance_generate: Any


_ENABLED: weakref.WeakKeyDictionary[Any, _Enabled] = weakref.WeakKeyDictionary()


def enable(
    model: Any,
    *,
    pool: PagedKVPool | None = None,
    num_blocks: int | None = None,
    memory_budget: int | float | str | None = None,
    block_size: int | None = None,
    namespace: Hashable = None,
    attention_backend: str | None = None,
    eviction_policy: str | None = None,
) -> PagedKVPool:
    """Make plain ``model.generate(...)`` reuse cached prompt prefixes across calls.

    Args:
        model: a transformers causal LM.
        pool: a pool to use (e.g. shared with an Engine); else one is created with the sizing arguments.
        num_blocks / memory_budget / block_size / eviction_policy: sizing of a new pool (see PagedKVPool).
        namespace: default namespace of this model's calls (override per call or per block of code).
        attention_backend: backend for ``attn_implementation="paged"`` (default: the plugins' choice).

    Returns:
        The pool; read ``pool.num_hit_tokens / pool.num_query_tokens`` for the hit rate.

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from pagedcore.adapters import transformers as pc
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        ...     num_hidden_layers=2, intermediate_size=128, vocab_size=100)).eval()
        >>> pool = pc.enable(model, num_blocks=64, block_size=4)
        >>> prompt = torch.arange(1, 14)[None]
        >>> _ = model.generate(prompt, max_new_tokens=2, do_sample=False)   # cold: computes 13 tokens
        >>> _ = model.generate(prompt, max_new_tokens=2, do_sample=False)   # warm: 12 cached, computes 1
        >>> pool.num_hit_tokens
        12
        >>> _ = pc.disable(model)
    """
    if model in _ENABLED:
        raise ConfigError("prefix caching is already enabled on this model; call disable(model) first")
    if pool is None:
        pool = PagedKVPool(
            model,
            num_blocks=num_blocks,
            memory_budget=memory_budget,
            block_size=block_size,
            eviction_policy=eviction_policy,
        )
    else:
        if num_blocks is not None or memory_budget is not None:
            raise ConfigError("num_blocks / memory_budget size a new pool: not with pool=")
        pool.bind(model)
    had_instance = "generate" in vars(model)
    state = _Enabled(pool, namespace, attention_backend, had_instance, vars(model).get("generate"))
    original = state.instance_generate if had_instance else type(model).generate
    model_ref = weakref.ref(model)

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        target = model_ref()
        if target is None:
            raise ReferenceError("the model was garbage collected")
        call = original if had_instance else functools.partial(original, target)
        return _generate(target, call, state, args, kwargs)

    model.generate = generate
    _ENABLED[model] = state
    return pool


def disable(model: Any) -> PagedKVPool:
    """Restore the model's own ``generate``. Returns the pool (its cached prefixes stay until it is dropped).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        ...     num_hidden_layers=2, intermediate_size=128, vocab_size=100))
        >>> pool = enable(model, num_blocks=16)
        >>> disable(model) is pool, is_enabled(model)
        (True, False)
    """
    state = _ENABLED.pop(model, None)
    if state is None:
        raise ConfigError("prefix caching is not enabled on this model")
    if state.had_instance_generate:
        model.generate = state.instance_generate
    else:
        del model.generate
    return state.pool


def is_enabled(model: Any) -> bool:
    """Whether :func:`enable` is in effect for ``model``.

    Example:
        >>> is_enabled(object())
        False
    """
    return model in _ENABLED


def prefix_pool(model: Any) -> PagedKVPool:
    """The pool :func:`enable` gave ``model``.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        ...     num_hidden_layers=2, intermediate_size=128, vocab_size=100))
        >>> pool = enable(model, num_blocks=16)
        >>> prefix_pool(model) is pool
        True
        >>> _ = disable(model)
    """
    state = _ENABLED.get(model)
    if state is None:
        raise ConfigError("prefix caching is not enabled on this model")
    return state.pool


@contextmanager
def namespace(name: Hashable) -> Iterator[None]:
    """Run ``generate`` calls of enabled models in the block under prefix-cache namespace ``name``.

    Example:
        >>> with namespace("tenant-a"):
        ...     pass  # model.generate(...) here only shares prefixes with other "tenant-a" calls
    """
    token = _namespace.set(name)
    try:
        yield
    finally:
        _namespace.reset(token)


# ---------------------------------------------------------------------- the wrapped generate
def _generate(model: Any, call: Callable[..., Any], state: _Enabled, args: tuple[Any, ...], kwargs: dict) -> Any:
    ns = kwargs.pop(NAMESPACE_KWARG, _UNSET)
    if ns is _UNSET:
        ns = _namespace.get()
    if ns is _UNSET:
        ns = state.namespace
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        return call(*args, **kwargs)  # the caller manages its own cache
    input_ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        return call(*args, **kwargs)  # inputs_embeds or unusual inputs: plain generate
    settings = _settings(model, kwargs, input_ids.shape[1])
    if not settings.use_cache:
        return call(*args, **kwargs)
    _check_inputs(model, input_ids, ns)
    mask = _attention_mask(input_ids, kwargs.get("attention_mask"), settings)
    pads = _left_pads(mask)
    pool = state.pool
    cache = PagedCache(model, pool=pool, namespace=ns, attention_backend=state.attention_backend)
    try:
        rows = [input_ids[r, p:].tolist() for r, p in enumerate(pads)] if pads is not None else None
        length = _attach(cache, pool, rows, pads, ns) if rows is not None and pads is not None else 0
        _check_capacity(pool, cache, input_ids, pads, settings)
        if settings.expand > 1:
            _prefill_once(model, cache, input_ids, mask, length)
            cache.batch_repeat_interleave(settings.expand)
        kwargs["cache"] = cache
        result = call(*args, **kwargs)
        if rows is not None and pads is not None:
            _register(cache, result, rows, pads, settings)
        return result
    finally:
        cache.release()


def _check_inputs(model: Any, input_ids: torch.Tensor, ns: Hashable) -> None:
    """Typed errors for input the prefix cache would otherwise trip over later, half-way through a call."""
    try:
        hash(ns)
    except TypeError:
        raise InvalidRequestError(f"the prefix-cache namespace must be hashable (a str is best), got {ns!r}") from None
    vocab = getattr(text_config(model), "vocab_size", None)
    if input_ids.numel() and vocab:
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise InvalidRequestError(f"token id {bad} is outside the model's vocabulary [0, {vocab})")


@dataclass(frozen=True)
class _Settings:
    max_new_tokens: int
    expand: int
    beams: int
    use_cache: bool
    pad_token_id: Any
    eos_token_id: Any


def _settings(model: Any, kwargs: dict[str, Any], prompt_len: int) -> _Settings:
    config = kwargs.get("generation_config") or model.generation_config

    def get(name: str, default: Any = None) -> Any:
        if kwargs.get(name) is not None:
            return kwargs[name]
        value = getattr(config, name, None)
        return default if value is None else value

    max_new = get("max_new_tokens")
    if max_new is None:
        max_new = max(int(get("max_length", 20)) - prompt_len, 1)
    beams = int(get("num_beams", 1))
    expand = max(beams, int(get("num_return_sequences", 1)))
    use_cache = bool(get("use_cache", True))
    return _Settings(int(max_new), expand, beams, use_cache, get("pad_token_id"), get("eos_token_id"))


def _attention_mask(input_ids: torch.Tensor, mask: Any, settings: _Settings) -> torch.Tensor:
    """The 2-D mask generate will use (inferred from the pad token like generate does when none is given)."""
    if isinstance(mask, torch.Tensor):
        return mask
    pad = settings.pad_token_id
    eos = settings.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else set()
    if pad is not None and pad not in eos_ids and bool((input_ids == pad).any()):
        return (input_ids != pad).long()
    return torch.ones_like(input_ids)


def _left_pads(mask: torch.Tensor) -> list[int] | None:
    """Leading zeros per row, or None if some row is not of the form 0...01...1 (no prefix reuse then)."""
    ones = mask.ne(0).long().cpu()
    count = ones.sum(dim=1)
    pads = mask.shape[1] - count
    expected = torch.arange(mask.shape[1])[None, :] >= pads[:, None]
    if not torch.equal(ones.bool(), expected) or bool((count == 0).any()):
        return None
    return [int(p) for p in pads]


def _attach(cache: PagedCache, pool: PagedKVPool, rows: list[list[int]], pads: list[int], ns: Hashable) -> int:
    """Attach the prefix every row can use (see the module docstring); returns its rectangular length."""
    with pool.lock:
        matches = [pool.kv.match(tokens, ns) for tokens in rows]
        hits = [min(m.num_tokens, len(tokens) - 1) for m, tokens in zip(matches, rows)]
        length = min(p + h for p, h in zip(pads, hits))
        call = next(_call_ids)
        for r, (tokens, pad) in enumerate(zip(rows, pads)):
            used = max(0, length - pad)
            pool.kv.record(len(tokens), used)
            pool.plugins.emit(
                "pagedcore_prefix_hit",
                request_id=f"generate-{call}/{r}",
                num_query_tokens=len(tokens),
                num_hit_tokens=used,
                namespace=ns,
            )
        if length > 0:
            cache.attach_prefix(matches, pads, length)
    return length


def _check_capacity(
    pool: PagedKVPool, cache: PagedCache, input_ids: torch.Tensor, pads: list[int] | None, settings: _Settings
) -> None:
    """Raise OutOfBlocksError before generation when the call cannot fit, so nothing runs half-way."""
    bs = pool.block_size
    total = input_ids.shape[1]
    pads = pads if pads is not None else [0] * input_ids.shape[0]
    held = cache.row_tokens()
    with pool.lock:
        for group in pool.kv.groups:
            need = 0
            for r, pad in enumerate(pads):
                prompt = total - pad
                final = prompt + settings.max_new_tokens - 1  # the last sampled token is never stored
                attached = -(-held[r] // bs) if held else 0
                partial = 1 if held and held[r] % bs else 0  # a partly used cached block is copied on write
                if settings.expand == 1:
                    row_need = -(-final // bs) - attached + partial
                else:  # the prompt once, then per fork its own tail (a copy of the shared last block + new ones)
                    row_need = max(-(-(prompt - 1) // bs) - attached, 0) + partial
                    row_need += settings.expand * (-(-final // bs) - (prompt - 1) // bs)
                if group.sliding_window is not None:
                    row_need = min(row_need, settings.expand * (-(-(group.sliding_window + prompt) // bs) + 2))
                need += row_need
            available = group.block_manager.num_available_blocks
            if need > available:
                raise OutOfBlocksError(
                    f"this generate call needs up to {need} blocks of {bs} tokens (KV group {group.index}) but the "
                    f"pool has {available} available of {group.block_manager.num_blocks}: use a larger pool "
                    "(enable(model, num_blocks=... / memory_budget=...)) or smaller batches",
                    requested=need,
                    available=available,
                )


def _prefill_once(model: Any, cache: PagedCache, input_ids: torch.Tensor, mask: torch.Tensor, start: int) -> None:
    """Compute prompt positions ``start .. T-2`` for the unexpanded batch, so forks share them."""
    end = input_ids.shape[1] - 1
    if end <= start:
        return
    kwargs: dict[str, Any] = {"attention_mask": mask[:, :end], "cache": cache, "use_cache": True}
    parameters = inspect.signature(model.forward).parameters
    if "position_ids" in parameters:
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        kwargs["position_ids"] = positions[:, start:end]
    if "logits_to_keep" in parameters:
        kwargs["logits_to_keep"] = 1
    with torch.no_grad():
        model(input_ids=input_ids[:, start:end], **kwargs)


def _register(cache: PagedCache, result: Any, rows: list[list[int]], pads: list[int], settings: _Settings) -> None:
    """Register every row's full blocks in the trie (prompt only after beam search, whose rows get reordered)."""
    sequences = result if isinstance(result, torch.Tensor) else getattr(result, "sequences", None)
    tokens: list[list[int]] = []
    for i in range(cache.batch_size if cache.batch_size > 0 else 0):
        source = i // settings.expand
        if settings.beams == 1 and isinstance(sequences, torch.Tensor) and i < sequences.shape[0]:
            tokens.append(sequences[i, pads[source] :].tolist())
        else:
            tokens.append(rows[source])
    if tokens:
        cache.cache_prefixes(tokens)
