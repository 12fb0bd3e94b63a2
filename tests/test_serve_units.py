"""The server's pure parts: API keys, request parsing, chat rendering (stop strings are the Engine's: see
test_text_units.py)."""

from __future__ import annotations

import hmac
import json

import pytest

from pagedcore.adapters.transformers.builtin import builtin_tokenizer
from pagedcore.serve import auth
from pagedcore.serve.auth import ApiKeys, ApiKeysError
from pagedcore.serve.prompts import ChatRenderer, completion_prompts, plain_chat_prompt
from pagedcore.serve.protocol import (
    ApiError,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    parse_request,
    sampling_params,
    stop_strings,
)


# ---------------------------------------------------------------------- API keys
def test_key_files_in_text_and_json(tmp_path):
    text = tmp_path / "keys.txt"
    text.write_text("# comment\n\nsk-a  team-a\n  sk-b\tteam-b  \nsk-c team-a\n")
    keys = ApiKeys.from_file(text)
    assert len(keys) == 3
    assert [keys.tenant(f"Bearer {k}") for k in ("sk-a", "sk-b", "sk-c")] == ["team-a", "team-b", "team-a"]
    assert keys.tenant("bearer sk-a") == "team-a" and keys.tenant("  Bearer   sk-b ") == "team-b"
    for header in (None, "", "sk-a", "Basic sk-a", "Bearer", "Bearer sk-", "Bearer sk-a2", "Bearer SK-A"):
        assert keys.tenant(header) is None, header
    as_json = tmp_path / "keys.json"
    as_json.write_text(json.dumps({"sk-x": "x", "sk-y": "y"}))
    assert ApiKeys.from_file(as_json).tenant("Bearer sk-y") == "y"


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("sk-a\n", "line 1: expected 'KEY TENANT'"),
        ("sk-a t1 extra\n", "line 1"),
        ("sk-a t1\nsk-a t2\n", "line 2: this key appears twice"),
        ("# nothing\n", "no API keys"),
        ('{"sk-a": 5}', "tenant"),
        ('{"sk-a": "  "}', "tenant"),
        ('{"": "t"}', "non-empty"),
        ("[1]", "line 1"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_key_files_name_the_problem(tmp_path, content, match):
    path = tmp_path / "keys"
    path.write_text(content)
    with pytest.raises(ApiKeysError, match=match):
        ApiKeys.from_file(path)


def test_a_missing_key_file_is_a_clear_error(tmp_path):
    with pytest.raises(ApiKeysError, match="cannot read"):
        ApiKeys.from_file(tmp_path / "absent")


def test_the_command_line_turns_a_bad_key_file_into_a_usage_error(tmp_path):
    from pagedcore.cli.common import UsageError
    from pagedcore.serve.cli import load_api_keys

    path = tmp_path / "keys"
    path.write_text("sk-1 team-a\n")
    assert load_api_keys(str(path), UsageError).tenant("Bearer sk-1") == "team-a"
    with pytest.raises(UsageError, match="cannot read"):
        load_api_keys(str(tmp_path / "absent"), UsageError)


def test_a_missing_extra_is_named_in_one_line(capsys):
    from pagedcore.serve.cli import missing_extra

    assert missing_extra("pagedcore serve --ray", "ray", ("json", "pagedcore_no_such_module"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "pagedcore serve --ray: needs the ray extra: pip install 'pagedcore[ray]'" in err
    assert "pagedcore_no_such_module" in err


def test_serve_packages_import_names_lazily_and_refuse_unknown_ones():
    import pagedcore.serve as serve
    import pagedcore.serve.ray as serve_ray

    assert serve.EngineLoop.__module__ == "pagedcore.serve.loop"
    assert serve_ray.ModelSpec.__module__ == "pagedcore.serve.ray.model_spec"
    for module in (serve, serve_ray):
        with pytest.raises(AttributeError, match="has no attribute 'nope'"):
            module.nope  # noqa: B018


def test_every_key_is_compared_whichever_matches(monkeypatch):
    keys = ApiKeys({f"sk-{i}": f"t{i}" for i in range(5)})
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for header in ("Bearer sk-0", "Bearer sk-4", "Bearer nope"):
        calls.clear()
        keys.tenant(header)
        assert len(calls) == 5, header


# ---------------------------------------------------------------------- request bodies
def test_no_op_values_of_unsupported_fields_are_accepted():
    body = {"model": "m", "prompt": "x", "logprobs": None, "echo": False, "best_of": 1, "presence_penalty": 0.0}
    body.update(frequency_penalty=0, logit_bias={}, suffix=None, user="u", some_future_field=[1])
    request = parse_request(CompletionRequest, json.dumps(body).encode())
    assert request.prompt == "x"
    for field, value in [("best_of", True), ("echo", 0), ("logprobs", 0), ("presence_penalty", 0.1)]:
        with pytest.raises(ApiError, match=field):
            parse_request(CompletionRequest, json.dumps({**body, field: value}).encode())


def test_openai_defaults_are_sampling_at_temperature_one():
    request = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    params = sampling_params(request, 16)
    assert (params.temperature, params.top_p, params.n, params.max_new_tokens) == (1.0, 1.0, 1, 16)
    assert not params.is_greedy


def test_engine_parameter_errors_use_the_openai_names():
    request = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    with pytest.raises(ApiError, match=r"^max_tokens must be an integer >= 0, got -2$") as caught:
        sampling_params(request, -2)
    assert caught.value.param == "max_tokens" and caught.value.status == 400


def test_stop_accepts_a_string_or_a_list():
    def stops(value):
        return stop_strings(CompletionRequest.model_validate({"model": "m", "prompt": "x", "stop": value}))

    assert stops(None) == () and stops("a") == ("a",) and stops(["a", "bc"]) == ("a", "bc")


def test_chat_max_completion_tokens_wins_over_max_tokens():
    messages = [{"role": "user", "content": "hi"}]
    request = ChatRequest.model_validate({"model": "m", "messages": messages, "max_tokens": 5})
    assert request.max_new_tokens(default=99) == 5
    request = ChatRequest.model_validate(
        {"model": "m", "messages": messages, "max_tokens": 5, "max_completion_tokens": 7}
    )
    assert request.max_new_tokens(default=99) == 7


def test_completion_prompt_forms():
    assert completion_prompts("a") == ["a"]
    assert completion_prompts([1, 2]) == [[1, 2]]
    assert completion_prompts([[1], [2, 3]]) == [[1], [2, 3]]
    assert completion_prompts(["a", "b"]) == ["a", "b"]
    with pytest.raises(ApiError, match="empty"):
        completion_prompts([])


# ---------------------------------------------------------------------- chat rendering
def test_the_plain_template_joins_text_parts():
    message = ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    )
    assert plain_chat_prompt([message]) == "user: ab\nassistant:"


def test_a_tokenizer_chat_template_is_used_when_there_is_one():
    tokenizer = builtin_tokenizer()
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    renderer = ChatRenderer(tokenizer)
    assert renderer.uses_template
    messages = [ChatMessage(role="developer", content="Be brief."), ChatMessage(role="user", content="Hi")]
    ids = renderer.render(messages)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1  # no second bos
    assert tokenizer.decode(ids, skip_special_tokens=True) == "[system]Be brief.[user]Hi[assistant]"


def test_a_chat_template_that_refuses_the_messages_is_a_400():
    tokenizer = builtin_tokenizer()
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ApiError, match="roles must alternate") as caught:
        ChatRenderer(tokenizer).render([ChatMessage(role="user", content="Hi")])
    assert caught.value.status == 400 and caught.value.param == "messages"
