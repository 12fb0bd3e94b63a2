"""``enable()``'s calls on encoder-decoder models (Whisper, T5, BART): the decoder's self-attention in a
:class:`~.cache.PagedCache` beside transformers' cross-attention cache, ``EncoderDecoderCache(PagedCache(model),
DynamicCache())`` (the cross-attention's keys and values are computed once per call from the encoder's output and
never grow); the prefix of the decoder prompt (``decoder_input_ids``) is looked up, and the rows registered, keyed by
a digest of each row's encoder input (:mod:`.encoder_decoder`): the same decoder prompt over another audio clip or
text is another prefix.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from typing import Any

import torch
from transformers import DynamicCache, EncoderDecoderCache

from pagedcore.engine.inputs import TOKEN_DTYPES, check_token_tensor

from .cache import PagedCache
from .encoder_decoder import encoder_digests, encoder_inputs, encoder_keys
from .generate_call import CallSettings, attach_hit, call_settings, carries_cache, give_back, left_pads, reserve_call
from .pool import PagedKVPool

# Internal to prefix_caching.py (enable()'s calls on encoder-decoder models): no public API.
__all__: list[str] = []


def run_seq2seq(
    model: Any,
    call: Callable[..., Any],
    pool: PagedKVPool,
    attention_backend: str | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ns: Hashable,
) -> Any:
    """One ``generate`` call of an encoder-decoder ``model`` (``call``: its own ``generate``) through ``pool`` (see
    the module docstring). A call with a cache of its own, or ``use_cache=False``, runs as it is."""
    if any(kwargs.get(k) is not None for k in ("cache", "past_key_values")) or kwargs.get("use_cache") is False:
        return call(*args, **kwargs)
    decoder = kwargs.get("decoder_input_ids")
    rows: list[list[int]] | None = None
    pads: list[int] | None = None
    digests: list[int] | None = None
    if isinstance(decoder, torch.Tensor) and decoder.dim() == 2:
        check_token_tensor(decoder, name="decoder_input_ids", dtypes=TOKEN_DTYPES)
        mask = kwargs.get("decoder_attention_mask")  # not read from the pad token: T5 starts its decoder with it
        if (
            not isinstance(mask, torch.Tensor)
            and "decoder_attention_mask" in inspect.signature(model.forward).parameters
        ):
            # generate feeds only the uncached decoder tokens when the decoder's mask spans them all (else all of
            # them, after the cached ones: wrong output)
            mask = kwargs["decoder_attention_mask"] = torch.ones_like(decoder)
        pads = left_pads(mask) if isinstance(mask, torch.Tensor) else None
        digests = encoder_digests(encoder_inputs(model, args, kwargs), decoder.shape[0])
        if pads is not None and digests is not None:
            rows = [encoder_keys(decoder[r, p:].tolist(), d) for r, (p, d) in enumerate(zip(pads, digests))]
    width = decoder.shape[1] if isinstance(decoder, torch.Tensor) and decoder.dim() == 2 else 1
    settings = call_settings(model, kwargs, width)
    reservation, keep = None, False
    cache = PagedCache(model, pool=pool, namespace=ns, attention_backend=attention_backend)
    try:
        with pool.lock:
            if rows is not None and pads is not None:
                _, lookups = attach_hit(cache, pool, rows, pads, ns, lookup=settings.reuse)
                shape = (len(rows), width)
                reservation = reserve_call(pool, cache.row_tokens(), shape, pads, settings, None, kwargs)
                lookups.record()  # once granted: a refused call counts no lookup
        cache.reservation = reservation
        if rows is not None and settings.expand > 1:
            cache.batch_repeat_interleave(settings.expand)  # generate expands the inputs, never the cache
        kwargs["cache"] = EncoderDecoderCache(cache, DynamicCache())
        result = call(*args, **kwargs)
        if isinstance(decoder, torch.Tensor) and pads is not None and digests is not None:
            _register(cache, result, decoder, pads, digests, settings)
        keep = carries_cache(result, cache)
        return result
    finally:
        give_back(pool, reservation, cache)
        if not keep:
            cache.release()


def _register(
    cache: PagedCache, result: Any, decoder: torch.Tensor, pads: list[int], digests: list[int], settings: CallSettings
) -> None:
    """Register each row's decoder tokens (its prompt and what it generated, as the output gives them when the output
    starts with the prompt) keyed by its encoder input."""
    sequences = result if isinstance(result, torch.Tensor) else getattr(result, "sequences", None)
    tokens = []
    for i in range(max(cache.batch_size, 0)):
        source = i // settings.expand
        prompt = decoder[source, pads[source] :].tolist()
        row = prompt
        if settings.beams == 1 and isinstance(sequences, torch.Tensor) and i < sequences.shape[0]:
            out = sequences[i, pads[source] :].tolist()
            row = out if out[: len(prompt)] == prompt else prompt
        tokens.append(encoder_keys(row, digests[source]))
    if tokens:
        cache.cache_prefixes(tokens)
