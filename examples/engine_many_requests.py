"""The continuous-batching Engine on many requests: a progress bar, per-request timings, stats, and streaming.

Needs: the `transformers` extra (`make demo` installs it).

python examples/engine_many_requests.py [--model PATH_OR_NAME] [--requests 32]
"""

from __future__ import annotations

import argparse
import random
import statistics

from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local path or hub name (default: the built-in model)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--quick", action="store_true", help="6 requests of 4 new tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.max_new_tokens = 6, 4
    if args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    else:
        tokenizer, model = builtin_tokenizer(), builtin_model()

    rng = random.Random(0)
    system = "You are a terse assistant for a public library. Answer in one sentence.\n"
    topics = ["opening hours", "late fees", "printing", "wifi", "e-books", "study rooms", "membership", "parking"]
    prompts = [f"{system}Question {i}: tell me about {rng.choice(topics)}." for i in range(args.requests)]

    with Engine(model, tokenizer, memory_budget="64MiB", max_num_batched_tokens=512, max_num_seqs=16) as engine:
        # Greedy for most requests, seeded sampling with two parallel samples for every fourth one.
        params = [
            SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.8, top_p=0.95, seed=i, n=2)
            if i % 4 == 0
            else SamplingParams(max_new_tokens=args.max_new_tokens)
            for i in range(len(prompts))
        ]
        outputs = engine.generate(prompts, params, use_tqdm=not args.no_progress)
        latencies = [o.metrics.latency for o in outputs if o.metrics.latency is not None]
        print(f"{len(outputs)} requests; first answer: {outputs[0].text!r}")
        print(f"latency p50 {statistics.median(latencies):.2f}s, max {max(latencies):.2f}s")
        stats = engine.stats()
        print(
            f"prefix hit rate {100 * stats.prefix_hit_rate:.1f}%, {stats.generated_tokens} tokens generated at "
            f"{stats.generation_throughput:.0f} tokens/s, peak KV {stats.kv_peak_used_bytes / 2**20:.2f} MiB, "
            f"{stats.num_preemptions} preemptions"
        )

        # Streaming: tokens arrive as they are produced.
        print("streamed:", end=" ", flush=True)
        for event in engine.stream([prompts[1]], SamplingParams(max_new_tokens=12)):
            if event.text:
                print(event.text, end="", flush=True)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
