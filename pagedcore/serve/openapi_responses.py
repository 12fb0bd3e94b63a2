"""What ``/openapi.json`` says of the Responses API: ``POST /v1/responses``'s body (every field the server knows,
implemented or accepted only at its no-op values, and no other; the input items and their parts as
:mod:`~pagedcore.serve.responses_api.items` reads them; tools, ``tool_choice`` and ``text.format`` as
:mod:`~pagedcore.serve.responses_api.request` converts them; this app's model names, context and vocabulary), the
response object it answers (and ``GET /v1/responses/{response_id}`` returns), and which ids exist: only those the
server answered (the POST's answer links to ``GET`` and ``DELETE`` by its ``id``); any other is a 404.

A request becomes a chat request (``to_chat``), so the chat path's rules hold too: what JSON Schema cannot state is
in the operations' ``x-pagedcore-rules`` (:data:`RULES`, :data:`ID_RULES`), e.g. that the input's tokens, counted
as ``POST /tokenize`` counts the chat messages it stands for, plus ``max_output_tokens`` fit the context.
"""

from __future__ import annotations

from typing import Any

from .openapi_rules import NO_AUTO_TOOL_CHOICE, ServedFacts, sampling_schemas, state_rules, tool_choice_schema
from .openapi_schemas import closed, integer, nullable
from .protocol import MAX_ID_CHARS, MAX_SALT_CHARS
from .responses_api.request import FIELDS, LOGPROBS_INCLUDE, MAX_INPUT_ITEMS

__all__ = ["ID_RULES", "RULES", "tighten_responses"]

RULES: tuple[str, ...] = (
    "the input as chat messages (instructions first as a system message; then the conversation of "
    "previous_response_id: its messages and its answer as an assistant turn; then the input: a text as a user "
    "message, a message item as its role and its parts' text joined, consecutive function_call items as one "
    "assistant message with tool_calls, a function_call_output as a tool message, a reasoning item as the next "
    "assistant message's reasoning_content) has tokens, as POST /tokenize counts those messages with the tools "
    "(in chat's form), that plus max_output_tokens (without it: 1) fit max_model_len; with truncation auto, only "
    "the last max(1, max_model_len - max_output_tokens) of them count (max_output_tokens absent: 1)",
    "the messages' contents (the instructions', the kept conversation's and the input's) have at most as many "
    "characters in all as a text input may (input's maxLength)",
    "previous_response_id is the id of a response this server answered to the same API key with store not false, "
    "not deleted nor dropped since (else 404)",
    "tool_choice other than none needs tools; a named function is one of them; tool names are unique",
    "at most one of text.format json_object / json_schema and tool_choice required / a named function, and none of "
    "them with ignore_eos",
)
"""``POST /v1/responses``'s rules that JSON Schema cannot state (its ``x-pagedcore-rules``)."""

ID_RULES: tuple[str, ...] = (
    "response_id is the id of a response this server answered (POST /v1/responses's id, the links of its answer) "
    "to the same API key with store not false, not deleted nor dropped since: any other is a 404",
)
"""``GET`` / ``DELETE /v1/responses/{response_id}``'s rule (their ``x-pagedcore-rules``)."""

_REF = "#/components/schemas/{}"
_ID_PATH = "/v1/responses/{response_id}"
_STATUS = {"enum": ["in_progress", "completed", "incomplete"]}
_STRING = {"type": "string"}


def tighten_responses(document: dict[str, Any], facts: ServedFacts) -> None:
    """Write the Responses API's request and answer schemas, rules and id links into ``document`` (built from the
    request models, ``ResponsesRequest`` among them).

    Example:
        >>> from pagedcore.serve.responses_api.request import ResponsesRequest
        >>> doc = {"components": {"schemas": {"ResponsesRequest": ResponsesRequest.model_json_schema()}}, "paths": {}}
        >>> tighten_responses(doc, ServedFacts(("tiny",), 99, 48, 192, 20, 8, False))
        >>> doc["components"]["schemas"]["ResponsesRequest"]["properties"]["truncation"]
        {'anyOf': [{'enum': ['disabled', 'auto']}, {'type': 'null'}]}
    """
    schemas = document["components"]["schemas"]
    if "ResponsesRequest" not in schemas:
        return
    _request(schemas["ResponsesRequest"], facts)
    schemas.update(_ITEMS)
    schemas["Response"] = RESPONSE
    schemas["DeletedResponse"] = closed(
        ("id", "object", "deleted"), id=_STRING, object={"const": "response"}, deleted={"const": True}
    )
    create = document["paths"].get("/v1/responses", {}).get("post")
    if create is not None:
        state_rules(create, RULES)
        create["responses"]["200"]["content"]["application/json"]["schema"] = {"$ref": _REF.format("Response")}
        create["responses"]["200"]["links"] = {
            f"{verb}Response": {
                "operationId": operation["operationId"],
                "parameters": {"response_id": "$response.body#/id"},
            }
            for verb, operation in (("Get", _by_id(document, "get")), ("Delete", _by_id(document, "delete")))
            if operation is not None
        }
        create["responses"]["404"] = _not_found("the model is not served, or previous_response_id is not kept")
    for method, answer in (("get", "Response"), ("delete", "DeletedResponse")):
        operation = _by_id(document, method)
        if operation is None:
            continue
        for parameter in operation.get("parameters", ()):
            parameter["schema"] = {"type": "string", "minLength": 1}
        state_rules(operation, ID_RULES)
        operation["responses"]["200"]["content"]["application/json"]["schema"] = {"$ref": _REF.format(answer)}
        operation["responses"]["404"] = _not_found("no response of this id is kept for this API key")


def _by_id(document: dict[str, Any], method: str) -> dict[str, Any] | None:
    operation: dict[str, Any] | None = document["paths"].get(_ID_PATH, {}).get(method)
    return operation


def _not_found(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": _REF.format("Error")}}}}


def _request(schema: dict[str, Any], facts: ServedFacts) -> None:
    properties = schema["properties"]
    for name, rule in FIELDS.items():
        if rule.status == "refused":
            properties[name] = {"enum": [None, *rule.no_op]}  # accepted at its no-op values only
    schema["additionalProperties"] = False  # any other field is a 400 naming it
    chars, logprobs = facts.max_prompt_chars, facts.max_logprobs
    text = {"type": "string", **({"maxLength": chars} if chars is not None else {})}
    items = {"type": "array", "items": {"$ref": _REF.format("ResponseInputItem")}, "minItems": 1,
             "maxItems": MAX_INPUT_ITEMS, "contains": {"$ref": _REF.format("ResponseInputTurn")}}  # fmt: skip
    given = {
        **sampling_schemas(facts),
        "input": {"anyOf": [text, items]},
        "instructions": text,
        "previous_response_id": {"type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS},
        "max_output_tokens": integer(0, facts.context),
        "cache_salt": {"type": "string", "minLength": 1, "maxLength": MAX_SALT_CHARS},
        "tools": {"type": "array", "items": _TOOL},
        "tool_choice": tool_choice_schema(facts, _NAMED),
        "text": {
            "type": "object",
            "properties": {"format": nullable(_FORMAT), "verbosity": nullable({"const": "medium"})},
            "additionalProperties": False,
        },
        "include": {"type": "array", "items": {"const": LOGPROBS_INCLUDE}},
        "top_logprobs": integer(0, 20 if logprobs is None else min(20, logprobs)),
        "truncation": {"enum": ["disabled", "auto"]},
    }
    for name, value in given.items():
        properties[name] = value if name in schema.get("required", ()) else nullable(value)
    schema["allOf"] = [_LOGPROBS_NEED_INCLUDE, *([] if facts.auto_tool_choice else [NO_AUTO_TOOL_CHOICE])]


# top_logprobs > 0 needs include: ["message.output_text.logprobs"].
_LOGPROBS_NEED_INCLUDE = {
    "if": {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}}, "required": ["top_logprobs"]},
    "then": {
        "required": ["include"],
        "properties": {"include": {"type": "array", "contains": {"const": LOGPROBS_INCLUDE}}},
    },
}
_TOOL = closed(
    ("type", "name"),
    type={"const": "function"},
    name={"type": "string", "minLength": 1},
    description=nullable(_STRING),
    parameters=nullable({"type": "object", "format": "json-schema"}),
    strict=nullable({"type": "boolean"}),
)
_NAMED = closed(("type", "name"), type={"const": "function"}, name={"type": "string", "minLength": 1})
_SCHEMA = {"anyOf": [{"type": "object"}, {"type": "string", "format": "json-schema"}]}
_FORMAT = {
    "oneOf": [
        closed(type={"const": "text"}),
        closed(type={"const": "json_object"}),
        closed(
            ("type", "schema"),
            type={"const": "json_schema"},
            schema=_SCHEMA,
            name=_STRING,
            strict=nullable({"type": "boolean"}),
            description=nullable(_STRING),
        ),
    ]
}


def _item_schemas() -> dict[str, Any]:
    """The input items and their parts (components of the document)."""
    ref = _REF.format
    words = {"type": "array", "items": {"$ref": ref("ResponseTextPart")}}
    content = {"anyOf": [_STRING, words]}
    seen = {"id": nullable(_STRING), "status": nullable(_STATUS)}  # as the API answered them: of no effect here
    parts = {
        "oneOf": [
            closed(("type", "text"), type={"enum": ["input_text", "text"]}, text=_STRING),
            closed(("type", "text"), type={"const": "output_text"}, text=_STRING, annotations={"type": "array"},
                   logprobs={"type": "array"}),
            closed(("type", "refusal"), type={"const": "refusal"}, refusal=_STRING),
        ]
    }  # fmt: skip
    roles = {"enum": ["user", "assistant", "system", "developer"]}
    phase = nullable({"enum": ["commentary", "final_answer"]})
    message = closed(("role", "content"), type={"const": "message"}, role=roles, content=content, phase=phase, **seen)
    call = closed(("type", "call_id", "name"), type={"const": "function_call"}, call_id=_STRING, name=_STRING,
                  arguments=_STRING, **seen)  # fmt: skip
    output = closed(("type", "call_id", "output"), type={"const": "function_call_output"}, call_id=_STRING,
                    output=content, **seen)  # fmt: skip

    def thought(kind: str) -> dict[str, Any]:
        return nullable({"type": "array", "items": closed(("type", "text"), type={"const": kind}, text=_STRING)})

    reasoning = closed(("type",), type={"const": "reasoning"}, content=thought("reasoning_text"),
                       summary=thought("summary_text"), encrypted_content={"type": "null"}, **seen)  # fmt: skip
    turns = [ref("ResponseInputMessage"), ref("ResponseFunctionCall"), ref("ResponseFunctionCallOutput")]
    return {
        "ResponseTextPart": parts,
        "ResponseInputMessage": message,
        "ResponseFunctionCall": call,
        "ResponseFunctionCallOutput": output,
        "ResponseReasoningItem": reasoning,
        "ResponseInputTurn": {"anyOf": [{"$ref": turn} for turn in turns]},
        "ResponseInputItem": {"anyOf": [{"$ref": turn} for turn in [*turns, ref("ResponseReasoningItem")]]},
    }


_ITEMS = _item_schemas()


def _response_schema() -> dict[str, Any]:
    """The response object (``POST /v1/responses``'s JSON answer, ``GET /v1/responses/{response_id}``'s)."""
    number, boolean, maybe_int = {"type": "number"}, {"type": "boolean"}, nullable({"type": "integer"})
    texts = {"type": "array", "items": {"type": "object", "required": ["type", "text"]}}
    output = {
        "oneOf": [
            {"type": "object", "required": ["type", "id", "role", "status", "content"],
             "properties": {"type": {"const": "message"}, "role": {"const": "assistant"}, "status": _STATUS,
                            "content": texts}},
            {"type": "object", "required": ["type", "id", "summary", "content"],
             "properties": {"type": {"const": "reasoning"}, "content": texts, "summary": {"type": "array"}}},
            {"type": "object", "required": ["type", "id", "call_id", "name", "arguments", "status"],
             "properties": {"type": {"const": "function_call"}, "call_id": _STRING, "name": _STRING,
                            "arguments": _STRING, "status": _STATUS}},
        ]
    }  # fmt: skip
    usage = {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"],
             "properties": {name: {"type": "integer", "minimum": 0}
                            for name in ("input_tokens", "output_tokens", "total_tokens")}}  # fmt: skip
    properties = {
        "id": {"type": "string", "pattern": "^resp_"}, "object": {"const": "response"}, "created_at": number,
        "status": {"enum": ["completed", "incomplete", "in_progress", "failed"]}, "error": nullable(
            {"type": "object", "required": ["code", "message"]}), "incomplete_details": nullable({"type": "object"}),
        "instructions": nullable(_STRING), "max_output_tokens": maybe_int, "max_tool_calls": maybe_int,
        "model": _STRING, "output": {"type": "array", "items": output}, "parallel_tool_calls": boolean,
        "previous_response_id": nullable(_STRING), "store": boolean, "temperature": number, "top_p": number,
        "top_logprobs": maybe_int, "tools": {"type": "array"}, "usage": nullable(usage),
        "metadata": {"type": "object", "additionalProperties": _STRING},
    }  # fmt: skip
    return {"type": "object", "required": list(properties), "properties": properties}


RESPONSE = _response_schema()
"""The response object's schema (the document's ``Response``)."""
