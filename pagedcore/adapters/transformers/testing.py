"""Tiny random models for examples and tests: nothing is downloaded, everything runs in milliseconds on a CPU.

The docstring examples of this package build their model with :func:`tiny_llama`, so one definition says what
"a tiny model" is. Its outputs are meaningless (random weights); use it to see what a cache or the Engine does.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

__all__ = ["tiny_hybrid", "tiny_llama", "tiny_llama_config"]

_TINY = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
}


def tiny_llama_config(**overrides: Any) -> LlamaConfig:
    """A fresh config of a tiny Llama: hidden 64, 2 layers, 4 heads / 2 KV heads of 16, vocabulary 100.

    ``overrides`` replace any field (``sliding_window=8`` for a Mistral-like window, say).

    Example:
        >>> config = tiny_llama_config(num_hidden_layers=1)
        >>> config.num_hidden_layers, config.num_key_value_heads, config.vocab_size
        (1, 2, 100)
    """
    return LlamaConfig(**{**_TINY, **overrides})


def tiny_llama(**overrides: Any) -> LlamaForCausalLM:
    """A tiny Llama with random weights, in eval mode (see :func:`tiny_llama_config` for its shape).

    Example:
        >>> import torch
        >>> _ = torch.manual_seed(0)   # the weights are random: a seed keeps a random eos out of the 2 new tokens
        >>> model = tiny_llama()
        >>> model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False).shape
        torch.Size([1, 5])
    """
    return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()


def tiny_hybrid(**overrides: Any) -> Any:
    """A tiny model built like Qwen3.5 (text): three Gated DeltaNet linear-attention layers (recurrent states), then
    one full-attention layer; hidden 64, vocabulary 100, random weights, in eval mode.

    Example:
        >>> import torch
        >>> _ = torch.manual_seed(0)   # as tiny_llama's example
        >>> model = tiny_hybrid()
        >>> model.config.layer_types
        ['linear_attention', 'linear_attention', 'linear_attention', 'full_attention']
        >>> model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False).shape
        torch.Size([1, 5])
    """
    fields = {
        **_TINY,
        "num_hidden_layers": 4,
        "head_dim": 16,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        **overrides,
    }
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_5_text", **fields)).eval()
