"""A request's structured-output fields as the engine's spec: OpenAI's ``response_format`` and vLLM's ``guided_*`` /
``structured_outputs``, validated here (off the event loop) so a bad schema is a 400 naming the field.

The engine owns the constraint (:class:`~pagedcore.engine.structured.StructuredOutput` in
``SamplingParams.structured``); this module reads the request's fields and has the spec checked in the request's
worker thread (parsed, and compiled by the engine's compiler where the loop has one), so the error names the field
the client wrote, and the spec goes to the engine carrying its parsed grammar: the step loop never parses it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pagedcore.engine.structured import GrammarCompiler, StructuredOutput
from pagedcore.errors import PagedCoreError

from .protocol import ApiError
from .tool_calls import ToolCalls, tool_calls_of

__all__ = ["STRUCTURED_FIELDS", "Prepare", "check_spec", "constraint", "parse_only", "structured_output"]

Prepare = Callable[[StructuredOutput], StructuredOutput]
"""How a front end checks a spec before submitting it: parse it (:func:`parse_only`), or also compile it with the
engine's compiler (``RequestLoop.prepare_structured``); either returns the spec carrying its grammar."""

# vLLM's request fields (the older guided_* and the current structured_outputs), besides OpenAI's response_format.
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")  # fmt: skip


def constraint(
    body: Any, tool_call_parser: str = "hermes", prepare: Prepare | None = None
) -> tuple[StructuredOutput | None, ToolCalls | None]:
    """A parsed request body's constraint (its structured-output field, or the grammar that enforces its
    ``tool_choice``) and, for a chat with tools, how its answers become ``tool_calls``. Run it off the event loop:
    the spec is checked and parsed here by ``prepare`` (the loop's ``prepare_structured``: the engine's compiler
    also compiles it; default :func:`parse_only`), so the engine's step loop never parses it.

    Example:
        >>> from pagedcore.serve.protocol import ChatRequest
        >>> body = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
        ...                                    "response_format": {"type": "json_object"}})
        >>> spec, calls = constraint(body)
        >>> spec.kind, calls, spec.parsed is not None
        ('json_object', None, True)
    """
    prepare = prepare or parse_only
    spec, field = structured_output({name: getattr(body, name, None) for name in STRUCTURED_FIELDS}, prepare)
    tools = {name: getattr(body, name, None) for name in ("tools", "tool_choice", "parallel_tool_calls")}
    calls, forced = tool_calls_of(tools, tool_call_parser)
    if forced is not None:
        if spec is not None:
            raise ApiError(400, f"tool_choice {tools['tool_choice']!r} cannot be combined with {field}", param=field)
        spec, field = check_spec(forced, "tools", prepare), "tools"
    if spec is not None:
        for name, why in (
            ("ignore_eos", "a structured output ends where its grammar ends"),
            ("min_tokens", "a structured output ends where its grammar ends"),
            ("allowed_token_ids", "the grammar decides which tokens may come"),
        ):
            if getattr(body, name, None):
                raise ApiError(400, f"{name} cannot be combined with {field}: {why}", param=name)
    return spec, calls


def structured_output(
    data: dict[str, Any], prepare: Prepare | None = None
) -> tuple[StructuredOutput | None, str | None]:
    """The spec a request body asks for (checked and parsed by ``prepare``, default :func:`parse_only`) and the
    field it came from (``(None, None)``: no constraint); raises :class:`~pagedcore.serve.protocol.ApiError` (400,
    naming the field) for a bad or doubled one, or one past a bound (:data:`~pagedcore.adapters.transformers.
    structured.spec.MAX_CHOICES`, ``MAX_SPEC_BYTES``, ``MAX_NESTING``).

    Example:
        >>> spec, field = structured_output({"guided_regex": "[0-9]+"})
        >>> spec.kind, field
        ('regex', 'guided_regex')
        >>> structured_output({"response_format": {"type": "text"}})
        (None, None)
    """
    given = [name for name in STRUCTURED_FIELDS if data.get(name) is not None]
    if len(given) > 1:
        raise ApiError(400, f"give one structured-output field, got {' and '.join(given)}", param=given[1])
    if not given:
        return None, None
    name = given[0]
    value = data[name]
    if name == "structured_outputs":
        _check_structured_outputs(value)
    try:
        if name == "response_format":
            spec = StructuredOutput.from_response_format(value)
        elif name == "structured_outputs":
            spec = StructuredOutput.from_value(value)
        else:
            spec = StructuredOutput.from_value({name: value})
    except PagedCoreError as exc:
        raise ApiError(400, f"{name}: {exc}", param=name) from exc
    if spec is None:
        return None, None
    return check_spec(spec, name, prepare), name


# vLLM's StructuredOutputsParams kinds this server implements (structural_tag and the backend options are not).
STRUCTURED_OUTPUTS_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _check_structured_outputs(value: Any) -> None:
    """``structured_outputs`` holds exactly one kind (given, not null; ``json_object`` true) and maybe ``strict``
    (a boolean); any other key is refused naming it, not left unread.

    Example:
        >>> _check_structured_outputs({"regex": "[0-9]+", "disable_any_whitespace": True})
        Traceback (most recent call last):
        ...
        pagedcore.serve.protocol.ApiError: structured_outputs.disable_any_whitespace is not supported: give one of ...
    """
    if not isinstance(value, dict):
        raise ApiError(400, "structured_outputs must be an object", param="structured_outputs")
    kinds = ", ".join(STRUCTURED_OUTPUTS_KINDS)
    for key, got in value.items():
        where = f"structured_outputs.{key}"
        if key == "strict":
            if got is not None and not isinstance(got, bool):
                raise ApiError(400, f"{where} must be a boolean, got {got!r}"[:300], param=where)
        elif key not in STRUCTURED_OUTPUTS_KINDS:
            raise ApiError(400, f"{where} is not supported: give one of {kinds} (and strict)", param=where)
        elif got is None or (key == "json_object" and got is not True):
            raise ApiError(400, f"{where} must be given (json_object: true), got {got!r}"[:300], param=where)
    if sum(key != "strict" for key in value) != 1:
        raise ApiError(400, f"structured_outputs needs exactly one of {kinds}", param="structured_outputs")


def check_spec(spec: StructuredOutput, field: str, prepare: Prepare | None = None) -> StructuredOutput:
    """``spec`` checked and parsed by ``prepare`` (default :func:`parse_only`), its ``source`` the request's
    ``field`` (an error the engine finds in it later names that field: :class:`~pagedcore.serve.jobs.Job`): an
    invalid schema, regex or grammar, a JSON Schema keyword llguidance does not implement, a grammar past its
    limits or one that does not compile in time is a 400 naming ``field``.

    Example:
        >>> check_spec(StructuredOutput.regex("[0-9]+"), "guided_regex").source
        'guided_regex'
        >>> check_spec(StructuredOutput.regex("(("), "guided_regex")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        pagedcore.serve.protocol.ApiError: guided_regex: invalid regex '((': ...
    """
    try:
        prepared = (prepare or parse_only)(spec)
    except PagedCoreError as exc:
        raise ApiError(400, f"{field}: {exc}", param=field) from exc
    return replace(prepared, source=field)


def parse_only(spec: StructuredOutput) -> StructuredOutput:
    """``spec`` parsed (it carries its grammar), by a compiler that never builds a vocabulary: what a front end
    without the engine's compiler (the Ray ingress) can check. Raises :class:`~pagedcore.errors.GrammarError`.

    Example:
        >>> parse_only(StructuredOutput.regex("[a-z]+")).parsed is not None
        True
    """
    return _parser().prepare(spec)


@functools.lru_cache(maxsize=1)
def _parser() -> GrammarCompiler:
    """A compiler used only to parse (it never builds a vocabulary): its parse cache is shared by every request."""
    return GrammarCompiler(None)
