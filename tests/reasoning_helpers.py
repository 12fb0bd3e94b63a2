"""A reasoning model for tests: a byte-level tokenizer with ``<think>`` / ``</think>`` as added tokens (not special,
as Qwen3's and DeepSeek-R1's) and ChatML turns, Qwen3's and DeepSeek-R1's chat template shapes, and a tiny model
that follows a script: after the generation prompt it writes ``<think>hm</think>Yes`` then eos.

The model decides each token by the last one alone (:func:`byte_text.successor_model`), so where the prompt ends
decides what it writes: Qwen3's template ends ``assistant\\n`` (the model opens ``<think>``), or with thinking
disabled ``</think>`` (the model answers ``Yes`` at once); DeepSeek-R1's ends ``<think>`` (the model reasons, then
answers).
"""

from __future__ import annotations

import itertools

from byte_text import byte_tokenizer, ids_of, successor_model
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast

THINK, END_THINK = "<think>", "</think>"
REASONING, ANSWER = "hm", "Yes"

_TURNS = "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor -%}"
# Qwen3's shape: the model opens <think> itself; enable_thinking=false closes an empty block in the prompt.
QWEN3_TEMPLATE = (
    _TURNS + "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>' }}{% endif %}"
    "{%- endif %}"
)
# DeepSeek-R1's shape: the generation prompt opens <think>.
R1_TEMPLATE = _TURNS + "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>' }}{% endif %}"


def reasoning_tokenizer(template: str | None = QWEN3_TEMPLATE) -> PreTrainedTokenizerFast:
    tokenizer = byte_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK, END_THINK)])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = template
    return tokenizer


def reasoning_model(tokenizer: PreTrainedTokenizerFast):
    """After ``\\n`` (the end of ``assistant\\n``): ``<think>hm</think>Yes`` then eos."""
    think, end = tokenizer.convert_tokens_to_ids([THINK, END_THINK])
    script = [ids_of(tokenizer, "\n")[0], think, *ids_of(tokenizer, REASONING), end, *ids_of(tokenizer, ANSWER)]
    successors = {a: [b] for a, b in itertools.pairwise(script)}
    successors[script[-1]] = [tokenizer.eos_token_id]
    model = successor_model(len(tokenizer), successors)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model
