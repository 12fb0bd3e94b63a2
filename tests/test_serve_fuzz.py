"""A schema-driven fuzz of the HTTP API: schemathesis generates requests from the server's own OpenAPI document
(bodies from the pydantic request models, tightened with this app's facts and rules), valid ones and invalid ones,
and sends them in-process (ASGI). Strict: no answer may be a server error; every request the document calls valid
is accepted (200) and every invalid one refused with OpenAI's error body; every answer fits the document; the server
is healthy afterwards with no block held.

"Valid" is the document's: its schemas, the languages its ``format`` names (regexes, grammars and JSON schemas
llguidance takes, generated here) and the rules it states in ``x-pagedcore-rules`` that JSON Schema cannot
(checked here as a client would, with ``POST /tokenize`` for the token counts).

The examples are derandomized and bounded (``FUZZ_EXAMPLES`` per mode) so the suite stays fast and repeatable; set
``PAGEDCORE_FUZZ_EXAMPLES`` (and ``PAGEDCORE_FUZZ_RANDOM=1``) to explore more.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("schemathesis")  # a test extra and the server: the GPU image has neither
pytest.importorskip("fastapi")

import schemathesis
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from pagedcore.adapters.transformers import Engine
from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer
from pagedcore.serve.app import create_app
from pagedcore.serve.body import BodyLimits
from pagedcore.serve.loop import EngineLoop
from pagedcore.serve.structured import STRUCTURED_FIELDS

# The languages the document's formats name: valid programs of each.
schemathesis.openapi.format("llguidance-regex", st.sampled_from(["[0-9]+", "(yes|no)", "a{1,3}", "[a-z]+ [a-z]+"]))
schemathesis.openapi.format("llguidance-grammar", st.sampled_from(['start: "a" | "b"', 'root ::= "x" [0-9]']))
schemathesis.openapi.format(
    "json-schema",
    st.sampled_from(['{"type": "integer"}', '{"type": "object", "properties": {"a": {"type": "string"}}}']),
)

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


def follows_the_rules(case: Any, call: Any, max_chars: int) -> bool:
    """Whether a generated request keeps the rules the document states beside its schemas (``x-pagedcore-rules``),
    checked as a client would: ``call(path, body)`` posts to the app (``/tokenize`` and ``/detokenize``)."""
    body = case.body if isinstance(case.body, dict) else {}
    chat = case.path == "/v1/chat/completions"
    messages = body.get("messages") or [] if case.path in ("/tokenize", "/v1/chat/completions") else []
    if sum(len(_text(m.get("content"))) for m in messages) > max_chars:
        return False
    if case.path not in ("/v1/completions", "/v1/chat/completions"):
        return True
    if not all(_spellable(option, call) for option in _choices(body)):
        return False
    constrained = [name for name in STRUCTURED_FIELDS if body.get(name) is not None]
    choice = body.get("tool_choice")
    forced = chat and body.get("tools") and (choice == "required" or isinstance(choice, dict))
    if len(constrained) + bool(forced) > 1:
        return False
    if (constrained or forced) and any(body.get(k) for k in ("ignore_eos", "min_tokens", "allowed_token_ids")):
        return False
    default = None if chat else 16
    max_tokens = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), default)
    if body.get("min_tokens") and max_tokens is not None and body["min_tokens"] > max_tokens:
        return False
    if chat and not _chat_rules(body, choice):
        return False
    return all(count + (1 if max_tokens is None else max_tokens) <= CONTEXT for count in _counts(body, chat, call))


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content)
    return content or ""


def _choices(body: dict[str, Any]) -> list[str]:
    structured = body.get("structured_outputs")
    nested = structured.get("choice") if isinstance(structured, dict) else None
    return [*(body.get("guided_choice") or []), *(nested or [])]


def _spellable(text: str, call: Any) -> bool:
    ids = call("/tokenize", {"prompt": text, "add_special_tokens": False}).json().get("tokens")
    return ids is not None and call("/detokenize", {"tokens": ids}).json().get("prompt") == text


def _chat_rules(body: dict[str, Any], choice: Any) -> bool:
    if body.get("top_logprobs") and not body.get("logprobs"):
        return False
    if body.get("continue_final_message") and body.get("add_generation_prompt") is not False:
        return False
    names = [tool["function"]["name"] for tool in body.get("tools") or []]
    if len(names) != len(set(names)) or (choice not in (None, "none") and not names):
        return False
    return not isinstance(choice, dict) or choice["function"]["name"] in names


def _counts(body: dict[str, Any], chat: bool, call: Any) -> list[int]:
    """Each prompt's tokens, as ``POST /tokenize`` counts them (after ``truncate_prompt_tokens``)."""
    keep = body.get("truncate_prompt_tokens")
    keep = CONTEXT if keep == -1 else keep
    if chat:
        keys = ("add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs")
        options = {k: body[k] for k in keys if body.get(k) is not None}
        counted = [call("/tokenize", {"messages": body["messages"], **options}).json().get("count", CONTEXT + 1)]
    else:
        prompt = body["prompt"]
        prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
        special = {} if body.get("add_special_tokens") is None else {"add_special_tokens": body["add_special_tokens"]}
        counted = [
            len(p)
            if isinstance(p, list)
            else call("/tokenize", {"prompt": p, **special}).json().get("count", CONTEXT + 1)
            for p in prompts
        ]
    return [min(n, keep) if keep is not None else n for n in counted]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_fuzzed_requests_get_no_server_error_and_well_formed_errors(served, mode):
    app, engine = served
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    strategies = [result.ok().as_strategy(generation_mode=mode) for result in schema.get_all_operations()]
    statuses: dict[int, int] = {}

    prompt = schema.raw_schema["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    max_chars = prompt["anyOf"][0]["maxLength"]  # the document's bound on a text prompt

    def call(path: str, body: dict[str, Any]) -> Any:
        return schema[path]["POST"].Case(body=body).call()

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=not RANDOM,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=st.one_of(strategies))
    def fuzz(case: Any) -> None:
        if mode == GenerationMode.POSITIVE:
            assume(follows_the_rules(case, call, max_chars))
        response = case.call()
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        check_answer(response)
        if mode == GenerationMode.POSITIVE:  # what the document calls valid is served
            assert response.status_code < 400, (case.path, json.dumps(case.body)[:600], response.text[:300])
        case.validate_response(response)

    fuzz()
    assert sum(statuses.values()) >= FUZZ_EXAMPLES // 2, statuses
    health = schemathesis.openapi.from_asgi("/openapi.json", app)["/health"]["GET"].Case().call()
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert engine.pool.kv.num_used_blocks == 0
