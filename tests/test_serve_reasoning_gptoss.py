"""gpt-oss's channel format through ``--reasoning-parser openai_gptoss`` (vLLM's name) and the official openai
client: the ``analysis`` channel comes back as ``reasoning_content`` (and ``delta.reasoning_content`` in streams,
never a marker's fragment), the ``final`` channel as the content, structured outputs constrain the final message
only, and the Responses API gives a reasoning item. The markers are special tokens the answer's text leaves out, so
they are read from its token ids.

Tokenizer: byte-level with gpt-oss's special tokens (``<|start|>``, ``<|channel|>``, ``<|message|>``, ``<|end|>``,
``<|return|>`` the eos, ...) and a gpt-oss-shaped chat template. Model: a tiny model whose logits a script
overrides, so that after ``<|start|>assistant`` it writes a harmony answer through the Engine's real path."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

import jsonschema
import openai
import torch
from byte_text import byte_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from pagedcore.adapters.transformers.runner import TransformersRunner
from pagedcore.config import PoolConfig
from pagedcore.engine import Engine
from pagedcore.errors import ConfigError
from pagedcore.serve.app import AppOptions, create_app
from pagedcore.serve.harmony import HARMONY_MARKERS, HarmonySplitter, harmony_state
from pagedcore.serve.loop import EngineLoop
from pagedcore.serve.reasoning import Reasoning
from pagedcore.serve.server import BackgroundServer

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "gpt-oss-tiny"
USER = [{"role": "user", "content": "2+2?"}]
THOUGHT, ANSWER = "Let me think.", "Yes, 4."
SCRIPT = (
    f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
)
TEMPLATE = (
    "{%- for m in messages %}{{ '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{% endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
)


def harmony_tokenizer() -> Any:
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(HARMONY_MARKERS)})
    tokenizer.eos_token = "<|return|>"
    tokenizer.chat_template = TEMPLATE
    return tokenizer


class ScriptRunner:
    """A transformers runner (packing, paged attention, the forward: all real) whose sampled rows' logits a script
    overrides: the k-th token of every answer is ``script[k]`` (the row's other logits are 0, so a grammar that masks
    the script's token leaves a tie among the tokens it allows)."""

    def __init__(self, tokenizer: Any, script: list[int]) -> None:
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)  # fmt: skip
        model = LlamaForCausalLM(config).eval()
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        # fused_argmax=False: the script overwrites the logits, so its runner must compute them (an argmax-only step
        # would otherwise come back as its tokens, ArgmaxTokens, even at one row where the head's screen applies)
        self._inner = TransformersRunner(model, config=PoolConfig(num_blocks=128, block_size=8), tokenizer=tokenizer,
                                         fused_argmax=False)  # fmt: skip
        self._script = script

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def prepare(self, batch: Any) -> Any:
        return batch, self._inner.prepare(batch)

    def execute(self, prepared: Any) -> torch.Tensor:
        batch, inner = prepared
        logits = torch.zeros_like(self._inner.execute(inner))
        sampled = [item for item in batch.scheduled if item.sample]
        for row, item in enumerate(sampled):
            k = item.sequence.num_tokens - item.sequence.num_prompt_tokens
            logits[row, self._script[min(k, len(self._script) - 1)]] = 30.0
        return logits


@pytest.fixture(scope="module")
def served(one_thread) -> Iterator[openai.OpenAI]:
    tokenizer = harmony_tokenizer()
    script = list(tokenizer(SCRIPT, add_special_tokens=False)["input_ids"])
    engine = Engine(ScriptRunner(tokenizer, script), tokenizer)
    loop = EngineLoop(engine)
    app = create_app(loop, model_name=MODEL, options=AppOptions(reasoning_parser="openai_gptoss"))
    server = BackgroundServer(app, loop).start()
    try:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    finally:
        server.stop()
        engine.close()


def ask(client: openai.OpenAI, **kwargs: Any) -> Any:
    args = {"model": MODEL, "messages": USER, "max_tokens": 80, "temperature": 0, **kwargs}
    return client.chat.completions.create(**args).choices[0]


def test_the_analysis_channel_is_the_reasoning_and_the_final_channel_the_answer(served):
    choice = ask(served)
    assert choice.message.content == ANSWER and choice.finish_reason == "stop"
    assert choice.message.reasoning_content == THOUGHT and choice.message.reasoning == THOUGHT


def test_streamed_deltas_split_the_channels_without_a_markers_fragment(served):
    stream = served.chat.completions.create(model=MODEL, messages=USER, max_tokens=80, temperature=0, stream=True)
    reasoning, content = [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        content.append(delta.content or "")
    assert "".join(reasoning) == THOUGHT and "".join(content) == ANSWER
    assert not any("<|" in part or "|>" in part or "analysis" in part for part in reasoning + content)


def test_a_choice_constrains_the_final_message_not_the_analysis(served):
    choice = ask(served, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.message.reasoning_content == THOUGHT
    assert choice.message.content in ("yes", "no")


def test_a_json_schema_constrains_the_final_message(served):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    choice = ask(served, response_format=response_format)
    assert choice.message.reasoning_content == THOUGHT
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_the_responses_api_gives_a_reasoning_item(served):
    response = served.responses.create(model=MODEL, input="2+2?", max_output_tokens=80)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"] and response.output_text == ANSWER
    assert response.output[0].content[0].text == THOUGHT
    before_answer = SCRIPT[: SCRIPT.index(ANSWER)]  # the analysis message and the final message's header
    thought_tokens = len(harmony_tokenizer()(before_answer, add_special_tokens=False)["input_ids"])
    assert response.usage.output_tokens_details.reasoning_tokens == thought_tokens


def test_the_responses_api_streams_the_reasoning_then_the_text(served):
    kinds, thought, text = [], [], []
    with served.responses.stream(model=MODEL, input="2+2?", max_output_tokens=80) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.reasoning_text.delta":
                thought.append(event.delta)
            elif event.type == "response.output_text.delta":
                text.append(event.delta)
        final = stream.get_final_response()
    assert "".join(thought) == THOUGHT and "".join(text) == ANSWER
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [item.type for item in final.output] == ["reasoning", "message"]


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "f"}}])
def test_tools_are_refused_naming_the_field_not_answered_as_text(served, tool_choice):
    # gpt-oss calls tools on its commentary channel, which is not read: a call must not come back as content.
    with pytest.raises(openai.BadRequestError, match="commentary channel") as caught:
        ask(served, tools=[TOOL], tool_choice=tool_choice)
    assert caught.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError, match="commentary channel"):
        served.responses.create(model=MODEL, input="2+2?", tools=[{"type": "function", "name": "f"}])


def test_tools_with_tool_choice_none_are_only_rendered(served):
    choice = ask(served, tools=[TOOL], tool_choice="none")
    assert (choice.message.reasoning_content, choice.message.content) == (THOUGHT, ANSWER)


def test_a_tokenizer_without_the_markers_is_refused():
    with pytest.raises(ConfigError, match="<\\|start\\|> as one token"):
        Reasoning("openai_gptoss", byte_tokenizer())


@pytest.mark.parametrize(
    ("state", "text", "expected"),
    [
        ("open", SCRIPT, (THOUGHT, ANSWER)),
        ("inside", f"{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>",
         (THOUGHT, ANSWER)),
        ("ended", f"{ANSWER}<|return|>", (None, ANSWER)),
        ("open", ANSWER, (None, ANSWER)),  # no channel at all: all content
        ("open", "<|channel|>commentary<|message|>Calling.<|end|><|start|>assistant<|channel|>final<|message|>Done",
         (None, "Calling.Done")),
        ("open", "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
                 "<|start|>assistant<|channel|>final<|constrain|>json<|message|>{}", ("ab", "{}")),
    ],
)  # fmt: skip
def test_split_at_every_token_boundary_equals_the_whole(state, text, expected):
    tokenizer = harmony_tokenizer()
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    reasoning = Reasoning("openai_gptoss", tokenizer)
    assert reasoning.split("(text without markers)", state, ids) == expected
    for cut in range(len(ids) + 1):
        splitter = reasoning.splitter(state)
        parts = [splitter.feed("", ids[:cut]), splitter.feed("", ids[cut:]), splitter.flush()]
        thought = "".join(part[0] for part in parts)
        content = "".join(part[1] for part in parts)
        assert (thought if splitter.thought else None, content or None) == expected
        assert isinstance(splitter, HarmonySplitter)


def test_the_prompt_state_is_read_with_the_special_tokens():
    assert harmony_state("<|start|>user<|message|>Hi<|end|><|start|>assistant") == "open"
    assert harmony_state("<|start|>assistant<|channel|>analysis<|message|>") == "inside"
    assert harmony_state("<|start|>assistant<|channel|>final<|message|>") == "ended"
    tokenizer = harmony_tokenizer()
    ids = tokenizer("<|start|>assistant<|channel|>analysis<|message|>", add_special_tokens=False)["input_ids"]
    reasoning = Reasoning("openai_gptoss", tokenizer)
    assert reasoning.state(reasoning.decode_prompt(ids, tokenizer.decode)) == "inside"
