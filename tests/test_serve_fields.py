"""Every request field is implemented or refused with a 400 naming it, none accepted and ignored: the one list
(:mod:`pagedcore.serve.fields`) is checked against vLLM's request models and the official openai client's
parameters, walked field by field through the client, and the sampling controls' effect is checked against the
Engine's own :class:`SamplingParams`; ``cache_salt`` narrows prefix sharing within a tenant and never widens it."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from functools import partial

import pytest

pytest.importorskip("openai")  # the optional client and server: the GPU image has neither
pytest.importorskip("fastapi")

import openai
from openai.resources.chat.completions import Completions as ChatResource
from openai.resources.completions import Completions as CompletionsResource
from test_serve import MODEL, Served, idle, serving, wait_for

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers.builtin import builtin_tokenizer
from pagedcore.serve.auth import ApiKeys
from pagedcore.serve.fields import CHAT, COMPLETIONS, FIELDS, rules_for
from pagedcore.serve.protocol import ChatRequest, CompletionRequest

pytestmark = pytest.mark.usefixtures("one_thread")

# The fields of vLLM's CompletionRequest and ChatCompletionRequest (vllm-project/vllm at d5dba2d7,
# vllm/entrypoints/openai/completion/protocol.py and chat_completion/protocol.py).
_VLLM_COMMON = [
    "model",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "response_format",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "user",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "allowed_token_ids",
    "prompt_logprobs",
    "echo",
    "add_special_tokens",
    "structured_outputs",
    "priority",
    "request_id",
    "logits_processors",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "cache_salt",
    "kv_transfer_params",
    "vllm_xargs",
    "max_repetition_pattern_size",
    "min_repetition_pattern_size",
    "repetition_min_count",
]
VLLM_COMPLETION = [*_VLLM_COMMON, "prompt", "suffix", "prompt_embeds"]
VLLM_CHAT = [*_VLLM_COMMON, "messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice"]
VLLM_CHAT += [
    "reasoning_effort",
    "include_reasoning",
    "parallel_tool_calls",
    "bad_words",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
]

_CLIENT_ONLY = {"self", "extra_body", "extra_headers", "extra_query", "timeout"}

# A value that asks for something, per refused field (default: a string).
_ASKING = {
    "best_of": 3,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "suffix": "end",
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "priority": 5,
    "bad_words": ["tide"],
    "watermarking": True,
    "thinking_token_budget": 10,
    "max_repetition_pattern_size": 4,
    "min_repetition_pattern_size": 2,
    "repetition_min_count": 3,
    "stream_interval": 4,
    "return_prompt_text": True,
    "return_token_offsets": True,
    "return_mm_kwargs": False,
    "routed_experts_prompt_start": 3,
    "include_reasoning": False,
    "store": True,
    "service_tier": "flex",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "modalities": ["text", "audio"],
    "logits_processors": ["my.Processor"],
    "media_io_kwargs": {"a": 1},
    "mm_processor_kwargs": {"a": 1},
    "metadata": {"a": "b"},
    "vllm_xargs": {"a": 1},
}


@pytest.fixture(scope="module")
def served(one_thread) -> Iterator[Served]:
    with serving() as s:
        yield s


@pytest.mark.parametrize(("endpoint", "vllm"), [(COMPLETIONS, VLLM_COMPLETION), (CHAT, VLLM_CHAT)])
def test_the_list_covers_every_field_of_vllms_request_models(endpoint, vllm):
    assert sorted(set(vllm) - set(rules_for(endpoint))) == []


@pytest.mark.parametrize(("endpoint", "resource"), [(COMPLETIONS, CompletionsResource), (CHAT, ChatResource)])
def test_the_list_covers_every_parameter_of_the_openai_client(endpoint, resource):
    parameters = set(inspect.signature(resource.create).parameters) - _CLIENT_ONLY
    assert sorted(parameters - set(rules_for(endpoint))) == []


@pytest.mark.parametrize(("endpoint", "model"), [(COMPLETIONS, CompletionRequest), (CHAT, ChatRequest)])
def test_implemented_fields_are_exactly_the_request_models_fields(endpoint, model):
    parsed = set(model.model_fields)
    rules = rules_for(endpoint)
    implemented = {name for name, rule in rules.items() if rule.status in ("implemented", "no effect")}
    assert sorted(implemented - parsed) == [] and sorted(parsed - implemented) == []


# Structured outputs and tools (pagedcore.serve.structured, tool_calls; tests/test_serve_structured.py shows their
# effect): implemented, where vLLM has them; the fields vLLM's grammar backends alone read stay refused.
STRUCTURED_AND_TOOLS = {
    "response_format": "implemented",
    "structured_outputs": "implemented",
    "guided_json": "implemented",
    "guided_regex": "implemented",
    "guided_choice": "implemented",
    "guided_grammar": "implemented",
    "guided_decoding_backend": "refused",
    "guided_whitespace_pattern": "refused",
    "structural_tag": "refused",
    "tools": "implemented",
    "tool_choice": "implemented",
    "parallel_tool_calls": "implemented",
    "functions": "refused",
    "function_call": "refused",
}


def test_structured_outputs_and_tools_are_implemented():
    assert {name: FIELDS[name].status for name in STRUCTURED_AND_TOOLS} == STRUCTURED_AND_TOOLS


def _refused(endpoint: str) -> list[str]:
    return sorted(name for name, rule in rules_for(endpoint).items() if rule.status == "refused")


@pytest.mark.parametrize("name", _refused(COMPLETIONS))
def test_each_refused_completion_field_gets_a_400_naming_it(served, name):
    value = _ASKING.get(name, "on")
    assert not FIELDS[name].accepts(value)
    with pytest.raises(openai.BadRequestError) as info:
        served.client().completions.create(model=MODEL, prompt="Tide", max_tokens=2, extra_body={name: value})
    assert info.value.body["param"] == name and name in info.value.body["message"]
    for no_op in FIELDS[name].no_op:  # the values that ask for nothing are accepted
        served.client().completions.create(model=MODEL, prompt="Tide", max_tokens=1, extra_body={name: no_op})


@pytest.mark.parametrize("name", _refused(CHAT))
def test_each_refused_chat_field_gets_a_400_naming_it(served, name):
    value = _ASKING.get(name, "on")
    messages = [{"role": "user", "content": "Tide?"}]
    with pytest.raises(openai.BadRequestError) as info:
        served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body={name: value})
    assert info.value.body["param"] == name
    wait_for(lambda: idle(served), "idle")


@pytest.mark.parametrize(
    ("endpoint", "name", "why"),
    [
        (COMPLETIONS, "max_token", "neither OpenAI nor vLLM defines it"),  # a misspelt max_tokens
        (CHAT, "temprature", "neither OpenAI nor vLLM defines it"),
        (COMPLETIONS, "messages", "the other endpoint"),
    ],
)
def test_a_field_this_endpoint_does_not_define_gets_a_400_naming_it(served, endpoint, name, why):
    """vLLM logs an unknown field and answers with the defaults; a misspelt max_tokens would then quietly get the
    default length. Here it is a 400 naming the field, and the server is idle afterwards."""
    client = served.client()
    if endpoint == COMPLETIONS:
        send = partial(client.completions.create, prompt="Tide")
    else:
        send = partial(client.chat.completions.create, messages=[{"role": "user", "content": "Tide?"}])
    with pytest.raises(openai.BadRequestError) as info:
        send(model=MODEL, max_tokens=2, extra_body={name: 3})
    assert info.value.body["param"] == name and why in info.value.body["message"]
    wait_for(lambda: idle(served), "idle")


@pytest.fixture(scope="module")
def engine_reference(served):
    """What the Engine alone gives for a prompt and parameters (the Engine's controls are tested against
    transformers' own logits processors in the Engine's tests)."""
    from test_serve import tiny_model

    engine = Engine(tiny_model(), builtin_tokenizer(), num_blocks=128, block_size=8)
    yield lambda prompt, params: engine.generate([prompt], params, use_tqdm=False)[0].text
    engine.close()


@pytest.mark.parametrize(
    ("fields", "params"),
    [
        ({"presence_penalty": 1.5}, {"presence_penalty": 1.5}),
        ({"frequency_penalty": 2.0}, {"frequency_penalty": 2.0}),
        ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
        ({"min_p": 0.3, "temperature": 1.0, "seed": 7}, {"min_p": 0.3, "temperature": 1.0, "seed": 7}),
        ({"top_k": -1, "temperature": 1.0, "seed": 3}, {"top_k": 0, "temperature": 1.0, "seed": 3}),
        ({"min_tokens": 10, "stop": ["e"]}, {"min_new_tokens": 10, "stop_strings": ["e"]}),
        ({"ignore_eos": True}, {"ignore_eos": True}),
    ],
)
def test_sampling_controls_do_what_the_engine_does(served, engine_reference, fields, params):
    prompt = "The tide comes in and the tide goes out"
    ids = builtin_tokenizer().encode(prompt)
    answer = served.client().completions.create(
        model=MODEL, prompt=ids, max_tokens=12, extra_body={"temperature": 0, **fields}
    )
    want = engine_reference(ids, SamplingParams(max_new_tokens=12, **{"temperature": 0.0, **params}))
    assert answer.choices[0].text == want


def test_logit_bias_stop_token_ids_and_allowed_token_ids_change_the_answer(served):
    tokenizer = builtin_tokenizer()
    ids = tokenizer.encode("Tides")
    token = tokenizer.encode("z", add_special_tokens=False)[-1]
    client = served.client()
    forced = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=5, temperature=0, logit_bias={str(token): 100}
    )
    assert forced.choices[0].text == "zzzzz"
    # vLLM leaves a stop token's text out unless include_stop_str_in_output (its detokenizer's stop_terminated rule)
    for include, text in ((False, ""), (True, "z")):
        extra = {"stop_token_ids": [token], "include_stop_str_in_output": include}
        stopped = client.completions.create(
            model=MODEL, prompt=ids, max_tokens=5, temperature=0, logit_bias={str(token): 100}, extra_body=extra
        ).choices[0]
        assert stopped.finish_reason == "stop" and stopped.text == text and stopped.model_extra["stop_reason"] == token
    allowed = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=4, temperature=0, extra_body={"allowed_token_ids": [token]}
    )
    assert allowed.choices[0].text == "zzzz"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=2, logit_bias={"tide": 1})
    assert info.value.body["param"] == "logit_bias"


def test_cache_salt_narrows_sharing_within_a_tenant_and_never_crosses_tenants():
    keys = ApiKeys({"sk-alice": "alice", "sk-bob": "bob"})
    prompt = builtin_tokenizer().encode("A salted prompt that spans several blocks of the pool, twice over.")
    with serving(api_keys=keys) as s:

        def cached(key: str, salt: str | None = None) -> int:
            extra = {} if salt is None else {"cache_salt": salt}
            answer = s.client(key).completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra)
            return answer.usage.prompt_tokens_details.cached_tokens

        assert cached("sk-alice", "s1") == 0
        assert cached("sk-alice", "s1") > 0  # same tenant, same salt: shared
        assert cached("sk-alice", "s2") == 0  # another salt: not shared
        assert cached("sk-alice") == 0  # no salt: not shared with a salted request
        assert cached("sk-bob", "s1") == 0  # the same salt never reaches another tenant's blocks
