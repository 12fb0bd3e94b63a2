"""The model's forward hooks that tell a :class:`~pagedcore.adapters.transformers.PagedCache` about each forward
before its first layer runs.

transformers hands a cache only the keys of each layer and (for most models) the ``position_ids``; the 2-D
attention mask, the only thing that says which positions are padding, never reaches it. So a cache made for a model
(``PagedCache(model)``, and every cache ``enable`` makes) has :func:`watch` register a forward pre-hook on that
model: before each forward that carries a ``PagedCache`` (as ``cache=`` or ``past_key_values=``), the hook hands the
cache the forward's input size, attention mask and positions, and the cache reserves the forward on the host there
(``PagedCache.before_forward``); keyword arguments the cache asks for (the paged-attention context of a model with
KV-shared layers, which call no ``update``) are added to the forward's. The layers then only write and gather through
indices already built, so ``model.forward = torch.compile(model.forward, ...)`` traces them without a graph break
(the hooks run outside the compiled function). A forward hook that always runs, also when the forward raised, gives
back a reservation no layer used (``PagedCache.after_forward``).

One pair of hooks per model, whatever the number of caches; forwards without a ``PagedCache`` pay a dictionary
look-up.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch

from pagedcore.errors import ConfigError

from .hook_ids import transparent_hook

__all__ = ["watch", "watched"]

_WATCHED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[type, tuple[str, ...], bool]] = weakref.WeakKeyDictionary()


def watch(model: torch.nn.Module, cache_type: type) -> None:
    """Register (once per model) the hooks that call ``before_forward`` / ``after_forward`` on a ``cache_type``
    instance passed to ``model``'s forward.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import PagedCache
        >>> model = tiny_llama()
        >>> watch(model, PagedCache); watch(model, PagedCache)   # idempotent: one pair of hooks
        >>> watched(model)
        True
    """
    if model in _WATCHED:
        return
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        parameters = {}  # type: ignore[assignment]
    names = tuple(parameters)
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    _WATCHED[model] = (cache_type, names, open_kwargs)
    if _before_forward in getattr(model, "_forward_pre_hooks", {}).values():
        return  # a copy of a watched model (copy.deepcopy, pickle) came with the hooks: once is enough
    model.register_forward_pre_hook(_before_forward, with_kwargs=True)
    model.register_forward_hook(_after_forward, with_kwargs=True, always_call=True)


def watched(model: Any) -> bool:
    """Whether :func:`watch` registered its hooks on ``model``.

    Example:
        >>> watched(torch.nn.Linear(2, 2))
        False
    """
    return isinstance(model, torch.nn.Module) and model in _WATCHED


def _cache_of(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, strict: bool = True
) -> tuple[Any, dict[str, Any]]:
    """The watched cache a forward carries (itself, or the self-attention cache of an ``EncoderDecoderCache``), and
    the forward's inputs by name; ``strict``: a bare cache on a forward that attends to an encoder is refused."""
    cache_type, names, _ = _WATCHED.get(module, (None, (), False))
    if cache_type is None:
        return None, kwargs
    inputs = {**dict(zip(names, args)), **kwargs} if args else kwargs
    cache = inputs.get("cache")
    if cache is None:
        cache = inputs.get("past_key_values")
    if isinstance(cache, cache_type):
        encoder = inputs.get("encoder_hidden_states", inputs.get("encoder_outputs"))
        if strict and (encoder is not None or "decoder_input_ids" in names):
            raise ConfigError(
                f"{type(module).__name__} attends to an encoder's output: pass the paged cache as the self-attention "
                "half of transformers' EncoderDecoderCache(PagedCache(model), DynamicCache()), which holds the "
                "cross-attention's keys and values beside it (alone, it would be given those too)"
            )
        return cache, inputs
    inner = getattr(cache, "self_attention_cache", None)
    return (inner if isinstance(inner, cache_type) else None), inputs


@transparent_hook  # pagedcore's plumbing: the weights watch does not count it (hook_ids)
def _before_forward(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    cache, inputs = _cache_of(module, args, kwargs)
    if cache is None:
        return None
    _, names, open_kwargs = _WATCHED[module]
    # An encoder-decoder model's forward names the decoder's inputs decoder_*: the cache holds the decoder's keys.
    prefix = "decoder_" if "decoder_input_ids" in names else ""
    extra = cache.before_forward(
        input_ids=inputs.get(f"{prefix}input_ids"),
        inputs_embeds=inputs.get(f"{prefix}inputs_embeds"),
        attention_mask=inputs.get(f"{prefix}attention_mask"),
        position_ids=inputs.get(f"{prefix}position_ids"),
        output_attentions=bool(inputs.get("output_attentions")),
        kwargs_reach=open_kwargs,
    )
    if extra and open_kwargs:  # keyword arguments the cache adds to a forward that takes any
        return args, {**kwargs, **extra}
    return None


@transparent_hook
def _after_forward(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
    cache, _ = _cache_of(module, args, kwargs, strict=False)
    if cache is not None:
        cache.after_forward()
