"""What a client sees when an engine replica fails (issue 17.12): the ingress's app over a ReplicaLoop whose replica
dies mid-request with Ray's real error, which names the actor id, pid, actor name, namespace and node address.
Clients get a generic message and their request id, streamed or not; the server log gets the details."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

pytest.importorskip("ray.serve")

from ray.core.generated.common_pb2 import ActorDiedErrorContext
from ray.exceptions import ActorDiedError
from ray_fakes import FakeHandle, FakeStream

from pagedcore.serve.app import create_app
from pagedcore.serve.loop import Delta, Started
from pagedcore.serve.ray.replica_loop import ReplicaLoop

INTERNALS = {
    "actor id": "ab" * 16,
    "pid": "4242",
    "actor name": "SERVE_REPLICA::pagedcore#PagedcoreEngine#x1y2z3",
    "namespace": "serve-namespace-7",
    "node address": "10.1.2.3",
    "class": "ServeReplica:pagedcore:PagedcoreEngine",
}


def actor_died() -> ActorDiedError:
    return ActorDiedError(
        ActorDiedErrorContext(
            class_name=INTERNALS["class"],
            actor_id=bytes.fromhex(INTERNALS["actor id"]),
            pid=int(INTERNALS["pid"]),
            name=INTERNALS["actor name"],
            ray_namespace=INTERNALS["namespace"],
            node_ip_address=INTERNALS["node address"],
            error_message="The actor is dead because it was killed by `ray.kill`.",
        )
    )


class Crash(Exception):
    """An unexpected error out of Ray, as RayTaskError prints: with the worker's pid and address."""


def post(streams: list, body: dict, **loop_options) -> httpx.Response:
    loop = ReplicaLoop(FakeHandle(streams), None, block_size=4, stats_interval=None, **loop_options)
    app = create_app(loop, model_name="m")

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            return await client.post("/v1/completions", json=body, timeout=30)

    return asyncio.run(go())


def assert_hidden(text: str, caplog) -> None:
    for what, value in INTERNALS.items():
        assert value not in text, f"the client saw the replica's {what}: {text}"
    assert "req-0" in text and "server log" in text
    logged = caplog.text  # the records with their tracebacks
    assert "req-0" in logged
    for what in ("actor id", "pid", "actor name", "namespace", "node address"):
        assert INTERNALS[what] in logged, f"the server log lacks the replica's {what}"


BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}


def test_a_replica_that_dies_mid_stream_sends_the_client_a_generic_error_event(caplog):
    caplog.set_level(logging.WARNING, logger="pagedcore.serve.ray")
    streams = [FakeStream([Started("r"), Delta("r", 0, "ab"), actor_died()])]
    response = post(streams, {**BODY, "stream": True})
    assert response.status_code == 200
    events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    error = json.loads(events[-2])["error"]
    assert events[-1] == "[DONE]" and error["type"] == "server_error"
    assert error["message"].startswith("the engine replica serving request req-0 failed")
    assert_hidden(response.text, caplog)


def test_a_replica_that_dies_before_answering_gives_a_generic_500(caplog):
    caplog.set_level(logging.WARNING, logger="pagedcore.serve.ray")
    response = post([FakeStream([Started("r"), actor_died()])], BODY, attempts=1)
    assert response.status_code == 500
    assert response.json()["error"]["message"].startswith("the engine replica serving request req-0 failed")
    assert_hidden(response.text, caplog)


def test_an_unexpected_error_in_the_ingress_is_logged_not_shown(caplog):
    caplog.set_level(logging.WARNING, logger="pagedcore.serve.ray")
    crash = Crash(
        f"ray::{INTERNALS['class']}.generate() (pid={INTERNALS['pid']}, ip={INTERNALS['node address']}, "
        f"actor_id={INTERNALS['actor id']}, repr={INTERNALS['actor name']}) in namespace {INTERNALS['namespace']}"
    )
    response = post([FakeStream([Started("r"), crash])], BODY)
    assert response.status_code == 500
    assert response.json()["error"]["message"].startswith("request req-0 failed in the server")
    assert_hidden(response.text, caplog)
