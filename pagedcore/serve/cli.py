"""``pagedcore serve``: its arguments and its run function.

This module is imported whenever the ``pagedcore`` command builds its parser, so it imports only ``argparse`` at
the top: torch, transformers, FastAPI and uvicorn are imported by :func:`run`.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

__all__ = ["BUILTIN_NAME", "add_arguments", "engine_config", "flag_error", "run"]

BUILTIN_NAME = "pagedcore-builtin"
# The defaults of pagedcore.serve.body.BodyLimits (not imported here: this module imports argparse alone).
_MAX_REQUEST_BYTES = "8MiB"
_BODY_TIMEOUT = 30.0
_SHUTDOWN_TIMEOUT = 30.0  # pagedcore.serve.server's drain on SIGTERM
_THREADS_HELP = "torch threads (default: the CPUs this process may use that other work leaves free; see start-up)"
_HEADER_TIMEOUT = 10.0  # pagedcore.serve.connections.ConnectionLimits' default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` options (vLLM's names where vLLM has the option) to ``parser`` and make :func:`run` its
    handler. Abbreviated options are refused (``--api-key`` is never read as ``--api-keys``).

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_arguments(parser)
        >>> args = parser.parse_args(["some/model", "--port", "9000", "--max-queue", "8", "--api-key", "sk-1"])
        >>> args.model_tag, args.host, args.port, args.max_queue, args.api_key, args.handler is run
        ('some/model', '127.0.0.1', 9000, 8, ['sk-1'], True)
    """
    from .lora_flags import add_lora_flags
    from .vllm_flags import DTYPES, add_refused, add_vllm_flags, human_int, json_list

    parser.allow_abbrev = False
    if parser.description is None:
        parser.description = (
            "Serve a model over HTTP with OpenAI's API (completions, chat, streaming), continuous batching and "
            "prefix caching, with vLLM's flags. Without a model: the built-in model."
        )
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="as --model (vLLM's positional form)")
    parser.add_argument("--model", help="local path or hub name of a causal LM (default: the built-in model)")
    parser.add_argument(
        "--served-model-name", nargs="+", metavar="NAME", help="the names clients use; answers carry the first"
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start-up)")
    _add_engine_flags(parser, human_int)
    _add_limits(parser)
    _add_access_flags(parser, json_list)
    parser.add_argument("--dtype", default="auto", choices=list(DTYPES), help="half is float16, float float32")
    parser.add_argument("--device", default="cpu", help="device for the model (default: cpu)")
    parser.add_argument("--trust-remote-code", action="store_true", help="run a checkpoint's own model code")
    parser.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template (a file, or the template)")
    parser.add_argument(
        "--trust-request-chat-template", action="store_true", help="let requests give their own chat_template"
    )
    parser.add_argument(
        "--tool-call-parser",
        default="hermes",
        metavar="NAME",
        help="the format tool_choice=auto reads the model's tool calls in: hermes (the default, <tool_call>{json}"
        "...), llama3_json, mistral, qwen3_coder, pythonic or deepseek_v3",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the draws of requests without a seed")
    parser.add_argument("--threads", type=int, default=None, help=_THREADS_HELP)
    levels = ["critical", "error", "warning", "info", "debug", "trace"]
    parser.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="warning", choices=levels)
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=_SHUTDOWN_TIMEOUT,
        metavar="SECONDS",
        help="on SIGTERM, seconds running requests may take to finish before they are aborted (default 30)",
    )
    add_vllm_flags(parser)
    add_lora_flags(parser)
    add_refused(parser)
    _add_ray_flags(parser)
    parser.set_defaults(handler=run)


def _add_decode_flags(parser: argparse.ArgumentParser) -> None:
    """How decode steps run: eagerly, compiled, or as CUDA graphs."""
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode steps compiled by inductor (Engine(compile=True)); --no-compile: eager; default: auto (eager)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help='decode steps captured as CUDA graphs per bucket, nothing compiled (Engine(compile="cudagraphs"))',
    )


def _add_engine_flags(parser: argparse.ArgumentParser, human_int: Callable[[str], int]) -> None:
    """The engine's sizing and scheduling."""
    sizing = parser.add_mutually_exclusive_group()
    sizing.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool")
    sizing.add_argument("--memory-budget", default=None, help="KV memory of the pool, e.g. 2GiB (instead of blocks)")
    sizing.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="F",
        help="this fraction of the device's free memory (after loading the model) becomes the KV pool",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--max-model-len", type=human_int, default=None, help="the context served, e.g. 4096 or 4k (default: model's)"
    )
    parser.add_argument(
        "--kv-store",
        metavar="DIR",
        default=None,
        help="a tier below the pool: evicted prefixes are written to this existing directory and loaded back, also "
        "after a restart (or a plugin's location, e.g. redis://...)",
    )
    parser.add_argument(
        "--kv-store-bytes", metavar="SIZE", default=None, help="the --kv-store budget, e.g. 20GiB (needed with it)"
    )
    parser.add_argument(
        "--state-slots",
        type=int,
        default=None,
        help="a model with recurrent-state layers (Qwen3.5, Mamba-2...): its state slots, live states and snapshots "
        "(default: half of --memory-budget, else 64)",
    )
    parser.add_argument(
        "--snapshot-interval",
        type=int,
        default=None,
        help="such a model's prompts keep a snapshot of their state every this many blocks (default 1)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens computed per step")
    parser.add_argument("--max-logprobs", type=int, default=20, help="the most logprobs a request may ask for")
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse cached prompt prefixes (default: on)",
    )
    parser.add_argument(
        "--max-queue", type=int, default=512, help="waiting requests before new ones get 429 (>= 1, default 512)"
    )
    _add_decode_flags(parser)


def _add_access_flags(parser: argparse.ArgumentParser, json_list: Callable[[str], list[str]]) -> None:
    """API keys and CORS."""
    parser.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="an API key clients must send (repeatable; vLLM's form: all keys share one prefix-cache namespace; "
        "without it, the VLLM_API_KEY environment variable)",
    )
    parser.add_argument(
        "--api-keys",
        metavar="FILE",
        help="API keys: 'KEY TENANT' per line, or a JSON object {KEY: TENANT}; each tenant gets its own prefix "
        "cache namespace, requests without a known key get 401",
    )
    parser.add_argument("--allowed-origins", type=json_list, default=[], help="CORS origins, e.g. '[\"*\"]'")
    parser.add_argument("--allowed-methods", type=json_list, default=["*"], help="CORS methods (default all)")
    parser.add_argument("--allowed-headers", type=json_list, default=["*"], help="CORS headers (default all)")
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")


def _add_ray_flags(parser: argparse.ArgumentParser) -> None:
    ray = parser.add_argument_group("more than one replica, with Ray Serve (needs the ray extra)")
    ray.add_argument("--ray", action="store_true", help="serve N engine replicas behind one ingress with Ray Serve")
    ray.add_argument("--replicas", type=int, default=None, help="engine replicas (with --ray; default 2)")
    ray.add_argument(
        "--routing", choices=["prefix", "random"], default=None, help="prefix-affinity (default) or random routing"
    )
    ray.add_argument("--ray-address", default=None, help="a Ray cluster to join (default: start a local one)")
    ray.add_argument("--cpus-per-replica", type=float, default=None, help="Ray CPUs per engine replica (default 1)")


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
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"seconds a connection may take to send its request line and headers; slower ones get 408 and are "
        f"closed (default {_HEADER_TIMEOUT:g})",
    )
    parser.add_argument(
        "--max-connections-per-client",
        type=int,
        default=None,
        metavar="N",
        help="connections one client address may hold at once; more get 429 (default: a quarter of ulimit -n, "
        "8..4096; 0: no cap, e.g. behind a proxy that carries many clients)",
    )


def run(args: argparse.Namespace) -> int:
    """Load the model, start the engine loop and serve until interrupted (Ctrl-C, or SIGTERM: running requests get
    ``--shutdown-timeout`` to finish, new ones 503); returns the exit code. Bad arguments raise
    ``pagedcore.cli.common.UsageError`` (exit code 2).

    Example:
        >>> run(argparse.Namespace(port=70000))  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ...
        pagedcore.cli.common.UsageError: --port must be in 0..65535, got 70000
    """
    from pagedcore.cli.common import EXIT_OK, EXIT_UNAVAILABLE, UsageError, missing_extra

    _check(args, UsageError)
    if getattr(args, "ray", False):
        from .ray.command import run as run_with_ray

        _check_ray(args, UsageError)

        args.replicas = 2 if args.replicas is None else args.replicas
        args.routing = args.routing or "prefix"
        args.cpus_per_replica = 1.0 if args.cpus_per_replica is None else args.cpus_per_replica
        return run_with_ray(args)
    if missing_extra("pagedcore serve", "serve", ("fastapi", "prometheus_client", "uvicorn")):
        return EXIT_UNAVAILABLE

    from .startup import stats_logger

    engine, loop, server, sock = _build(args, UsageError)
    in_main = _in_main_thread()
    # uvicorn handles SIGTERM / Ctrl-C while serving, then raises the signal again once it has shut down; these
    # handlers turn that second signal into a normal return, so the engine is closed below and the exit code is 0.
    previous = signal.signal(signal.SIGTERM, _ignore) if in_main else None
    loop.start()
    stats = stats_logger(args, loop)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        if stats is not None:
            stats.stop()
        loop.stop()
        engine.close()
        sock.close()
    return EXIT_OK


def _build(args: argparse.Namespace, error: type[Exception]) -> tuple[Any, Any, Any, Any]:
    """The engine, its loop, the uvicorn server that ``args`` describe and its bound socket (nothing started)."""
    from .server import bind
    from .server_logs import configure_logging

    # --enable-log-requests asks for its INFO lines: below the default level (warning) they would show nothing
    quiet = args.log_level.lower() in ("warning", "error", "critical")
    configure_logging("info" if getattr(args, "enable_log_requests", False) and quiet else args.log_level)
    from .auth import api_keys_of

    api_keys, key_source = api_keys_of(args, error)
    sock = _listen(args, error, bind)  # before the model loads: a taken port is said at once, in one line
    try:
        engine, loop, server = _serving(args, error, sock, api_keys, key_source)
    except BaseException:
        sock.close()
        raise
    return engine, loop, server, sock


def _listen(args: argparse.Namespace, error: type[Exception], bind: Callable[..., Any]) -> Any:
    try:
        return bind(args.host, args.port, listen=False)
    except OSError as exc:  # the port taken, a host that does not resolve or is not this machine's
        raise error(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None


def _serving(
    args: argparse.Namespace, error: type[Exception], sock: Any, api_keys: Any, key_source: str
) -> tuple[Any, Any, Any]:
    """The engine, its loop and the uvicorn server on ``sock`` (nothing started)."""
    from pagedcore.adapters.transformers import Engine
    from pagedcore.errors import ConfigError

    from .app import create_app
    from .body import body_limits
    from .loop import EngineLoop
    from .lora_flags import load_lora_modules
    from .server import make_server, start_listening
    from .startup import print_notes

    model, tokenizer, name = _model(args, error)
    try:
        engine = Engine(model, tokenizer, config=engine_config(args, _memory_budget(args, error)))
    except ConfigError as exc:  # e.g. --max-model-len over the model's context
        raise flag_error(exc, error) from exc
    try:
        load_lora_modules(engine, getattr(args, "lora_modules", None), error)
    except BaseException:
        engine.close()
        raise
    context = engine.context.limit
    loop = EngineLoop(engine, max_queue=args.max_queue)
    names = args.served_model_name or [name]
    options = _app_options(args, names, error, tokenizer)
    try:
        app = create_app(
            loop,
            model_name=names[0],
            api_keys=api_keys,
            context_length=context,
            limits=body_limits(args),
            options=options,
            tool_call_parser=args.tool_call_parser,
        )
    except ConfigError as exc:  # e.g. a reasoning parser whose markers the tokenizer lacks
        engine.close()
        raise error(str(exc)) from exc
    port = sock.getsockname()[1]
    server = make_server(
        app,
        loop,
        host=args.host,
        port=port,
        log_level=args.log_level,
        shutdown_timeout=args.shutdown_timeout,
        access_log=not getattr(args, "disable_uvicorn_access_log", False),
        limits=_connection_limits(args, error),
    )
    _freeze_heap()
    start_listening(sock)  # only now: a client connecting while the model loaded was refused, not left waiting
    _announce(args, engine, loop, names[0], port, api_keys, context)
    print(f"pagedcore serve: {key_source}", file=sys.stderr, flush=True)
    print_notes(args, model, options)
    return engine, loop, server


def _freeze_heap() -> None:
    """The start-up heap frozen before the first request (``pagedcore/cli/gc_heap.py``), said in one line."""
    from pagedcore.cli.gc_heap import ENV, freeze_startup_heap

    frozen = freeze_startup_heap()
    if frozen is None:
        print(f"pagedcore serve: start-up heap left to the garbage collector ({ENV}=0)", file=sys.stderr, flush=True)
    else:
        print(
            f"pagedcore serve: start-up heap frozen ({frozen} objects; full garbage collections skip them, "
            f"{ENV}=0 leaves them)",
            file=sys.stderr,
            flush=True,
        )


def _announce(
    args: argparse.Namespace, engine: Any, loop: Any, name: str, port: int, api_keys: Any, context: int | None
) -> None:
    host = f"[{args.host}]" if ":" in args.host else args.host
    tenants = f", {len(api_keys)} API keys" if api_keys is not None else ""
    slots = engine.pool.kv.states
    if slots is not None:  # a model with recurrent-state layers
        tenants = f", {slots.num_slots} state slots (a snapshot every {slots.interval} blocks){tenants}"
    print(
        f"pagedcore serve: model {name!r} at http://{host}:{port}/v1 "
        f"(context {'unbounded' if context is None else f'{context} tokens'}; "
        f"{engine.pool.num_blocks} KV blocks of {engine.pool.block_size} tokens{tenants}; "
        f"{getattr(args, 'threads_note', 'torch threads as set')}); Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    room = engine.scheduler.max_new_tokens(1)  # the pool's bound on one request (None: none)
    if context is not None and room is not None and room + 1 < context:
        print(
            f"pagedcore serve: warning: the KV pool holds {room + 1} tokens for one request, less "
            f"than the context of {context}: longer requests get 400, and chat without max_tokens is clamped to "
            "what fits (more --num-blocks / --memory-budget, or a smaller --max-model-len)",
            file=sys.stderr,
        )
    if api_keys is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"pagedcore serve: warning: {args.host} is reachable from other machines and no --api-key is set",
            file=sys.stderr,
        )


def _check(args: argparse.Namespace, error: type[Exception]) -> None:
    from .lora_flags import check_lora_flags
    from .vllm_flags import check_refused, check_vllm_flags

    if not 0 <= args.port <= 65535:
        raise error(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 1:  # 0 would refuse every request with 429
        raise error(f"--max-queue must be >= 1, got {args.max_queue}")
    from pagedcore.config import PoolConfig, parse_size
    from pagedcore.errors import ConfigError

    try:
        args.max_request_bytes = parse_size(
            getattr(args, "max_request_bytes", _MAX_REQUEST_BYTES), name="--max-request-bytes"
        )
        PoolConfig(kv_store=getattr(args, "kv_store", None), kv_store_bytes=getattr(args, "kv_store_bytes", None))
    except ConfigError as exc:
        raise flag_error(exc, error) from exc
    if args.max_request_bytes < 1:
        raise error(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    timeout = getattr(args, "body_timeout", _BODY_TIMEOUT)
    if not timeout > 0 or timeout == float("inf"):
        raise error(f"--body-timeout must be a number of seconds > 0, got {timeout}")
    _connection_limits(args, error)
    if args.threads is not None and args.threads < 1:
        raise error(f"--threads must be >= 1, got {args.threads}")
    _check_vllm_flags(args, error)
    check_vllm_flags(args, error)
    check_refused(args, error)
    check_lora_flags(args, error, served=args.served_model_name or [args.model or BUILTIN_NAME])
    if getattr(args, "config", None) is not None:
        raise error("--config is read by the pagedcore command (pagedcore serve --config FILE.yaml)")
    from pagedcore.cli.common import check_device, check_model_path  # before torch loads: seconds sooner

    if args.model not in (None, BUILTIN_NAME):
        check_model_path(args.model)
    check_device(getattr(args, "device", "cpu"))
    if not getattr(args, "ray", False):
        for option in ("replicas", "routing", "ray_address", "cpus_per_replica"):
            if getattr(args, option, None) is not None:
                raise error(f"--{option.replace('_', '-')} needs --ray")


def _check_vllm_flags(args: argparse.Namespace, error: type[Exception]) -> None:
    tag, model = getattr(args, "model_tag", None), getattr(args, "model", None)
    if tag is not None and model is not None and tag != model:
        raise error(f"the model is given twice: {tag!r} and --model {model!r}")
    args.model = model or tag
    length = getattr(args, "max_model_len", None)
    if length is not None and length < 1:
        raise error(f"--max-model-len must be >= 1, got {length}")
    fraction = getattr(args, "gpu_memory_utilization", None)
    if fraction is not None and not 0 < fraction <= 1:
        raise error(f"--gpu-memory-utilization must be in (0, 1], got {fraction}")
    shutdown = getattr(args, "shutdown_timeout", _SHUTDOWN_TIMEOUT)
    if not shutdown >= 0 or shutdown == float("inf"):
        raise error(f"--shutdown-timeout must be a number of seconds >= 0, got {shutdown}")


# Flags the Ray path (pagedcore.serve.ray.command) does not take yet: their values that ask for nothing.
_NOT_WITH_RAY: dict[str, Any] = {
    "api_key": None,
    "max_model_len": None,
    "gpu_memory_utilization": None,
    "chat_template": None,
    "trust_request_chat_template": False,
    "trust_remote_code": False,
    "allowed_origins": [],
    "seed": None,
    "enable_prefix_caching": True,
    "max_logprobs": 20,
    "tool_call_parser": "hermes",
    "tokenizer": None,
    "tokenizer_revision": None,
    "revision": None,
    "download_dir": None,
    "override_generation_config": None,
    "enable_auto_tool_choice": None,
    "reasoning_parser": None,
    "default_chat_template_kwargs": None,
    "return_tokens_as_token_ids": False,
    "response_role": "assistant",
    "root_path": None,
    "disable_fastapi_docs": False,
    "enable_request_id_headers": False,
    "enable_log_requests": False,
    "disable_uvicorn_access_log": False,
    "enable_lora": False,
    "header_timeout": None,  # Ray Serve's HTTP proxy holds the connections
    "max_connections_per_client": None,
    # Ray Serve's HTTP proxy reads the bodies, and serve.shutdown() stops the replicas without a drain (the values
    # after _check: a size in bytes, seconds)
    "max_request_bytes": 8 * 1024 * 1024,
    "body_timeout": _BODY_TIMEOUT,
    "shutdown_timeout": _SHUTDOWN_TIMEOUT,
}


def _check_ray(args: argparse.Namespace, error: type[Exception]) -> None:
    """Refuse the flags that the Ray path does not take; the rest in its forms (one name, an explicit dtype)."""
    for option, no_op in _NOT_WITH_RAY.items():
        if getattr(args, option, no_op) != no_op:
            flag = (
                "--no-enable-prefix-caching" if option == "enable_prefix_caching" else f"--{option.replace('_', '-')}"
            )
            raise error(f"{flag} is not supported with --ray yet (serve one engine without --ray)")
    names = getattr(args, "served_model_name", None) or []
    if len(names) > 1:
        raise error("--served-model-name takes one name with --ray")
    args.served_model_name = names[0] if names else None
    from .vllm_flags import DTYPES

    args.dtype = DTYPES.get(getattr(args, "dtype", "auto"), "auto")
    if args.dtype == "auto":
        args.dtype = "float32"
    if getattr(args, "enforce_eager", False):
        args.compile = False
    if getattr(args, "generation_config", "auto") != "auto":
        raise error("--generation-config is not supported with --ray yet (serve one engine without --ray)")


def engine_config(args: argparse.Namespace, memory_budget: Any = None) -> Any:
    """The :class:`~pagedcore.engine.config.EngineConfig` ``pagedcore serve``'s flags describe (the pool's sizes and
    tiers, the scheduler's limits, the Engine's own); raises :class:`~pagedcore.errors.ConfigError` naming the
    setting (:func:`flag_error` names its flag).

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_arguments(parser)
        >>> config = engine_config(parser.parse_args(["--num-blocks", "64", "--max-num-seqs", "8", "--no-compile"]))
        >>> config.pool.num_blocks, config.scheduler.max_num_seqs, config.compile
        (64, 8, False)
    """
    from pagedcore.config import PoolConfig
    from pagedcore.engine.config import EngineConfig
    from pagedcore.engine.lora import LoRAConfig
    from pagedcore.scheduler import SchedulerConfig

    from .startup import compile_mode

    pool = PoolConfig(
        num_blocks=args.num_blocks,
        memory_budget=args.memory_budget if memory_budget is None else memory_budget,
        block_size=args.block_size,
        kv_store=getattr(args, "kv_store", None),
        kv_store_bytes=getattr(args, "kv_store_bytes", None),
        state_slots=getattr(args, "state_slots", None),
        snapshot_interval=getattr(args, "snapshot_interval", None),
    )
    scheduler = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    lora = LoRAConfig(args.max_loras, args.max_lora_rank) if getattr(args, "enable_lora", False) else None
    return EngineConfig(
        pool,
        scheduler,
        max_logprobs=args.max_logprobs,
        max_model_len=args.max_model_len,
        compile=compile_mode(args),
        lora=lora,
    )


def _connection_limits(args: argparse.Namespace, error: type[Exception]) -> Any:
    """``--header-timeout`` and ``--max-connections-per-client`` as the server's connection limits."""
    from pagedcore.errors import ConfigError

    from .connections import ConnectionLimits

    given: dict[str, Any] = {}
    if getattr(args, "header_timeout", None) is not None:
        given["header_timeout"] = args.header_timeout
    if getattr(args, "max_connections_per_client", None) is not None:
        given["max_per_client"] = args.max_connections_per_client
    try:
        return ConnectionLimits(**given)
    except ConfigError as exc:
        raise error(str(exc)) from exc


def _memory_budget(args: argparse.Namespace, error: type[Exception]) -> Any:
    """``--memory-budget``, or ``--gpu-memory-utilization`` of the device's free memory (after the model loaded)."""
    fraction = args.gpu_memory_utilization
    if fraction is None:
        return args.memory_budget
    import torch

    device = torch.device(args.device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        import os

        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(free * fraction)


def _app_options(args: argparse.Namespace, names: list[str], error: type[Exception], tokenizer: Any) -> Any:
    from pathlib import Path

    from .app import AppOptions
    from .lora_flags import parents, runtime_lora_updating
    from .server_logs import RequestLog
    from .startup import sampling_defaults

    template = args.chat_template
    if template is not None and ("{" not in template or Path(template).expanduser().is_file()):
        try:
            template = Path(template).expanduser().read_text()
        except OSError as exc:
            raise error(f"--chat-template {args.chat_template!r}: cannot read it: {exc}") from exc
    if template is not None:
        _check_template(template, args.chat_template, error)
    elif args.model not in (None, BUILTIN_NAME) and not getattr(tokenizer, "chat_template", None):
        print(
            f"pagedcore serve: warning: {args.model!r} has no chat template: /v1/chat/completions writes the messages "
            "as plain 'role: content' lines (vLLM refuses such requests); give --chat-template FILE for the model's",
            file=sys.stderr,
        )
    return AppOptions(
        aliases=tuple(names[1:]),
        chat_template=template,
        trust_request_chat_template=args.trust_request_chat_template,
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        model_root=args.model or BUILTIN_NAME,
        response_role=args.response_role,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        auto_tool_choice=args.enable_auto_tool_choice is not False,
        reasoning_parser=args.reasoning_parser,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        sampling_defaults=sampling_defaults(args, error, None if args.model in (None, BUILTIN_NAME) else args.model),
        root_path=args.root_path,
        openapi=not args.disable_fastapi_docs,
        request_id_headers=args.enable_request_id_headers,
        request_log=RequestLog(args.max_log_len) if args.enable_log_requests else None,
        lora_parents=parents(getattr(args, "lora_modules", None)),
        runtime_lora_updating=runtime_lora_updating(),
    )


def flag_error(exc: Exception, error: type[Exception]) -> Exception:
    """``error`` (the usage error) for a :class:`~pagedcore.errors.ConfigError` of a setting a flag gives: the
    setting (its ``param``) named as the flag.

    Example:
        >>> from pagedcore.config import PoolConfig
        >>> from pagedcore.errors import ConfigError
        >>> try:
        ...     PoolConfig(kv_store_bytes="lots")
        ... except ConfigError as exc:
        ...     print(flag_error(exc, ValueError))
        --kv-store-bytes must be a size like 8MiB, 2GiB or 1000000, got 'lots'
    """
    param, message = getattr(exc, "param", None), str(exc)
    if param is None:
        return error(message)
    flag = param if param.startswith("--") else "--" + param.replace("_", "-")
    if message.startswith(param + " "):
        return error(flag + message[len(param) :])
    return error(f"{flag}: {message}")


def _check_template(template: str, given: str, error: type[Exception]) -> None:
    """A ``--chat-template`` Jinja cannot parse is the server's error, said at start-up (else every chat request
    would get a 400 blaming the client)."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)  # the environment apply_chat_template renders with (break, generation)
    except TemplateSyntaxError as exc:
        raise error(f"--chat-template {given!r} is not a Jinja template: {exc.message} (line {exc.lineno})") from None


def _model(args: argparse.Namespace, error: type[Exception]) -> tuple[Any, Any, str]:
    import torch

    from pagedcore.cli.devices import resolve_device

    from .startup import hub_options, load_tokenizer
    from .vllm_flags import DTYPES

    resolve_device(args.device)  # a CUDA build without a GPU: one line, not a traceback at model.to()
    dtype_name = DTYPES[args.dtype]
    dtype = "auto" if dtype_name == "auto" else getattr(torch, dtype_name)
    model: Any
    tokenizer: Any
    from pagedcore.cli.huge_pages import huge_pages
    from pagedcore.cli.malloc import tune_malloc
    from pagedcore.cli.threads import apply_threads

    # stated in the start-up line
    args.threads_note = "; ".join(
        (apply_threads(args.threads).describe(), tune_malloc().describe(), huge_pages().describe())
    )
    if args.seed is not None:  # requests without a seed draw theirs from Python's random
        import random

        random.seed(args.seed)
        torch.manual_seed(args.seed)
    if args.model in (None, BUILTIN_NAME):
        from pagedcore.adapters.transformers.builtin import BUILTIN_DESCRIPTION, builtin_model, builtin_tokenizer

        print(
            f"note: no --model given: serving the {BUILTIN_DESCRIPTION} as {BUILTIN_NAME!r}; its text is gibberish. "
            "Pass --model PATH for a real checkpoint.",
            file=sys.stderr,
        )
        model, tokenizer, name = builtin_model(), builtin_tokenizer(), BUILTIN_NAME
    else:
        from pagedcore.cli.common import load_model  # the `--model` loader of `pagedcore generate`

        hub = hub_options(args)
        another = args.tokenizer is not None or args.tokenizer_revision is not None  # loaded below instead
        model, tokenizer = load_model(
            args.model, dtype, trust_remote_code=args.trust_remote_code, tokenizer=not another, **hub
        )
        name = args.model
    if args.tokenizer is not None or args.tokenizer_revision is not None:
        tokenizer = load_tokenizer(args, error, None if args.model in (None, BUILTIN_NAME) else args.model)
    model.to(device=args.device)
    if dtype != "auto":
        model.to(dtype=dtype)
    return model, tokenizer, name


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _ignore(signum: int, frame: Any) -> None:
    """SIGTERM after uvicorn's own shutdown: nothing left to do but return."""
