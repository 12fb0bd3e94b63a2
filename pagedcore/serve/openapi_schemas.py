"""The JSON Schema building blocks ``/openapi.json`` is written with (:mod:`pagedcore.serve.openapi_rules` for the
completion, chat and tokenizer endpoints, :mod:`pagedcore.serve.openapi_responses` for the Responses API).
"""

from __future__ import annotations

from typing import Any

__all__ = ["TOKEN", "closed", "integer", "nullable", "text"]

TOKEN = {"$ref": "#/components/schemas/TokenId"}
"""A token id of this app's vocabulary (the document's ``TokenId``)."""


def text(max_chars: int | None = None) -> dict[str, Any]:
    """A non-empty string (of at most ``max_chars``).

    Example:
        >>> text(8)
        {'type': 'string', 'minLength': 1, 'maxLength': 8}
    """
    return {"type": "string", "minLength": 1, **({"maxLength": max_chars} if max_chars is not None else {})}


def integer(low: int | None, high: int | None) -> dict[str, Any]:
    """An integer in ``[low, high]`` (None: unbounded on that side).

    Example:
        >>> integer(0, None)
        {'type': 'integer', 'minimum': 0}
    """
    out: dict[str, Any] = {"type": "integer"}
    if low is not None:
        out["minimum"] = low
    if high is not None:
        out["maximum"] = high
    return out


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` or null.

    Example:
        >>> nullable({"type": "string"})
        {'anyOf': [{'type': 'string'}, {'type': 'null'}]}
    """
    return {"anyOf": [schema, {"type": "null"}]}


def closed(required: tuple[str, ...] = (), **properties: Any) -> dict[str, Any]:
    """An object of these properties and no other, ``required`` given (default: the first).

    Example:
        >>> closed(type={"const": "text"})["required"], closed(type={"const": "text"})["additionalProperties"]
        (['type'], False)
    """
    return {
        "type": "object",
        "properties": properties,
        "required": list(required) or [next(iter(properties))],
        "additionalProperties": False,
    }
