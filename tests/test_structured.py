"""Structured outputs without the Engine: specs, the compiler (cache, worker, bounded time, typed errors), the
per-sample grammar state (sync, rollback, fork), the batched masks, and the transformers logits processor for
plain ``model.generate`` (with and without ``enable()``), checked against xgrammar's own processor."""

from __future__ import annotations

import json
import threading
import types

import numpy
import pytest

pytest.importorskip("jsonschema")  # a test extra: the GPU image has none

import jsonschema
import torch
from structured_helpers import SCHEMA, bpe_tokenizer, random_model

import pagedcore.adapters.transformers as pc
from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer
from pagedcore.adapters.transformers.structured import (
    GrammarCompiler,
    GrammarMasks,
    GrammarState,
    StructuredLogitsProcessor,
    StructuredOutput,
)
from pagedcore.errors import GrammarError, GrammarTimeoutError

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok):
    compiler = GrammarCompiler(tok, vocab_size=len(tok))
    yield compiler
    compiler.close()


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------------------- specs
def test_specs_from_openai_and_vllm_shapes():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": False}}
    spec = StructuredOutput.from_response_format(rf)
    assert spec == StructuredOutput.json_schema(json.dumps(schema), strict=False)
    assert list(json.loads(spec.spec)["properties"]) == ["b", "a"]  # generation order is the schema's order
    assert StructuredOutput.from_response_format({"type": "text"}) is None
    assert StructuredOutput.from_response_format({"type": "json_object"}).kind == "json_object"
    assert StructuredOutput.from_value({"guided_json": schema}) == StructuredOutput.json_schema(schema)
    assert StructuredOutput.from_value({"json": schema}).kind == "json_schema"
    assert StructuredOutput.from_value({"guided_regex": "[0-9]+"}) == StructuredOutput.regex("[0-9]+")
    assert StructuredOutput.from_value({"guided_grammar": "root ::= [a-z]+"}).kind == "grammar"
    assert StructuredOutput.from_value({"json_object": True}).kind == "json_object"
    assert StructuredOutput.choice(["a", "b"]).choices == ["a", "b"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: StructuredOutput.from_value({"regex": "a", "choice": ["b"]}), "exactly one of"),
        (lambda: StructuredOutput.from_value({}), "exactly one of"),
        (lambda: StructuredOutput.from_value({"jsonschema": {}}), "exactly one of"),
        (lambda: StructuredOutput.choice([]), "non-empty list"),
        (lambda: StructuredOutput.choice("ab"), "non-empty list"),
        (lambda: StructuredOutput.choice(["a", 3]), "non-empty string"),
        (lambda: StructuredOutput.json_schema("{not json"), "not valid JSON"),
        (lambda: StructuredOutput.json_schema([1, 2]), "expected a JSON object"),
        (lambda: StructuredOutput.json_schema({"x": float("nan")}), "cannot be written as JSON"),
        (lambda: StructuredOutput.from_response_format({"type": "json_schema"}), "needs"),
        (lambda: StructuredOutput.from_response_format({"type": "xml"}), "response_format type"),
        (lambda: StructuredOutput.from_response_format({"type": "structural_tag"}), "response_format type"),
        (lambda: StructuredOutput("yaml", ""), "unknown structured-output kind"),
        (lambda: StructuredOutput.json_schema({}, max_whitespace=-1), "max_whitespace"),
    ],
)
def test_bad_specs_are_typed_errors(make, message):
    with pytest.raises(GrammarError, match=message):
        make()


# ------------------------------------------------------------------------------------------------------- compiler
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput.json_schema({"type": "objec"}), "invalid json_schema .*Invalid type: objec"),
        (StructuredOutput.json_schema({"type": "string", "pattern": "a("}), "invalid json_schema .*unclosed group"),
        (
            StructuredOutput.json_schema({"type": "array", "uniqueItems": True}),
            r'Unimplemented keys: \["uniqueItems"\]',
        ),
        (StructuredOutput.regex("a(b"), "invalid regex 'a\\(b': .*unclosed group"),
        (StructuredOutput.grammar("root ::= foo"), "Rule 'foo' not found"),
        (StructuredOutput.grammar("start: ("), "invalid grammar"),
        (StructuredOutput.grammar("start: foo"), 'unknown name: "foo"'),
    ],
)
def test_invalid_specs_raise_at_parse(compiler, spec, message):
    with pytest.raises(GrammarError, match=message):
        compiler.parse(spec)
    with pytest.raises(GrammarError):
        compiler.submit(spec)  # refused before anything is queued


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput.regex("é+"), "no token of the model's vocabulary can start an output of it"),
        (StructuredOutput.choice(["é", "ü"]), "cannot compile choice"),  # llguidance's own message
    ],
)
def test_a_grammar_no_token_can_start_is_refused_at_compile(spec, message):
    """The built-in ASCII vocabulary cannot spell "é": llguidance's first mask allows only ``<unk>``, which it
    then refuses, so the request was admitted and failed at its first token (a 200 stream ending in an error)."""
    compiler = GrammarCompiler(builtin_tokenizer(), vocab_size=len(builtin_tokenizer()))
    try:
        with pytest.raises(GrammarError, match=message):
            compiler.compile(spec)
        assert compiler.compile(StructuredOutput.regex("a+")).vocab_size == len(builtin_tokenizer())
    finally:
        compiler.close()


def test_a_later_mask_never_allows_a_special_token_the_matcher_refuses():
    """After "a", the regex "aé" forces "é", which the built-in ASCII vocabulary cannot spell: llguidance tokenizes
    the forced text and its mask allowed only ``<unk>``, which its matcher then refused (the request failed with
    "token 3 is not allowed", after its 200). Now that mask allows nothing and the state says why, in a batch with
    another row (the parallel fill) and alone; a special token the grammar asks for (``<[1]>``) stays allowed."""
    tok = builtin_tokenizer()
    compiler = GrammarCompiler(tok, vocab_size=len(tok))
    try:
        for batched in (True, False):
            stuck = GrammarState(compiler.compile(StructuredOutput.regex("aé")))
            marked = GrammarState(compiler.compile(StructuredOutput.grammar('start: "a" (<[1]> | "b")')))
            assert stuck.sync(ids(tok, "a")) and marked.sync(ids(tok, "a")) and stuck.error is None
            logits = torch.zeros(3, len(tok))
            if batched:
                GrammarMasks().apply(logits, [0, 2], [stuck, marked])
            else:
                GrammarMasks().apply(logits, [0], [stuck])
                GrammarMasks().apply(logits, [2], [marked])
            assert not torch.isfinite(logits[0]).any()
            assert "no token of the model's vocabulary can continue the output after 1 tokens" in (stuck.error or "")
            allowed = set(torch.isfinite(logits[2]).nonzero().flatten().tolist())
            assert {1, *ids(tok, "b")} <= allowed and 3 not in allowed and marked.error is None
            stuck.sync([])  # a rollback: the state can go on again
            assert stuck.error is None
    finally:
        compiler.close()


def test_a_mask_allows_the_stop_token_only_where_the_grammar_may_end():
    """After "a", ``start: "a" (<[1]> | "b")`` must go on (``<s>`` or "b"), yet llguidance's mask allowed the stop
    token ``</s>`` too, which the matcher then refused ("token 2 is not allowed", after the request's 200). Now the
    mask leaves it out there, batched and alone, and keeps it where the grammar is complete."""
    tok = builtin_tokenizer()
    compiler = GrammarCompiler(tok, vocab_size=len(tok))
    eos = tok.eos_token_id
    try:
        for batched in (True, False):
            spec = StructuredOutput.grammar('start: "a" (<[1]> | "b")')
            going, ended = GrammarState(compiler.compile(spec)), GrammarState(compiler.compile(spec))
            assert going.sync(ids(tok, "a")) and ended.sync(ids(tok, "ab")) and ended.is_complete
            logits = torch.zeros(2, len(tok))
            if batched:
                GrammarMasks().apply(logits, [0, 1], [going, ended])
            else:
                GrammarMasks().apply(logits, [0], [going])
                GrammarMasks().apply(logits, [1], [ended])
            allowed = set(torch.isfinite(logits[0]).nonzero().flatten().tolist())
            assert allowed == {1, *ids(tok, "b")} and going.error is None and not going.accept(eos)
            assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [eos] and ended.accept(eos)
    finally:
        compiler.close()


def test_processor_raises_when_no_token_can_continue():
    """Plain ``generate`` under a grammar stuck after its first token: a GrammarError, not a row that drew
    ``<unk>`` and then ran unconstrained."""
    tok = builtin_tokenizer()
    model = builtin_model(num_hidden_layers=1)
    processor = StructuredLogitsProcessor({"regex": "aé"}, tok, vocab_size=len(tok))
    with pytest.raises(GrammarError, match="row 0: no token of the model's vocabulary can continue"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False, logits_processor=[processor],
                       eos_token_id=tok.eos_token_id)  # fmt: skip


def test_compiled_grammars_are_cached_by_spec(tok):
    compiler = GrammarCompiler(tok, vocab_size=len(tok))
    try:
        spec = StructuredOutput.json_schema(SCHEMA)
        first = compiler.compile(spec)
        assert compiler.compile(StructuredOutput.json_schema(json.dumps(SCHEMA))) is first
        assert compiler.stats.num_compiled == 1 and compiler.stats.num_hits == 1
        assert compiler.is_compiled(spec)
        assert compiler.compile(StructuredOutput.json_schema(SCHEMA, strict=False)) is not first  # another key
    finally:
        compiler.close()


def test_compile_runs_in_a_worker_and_its_wait_is_bounded(tok, monkeypatch):
    compiler = GrammarCompiler(tok, vocab_size=len(tok), compile_timeout=0.05)
    llg = compiler._llg
    release = threading.Event()
    callers = []

    class SlowMatcher:  # llguidance's matcher, built only once the test says so
        def __new__(cls, *args, **kwargs):
            callers.append(threading.current_thread().name)
            release.wait(30)
            return llg.LLMatcher(*args, **kwargs)

    spec = StructuredOutput.regex("[a-z]+")
    compiler.parse(spec)  # parsed (and cached) with the real llguidance; only the build is slow
    monkeypatch.setattr(compiler, "_llg", types.SimpleNamespace(LLMatcher=SlowMatcher))
    try:
        with pytest.raises(GrammarTimeoutError, match=r"regex \[a-z\]\+ did not compile within 0.05 s"):
            compiler.compile(spec)
        assert compiler.stats.num_timeouts == 1 and not compiler.is_compiled(spec)
        release.set()
        compiled = compiler.compile(spec, timeout=30)  # the compilation went on and was cached
        assert compiler.is_compiled(spec) and compiler.compile(spec) is compiled
        assert callers == ["pagedcore-grammar_0"]
    finally:
        release.set()
        compiler.close()


# ------------------------------------------------------------------------------------------------------ the state
def test_state_follows_the_tokens_rollback_rebuild_and_fork(tok, compiler):
    compiled = compiler.compile(StructuredOutput.json_schema(SCHEMA))
    doc = ids(tok, json.dumps({"id": "AB-123", "status": "closed", "score": 9}))
    state = GrammarState(compiled)
    for k in range(1, 8):
        assert state.sync(doc[:k]) and state.num_tokens == k
    fork = state.fork()
    assert state.sync(doc[:3]) and state.num_tokens == 3  # rolled back (a dropped token, a recompute)
    assert fork.num_tokens == 7 and fork.sync(doc[:9])  # the fork kept its own position
    assert state.sync(doc[:9])  # forward again from the rolled-back position
    masks = GrammarMasks()
    bitmask = masks.fill([state, fork])
    assert torch.equal(bitmask[0], bitmask[1])  # same tokens, same position
    assert not state.sync([*doc[:2], ids(tok, "}")[0]])  # a token the grammar refuses
    assert state.num_tokens == 2  # it kept what it could accept


def test_state_rebuilds_when_rollback_cannot_reach(tok, compiler):
    compiled = compiler.compile(StructuredOutput.regex("[a-z]{1,20}"))

    class NoRollback:  # a matcher that cannot roll back (past its history, say)
        def __init__(self, inner):
            self.inner = inner

        def rollback(self, count):
            return False

        def __getattr__(self, name):
            return getattr(self.inner, name)

    state = GrammarState(compiled, matcher=NoRollback(compiled.matcher.deep_copy()))
    assert state.sync(ids(tok, "abcdef"))
    assert state.sync(ids(tok, "abx"))  # rebuilt from the start
    assert state.num_tokens == len(ids(tok, "abx")) and not isinstance(state.matcher, NoRollback)
    assert not state.is_complete or state.sync(ids(tok, "abxy"))


# ------------------------------------------------------------------------------------------------------ the masks
@pytest.mark.parametrize("rows", [[0], [1, 2, 3], [0, 2, 5], [5]])
def test_masks_touch_only_the_constrained_rows_and_match_llguidance(tok, compiler, rows):
    specs = [StructuredOutput.json_schema(SCHEMA), StructuredOutput.regex("[0-9]+"), StructuredOutput.choice(["yes"])]
    states = [GrammarState(compiler.compile(specs[i % 3])) for i in range(len(rows))]
    logits = torch.randn(6, len(tok) + 5)  # the model's logits may be wider than the tokenizer
    before = logits.clone()
    GrammarMasks().apply(logits, rows, states)
    for i in range(6):
        if i not in rows:
            assert torch.equal(logits[i], before[i])  # unconstrained rows: not read, not written
    for k, state in zip(rows, states):
        bits = state.matcher.compute_bitmask()  # llguidance's own mask, one bit per token
        allowed = torch.tensor([t < len(tok) and bool(bits[t // 8] >> (t % 8) & 1) for t in range(len(tok) + 5)])
        assert torch.equal(logits[k], before[k].masked_fill(~allowed, float("-inf")))
    assert torch.isinf(logits[rows, len(tok) :]).all()  # beyond the grammar's vocabulary: never


# ------------------------------------------------------------------------------------------------------ generate()
class NaiveProcessor:
    """The reference: every call, each row's matcher is rebuilt from the start over its whole history, and its
    mask (llguidance's bytes, read bit by bit here) applied with ``masked_fill``."""

    def __init__(self, compiled, prompt_length):
        self.compiled, self.prompt_length = compiled, prompt_length

    def __call__(self, input_ids, scores):
        for row, history in enumerate(input_ids[:, self.prompt_length :].tolist()):
            matcher = self.compiled.matcher.deep_copy()
            if history[-1:] == list(self.compiled.stop_token_ids) or not all(matcher.consume_token(t) for t in history):
                continue  # ended (then padded)
            bits = numpy.unpackbits(numpy.frombuffer(matcher.compute_bitmask(), numpy.uint8), bitorder="little")
            allowed = torch.zeros(scores.shape[1], dtype=torch.bool)
            width = min(len(bits), scores.shape[1])
            allowed[:width] = torch.from_numpy(bits[:width].astype(bool))
            scores[row] = scores[row].masked_fill(~allowed, float("-inf"))
        return scores


def _reference_tokens(model, tok, compiled, prompt, new):
    out = model.generate(
        prompt, max_new_tokens=new, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
        logits_processor=[NaiveProcessor(compiled, prompt.shape[1])],
    )  # fmt: skip
    return out[:, prompt.shape[1] :]


@pytest.mark.parametrize("enabled", [False, True], ids=["plain", "enable"])
def test_processor_matches_a_naive_reference_and_outputs_validate(tok, compiler, enabled):
    model = random_model(len(tok))
    schema = {key: SCHEMA[key] for key in ("type", "additionalProperties")}
    schema |= {"properties": {k: SCHEMA["properties"][k] for k in ("id", "score", "tags")}, "required": ["id", "score"]}
    spec = StructuredOutput.json_schema(schema, max_whitespace=2)
    prompt = torch.tensor([ids(tok, "Give me a record: ")])
    expected = _reference_tokens(model, tok, compiler.compile(spec), prompt, 100)
    if enabled:
        pc.enable(model, num_blocks=64, block_size=8)
    try:
        for _ in range(2 if enabled else 1):  # enabled: the second call hits the cached prompt prefix
            processor = StructuredLogitsProcessor(spec, tok, compiler=compiler)
            out = model.generate(
                prompt, max_new_tokens=100, do_sample=False, logits_processor=[processor],
                eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
            )  # fmt: skip
            assert torch.equal(out[:, prompt.shape[1] :], expected)
    finally:
        if enabled:
            pool = pc.prefix_pool(model)
            pc.disable(model)
            assert pool.num_hit_tokens > 0
    assert tok.eos_token_id in expected[0].tolist()  # a whole document (then padding)
    text = tok.decode(expected[0], skip_special_tokens=True)
    jsonschema.validate(json.loads(text), schema)


def test_processor_with_sampling_and_parallel_sequences_and_beams(tok, compiler):
    model = random_model(len(tok), seed=3)
    spec = StructuredOutput.json_schema(SCHEMA, max_whitespace=1)
    prompt = torch.tensor([ids(tok, "Record: "), ids(tok, "Other: ")[:3] + ids(tok, "Record: ")[3:]])
    common = {"max_new_tokens": 200, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.eos_token_id,
              "attention_mask": torch.ones_like(prompt)}  # fmt: skip
    torch.manual_seed(0)
    runs = [
        model.generate(prompt, do_sample=True, num_return_sequences=3, temperature=1.5,
                       logits_processor=[StructuredLogitsProcessor(spec, tok, compiler=compiler)], **common),
        model.generate(prompt, num_beams=3, num_return_sequences=2, do_sample=False,
                       logits_processor=[StructuredLogitsProcessor(spec, tok, compiler=compiler)], **common),
    ]  # fmt: skip
    finished = 0
    for out in runs:
        for row in out[:, prompt.shape[1] :]:
            tokens = row.tolist()
            if tok.eos_token_id not in tokens:
                continue  # ran out of tokens: not a whole document
            finished += 1
            jsonschema.validate(json.loads(tok.decode(tokens, skip_special_tokens=True)), SCHEMA)
    assert finished >= 6


@pytest.mark.parametrize(
    ("structured", "check"),
    [
        ({"type": "json_object"}, lambda text: isinstance(json.loads(text), dict)),
        ({"regex": "[a-z]{2,5}-[0-9]{2}"}, lambda text: __import__("re").fullmatch("[a-z]{2,5}-[0-9]{2}", text)),
        ({"choice": ["alpha", "beta", "gamma delta"]}, lambda text: text in ("alpha", "beta", "gamma delta")),
        ({"grammar": 'root ::= "(" [0-9]+ ("," [0-9]+)* ")"'}, lambda text: text[0] == "(" and text[-1] == ")"),
        ({"grammar": 'start: "<" WORD ">"\nWORD: /[a-z]+/'}, lambda text: text[0] == "<" and text[-1] == ">"),
    ],
    ids=["json_object", "regex", "choice", "ebnf", "lark"],
)
def test_every_kind_on_the_builtin_tokenizer(structured, check):
    model, tok = builtin_model(num_hidden_layers=1), builtin_tokenizer()
    processor = StructuredLogitsProcessor(structured, tok, vocab_size=99)
    out = model.generate(
        torch.tensor([[5, 6, 7]]), max_new_tokens=120, do_sample=False, logits_processor=[processor],
        eos_token_id=tok.eos_token_id, pad_token_id=0,
    )  # fmt: skip
    tokens = out[0, 3:].tolist()
    assert tok.eos_token_id in tokens
    assert check(tok.decode(tokens, skip_special_tokens=True))


def test_processor_refuses_bad_input_before_generate(tok):
    with pytest.raises(GrammarError, match="invalid regex"):
        StructuredLogitsProcessor({"regex": "(("}, tok)
    with pytest.raises(GrammarError, match="no constraint"):
        StructuredLogitsProcessor({"type": "text"}, tok)
