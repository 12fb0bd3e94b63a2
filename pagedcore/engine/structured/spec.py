"""What a structured-output request asks for: :class:`StructuredOutput`, one of five kinds, in a canonical form.

Plain Python (no grammar engine is imported here), so requests can be validated and cached by their spec anywhere.
The kinds are OpenAI's and vLLM's: ``json_schema`` (``response_format={"type": "json_schema", ...}``, vLLM's
``guided_json`` / ``structured_outputs.json``), ``json_object`` (any JSON object), ``regex``, ``choice`` (exactly
one of N strings) and ``grammar`` (EBNF in GBNF style, or Lark; a Lark grammar may embed JSON schemas with
``%json {...}``, which is how tool calls are enforced).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedcore.errors import GrammarError
from pagedcore.validation import unknown_key

__all__ = ["DEFAULT_MAX_WHITESPACE", "KINDS", "MAX_CHOICES", "MAX_NESTING", "MAX_SPEC_BYTES", "StructuredOutput"]

DEFAULT_MAX_WHITESPACE = 8
# Bounds on what one request may ask, so that parsing and compiling it stays within a second or so (llguidance's
# validation grows faster than linearly: a choice of 40,000 options took 5 s, of 200,000 more than its own limits).
MAX_SPEC_BYTES = 512 * 1024  # the spec's text (schema JSON, regex, choices as JSON, grammar), UTF-8
MAX_CHOICES = 10_000  # options of a choice
MAX_NESTING = 64  # levels of a JSON schema (objects and lists inside each other)
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# vLLM's names of the same fields (StructuredOutputsParams and the older guided_* request fields).
_ALIASES = {"json": "json_schema", "guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
            "guided_grammar": "grammar", "guided_json_object": "json_object"}  # fmt: skip


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output. Build one with the class methods; equal specs compile once.

    Attributes:
        kind: one of :data:`KINDS`.
        spec: the canonical text: the schema as JSON (key order kept: it is the order the properties are
            generated in), the regex, the choices as a JSON list, the grammar; ``""`` for
            ``json_object``.
        strict: ``json_schema`` only: True (the default, OpenAI's ``strict`` and vLLM's behaviour) allows
            properties an object's schema does not list only where it says ``additionalProperties``; False allows
            them wherever JSON Schema does (``additionalProperties`` unset means allowed).
        max_whitespace: JSON kinds only: the longest run of whitespace between JSON tokens (8 by default, so that
            a model cannot loop on whitespace and still indents a few levels; 0: compact JSON, as vLLM's
            ``disable_any_whitespace``; None: unbounded, vLLM's default).
        parsed: llguidance's grammar once the spec was parsed (``GrammarCompiler.prepare``), else None; not part
            of the spec's identity. A spec is bounded: :data:`MAX_SPEC_BYTES` of text, :data:`MAX_CHOICES` options,
            :data:`MAX_NESTING` levels of JSON (else :class:`~pagedcore.errors.GrammarError` naming the bound).
        source: where the spec came from, as its front end names it (a server sets the request field, e.g.
            ``guided_regex``, so an error found later names it); the engine never reads it; not part of the spec's
            identity.

    Example:
        >>> spec = StructuredOutput.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
        >>> spec.kind, spec.spec
        ('json_schema', '{"type": "object", "properties": {"n": {"type": "integer"}}}')
        >>> StructuredOutput.choice(["yes", "no"]) == StructuredOutput.from_value({"guided_choice": ["yes", "no"]})
        True
        >>> StructuredOutput.regex("")
        Traceback (most recent call last):
        ...
        pagedcore.errors.GrammarError: regex: expected a non-empty string, got ''
    """

    kind: str
    spec: str
    strict: bool = True
    max_whitespace: int | None = DEFAULT_MAX_WHITESPACE
    parsed: str | None = field(default=None, compare=False, repr=False)  # a spec that carries it is never parsed
    # again: a server parses in its worker, and the Engine's step loop does not
    source: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown structured-output kind {self.kind!r}: use one of {', '.join(KINDS)}")
        if not isinstance(self.spec, str):
            raise GrammarError(f"{self.kind}: the spec must be text, got {type(self.spec).__name__}")
        if len(self.spec) > MAX_SPEC_BYTES // 4 and len(self.spec.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
            raise GrammarError(
                f"{self.kind}: the spec takes {len(self.spec.encode('utf-8', 'surrogatepass'))} bytes, more than the "
                f"{MAX_SPEC_BYTES} a structured output may take"
            )
        if not isinstance(self.strict, bool):
            raise GrammarError(f"strict must be True or False, got {self.strict!r}")
        ws = self.max_whitespace
        if ws is not None and (isinstance(ws, bool) or not isinstance(ws, int) or ws < 0):
            raise GrammarError(f"max_whitespace must be None or an integer >= 0, got {ws!r}")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def json_schema(
        cls,
        schema: Mapping[str, Any] | str | bool,
        *,
        strict: bool | None = None,
        max_whitespace: int | None = DEFAULT_MAX_WHITESPACE,
    ) -> StructuredOutput:
        """Output valid against a JSON schema (a dict, or its JSON text); ``strict`` None means True."""
        text = _json_text("json_schema", schema, objects_only=False)
        return cls("json_schema", text, True if strict is None else strict, max_whitespace)

    @classmethod
    def json_object(cls, *, max_whitespace: int | None = DEFAULT_MAX_WHITESPACE) -> StructuredOutput:
        """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        return cls("json_object", "", False, max_whitespace)

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        """Output matching a regular expression as a whole (xgrammar's regex syntax: no lookaround)."""
        return cls("regex", _text("regex", pattern))

    @classmethod
    def choice(cls, options: Sequence[str]) -> StructuredOutput:
        """Exactly one of ``options`` (strings)."""
        if isinstance(options, (str, bytes)) or not isinstance(options, Sequence) or not options:
            raise GrammarError(f"choice: expected a non-empty list of strings, got {options!r}")
        if len(options) > MAX_CHOICES:
            raise GrammarError(f"choice: {len(options)} options, more than the {MAX_CHOICES} a choice may have")
        bad = [o for o in options if not isinstance(o, str) or not o]
        if bad:
            raise GrammarError(f"choice: every choice must be a non-empty string, got {bad[0]!r}")
        return cls("choice", json.dumps(list(options), ensure_ascii=False))

    @classmethod
    def grammar(cls, text: str) -> StructuredOutput:
        """Output of a grammar: EBNF in GBNF style (``root ::= ...``) or, without ``::=``, Lark (``start: ...``)."""
        return cls("grammar", _text("grammar", text))

    @classmethod
    def from_value(cls, value: StructuredOutput | Mapping[str, Any]) -> StructuredOutput:
        """A :class:`StructuredOutput`, or a dict with exactly one kind as its key (our names or vLLM's:
        ``json``, ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``), plus ``strict``.

        Example:
            >>> StructuredOutput.from_value({"regex": "[0-9]+"}).spec
            '[0-9]+'
        """
        if isinstance(value, StructuredOutput):
            return value
        if not isinstance(value, Mapping):
            raise GrammarError(f"structured output must be a StructuredOutput or a dict, got {value!r}")
        options = {k: v for k, v in value.items() if k not in ("strict", "max_whitespace")}
        kinds = [k for k, v in options.items() if v is not None and v is not False]
        unknown = [k for k in kinds if _ALIASES.get(k, k) not in KINDS]
        if unknown or len(kinds) != 1:
            got = ", ".join(map(repr, kinds)) or "none"
            raise GrammarError(f"structured output needs exactly one of {', '.join(KINDS)}, got {got}")
        kind = _ALIASES.get(kinds[0], kinds[0])
        arg = options[kinds[0]]
        ws = value.get("max_whitespace", DEFAULT_MAX_WHITESPACE)
        if kind == "json_object":
            return cls.json_object(max_whitespace=ws)
        if kind == "json_schema":
            return cls.json_schema(arg, strict=value.get("strict"), max_whitespace=ws)
        return getattr(cls, kind)(arg)

    @classmethod
    def from_response_format(cls, response_format: Mapping[str, Any] | None) -> StructuredOutput | None:
        """OpenAI's ``response_format``: ``{"type": "text"}`` (None: no constraint), ``{"type": "json_object"}``,
        or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``.

        Example:
            >>> inner = {"name": "n", "schema": {"type": "integer"}, "strict": True}
            >>> StructuredOutput.from_response_format({"type": "json_schema", "json_schema": inner})
            StructuredOutput(kind='json_schema', spec='{"type": "integer"}', strict=True, max_whitespace=8)
        """
        if response_format is None:
            return None
        if not isinstance(response_format, Mapping):
            raise GrammarError(f"response_format must be an object, got {response_format!r}")
        kind = response_format.get("type")
        known = {"text": ("type",), "json_object": ("type",), "json_schema": ("type", "json_schema")}.get(str(kind))
        extra = None if known is None else unknown_key(response_format, known)
        if extra is not None:  # a schema beside json_object, say: it would not be applied
            raise GrammarError(f"response_format.{extra} is not a field of a {kind} response_format")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "json_schema":
            inner = response_format.get("json_schema")
            if not isinstance(inner, Mapping) or "schema" not in inner:
                raise GrammarError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
            extra = unknown_key(inner, ("name", "description", "schema", "strict"))
            if extra is not None:
                raise GrammarError(f"response_format.json_schema.{extra} is not a field of a json_schema")
            return cls.json_schema(inner["schema"], strict=inner.get("strict"))
        raise GrammarError(f"response_format type must be text, json_object or json_schema, got {kind!r}")

    # ------------------------------------------------------------------ queries
    @property
    def key(self) -> tuple[str, str, bool, int | None]:
        """What the compiled-grammar cache is keyed by."""
        return (self.kind, self.spec, self.strict, self.max_whitespace)

    @property
    def choices(self) -> list[str]:
        """The choices of a ``choice`` spec."""
        return list(json.loads(self.spec)) if self.kind == "choice" else []

    def describe(self) -> str:
        """A short, readable name of the spec for messages (``json_schema {"type": "obj…``)."""
        text = self.spec if len(self.spec) <= 60 else self.spec[:57] + "..."
        return f"{self.kind} {text}".strip()


def _text(kind: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise GrammarError(f"{kind}: expected a non-empty string, got {value!r}")
    return value


def _json_text(kind: str, value: object, *, objects_only: bool) -> str:
    """Canonical JSON text of a schema (key order kept), from a dict, a bool schema or JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise GrammarError(f"{kind}: not valid JSON: {exc}") from None
    if not isinstance(value, Mapping) and (objects_only or not isinstance(value, bool)):
        raise GrammarError(f"{kind}: expected a JSON object, got {value!r}"[:200])
    depth = _depth(value)
    if depth > MAX_NESTING:
        raise GrammarError(f"{kind}: the schema nests {depth} levels deep, more than the {MAX_NESTING} allowed")
    value = _wide_ints_as_floats(value)
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"{kind}: cannot be written as JSON: {exc}") from None


def _depth(value: object) -> int:
    """How many objects and lists nest in ``value`` (without recursion: a deep one cannot exhaust the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, Mapping) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level <= MAX_NESTING:  # past the bound the answer is known: stop walking
            stack.extend((child, level + 1) for child in children)
    return deepest


def _wide_ints_as_floats(value: Any) -> Any:
    """``value`` with integers past 64 bits written as floats (the same JSON number; the grammar engine reads
    numbers as 64-bit ones). Nesting is bounded (:data:`MAX_NESTING`) before this runs."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return float(value) if not -(2**63) <= value < 2**64 else value
    if isinstance(value, Mapping):
        return {k: _wide_ints_as_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_wide_ints_as_floats(v) for v in value]
    return value
