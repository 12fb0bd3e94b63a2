"""A schema-driven fuzz of the HTTP API: schemathesis generates requests from the server's own OpenAPI document
(bodies from the pydantic request models, tightened with this app's facts and rules), valid ones and invalid ones,
and sends them in-process (ASGI). Strict: no answer may be a server error; every request the document calls valid
is accepted (200) and every invalid one refused with OpenAI's error body; every answer fits the document; the server
is healthy afterwards with no block held.

"Valid" is the document's: its schemas, the languages its ``format`` names (regexes, grammars and JSON schemas
llguidance takes, generated here) and the rules it states in ``x-pagedcore-rules`` that JSON Schema cannot
(checked here as a client would, with ``POST /tokenize`` for the token counts).

Ids only the server can know (``GET`` / ``DELETE /v1/responses/{response_id}``, ``previous_response_id``) are
made as a client makes them: a positive case first creates a response and uses its id (the document links the
POST's answer to both operations by its ``id``), so it must be answered 200, and a ``DELETE`` must leave the id
unknown (404) after it; a negative case sends what was generated, and an unknown id is the documented 404.

The examples are derandomized and bounded (``FUZZ_EXAMPLES`` per mode) so the suite stays fast and repeatable; set
``PAGEDCORE_FUZZ_EXAMPLES`` (and ``PAGEDCORE_FUZZ_RANDOM=1``) to explore more.

An endpoint's author keeps this fuzz passing by making the document say what the server enforces
(docs/development.md, "A new endpoint in /openapi.json"): the body's model in ``REQUEST_MODELS`` and ``json_body``
on the route, every field implemented or refused at its no-op values (``additionalProperties: false``), bounds
and one-ofs tightened with this app's facts, every status it answers in ``responses=`` with OpenAI's error body,
the rules JSON Schema cannot state in ``x-pagedcore-rules`` and checked below as a client would, and values only
the server can know (ids, names of loaded things) made here before a positive case (``SERVER_MADE``).
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
from schemathesis.core import NotSet

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


def follows_the_rules(case: Any, call: Any, max_chars: int, history: list[dict[str, Any]] | None = None) -> bool:
    """Whether a generated request keeps the rules the document states beside its schemas (``x-pagedcore-rules``),
    checked as a client would: ``call(path, body)`` posts to the app (``/tokenize`` and ``/detokenize``);
    ``history``: the chat messages of the response a Responses request continues."""
    body = case.body if isinstance(case.body, dict) else {}
    if case.path == "/v1/responses":
        return _responses_rules(body, call, max_chars, history or [])
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


def _responses_rules(body: dict[str, Any], call: Any, max_chars: int, history: list[dict[str, Any]]) -> bool:
    """``POST /v1/responses``'s rules: its input as the chat messages the document says it stands for."""
    system = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") is not None else []
    messages = [*system, *history, *_input_messages(body["input"])]
    if sum(len(m.get("content") or "") for m in messages) > max_chars:
        return False
    tools, choice = body.get("tools") or [], body.get("tool_choice")
    names = [tool["name"] for tool in tools]
    if len(names) != len(set(names)) or (choice not in (None, "none") and not names):
        return False
    if isinstance(choice, dict) and choice["name"] not in names:
        return False
    text_format = (body.get("text") or {}).get("format") or {}
    constrained = text_format.get("type") in ("json_object", "json_schema")
    forced = bool(tools) and (choice == "required" or isinstance(choice, dict))
    if (constrained and forced) or ((constrained or forced) and body.get("ignore_eos")):
        return False
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    counted = call("/tokenize", {"messages": messages, **({"tools": chat_tools} if tools else {})})
    if counted.status_code != 200:  # nothing to count: the server must serve it or the document must refuse it
        return True
    count, wanted = counted.json()["count"], body.get("max_output_tokens")
    if body.get("truncation") == "auto":
        count = min(count, max(1, CONTEXT - (wanted or 1)))
    return count + (1 if wanted is None else wanted) <= CONTEXT


def _input_messages(value: Any) -> list[dict[str, Any]]:
    """The chat messages a Responses ``input`` stands for (the document's mapping, as a client reads it)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    thought = None
    for item in value:
        kind = item.get("type", "message")
        if kind == "reasoning":
            parts = [*(item.get("content") or []), *(item.get("summary") or [])]
            thought = (thought or "") + "".join(part["text"] for part in parts)
            continue
        if kind == "message":
            message = {"role": item["role"], "content": _joined(item["content"])}
        elif kind == "function_call_output":
            message = {"role": "tool", "content": _joined(item["output"]), "tool_call_id": item["call_id"]}
        else:
            function = {"name": item["name"], "arguments": item.get("arguments", "{}")}
            called = {"id": item["call_id"], "type": "function", "function": function}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(called)  # one more call of the same turn
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [called]}
        if thought is not None and message["role"] == "assistant":
            message["reasoning_content"], thought = thought, None
        messages.append(message)
    return messages


def _joined(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part["refusal"] if part["type"] == "refusal" else part["text"] for part in content)


def new_response(call: Any) -> tuple[str, list[dict[str, Any]]]:
    """A response the server answered and keeps: its id, and the chat messages a follow-up continues."""
    answer = call("/v1/responses", {"input": "Hi", "max_output_tokens": 1, "ignore_eos": True, "temperature": 0})
    assert answer.status_code == 200, answer.text
    created = answer.json()
    text = "".join(part["text"] for item in created["output"] if item["type"] == "message" for part in item["content"])
    return created["id"], [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": text}]


def server_made(case: Any, call: Any) -> list[dict[str, Any]]:
    """Put the ids only the server can know into a positive case (``SERVER_MADE``), as a client gets them; the chat
    messages of the response a Responses request continues (none when it continues none)."""
    history: list[dict[str, Any]] = []
    for (path, location, name), make in SERVER_MADE.items():
        if case.path != path:
            continue
        if location == "path":
            case.path_parameters = {**case.path_parameters, name: make(call)[0]}
        elif isinstance(case.body, dict) and case.body.get(name) is not None:
            case.body[name], history = make(call)
    return history


SERVER_MADE = {
    ("/v1/responses/{response_id}", "path", "response_id"): new_response,
    ("/v1/responses", "body", "previous_response_id"): new_response,
}
"""Values a positive case cannot generate: (path, where, name) -> what makes one (its value, its chat history)."""


def shown(case: Any) -> str:
    """A request as the failure message shows it (a case may have no body)."""
    body = "" if isinstance(case.body, NotSet) else json.dumps(case.body, default=repr)[:600]
    return f"{case.method} {case.formatted_path} {body}".strip()


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
            history = server_made(case, call)
            assume(follows_the_rules(case, call, max_chars, history))
        response = case.call()
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        check_answer(response)
        if mode == GenerationMode.POSITIVE:  # what the document calls valid is served
            assert response.status_code < 400, (shown(case), response.text[:300])
            if (case.method, case.path) == ("DELETE", "/v1/responses/{response_id}"):  # and what it deleted is gone
                gone = schema[case.path]["GET"].Case(path_parameters=case.path_parameters).call()
                assert gone.status_code == 404, (shown(case), gone.text[:300])
        case.validate_response(response)

    fuzz()
    assert sum(statuses.values()) >= FUZZ_EXAMPLES // 2, statuses
    health = schemathesis.openapi.from_asgi("/openapi.json", app)["/health"]["GET"].Case().call()
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert engine.pool.kv.num_used_blocks == 0
