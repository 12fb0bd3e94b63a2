"""Tiny random transformers models for tests, built from configs (no weights are ever downloaded).

- :func:`tiny_config` / :func:`tiny_model`: one small config per family in :data:`FAMILIES` (hidden 64, 2-4 layers,
  vocab 256), with a larger ``initializer_range`` so greedy choices are not decided by float noise, and a small
  sliding window (:data:`WINDOW`) for the sliding families so short generations cross it.
- :func:`tiny_tokenizer`: a word-level tokenizer over the same vocabulary (token ``i`` is the word ``t<i>``), built
  offline, for streamers and anything else that needs text.
  (The benchmark-sized models are ``pagedcore.benchmarks.options.MODEL_SIZES``.)

Every model is built from its own config object: ``from_config(cfg, attn_implementation=X)`` mutates ``cfg``.
Token ids ``0, 1, 2`` are pad, bos and eos in every family; tests draw prompt tokens from ``3 .. vocab - 1``.
Models come back in ``eval()`` mode with ``generation_config.eos_token_id = None`` (generations run to
``max_new_tokens`` unless a test sets an eos; an Engine given a tokenizer adds the tokenizer's eos) and
``pad_token_id = PAD``.
"""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

import pagedcore.adapters.transformers  # noqa: F401  (registers attn_implementation="paged")

__all__ = [
    "FAMILIES",
    "FIRST_TOKEN",
    "NO_KWARGS_FAMILIES",
    "NO_PAGED_ATTENTION",
    "PAD",
    "SLIDING_FAMILIES",
    "VOCAB",
    "WINDOW",
    "compatible_attn",
    "tiny_config",
    "tiny_model",
    "tiny_tokenizer",
]

VOCAB = 256
WINDOW = 8  # sliding window of the sliding families, in tokens
PAD, BOS, EOS = 0, 1, 2
FIRST_TOKEN = 3  # first id that is neither pad, bos nor eos
INIT = 0.3  # initializer_range: large enough that tiny models have clear greedy margins

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "pad_token_id": PAD,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "tie_word_embeddings": False,
}

# Per family: the transformers model_type and the overrides that make it tiny.
_FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "llama",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "initializer_range": INIT,
        },
    ),
    "mistral": (
        "mistral",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 512,
            "sliding_window": WINDOW,
            "initializer_range": INIT,
        },
    ),
    "qwen2": (
        "qwen2",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "initializer_range": INIT,
        },
    ),
    "qwen3": (
        "qwen3",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 512,
            "initializer_range": INIT,
        },
    ),
    "gemma2": (
        "gemma2",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "max_position_embeddings": 512,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "initializer_range": INIT,
        },
    ),
    "gemma3": (
        "gemma3_text",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "max_position_embeddings": 512,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            "initializer_range": INIT,
        },
    ),
    "phi3": (
        "phi3",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "original_max_position_embeddings": 512,
            "initializer_range": INIT,
        },
    ),
    "gpt_neox": (
        "gpt_neox",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 512,
            "initializer_range": INIT,
        },
    ),
    "gpt2": (
        "gpt2",
        {
            "n_embd": 64,
            "n_inner": 128,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 512,
            "initializer_range": INIT,
            "attn_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "resid_pdrop": 0.0,
        },
    ),
    "opt": (
        "opt",
        {
            "hidden_size": 64,
            "ffn_dim": 128,
            "word_embed_proj_dim": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 512,
            "init_std": INIT,
            "dropout": 0.0,
        },
    ),
    "mixtral": (
        "mixtral",
        {
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 512,
            "initializer_range": INIT,
        },
    ),
    "qwen3_moe": (
        "qwen3_moe",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "max_position_embeddings": 512,
            "initializer_range": INIT,
        },
    ),
    # Families below call cache.update without the model kwargs (no position_ids reach the cache).
    "falcon": (
        "falcon",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "multi_query": True,  # Falcon-7B's layout: one KV head
            "new_decoder_architecture": False,
            "alibi": False,
            "max_position_embeddings": 512,
            "initializer_range": INIT,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
        },
    ),
    "bloom": (
        "bloom",
        {
            "hidden_size": 64,
            "n_layer": 2,
            "n_head": 4,
            "initializer_range": INIT,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
        },
    ),
    "gpt_neo": (
        "gpt_neo",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_layers": 2,
            "num_heads": 4,
            "attention_types": [[["global", "local"], 1]],
            "window_size": WINDOW,
            "max_position_embeddings": 512,
            "initializer_range": INIT,
            "embed_dropout": 0.0,
            "attention_dropout": 0.0,
            "resid_dropout": 0.0,
        },
    ),
    "ctrl": (
        "ctrl",
        {
            "n_embd": 64,
            "dff": 128,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 512,
            "initializer_range": INIT,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
        },
    ),
}

FAMILIES: tuple[str, ...] = tuple(_FAMILY_CONFIGS)
"""Decoder-only families the paged cache must match DynamicCache on."""

SLIDING_FAMILIES: frozenset[str] = frozenset({"mistral", "gemma2", "gemma3"})
"""Families whose tiny config has sliding-window layers (window :data:`WINDOW`)."""

NO_KWARGS_FAMILIES: frozenset[str] = frozenset({"gpt_neox", "falcon", "bloom", "gpt_neo", "ctrl"})
"""Families whose attention calls ``cache.update`` without the model kwargs: no ``position_ids`` reach the cache,
so a plain PagedCache cannot tell their left padding from tokens (``enable`` declares it)."""

NO_PAGED_ATTENTION: frozenset[str] = frozenset({"falcon", "gpt_neo"})
"""Families whose attention cannot be swapped through ``attn_implementation`` (no ``"paged"``)."""

_EAGER = frozenset({"gemma2", "bloom", "gpt_neo"})  # sdpa rejects softcap (Gemma2) or is not implemented


def compatible_attn(family: str) -> str:
    """The stock attention implementation to compare against: sdpa, or eager where sdpa is not available (Bloom,
    GPT-Neo) or rejects the model (Gemma2's softcap)."""
    return "eager" if family in _EAGER else "sdpa"


def tiny_config(family: str, **overrides: Any) -> PretrainedConfig:
    """A fresh tiny config of ``family`` (one of :data:`FAMILIES`); ``overrides`` replace any field."""
    try:
        model_type, fields = _FAMILY_CONFIGS[family]
    except KeyError:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}") from None
    return AutoConfig.for_model(model_type, **{**_COMMON, **fields, **overrides})


def tiny_model(
    family: str, *, attn_implementation: str | None = None, seed: int = 0, **overrides: Any
) -> PreTrainedModel:
    """A tiny random ``family`` model in eval mode, fp32, weights drawn under ``torch.manual_seed(seed)``.

    The same ``family``, ``seed`` and ``overrides`` give the same weights whatever ``attn_implementation`` is.
    """
    config = tiny_config(family, **overrides)
    return _build(config, attn_implementation or compatible_attn(family), seed)


def tiny_tokenizer(vocab_size: int = VOCAB) -> PreTrainedTokenizerFast:
    """A word-level tokenizer: id ``i >= FIRST_TOKEN`` <-> word ``t<i>``; ``<pad>``, ``<s>``, ``</s>`` are 0, 1, 2."""
    specials = {"<pad>": PAD, "<s>": BOS, "</s>": EOS}
    vocab = {**specials, **{f"t{i}": i for i in range(FIRST_TOKEN, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _build(config: PretrainedConfig, attn_implementation: str, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model
