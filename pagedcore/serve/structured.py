"""A request's structured-output fields as the engine's spec: OpenAI's ``response_format`` and vLLM's ``guided_*`` /
``structured_outputs``, validated here (off the event loop) so a bad schema is a 400 naming the field.

The engine owns the constraint (:class:`~pagedcore.engine.structured.StructuredOutput` in
``SamplingParams.structured``); this module only reads the request's fields and checks the spec with the grammar
engine's parser (no vocabulary needed: about a millisecond), so the error names the field the client wrote.
"""

from __future__ import annotations

import functools
from typing import Any

from pagedcore.engine.structured import GrammarCompiler, StructuredOutput
from pagedcore.errors import PagedCoreError

from .protocol import ApiError
from .tool_calls import ToolCalls, tool_calls_of

__all__ = ["STRUCTURED_FIELDS", "check_spec", "constraint", "structured_output"]

# vLLM's request fields (the older guided_* and the current structured_outputs), besides OpenAI's response_format.
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")  # fmt: skip


def constraint(body: Any, tool_call_parser: str = "hermes") -> tuple[StructuredOutput | None, ToolCalls | None]:
    """A parsed request body's constraint (its structured-output field, or the grammar that enforces its
    ``tool_choice``) and, for a chat with tools, how its answers become ``tool_calls``. Run it off the event loop.

    Example:
        >>> from pagedcore.serve.protocol import ChatRequest
        >>> body = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
        ...                                    "response_format": {"type": "json_object"}})
        >>> spec, calls = constraint(body)
        >>> spec.kind, calls
        ('json_object', None)
    """
    spec, field = structured_output({name: getattr(body, name, None) for name in STRUCTURED_FIELDS})
    tools = {name: getattr(body, name, None) for name in ("tools", "tool_choice", "parallel_tool_calls")}
    calls, forced = tool_calls_of(tools, tool_call_parser)
    if forced is not None:
        if spec is not None:
            raise ApiError(400, f"tool_choice {tools['tool_choice']!r} cannot be combined with {field}", param=field)
        check_spec(forced, "tools")
        spec = forced
    return spec, calls


def structured_output(data: dict[str, Any]) -> tuple[StructuredOutput | None, str | None]:
    """The spec a request body asks for and the field it came from (``(None, None)``: no constraint); raises
    :class:`~pagedcore.serve.protocol.ApiError` (400, naming the field) for a bad or doubled one.

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
    try:
        if name == "response_format":
            spec = StructuredOutput.from_response_format(value)
        elif name == "structured_outputs":
            spec = StructuredOutput.from_value(value)
        else:
            spec = StructuredOutput.from_value({name: value})
    except PagedCoreError as exc:
        raise ApiError(400, f"{name}: {exc}", param=name) from exc
    if spec is not None:
        check_spec(spec, name)
    return spec, (name if spec is not None else None)


def check_spec(spec: StructuredOutput, field: str) -> None:
    """Parse ``spec`` with the grammar engine (an invalid schema, regex or grammar, or a JSON Schema keyword it does
    not implement, is a 400 naming ``field``).

    Example:
        >>> check_spec(StructuredOutput.regex("(("), "guided_regex")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        pagedcore.serve.protocol.ApiError: guided_regex: invalid regex '((': ...
    """
    try:
        _parser().parse(spec)
    except PagedCoreError as exc:
        raise ApiError(400, f"{field}: {exc}", param=field) from exc


@functools.lru_cache(maxsize=1)
def _parser() -> GrammarCompiler:
    """A compiler used only to parse (it never builds a vocabulary): its parse cache is shared by every request."""
    return GrammarCompiler(None)
