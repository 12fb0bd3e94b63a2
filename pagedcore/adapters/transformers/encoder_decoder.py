"""Encoder-decoder models (Whisper, T5, BART and their kind): what a PagedCache pages of them, and their inputs.

A paged cache holds the **decoder's self-attention**: keys and values that grow token by token, per sequence, like a
decoder-only model's. The cross-attention's keys and values are computed once per sequence from the encoder's output
and never grow: they stay in transformers' own cache beside it, ``EncoderDecoderCache(PagedCache(model),
DynamicCache())``, which is what ``generate`` and the models expect (a bare cache would get the cross-attention's
keys too). ``enable()`` builds that pair for each call and keys the call's prefixes by the encoder input's content
as well as the decoder tokens (:func:`encoder_keys`): the same decoder prompt over another audio clip or text is
another prefix.

:func:`decoder_layout` reads the decoder's layer count and heads from an encoder-decoder family's config, also
where the config serves a decoder alone (``WhisperForCausalLM``, ``BartForCausalLM``), whose ``num_hidden_layers``
and ``num_attention_heads`` name the encoder's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DecoderLayout",
    "decoder_layout",
    "encoder_digests",
    "encoder_inputs",
    "encoder_keys",
    "is_encoder_decoder",
]

_SPACE = 1 << 62


@dataclass(frozen=True)
class DecoderLayout:
    """The decoder self-attention's layers, KV heads and head size.

    Example:
        >>> from transformers import WhisperConfig
        >>> decoder_layout(WhisperConfig(encoder_layers=4, decoder_layers=2, decoder_attention_heads=4, d_model=64))
        DecoderLayout(num_layers=2, num_kv_heads=4, head_dim=16)
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int


def decoder_layout(config: Any) -> DecoderLayout | None:
    """The decoder's layout for a config of an encoder-decoder family (None for any other config).

    Example:
        >>> from transformers import LlamaConfig, T5Config
        >>> decoder_layout(T5Config(num_layers=6, num_decoder_layers=3, num_heads=8, d_kv=64))
        DecoderLayout(num_layers=3, num_kv_heads=8, head_dim=64)
        >>> decoder_layout(LlamaConfig()) is None
        True
    """
    layers = _first(config, "decoder_layers", "num_decoder_layers")
    if layers is None:
        return None
    heads = _first(config, "decoder_attention_heads", "num_heads", "num_attention_heads")
    if heads is None:
        return None
    head_dim = _first(config, "d_kv")
    if head_dim is None:
        width = _first(config, "d_model", "hidden_size")
        if width is None:
            return None
        head_dim = width // heads
    return DecoderLayout(layers, heads, head_dim)


def _first(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def is_encoder_decoder(model: Any) -> bool:
    """Whether ``model`` runs an encoder and a decoder (its ``generate`` takes the encoder's input).

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> is_encoder_decoder(tiny_llama())
        False
    """
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def encoder_inputs(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The encoder's inputs of a ``generate`` call on an encoder-decoder ``model``: its main input (``input_ids``,
    ``input_features``...: the first positional argument or keyword), the encoder's attention mask, or
    ``encoder_outputs`` given instead.

    Example:
        >>> from types import SimpleNamespace
        >>> whisper = SimpleNamespace(main_input_name="input_features")
        >>> sorted(encoder_inputs(whisper, (), {"input_features": torch.zeros(1, 2, 4), "max_new_tokens": 3}))
        ['input_features']
    """
    name = getattr(model, "main_input_name", "input_ids")
    found: dict[str, Any] = {}
    main = args[0] if args else kwargs.get(name, kwargs.get("inputs"))
    if main is not None:
        found[name] = main
    for key in ("attention_mask", "encoder_outputs"):
        if kwargs.get(key) is not None:
            found[key] = kwargs[key]
    return found


def encoder_digests(inputs: dict[str, Any], batch: int) -> list[int] | None:
    """A digest of every row's encoder input (its real positions only, where the encoder's attention mask says
    which), or None when the inputs cannot be split per row (nothing is reused or cached then).

    Example:
        >>> features = torch.zeros(2, 3, 4)
        >>> features[1] += 1
        >>> a = encoder_digests({"input_features": features}, 2)
        >>> a[0] != a[1], a == encoder_digests({"input_features": features.clone()}, 2)
        (True, True)
    """
    digests = [_row_digest(inputs, r, batch) for r in range(batch)]
    return None if any(d is None for d in digests) else [d for d in digests if d is not None]


def encoder_keys(tokens: list[int], digest: int) -> list[int]:
    """Decoder tokens keyed by their encoder input's ``digest``: every token becomes an id derived from both, so a
    prefix matches only under the same input (the ids are negative: never a real token).

    Example:
        >>> encoder_keys([7, 8], 1) != encoder_keys([7, 8], 2), encoder_keys([7], 1)[0] < 0
        (True, True)
    """
    return [-1 - (digest * 1_000_003 + t) % _SPACE for t in tokens]


def _row_digest(inputs: dict[str, Any], row: int, batch: int) -> int | None:
    """A digest of one row's encoder input (its real positions only, where an attention mask says which)."""
    mask = inputs.get("attention_mask")
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(inputs):
        value = inputs[name]
        if name == "attention_mask":
            continue
        if name == "encoder_outputs":
            value = value[0] if isinstance(value, (tuple, list)) else getattr(value, "last_hidden_state", None)
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != batch:
            return None
        part = value[row].detach().to("cpu")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and part.dim() >= 1 and part.shape[0] == mask.shape[1]:
            part = part[mask[row].detach().to("cpu").bool()]  # padding to the batch's longest is not content
        part = part.contiguous()
        h.update(f"{name}{tuple(part.shape)}{part.dtype}".encode())
        h.update(part.reshape(-1).view(torch.uint8).numpy().tobytes() if part.numel() else b"")
    return int.from_bytes(h.digest(), "little") % _SPACE
