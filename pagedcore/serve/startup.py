"""What ``pagedcore serve`` sets up from vLLM's flags at start-up, besides the engine and the app: the hub options
and a tokenizer other than the model's (``--revision``, ``--download-dir``, ``--tokenizer``), the requests' default
sampling values (``--generation-config``), the decode mode (``--enforce-eager``), the start-up notes (the dtype,
the defaults taken, why a no-op flag changes nothing) and the periodic stats lines (``--disable-log-stats``).

Called by :mod:`pagedcore.serve.cli` once its arguments are checked.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["compile_mode", "hub_options", "load_tokenizer", "print_notes", "sampling_defaults", "stats_logger"]


def stats_logger(args: argparse.Namespace, loop: Any) -> Any:
    """vLLM's periodic stats lines (INFO), started, unless ``--disable-log-stats`` (None then).

    Example:
        >>> stats_logger(argparse.Namespace(disable_log_stats=True), loop=None) is None
        True
    """
    from .server_logs import StatsLogger, stats_interval

    if getattr(args, "disable_log_stats", False):
        return None
    stats = StatsLogger(loop, stats_interval())
    stats.start()
    return stats


def compile_mode(args: argparse.Namespace) -> bool | str:
    """``Engine(compile=...)``: ``--enforce-eager`` is ``--no-compile``, ``--cuda-graphs`` is ``"cudagraphs"``;
    default: auto (eager).

    Example:
        >>> eager, default = argparse.Namespace(enforce_eager=True, compile=None), argparse.Namespace(compile=None)
        >>> compile_mode(eager), compile_mode(default), compile_mode(argparse.Namespace(cuda_graphs=True))
        (False, 'auto', 'cudagraphs')
    """
    if getattr(args, "enforce_eager", False):
        return False
    if getattr(args, "cuda_graphs", False):
        return "cudagraphs"
    return "auto" if args.compile is None else bool(args.compile)


def print_notes(args: argparse.Namespace, model: Any, options: Any) -> None:
    """Print the start-up lines: the dtype and decode mode, the request defaults taken from the generation config,
    and why each no-op vLLM flag given changes nothing here.

    Example:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> args = argparse.Namespace(compile=None, enable_chunked_prefill=None, swap_space=None)
        >>> print_notes(args, torch.nn.Linear(1, 1), SimpleNamespace(sampling_defaults={}))
    """
    from .vllm_flags import no_op_notes

    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    mode = compile_mode(args)
    decode = {False: "eager", True: "compiled", "cudagraphs": "as CUDA graphs"}.get(mode, "auto (eager)")
    print(f"pagedcore serve: weights in {dtype}, decode steps {decode}", file=sys.stderr)
    if options.sampling_defaults:
        shown = ", ".join(f"{k}={v}" for k, v in options.sampling_defaults.items())
        print(
            f"pagedcore serve: requests that leave them unset get the generation config's {shown} "
            "(--generation-config vllm: none)",
            file=sys.stderr,
        )
    for note in no_op_notes(args):
        print(f"pagedcore serve: {note}", file=sys.stderr)
    sys.stderr.flush()


def sampling_defaults(args: argparse.Namespace, error: type[Exception], model: str | None) -> dict[str, Any]:
    """``--generation-config`` and ``--override-generation-config``: the requests' default sampling values for
    ``model`` (its folder or hub name; None: the built-in model, which has no generation config).

    Example:
        >>> args = argparse.Namespace(generation_config="auto", override_generation_config={"temperature": 0.5})
        >>> sampling_defaults(args, ValueError, None)
        {'temperature': 0.5}
    """
    from .sampling_defaults import generation_defaults
    from .vllm_flags import generation_config_source

    try:
        source = generation_config_source(args.generation_config)
        return generation_defaults(source, model, args.override_generation_config, **hub_options(args))
    except ValueError as exc:
        raise error(str(exc)) from exc


def hub_options(args: argparse.Namespace) -> dict[str, Any]:
    """``from_pretrained``'s hub options: ``--revision`` and ``--download-dir`` (the cache).

    Example:
        >>> hub_options(argparse.Namespace(revision="v2", download_dir=None))
        {'revision': 'v2'}
    """
    hub = {"revision": getattr(args, "revision", None), "cache_dir": getattr(args, "download_dir", None)}
    return {key: value for key, value in hub.items() if value is not None}


def load_tokenizer(args: argparse.Namespace, error: type[Exception], model: str | None) -> Any:
    """``--tokenizer`` (at ``--tokenizer-revision``): a tokenizer other than ``model``'s own (``model``: its folder
    or hub name; None: the built-in model).

    Example:
        >>> load_tokenizer(argparse.Namespace(tokenizer=None), ValueError, None)
        Traceback (most recent call last):
        ...
        ValueError: --tokenizer-revision needs --tokenizer or a --model from the hub
    """
    from transformers import AutoTokenizer

    from pagedcore.cli.common import first_line

    name = args.tokenizer or model
    if name is None:
        raise error("--tokenizer-revision needs --tokenizer or a --model from the hub")
    options: dict[str, Any] = {"trust_remote_code": args.trust_remote_code, "revision": args.tokenizer_revision}
    if args.download_dir is not None:
        options["cache_dir"] = args.download_dir
    try:
        return AutoTokenizer.from_pretrained(name, **options)
    except (OSError, ValueError) as exc:
        raise error(f"cannot load the tokenizer {name!r}: {first_line(exc)}") from exc
