"""The tool-call formats ``--tool-call-parser`` reads besides Hermes and Llama 3's JSON: Mistral's (both tokenizer
generations, with and without the marker in the text), Qwen3-Coder's XML (values typed by the tools' schemas),
Llama 3.2 / 4's Python calls and DeepSeek-V3's; what is not a format's calls stays content; and the chat answer they
become through :class:`~pagedcore.serve.answers.Shape` (``tool_calls``, finish reason ``tool_calls``)."""

from __future__ import annotations

import json

import pytest

from pagedcore.serve.answers import Shape
from pagedcore.serve.tool_calls import tool_calls_of
from pagedcore.serve.tool_formats import (
    deepseek_v3_tool_calls,
    mistral_tool_calls,
    pythonic_tool_calls,
    qwen3_coder_tool_calls,
)

SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
            "hours": {"type": "array"},
            "zip": {"type": "string"},
        },
    }
}
PARIS = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]', (None, [PARIS])),
        ('[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]', (None, [PARIS])),  # marker left out
        ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}', ("Sure.", [PARIS])),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]now[ARGS]{}',
         (None, [PARIS, {"name": "now", "arguments": {}}])),
        ("[TOOL_CALLS]not json", ("[TOOL_CALLS]not json", [])),
        ("Just an answer.", ("Just an answer.", [])),
        ("[1, 2, 3]", ("[1, 2, 3]", [])),
    ],
)  # fmt: skip
def test_mistral(text, expected):
    assert mistral_tool_calls(text) == expected


def test_qwen3_coder_types_values_by_the_tools_schema():
    text = (
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2]\n"
        "</parameter>\n<parameter=zip>\n75001\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=now>\n</function>\n</tool_call>"
    )
    content, calls = qwen3_coder_tool_calls(text, SCHEMAS)
    assert content == "Let me check."
    assert calls == [
        {"name": "get_weather",
         "arguments": {"city": "Paris", "days": 2, "metric": True, "hours": [1, 2], "zip": "75001"}},
        {"name": "now", "arguments": {}},
    ]  # fmt: skip
    # Without a schema a value is text (a string parameter that looks like a number stays one).
    assert qwen3_coder_tool_calls(text)[1][0]["arguments"]["days"] == "2"
    assert qwen3_coder_tool_calls("no calls") == ("no calls", [])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[get_weather(city="Paris", days=2)]', (None, [PARIS])),
        ("[get_weather(city='Paris', days=2), now()]", (None, [PARIS, {"name": "now", "arguments": {}}])),
        ('[get_weather(city=["a", {"b": None}])]',
         (None, [{"name": "get_weather", "arguments": {"city": ["a", {"b": None}]}}])),
        ("[get_weather(city=open('x'))]", ("[get_weather(city=open('x'))]", [])),  # literals only: no code runs
        ('[get_weather("Paris")]', ('[get_weather("Paris")]', [])),  # positional arguments have no names
        ("[1, 2]", ("[1, 2]", [])),
        ("The answer is [x].", ("The answer is [x].", [])),
    ],
)  # fmt: skip
def test_pythonic(text, expected):
    assert pythonic_tool_calls(text) == expected


def test_deepseek_v3():
    begin, sep, end = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    call = f'{begin}function{sep}get_weather\n```json\n{{"city": "Paris", "days": 2}}\n```{end}'
    text = f"Checking.<｜tool▁calls▁begin｜>{call}\n{call}<｜tool▁calls▁end｜>"
    assert deepseek_v3_tool_calls(text) == ("Checking.", [PARIS, PARIS])
    assert deepseek_v3_tool_calls("plain") == ("plain", [])
    broken = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\nnot json\n```<｜tool▁call▁end｜>"
    )
    assert deepseek_v3_tool_calls(broken) == (broken, [])


@pytest.mark.parametrize("parser", ["mistral", "qwen3_coder", "pythonic", "deepseek_v3"])
def test_each_format_becomes_the_answers_tool_calls(parser):
    texts = {
        "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
        "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        "pythonic": '[get_weather(city="Paris", days=2)]',
        "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMAS["get_weather"]}}]
    calls, spec = tool_calls_of({"tools": tools}, parser)
    assert spec is None and calls is not None and calls.mode == "auto"
    message, reason = Shape(True, "chatcmpl-1", 0, "m", tools=calls).message(texts[parser], "stop")
    assert reason == "tool_calls" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}
