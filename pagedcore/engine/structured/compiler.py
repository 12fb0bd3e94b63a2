"""Compiling structured-output specs into the grammars the masks come from, off the step loop, cached by spec.

Two stages, so that bad input is refused at once and slow work never runs where requests wait on it:

1. :meth:`GrammarCompiler.parse` (synchronous: a millisecond for typical specs, up to about a second for the largest
   a spec may be, :data:`~.spec.MAX_SPEC_BYTES`): the spec becomes an llguidance grammar and is validated; an
   invalid schema, regex or grammar, or a JSON Schema keyword llguidance does not implement (it says so rather than
   ignore it), raises :class:`~pagedcore.errors.GrammarError` naming what is wrong. Cached by spec.
   :meth:`GrammarCompiler.prepare` returns the spec carrying its grammar (``StructuredOutput.parsed``): a server
   prepares in a worker thread, and whoever compiles it later (the Engine, on its step loop) never parses it again.
   A choice is one lexeme (its options one automaton), so a choice of thousands of options sharing a prefix stays
   within llguidance's parser limits.
2. :meth:`GrammarCompiler.submit` (a worker thread): the grammar is built against the vocabulary into a matcher
   (milliseconds for typical schemas, up to about a second for huge ones), cached by spec: a schema many requests
   share is built once, and each sample starts from a copy. :meth:`GrammarCompiler.compile` waits at most
   ``compile_timeout`` seconds and raises :class:`~pagedcore.errors.GrammarTimeoutError` past it (the build carries
   on in the worker and is cached when it ends).

Per step, llguidance's own limits bound the work one mask may take (``LLParserLimits``: lexer fuel, Earley items);
a grammar that exceeds them at its first mask fails to compile (the compilation computes that mask), one that
exceeds them later puts its matcher in an error state, which fails that sample with llguidance's message (the
request's fault, not the server's).
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pagedcore.errors import ConfigError, GrammarError, GrammarTimeoutError

from .spec import StructuredOutput
from .vocab import SpecialTokens, import_llguidance, lltokenizer, special_tokens

SpecKey = tuple[str, str, bool, int | None]

__all__ = ["CompiledGrammar", "CompilerStats", "GrammarCompiler", "closed_objects"]


@dataclass(frozen=True)
class CompiledGrammar:
    """A spec built against a vocabulary: the matcher every sample starts from (copied, never changed itself).

    Attributes:
        matcher: llguidance's matcher at the start.
        vocab_size: the mask's width (the model's logits).
        spec: what it was compiled from.
        stop_token_ids: the tokens that end an output once the grammar is complete.
        special: the special and stop tokens a mask allows only where the matcher accepts them
            (:class:`~.vocab.SpecialTokens`).

    Example:
        >>> CompiledGrammar(None, 128, StructuredOutput.regex("a+"), (2,)).vocab_size
        128
    """

    matcher: Any
    vocab_size: int
    spec: StructuredOutput
    stop_token_ids: tuple[int, ...]
    special: SpecialTokens = field(default_factory=lambda: SpecialTokens((), 0))


@dataclass
class CompilerStats:
    """Counters of a :class:`GrammarCompiler`.

    Attributes:
        num_compiled: grammars compiled (cache misses that finished).
        num_hits: requests served from the compiled-grammar cache.
        num_timeouts: waits that hit ``compile_timeout``.
        compile_seconds: seconds spent compiling, summed.

    Example:
        >>> CompilerStats().num_hits
        0
    """

    num_compiled: int = 0
    num_hits: int = 0
    num_timeouts: int = 0
    compile_seconds: float = 0.0


class GrammarCompiler:
    """Parses and compiles :class:`StructuredOutput` specs for one tokenizer and vocabulary size.

    Args:
        tokenizer: a transformers tokenizer (its vocabulary is what the masks cover).
        vocab_size: the model's logits width (the mask size); None: the tokenizer's.
        stop_token_ids: the tokens that end an output (what a finished grammar allows); None: the tokenizer's eos.
        compile_timeout: seconds a compilation may take before a waiting request is refused.
        max_cached: compiled grammars kept (least recently used dropped first).

    Example:
        >>> from pagedcore.adapters.transformers.builtin import builtin_tokenizer
        >>> compiler = GrammarCompiler(builtin_tokenizer(), vocab_size=99)
        >>> spec = StructuredOutput.json_schema({"type": "integer"})
        >>> compiled = compiler.compile(spec)
        >>> compiler.compile(spec) is compiled, compiler.stats.num_hits
        (True, 1)
        >>> compiler.parse(StructuredOutput.json_schema({"type": "array", "uniqueItems": True}))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        pagedcore.errors.GrammarError: invalid json_schema '{"type": "array", "uniqueItems": true}': ...
        >>> compiler.close()
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        compile_timeout: float = 30.0,
        max_cached: int = 256,
    ) -> None:
        if not compile_timeout > 0:
            raise ConfigError(f"compile_timeout must be > 0 seconds, got {compile_timeout!r}")
        if max_cached < 1:
            raise ConfigError(f"max_cached must be >= 1, got {max_cached!r}")
        self._llg = import_llguidance()
        if stop_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            stop_token_ids = [] if eos is None else [eos]
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.compile_timeout = float(compile_timeout)
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self._parsed: OrderedDict[tuple[str, str, bool, int | None], Any] = OrderedDict()
        self._compiled: OrderedDict[tuple[str, str, bool, int | None], concurrent.futures.Future[CompiledGrammar]] = (
            OrderedDict()
        )
        self._lltok: Any = None
        self._special: SpecialTokens | None = None
        self._limits = self._llg.LLParserLimits(verbose_errors=False)  # messages go to clients: no grammar dumps
        # Two workers: one pathological grammar (compiling past the timeout) does not hold every other spec up.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="pagedcore-grammar")
        self.stats = CompilerStats()

    # ------------------------------------------------------------------ parse (synchronous, cheap)
    def parse(self, spec: StructuredOutput) -> str:
        """The llguidance grammar of ``spec`` (cached; the one it carries, when :meth:`prepare` parsed it);
        :class:`~pagedcore.errors.GrammarError` when invalid."""
        if spec.parsed is not None:
            return spec.parsed
        with self._lock:
            grammar = self._parsed.get(spec.key)
            if grammar is not None:
                self._parsed.move_to_end(spec.key)
                return str(grammar)
        grammar = self._to_grammar(spec)
        with self._lock:
            self._parsed[spec.key] = grammar
            while len(self._parsed) > self._max_cached:
                self._parsed.popitem(last=False)
        return grammar

    def prepare(self, spec: StructuredOutput) -> StructuredOutput:
        """``spec`` parsed (in the calling thread: a server's worker), carrying its grammar so that nothing parses
        it again; :class:`~pagedcore.errors.GrammarError` when invalid.

        Example:
            >>> compiler = GrammarCompiler(None)
            >>> prepared = compiler.prepare(StructuredOutput.regex("[0-9]+"))
            >>> prepared == StructuredOutput.regex("[0-9]+"), prepared.parsed is not None
            (True, True)
        """
        return spec if spec.parsed is not None else replace(spec, parsed=self.parse(spec))

    def _to_grammar(self, spec: StructuredOutput) -> str:
        llg = self._llg
        try:
            if spec.kind in ("json_schema", "json_object"):
                schema = json.loads(spec.spec) if spec.kind == "json_schema" else {"type": "object"}
                if spec.strict:
                    schema = closed_objects(schema)
                grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=_json_options(spec.max_whitespace))
            elif spec.kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(spec.spec)
            elif spec.kind == "choice":  # one lexeme: its options as one automaton, not thousands of parser rules
                options = " | ".join(json.dumps(option) for option in json.loads(spec.spec))
                grammar = llg.LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {options}")
            else:  # GBNF (converted to Lark) or Lark
                grammar = llg.grammar_from("gbnf" if "::=" in spec.spec else "lark", spec.spec)
            error = llg.LLMatcher.validate_grammar(grammar)
        except Exception as exc:  # llguidance raises ValueError for text it cannot read
            error = str(exc)
        if error:
            raise GrammarError(f"invalid {spec.kind} {_shorten(spec.spec)}: {_message(error)}")
        return str(grammar)

    # ------------------------------------------------------------------ compile (worker thread, cached)
    def submit(self, spec: StructuredOutput) -> concurrent.futures.Future[CompiledGrammar]:
        """Parse ``spec`` here (raising for bad input) and compile it in the worker; the future's result is the
        compiled grammar. A spec compiled or compiling already shares that future."""
        grammar = self.parse(spec)
        with self._lock:
            future = self._compiled.get(spec.key)
            if future is not None:
                self._compiled.move_to_end(spec.key)
                self.stats.num_hits += 1
                return future
            future = self._pool.submit(self._compile, spec, grammar)
            self._compiled[spec.key] = future
            while len(self._compiled) > self._max_cached:
                self._compiled.popitem(last=False)
        return future

    def compile(self, spec: StructuredOutput, timeout: float | None = None) -> CompiledGrammar:
        """The compiled grammar of ``spec``, waiting at most ``timeout`` seconds (default ``compile_timeout``)."""
        return self.result(spec, self.submit(spec), timeout)

    def result(
        self, spec: StructuredOutput, future: concurrent.futures.Future[CompiledGrammar], timeout: float | None = None
    ) -> CompiledGrammar:
        """Wait for a :meth:`submit` future: its compiled grammar, or the typed error of its failure or timeout."""
        limit = self.compile_timeout if timeout is None else timeout
        try:
            return future.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self.stats.num_timeouts += 1
            raise GrammarTimeoutError(
                f"{spec.describe()} did not compile within {limit:g} s (compile_timeout); simplify the schema or "
                "grammar, or retry: it is still compiling and will be cached"
            ) from None

    def is_compiled(self, spec: StructuredOutput) -> bool:
        """Whether ``spec``'s compiled grammar is in the cache (ready now)."""
        with self._lock:
            future = self._compiled.get(spec.key)
        return future is not None and future.done() and future.exception() is None

    def _compile(self, spec: StructuredOutput, grammar: str) -> CompiledGrammar:
        started = time.perf_counter()
        matcher = self._llg.LLMatcher(self.lltokenizer, grammar, log_level=0, limits=self._limits)
        probe = matcher.deep_copy()
        # The first mask: a grammar past llguidance's limits fails here, not in a step; one whose output no token of
        # the vocabulary can start (a choice of characters the tokenizer cannot spell) is refused too.
        first = b"" if matcher.is_error() else probe.compute_bitmask()
        error = matcher.get_error() if matcher.is_error() else probe.get_error() if probe.is_error() else None
        if error is None and not _starts(probe, first):
            error = "no token of the model's vocabulary can start an output of it"
        if error is not None:
            with self._lock:
                self._compiled.pop(spec.key, None)  # not cached: the next request tries again
            raise GrammarError(f"cannot compile {spec.kind} {_shorten(spec.spec)}: {_message(error)}")
        with self._lock:
            self.stats.num_compiled += 1
            self.stats.compile_seconds += time.perf_counter() - started
        return CompiledGrammar(matcher, self.vocab_size, spec, self.stop_token_ids, self.special_tokens)

    @property
    def lltokenizer(self) -> Any:
        """llguidance's view of the vocabulary, built on first use (reading a large vocabulary takes a while)."""
        with self._lock:
            if self._lltok is None:
                self._lltok = lltokenizer(self._tokenizer, self._vocab_size, self.stop_token_ids)
            return self._lltok

    @property
    def special_tokens(self) -> SpecialTokens:
        """The special tokens of the vocabulary and the stop tokens, found once."""
        lltok = self.lltokenizer
        with self._lock:
            if self._special is None:
                self._special = special_tokens(lltok, self._tokenizer, self.stop_token_ids)
            return self._special

    @property
    def vocab_size(self) -> int:
        """The mask size (the model's logits width)."""
        return int(self.lltokenizer.vocab_size)

    def close(self) -> None:
        """Stop the workers (a compilation under way is left to finish in the background)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _starts(matcher: Any, bitmask: bytes, checked: int = 64) -> bool:
    """Whether a token ``matcher``'s first mask allows is one it accepts. llguidance's mask may allow a special
    token it then refuses (the built-in tokenizer's ``<unk>`` where the grammar needs a character the vocabulary
    lacks): the first ``checked`` allowed tokens are tried; past them the mask is trusted.

    Example:
        >>> class Matcher:  # accepts token 33 only
        ...     def validate_tokens(self, tokens): return int(tokens == [33])
        >>> mask = (1 << 3).to_bytes(4, "little") + (1 << 1).to_bytes(4, "little")   # tokens 3 and 33
        >>> _starts(Matcher(), mask), _starts(Matcher(), mask[:4]), _starts(Matcher(), bytes(8))
        (True, False, False)
    """
    tried = 0
    for index, byte in enumerate(bytes(bitmask)):
        while byte:
            low = byte & -byte
            if matcher.validate_tokens([index * 8 + low.bit_length() - 1]):
                return True
            tried += 1
            if tried >= checked:
                return True
            byte ^= low
    return False


def _shorten(text: str) -> str:
    """A spec in a message: the start of its text (a schema can be long, and is the client's own)."""
    return repr(text if len(text) <= 40 else text[:37] + "...")


def _message(error: str) -> str:
    """llguidance's error, on one line: its first line, plus the regex error's own line when there is one."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    first = lines[0] if lines else "invalid"
    detail = next((line for line in lines[1:] if line.startswith("error:")), "")
    return f"{first} ({detail})"[:300] if detail else first[:300]


def _json_options(max_whitespace: int | None) -> dict[str, Any]:
    if max_whitespace == 0:  # compact, with Python's and OpenAI's separators
        return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    if max_whitespace is None:
        return {"whitespace_flexible": True}
    return {"whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{max_whitespace}}}"}


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object schema that lists ``properties`` and does
    not say (what ``strict`` means; OpenAI's strict mode asks schemas to say so themselves).

    Example:
        >>> closed = closed_objects({"type": "object", "properties": {"properties": {"properties": {}}}})
        >>> closed["additionalProperties"], closed["properties"]["properties"]
        (False, {'properties': {}, 'additionalProperties': False})
    """
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema: the names are not keywords
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        elif key in _DATA:  # values, not schemas
            out[key] = value
        else:
            out[key] = closed_objects(value)
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_DATA = frozenset({"const", "enum", "default", "examples", "required"})
