"""Tiny random models of the attention variants of issue 28 (part A), built from configs with their real layer pattern.

Each family keeps what makes it a variant, small: Gemma 4's global layers with their own head size (and KV heads,
``attention_k_eq_v``), Gemma 3n / Gemma 4's KV-shared layers, MLA (DeepSeek V2/V3, Kimi Linear's MLA layers: here all
of its layers, its linear-attention ones belong to the hybrid families), attention sinks (gpt-oss, Granite SWA and
Granite MoE SWA, Flint; the sinks drawn at random, as trained ones are far from Granite's zero init) and Llama 4's
chunked attention (chunk :data:`CHUNK`, NoPE layers with their query temperature at ``floor_scale`` 4, so short
generations cross both). Vocabulary and special tokens as :mod:`models`; a larger ``initializer_range`` so greedy
choices are not float noise (Granite's ``attention_multiplier`` set to ``1 / sqrt(head_dim)`` for the same reason:
its default 1.0 makes the tiny model's softmax so sharp that fp32 rounding moves logits by 1e-4).
"""

from __future__ import annotations

from typing import Any

import torch
from models import BOS, EOS, INIT, PAD, VOCAB
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

import pagedcore.adapters.transformers  # noqa: F401  (registers attn_implementation="paged")

__all__ = ["CHUNK", "VARIANTS", "WINDOW", "variant_config", "variant_model"]

WINDOW = 8  # sliding window
CHUNK = 8  # Llama 4's attention chunk

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "pad_token_id": PAD,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "tie_word_embeddings": False,
    "initializer_range": INIT,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
_GEMMA4 = {
    "head_dim": 16,
    "sliding_window": WINDOW,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": VOCAB,
}
_MLA = {"num_key_value_heads": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16}
_DEEPSEEK = {
    **_MLA,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "q_lora_rank": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
}
_SWA = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"], "num_hidden_layers": 2}

# family -> (transformers model type, overrides)
_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma4": (  # per-layer head sizes: the global layers' head_dim is 32, the sliding ones' 16
        "gemma4_text",
        {
            **_GEMMA4,
            "num_hidden_layers": 4,
            "global_head_dim": 32,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ),
    "gemma4_shared": (  # KV sharing, and global layers with their own head size and one KV head (k_eq_v)
        "gemma4_text",
        {
            **_GEMMA4,
            "num_hidden_layers": 6,
            "global_head_dim": 32,
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
            "num_kv_shared_layers": 2,
            "layer_types": ["sliding_attention", "full_attention"] * 3,
        },
    ),
    "gemma3n": (
        "gemma3n_text",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "num_hidden_layers": 6,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
            "num_kv_shared_layers": 3,
            "hidden_size_per_layer_input": 16,
            "vocab_size_per_layer_input": VOCAB,
            "laurel_rank": 8,
            "altup_num_inputs": 2,
            "activation_sparsity_pattern": [0.0] * 6,
        },
    ),
    "deepseek_v3": ("deepseek_v3", _DEEPSEEK),
    "deepseek_v2": ("deepseek_v2", _DEEPSEEK),
    "kimi_linear": (
        "kimi_linear",
        {
            **_MLA,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "q_lora_rank": None,
            "num_experts": 4,
            "num_experts_per_token": 2,
            "layer_types": ["full_attention"] * 2,
        },
    ),
    "gpt_oss": (
        "gpt_oss",
        {**_SWA, "intermediate_size": 64, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "granite_swa": ("granite_swa", {**_SWA, "attention_multiplier": 0.25}),
    "granitemoe_swa": (
        "granitemoe_swa",
        {
            **_SWA,
            "intermediate_size": 64,
            "attention_multiplier": 0.25,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "flint": ("flint", {**_SWA, "head_dim": 16}),
    "llama4": (
        "llama4_text",
        {
            "intermediate_size_mlp": 128,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "attention_chunk_size": CHUNK,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "floor_scale": 4,
        },
    ),
}

VARIANTS: tuple[str, ...] = tuple(_VARIANTS)
"""The variant families."""


def variant_config(family: str, **overrides: Any) -> PretrainedConfig:
    """A fresh tiny config of ``family`` (one of :data:`VARIANTS`)."""
    model_type, fields = _VARIANTS[family]
    return AutoConfig.for_model(model_type, **{**_COMMON, **fields, **overrides})


def variant_model(
    family: str, *, attn_implementation: str = "eager", seed: int = 0, **overrides: Any
) -> PreTrainedModel:
    """A tiny random ``family`` model in eval mode, fp32; the same weights whatever ``attn_implementation`` is
    (eager: what most of these families support; the reference the paged modes are compared with)."""
    config = variant_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            sinks = getattr(module, "sinks", None)
            if isinstance(sinks, torch.Tensor):
                sinks.copy_(torch.randn(sinks.shape, generator=generator))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model
