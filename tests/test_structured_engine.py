"""Structured outputs in the Engine: constrained and unconstrained rows in one batch, forks, preemption storms, prefix
hits, compilation off the step loop, typed errors at admission; every constrained output validated with jsonschema,
every unconstrained output identical to the same request run alone."""

from __future__ import annotations

import json
import re
import threading

import pytest

pytest.importorskip("jsonschema")  # a test extra: the GPU image has none

import jsonschema
from structured_helpers import SCHEMA, bpe_tokenizer, random_model

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer
from pagedcore.adapters.transformers.structured import GrammarCompiler, StructuredOutput
from pagedcore.errors import ConfigError, GrammarError, InvalidRequestError

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    model = random_model(len(tok))
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def engine(model, tok, **kwargs):
    kwargs.setdefault("num_blocks", 256)
    kwargs.setdefault("block_size", 8)
    return Engine(model, tok, **kwargs)


def constrained(seed, n=1, max_new_tokens=160, structured=None):
    return SamplingParams(
        max_new_tokens=max_new_tokens, temperature=1.0, seed=seed, n=n, structured=structured or {"json_schema": SCHEMA}
    )


def assert_valid(outputs, schema=SCHEMA, minimum=1):
    """Every sample that finished by its grammar's end is valid; at least ``minimum`` of them did."""
    finished = 0
    for out in outputs:
        assert out.error is None, out.error
        for sample in out.samples:
            assert sample.finish_reason in ("stop", "length")
            if sample.finish_reason == "stop":
                jsonschema.validate(json.loads(sample.text), schema)
                finished += 1
    assert finished >= minimum
    return finished


def assert_no_leak(eng):
    eng.pool.kv.check_invariants()
    assert eng.pool.kv.num_used_blocks == 0


SMALL = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5},
         "w": {"enum": ["a", "bc"]}}, "required": ["n", "w"], "additionalProperties": False}  # fmt: skip
PROMPTS = ["Hello there", "The weather today", "Let me check", "how are you?"]


def test_mixed_batch_constrained_valid_unconstrained_identical(model, tok):
    plain = [SamplingParams(max_new_tokens=24) for _ in PROMPTS]
    with engine(model, tok) as eng:
        alone = eng.generate(PROMPTS, plain, use_tqdm=False)
    with engine(model, tok) as eng:
        params = [constrained(i, n=2) for i in range(len(PROMPTS))] + plain
        mixed = eng.generate(PROMPTS + PROMPTS, params, use_tqdm=False)
        assert eng.stats().num_failed == 0
        assert_no_leak(eng)
    assert [o.samples[0].token_ids for o in mixed[len(PROMPTS) :]] == [o.samples[0].token_ids for o in alone]
    assert_valid(mixed[: len(PROMPTS)], minimum=4)


@pytest.mark.slow
def test_two_hundred_constrained_completions_validate(model, tok):
    """The issue's bar: 200 constrained completions from a random model (an adversarial generator), all valid."""
    schema = SMALL
    params = [constrained(i, n=8, max_new_tokens=60, structured={"json_schema": schema}) for i in range(25)]
    with engine(model, tok, num_blocks=512, max_num_seqs=256) as eng:
        outs = eng.generate(["Hello"] * 25, params, use_tqdm=False)
        assert_no_leak(eng)
    assert sum(len(o.samples) for o in outs) == 200
    assert assert_valid(outs, schema, minimum=190) >= 190


def test_preemption_storm_and_prefix_hits_keep_every_output_valid(model, tok):
    prompt = "Let me check the weather for you, " * 3
    small = {"json_schema": SMALL}
    params = [constrained(i, 2, 40, small) for i in range(4)] + [SamplingParams(max_new_tokens=30) for _ in range(2)]
    with engine(model, tok, num_blocks=36, block_size=4, max_num_batched_tokens=64) as eng:
        outs = eng.generate([prompt] * 6, params, use_tqdm=False)
        stats = eng.stats()
        assert_no_leak(eng)
    assert stats.num_preemptions > 0
    assert stats.prefix_hit_tokens > 0
    assert_valid(outs[:4], SMALL, minimum=4)


@pytest.mark.parametrize(
    ("structured", "check"),
    [
        ({"type": "json_object"}, lambda text: isinstance(json.loads(text), dict)),
        ({"guided_regex": "[a-z]{2,5}-[0-9]{2}"}, lambda text: re.fullmatch("[a-z]{2,5}-[0-9]{2}", text)),
        ({"guided_choice": ["alpha", "beta", "gamma delta"]}, lambda text: text in ("alpha", "beta", "gamma delta")),
        ({"guided_grammar": 'root ::= "(" [0-9]+ ("," [0-9]+)* ")"'}, lambda t: re.fullmatch(r"\(\d+(,\d+)*\)", t)),
    ],
    ids=["json_object", "regex", "choice", "grammar"],
)
def test_every_kind_through_the_engine(model, tok, structured, check):
    with engine(model, tok) as eng:
        outs = eng.generate(["Hello"], SamplingParams(max_new_tokens=80, structured=structured), use_tqdm=False)
    sample = outs[0].samples[0]
    assert sample.finish_reason == "stop"
    assert check(sample.text)


def test_generate_kwargs_take_structured_and_response_format(model, tok):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    rf = {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema, "strict": True}}
    with engine(model, tok) as eng:
        a = eng.generate(["Hello"], max_new_tokens=60, do_sample=False, response_format=rf, use_tqdm=False)[0]
        b = eng.generate(["Hello"], max_new_tokens=60, do_sample=False, structured={"json": schema}, use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="not both"):
            eng.generate(["Hello"], structured={"json": schema}, response_format=rf, use_tqdm=False)
    assert a.samples[0].finish_reason == "stop"
    assert json.loads(a.samples[0].text) == json.loads(b[0].samples[0].text)
    assert set(json.loads(a.samples[0].text)) == {"ok"}


def test_an_unfinished_structure_finishes_by_length(model, tok):
    with engine(model, tok) as eng:
        out = eng.generate(["Hello"], constrained(0, max_new_tokens=5), use_tqdm=False)[0]
    assert out.samples[0].finish_reason == "length"
    assert len(out.samples[0].token_ids) == 5


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_no_token_can_continue_fails_its_request_only(temperature):
    """The built-in ASCII vocabulary spells "a" but not the "é" the regex forces next: llguidance's mask then allowed
    ``<unk>`` alone, which its matcher refused ("token 3 is not allowed"). Now no token is allowed, and the request
    fails as the client's GrammarError saying so; the other request and the blocks are untouched."""
    tok = builtin_tokenizer()
    params = SamplingParams(max_new_tokens=6, temperature=temperature, seed=1, structured={"regex": "aé"})
    with Engine(builtin_model(num_hidden_layers=1), tok, num_blocks=32, block_size=8) as eng:
        out = eng.generate(["Hello", "Hi"], [params, SamplingParams(max_new_tokens=3)], use_tqdm=False)
        assert out[0].client_error and "GrammarError" in (out[0].error or "")
        assert "no token of the model's vocabulary can continue the output after 1 tokens" in (out[0].error or "")
        assert out[0].samples[0].token_ids == tok("a", add_special_tokens=False)["input_ids"]
        assert out[1].error is None and len(out[1].samples[0].token_ids) == 3
        assert_no_leak(eng)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_model_that_prefers_the_stop_token_gets_it_only_where_the_grammar_ends(temperature):
    """After "a", ``start: "a" (<[1]> | "b")`` must go on, but its mask allowed the stop token: a model that prefers
    it (here by its bias) drew it and the request failed with "GrammarError: ... token 2 is not allowed". Now it draws
    ``<s>`` or "b", then the stop token, where the grammar may end."""
    tok = builtin_tokenizer()
    eos = tok.eos_token_id
    structured = {"grammar": 'start: "a" (<[1]> | "b")'}
    params = SamplingParams(max_new_tokens=6, temperature=temperature, seed=1, structured=structured,
                            logit_bias={eos: 50.0})  # fmt: skip
    with Engine(builtin_model(num_hidden_layers=1), tok, num_blocks=32, block_size=8) as eng:
        (out,) = eng.generate(["Hello"], params, use_tqdm=False)
        assert out.error is None, out.error
        tokens = out.samples[0].token_ids
        assert tokens[0] == tok("a", add_special_tokens=False)["input_ids"][0] and tokens[-1] == eos
        assert len(tokens) == 3 and out.samples[0].finish_reason == "stop"
        assert_no_leak(eng)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"structured": {"json_schema": {"type": "array", "uniqueItems": True}}}, "uniqueItems"),
        ({"structured": {"regex": "(("}}, "invalid regex"),
        ({"structured": {"json_schema": {"type": "object"}, "regex": "a"}}, "exactly one"),
        ({"structured": {"type": "json_schema"}}, "json_schema needs"),
        ({"structured": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        ({"structured": {"type": "json_object"}, "min_new_tokens": 3}, "min_new_tokens"),
    ],
)
def test_bad_specs_are_refused_at_admission(model, tok, params, message):
    with engine(model, tok) as eng:
        with pytest.raises(GrammarError, match=message):
            eng.add_request("Hello", params)
        assert not eng.has_unfinished()
        out = eng.generate(["Hello", "Hi"], [params, SamplingParams(max_new_tokens=3)], use_tqdm=False)
        assert "GrammarError" in out[0].error and out[1].error is None
        assert_no_leak(eng)


def test_structured_needs_the_tokenizer(model):
    with Engine(model, num_blocks=32, block_size=8) as eng, pytest.raises(InvalidRequestError, match="tokenizer"):
        eng.add_request([1, 2, 3], SamplingParams(structured={"type": "json_object"}))


def _slow_compiles(monkeypatch):
    """Compilations wait for the returned event (as a pathological schema would)."""
    gate = threading.Event()
    compile_ = GrammarCompiler._compile

    def slow(self, spec, grammar):
        gate.wait(30)
        return compile_(self, spec, grammar)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    return gate


def test_compilation_never_blocks_the_other_requests(model, tok, monkeypatch):
    gate = _slow_compiles(monkeypatch)
    with engine(model, tok) as eng:
        slow = eng.add_request("Hello", constrained(1, 1, 60, {"json_schema": SMALL}))
        fast = eng.add_request("Hi", SamplingParams(max_new_tokens=6))
        done = {}
        while fast not in done:
            done.update((o.request_id, o) for o in eng.step())
        assert slow not in done  # the plain request finished while the grammar was still compiling
        gate.set()
        while eng.has_unfinished():
            done.update((o.request_id, o) for o in eng.step())
        assert_valid([done[slow]], SMALL)
        assert_no_leak(eng)


def test_a_grammar_past_compile_timeout_fails_its_request_only(model, tok, monkeypatch):
    gate = _slow_compiles(monkeypatch)
    try:
        with engine(model, tok, compile_timeout=0.2) as eng:
            outs = eng.generate(["Hello", "Hi"], [constrained(0), SamplingParams(max_new_tokens=4)], use_tqdm=False)
            assert "did not compile within 0.2 s" in outs[0].error
            assert outs[0].samples[0].finish_reason == "error"
            assert outs[1].error is None and len(outs[1].samples[0].token_ids) == 4
            assert_no_leak(eng)
    finally:
        gate.set()


def test_abort_while_compiling(model, tok, monkeypatch):
    gate = _slow_compiles(monkeypatch)
    with engine(model, tok) as eng:
        rid = eng.add_request("Hello", constrained(0))
        eng.step()
        assert eng.abort(rid).samples[0].finish_reason == "abort"
        gate.set()
        for _ in range(3):
            eng.step()
        assert not eng.has_unfinished()
        assert_no_leak(eng)


def test_compiled_grammars_are_shared_across_requests(model, tok):
    with engine(model, tok) as eng:
        eng.generate(["Hello", "Hi", "Hey"], [constrained(i, 1, 40, {"json": SMALL}) for i in range(3)], use_tqdm=False)
        stats = eng._admission.grammars.compiler.stats
    assert stats.num_compiled == 1 and stats.num_hits == 2


def test_spec_objects_are_accepted_as_is(model, tok):
    spec = StructuredOutput.choice(["yes", "no"])
    with engine(model, tok) as eng:
        out = eng.generate(["Hello"], SamplingParams(max_new_tokens=10, structured=spec), use_tqdm=False)[0]
    assert out.samples[0].text in ("yes", "no")


@pytest.mark.parametrize("value", [0, -1.0, True, "30"])
def test_compile_timeout_must_be_positive_seconds(model, tok, value):
    with pytest.raises(ConfigError, match="compile_timeout"):
        Engine(model, tok, num_blocks=8, block_size=8, compile_timeout=value)
    assert model.config._attn_implementation != "paged"  # nothing was switched before the refusal
