"""``pagedcore serve --ray``: the Ray Serve application from the command line.

Connects to a Ray cluster (``--ray-address``; default: starts a local one), deploys N engine replicas behind the
OpenAI-compatible ingress (:func:`~pagedcore.serve.ray.deployment.build_app`) on Ray Serve's HTTP proxy at
``--host:--port``, and serves until Ctrl-C or SIGTERM, then shuts Serve (and a Ray it started) down.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .model_spec import ModelSpec

__all__ = ["replica_engine_kwargs", "run"]


def run(args: argparse.Namespace) -> int:
    """Serve with Ray until interrupted; returns the exit code. Bad arguments raise ``pagedcore.cli.common.UsageError``.

    Example:
        >>> run(argparse.Namespace(replicas=0))  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ...
        pagedcore.cli.common.UsageError: --replicas must be >= 1, got 0
    """
    from pagedcore.cli.common import EXIT_OK, EXIT_UNAVAILABLE, UsageError, missing_extra

    if args.replicas < 1:
        raise UsageError(f"--replicas must be >= 1, got {args.replicas}")
    if args.cpus_per_replica <= 0:
        raise UsageError(f"--cpus-per-replica must be > 0, got {args.cpus_per_replica}")
    from ..auth import api_keys_of

    if missing_extra("pagedcore serve --ray", "ray", ("ray", "ray.serve")):
        return EXIT_UNAVAILABLE
    from .deployment import build_app

    api_keys, key_source = api_keys_of(args, UsageError)
    spec = _model_spec(args)
    print(
        "pagedcore serve: with --ray the model's generation config is not applied yet: requests get OpenAI's "
        "default sampling values (as --generation-config vllm)",
        file=sys.stderr,
    )
    print(f"pagedcore serve: {key_source}", file=sys.stderr, flush=True)
    engine_kwargs = replica_engine_kwargs(args)
    app = build_app(
        spec,
        replicas=args.replicas,
        routing=args.routing,
        engine_kwargs=engine_kwargs,
        max_queue=args.max_queue,
        served_model_name=args.served_model_name,
        api_keys=api_keys,
        num_cpus_per_replica=args.cpus_per_replica,
    )
    _serve_until_stopped(app, args, args.served_model_name or spec.name)
    return EXIT_OK


def _model_spec(args: argparse.Namespace) -> ModelSpec:
    """The model the replicas load, its tokenizer and context length checked here, in one line, rather than in every
    replica."""
    from pagedcore.cli.common import UsageError

    from .model_spec import ModelSpec

    spec = ModelSpec(path=args.model, dtype=args.dtype, device=args.device, threads=args.threads)
    if args.model is None:
        from pagedcore.adapters.transformers.builtin import BUILTIN_DESCRIPTION

        print(
            f"note: no --model given: serving the {BUILTIN_DESCRIPTION} as {spec.name!r}; its text is gibberish. "
            "Pass --model PATH for a real checkpoint.",
            file=sys.stderr,
        )
    try:
        spec.load_tokenizer()
        spec.context_length()
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load model {spec.name!r}: {str(exc).strip().splitlines()[0]}") from exc
    return spec


def _serve_until_stopped(app: Any, args: argparse.Namespace, name: str) -> None:
    """Deploy ``app`` (starting Ray unless it runs), serve until SIGINT/SIGTERM, then shut Serve (and a Ray this
    started) down."""
    import ray
    from ray import serve

    from .deployment import deploy

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=args.ray_address, logging_level=args.log_level.upper(), log_to_driver=False)
    stop = threading.Event()
    in_main = threading.current_thread() is threading.main_thread()
    previous = (
        {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    )
    try:
        url = deploy(app, host=args.host, port=args.port)
        print(
            f"pagedcore serve: model {name!r} at {url}/v1 on {args.replicas} Ray Serve replicas "
            f"({args.routing} routing); Ctrl-C stops",
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        serve.shutdown()
        if started_ray:
            ray.shutdown()


def replica_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Each replica's Engine keyword arguments from the serve flags: the pool's (blocks, tiers below it, a
    recurrent-state model's state slots and snapshots), the scheduler's, and the decode mode as without ``--ray``
    (``--enforce-eager``, ``--compile``, ``--cuda-graphs``; :func:`~pagedcore.serve.startup.compile_mode`).

    Example:
        >>> flags = dict(num_blocks=64, memory_budget=None, block_size=16, max_num_seqs=8, max_num_batched_tokens=512)
        >>> replica_engine_kwargs(argparse.Namespace(**flags, cuda_graphs=True, compile=None))["compile"]
        'cudagraphs'
    """
    from ..startup import compile_mode

    return {
        "num_blocks": args.num_blocks,
        "memory_budget": args.memory_budget,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "compile": compile_mode(args),
        "kv_store": getattr(args, "kv_store", None),  # one directory shared by the replicas: each other's prefixes
        "kv_store_bytes": getattr(args, "kv_store_bytes", None),
        "state_slots": getattr(args, "state_slots", None),  # a recurrent-state model's pool, as without --ray
        "snapshot_interval": getattr(args, "snapshot_interval", None),
    }
