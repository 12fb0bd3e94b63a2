"""A schema-driven fuzz of the HTTP API: schemathesis generates requests from the server's own OpenAPI document
(bodies from the pydantic request models), valid ones and invalid ones, and sends them in-process (ASGI). No
answer may be a server error, every 4xx carries OpenAI's error body, every answer fits the document, and the server
is healthy afterwards with no block held.

The examples are derandomized and bounded (``FUZZ_EXAMPLES`` per mode) so the suite stays fast and repeatable; set
``PAGEDCORE_FUZZ_EXAMPLES`` (and ``PAGEDCORE_FUZZ_RANDOM=1``) to explore more.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("schemathesis")  # a test extra and the server: the GPU image has neither
pytest.importorskip("fastapi")

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode, checks

from pagedcore.adapters.transformers import Engine
from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer
from pagedcore.serve.app import create_app
from pagedcore.serve.body import BodyLimits
from pagedcore.serve.loop import EngineLoop

FUZZ_EXAMPLES = int(os.environ.get("PAGEDCORE_FUZZ_EXAMPLES", "60"))
RANDOM = os.environ.get("PAGEDCORE_FUZZ_RANDOM") == "1"
MODEL = "tiny"
CONTEXT = 48  # a short context bounds what any accepted request can cost

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def served(one_thread) -> Iterator[tuple[Any, Engine]]:
    model = builtin_model(hidden_size=32, intermediate_size=64, num_hidden_layers=1, max_position_embeddings=CONTEXT)
    engine = Engine(model, builtin_tokenizer(), num_blocks=64, block_size=8, max_num_seqs=8)
    loop = EngineLoop(engine, max_queue=64)
    app = create_app(loop, model_name=MODEL, limits=BodyLimits(max_bytes=64 * 1024, timeout=10.0))
    loop.start()
    try:
        yield app, engine
    finally:
        loop.stop()
        engine.close()
    assert engine.pool.kv.num_used_blocks == 0, "blocks leaked"
    engine.pool.check_invariants()


def check_answer(response: Any) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
        assert error["param"] is None or isinstance(error["param"], str)
        assert error["code"] is None or isinstance(error["code"], str)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_fuzzed_requests_get_no_server_error_and_well_formed_errors(served, mode):
    app, engine = served
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    strategies = [result.ok().as_strategy(generation_mode=mode) for result in schema.get_all_operations()]
    statuses: dict[int, int] = {}

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=not RANDOM,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=st.one_of(strategies), served_model=st.booleans())
    def fuzz(case: Any, served_model: bool) -> None:
        if served_model and isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = MODEL  # else nearly every generated request would only find an unknown model
        response = case.call()
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        check_answer(response)
        # The document cannot say everything the server refuses (the context, the vocabulary, sampling ranges),
        # so a schema-valid request may get a 400; every other check holds.
        case.validate_response(response, excluded_checks=[checks.not_a_server_error, checks.positive_data_acceptance])

    fuzz()
    assert sum(statuses.values()) >= FUZZ_EXAMPLES // 2, statuses
    health = schemathesis.openapi.from_asgi("/openapi.json", app)["/health"]["GET"].Case().call()
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert engine.pool.kv.num_used_blocks == 0
