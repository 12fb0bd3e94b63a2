"""``pagedcore generate``: prompts through prefix-cached ``generate`` (or the Engine with ``--engine``), the text and
a stats line (prefix hit rate, KV peak, tokens/s) printed."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from .common import EXIT_OK, UsageError, check_device, check_model_path, load_model

__all__ = ["DEFAULT_QUESTIONS", "DEFAULT_SYSTEM", "add_parser", "run"]

DEFAULT_SYSTEM = (
    "You are a helpful assistant for a bicycle repair shop. Answer briefly and politely, and suggest a visit to "
    "the shop when a repair needs tools. "
)
DEFAULT_QUESTIONS = [
    "How often should I oil my chain?",
    "My brakes squeak when it rains. Why?",
    "What tyre pressure should I use for commuting?",
]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand to the ``sub`` parsers.

    Example:
        >>> sub = argparse.ArgumentParser().add_subparsers(dest="command")
        >>> add_parser(sub).parse_args(["hi", "--engine"]).engine
        True
    """
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
    _add_sampling_and_pool(gen)
    gen.add_argument("--repeat", type=int, default=1, help="run the prompts this many times (see prefix reuse)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt and one for the stats")
    gen.set_defaults(handler=run)
    return gen


def _add_sampling_and_pool(gen: argparse.ArgumentParser) -> None:
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
    gen.add_argument(
        "--threads",
        type=_positive,
        default=None,
        help="torch threads (default: the CPUs this process may use that other work leaves free; see the start-up "
        "line)",
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_or_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


@dataclass
class _Setup:
    """What a run generates with: the model on its device, its tokenizer, the pool and the sampling."""

    model: Any
    tokenizer: Any
    device: Any
    pool: Any
    params: Any


@dataclass
class _Results:
    """Each prompt's text, the tokens generated and the KV peak seen."""

    texts: list[tuple[str, str]]
    generated: int = 0
    peak: int = 0


def run(args: argparse.Namespace) -> int:
    """Run ``pagedcore generate`` with parsed ``args``; returns the exit code (bad arguments raise
    :class:`~pagedcore.cli.common.UsageError`).

    Example:
        >>> run(argparse.Namespace(max_new_tokens=0, engine=False))  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ...
        pagedcore.cli.common.UsageError: --max-new-tokens 0 needs --engine
    """
    if args.max_new_tokens == 0 and not args.engine:
        raise UsageError("--max-new-tokens 0 needs --engine (transformers' generate makes at least one token)")
    if args.repeat < 1:
        raise UsageError(f"--repeat must be >= 1, got {args.repeat}")
    prompts = _read_prompts(args)
    _check_before_imports(args)
    setup = _setup(args)
    started = time.perf_counter()
    results = _run_engine(args, setup, prompts) if args.engine else _run_enabled(args, setup, prompts)
    _report(args, setup.pool, results, time.perf_counter() - started)
    return EXIT_OK


def _check_before_imports(args: argparse.Namespace) -> None:
    """What can be refused before torch and transformers load (seconds): the model's path, the device, the pool's
    counts (their rule: :func:`pagedcore.validation.integer`, as the pool asks it)."""
    from pagedcore.errors import ConfigError
    from pagedcore.validation import integer

    if args.model is not None:
        check_model_path(args.model)
    check_device(args.device)
    for name in ("num_blocks", "block_size"):
        if getattr(args, name, None) is not None:
            integer(name, getattr(args, name), minimum=1, error=ConfigError, expected="a positive integer")


def _setup(args: argparse.Namespace) -> _Setup:
    from pagedcore.adapters.transformers import PagedKVPool, SamplingParams
    from pagedcore.adapters.transformers.builtin import BUILTIN_DESCRIPTION, builtin_model, builtin_tokenizer
    from pagedcore.cli.devices import resolve_device, resolve_dtype

    from .huge_pages import huge_pages
    from .malloc import tune_malloc
    from .threads import apply_threads

    threads = apply_threads(getattr(args, "threads", None))
    malloc = tune_malloc()
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
    memory = f"{malloc.describe()}; {huge_pages().describe()}"
    print(f"pagedcore generate: {threads.describe()}; {memory}", file=sys.stderr)  # all checked: under way
    return _Setup(model, tokenizer, device, pool, params)


def _run_engine(args: argparse.Namespace, setup: _Setup, prompts: list[str]) -> _Results:
    from pagedcore.adapters.transformers import Engine

    results = _Results([])
    with Engine(setup.model, setup.tokenizer, pool=setup.pool, attention_backend=args.backend) as engine:
        for _ in range(args.repeat):
            outputs = engine.generate(prompts, setup.params, use_tqdm=not args.json, namespace=args.namespace)
            for prompt, out in zip(prompts, outputs):
                if out.error:
                    raise UsageError(out.error)
                results.generated += len(out.token_ids)
                results.texts.append((prompt, out.text or ""))
        results.peak = engine.stats().kv_peak_used_bytes
    return results


def _run_enabled(args: argparse.Namespace, setup: _Setup, prompts: list[str]) -> _Results:
    from pagedcore.adapters.transformers import disable, enable, namespace

    results = _Results([])
    enable(setup.model, pool=setup.pool, attention_backend=args.backend)
    try:
        with namespace(args.namespace):
            for _ in range(args.repeat):
                for prompt in prompts:
                    text, count, used = _generate_one(setup, prompt)
                    results.peak = max(results.peak, used)
                    results.generated += count
                    results.texts.append((prompt, text))
    finally:
        disable(setup.model)
    return results


def _report(args: argparse.Namespace, pool: Any, results: _Results, elapsed: float) -> None:
    generated, peak = results.generated, results.peak
    stats = {
        "prompts": len(results.texts),
        "prefix_hit_tokens": pool.num_hit_tokens,
        "prefix_query_tokens": pool.num_query_tokens,
        "prefix_hit_rate": round(pool.hit_rate, 4),
        "kv_peak_bytes": peak,
        "kv_capacity_bytes": pool.memory_stats().capacity_bytes,
        "generated_tokens": generated,
        "seconds": round(elapsed, 3),
        "tokens_per_second": round(generated / elapsed, 2) if elapsed else 0.0,
    }
    for prompt, text in results.texts:
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


def _generate_one(setup: _Setup, prompt: str) -> tuple[str, int, int]:
    model, tokenizer, params, device, pool = setup.model, setup.tokenizer, setup.params, setup.device, setup.pool
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
