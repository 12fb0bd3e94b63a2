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
import dataclasses
import gc
import json
import sys
from collections.abc import Sequence
from typing import NoReturn

from pagedcore import __version__
from pagedcore.errors import PagedCoreError, PluginError

from . import generate
from .common import EXIT_FAILURE, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, UsageError, load_model

__all__ = ["entry", "load_model", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code.

    Example:
        >>> main(["--version"])  # doctest: +SKIP
        pagedcore 0.1.0
        0
    """
    parser = _parser()
    from pagedcore.serve.vllm_flags import expand_config  # argparse only

    try:
        argv = expand_config(sys.argv[1:] if argv is None else argv)  # `serve --config FILE.yaml` (vLLM's)
    except ValueError as exc:
        print(f"pagedcore serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the subcommand's parser, which knows its options
        commands = getattr(parser, "subcommands", {})
        commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    if args.command in ("generate", "serve"):  # before anything loads torch: its allocator reads it once
        from .huge_pages import huge_pages

        huge_pages()
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


def entry() -> int:
    """The ``pagedcore`` command itself (its console script and ``python -m pagedcore``): :func:`main` on the
    process's arguments, then the heap frozen (``gc.freeze``) before the interpreter exits.

    The interpreter's exit runs full garbage collections over every object still alive: with torch, transformers
    and a model loaded, several seconds on a busy machine (an idle ``pagedcore serve`` took 15-19 s to exit after
    SIGTERM, all of it in ``gc_collect_main``). Frozen objects are skipped; they are freed with the process.

    Example:
        >>> import sys
        >>> sys.argv = ["pagedcore", "--version"]
        >>> entry()  # doctest: +SKIP
        pagedcore 0.1.0
    """
    try:
        return main()
    finally:
        gc.freeze()


def _parser() -> argparse.ArgumentParser:
    # The benchmarks' options are plain Python; imported here, so that importing pagedcore.cli's leaf modules (common,
    # devices) from the benchmarks never runs this package's imports of them.
    from pagedcore.benchmarks.options import add_arguments as add_bench_arguments
    from pagedcore.benchmarks.registry import BENCHMARKS

    parser = _OneLineParser(
        prog="pagedcore",
        description="Paged KV-cache memory with prefix caching for Hugging Face transformers.",
    )
    parser.add_argument("--version", action="version", version=f"pagedcore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    generate.add_parser(sub)

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
    parser.subcommands = dict(sub.choices)  # type: ignore[attr-defined]
    return parser


class _OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``pagedcore COMMAND: error: ...`` (argparse prints the whole
    usage first: 52 lines for ``serve``), pointing at ``--help``; its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---------------------------------------------------------------------- bench
def _cmd_bench(args: argparse.Namespace) -> int:
    from pagedcore.benchmarks import run_benchmarks
    from pagedcore.benchmarks.options import options_from

    from .huge_pages import huge_pages
    from .malloc import tune_malloc
    from .threads import choose_threads

    choice = choose_threads(args.threads)
    options = dataclasses.replace(options_from(args), threads=choice.threads)
    malloc = tune_malloc()

    def announce() -> None:  # once every option is checked: a bad one gets its one error line alone
        pages = huge_pages(enable=False).describe()  # its peers share its process: torch's default unless asked
        print(f"pagedcore bench: {choice.describe()}; {malloc.describe()}; {pages}", file=sys.stderr)

    print(run_benchmarks(options, args.out, on_start=announce))
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
