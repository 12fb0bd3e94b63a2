"""A tiny config for every causal-LM model type of transformers, with its real layer pattern (no weights downloaded).

:func:`tiny_config` starts from the model type's own defaults (``AutoConfig.for_model``) and shrinks what makes a
model big, wherever the config has the field (and in its sub-configs): hidden 64, 4 heads / 2 KV heads of 16,
vocabulary 256, 4 experts (top 2), window 8. The layer pattern stays the family's: ``layer_types`` (and every other
per-layer list) is cut to the shortest prefix that holds every kind of layer the family has (at least 2 layers), so
a hybrid keeps its attention and its linear layers, Gemma 3 its sliding and full ones. :data:`OVERRIDES` holds what
a family needs besides (its own names for sizes, sizes that must agree with each other). Token ids 0, 1, 2 are pad,
bos and eos; ``initializer_range`` 0.3 keeps greedy choices clear of float noise.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

__all__ = ["CAUSAL_LM_TYPES", "OVERRIDES", "tiny_config", "tiny_family"]

CAUSAL_LM_TYPES: tuple[str, ...] = tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
"""Every model type ``AutoModelForCausalLM`` builds (200 in transformers 5.25)."""

VOCAB = 256
WINDOW = 8
MAX_LAYERS = 8  # a layer pattern whose kinds first all appear later is cut here (and every kind forced in)

# Field -> tiny value, set wherever a config (or a sub-config) has the field.
SMALL: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.3,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "num_shared_experts": 1,
    "n_shared_experts": 1,
    "sliding_window": WINDOW,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 8,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
    "tie_word_embeddings": False,
    # encoder-decoder and BERT-like names
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_heads": 4,
    "d_ff": 128,
    "d_kv": 16,
    # multi-head latent attention (DeepSeek V2/V3, Kimi, MiniCPM3...): a 16-wide query/key head
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    # state-space and linear attention
    "state_size": 8,
    "conv_kernel": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_d_state": 8,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_n_groups": 1,
    "mamba_expand": 2,
    "mamba_d_conv": 4,
    "n_groups": 1,
}

# Encoders whose causal-LM head is a decoder only with ``is_decoder=True`` (without it they attend both ways, and
# transformers warns that the LM head needs it).
BIDIRECTIONAL = (
    "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
    "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl", "xmod",
)  # fmt: skip

# What a family needs besides SMALL (its own names, sizes that must agree).
OVERRIDES: dict[str, dict[str, Any]] = {
    **{model_type: {"is_decoder": True} for model_type in BIDIRECTIONAL},
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    "kolibri1_1": {"index_num_heads": 2},  # at most the query heads of one key head (4 / 2)
    "gpt_bigcode": {"num_key_value_heads": 1},  # multi_query, as StarCoder: the config derives 1 unless told
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": WINDOW},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "bamba": {"attn_layer_indices": [1]},
    "mamba2": {"num_heads": 8},
    "falcon_h1": {"mamba_d_ssm": 128},
    "reformer": {
        "is_decoder": True,
        "axial_pos_shape": [16, 32],
        "axial_pos_embds_dim": [32, 32],
        "attn_layers": ["local", "lsh"],
        "feed_forward_size": 128,
        "attention_head_size": 16,
    },
    "xlnet": {"d_head": 16, "d_inner": 128},
    "zaya": {"num_experts_per_tok": 1},
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0}},
    # Granite scales attention by attention_multiplier (1/head_dim in its checkpoints), not 1/sqrt(head_dim): with the
    # default 1.0 a tiny model's softmax is so sharp that float noise exceeds the 1e-4 the matrix allows
    **{
        t: {"attention_multiplier": 1 / 16}
        for t in ("granite", "granitemoe", "granitemoeshared", "granite_swa", "granitemoe_swa", "granitemoehybrid")
    },
    "rembert": {"initializer_range": 0.1},  # logits near 34 at 0.3: float noise above 1e-4
    # HRM's layers recur in cycles: at 0.3 float noise grows to 1e-3 between a prompt in one forward and in two, with
    # transformers' own DynamicCache too; at 0.1 it stays near 6e-7
    "hrm_text": {"initializer_range": 0.1},
    "dbrx": {
        "attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2},
        "d_model": 64,
        "n_heads": 4,
        "n_layers": 2,
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
}


def tiny_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """A fresh tiny config of ``model_type`` (see the module docstring); ``overrides`` replace any field."""
    base = AutoConfig.for_model(model_type)
    fields = _merged(_merged(_shrunk(base), OVERRIDES.get(model_type, {})), overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoConfig.for_model(model_type, **fields)


def tiny_family(model_type: str, *, attn_implementation: str | None = None, seed: int = 0, **overrides: Any
                ) -> PreTrainedModel:  # fmt: skip
    """A tiny random ``model_type`` causal LM in eval mode, fp32, weights drawn under ``torch.manual_seed(seed)``;
    ``generation_config.eos_token_id`` is None (generations run to ``max_new_tokens``), ``pad_token_id`` 0."""
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_config(config, **kwargs).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _merged(fields: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """``fields`` updated with ``more``, sub-config dicts merged field by field."""
    out = dict(fields)
    for key, value in more.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def _get(config: PretrainedConfig, name: str) -> Any:
    """``config.name``, or None where reading it raises (a per-layer field of a heterogeneous config, Gemma 4)."""
    try:
        return getattr(config, name, None)
    except Exception:
        return None


def _settable(config: PretrainedConfig) -> set[str]:
    """The fields a config takes as constructor arguments (not derived properties such as Falcon's head_dim)."""
    names = set(vars(config))
    names |= set(getattr(type(config), "__dataclass_fields__", {}))
    names |= set(getattr(config, "attribute_map", {}))
    return names


def _shrunk(config: PretrainedConfig) -> dict[str, Any]:
    """The fields of ``config`` that SMALL shrinks, its layer pattern cut (:func:`_layers`), and its sub-configs
    shrunk alike (as the fields to change)."""
    names = _settable(config)
    out = {k: v for k, v in SMALL.items() if k in names}
    if _get(config, "kv_lora_rank") is not None:  # multi-head latent attention
        if "head_dim" in out:
            out["head_dim"] = SMALL["qk_rope_head_dim"]  # the rotary part is the "head_dim" rope is built for
        if "num_key_value_heads" in out:
            out["num_key_value_heads"] = SMALL["num_attention_heads"]  # every head reads the one latent
    out.update(_layers(config, names))
    for name in names:
        value = _get(config, name)
        if isinstance(value, PretrainedConfig) and name not in out:
            out[name] = _shrunk(value)
    return out


def _layers(config: PretrainedConfig, names: set[str]) -> dict[str, Any]:
    """``num_hidden_layers``, ``layer_types`` and every other per-layer list cut to the family's layer pattern
    (:func:`_pattern`); where the layer types derive from other fields (Mamba, Jamba, RecurrentGemma: a read-only
    property), only the number of layers, a prefix of the pattern."""
    layers = _get(config, "num_hidden_layers") if "num_hidden_layers" in names else None
    types = _get(config, "layer_types")
    if not (isinstance(layers, int) and isinstance(types, (list, tuple)) and len(types) == layers and layers > 2):
        return {}
    keep = _pattern(list(types))
    if _read_only(config, "layer_types"):
        return {"num_hidden_layers": min(len(keep), max(keep) + 1 if keep == list(range(len(keep))) else MAX_LAYERS)}
    out: dict[str, Any] = {"num_hidden_layers": len(keep), "layer_types": [types[i] for i in keep]}
    for name in names:
        value = _get(config, name)
        if (
            isinstance(value, (list, tuple))
            and len(value) == layers
            and name not in out
            and not _read_only(config, name)
        ):
            out[name] = [value[i] for i in keep]
    return out


def _read_only(config: PretrainedConfig, name: str) -> bool:
    real = getattr(config, "attribute_map", {}).get(name, name)
    return isinstance(getattr(type(config), real, None), property)


def _pattern(types: list[Any]) -> list[int]:
    """The layers kept: the shortest prefix holding every kind (at least 2 layers), or, when that prefix is longer
    than MAX_LAYERS, the first MAX_LAYERS - 1 layers and the first layer of each kind missing from them."""
    kinds = list(dict.fromkeys(types))
    end = max(2, max(types.index(k) for k in kinds) + 1)
    if end <= MAX_LAYERS:
        return list(range(end))
    missing = [k for k in kinds if k not in types[:MAX_LAYERS]]
    head = list(range(MAX_LAYERS - len(missing)))
    present = {types[i] for i in head}
    return head + [types.index(k) for k in kinds if k not in present]
