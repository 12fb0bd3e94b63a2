"""A small Llama written directly on ``torch.nn``: the model of the plain-PyTorch runner.

It computes what transformers' ``LlamaForCausalLM`` computes (RMSNorm, rotary positions, grouped-query attention,
the SiLU-gated MLP, the same operations in the same order), under the same parameter names, so it loads the same
weights: a transformers checkpoint folder (``config.json`` + safetensors) or a ``LlamaForCausalLM``'s
``state_dict()``. It never imports transformers. Its forward takes packed tokens (one row of every sequence's new
tokens) and hands each layer's queries and new keys and values to an ``attend`` callable, which owns the KV memory:
the runner's, which writes them into the pool and reads each sequence's keys through its block table.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedcore.errors import ConfigError, UnsupportedModelError

__all__ = ["Attend", "LlamaShape", "TorchLlama"]

_TINY = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
_TINY.update({"num_attention_heads": 4, "num_key_value_heads": 2, "eos_token_id": 2})

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(layer, query (n, heads, dim), key (n, kv_heads, dim), value (n, kv_heads, dim)) -> (n, heads, dim)``."""


@dataclass(frozen=True)
class LlamaShape:
    """The fields of a Llama ``config.json`` the model reads (the rest are refused when they change the output).

    Example:
        >>> LlamaShape.from_config({"vocab_size": 100, "hidden_size": 64, "num_attention_heads": 4}).head_dim
        16
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LlamaShape:
        """The shape of a Llama ``config.json`` (a dict); refuses what this model does not compute."""
        kind = (config.get("model_type", "llama"), config.get("hidden_act", "silu"))
        if kind != ("llama", "silu"):
            raise UnsupportedModelError(f"TorchLlama computes Llama with SiLU, not {kind[0]!r} with {kind[1]!r}")
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise UnsupportedModelError(f"TorchLlama computes default rotary positions, not {rope!r}")
        known = {f.name for f in fields(cls)}
        values = {name: value for name, value in config.items() if name in known and value is not None}
        values["rope_theta"] = rope.get("rope_theta", config.get("rope_theta", cls.rope_theta))
        return cls(**values)


class RMSNorm(nn.Module):
    """Root-mean-square normalization, in float32 (as transformers' ``LlamaRMSNorm``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Rotary position embedding: each position's cos and sin over half the head dimension, twice."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = (self.inv_freq.float()[:, None] @ positions.float()[None, :]).transpose(0, 1)  # (n, dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (n, dim)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x (n, heads, dim)`` rotated by its positions' ``cos``/``sin (n, dim)``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    """Grouped-query self-attention whose keys and values live wherever ``attend`` keeps them."""

    def __init__(self, shape: LlamaShape, index: int) -> None:
        super().__init__()
        heads, kv_heads, dim = shape.num_attention_heads, int(shape.num_key_value_heads or 0), int(shape.head_dim or 0)
        self.index, self.heads, self.kv_heads, self.dim = index, heads, kv_heads, dim
        self.q_proj = nn.Linear(shape.hidden_size, heads * dim, bias=shape.attention_bias)
        self.k_proj = nn.Linear(shape.hidden_size, kv_heads * dim, bias=shape.attention_bias)
        self.v_proj = nn.Linear(shape.hidden_size, kv_heads * dim, bias=shape.attention_bias)
        self.o_proj = nn.Linear(heads * dim, shape.hidden_size, bias=shape.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        n = x.shape[0]
        q = _rotate(self.q_proj(x).view(n, self.heads, self.dim), cos, sin)
        k = _rotate(self.k_proj(x).view(n, self.kv_heads, self.dim), cos, sin)
        v = self.v_proj(x).view(n, self.kv_heads, self.dim)
        out = attend(self.index, q, k, v)  # (n, heads, dim)
        return self.o_proj(out.reshape(n, self.heads * self.dim))


class MLP(nn.Module):
    """The SiLU-gated feed-forward block."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=shape.mlp_bias)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=shape.mlp_bias)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=shape.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """One decoder layer: pre-norm attention, then pre-norm MLP, each added to the residual stream."""

    def __init__(self, shape: LlamaShape, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(shape, index)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The embeddings, the layers and the final norm (transformers' ``model.`` prefix)."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(Layer(shape, i) for i in range(shape.num_hidden_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.rotary_emb = Rotary(int(shape.head_dim or 0), shape.rope_theta)


class TorchLlama(nn.Module):
    """A Llama causal LM on plain ``torch.nn`` (see the module docstring).

    Example:
        >>> model = TorchLlama.tiny()
        >>> attend = lambda layer, q, k, v: q   # any attention: here, none
        >>> model(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), attend).shape
        torch.Size([3, 100])
    """

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = shape
        self.model = Decoder(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The logits ``(n, vocab)`` of packed tokens ``input_ids (n,)`` at ``positions (n,)``."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attend)
        return self.lm_head(self.model.norm(x))

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: torch.dtype | None = None) -> TorchLlama:
        """A checkpoint folder's model: its ``config.json`` (the stop tokens of its ``generation_config.json`` when
        there is one) and its weights (``model.safetensors``, sharded or not, or ``pytorch_model.bin``), as
        transformers saves them."""
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        generation = folder / "generation_config.json"  # its eos wins, as in transformers' generate
        if generation.is_file():
            config = {**config, "eos_token_id": json.loads(generation.read_text()).get("eos_token_id")}
        shape = LlamaShape.from_config(config)
        model = cls(shape)
        model.load_state_dict(_weights(folder), strict=not shape.tie_word_embeddings)
        return model.to(dtype=dtype).eval() if dtype is not None else model.eval()

    @classmethod
    def tiny(cls, seed: int = 0, **fields: Any) -> TorchLlama:
        """A tiny model with random weights (hidden 64, 2 layers, 4 heads / 2 KV heads, vocabulary 100)."""
        shape = LlamaShape(**{**_TINY, **fields})
        model = cls(shape)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if not name.endswith("layernorm.weight") and not name.endswith("norm.weight"):
                    parameter.normal_(0.0, 0.02, generator=generator)
        return model.eval()


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, by name."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else []
    if not files and (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    if files:
        from safetensors.torch import load_file

        return {name: tensor for file in files for name, tensor in load_file(folder / file).items()}
    if (folder / "pytorch_model.bin").is_file():
        loaded: dict[str, torch.Tensor] = torch.load(folder / "pytorch_model.bin", weights_only=True)
        return loaded
    raise ConfigError(f"{folder} holds no model.safetensors or pytorch_model.bin", param="folder")
