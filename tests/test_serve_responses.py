"""OpenAI's Responses API (``/v1/responses``) through the official openai client's ``responses.create``,
``responses.stream``, ``responses.parse``, ``retrieve`` and ``delete`` against the real server: text and item
input, instructions, the answer equal to the chat path's, streamed events as the client accumulates them, tools and
their results, ``text.format`` json_schema, ``previous_response_id`` kept per API key within a bound, every field
implemented or refused by name, and reasoning as a ``reasoning`` item."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

import httpx
import openai
import pydantic
from reasoning_helpers import ANSWER, REASONING, reasoning_model, reasoning_tokenizer
from structured_helpers import WEATHER_TOOL, bpe_tokenizer, random_model

from pagedcore.adapters.transformers import Engine
from pagedcore.serve.app import AppOptions, create_app
from pagedcore.serve.auth import ApiKeys
from pagedcore.serve.loop import EngineLoop
from pagedcore.serve.responses_api.request import FIELDS
from pagedcore.serve.server import BackgroundServer

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny"
TOKENIZER = bpe_tokenizer()
KEYS = {"sk-a": "alice", "sk-b": "bob"}
FUNCTION = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's flat form


@pytest.fixture(scope="module")
def url(one_thread) -> Iterator[str]:
    model = random_model(len(TOKENIZER))
    model.generation_config.eos_token_id = TOKENIZER.eos_token_id
    engine = Engine(model, TOKENIZER, num_blocks=512, block_size=8, max_num_seqs=16)
    loop = EngineLoop(engine)
    app = create_app(loop, model_name=MODEL, api_keys=ApiKeys(KEYS), context_length=2048)
    server = BackgroundServer(app, loop).start()
    try:
        yield server.url
    finally:
        server.stop()
        engine.close()
    assert engine.pool.kv.num_used_blocks == 0, "blocks leaked"


def client(url: str, key: str = "sk-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def chat_text(url: str, messages: list[dict], **kwargs) -> str:
    answer = client(url).chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)
    return answer.choices[0].message.content or ""


def test_a_text_input_is_answered_as_the_chat_path_answers_it(url):
    response = client(url).responses.create(
        model=MODEL, input="What is the weather?", instructions="Be brief.", max_output_tokens=12, temperature=0
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather?"}]
    assert response.output_text == chat_text(url, messages, max_tokens=12)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 12 and response.usage.input_tokens > 0
    assert response.id.startswith("resp_") and response.model == MODEL and response.instructions == "Be brief."


def test_the_answer_validates_as_the_clients_response_type_and_counts_cache_writes(url):
    """Regression: ``usage.input_tokens_details`` lacked ``cache_write_tokens``, which the openai client's
    ``Response`` type requires (its ``create`` builds the object without validating, so only a strict read showed
    it). A prompt's tokens are read from the prefix cache or computed and kept there: the two add up."""
    from openai.types.responses import Response

    body = {"model": MODEL, "input": "Count the cache writes " * 8, "max_output_tokens": 3, "temperature": 0}
    headers = {"Authorization": "Bearer sk-a"}
    first, second = (httpx.post(f"{url}/v1/responses", json=body, headers=headers, timeout=120) for _ in range(2))
    usages = [Response.model_validate(answer.json()).usage for answer in (first, second)]
    for usage in usages:
        assert usage is not None
        details = usage.input_tokens_details
        assert details.cached_tokens + details.cache_write_tokens == usage.input_tokens
    assert usages[0].input_tokens_details.cache_write_tokens > 0  # type: ignore[union-attr]
    assert usages[1].input_tokens_details.cached_tokens > 0  # type: ignore[union-attr]


def test_items_become_the_conversation(url):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
        {"role": "user", "content": "And now?"},
    ]
    response = client(url).responses.create(model=MODEL, input=items, max_output_tokens=8, temperature=0)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert response.output_text == chat_text(url, [*messages, {"role": "user", "content": "And now?"}], max_tokens=8)


def test_the_stream_accumulates_to_the_same_response(url):
    args = {"model": MODEL, "input": "Tell me", "max_output_tokens": 10, "temperature": 0}
    whole = client(url).responses.create(**args)
    with client(url).responses.stream(**args) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.status == whole.status
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 10
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.done"} <= set(kinds)


def test_tools_and_their_results(url):
    c = client(url)
    first = c.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[FUNCTION], tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=300, temperature=1.0, extra_body={"seed": 1},
    )  # fmt: skip
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
    follow = c.responses.create(
        model=MODEL, input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        previous_response_id=first.id, tools=[FUNCTION], tool_choice="none", max_output_tokens=5, temperature=0,
    )  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]  # fmt: skip
    tools = [WEATHER_TOOL]
    assert follow.output_text == chat_text(url, messages, max_tokens=5, tools=tools, tool_choice="none")


def test_a_streamed_tool_call(url):
    with client(url).responses.stream(
        model=MODEL, input="Weather?", tools=[FUNCTION], tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=300, temperature=1.0, extra_body={"seed": 2},
    ) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments)
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"


class Forecast(pydantic.BaseModel):
    city: str
    days: int


def test_text_format_json_schema_through_parse(url):
    parsed = client(url).responses.parse(
        model=MODEL, input="Forecast?", text_format=Forecast, max_output_tokens=200, temperature=1.0,
        extra_body={"seed": 3},
    )  # fmt: skip
    assert isinstance(parsed.output_parsed, Forecast)


def test_previous_response_id_is_kept_per_api_key_and_can_be_deleted(url):
    a, b = client(url, "sk-a"), client(url, "sk-b")
    first = a.responses.create(model=MODEL, input="One", max_output_tokens=4, temperature=0)
    assert a.responses.retrieve(first.id).output_text == first.output_text
    second = a.responses.create(
        model=MODEL, input="Two", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    messages = [{"role": "user", "content": "One"}, {"role": "assistant", "content": first.output_text}]
    assert second.output_text == chat_text(url, [*messages, {"role": "user", "content": "Two"}], max_tokens=4)
    with pytest.raises(openai.NotFoundError):  # another tenant's response is not found
        b.responses.create(model=MODEL, input="x", previous_response_id=first.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(first.id)
    a.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(first.id)
    unstored = a.responses.create(model=MODEL, input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("background", True),
        ("conversation", "conv_1"),
        ("reasoning", {"effort": "high"}),
        ("prompt", {"id": "pmpt_1"}),
        ("service_tier", "flex"),
        ("no_such_field", 1),
    ],
)
def test_unsupported_fields_are_refused_by_name(url, field, value):
    body = {"model": MODEL, "input": "x", field: value}
    answer = httpx.post(f"{url}/v1/responses", json=body, headers={"Authorization": "Bearer sk-a"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0.type"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "include": ["file_search_call.results"]}, "include"),
        ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}}}},
         "text.format"),
        ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": [{"type": "reasoning", "content": 5}, {"role": "user", "content": "x"}]}, "input.0"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input.0"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
        ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"input": "x", "text": {"verbosity": "high"}}, "text.verbosity"),
        ({"input": "x", "truncation": "sometimes"}, "truncation"),
        ({"input": []}, "input"),
        ({"input": "x", "stream_options": {"include_usage": True}}, "stream_options.include_usage"),
        ({"input": [{"role": "user", "content": "x", "name": "a"}]}, "input.0.name"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x", "x": 1}]}]},
         "input.0.content.0.x"),
        ({"input": [{"type": "reasoning", "encrypted_content": "gAAA"}, {"role": "user", "content": "x"}]},
         "input.0.encrypted_content"),
        ({"input": [{"role": "user", "content": "x", "status": "sleeping"}]}, "input.0.status"),
        ({"input": "x", "tools": [{**FUNCTION, "cache_control": {}}]}, "tools.0.cache_control"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "f", "x": 1}}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_object", "schema": {}}}}, "text.format.schema"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_responses_field(url, body, param):
    answer = httpx.post(f"{url}/v1/responses", json={"model": MODEL, **body}, headers={"Authorization": "Bearer sk-a"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def test_the_document_states_the_empty_input_400_and_the_unknown_id_404(url):
    """OpenAI refuses an empty input list, and so does this server: the schema says minItems 1; an id no response
    of this key has (one with a "/" too) is a 404 in OpenAI's error body, as the document lists it."""
    document = httpx.get(f"{url}/openapi.json", headers={"Authorization": "Bearer sk-a"}).json()
    request = document["components"]["schemas"]["ResponsesRequest"]["properties"]["input"]
    kinds, lists = [request], []
    while kinds:  # the array among the input's (nested, maybe nullable) kinds
        kind = kinds.pop()
        kinds.extend(kind.get("anyOf", ()))
        lists += [kind] if kind.get("type") == "array" else []
    assert lists and lists[0]["minItems"] == 1, request
    (path,) = [path for path in document["paths"] if path.startswith("/v1/responses/")]
    for method in ("get", "delete"):
        assert "404" in document["paths"][path][method]["responses"], method
        for response_id in ("resp_unknown", "resp_a/b"):
            answer = httpx.request(method, f"{url}/v1/responses/{response_id}",
                                   headers={"Authorization": "Bearer sk-a"})  # fmt: skip
            assert answer.status_code == 404 and answer.json()["error"]["type"], (method, response_id, answer.text)


def test_every_openai_parameter_is_implemented_or_refused():
    """The openai client's responses.create parameters are all in the field list (none passes unseen)."""
    import inspect

    from openai.resources.responses import Responses

    sent = set(inspect.signature(Responses.create).parameters) - {"self", "extra_headers", "extra_query",
                                                                   "extra_body", "timeout"}  # fmt: skip
    assert sent <= set(FIELDS), sorted(sent - set(FIELDS))


def test_logprobs_of_the_output_text(url):
    response = client(url).responses.create(
        model=MODEL, input="x", max_output_tokens=4, temperature=0, include=["message.output_text.logprobs"],
        top_logprobs=2,
    )  # fmt: skip
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == 4 and all(len(entry.top_logprobs) == 2 for entry in logprobs)


def test_reasoning_comes_back_as_a_reasoning_item(one_thread):
    tokenizer = reasoning_tokenizer()
    engine = Engine(reasoning_model(tokenizer), tokenizer, num_blocks=128, block_size=8)
    loop = EngineLoop(engine)
    app = create_app(loop, model_name=MODEL, options=AppOptions(reasoning_parser="qwen3"))
    server = BackgroundServer(app, loop).start()
    try:
        c = client(server.url)
        response = c.responses.create(model=MODEL, input="Is it?", max_output_tokens=20, temperature=0)
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == REASONING and response.output_text == ANSWER
        assert response.usage.output_tokens_details.reasoning_tokens == 4  # <think> h m </think>
        with c.responses.stream(model=MODEL, input="Is it?", max_output_tokens=20, temperature=0) as stream:
            deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
            final = stream.get_final_response()
        assert "".join(deltas) == REASONING and final.output_text == ANSWER
    finally:
        server.stop()
        engine.close()
