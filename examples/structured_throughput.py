"""Engine throughput with 0%, 50% and 100% of the requests constrained by a JSON schema (structured outputs).

Needs: the `structured` extra (`pip install 'pagedcore[structured]'`, in `all`).

Same model, prompts and lengths for each share; the shares run in rotation (``--rounds`` times each) and the median
is reported, so a slower machine moment does not land on one share only. The model is a tiny Llama with random
weights over a 32k byte-level BPE vocabulary (``structured_engines.build_tokenizer``; ``--builtin`` for the built-in
99-token model, as the tests run it): a small model makes the per-token cost of the masks look as large as it can.
Each request's answer may run to ``--max-new-tokens``; constrained ones end where their schema does, so tokens/s
(generated tokens over wall time) is the figure, with the tokens generated per share beside it.

Run: ``python examples/structured_throughput.py`` (``--quick`` for a short run). Results: docs/structured.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "status": {"enum": ["active", "suspended", "closed"]},
        "age": {"type": "integer", "minimum": 18, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 5},
    },
    "required": ["id", "status", "age", "tags"],
    "additionalProperties": False,
}


def _model_and_tokenizer(builtin: bool) -> tuple[Any, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if builtin:
        from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer

        return builtin_model(), builtin_tokenizer()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from structured_engines import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def run_share(engine: Any, share: float, requests: int, max_new_tokens: int) -> tuple[float, int]:
    """Tokens/s and tokens generated for ``requests`` requests of which ``share`` are constrained."""
    from pagedcore.adapters.transformers import SamplingParams

    constrained = round(requests * share)
    params = [
        SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=i,
                       structured={"json_schema": SCHEMA} if i < constrained else None)
        for i in range(requests)
    ]  # fmt: skip
    prompts = [f"Request {i}: describe the account." for i in range(requests)]
    started = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(s.token_ids) for o in outs for s in o.samples)
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(errors[0])
    return tokens / seconds, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and rounds")
    parser.add_argument("--builtin", action="store_true", help="the built-in 99-token model (as the tests run it)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    requests, rounds, new = args.requests, args.rounds, args.max_new_tokens
    if args.quick:
        requests, rounds, new = 8, 1, 16
    from pagedcore.adapters.transformers import Engine

    model, tokenizer = _model_and_tokenizer(args.builtin)
    shares = (0.0, 0.5, 1.0)
    results: dict[float, list[tuple[float, int]]] = {s: [] for s in shares}
    with Engine(model, tokenizer, num_blocks=2048, block_size=16, max_num_seqs=requests) as engine:
        run_share(engine, 1.0, 2, 4)  # warm up: the vocabulary's grammar tables, the schema's compilation
        for _ in range(rounds):
            for share in shares:
                results[share].append(run_share(engine, share, requests, new))
    params = sum(p.numel() for p in model.parameters())
    print(f"Engine tokens/s, {requests} requests of at most {new} new tokens, vocab {len(tokenizer)}, "
          f"{params / 1e6:.1f}M parameters, median of {rounds} rounds")  # fmt: skip
    print("| constrained | tokens/s | tokens generated | vs 0% |")
    print("|---|---|---|---|")
    base = statistics.median(r[0] for r in results[0.0])
    for share in shares:
        rate = statistics.median(r[0] for r in results[share])
        tokens = statistics.median(r[1] for r in results[share])
        print(f"| {share:.0%} | {rate:.0f} | {tokens:.0f} | {rate / base:.2f} |")
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
