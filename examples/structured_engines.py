"""Choose the grammar engine of structured outputs by measurement: xgrammar, llguidance and outlines-core.

Needs: ``pip install 'pagedcore[structured-engines]'`` (llguidance, xgrammar and outlines-core; xgrammar pulls in
triton). With only the ``structured`` extra it measures llguidance alone and names the engines it could not import.

For each engine, on one 32k-token byte-level BPE vocabulary (trained here on transformers' own source text, since
nothing is downloaded), the script measures:

- **mask cost per step**: B constrained rows (B = 1, 16, 64) walk a JSON schema together; each step fills every
  row's token bitmask (the engine's batched / parallel call where it has one), applies the masks to a (B, 32000)
  float32 logits tensor, draws a token per row from random logits and advances each matcher. Fill, apply and
  advance are timed apart; medians over the steps, engines interleaved round by round;
- **compile time** of a typical JSON schema (nested objects, arrays, enums, required fields, bounded numbers,
  patterned strings), from the schema text to the first mask, with each engine's cache off; and the one-time
  tokenizer set-up;
- **correctness** on each schema feature: a valid and an invalid document per feature must be accepted / refused
  token by token, and ``--walks`` random walks per feature (random logits under the mask: an adversarial
  generator) that end must validate with ``jsonschema``; plus which request kinds each engine compiles at all
  (any JSON, regex, choice, EBNF / Lark grammar).

Run: ``python examples/structured_engines.py`` (``--quick`` for a short run). Results: docs/structured.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedcore.benchmarks.report import package_version

VOCAB = 32000
TYPICAL = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "status": {"enum": ["active", "suspended", "closed"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "age": {"type": "integer", "minimum": 18, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 5},
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}},
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
            "maxItems": 3,
        },
    },
    "required": ["id", "name", "status", "age", "address"],
    "additionalProperties": False,
}

# feature -> (schema, a valid document, an invalid one)
FEATURES: dict[str, tuple[dict[str, Any], str, str]] = {
    "nested objects": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 8},
                        "home": {
                            "type": "object",
                            "properties": {"city": {"type": "string", "maxLength": 8}},
                            "required": ["city"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["name", "home"],
                    "additionalProperties": False,
                }
            },
            "required": ["user"],
            "additionalProperties": False,
        },
        '{"user": {"name": "Ada", "home": {"city": "Paris"}}}',
        '{"user": {"name": "Ada"}}',
    ),
    "arrays": (
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4},
        "[1, 2, 3]",
        "[1, 2, 3, 4, 5]",
    ),
    "enums": (
        {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}},
            "required": ["color"],
            "additionalProperties": False,
        },
        '{"color": "green"}',
        '{"color": "purple"}',
    ),
    "required fields": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"type": "null"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
        '{"a": 1, "b": true}',
        '{"a": 1, "c": null}',
    ),
    "bounded numbers": (
        {
            "type": "object",
            "properties": {
                "n": {"type": "integer", "minimum": 3, "maximum": 17},
                "x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            },
            "required": ["n", "x"],
            "additionalProperties": False,
        },
        '{"n": 17, "x": -1.25}',
        '{"n": 18, "x": 0}',
    ),
    "patterned strings": (
        {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
            "required": ["code"],
            "additionalProperties": False,
        },
        '{"code": "AB-123"}',
        '{"code": "ab-123"}',
    ),
}


# --------------------------------------------------------------------------------------------------- the vocabulary
def build_tokenizer(vocab_size: int = VOCAB) -> Any:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens trained on transformers' source (cached in /tmp)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    cached = pathlib.Path(tempfile.gettempdir()) / f"pagedcore-bpe-{vocab_size}-{transformers.__version__}.json"
    if not cached.exists():
        root = pathlib.Path(transformers.__file__).parent

        def texts(limit: int = 12_000_000) -> Iterator[str]:
            seen = 0
            for path in sorted(root.rglob("*.py")):
                text = path.read_text(encoding="utf-8", errors="ignore")
                seen += len(text)
                yield text
                if seen > limit:
                    return

        core = Tokenizer(models.BPE())
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        core.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<s>", "</s>", "<unk>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        core.train_from_iterator(texts(), trainer)
        core.save(str(cached) + ".part")
        os.replace(str(cached) + ".part", cached)
    return PreTrainedTokenizerFast(tokenizer_file=str(cached), bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte is written as -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


# ------------------------------------------------------------------------------------------------------ the engines
@dataclass
class EngineAdapter:
    """The calls this comparison makes, per engine (set-up, compile, matcher, batched fill, apply)."""

    name: str
    setup: Callable[[Any], None]
    compile: Callable[[str, str], Any]  # (kind, spec) -> compiled
    matcher: Callable[[Any], Any]
    fill: Callable[[list[Any], torch.Tensor], None]  # matchers -> bitmask rows 0..len-1
    apply: Callable[[torch.Tensor, torch.Tensor], None]
    advance: Callable[[Any, int], bool]
    end: Callable[[Any, int], bool]  # (matcher, eos) -> whether the document may end here
    state: dict[str, Any] = field(default_factory=dict)


def _xgrammar(threads: int) -> EngineAdapter:
    import xgrammar as xgr

    state: dict[str, Any] = {}

    def setup(tok: Any) -> None:
        state["info"] = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
        state["batch"] = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(kind: str, spec: str) -> Any:
        compiler = xgr.GrammarCompiler(state["info"], max_threads=threads, cache_enabled=False)
        if kind == "json_schema":
            return compiler.compile_json_schema(spec, any_whitespace=True)
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "lark":
            return compiler.compile_lark(spec)
        return compiler.compile_grammar(spec)

    def fill(matchers: list[Any], bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            state["batch"].batch_fill_next_token_bitmask(matchers, bitmask)

    return EngineAdapter(
        f"xgrammar {package_version('xgrammar')}",
        setup,
        compile,
        lambda compiled: xgr.GrammarMatcher(compiled),
        fill,
        lambda logits, bitmask: xgr.apply_token_bitmask_inplace(logits, bitmask),
        lambda m, t: bool(m.accept_token(t)),
        lambda m, eos: bool(m.accept_token(eos)),
        state,
    )


def _llguidance(threads: int) -> EngineAdapter:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    state: dict[str, Any] = {}

    def setup(tok: Any) -> None:
        state["tok"] = llguidance.hf.from_tokenizer(tok)
        state["exec"] = llguidance.LLExecutor(num_threads=threads)

    def compile(kind: str, spec: str) -> Any:
        if kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec)
        elif kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        elif kind == "lark":
            grammar = llguidance.LLMatcher.grammar_from_lark(spec)
        else:
            grammar = llguidance.grammar_from("gbnf", spec)
        matcher = llguidance.LLMatcher(state["tok"], grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(grammar: Any) -> Any:
        return llguidance.LLMatcher(state["tok"], grammar, log_level=0)

    def fill(matchers: list[Any], bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            llguidance.torch.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            llguidance.torch.fill_next_token_bitmask_par(
                state["exec"], [(m, i) for i, m in enumerate(matchers)], bitmask[: len(matchers)]
            )

    return EngineAdapter(
        f"llguidance {llguidance.get_version() if hasattr(llguidance, 'get_version') else ''}".strip(),
        setup,
        compile,
        matcher,
        fill,
        lambda logits, bitmask: llguidance.torch.apply_token_bitmask_inplace(logits, bitmask),
        lambda m, t: bool(m.consume_token(t)),
        lambda m, eos: bool(m.is_accepting()),
        state,
    )


def _outlines_core() -> EngineAdapter:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
    from outlines_core.kernels.torch import _apply_token_bitmask_inplace_kernel

    state: dict[str, Any] = {}

    def setup(tok: Any) -> None:
        decoder = _byte_decoder()
        vocab: dict[bytes, list[int]] = {}
        for text, token in tok.get_vocab().items():
            if token in tok.all_special_ids:
                continue
            vocab.setdefault(bytes(decoder[c] for c in text), []).append(token)
        state["vocab"] = outlines_core.Vocabulary(tok.eos_token_id, vocab)

    def compile(kind: str, spec: str) -> Any:
        if kind == "json_schema":
            return outlines_core.Index(build_regex_from_schema(spec), state["vocab"])
        if kind == "json_object":
            return outlines_core.Index(build_regex_from_schema('{"type": "object"}'), state["vocab"])
        if kind == "regex":
            return outlines_core.Index(spec, state["vocab"])
        raise ValueError("outlines-core compiles regular expressions only (no context-free grammar)")

    def fill(matchers: list[Any], bitmask: torch.Tensor) -> None:
        words = bitmask.shape[1]
        for i, guide in enumerate(matchers):  # no batched call
            guide.write_mask_into(bitmask[i].data_ptr(), words, 4)

    def advance(guide: Any, token: int) -> bool:
        try:
            guide.advance(token, return_tokens=False)
        except Exception:
            return False
        return True

    def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        _apply_token_bitmask_inplace_kernel(logits, bitmask)  # its torch.compile'd kernel (as outlines uses it)

    return EngineAdapter(
        f"outlines-core {package_version('outlines_core')}",
        setup,
        compile,
        lambda index: outlines_core.Guide(index),
        fill,
        apply,
        advance,
        lambda g, eos: bool(g.is_finished()),
        state,
    )


# ------------------------------------------------------------------------------------------------- the common apply
_BITS = (torch.arange(256)[:, None] >> torch.arange(8)[None, :]) & 1
_PENALTY = torch.where(_BITS.bool(), 0.0, float("-inf"))  # (256, 8): a bitmask byte -> 0 / -inf per token


def table_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Add 0 / -inf by a byte lookup table (one gather and one add; masked_fill is a scalar loop on this CPU)."""
    rows = bitmask.shape[0]
    penalty = _PENALTY.index_select(0, bitmask.view(torch.uint8).view(-1).long()).view(rows, -1)
    logits.add_(penalty[:, : logits.shape[1]])


# ------------------------------------------------------------------------------------------------------ the checks
def _accepts(engine: EngineAdapter, compiled: Any, tok: Any, text: str) -> bool:
    """Whether ``text`` (then eos) is accepted token by token."""
    matcher = engine.matcher(compiled)
    return all(engine.advance(matcher, t) for t in tok(text, add_special_tokens=False)["input_ids"]) and engine.end(
        matcher, tok.eos_token_id
    )


def _walk(
    engine: EngineAdapter, compiled: Any, tok: Any, rng: torch.Generator, bias: torch.Tensor, limit: int
) -> str | None:
    """One random walk under the mask (None when it did not end within ``limit`` tokens)."""
    matcher = engine.matcher(compiled)
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    tokens: list[int] = []
    for _ in range(limit):
        engine.fill([matcher], bitmask)
        logits = torch.randn(1, VOCAB, generator=rng) + bias
        table_apply(logits, bitmask)
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=rng))
        if token == tok.eos_token_id:
            if not engine.end(matcher, token):
                raise AssertionError(f"{engine.name} allowed eos where the document cannot end")
            return tok.decode(tokens)
        if not engine.advance(matcher, token):
            raise AssertionError(f"{engine.name} refused a token its own mask allowed: {token}")
        tokens.append(token)
    return None


def _walk_bias(tok: Any) -> torch.Tensor:
    """Random logits favour short structural tokens and eos, so walks end within a few hundred tokens."""
    bias = torch.zeros(VOCAB)
    for text, token in tok.get_vocab().items():
        plain = text.replace("Ġ", " ")
        if len(plain) <= 2 and all(c in '{}[]":, 0123456789-.tfnrueal' for c in plain):
            bias[token] = 6.0
    bias[tok.eos_token_id] = 6.0
    return bias


def correctness(engine: EngineAdapter, tok: Any, walks: int, limit: int) -> dict[str, str]:
    """Per feature: 'ok' or what went wrong; plus the request kinds the engine compiles."""
    import jsonschema

    out: dict[str, str] = {}
    bias = _walk_bias(tok)
    rng = torch.Generator().manual_seed(0)
    for feature, (schema, good, bad) in FEATURES.items():
        try:
            compiled = engine.compile("json_schema", json.dumps(schema))
        except Exception as exc:
            out[feature] = f"does not compile: {str(exc)[:60]}"
            continue
        problems = []
        if not _accepts(engine, compiled, tok, good):
            problems.append("refuses a valid document")
        if _accepts(engine, compiled, tok, bad):
            problems.append("accepts an invalid document")
        ended = invalid = 0
        for _ in range(walks):
            try:
                text = _walk(engine, compiled, tok, rng, bias, limit)
            except AssertionError as exc:
                problems.append(str(exc))
                break
            if text is None:
                continue
            ended += 1
            try:
                jsonschema.validate(json.loads(text), schema)
            except Exception:
                invalid += 1
        if invalid:
            problems.append(f"{invalid}/{ended} walks invalid")
        out[feature] = "; ".join(problems) or f"ok ({ended}/{walks} ended, all valid)"
    kinds = {
        "any JSON (json_object)": ("json_object", ""),
        "regex": ("regex", r"[a-z]{3}-[0-9]+"),
        "choice": ("regex", "(yes|no|maybe)"),
        "Lark grammar": ("lark", 'start: "a" start "b" | "ab"'),
        "EBNF (GBNF) grammar": ("ebnf", 'root ::= "a" root "b" | "ab"'),
    }
    for label, (kind, spec) in kinds.items():
        try:
            engine.compile(kind, spec)
            out[label] = "yes"
        except Exception as exc:
            out[label] = f"no: {str(exc).splitlines()[0][:50]}"
    return out


# ---------------------------------------------------------------------------------------------------- the timings
# CPU seconds of this process (all its threads), not wall time: on a machine shared by other jobs an operation
# longer than a scheduler time slice is preempted, and wall time then measures the other jobs.
cpu = time.process_time


def compile_seconds(engine: EngineAdapter, repeats: int) -> float:
    """Median CPU seconds from the typical schema's text to the first mask (cache off)."""
    spec = json.dumps(TYPICAL)
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    times = []
    for _ in range(repeats):
        start = cpu()
        engine.fill([engine.matcher(engine.compile("json_schema", spec))], bitmask)
        times.append(cpu() - start)
    return statistics.median(times)


@dataclass
class StepTimes:
    fill: list[float] = field(default_factory=list)
    apply: list[float] = field(default_factory=list)
    common: list[float] = field(default_factory=list)
    advance: list[float] = field(default_factory=list)


def step_times(engine: EngineAdapter, compiled: Any, tok: Any, batch: int, steps: int, times: StepTimes) -> None:
    """``steps`` steps of ``batch`` rows walking the typical schema; a row that ends starts again."""
    bias = _walk_bias(tok)
    rng = torch.Generator().manual_seed(batch)
    matchers = [engine.matcher(compiled) for _ in range(batch)]
    bitmask = torch.full((batch, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    for _ in range(steps):
        logits = torch.randn(batch, VOCAB, generator=rng) + bias
        same = logits.clone()
        start = cpu()
        engine.fill(matchers, bitmask)
        filled = cpu()
        engine.apply(logits, bitmask)
        applied = cpu()
        table_apply(same, bitmask)
        common = cpu()
        if not torch.equal(logits, same):
            raise AssertionError(f"{engine.name}'s apply differs from the table apply")
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=rng)[:, 0].tolist()
        advancing = cpu()
        for i, token in enumerate(tokens):
            if token == tok.eos_token_id or not engine.advance(matchers[i], token):
                matchers[i] = engine.matcher(compiled)
        times.advance.append(cpu() - advancing)
        times.fill.append(filled - start)
        times.apply.append(applied - filled)
        times.common.append(common - applied)


def _ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):.3f}"


def _report(
    engines: list[EngineAdapter],
    setup: dict[str, float],
    compile_times: dict[str, list[float]],
    times: dict[tuple[str, int], StepTimes],
    steps: int,
) -> None:
    print(f"\nper step, CPU milliseconds, median of {steps} steps (vocab {VOCAB}, B constrained rows)")
    print(
        "| engine | tokenizer set-up s | compile typical schema ms | B | fill masks | apply (own kernel) | "
        "apply (table add) | advance matchers |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for e in engines:
        for b in (1, 16, 64):
            t = times[e.name, b]
            head = f"{e.name} | {setup[e.name]:.2f} | {_ms(compile_times[e.name])}" if b == 1 else " | |"
            print(f"| {head} | {b} | {_ms(t.fill)} | {_ms(t.apply)} | {_ms(t.common)} | {_ms(t.advance)} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, walks and repeats")
    parser.add_argument("--threads", type=int, default=1, help="threads of the engines' batched fills")
    parser.add_argument("--engines", default="xgrammar,llguidance,outlines-core")
    args = parser.parse_args(argv)
    steps, walks, repeats, rounds = (10, 4, 2, 2) if args.quick else (40, 40, 5, 4)
    torch.set_num_threads(1)
    makers = {
        "xgrammar": lambda: _xgrammar(args.threads),
        "llguidance": lambda: _llguidance(args.threads),
        "outlines-core": _outlines_core,
    }
    engines, missing = [], []
    for name in args.engines.split(","):
        try:
            engines.append(makers[name]())
        except ImportError as exc:
            missing.append(f"{name} ({exc})")
    if missing:
        print(f"not installed, not measured: {'; '.join(missing)}. pip install 'pagedcore[structured-engines]'")
    if not engines:
        print("no grammar engine to measure: pip install 'pagedcore[structured]' (llguidance)", file=sys.stderr)
        return 3
    load = os.getloadavg()
    print(
        f"machine: {os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; "
        f"{args.threads} fill thread(s), torch {torch.__version__} on 1 thread"
    )
    tok = build_tokenizer()
    setup = {}
    for engine in engines:
        start = cpu()
        engine.setup(tok)
        setup[engine.name] = cpu() - start
    compiled = {e.name: e.compile("json_schema", json.dumps(TYPICAL)) for e in engines}
    compile_times: dict[str, list[float]] = {e.name: [] for e in engines}
    times = {(e.name, b): StepTimes() for e in engines for b in (1, 16, 64)}
    for r in range(rounds):  # interleaved, the order rotating, so drift in the machine's load hits all alike
        for engine in engines[r % len(engines) :] + engines[: r % len(engines)]:
            compile_times[engine.name].append(compile_seconds(engine, repeats))
            for batch in (1, 16, 64):
                step_times(engine, compiled[engine.name], tok, batch, steps, times[engine.name, batch])
    _report(engines, setup, compile_times, times, steps * rounds)
    print(f"\ncorrectness ({walks} random walks of at most 400 tokens per feature, validated with jsonschema)")
    results = {e.name: correctness(e, tok, walks, 400) for e in engines}
    print("| check | " + " | ".join(e.name for e in engines) + " |")
    print("|---|" + "---|" * len(engines))
    for row in next(iter(results.values())):
        print(f"| {row} | " + " | ".join(results[e.name][row] for e in engines) + " |")
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
