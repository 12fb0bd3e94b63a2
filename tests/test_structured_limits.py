"""Structured outputs and tools at their edges (issue 26.3, 26.7): a huge spec is refused by its bounds and a large
one is parsed in a worker while every other stream goes on (real HTTP streams, timed); choices of thousands of
options that share a prefix work; a grammar past llguidance's limits is the client's 400 with llguidance's reason;
tools whose parameters use ``$defs`` / ``$ref`` (pydantic's nested models) work under ``tool_choice="required"``;
two tools of one name are refused."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

import openai
from pydantic import BaseModel
from structured_helpers import bpe_tokenizer, random_model

from pagedcore.adapters.transformers import Engine
from pagedcore.adapters.transformers.structured.spec import MAX_CHOICES, MAX_NESTING, MAX_SPEC_BYTES
from pagedcore.serve.app import create_app
from pagedcore.serve.loop import EngineLoop
from pagedcore.serve.server import BackgroundServer

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny"
TOKENIZER = bpe_tokenizer()
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(one_thread) -> Iterator[tuple[openai.OpenAI, Engine]]:
    """A random model over a byte-level BPE (an adversarial generator: only the masks make its output valid)."""
    model = random_model(len(TOKENIZER))
    model.generation_config.eos_token_id = TOKENIZER.eos_token_id
    engine = Engine(model, TOKENIZER, num_blocks=512, block_size=8, max_num_seqs=32)
    loop = EngineLoop(engine)
    server = BackgroundServer(create_app(loop, model_name=MODEL, context_length=2048), loop)
    server.start()
    try:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120), engine
    finally:
        server.stop()
        engine.close()
    assert engine.pool.kv.num_used_blocks == 0, "blocks leaked"
    engine.pool.check_invariants()


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    home: Address


class Company(BaseModel):
    title: str
    office: Address  # another tool with a $defs entry of the same name


def test_tool_choice_required_with_pydantic_nested_models(served):
    """pydantic writes nested models as ``$defs`` and ``$ref: "#/$defs/Address"``; the calls schema wraps each tool's
    parameters, so those refs pointed at the wrong root ("Pointer '/$defs/Address' does not exist", a 400)."""
    client, _ = served
    tools = [openai.pydantic_function_tool(Person), openai.pydantic_function_tool(Company)]
    assert "$defs" in tools[0]["function"]["parameters"]
    out = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=400,
        temperature=1.0,
        seed=2,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    for call in choice.message.tool_calls:
        model = {"Person": Person, "Company": Company}[call.function.name]
        model.model_validate_json(call.function.arguments)  # what the schema promised, nested model included


def test_two_tools_with_one_name_are_refused(served):
    client, _ = served
    tool = openai.pydantic_function_tool(Person)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, tools=[tool, tool])
    assert info.value.body["param"] == "tools" and "'Person' is given twice" in info.value.body["message"]


def test_a_choice_of_2000_options_sharing_a_prefix_is_served(served):
    """As one rule per option, llguidance's parser hit its row limit at the first token ("Current row has 2001
    items; max is 2000") and the request ended 500 with "token 66 is not allowed"; a choice is one lexeme now."""
    client, _ = served
    options = [f"option {i}" for i in range(2000)]
    out = client.completions.create(
        model=MODEL, prompt="Pick one:", max_tokens=12, temperature=1.0, seed=4, extra_body={"guided_choice": options}
    )
    assert out.choices[0].text in options and out.choices[0].finish_reason == "stop"


def test_a_grammar_past_llguidances_limits_is_a_400_with_its_reason(served):
    """One rule with 2,500 alternatives sharing a prefix compiles, then exceeds llguidance's Earley row limit at the
    first token: the client's fault (400) with llguidance's message, not a 500 hiding it."""
    client, engine = served
    grammar = "start: " + " | ".join(json.dumps(f"option {i}") for i in range(2500))
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt="Pick one:", max_tokens=12, seed=4, extra_body={"guided_grammar": grammar}
        )
    assert "max is 2000" in info.value.body["message"], info.value.body
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    ("field", "value", "bound"),
    [
        ("guided_choice", [f"o{i}" for i in range(MAX_CHOICES + 1)], f"more than the {MAX_CHOICES}"),
        ("guided_regex", "a" * (MAX_SPEC_BYTES + 1), f"more than the {MAX_SPEC_BYTES}"),
        ("guided_json", json.loads('{"items":' * (MAX_NESTING + 1) + "{}" + "}" * (MAX_NESTING + 1)), "nests"),
    ],
)
def test_specs_past_their_bounds_are_400s_naming_the_bound(served, field, value, bound):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={field: value})
    assert info.value.body["param"] == field and bound in info.value.body["message"], info.value.body


def test_a_large_spec_never_stalls_the_other_streams(served):
    """Issue 26.3: a 600 KB ``guided_choice`` (40,000 options) was validated in a worker, then parsed again by the
    Engine's compiler on the step loop's thread: no stream got a token for seconds (7.3 s measured, then a 500).
    Now a spec past the bounds is a 400 from the worker, one within them is parsed and compiled there, and the
    streams go on."""
    client, _ = served
    url = str(client.base_url).rstrip("/")
    big = [f"an option with a long shared prefix, number {i}" for i in range(40_000)]
    large = [f"option {i}" for i in range(5_000)]
    gaps: list[float] = []
    done = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": "Tides", "max_tokens": 1000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            last = None
            for _ in response.iter_lines():
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                if done.is_set():
                    return

    streams = [threading.Thread(target=stream) for _ in range(3)]
    for thread in streams:
        thread.start()
    while len(gaps) < 30:  # the streams are running
        time.sleep(0.05)
    first = len(gaps)
    refused = httpx.post(
        f"{url}/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "guided_choice": big}, timeout=120
    )
    answered = httpx.post(
        f"{url}/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 12, "guided_choice": large},
        timeout=120,
    )
    worst = max(gaps[first:])
    done.set()
    for thread in streams:
        thread.join(60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "guided_choice"
    assert answered.status_code == 200 and answered.json()["choices"][0]["text"] in large
    assert worst < 2.0, f"a stream waited {worst:.2f} s for a token while the specs were handled"


def test_a_spec_is_parsed_once_and_never_on_the_step_loop(served, monkeypatch):
    """The server parsed the spec in a worker, then the Engine's own compiler parsed it again on the step loop's
    thread (a second parse cache). Now it is parsed once, in the request's worker, and handed over parsed."""
    from pagedcore.adapters.transformers.structured.compiler import GrammarCompiler

    client, _ = served
    threads: list[str] = []
    original = GrammarCompiler._to_grammar

    def recording(self, spec):
        threads.append(threading.current_thread().name)
        return original(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_to_grammar", recording)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 40_000_123}}, "required": ["n"]}
    out = client.completions.create(
        model=MODEL, prompt="x", max_tokens=40, seed=5, extra_body={"guided_json": schema, "temperature": 1.0}
    )
    assert json.loads(out.choices[0].text)["n"] >= 40_000_123
    assert len(threads) == 1 and threads[0] != "pagedcore-engine-loop", threads
