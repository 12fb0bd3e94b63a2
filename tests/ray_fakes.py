"""Stand-ins for Ray Serve's pieces, so the Ray code runs without a cluster: replicas and pending requests for the
router, a deployment handle (streams and broadcasts) for the ingress's ReplicaLoop."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from pagedcore.adapters.transformers import SamplingParams
from pagedcore.serve.loop import Finished, Submission
from pagedcore.serve.ray.replica import ReplicaReport
from pagedcore.serve.ray.routing import PrefixAffinityRouter, RoutedRequest, prefix_hashes

DEPLOYMENT = DeploymentID(name="PagedcoreEngine", app_name="test")


@dataclass(frozen=True)
class FakeReplica:
    replica_id: ReplicaID


@dataclass(frozen=True)
class FakeMetadata:
    internal_request_id: str


@dataclass
class FakePending:
    """A PendingRequest: its args; with ``metadata`` and ``future`` (made inside an event loop) as Ray's have."""

    args: list
    metadata: FakeMetadata | None = None
    future: Any = None


def make_router(names=("r0", "r1", "r2"), **kwargs) -> tuple[PrefixAffinityRouter, list[FakeReplica]]:
    router = PrefixAffinityRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**kwargs)
    return router, [FakeReplica(ReplicaID(name, DEPLOYMENT)) for name in names]


def routed(tokens: list[int], block_size: int = 4) -> RoutedRequest:
    return RoutedRequest(Submission(tokens, SamplingParams(max_new_tokens=1)), prefix_hashes(tokens, block_size))


def request(tokens: list[int]) -> FakePending:
    """A pending request without Ray's metadata (the router does not count it in flight)."""
    return FakePending([routed(tokens)])


def pending(tokens: list[int], request_id: str) -> FakePending:
    """A pending request as Ray routes it: an id and a future (call inside a running event loop)."""
    return FakePending([routed(tokens)], FakeMetadata(request_id), asyncio.get_running_loop().create_future())


class FakeStream:
    """A streaming DeploymentResponseGenerator: yields ``items`` (an exception item is raised)."""

    def __init__(self, items, block_after=False):
        self.items = list(items)
        self.block_after = block_after
        self.cancelled = False
        self.ended = False  # the caller read it to its end

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            if self.block_after:
                await asyncio.sleep(3600)
            self.ended = True
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        await asyncio.sleep(0)
        return item

    def cancel(self):
        self.cancelled = True


@dataclass
class FakeBroadcast:
    answers: list | BaseException

    async def results_async(self, *, timeout_s=None, return_exceptions=False):
        assert return_exceptions  # one replica's failure must not lose the others' answers
        if isinstance(self.answers, BaseException):
            raise self.answers
        return list(self.answers)


@dataclass
class FakeHandle:
    """``handle.options(stream=True).generate.remote(request)`` returns the next scripted stream;
    ``handle.broadcast("stats")`` answers with the next scripted poll (a list of reports and exceptions, or an
    exception the whole poll raises; none scripted: it times out, which leaves the figures as they were)."""

    streams: list = field(default_factory=list)
    polls: list = field(default_factory=list)
    requests: list[RoutedRequest] = field(default_factory=list)
    num_polls: int = 0

    def options(self, **kwargs):
        assert kwargs == {"stream": True}
        return self

    @property
    def generate(self):
        return self

    def remote(self, request: RoutedRequest):
        self.requests.append(request)
        return self.streams.pop(0)

    def broadcast(self, method: str) -> FakeBroadcast:
        assert method == "stats"
        self.num_polls += 1
        return FakeBroadcast(self.polls.pop(0) if self.polls else TimeoutError("no poll scripted"))


def finished(rid="x", prompt=3, tokens=(2,), cached=0):
    return Finished(rid, prompt, tokens, ("length",), cached_tokens=cached)


def report(name: str, stats, sequence: int) -> ReplicaReport:
    return ReplicaReport(name, stats, sequence)
