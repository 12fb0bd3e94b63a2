"""Prefix caching for a chat with a shared system prompt: one line turns it on for plain ``model.generate``.

Needs: the `transformers` extra (`make demo` installs it).

Every turn re-sends the whole conversation (as chat front-ends do); the enabled model serves the part it has
seen before from the pool's prefix cache and computes only the new tokens.

    python examples/chat_prefix_cache.py [--model PATH_OR_NAME]
"""

from __future__ import annotations

import argparse
import time

from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedcore.adapters import transformers as pc
from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer

SYSTEM = (
    "System: You are the support assistant of a small bakery. You answer in two sentences, mention opening hours "
    "(8 to 18, closed on Mondays) when relevant and never invent prices.\n"
)
TURNS = ["Do you bake sourdough?", "Can I order a cake for Sunday?", "Are you open on Monday?"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local path or hub name (default: the built-in model)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--users", type=int, default=2, help="independent chats sharing the system prompt")
    parser.add_argument("--quick", action="store_true", help="3 new tokens per turn")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_new_tokens = 3
    if args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    else:
        tokenizer, model = builtin_tokenizer(), builtin_model()

    pool = pc.enable(model, memory_budget="64MiB", block_size=16)  # <- the one line
    try:
        for user in range(args.users):
            history = SYSTEM
            for turn in TURNS:
                history += f"User {user}: {turn}\nAssistant:"
                ids = tokenizer(history, return_tensors="pt")["input_ids"]
                hits = pool.num_hit_tokens
                started = time.perf_counter()
                out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
                elapsed = time.perf_counter() - started
                answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
                history += answer + "\n"
                print(
                    f"[user {user}] {turn!r}: {ids.shape[1]} prompt tokens, "
                    f"{pool.num_hit_tokens - hits} from the cache, {elapsed * 1000:.0f} ms"
                )
        print(
            f"prefix hit rate over the session: {100 * pool.hit_rate:.1f}% "
            f"({pool.num_hit_tokens}/{pool.num_query_tokens} prompt tokens)"
        )
    finally:
        pc.disable(model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
