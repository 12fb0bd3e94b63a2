"""``pagedcore.serve.ray``: pagedcore on more than one process or machine, with Ray (needs the ``ray`` extra).

Two paths:

- **Serving** (Ray Serve): :func:`build_app` binds N engine replicas (:class:`EngineReplica`, one Engine each)
  behind one OpenAI-compatible ingress (the single-process server's app over a :class:`ReplicaLoop`); requests are
  routed by prompt prefix (:class:`PrefixAffinityRouter`, a Ray Serve request router) so that requests sharing a
  prefix reach the replica that cached it, falling back to the least-loaded replica under imbalance. From the
  command line: ``pagedcore serve --ray --replicas N``.
- **Offline batches** (Ray Data): :class:`GenerateBatch`, a callable class for ``Dataset.map_batches`` that holds
  one Engine per worker.

Modules: ``model_spec.py`` (:class:`ModelSpec`: what each process loads), ``routing.py`` (prefix hashes, the
routers), ``in_flight.py`` (the router's count of the requests it assigned and has not seen complete),
``replica.py`` (:class:`EngineReplica`), ``replica_loop.py`` (:class:`ReplicaLoop`, the ingress side),
``replica_stats.py`` (the ingress's view of the replicas' statistics, for ``/metrics``), ``deployment.py``
(:func:`build_app`, :func:`deploy`), ``data.py`` (:class:`GenerateBatch`), ``command.py`` (``pagedcore serve
--ray``). Names are imported lazily: ``import pagedcore.serve.ray`` does not import Ray.

Example:
    >>> from pagedcore.serve.ray import ModelSpec
    >>> ModelSpec().name
    'pagedcore-builtin'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedcore.lazy_names import lazy_getattr

if TYPE_CHECKING:
    from .data import GenerateBatch
    from .deployment import build_app, deploy
    from .model_spec import ModelSpec
    from .replica import EngineReplica
    from .replica_loop import ReplicaLoop
    from .routing import PrefixAffinityRouter, RandomRouter

__all__ = [
    "EngineReplica",
    "GenerateBatch",
    "ModelSpec",
    "PrefixAffinityRouter",
    "RandomRouter",
    "ReplicaLoop",
    "build_app",
    "deploy",
]

_HOMES = {
    "EngineReplica": "replica",
    "GenerateBatch": "data",
    "ModelSpec": "model_spec",
    "PrefixAffinityRouter": "routing",
    "RandomRouter": "routing",
    "ReplicaLoop": "replica_loop",
    "build_app": "deployment",
    "deploy": "deployment",
}

__getattr__ = lazy_getattr(__name__, _HOMES)
