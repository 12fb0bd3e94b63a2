"""KV bytes per token of the attention variants that store less: MLA latents (DeepSeek V2/V3, Kimi) and KV-shared
layers (Gemma 3n, Gemma 4), measured against transformers' DynamicCache, and what they save against per-head keys
and values in every layer (``PagedKVPool.memory_stats()``: ``bytes_per_token``, ``expanded_bytes_per_token``,
``savings``).

Needs: the `transformers` extra (`make demo` installs it).

1. Measured: tiny random models of each family generate ``--tokens`` positions with a DynamicCache and with a
   PagedCache; bytes per token are what each holds (DynamicCache: its layers' tensors; PagedCache: the blocks its rows
   hold, and the pool's per-token figure). Sliding layers hold their window only in both, so the per-token figures
   are taken on full-attention-only configs (a window would make them depend on the length).
2. Real sizes (configs only, no weights): the default configs of transformers' DeepseekV3Config (DeepSeek-V3's
   sizes), DeepseekV2Config and Gemma3nTextConfig (Gemma 3n E4B: 15 of 35 layers share their keys and values), in
   bf16: the spec's bytes per token against per-head keys and values.

Usage:
    python examples/variant_memory.py                 # both tables (seconds on a CPU)
    python examples/variant_memory.py --tokens 64     # a shorter generation
    python examples/variant_memory.py --quick         # a smoke run (16 positions)
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from pagedcore.adapters.transformers import ModelKVSpec, PagedCache

_TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek_v3 (MLA)": (
        "deepseek_v3",
        {
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 32,
        },
    ),
    "gemma4 (KV sharing)": (
        "gemma4_text",
        {
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "global_head_dim": 32,
            "num_kv_shared_layers": 3,
            "layer_types": ["full_attention"] * 6,
            "hidden_size_per_layer_input": 16,
            "vocab_size_per_layer_input": 256,
        },
    ),
}
_COMMON = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 1024}
_REAL = {"deepseek_v3": "DeepSeek-V3", "deepseek_v2": "DeepSeek-V2", "gemma3n_text": "Gemma 3n E4B"}


def dynamic_bytes(cache: DynamicCache) -> int:
    """Bytes of a DynamicCache's tensors (its KV-sharing layers hold none)."""
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def measured(tokens: int) -> list[str]:
    """Rows of the measured table."""
    rows = []
    for name, (model_type, fields) in _TINY.items():
        config = AutoConfig.for_model(model_type, **{**_COMMON, **fields})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        prompt = torch.randint(3, 256, (1, 8))
        new = tokens - prompt.shape[1]
        dynamic = DynamicCache(config=model.config)
        model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, cache=dynamic)
        paged = PagedCache(model, num_blocks=tokens, block_size=16)
        model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, cache=paged)
        stored = paged.get_seq_length()
        pool = paged.pool.memory_stats()
        rows.append(
            f"| {name} | {stored} | {dynamic_bytes(dynamic) / dynamic.get_seq_length():.0f} | "
            f"{paged.memory_stats().token_bytes / stored:.0f} | {pool.bytes_per_token} | "
            f"{pool.expanded_bytes_per_token} | {pool.savings:.1%} |"
        )
        paged.release()
    return rows


def real() -> list[str]:
    """Rows of the real-sizes table (bf16)."""
    rows = []
    for model_type, name in _REAL.items():
        spec = ModelKVSpec.from_config(AutoConfig.for_model(model_type))
        mine, expanded = spec.bytes_per_token(torch.bfloat16), spec.expanded_bytes_per_token(torch.bfloat16)
        layer = next(x for x in spec.layers if x.has_cache)
        per_layer = layer.token_elements * 2
        rows.append(
            f"| {name} | {spec.num_layers} | {sum(x.has_cache for x in spec.layers)} | {per_layer} | {mine} | "
            f"{expanded} | {mine / expanded:.4f} (1/{expanded / mine:.1f}) |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print both tables as markdown."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128, help="positions each tiny model stores (default 128)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 16 positions")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens = 16
    torch.set_num_threads(1)
    print("Measured, tiny random models, fp32, bytes per token:\n")
    print("| family | positions | DynamicCache | PagedCache (held) | pool bytes_per_token | per-head K+V | savings |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(measured(args.tokens)))
    print("\nReal sizes (default configs), bf16, bytes per token:\n")
    print("| model | layers | storing layers | one layer | all layers | per-head K+V, every layer | ratio |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(real()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
