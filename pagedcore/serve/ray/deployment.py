"""The Ray Serve application: N engine replicas behind one OpenAI-compatible ingress.

``build_app`` binds two deployments: ``PagedcoreEngine`` (:class:`~pagedcore.serve.ray.replica.EngineReplica`, N
replicas, routed by :class:`~pagedcore.serve.ray.routing.PrefixAffinityRouter` or
:class:`~pagedcore.serve.ray.routing.RandomRouter`) and ``PagedcoreIngress``, which runs the single-process
server's FastAPI app (:func:`~pagedcore.serve.app.create_app`) over a
:class:`~pagedcore.serve.ray.replica_loop.ReplicaLoop`. Ray Serve's HTTP proxy forwards every request to the
ingress. ``deploy`` runs it on the connected cluster with ``serve.run``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from pagedcore.errors import ConfigError

from ..auth import ApiKeys
from .model_spec import ModelSpec
from .replica import EngineReplica
from .routing import PrefixAffinityRouter, RandomRouter

__all__ = ["ENGINE_DEPLOYMENT", "INGRESS_DEPLOYMENT", "ROUTERS", "build_app", "deploy"]

ENGINE_DEPLOYMENT = "PagedcoreEngine"
INGRESS_DEPLOYMENT = "PagedcoreIngress"
ROUTERS: dict[str, type] = {"prefix": PrefixAffinityRouter, "random": RandomRouter}


def build_app(
    model: ModelSpec | None = None,
    *,
    replicas: int = 2,
    routing: str = "prefix",
    engine_kwargs: dict[str, Any] | None = None,
    max_queue: int = 512,
    served_model_name: str | None = None,
    api_keys: ApiKeys | None = None,
    num_cpus_per_replica: float = 1.0,
    router_kwargs: dict[str, Any] | None = None,
    attempts: int = 3,
    stall_timeout: float = 600.0,
) -> Any:
    """The Ray Serve application (``serve.run(build_app(...))``), not yet running.

    Args:
        model: what each replica loads (default: the built-in model).
        replicas: engine replicas (each holds one Engine and its KV pool).
        routing: ``"prefix"`` (:class:`~pagedcore.serve.ray.routing.PrefixAffinityRouter`) or ``"random"``.
        engine_kwargs: keyword arguments of each replica's :class:`~pagedcore.adapters.transformers.Engine`.
        max_queue: waiting requests per replica (and in the ingress, times ``replicas``) before 429.
        served_model_name: the ``model`` clients name (default: the model's path or ``pagedcore-builtin``).
        api_keys: tenants, as for ``pagedcore serve --api-keys``.
        num_cpus_per_replica: Ray CPUs each engine replica reserves (the ingress reserves none).
        router_kwargs: options of the prefix router (``imbalance_threshold``, ``min_match_fraction``,
            ``max_entries``).
        attempts / stall_timeout: see :class:`~pagedcore.serve.ray.replica_loop.ReplicaLoop`.

    Example:
        >>> app = build_app(ModelSpec(), replicas=3, engine_kwargs={"num_blocks": 256})
        >>> type(app).__name__
        'Application'
    """
    model = model or ModelSpec()
    _check_options(routing, replicas, max_queue)
    engine_kwargs = _with_block_size(model, engine_kwargs)
    block_size = int(engine_kwargs["block_size"])
    # The engine batches whatever it holds: Ray Serve must not cap a replica below what its loop queues.
    max_ongoing = int(engine_kwargs.get("max_num_seqs", 64)) + max_queue
    engine = _engine_deployment(replicas, routing, router_kwargs, max_ongoing, num_cpus_per_replica)
    ingress = _ingress_deployment(
        _ingress_builder(
            model,
            served_model_name or model.name,
            api_keys,
            block_size=block_size,
            max_queue=max_queue * replicas,
            attempts=attempts,
            stall_timeout=stall_timeout,
        ),
        max_queue * replicas,
    )
    # The engine deployment is bound as an argument so that it is part of the application; the ingress reaches it
    # by name (its app builder takes no arguments).
    return ingress.bind(engine.bind(model, engine_kwargs, max_queue))


def _engine_deployment(
    replicas: int, routing: str, router_kwargs: dict[str, Any] | None, max_ongoing: int, num_cpus: float
) -> Any:
    """The engine replicas' deployment behind the ``routing`` request router."""
    options: dict[str, Any] = {  # Ray's type hints say a dict where a class is accepted
        "request_router_class": ROUTERS[routing],
        "request_router_kwargs": dict(router_kwargs or {}) if routing == "prefix" else {},
    }
    router = RequestRouterConfig(**options)
    return serve.deployment(
        name=ENGINE_DEPLOYMENT,
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing,
        request_router_config=router,
        ray_actor_options={"num_cpus": num_cpus},
    )(EngineReplica)


def _ingress_deployment(builder: Any, max_queue: int) -> Any:
    """The ingress deployment of the FastAPI app ``builder`` builds: no CPUs reserved, and a cap on ongoing requests
    above what its queue holds (the queue answers 429 first)."""
    return serve.deployment(
        name=INGRESS_DEPLOYMENT, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=max_queue + 64
    )(serve.ingress(builder)())


def _check_options(routing: str, replicas: object, max_queue: object) -> None:
    """Raise :class:`~pagedcore.errors.ConfigError` naming the first bad option of :func:`build_app`."""
    if routing not in ROUTERS:
        raise ConfigError(f"routing must be one of {sorted(ROUTERS)}, got {routing!r}")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"replicas must be an integer >= 1, got {replicas!r}")
    if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
        raise ConfigError(f"max_queue must be an integer >= 0, got {max_queue!r}")


def _with_block_size(model: ModelSpec, engine_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of ``engine_kwargs`` that names the block size: the ingress routes by whole blocks, so every replica
    and the ingress use one block size (the device's and backend's default unless given)."""
    from pagedcore.attention import default_block_size

    kwargs = dict(engine_kwargs or {})
    if kwargs.get("block_size") is None:
        kwargs["block_size"] = default_block_size(model.device, kwargs.get("attention_backend"))
    return kwargs


def deploy(
    app: Any, *, name: str = "pagedcore", route_prefix: str = "/", host: str = "127.0.0.1", port: int = 8000
) -> str:
    """Run ``app`` (from :func:`build_app`) on the connected Ray cluster (``ray.init`` first) and return its base URL
    (``{url}/v1`` is the OpenAI API). Starts Ray Serve's HTTP proxy on ``host:port`` unless Serve runs already,
    in which case its proxy keeps the address it was started with.

    Example:
        >>> deploy  # doctest: +ELLIPSIS
        <function deploy at ...>
    """
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=name, route_prefix=route_prefix, blocking=False)
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}{route_prefix.rstrip('/')}"


def _ingress_builder(
    model: ModelSpec,
    model_name: str,
    api_keys: ApiKeys | None,
    *,
    block_size: int,
    max_queue: int,
    attempts: int,
    stall_timeout: float,
) -> Callable[[], Any]:
    def build() -> Any:  # runs in the ingress replica when it starts
        from ..app import create_app
        from .replica_loop import ReplicaLoop

        handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=serve.get_replica_context().app_name)
        tokenizer = model.load_tokenizer()
        options: dict[str, Any] = {"max_queue": max_queue, "attempts": attempts, "stall_timeout": stall_timeout}
        loop = ReplicaLoop(handle, tokenizer, block_size=block_size, **options)
        return create_app(
            loop, model_name=model_name, api_keys=api_keys, tokenizer=tokenizer, context_length=model.context_length()
        )

    return build
