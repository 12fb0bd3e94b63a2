"""The ``pagedcore`` command line.

Subcommands:

- ``pagedcore generate`` — generate from one or many prompts through prefix-cached ``generate`` (or the Engine with
  ``--engine``) and print the text and a stats line. Without ``--model`` a small built-in model is built from a
  config (random weights, nothing downloaded).
- ``pagedcore bench`` — the side-by-side benchmarks (markdown table on stdout, PNG chart in ``--out``).
- ``pagedcore plugins`` — the loaded plugins, their hooks, and the attention backend chosen per device and dtype.
- ``pagedcore serve`` — an OpenAI-compatible HTTP server over the Engine (``pagedcore.serve``).

Exit codes: 0 success, 1 unexpected failure, 2 bad arguments or input (including a checkpoint that cannot be
loaded), 3 an unavailable plugin (e.g. an attention backend no plugin offers on this device).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from pagedcore import __version__
from pagedcore.benchmarks.options import add_arguments as add_bench_arguments
from pagedcore.benchmarks.options import options_from as bench_options
from pagedcore.benchmarks.registry import BENCHMARKS
from pagedcore.errors import PagedCoreError, PluginError

from .common import EXIT_FAILURE, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, UsageError, load_model

__all__ = ["load_model", "main"]

DEFAULT_SYSTEM = (
    "You are a helpful assistant for a bicycle repair shop. Answer briefly and politely, and suggest a visit to "
    "the shop when a repair needs tools. "
)
DEFAULT_QUESTIONS = [
    "How often should I oil my chain?",
    "My brakes squeak when it rains. Why?",
    "What tyre pressure should I use for commuting?",
]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code.

    Example:
        >>> main(["--version"])  # doctest: +SKIP
        pagedcore 0.1.0
        0
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        result: int = args.handler(args)
        return result
    except UsageError as exc:
        print(f"pagedcore {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except PluginError as exc:
        print(f"pagedcore {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except PagedCoreError as exc:
        print(f"pagedcore {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_FAILURE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedcore",
        description="Paged KV-cache memory with prefix caching for Hugging Face transformers.",
    )
    parser.add_argument("--version", action="version", version=f"pagedcore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="generate text with paged KV memory and prefix caching",
        description="Generate from prompts; prints the text and a stats line.",
    )
    gen.add_argument("prompts", nargs="*", help="prompts (default: three questions sharing a system prompt)")
    gen.add_argument("-f", "--file", help="read prompts from a file, one per line ('-' for stdin)")
    gen.add_argument("--model", help="local path or hub name of a causal LM (default: the built-in model)")
    gen.add_argument(
        "--system",
        default=None,
        help="text prepended to every prompt (default: a demo system prompt when no prompt is given)",
    )
    gen.add_argument("--engine", action="store_true", help="run all prompts through the continuous-batching Engine")
    gen.add_argument("--max-new-tokens", type=_positive_or_zero, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool")
    gen.add_argument("--memory-budget", default=None, help="KV memory of the pool, e.g. 2GiB (instead of blocks)")
    gen.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: the device's)")
    gen.add_argument("--namespace", default=None, help="prefix-cache namespace (tenant) of these prompts")
    gen.add_argument(
        "--attn",
        default="paged",
        choices=["paged", "sdpa", "eager"],
        help="attention implementation (default: paged, reading KV straight from the pool)",
    )
    gen.add_argument("--backend", default=None, help="attention backend plugin for --attn paged (default: auto)")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--device", default="cpu", help="device for the model: cpu, cuda, cuda:N, auto (default: cpu)")
    gen.add_argument("--repeat", type=int, default=1, help="run the prompts this many times (see prefix reuse)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt and one for the stats")
    gen.set_defaults(handler=_cmd_generate)

    bench = sub.add_parser(
        "bench",
        help="side-by-side benchmarks (markdown tables + PNG chart)",
        description="Run the side-by-side benchmarks (all, or those --only names), in this order:\n"
        + "\n".join(f"  {b.name:8} {b.summary}" for b in BENCHMARKS.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_bench_arguments(bench)  # --quick, --device, --dtype, --model-size, --only, --threads, --no-progress
    bench.add_argument("--out", default="bench-out", help="folder for results.md and the chart (default: bench-out)")
    bench.set_defaults(handler=_cmd_bench)

    plugins = sub.add_parser(
        "plugins",
        help="list plugins, their hooks and the attention backend per device",
        description="List the loaded plugins and which attention backend each device gets.",
    )
    plugins.add_argument("--json", action="store_true")
    plugins.set_defaults(handler=_cmd_plugins)

    from pagedcore.serve import cli as serve_cli  # argparse only: the server's imports wait for `serve` to run

    serve_cli.add_arguments(sub.add_parser("serve", help="an OpenAI-compatible server over the Engine"))
    return parser


def _positive_or_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


# ---------------------------------------------------------------------- generate
def _cmd_generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens == 0 and not args.engine:
        raise UsageError("--max-new-tokens 0 needs --engine (transformers' generate makes at least one token)")
    if args.repeat < 1:
        raise UsageError(f"--repeat must be >= 1, got {args.repeat}")
    prompts = _read_prompts(args)

    from pagedcore.adapters.transformers import Engine, PagedKVPool, SamplingParams, disable, enable, namespace
    from pagedcore.adapters.transformers.builtin import BUILTIN_DESCRIPTION, builtin_model, builtin_tokenizer
    from pagedcore.benchmarks.device import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model: Any
    tokenizer: Any
    if args.model is None:
        model, tokenizer = builtin_model(), builtin_tokenizer()
        print(
            f"note: no --model given: using the {BUILTIN_DESCRIPTION}; its text is gibberish. "
            "Pass --model PATH for a real checkpoint.",
            file=sys.stderr,
        )
    else:
        model, tokenizer = load_model(args.model, dtype)
    model.to(device=device, dtype=dtype)
    if args.attn:
        model.set_attn_implementation(args.attn)
    if args.backend is not None:  # fail now, with exit code 3, if no plugin offers it
        from pagedcore import default_plugin_manager

        default_plugin_manager().attention_backend(device.type, dtype, args.backend)
    pool = PagedKVPool(model, num_blocks=args.num_blocks, memory_budget=args.memory_budget, block_size=args.block_size)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    started = time.perf_counter()
    generated = 0
    results: list[tuple[str, str]] = []
    peak = 0
    if args.engine:
        with Engine(model, tokenizer, pool=pool, attention_backend=args.backend) as engine:
            for _ in range(args.repeat):
                outputs = engine.generate(prompts, params, use_tqdm=not args.json, namespace=args.namespace)
                for prompt, out in zip(prompts, outputs):
                    if out.error:
                        raise UsageError(out.error)
                    generated += len(out.token_ids)
                    results.append((prompt, out.text or ""))
            peak = engine.stats().kv_peak_used_bytes
    else:
        enable(model, pool=pool, attention_backend=args.backend)
        try:
            with namespace(args.namespace):
                for _ in range(args.repeat):
                    for prompt in prompts:
                        text, count, used = _generate_one(model, tokenizer, prompt, params, device, pool)
                        peak = max(peak, used)
                        generated += count
                        results.append((prompt, text))
        finally:
            disable(model)
    elapsed = time.perf_counter() - started
    stats = {
        "prompts": len(results),
        "prefix_hit_tokens": pool.num_hit_tokens,
        "prefix_query_tokens": pool.num_query_tokens,
        "prefix_hit_rate": round(pool.hit_rate, 4),
        "kv_peak_bytes": peak,
        "kv_capacity_bytes": pool.memory_stats().capacity_bytes,
        "generated_tokens": generated,
        "seconds": round(elapsed, 3),
        "tokens_per_second": round(generated / elapsed, 2) if elapsed else 0.0,
    }
    for prompt, text in results:
        if args.json:
            print(json.dumps({"prompt": prompt, "text": text}))
        else:
            print(f"> {_short(prompt)}\n{text}\n")
    if args.json:
        print(json.dumps(stats))
    else:
        print(
            f"prefix hit rate {100 * pool.hit_rate:.1f}% ({pool.num_hit_tokens}/{pool.num_query_tokens} prompt tokens)"
            f" | KV peak {_size(peak)} of {_size(stats['kv_capacity_bytes'])}"
            f" | {generated} tokens in {elapsed:.2f}s ({stats['tokens_per_second']} tokens/s)"
        )
    return EXIT_OK


def _generate_one(model: Any, tokenizer: Any, prompt: str, params: Any, device: Any, pool: Any) -> tuple[str, int, int]:
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    peak = [0]

    class _Watch(StoppingCriteria):  # samples the pool's KV use while generating
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            peak[0] = max(peak[0], pool.memory_stats().used_bytes)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
    kwargs: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "stopping_criteria": StoppingCriteriaList([_Watch()]),
    }
    if params.is_greedy:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p)
        if params.seed is not None:
            torch.manual_seed(params.seed)
    if tokenizer.pad_token_id is not None:
        kwargs["pad_token_id"] = tokenizer.pad_token_id
    out = model.generate(ids, **kwargs)
    new = out[0, ids.shape[1] :]
    return tokenizer.decode(new, skip_special_tokens=True), int(new.shape[0]), peak[0]


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.file:
        try:
            handle = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            raise UsageError(f"cannot read prompts from {args.file!r}: {exc.strerror}") from exc
        with handle:
            prompts.extend(line.rstrip("\n") for line in handle if line.strip())
    system = args.system
    if not prompts:
        prompts = list(DEFAULT_QUESTIONS)
        system = DEFAULT_SYSTEM if system is None else system
    if any(not p.strip() for p in prompts):
        raise UsageError("empty prompt")
    return [(system or "") + p for p in prompts]


# ---------------------------------------------------------------------- bench
def _cmd_bench(args: argparse.Namespace) -> int:
    from pagedcore.benchmarks import run_benchmarks

    print(run_benchmarks(bench_options(args), args.out))
    return EXIT_OK


# ---------------------------------------------------------------------- plugins
def _cmd_plugins(args: argparse.Namespace) -> int:
    import torch

    import pagedcore.adapters.transformers  # noqa: F401  (registers the "paged" attention implementation)
    from pagedcore import default_plugin_manager
    from pagedcore.plugins.xformers.status import describe, xformers_status

    pm = default_plugin_manager()
    infos = pm.plugins()
    xformers = xformers_status()  # why the xformers backend is (not) offered
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    choices: dict[str, dict[str, str]] = {}
    for device in devices:
        choices[device] = {}
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            try:
                choices[device][str(dtype).removeprefix("torch.")] = pm.attention_backend(device, dtype).name
            except PluginError:
                choices[device][str(dtype).removeprefix("torch.")] = "none"
    if args.json:
        print(
            json.dumps(
                {
                    "plugins": [{"name": i.name, "source": i.source, "hooks": list(i.hooks)} for i in infos],
                    "attention_backends": choices,
                    "xformers": {"available": xformers.available, "reason": xformers.reason, "ops": xformers.ops},
                },
                indent=2,
            )
        )
        return EXIT_OK
    print("plugins:")
    for info in infos:
        print(f"  {info.name:<12} {info.source}")
        for hook in info.hooks:
            print(f"      {hook}")
    print("attention backend per device and dtype:")
    for device, per_dtype in choices.items():
        print(f"  {device:<6} " + ", ".join(f"{dtype}: {name}" for dtype, name in per_dtype.items()))
    if "cuda" not in choices:
        print("  cuda   (no CUDA device here)")
    print(describe(xformers))
    return EXIT_OK


def _short(text: str, width: int = 100) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def _size(num_bytes: float) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} GiB"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
