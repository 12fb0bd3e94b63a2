"""Quickstart: generate with a paged KV cache, and check it gives what DynamicCache gives.

Needs: the `transformers` extra (`make demo` installs it).

python examples/quickstart.py                      # the built-in model (random weights, nothing downloaded)
python examples/quickstart.py --model PATH_OR_NAME # your own checkpoint
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from pagedcore.adapters.transformers import PagedCache
from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local path or hub name (default: the built-in model)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "paged"])
    parser.add_argument("--quick", action="store_true", help="4 new tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_new_tokens = 4

    if args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    else:
        tokenizer, model = builtin_tokenizer(), builtin_model()
    model.set_attn_implementation(args.attn)  # "paged" reads keys and values straight from the pool
    tokenizer.padding_side = "left"
    prompts = ["The quick brown fox", "Paged attention keeps the KV cache in fixed-size blocks so that"]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)

    # 1. A drop-in cache for generate: blocks of 16 tokens from a pool of 256 blocks.
    cache = PagedCache(model, num_blocks=256, block_size=16)
    out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, cache=cache)

    # 2. The same call with transformers' DynamicCache gives the same tokens.
    ref = model.generate(
        **inputs, max_new_tokens=args.max_new_tokens, do_sample=False, cache=DynamicCache(config=model.config)
    )
    assert torch.equal(out, ref), "PagedCache and DynamicCache disagree"

    for prompt, row in zip(prompts, out):
        print(f"> {prompt}\n{tokenizer.decode(row[inputs['input_ids'].shape[1] :], skip_special_tokens=True)}\n")
    stats = cache.memory_stats()
    print(
        f"same tokens as DynamicCache: yes | {stats.tokens} tokens stored in {stats.blocks} blocks "
        f"({stats.held_bytes / 1024:.0f} KiB held); {stats.padding_tokens} padding positions not stored"
    )
    cache.release()  # give the blocks back to the pool (garbage collection would do it too)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
