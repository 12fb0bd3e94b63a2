"""A small built-in model and tokenizer for demos and the command line: nothing is downloaded.

The model is a Llama built from a config with random weights, so its text is gibberish: it exists to show what
pagedcore does (prefix hits, KV memory, throughput) on any machine. Point ``--model`` / ``from_pretrained`` at a
real checkpoint for real text.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

__all__ = ["BUILTIN_DESCRIPTION", "builtin_model", "builtin_tokenizer"]

BUILTIN_DESCRIPTION = (
    "built-in Llama (hidden 256, 4 layers, 4 heads / 2 KV heads, ASCII character vocab, random weights)"
)


def builtin_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII (spaces as ``▁``), with ``<pad>``, ``<s>``, ``</s>`` and
    ``<unk>``: whatever a random model generates decodes to readable characters.

    Example:
        >>> tok = builtin_tokenizer()
        >>> tok.decode(tok("Hi there!")["input_ids"])
        'Hi there!'
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "▁": 4}
    for code in range(33, 127):
        vocab[chr(code)] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def builtin_model(*, seed: int = 0, attn_implementation: str = "sdpa", **overrides: Any) -> LlamaForCausalLM:
    """The built-in demo model (see :data:`BUILTIN_DESCRIPTION`), in eval mode.

    Example:
        >>> model = builtin_model(num_hidden_layers=1)
        >>> model.config.vocab_size
        99
    """
    settings: dict[str, Any] = {
        "vocab_size": 99,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.5,
    }
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    model.set_attn_implementation(attn_implementation)
    model.generation_config.eos_token_id = []  # random weights: no eos at all (not even the tokenizer's), so a
    # generation runs to max_new_tokens instead of a random stop
    model.generation_config.pad_token_id = settings["pad_token_id"]
    return model
