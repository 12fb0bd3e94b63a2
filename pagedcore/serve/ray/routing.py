"""Routing requests to engine replicas: by prompt prefix, through Ray Serve's request-router extension point.

The ingress hashes each prompt's full blocks as a chain (block ``i``'s hash covers blocks ``0..i`` and the tenant's
namespace: :func:`pagedcore.block_keys.prefix_hashes`, re-exported here) and sends them with the request
(:class:`RoutedRequest`). :class:`PrefixAffinityRouter`, a Ray Serve
``RequestRouter``, runs inside the ingress's deployment handle and remembers which replica it last sent each block
chain to; a request goes to the replica holding its longest remembered prefix, where that prefix is cached. A
prompt with no useful match (none, or under ``min_match_fraction`` of its blocks, such as a chat template's shared
header) goes to the replica that holds the fewest remembered blocks, so distinct prefixes spread evenly. Under
imbalance, a replica with more than ``imbalance_threshold`` requests over the least loaded one is not chosen for
affinity: its requests fall back to the least-loaded replica. A replica's load is what the router assigned to it
and has not seen complete (:class:`~pagedcore.serve.ray.in_flight.InFlight`, counted when it decides, so a burst
routed at once sees its own earlier decisions), or Ray Serve's queue-length figure for it where that is higher
(requests other routers sent). So a burst of one hot prefix splits with no replica more than
``imbalance_threshold + 1`` requests above another. :class:`RandomRouter` is the baseline that ignores prefixes.

The table is the router's memory of its own decisions (bounded, least recently used first out), not the replicas'
caches: it may remember a prefix a replica has evicted since (that request then recomputes it there). With several
ingress replicas each router learns on its own.
"""

from __future__ import annotations

import math
import random
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedcore.block_keys import prefix_hashes
from pagedcore.errors import ConfigError

from ..loop import Submission
from .in_flight import InFlight

__all__ = ["MAX_ROUTED_BLOCKS", "PrefixAffinityRouter", "RandomRouter", "RoutedRequest", "prefix_hashes"]

MAX_ROUTED_BLOCKS = 64  # a routing decision looks at most this many leading blocks


@dataclass(frozen=True)
class RoutedRequest:
    """What the ingress sends an engine replica: the loop request, and its prefix hashes for the router.

    Example:
        >>> from pagedcore.adapters.transformers import SamplingParams
        >>> request = RoutedRequest(Submission([5, 6, 7], SamplingParams(max_new_tokens=2)), (11, 12))
        >>> request.prefix_hashes
        (11, 12)
    """

    submission: Submission
    prefix_hashes: tuple[int, ...] = ()


def _request_id_of(pending_request: PendingRequest | None) -> str | None:
    metadata = getattr(pending_request, "metadata", None)
    request_id = getattr(metadata, "internal_request_id", None)
    return request_id if isinstance(request_id, str) else None


def _hashes_of(pending_request: PendingRequest | None) -> tuple[int, ...]:
    # By attribute, not isinstance: Ray Serve ships a router class to the handle's process pickled by value,
    # together with its module, so the RoutedRequest class the router sees is a copy of the one the ingress uses.
    if pending_request is None:
        return ()
    for arg in pending_request.args:
        hashes = getattr(arg, "prefix_hashes", None)
        if isinstance(hashes, tuple):
            return hashes
    return ()


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router: the replica that holds the longest routed prefix, else the one holding the fewest
    routed blocks; never a replica loaded over ``imbalance_threshold`` requests above the least loaded one (load:
    the requests this router assigned to it and has not seen complete, or Ray's queue-length figure if higher).

    Configure it on the engine deployment (``build_app`` does) with ``RequestRouterConfig(request_router_class=
    PrefixAffinityRouter, request_router_kwargs={...})``; the kwargs go to :meth:`initialize_state`.

    Example:
        >>> from ray.serve.config import RequestRouterConfig
        >>> config = RequestRouterConfig(request_router_class=PrefixAffinityRouter,
        ...                              request_router_kwargs={"imbalance_threshold": 4})
        >>> config.request_router_class
        'pagedcore.serve.ray.routing.PrefixAffinityRouter'
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.imbalance_threshold = 8
        self.min_match_fraction = 0.1
        self.max_entries = 1 << 16
        self._owners: OrderedDict[int, ReplicaID] = OrderedDict()  # block chain hash -> replica last sent it
        self._num_owned: Counter[ReplicaID] = Counter()
        self._in_flight = InFlight()

    def initialize_state(
        self,
        imbalance_threshold: int = 8,
        min_match_fraction: float = 0.1,
        max_entries: int = 1 << 16,
        **kwargs: Any,
    ) -> None:
        """Args:
        imbalance_threshold: requests a replica may have over the least-loaded one and still be chosen.
        min_match_fraction: the share of a prompt's routed blocks a match must cover to count.
        max_entries: block chains remembered (least recently used forgotten first).
        """
        if isinstance(imbalance_threshold, bool) or not isinstance(imbalance_threshold, int) or imbalance_threshold < 0:
            raise ConfigError(f"imbalance_threshold must be an integer >= 0, got {imbalance_threshold!r}")
        if not 0.0 <= min_match_fraction <= 1.0:
            raise ConfigError(f"min_match_fraction must be in [0, 1], got {min_match_fraction!r}")
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ConfigError(f"max_entries must be an integer >= 1, got {max_entries!r}")
        self.imbalance_threshold = imbalance_threshold
        self.min_match_fraction = min_match_fraction
        self.max_entries = max_entries

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Ranks of replicas: the chosen one first, then the others from least to most loaded."""
        if not candidate_replicas:
            return []
        request_id = _request_id_of(pending_request)
        loads = {r.replica_id: self._load(r.replica_id, request_id) for r in candidate_replicas}
        least = min(loads.values())
        eligible = [r for r in candidate_replicas if loads[r.replica_id] <= least + self.imbalance_threshold]
        hashes = _hashes_of(pending_request)
        chosen = self._owner_of(hashes, eligible)
        if chosen is None:
            chosen = min(eligible, key=lambda r: (self._num_owned[r.replica_id], loads[r.replica_id], random.random()))
        self._remember(hashes, chosen.replica_id)
        if request_id is not None:  # counts from now: the next decision of the same burst sees it
            self._in_flight.assign(request_id, chosen.replica_id, getattr(pending_request, "future", None))
        others = sorted((r for r in candidate_replicas if r is not chosen), key=lambda r: loads[r.replica_id])
        return [[chosen], others] if others else [[chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Remember where the request went (a fallback rank may differ from the choice)."""
        self._remember(_hashes_of(pending_request), replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The request ended on the replica (finished, failed or cancelled): it no longer counts as its load."""
        super().on_request_completed(replica_id, internal_request_id)
        self._in_flight.complete(internal_request_id, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Forget a dead replica's counts; its table entries are ignored and overwritten."""
        super().on_replica_actor_died(replica_id)
        self._num_owned.pop(replica_id, None)
        self._in_flight.forget_replica(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray Serve's replica set update; counts of replicas that left are dropped."""
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for replica_id in [r for r in self._num_owned if r not in live]:
            del self._num_owned[replica_id]
        self._in_flight.retain_replicas(live.__contains__)

    def _load(self, replica_id: ReplicaID, routing: str | None) -> int:
        # Not counting the request being routed, when this is a re-ranking of its attempt.
        cached = self.replica_queue_len_cache.get(replica_id) or 0
        return max(self._in_flight.load(replica_id, excluding=routing), cached)

    def _owner_of(self, hashes: tuple[int, ...], eligible: list[RunningReplica]) -> RunningReplica | None:
        by_id = {r.replica_id: r for r in eligible}
        needed = max(1, math.ceil(self.min_match_fraction * len(hashes)))
        for depth in range(len(hashes), needed - 1, -1):
            owner = self._owners.get(hashes[depth - 1])
            if owner is not None and owner in by_id:
                return by_id[owner]
        return None

    def _remember(self, hashes: tuple[int, ...], replica_id: ReplicaID) -> None:
        owners, owned = self._owners, self._num_owned
        for value in hashes:
            self._disown(owners.pop(value, None))
            owners[value] = replica_id
            owned[replica_id] += 1
        while len(owners) > self.max_entries:
            self._disown(owners.popitem(last=False)[1])

    def _disown(self, replica_id: ReplicaID | None) -> None:
        if replica_id is not None and replica_id in self._num_owned:  # one that left has no count any more
            self._num_owned[replica_id] -= 1


class RandomRouter(RequestRouter):
    """Ray Serve request router that sends each request to a replica drawn uniformly at random (the baseline that
    prefix routing is measured against).

    Example:
        >>> from ray.serve.config import RequestRouterConfig
        >>> RequestRouterConfig(request_router_class=RandomRouter).request_router_class
        'pagedcore.serve.ray.routing.RandomRouter'
    """

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """One rank: one replica drawn at random."""
        return [[random.choice(candidate_replicas)]] if candidate_replicas else []
