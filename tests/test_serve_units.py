"""The server's pure parts: API keys, request parsing, chat rendering (stop strings are the Engine's: see
test_text_units.py)."""

from __future__ import annotations

import hmac
import json

import pytest

from pagedcore.adapters.transformers.builtin import builtin_tokenizer
from pagedcore.serve import auth
from pagedcore.serve.auth import ApiKeys, ApiKeysError
from pagedcore.serve.prompts import ChatRenderer, PromptEncoder, completion_prompts, plain_chat_prompt, text_bound
from pagedcore.serve.protocol import (
    MAX_PROMPTS,
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
    from pagedcore.serve.auth import load_api_keys

    path = tmp_path / "keys"
    path.write_text("sk-1 team-a\n")
    assert load_api_keys(str(path), UsageError).tenant("Bearer sk-1") == "team-a"
    with pytest.raises(UsageError, match="cannot read"):
        load_api_keys(str(tmp_path / "absent"), UsageError)


def test_a_missing_extra_is_named_in_one_line(capsys):
    from pagedcore.cli.common import missing_extra

    assert missing_extra("pagedcore serve --ray", "ray", ("json", "pagedcore_no_such_module"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "pagedcore serve --ray: needs the ray extra: make install EXTRAS=ray in the pagedcore checkout" in err
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
    body.update(frequency_penalty=0, logit_bias={}, suffix=None, user="u")
    request = parse_request(CompletionRequest, json.dumps(body).encode())
    assert request.prompt == "x"
    # A field that neither OpenAI nor vLLM defines is refused too (pagedcore.serve.fields), not ignored.
    cases = [("best_of", True), ("best_of", 2), ("echo", 0), ("use_beam_search", True), ("some_future_field", [1])]
    for field, value in cases:
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


def test_a_json_key_file_with_a_key_twice_is_refused_without_showing_the_key(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text('{"sk-secret-1": "alice", "sk-other": "carol", "sk-secret-1": "bob"}')
    with pytest.raises(ApiKeysError, match="entry 3 repeats the key of entry 1") as caught:
        ApiKeys.from_file(path)
    assert "sk-secret-1" not in str(caught.value) and str(path) in str(caught.value)


# ---------------------------------------------------------------------- sizes before work
def test_id_lists_and_message_lists_are_refused_by_length_before_their_elements_are_checked():
    too_many = json.dumps({"model": "m", "prompt": [5] * 600 + ["not an id"]}).encode()
    with pytest.raises(ApiError, match="601 token ids, more than the model's context of 512") as caught:
        parse_request(CompletionRequest, too_many, max_prompt_tokens=512)
    assert caught.value.param == "prompt"
    batch = json.dumps({"model": "m", "prompt": [[5] * 3, [5] * 513]}).encode()
    with pytest.raises(ApiError, match="prompt 1 has 513 token ids"):
        parse_request(CompletionRequest, batch, max_prompt_tokens=512)
    many = json.dumps({"model": "m", "prompt": ["a"] * (MAX_PROMPTS + 1)}).encode()
    with pytest.raises(ApiError, match=f"at most {MAX_PROMPTS} prompts"):
        parse_request(CompletionRequest, many)
    messages = json.dumps({"model": "m", "messages": [{"role": "user"}] * 9}).encode()
    with pytest.raises(ApiError, match="9 messages cannot fit in the model's context of 8 tokens") as caught:
        parse_request(ChatRequest, messages, max_prompt_tokens=8)
    assert caught.value.param == "messages"
    fits = json.dumps({"model": "m", "prompt": [5] * 512}).encode()
    assert len(parse_request(CompletionRequest, fits, max_prompt_tokens=512).prompt) == 512


@pytest.mark.parametrize("depth", [10_000, 100_000])
def test_deeply_nested_json_is_a_400(depth):
    for body in (b"[" * depth, b'{"model": "m", "prompt": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"):
        with pytest.raises(ApiError, match="nests too deeply"):
            parse_request(CompletionRequest, body)


def test_a_huge_unsupported_value_is_named_briefly():
    body = json.dumps({"model": "m", "prompt": "x", "bad_words": [str(i) for i in range(100_000)]}).encode()
    with pytest.raises(ApiError, match="bad_words is not supported") as caught:
        parse_request(CompletionRequest, body)
    assert len(caught.value.message) < 200


class CountingTokenizer:
    """The built-in tokenizer, recording the length of every text it is asked to encode."""

    def __init__(self):
        self.inner = builtin_tokenizer()
        self.lengths: list[int] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.inner(text, **kwargs)


def test_a_text_longer_than_the_context_can_hold_never_reaches_the_tokenizer():
    tokenizer = CountingTokenizer()
    encoder = PromptEncoder(tokenizer, context=512)
    assert encoder.max_chars == 512 * len("<unk>")  # the longest vocabulary entry
    assert encoder.completion("x" * encoder.max_chars) == [[tokenizer.inner.convert_tokens_to_ids("x")] * 2560]
    for oversized in ("x" * (encoder.max_chars + 1), "y" * 5_000_000):
        with pytest.raises(ApiError, match="more than the model's context of 512 tokens can hold") as caught:
            encoder.completion(["short", oversized])
        assert caught.value.param == "prompt"
        with pytest.raises(ApiError, match="the messages have"):
            encoder.chat([ChatMessage(role="user", content=oversized)])
    assert max(tokenizer.lengths) == encoder.max_chars


def test_the_character_bound_holds_for_real_tokenizer_kinds_and_is_off_where_characters_can_vanish():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def fast(normalizer=None, pre_tokenizer=None, vocab=None):
        core = Tokenizer(models.WordLevel(vocab or {"<unk>": 0, "ab": 1, "a": 2, "b": 3}, unk_token="<unk>"))
        if normalizer is not None:
            core.normalizer = normalizer
        if pre_tokenizer is not None:
            core.pre_tokenizer = pre_tokenizer
        return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")

    assert text_bound(fast(), 10) == 50  # "<unk>"
    assert text_bound(fast(normalizers.NFC()), 10) == 200  # composition may merge characters
    assert text_bound(fast(normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])), 10) == 200
    assert text_bound(fast(normalizers.Replace(" ", "\u2581")), 10) == 50
    for dropping in (
        dict(normalizer=normalizers.BertNormalizer()),
        dict(normalizer=normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])),
        dict(normalizer=normalizers.Replace("  ", " ")),
        dict(pre_tokenizer=pre_tokenizers.Whitespace()),
        dict(pre_tokenizer=pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.WhitespaceSplit()])),
        dict(pre_tokenizer=pre_tokenizers.Split(" ", behavior="removed")),
        dict(normalizer=normalizers.Nmt()),
        dict(pre_tokenizer=pre_tokenizers.CharDelimiterSplit(" ")),
    ):
        assert text_bound(fast(**dropping), 10) is None, dropping
    assert text_bound(None, 10) is None and text_bound(builtin_tokenizer(), None) is None


def test_the_character_bound_is_sound_for_a_byte_level_bpe_over_utf8_text():
    """A byte-level BPE (GPT-2's kind) trained here: every text of at most the bound's characters may fit, and any
    text over it needs more tokens than the context (checked on texts near the bound, multi-byte ones included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    corpus = ["the tide comes in, the tide goes out", "潮の満ち引き", "🌊 waves 🌊", "aaaaaaaaaaaaaaaa"] * 50
    core.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core)
    context = 16
    bound = text_bound(tokenizer, context)
    assert bound is not None
    for text in ("a" * 4000, "潮" * 4000, "🌊" * 4000, "the tide comes in, " * 300):
        for length in (bound + 1, bound + 7):
            assert len(tokenizer(text[:length])["input_ids"]) > context, (text[:8], length)


def test_a_body_still_arriving_when_the_server_drains_gets_503_at_once():
    """Regression (an outside audit): on SIGTERM a client still sending its body was neither admitted nor ended by
    the drain, so uvicorn cancelled it at its own graceful timeout (5 s, past --shutdown-timeout 2) with a
    traceback. The read now answers 503 as soon as admission closes; without a shutdown it waits as before."""
    import asyncio

    from starlette.requests import Request

    from pagedcore.serve.admission import Admission
    from pagedcore.serve.body import BodyLimits, read_body
    from pagedcore.serve.protocol import ApiError

    async def scenario() -> tuple[ApiError, bytes]:
        admission = Admission()
        forever = asyncio.Event()

        async def stalled():  # the first chunk came; the rest never does
            await forever.wait()

        chunks = [{"type": "http.request", "body": b'{"a": ', "more_body": True}]

        async def receive():
            return chunks.pop(0) if chunks else await stalled()

        request = Request({"type": "http", "method": "POST", "headers": []}, receive)
        reading = asyncio.ensure_future(read_body(request, BodyLimits(timeout=60.0), admission))
        await asyncio.sleep(0.3)
        assert not reading.done()
        admission.close()
        try:
            await asyncio.wait_for(reading, 2.0)
        except ApiError as exc:
            refused = exc
        whole = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def quick():
            return whole.pop(0)

        body = await read_body(Request({"type": "http", "method": "POST", "headers": []}, quick), BodyLimits())
        return refused, body

    refused, body = asyncio.run(scenario())
    assert refused.status == 503 and "shutting down" in str(refused) and body == b"{}"
