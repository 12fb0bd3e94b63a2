"""Byte-level text for tests: a byte-level BPE tokenizer built offline, and tiny models that follow a script.

- :func:`byte_tokenizer`: ``tokenizers.models.BPE`` over the ByteLevel alphabet without merges, wrapped in
  ``PreTrainedTokenizerFast``: every byte is a token, so each CJK character, emoji or rare symbol is 2-4 tokens, as
  GPT-2, Llama 3 and Qwen spell them. Plus the special tokens ``<|endoftext|>`` (eos) and ``<|im_end|>``.
- :func:`successor_model`: a tiny Llama whose next token is decided by its last token alone, through a table
  ``successors[t]`` (one id: that id; several: an exact tie, so sampling picks among them). Its layers add nothing to
  the residual stream (their output projections are zero) and its head maps each token's embedding to its
  successors, so the Engine's real path (paged attention, packing, sampling) generates a known text.
- :func:`script_model`: a successor model that spells ``text`` over and over (every byte of it must be distinct).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS_TEXT = "<|endoftext|>"
IM_END = "<|im_end|>"


def byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS_TEXT)
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_END]})
    return tokenizer


def ids_of(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def successor_model(vocab_size: int, successors: Mapping[int, Sequence[int]], *, seed: int = 0) -> LlamaForCausalLM:
    """The tokens that appear in ``successors`` get orthonormal embeddings (up to the hidden size), so the
    successors of a token tie exactly."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()  # attention still runs (and reads the paged cache); it adds nothing
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        used = sorted({t for t in successors} | {n for nexts in successors.values() for n in nexts})
        if len(used) <= config.hidden_size:
            basis, _ = torch.linalg.qr(torch.randn(config.hidden_size, len(used)))
            embed[used] = basis.T * embed[used].norm(dim=-1, keepdim=True)
        unit = embed / embed.norm(dim=-1, keepdim=True)
        head = torch.zeros_like(embed)
        for token, nexts in successors.items():
            for nxt in nexts:
                head[nxt] += 8.0 * unit[token]
        model.lm_head.weight.copy_(head)
    model.generation_config.eos_token_id = None
    return model


def script_model(tokenizer: PreTrainedTokenizerFast, text: str) -> tuple[LlamaForCausalLM, list[int]]:
    """A model that, after any token of ``text``, goes on spelling ``text`` (cyclically); returns it and the ids."""
    ids = ids_of(tokenizer, text)
    assert len(set(ids)) == len(ids), "a script's bytes must be distinct"
    successors = {t: [ids[(i + 1) % len(ids)]] for i, t in enumerate(ids)}
    return successor_model(len(tokenizer), successors), ids


def spelled(ids: list[int], start: int, count: int) -> list[int]:
    """The ``count`` tokens a script model spells after ``ids[start]``."""
    return [ids[(start + 1 + k) % len(ids)] for k in range(count)]
