"""Host memory of the bookkeeping core: what a pool costs before it is used, and what a long run leaves behind.

Needs: pagedcore alone; `--generate` the `transformers` extra.

Two measurements, each in a fresh interpreter so that one does not inherit the other's freed-but-kept memory:

- ``blocks``: resident memory (RSS) and time of ``BlockManager(num_blocks=N)``, and optionally after every block
  was allocated and freed once (``--touch``); reported as bytes per block.
- ``namespaces``: a small ``KVPool`` serving N namespaces one after another (one cached block each, as per-tenant
  namespaces do); RSS before and after, and how many namespace roots the tries still hold. With ``--generate``,
  the same through ``enable()``'d ``model.generate`` on a tiny random Llama (slower: use a smaller count).

Usage:
    python examples/host_memory.py blocks --sizes 1000000 100000000
    python examples/host_memory.py blocks --sizes 1000000 --touch
    python examples/host_memory.py namespaces --count 50000
    python examples/host_memory.py namespaces --count 2000 --generate
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pagedcore import BlockManager, KVPool


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def measure_blocks(num_blocks: int, touch: bool) -> dict[str, float | str]:
    before = rss_bytes()
    t0 = time.perf_counter()
    bm = BlockManager(num_blocks, 16)
    built_s = time.perf_counter() - t0
    built = rss_bytes()
    out: dict[str, float | str] = {
        "num_blocks": num_blocks,
        "build_s": built_s,
        "build_bytes_per_block": (built - before) / num_blocks,
    }
    if touch:
        chunk = 100_000
        t0 = time.perf_counter()
        held = [bm.allocate(min(chunk, num_blocks - start)) for start in range(0, num_blocks, chunk)]
        for ids in held:
            bm.free(ids)
        del held
        out["touch_s"] = time.perf_counter() - t0
        out["touched_bytes_per_block"] = (rss_bytes() - before) / num_blocks
    return out


def namespace_server(generate: bool) -> tuple[KVPool, Callable[[int], None]]:
    """The pool and a function that serves one request in namespace ``tenant-<i>``."""
    if not generate:
        pool = KVPool(num_blocks=16, block_size=4)
        group = pool.groups[0]

        def serve(i: int) -> None:
            ids = group.block_manager.allocate(1)
            group.trie.insert([1, 2, 3, 4], ids, namespace=f"tenant-{i}")
            group.block_manager.release(ids)

        return pool, serve

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedcore.adapters.transformers import enable

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    paged = enable(model, num_blocks=16, block_size=4)
    prompt = torch.arange(3, 12)[None]  # 9 tokens: two full blocks cached per request

    def serve_generate(i: int) -> None:
        model.generate(prompt, max_new_tokens=1, do_sample=False, pagedcore_namespace=f"tenant-{i}")

    return paged.kv, serve_generate


def measure_namespaces(count: int, generate: bool) -> dict[str, float | str]:
    pool, serve = namespace_server(generate)
    for i in range(100):  # warm up allocator pools and code paths before the first reading
        serve(-i - 1)
    before = rss_bytes()
    t0 = time.perf_counter()
    for i in range(count):
        serve(i)
    seconds = time.perf_counter() - t0
    after = rss_bytes()
    pool.check_invariants()
    return {
        "via": "enable()d generate" if generate else "KVPool",
        "namespaces_served": count,
        "seconds": seconds,
        "rss_before_mb": before / 2**20,
        "rss_after_mb": after / 2**20,
        "growth_bytes_per_namespace": (after - before) / count,
        "tries": "; ".join(repr(group.trie) for group in pool.groups),
    }


def child(argv: list[str]) -> dict[str, float | str]:
    """Run one measurement in a fresh interpreter and return its figures."""
    result = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["blocks", "namespaces"], help="default with --quick: both")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000], help="num_blocks values (blocks)")
    parser.add_argument("--touch", action="store_true", help="also allocate and free every block once (blocks)")
    parser.add_argument("--count", type=int, default=50_000, help="namespaces to serve (namespaces)")
    parser.add_argument("--generate", action="store_true", help="serve them through enable()d generate")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="small sizes: 1000 blocks (touched), 200 namespaces")
    args = parser.parse_args(argv)
    if args.quick and args.what is None:
        return max(main(["blocks", "--quick"]), main(["namespaces", "--quick"]))
    if args.what is None:
        parser.error("say what to measure: blocks or namespaces (or --quick for both, small)")
    if args.quick:
        args.sizes, args.touch, args.count = [1000], True, 200
    if args.child:
        blocks = args.what == "blocks"
        figures = measure_blocks(args.sizes[0], args.touch) if blocks else measure_namespaces(args.count, args.generate)
        print(json.dumps(figures))
        return 0
    if args.what == "blocks":
        for size in args.sizes:
            extra = ["--touch"] if args.touch else []
            print(json.dumps(child(["blocks", "--sizes", str(size), *extra])))
    else:
        extra = ["--generate"] if args.generate else []
        print(json.dumps(child(["namespaces", "--count", str(args.count), *extra])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
