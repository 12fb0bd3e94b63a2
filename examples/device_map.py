"""A model split across devices with accelerate's ``device_map``, generating through a PagedCache.

Needs: the `transformers` extra (`make demo` installs it: accelerate is in it).

Each layer's pool is created on the device and dtype of that layer's first keys, so the cache follows the split.
The script saves the built-in model, reloads it with ``from_pretrained(..., device_map=...)`` spreading its layers
over every device it finds (all on the CPU on a machine without GPUs: the same code path, dispatch hooks
included), and checks the output against DynamicCache.

    python examples/device_map.py [--model PATH_OR_NAME]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from pagedcore.adapters.transformers import PagedCache
from pagedcore.adapters.transformers.builtin import builtin_model


def split_map(num_layers: int, devices: list[str]) -> dict[str, str]:
    """Layers spread evenly over ``devices``; embeddings on the first device, the head on the last."""
    device_map = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0]}
    for i in range(num_layers):
        device_map[f"model.layers.{i}"] = devices[i * len(devices) // num_layers]
    device_map.update({"model.norm": devices[-1], "lm_head": devices[-1]})
    return device_map


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local path or hub name of a Llama-like checkpoint (default: built-in)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="4 new tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_new_tokens = 4
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            builtin_model().save_pretrained(tmp)
            path = tmp
        config_layers = AutoModelForCausalLM.from_pretrained(path).config.num_hidden_layers
        model = AutoModelForCausalLM.from_pretrained(path, device_map=split_map(config_layers, devices)).eval()
        # transformers records the split in hf_device_map (only when it spans several devices).
        print("device map:", getattr(model, "hf_device_map", None) or f"everything on {devices[0]}")
        ids = torch.tensor([[5, 17, 42, 8, 23, 11, 4, 9]], device=devices[0])
        cache = PagedCache(model, num_blocks=64, block_size=16)
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, cache=cache)
        ref = model.generate(
            ids, max_new_tokens=args.max_new_tokens, do_sample=False, cache=DynamicCache(config=model.config)
        )
        assert torch.equal(out, ref), "PagedCache and DynamicCache disagree on the split model"
        placed = {str(t[0].device) for i in range(config_layers) if (t := cache.pool.layer_tensors(i)) is not None}
        print(f"same tokens as DynamicCache: yes; pool tensors on {sorted(placed)}")
        cache.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
