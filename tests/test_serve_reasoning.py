"""Reasoning models through `pagedcore serve --reasoning-parser` and the official openai client: the reasoning comes
back as ``reasoning_content`` (``delta.reasoning_content`` in streams, never a marker's fragment), the content is
the answer alone, ``chat_template_kwargs={"enable_thinking": false}`` is honoured (also by the plain template), and
structured outputs and tool calls constrain / are read from the answer only, after the reasoning.

Model: :mod:`reasoning_helpers` (it writes ``<think>hm</think>Yes`` after Qwen3's generation prompt)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

import httpx
import jsonschema
import openai
from reasoning_helpers import ANSWER, R1_TEMPLATE, REASONING, reasoning_model, reasoning_tokenizer

from pagedcore.adapters.transformers import Engine
from pagedcore.serve.app import AppOptions, create_app
from pagedcore.serve.loop import EngineLoop
from pagedcore.serve.reasoning import ENDED, FORMATS, INSIDE, OPEN, Reasoning, ThinkSplitter
from pagedcore.serve.server import BackgroundServer

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "thinker"
USER = [{"role": "user", "content": "Is it?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]},
    },
}


@dataclass
class Served:
    url: str
    client: openai.OpenAI


def start(template: str | None = None, parser: str | None = "qwen3", **options) -> tuple[BackgroundServer, Engine]:
    tokenizer = reasoning_tokenizer() if template is None else reasoning_tokenizer(template)
    if template == "":
        tokenizer.chat_template = None  # no template: the plain one
    engine = Engine(reasoning_model(tokenizer), tokenizer, num_blocks=128, block_size=8)
    loop = EngineLoop(engine)
    app = create_app(loop, model_name=MODEL, options=AppOptions(reasoning_parser=parser, **options))
    return BackgroundServer(app, loop).start(), engine


@pytest.fixture(scope="module")
def qwen3(one_thread) -> Iterator[Served]:
    server, engine = start()
    try:
        yield Served(server.url, openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120))
    finally:
        server.stop()
        engine.close()
    assert engine.pool.kv.num_used_blocks == 0


def ask(served: Served, **kwargs):
    args = {"model": MODEL, "messages": USER, "max_tokens": 40, "temperature": 0, **kwargs}
    return served.client.chat.completions.create(**args).choices[0]


def test_the_reasoning_is_split_off_the_answer(qwen3):
    choice = ask(qwen3)
    message = choice.message
    assert message.content == ANSWER and choice.finish_reason == "stop"
    assert message.reasoning_content == REASONING and message.reasoning == REASONING  # vLLM's names, old and new


def test_streamed_reasoning_comes_as_reasoning_content_deltas(qwen3):
    stream = qwen3.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40, temperature=0, stream=True)
    reasoning, content = [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        content.append(delta.content or "")
    assert "".join(reasoning) == REASONING and "".join(content) == ANSWER
    assert not any("<" in part or ">" in part for part in reasoning + content)  # no marker, not even a fragment


def test_enable_thinking_false_is_honoured(qwen3):
    # The template closes an empty reasoning block: the model answers at once, all of it is content.
    message = ask(qwen3, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).message
    assert message.content == ANSWER and getattr(message, "reasoning_content", None) is None


def test_include_reasoning_false_leaves_it_out(qwen3):
    message = ask(qwen3, extra_body={"include_reasoning": False}).message
    assert message.content == ANSWER and getattr(message, "reasoning_content", None) is None


def test_a_choice_constrains_the_answer_not_the_reasoning(qwen3):
    choice = ask(qwen3, extra_body={"guided_choice": ["yes", "no"]})
    # Constrained from the first token, the model could never have opened its reasoning.
    assert choice.message.reasoning_content == REASONING
    assert choice.message.content in ("yes", "no")


def test_a_json_schema_constrains_the_answer_after_the_reasoning(qwen3):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    choice = ask(qwen3, response_format=response_format, max_tokens=80)
    assert choice.message.reasoning_content == REASONING
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_tool_calls_are_read_from_the_answer_after_the_reasoning(qwen3):
    choice = ask(qwen3, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == REASONING
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_deepseek_r1s_template_opens_the_reasoning_in_the_prompt(one_thread):
    server, engine = start(R1_TEMPLATE, "deepseek_r1")
    try:
        body = {"model": MODEL, "messages": USER, "max_tokens": 40, "temperature": 0}
        message = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
        assert message["message"]["content"] == ANSWER
        assert message["message"]["reasoning_content"] == REASONING
    finally:
        server.stop()
        engine.close()


def test_the_plain_template_honours_enable_thinking_with_a_reasoning_parser(one_thread):
    """Without a chat template, enable_thinking used to be a 400 ("no chat template"): with a reasoning parser the
    plain template closes an empty block after ``assistant:``, and the answer is all content."""
    body = {"model": MODEL, "messages": USER, "max_tokens": 3, "temperature": 0}
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    server, engine = start("", "qwen3")
    try:
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=off, timeout=120).json()
        assert "reasoning_content" not in answer["choices"][0]["message"], answer
        other = {**body, "chat_template_kwargs": {"enable_thinking": False, "other": 1}}
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=other, timeout=120)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"
    finally:
        server.stop()
        engine.close()
    server, engine = start("", None)
    try:
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=off, timeout=120)
        assert refused.status_code == 400 and "--reasoning-parser" in refused.json()["error"]["message"]
        no_parser = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "include_reasoning": False})
        assert no_parser.status_code == 400 and no_parser.json()["error"]["param"] == "include_reasoning"
    finally:
        server.stop()
        engine.close()


def test_default_chat_template_kwargs_are_under_the_requests(one_thread):
    server, engine = start(default_chat_template_kwargs={"enable_thinking": False})
    try:
        body = {"model": MODEL, "messages": USER, "max_tokens": 40, "temperature": 0}
        off = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
        assert off["message"]["content"] == ANSWER and "reasoning_content" not in off["message"]
        on = {**body, "chat_template_kwargs": {"enable_thinking": True}}
        thought = httpx.post(f"{server.url}/v1/chat/completions", json=on, timeout=120).json()["choices"][0]
        assert thought["message"]["reasoning_content"] == REASONING
    finally:
        server.stop()
        engine.close()


# ---------------------------------------------------------------------- the splitter and the prompt state
@pytest.mark.parametrize(
    ("name", "state", "text", "expected"),
    [
        ("qwen3", OPEN, "<think>Let me see.</think>\n\nIt is 4.", ("Let me see.", "\n\nIt is 4.")),
        ("qwen3", OPEN, "It is 4.", (None, "It is 4.")),  # an instruct model that never thinks
        ("qwen3", OPEN, "<think>cut short", ("cut short", None)),
        ("qwen3", INSIDE, "Let me see.</think>It is 4.", ("Let me see.", "It is 4.")),
        ("qwen3", ENDED, "It is <think> 4.", (None, "It is <think> 4.")),
        ("deepseek_r1", OPEN, "Let me see.</think>It is 4.", ("Let me see.", "It is 4.")),
        ("deepseek_r1", OPEN, "<think>Let me see.</think>It is 4.", ("Let me see.", "It is 4.")),
        ("deepseek_r1", OPEN, "never closed", ("never closed", None)),
        ("deepseek_r1", INSIDE, "</think>4", ("", "4")),
    ],
)
def test_split_at_every_delta_boundary_equals_the_whole(name, state, text, expected):
    reasoning = Reasoning(name, None)
    assert reasoning.split(text, state) == expected
    for cut in range(len(text) + 1):  # two deltas, cut anywhere (inside a marker too)
        splitter = ThinkSplitter(FORMATS[name], state)
        parts = [splitter.feed(text[:cut]), splitter.feed(text[cut:]), splitter.flush()]
        thought, content = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
        assert (thought if splitter.thought else None, content or None) == expected, cut
    splitter = ThinkSplitter(FORMATS[name], state)
    chars = [splitter.feed(c) for c in text] + [splitter.flush()]  # one character per delta
    assert ("".join(p[0] for p in chars), "".join(p[1] for p in chars) or None) == (expected[0] or "", expected[1])


def test_an_assistant_messages_reasoning_reaches_the_template():
    """``reasoning_content`` (or vLLM's newer ``reasoning``) of an earlier assistant turn goes to the chat template,
    which renders it or not (Qwen3's keeps it in a tool loop); it used to be accepted and dropped."""
    from pagedcore.serve.prompts import ChatRenderer
    from pagedcore.serve.protocol import ChatMessage

    tokenizer = reasoning_tokenizer()
    template = "{% for m in messages %}{{ m.reasoning_content or '' }}|{{ m.content }};{% endfor %}"
    renderer = ChatRenderer(tokenizer, template)
    messages = [
        ChatMessage(role="user", content="Q"),
        ChatMessage(role="assistant", content="A", reasoning_content="R"),
        ChatMessage.model_validate({"role": "assistant", "content": "B", "reasoning": "S"}),
    ]
    assert tokenizer.decode(renderer.render(messages)) == "|Q;R|A;S|B;"


def test_the_prompt_state_is_the_generation_prompts_last_marker():
    reasoning = Reasoning("qwen3", None)
    assert reasoning.state("<|im_start|>assistant\n") == OPEN
    assert reasoning.state("<|im_start|>assistant\n<think>\n") == INSIDE
    assert reasoning.state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == ENDED
