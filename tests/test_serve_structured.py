"""Structured outputs and tool calls through `pagedcore serve` and the official openai client: response_format
json_object / json_schema (nested objects, arrays, enums, required fields, bounded numbers, patterned strings),
vLLM's guided fields, bad schemas as 400s naming the field, tools with tool_choice required / named / auto, tool
results in the history; streamed and not. Every answer that claims a format is validated with jsonschema. Model:
a tiny Llama with random weights over a byte-level BPE with a Hermes-style chat template (an adversarial
generator: only the masks make its output valid)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

import jsonschema
import openai
from structured_helpers import SCHEMA, TIME_TOOL, WEATHER_TOOL, bpe_tokenizer, random_model

from pagedcore.adapters.transformers import Engine
from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer
from pagedcore.serve.answers import Shape
from pagedcore.serve.app import create_app
from pagedcore.serve.loop import EngineLoop
from pagedcore.serve.server import BackgroundServer
from pagedcore.serve.tool_calls import ToolCalls

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny"
TOKENIZER = bpe_tokenizer()
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
UNIQUE = {"type": "array", "uniqueItems": True}
NO_SUCH_TOOL = {"type": "function", "function": {"name": "nope"}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c", "days": 2}}'


@pytest.fixture(scope="module")
def served(one_thread) -> Iterator[tuple[openai.OpenAI, Engine]]:
    model = random_model(len(TOKENIZER))
    model.generation_config.eos_token_id = TOKENIZER.eos_token_id
    engine = Engine(model, TOKENIZER, num_blocks=512, block_size=8, max_num_seqs=32)
    yield from serving(engine, context_length=2048)
    engine.pool.check_invariants()


def serving(engine: Engine, **app: Any) -> Iterator[tuple[openai.OpenAI, Engine]]:
    """A fixture's body: ``engine`` served in the background to an ``openai`` client until the module's tests end,
    then closed, with no block left held."""
    loop = EngineLoop(engine)
    server = BackgroundServer(create_app(loop, model_name=MODEL, **app), loop)
    server.start()
    try:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120), engine
    finally:
        server.stop()
        engine.close()
    assert engine.pool.kv.num_used_blocks == 0, "blocks leaked"


def chat(client, stream=False, **kwargs):
    """The answers (message-like dicts with content, tool_calls, finish_reason) of a chat call, streamed or not."""
    args = {"model": MODEL, "messages": USER, "max_tokens": 300, "temperature": 1.0, "seed": 1, **kwargs}
    if not stream:
        out = client.chat.completions.create(**args)
        return [
            {"content": c.message.content, "tool_calls": c.message.tool_calls, "finish_reason": c.finish_reason}
            for c in out.choices
        ]
    answers: dict[int, dict] = {}
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            answer = answers.setdefault(c.index, {"content": "", "tool_calls": None, "finish_reason": None})
            answer["content"] += c.delta.content or ""
            if c.delta.tool_calls:
                answer["tool_calls"] = (answer["tool_calls"] or []) + list(c.delta.tool_calls)
            answer["finish_reason"] = c.finish_reason or answer["finish_reason"]
    return [answers[i] for i in sorted(answers)]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_json_schema_answers_are_always_valid(served, stream):
    client, _ = served
    rf = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    answers = chat(client, stream, response_format=rf, n=4)
    assert len(answers) == 4
    for answer in answers:
        assert answer["finish_reason"] == "stop", answer
        jsonschema.validate(json.loads(answer["content"]), SCHEMA)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_json_object_answers_are_objects(served, stream):
    client, _ = served
    for answer in chat(client, stream, response_format={"type": "json_object"}, n=3, max_tokens=400):
        if answer["finish_reason"] == "stop":
            assert isinstance(json.loads(answer["content"]), dict)
        else:  # free JSON may run long on random weights: then it is cut, and says so
            assert answer["finish_reason"] == "length"


def test_completions_and_vllm_guided_fields(served):
    client, _ = served
    out = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=40, extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"}
    )
    assert out.choices[0].finish_reason == "stop"
    assert jsonschema.Draft202012Validator({"pattern": "^[A-Z]{2}-[0-9]{3}$"}).is_valid(out.choices[0].text)
    answers = chat(client, extra_body={"guided_choice": ["sunny", "rainy"]}, n=3)
    assert {a["content"] for a in answers} <= {"sunny", "rainy"}
    answers = chat(client, extra_body={"structured_outputs": {"json": {"type": "integer", "maximum": 9}}})
    assert json.loads(answers[0]["content"]) <= 9


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": UNIQUE}}},
            "response_format",
            "uniqueItems",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"guided_regex": "(("}, "guided_regex", "invalid regex"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "one structured-output field"),
        ({"tools": [WEATHER_TOOL], "tool_choice": NO_SUCH_TOOL}, "tool_choice", "not one of the tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [{"type": "function"}]}, "tools", "tools.0"),
        ({"structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": True}},
         "structured_outputs.disable_any_whitespace", "not supported"),
        ({"structured_outputs": {"regex": "[0-9]+", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object", "must be given"),
    ],
)  # fmt: skip
def test_bad_specs_are_400s_naming_the_field(served, extra, param, message):
    client, engine = served
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, extra_body=extra)
    error = info.value.body
    assert error["param"] == param and message in error["message"], error
    assert not engine.has_unfinished()


@pytest.fixture(scope="module")
def ascii_served(one_thread) -> Iterator[tuple[openai.OpenAI, Engine]]:
    """The built-in model over the built-in ASCII vocabulary: a grammar that needs "é" gets stuck after the
    request was accepted (no token can spell it)."""
    engine = Engine(builtin_model(num_hidden_layers=1), builtin_tokenizer(), num_blocks=64, block_size=8)
    yield from serving(engine)


STUCK = {"type": "object", "properties": {"w": {"const": "aé"}}, "required": ["w"]}  # "é": no ASCII token spells it
STUCK_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": STUCK}}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize(
    ("param", "extra"),
    [
        ("guided_regex", {"guided_regex": "aé"}),
        ("guided_grammar", {"guided_grammar": 'start: "aé"'}),
        ("guided_choice", {"guided_choice": ["aé", "aéb"]}),
        ("guided_json", {"guided_json": STUCK}),
        ("structured_outputs", {"structured_outputs": {"regex": "aé"}}),
        ("response_format", {"response_format": STUCK_FORMAT}),
        ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": STUCK}}],
                   "tool_choice": "required"}),
    ],
)  # fmt: skip
def test_a_grammar_failing_after_acceptance_names_its_field(ascii_served, param, extra, stream):
    """A grammar that fails after the request was accepted (here: stuck, no token can spell what it needs) ends the
    request with a 400 / a stream's error event whose ``param`` is the field the grammar came from (it was null:
    the engine does not know the request's fields)."""
    client, engine = ascii_served
    args = {"model": MODEL, "max_tokens": 64, "temperature": 0.0, "extra_body": extra, "stream": stream}

    def ask():
        if param == "guided_regex":  # a completions field as much as a chat one
            answer = client.completions.create(prompt="Hello", **args)
        else:
            answer = client.chat.completions.create(messages=USER, **args)
        return list(answer) if stream else answer

    with pytest.raises(openai.BadRequestError if not stream else openai.APIError) as info:
        ask()
    assert info.value.param == param, info.value.body
    assert "no token of the model's vocabulary can continue the output" in info.value.message
    assert not engine.has_unfinished()


def _arguments(call, tools=(WEATHER_TOOL, TIME_TOOL)):
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema)
    return arguments


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_tool_choice_required_gives_valid_tool_calls(served, stream):
    client, _ = served
    answers = chat(client, stream, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", n=3)
    for answer in answers:
        assert answer["finish_reason"] == "tool_calls" and answer["tool_calls"], answer
        for call in answer["tool_calls"]:
            assert call.type == "function" and call.id.startswith("call_")
            _arguments(call)
    one = chat(client, stream, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", parallel_tool_calls=False)
    assert len(one[0]["tool_calls"]) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_named_function_is_called(served, stream):
    client, _ = served
    choice = {"type": "function", "function": {"name": "get_time"}}
    answers = chat(client, stream, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice, n=2)
    for answer in answers:
        (call,) = answer["tool_calls"]
        assert call.function.name == "get_time"
        _arguments(call)


def test_a_streamed_tool_answer_is_one_chunk_with_its_tokens(served):
    """With tools a stream's answer is held to its end and goes out in one chunk: the role, the calls, and what the
    request asked to see beside them (token ids, log-probabilities), as the same request answers unstreamed."""
    client, _ = served
    args = {"model": MODEL, "messages": USER, "max_tokens": 200, "temperature": 1.0, "seed": 3, "logprobs": True}
    args.update(tools=[WEATHER_TOOL], tool_choice="required", extra_body={"return_token_ids": True})
    whole = client.chat.completions.create(**args).choices[0]
    (chunk,) = [c for c in client.chat.completions.create(**args, stream=True) if c.choices]
    choice = chunk.choices[0]
    assert choice.delta.role == "assistant" and choice.finish_reason == whole.finish_reason == "tool_calls"
    streamed, answered = choice.delta.tool_calls[0].function, whole.message.tool_calls[0].function
    assert (streamed.name, streamed.arguments) == (answered.name, answered.arguments)
    token_ids = choice.model_dump()["token_ids"]
    assert token_ids == whole.model_dump()["token_ids"] and len(choice.logprobs.content) == len(token_ids) > 0


def test_auto_renders_the_tools_and_parses_what_the_model_wrote(served):
    client, _ = served
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4)
    auto = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, tools=[WEATHER_TOOL])
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the template wrote the tools in
    # The random model writes no call: the answer is its text. What a model that calls a tool writes is parsed:
    shape = Shape(True, "id", 0, MODEL, tools=ToolCalls("auto"))
    text = f"Let me look. <tool_call>\n{CALL}\n</tool_call>"
    message, reason = shape.message(text, "stop")
    assert reason == "tool_calls" and message["content"] == "Let me look."
    assert json.loads(message["tool_calls"][0]["function"]["arguments"])["city"] == "Paris"
    assert shape.message("no call here", "stop") == ({"role": "assistant", "content": "no call here"}, "stop")


def test_the_cli_offers_every_tool_call_parser():
    import argparse

    from pagedcore.serve.cli import add_arguments
    from pagedcore.serve.tool_calls import TOOL_PARSERS, llama3_json_tool_calls
    from pagedcore.serve.vllm_flags import TOOL_CALL_PARSERS, check_vllm_flags

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert sorted(TOOL_CALL_PARSERS) == sorted(TOOL_PARSERS)  # the names the command line checks
    assert parser.parse_args(["--tool-call-parser", "llama3_json"]).tool_call_parser == "llama3_json"
    for name in TOOL_PARSERS:
        check_vllm_flags(parser.parse_args(["--tool-call-parser", name]), ValueError)
    with pytest.raises(ValueError, match="--tool-call-parser granite is not supported here"):
        check_vllm_flags(parser.parse_args(["--tool-call-parser", "granite"]), ValueError)
    assert (
        llama3_json_tool_calls(f"<|python_tag|>{CALL.replace('arguments', 'parameters')}")[1][0]["name"]
        == "get_weather"
    )
    assert llama3_json_tool_calls("just text") == ("just text", [])


def test_a_tool_result_continues_the_conversation(served):
    client, _ = served
    # Seeded: unseeded draws of the random model depend on what ran before, and may not finish the call in time.
    first = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=300, seed=1, tools=[WEATHER_TOOL], tool_choice="required"
    )
    assert first.choices[0].finish_reason == "tool_calls", first.choices[0]
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = [
        *USER,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    again = client.chat.completions.create(model=MODEL, messages=history, max_tokens=5, tools=[WEATHER_TOOL])
    assert again.choices[0].finish_reason in ("stop", "length")
    assert again.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt
