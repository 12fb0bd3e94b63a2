"""Compiled decode step on a ``PagedCache`` vs on transformers' ``StaticCache`` (issue 23 item 2), side by side.

Needs: the `transformers` extra (`make demo` installs it); inductor compiles with the system's C compiler.

transformers' fastest single-sequence path is a ``StaticCache`` with ``model.forward = torch.compile(model.forward)``.
This script compiles two copies of the same random-weight Llama that way, one decoding with a ``StaticCache`` sized
for the context, the other with a ``PagedCache``, prefills both eagerly to each context length, checks that their
first decode logits agree (fp32, 1e-4), then times decode steps of the two alternately (rounds of ``--steps`` steps
each, median per step over ``--rounds`` rounds) so that machine load hits both alike. It prints one line per context:
milliseconds per decode step for each cache and the ratio PagedCache / StaticCache.

Usage:
    python examples/bench_compiled_decode.py                          # contexts 512 and 2048, inductor
    python examples/bench_compiled_decode.py --contexts 512 --hidden 128 --layers 2 --steps 8 --rounds 3
    python examples/bench_compiled_decode.py --backend eager          # dynamo only (no inductor codegen)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

from pagedcore.adapters.transformers import PagedCache

Step = Callable[[], torch.Tensor]


def make_models(hidden: int, layers: int, backend: str) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """Two copies of one random Llama, each with ``model.forward`` compiled (``dynamic=True``)."""
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    models = []
    for _ in range(2):
        model = LlamaForCausalLM(config).eval()
        models.append(model)
    models[1].load_state_dict(models[0].state_dict())
    for model in models:
        model.forward = torch.compile(model.forward, dynamic=True, backend=backend)
    return models[0], models[1]


def decoder(model: LlamaForCausalLM, cache: object, prompt: torch.Tensor, static: bool) -> tuple[Step, torch.Tensor]:
    """Prefill ``prompt`` eagerly, and return a function that runs the next compiled decode step (greedy)."""
    length = prompt.shape[1]
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        extra = {"cache_position": torch.arange(length)} if static else {}
        logits = model(prompt, cache=cache, **extra).logits[:, -1:]
    state = {"token": logits.argmax(-1), "pos": length}

    def step() -> torch.Tensor:
        pos = torch.tensor([[state["pos"]]])
        extra = {"cache_position": pos[0]} if static else {}
        with torch.no_grad():
            out = model(state["token"], position_ids=pos, cache=cache, **extra).logits
        state["token"], state["pos"] = out.argmax(-1), state["pos"] + 1
        return out

    return step, logits


def per_step_ms(step: Step, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n * 1e3


def measure(args: argparse.Namespace, context: int) -> tuple[float, float]:
    """Median ms per decode step of (PagedCache, StaticCache) at ``context`` tokens, after the equality check."""
    paged_model, static_model = make_models(args.hidden, args.layers, args.backend)
    total = context + args.steps * (args.rounds + 1) + 8
    prompt = torch.randint(0, 32000, (1, context), generator=torch.Generator().manual_seed(1))
    paged = PagedCache(paged_model, num_blocks=total // 16 + 4, block_size=16)
    static = StaticCache(config=static_model.config, max_cache_len=total)
    paged_step, paged_logits = decoder(paged_model, paged, prompt, static=False)
    static_step, static_logits = decoder(static_model, static, prompt, static=True)
    torch.testing.assert_close(paged_logits, static_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(paged_step(), static_step(), atol=1e-4, rtol=0)  # first compiled step: compiles
    per_step_ms(paged_step, 2), per_step_ms(static_step, 2)  # warm-up (a second compile for dynamic shapes)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(args.rounds):
        times[0].append(per_step_ms(paged_step, args.steps))
        times[1].append(per_step_ms(static_step, args.steps))
    paged.release()
    return statistics.median(times[0]), statistics.median(times[1])


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, measure each context and print the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--quick", action="store_true", help="one 512-token context, a 2-layer model, 3 short rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts, args.hidden, args.layers, args.steps, args.rounds = [512], 128, 2, 8, 3
    torch.set_num_threads(args.threads)
    print(f"Llama hidden {args.hidden}, {args.layers} layers, fp32, batch 1, {args.threads} thread(s), {args.backend}")
    print("| context | PagedCache ms/step | StaticCache ms/step | ratio paged/static |\n|---|---|---|---|")
    for context in args.contexts:
        paged_ms, static_ms = measure(args, context)
        print(f"| {context} | {paged_ms:.2f} | {static_ms:.2f} | {paged_ms / static_ms:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
