"""Tokenizers, models and schemas for the structured-output and tool-calling tests, all built offline.

- :func:`bpe_tokenizer`: a byte-level BPE (GPT-2 / Llama 3 / Qwen style) with a few hundred merges learnt here from
  JSON-like text, so tokens span several characters (``{"``, ``": ``, words), with Qwen's chat markers and a
  Hermes / Qwen-style chat template that renders ``tools``, assistant ``tool_calls`` and ``role: "tool"`` messages.
- :func:`random_model`: a tiny Llama over a tokenizer's vocabulary with large random weights: an adversarial
  generator (it has no idea of JSON; only the masks make its output valid).
- :data:`SCHEMA`: nested objects, arrays, enums, required fields, bounded numbers and patterned strings.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS_TEXT = "<|endoftext|>"

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "status": {"enum": ["active", "closed"]},
        "score": {"type": "integer", "minimum": 3, "maximum": 17},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 6}, "admin": {"type": "boolean"}},
            "required": ["name", "admin"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["id", "status", "score", "ratio", "owner", "tags"],
    "additionalProperties": False,
}

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}

# Hermes / Qwen 2.5 style (the structure of Qwen's own template, shortened).
CHAT_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions. Function signatures are within <tools></tools>:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
For each call return a JSON object with the name and arguments within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

_CORPUS = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c", "days": 3}}',
    '{"id": "AB-123", "status": "active", "score": 12, "ratio": 0.5, "tags": ["a", "b"]}',
    '{"owner": {"name": "Ada", "admin": true}, "items": [1, 2, 3], "ok": false, "value": null}',
    "<tool_call>\n{json}\n</tool_call> The weather today is sunny and the time is noon.",
    "Hello there, how are you? I am fine, thank you. Let me check the weather for you.",
]


@functools.lru_cache(maxsize=1)
def _trained() -> str:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=[EOS_TEXT, "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_CORPUS * 20, trainer)
    return core.to_str()


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh byte-level BPE tokenizer with Qwen's markers and a tool-capable chat template."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained()), eos_token=EOS_TEXT, pad_token=EOS_TEXT
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])  # Qwen's: added tokens that are text (not special)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def random_model(vocab_size: int, *, seed: int = 0, layers: int = 2) -> LlamaForCausalLM:
    """A tiny Llama with large random weights over ``vocab_size`` tokens (no eos in its generation config)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.5,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = []  # none, not even the tokenizer's
    return model
