"""Tiny random hybrid models (recurrent-state layers beside attention) for tests, built from configs with each
family's real layer pattern: Qwen3.5 (text, MoE), Qwen3-Next, Granite 4 (granitemoehybrid), Nemotron-H, LFM2 (short
convolutions), MiniMax (lightning attention), Bamba, Jamba, Falcon-H1 (attention and SSM in one layer), Mamba-2 (no
attention at all), Zamba2 (shared hybrid blocks), OLMo-hybrid and Kimi Linear (Kimi Delta Attention beside latent
attention).

Hidden 64, 3-4 layers, vocab 256, every layer kind of the family at least once; token ids ``0, 1, 2`` are pad, bos and
eos, as in :mod:`models`. Every model is built from its own config object. Models come back in ``eval()`` mode with
``generation_config.eos_token_id = None`` and ``pad_token_id = 0``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pagedcore.adapters.transformers  # noqa: F401  (registers attn_implementation="paged")

__all__ = ["HYBRID_FAMILIES", "NO_ATTENTION", "TOKEN_BY_TOKEN", "hybrid_config", "hybrid_model"]

_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
_ATTENTION: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
_GDN: dict[str, Any] = {  # Gated DeltaNet (Qwen3.5, Qwen3-Next)
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_hidden_layers": 4,
}
_MOE: dict[str, Any] = {
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}
_MAMBA: dict[str, Any] = {  # Mamba-2 mixers of Granite 4, Bamba, Falcon-H1
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_n_groups": 1,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 8,
}

# family -> (model_type, overrides, initializer_range)
_CONFIGS: dict[str, tuple[str, dict[str, Any], float]] = {
    "qwen3_5": ("qwen3_5_text", {**_ATTENTION, **_GDN}, 0.3),
    "qwen3_5_moe": ("qwen3_5_moe_text", {**_ATTENTION, **_GDN, **_MOE}, 0.3),
    "qwen3_next": ("qwen3_next", {**_ATTENTION, **_GDN, **_MOE}, 0.3),
    "granitemoehybrid": (
        "granitemoehybrid",
        {
            **_ATTENTION,
            **_MAMBA,
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 64,
        },
        0.3,
    ),
    "nemotron_h": (
        "nemotron_h",
        {
            **_ATTENTION,
            "head_dim": 16,
            "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"],
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "ssm_state_size": 16,
            "n_groups": 1,
            "conv_kernel": 4,
            "expand": 2,
            "chunk_size": 8,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 32,
        },
        0.1,
    ),
    "lfm2": (
        "lfm2",
        {
            **_ATTENTION,
            "num_hidden_layers": 4,
            "layer_types": ["conv", "full_attention", "conv", "conv"],
            "conv_L_cache": 3,
            "block_auto_adjust_ff_dim": False,
        },
        0.3,
    ),
    "minimax": (
        "minimax",
        {
            **_ATTENTION,
            "head_dim": 16,
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "block_size": 8,
        },
        0.3,
    ),
    "bamba": ("bamba", {**_ATTENTION, **_MAMBA, "num_hidden_layers": 4, "attn_layer_indices": [1]}, 0.3),
    "jamba": (
        "jamba",
        {
            **_ATTENTION,
            "num_hidden_layers": 4,
            "attn_layer_period": 4,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mamba_d_state": 8,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_dt_rank": 8,
        },
        0.3,
    ),
    "falcon_h1": ("falcon_h1", {**_ATTENTION, **_MAMBA, "num_hidden_layers": 3, "mamba_d_ssm": 128}, 0.3),
    "mamba2": (
        "mamba2",
        {
            "hidden_size": 64,
            "num_heads": 8,
            "head_dim": 16,
            "state_size": 16,
            "n_groups": 1,
            "num_hidden_layers": 3,
            "conv_kernel": 4,
            "expand": 2,
            "chunk_size": 8,
            "time_step_rank": 8,
        },
        0.3,
    ),
    "zamba2": (
        "zamba2",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "num_hidden_layers": 4,
            "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_ngroups": 1,
            "n_mamba_heads": 8,
            "chunk_size": 8,
            "attention_head_dim": 16,
            "max_position_embeddings": 512,
            "num_mem_blocks": 1,
        },
        0.1,
    ),
    "olmo_hybrid": (
        "olmo_hybrid",
        {
            **_ATTENTION,
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
        },
        0.3,
    ),
    "kimi_linear": (
        "kimi_linear",
        {
            **_ATTENTION,
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            # its full-attention layers are MLA (latent attention, paged as latents)
            "num_key_value_heads": 4,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "q_lora_rank": None,
            "linear_attn_config": {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4},
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_token": 2,
        },
        0.3,
    ),
}

HYBRID_FAMILIES = tuple(_CONFIGS)
NO_ATTENTION = frozenset({"mamba2"})  # no attention layer: nothing to attend with "paged"
TOKEN_BY_TOKEN = frozenset({"jamba"})  # several tokens on a cached state do not continue it


def hybrid_config(family: str, **overrides: Any) -> Any:
    """A fresh tiny config of ``family``."""
    model_type, kwargs, init = _CONFIGS[family]
    return AutoConfig.for_model(model_type, **{**_COMMON, **kwargs, "initializer_range": init, **overrides})


def hybrid_model(family: str, attn_implementation: str | None = None, seed: int = 0, **overrides: Any) -> Any:
    """A tiny ``family`` model (sdpa attention unless asked otherwise; eager for Mamba-2, which has none)."""
    if attn_implementation is None:
        attn_implementation = "eager" if family in NO_ATTENTION else "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        hybrid_config(family, **overrides), attn_implementation=attn_implementation
    )
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model
