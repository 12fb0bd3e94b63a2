"""``pagedcore serve``: its arguments and its run function.

This module is imported whenever the ``pagedcore`` command builds its parser, so it imports only ``argparse`` at
the top: torch, transformers, FastAPI and uvicorn are imported by :func:`run`.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .auth import ApiKeys

__all__ = ["BUILTIN_NAME", "add_arguments", "load_api_keys", "missing_extra", "parse_size", "run"]

BUILTIN_NAME = "pagedcore-builtin"
# The defaults of pagedcore.serve.body.BodyLimits (not imported here: this module imports argparse alone).
_MAX_REQUEST_BYTES = "8MiB"
_BODY_TIMEOUT = 30.0
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` options to ``parser`` and make :func:`run` its handler.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_arguments(parser)
        >>> args = parser.parse_args(["--port", "9000", "--max-queue", "8"])
        >>> args.host, args.port, args.max_queue, args.handler is run
        ('127.0.0.1', 9000, 8, True)
    """
    if parser.description is None:
        parser.description = (
            "Serve a model over HTTP with OpenAI's API (completions, chat, streaming), continuous batching and "
            "prefix caching. Without --model: the built-in model."
        )
    parser.add_argument("--model", help="local path or hub name of a causal LM (default: the built-in model)")
    parser.add_argument("--served-model-name", help="the model name clients use (default: --model, or the built-in's)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    sizing = parser.add_mutually_exclusive_group()
    sizing.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool")
    sizing.add_argument("--memory-budget", default=None, help="KV memory of the pool, e.g. 2GiB (instead of blocks)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens computed per step")
    parser.add_argument(
        "--max-queue", type=int, default=512, help="waiting requests before new ones get 429 (>= 1, default 512)"
    )
    _add_limits(parser)
    parser.add_argument(
        "--api-keys",
        metavar="FILE",
        help="API keys: 'KEY TENANT' per line, or a JSON object {KEY: TENANT}; each tenant gets its own prefix "
        "cache namespace, requests without a known key get 401",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="device for the model (default: cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=["hermes", "llama3_json"],
        help="the format tool_choice=auto reads the model's tool calls in (default: hermes, <tool_call>{json}...)",
    )
    parser.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    ray = parser.add_argument_group("more than one replica, with Ray Serve (needs the ray extra)")
    ray.add_argument("--ray", action="store_true", help="serve N engine replicas behind one ingress with Ray Serve")
    ray.add_argument("--replicas", type=int, default=None, help="engine replicas (with --ray; default 2)")
    ray.add_argument(
        "--routing", choices=["prefix", "random"], default=None, help="prefix-affinity (default) or random routing"
    )
    ray.add_argument("--ray-address", default=None, help="a Ray cluster to join (default: start a local one)")
    ray.add_argument("--cpus-per-replica", type=float, default=None, help="Ray CPUs per engine replica (default 1)")
    parser.set_defaults(handler=run)


def _add_limits(parser: argparse.ArgumentParser) -> None:
    """The bounds on one request's body."""
    parser.add_argument(
        "--max-request-bytes",
        default=_MAX_REQUEST_BYTES,
        metavar="SIZE",
        help=f"largest request body, e.g. 8MiB or 1000000; larger ones get 413 (default {_MAX_REQUEST_BYTES})",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=_BODY_TIMEOUT,
        metavar="SECONDS",
        help=f"seconds a request body may take to arrive; slower ones get 408 (default {_BODY_TIMEOUT:g})",
    )


def run(args: argparse.Namespace) -> int:
    """Load the model, start the engine loop and serve until interrupted (Ctrl-C or SIGTERM); returns the exit
    code. Bad arguments raise ``pagedcore.cli.common.UsageError`` (exit code 2).

    Example:
        >>> run(argparse.Namespace(port=70000))  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ...
        pagedcore.cli.common.UsageError: --port must be in 0..65535, got 70000
    """
    from pagedcore.cli.common import EXIT_OK, EXIT_UNAVAILABLE, UsageError

    _check(args, UsageError)
    if getattr(args, "ray", False):
        from .ray.command import run as run_with_ray

        args.replicas = 2 if args.replicas is None else args.replicas
        args.routing = args.routing or "prefix"
        args.cpus_per_replica = 1.0 if args.cpus_per_replica is None else args.cpus_per_replica
        return run_with_ray(args)
    if missing_extra("pagedcore serve", "serve", ("fastapi", "prometheus_client", "uvicorn")):
        return EXIT_UNAVAILABLE

    engine, loop, server = _build(args, UsageError)
    in_main = _in_main_thread()
    # uvicorn handles SIGTERM / Ctrl-C while serving, then raises the signal again once it has shut down; these
    # handlers turn that second signal into a normal return, so the engine is closed below and the exit code is 0.
    previous = signal.signal(signal.SIGTERM, _ignore) if in_main else None
    loop.start()
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        loop.stop()
        engine.close()
    return EXIT_OK


def _build(args: argparse.Namespace, error: type[Exception]) -> tuple[Any, Any, Any]:
    """The engine, its loop and the uvicorn server that ``args`` describe (nothing started yet)."""
    from pagedcore.adapters.transformers import Engine

    from .app import create_app
    from .body import body_limits
    from .loop import EngineLoop
    from .server import make_server

    api_keys = load_api_keys(args.api_keys, error)
    model, tokenizer, name = _model(args, error)
    engine = Engine(
        model,
        tokenizer,
        num_blocks=args.num_blocks,
        memory_budget=args.memory_budget,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    loop = EngineLoop(engine, max_queue=args.max_queue)
    app = create_app(
        loop,
        model_name=args.served_model_name or name,
        api_keys=api_keys,
        limits=body_limits(args),
        tool_call_parser=args.tool_call_parser,
    )
    server = make_server(app, loop, host=args.host, port=args.port, log_level=args.log_level)
    host = f"[{args.host}]" if ":" in args.host else args.host
    tenants = f", {len(api_keys)} API keys" if api_keys is not None else ""
    print(
        f"pagedcore serve: model {args.served_model_name or name!r} at http://{host}:{args.port}/v1 "
        f"({engine.pool.num_blocks} KV blocks of {engine.pool.block_size} tokens{tenants}); Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    if api_keys is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"pagedcore serve: warning: {args.host} is reachable from other machines and no --api-keys is set",
            file=sys.stderr,
        )
    return engine, loop, server


def _check(args: argparse.Namespace, error: type[Exception]) -> None:
    if not 0 <= args.port <= 65535:
        raise error(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 1:  # 0 would refuse every request with 429
        raise error(f"--max-queue must be >= 1, got {args.max_queue}")
    args.max_request_bytes = parse_size(getattr(args, "max_request_bytes", _MAX_REQUEST_BYTES), error)
    if args.max_request_bytes < 1:
        raise error(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    timeout = getattr(args, "body_timeout", _BODY_TIMEOUT)
    if not timeout > 0 or timeout == float("inf"):
        raise error(f"--body-timeout must be a number of seconds > 0, got {timeout}")
    if args.threads is not None and args.threads < 1:
        raise error(f"--threads must be >= 1, got {args.threads}")
    if not getattr(args, "ray", False):
        for option in ("replicas", "routing", "ray_address", "cpus_per_replica"):
            if getattr(args, option, None) is not None:
                raise error(f"--{option.replace('_', '-')} needs --ray")


def parse_size(value: str | int, error: type[Exception] = ValueError) -> int:
    """A size in bytes: an integer, or a number with a unit (KB, MB, GB, KiB, MiB, GiB); ``error`` otherwise.

    Example:
        >>> parse_size("8MiB"), parse_size("1.5 kb"), parse_size(100)
        (8388608, 1500, 100)
    """
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
    if match is None or match.group(2).lower() not in _UNITS:
        raise error(f"--max-request-bytes must be a size like 8MiB or 1000000, got {value!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _model(args: argparse.Namespace, error: type[Exception]) -> tuple[Any, Any, str]:
    import torch

    from pagedcore.cli.common import load_model  # the `--model` loader of `pagedcore generate`

    dtype = getattr(torch, args.dtype)
    model: Any
    tokenizer: Any
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from pagedcore.adapters.transformers.builtin import BUILTIN_DESCRIPTION, builtin_model, builtin_tokenizer

        print(
            f"note: no --model given: serving the {BUILTIN_DESCRIPTION} as {BUILTIN_NAME!r}; its text is gibberish. "
            "Pass --model PATH for a real checkpoint.",
            file=sys.stderr,
        )
        model, tokenizer, name = builtin_model(), builtin_tokenizer(), BUILTIN_NAME
    else:
        model, tokenizer = load_model(args.model, dtype)
        name = args.model
    model.to(device=args.device, dtype=dtype)
    return model, tokenizer, name


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _ignore(signum: int, frame: Any) -> None:
    """SIGTERM after uvicorn's own shutdown: nothing left to do but return."""


def missing_extra(command: str, extra: str, modules: tuple[str, ...]) -> bool:
    """Whether one of ``modules`` cannot be imported; if so, say in one line which extra ``command`` needs.

    Example:
        >>> missing_extra("pagedcore serve", "serve", ("json",))
        False
    """
    import importlib

    try:
        for module in modules:
            importlib.import_module(module)
    except ImportError as exc:
        print(f"{command}: needs the {extra} extra: pip install 'pagedcore[{extra}]' ({exc})", file=sys.stderr)
        return True
    return False


def load_api_keys(path: str | None, usage_error: type[Exception]) -> ApiKeys | None:
    """The :class:`~pagedcore.serve.auth.ApiKeys` of ``--api-keys FILE`` (None without one); a bad file raises
    ``usage_error`` with the file's problem in one line.

    Example:
        >>> load_api_keys(None, ValueError) is None
        True
    """
    if not path:
        return None
    from .auth import ApiKeys, ApiKeysError

    try:
        return ApiKeys.from_file(path)
    except ApiKeysError as exc:
        raise usage_error(str(exc)) from exc
