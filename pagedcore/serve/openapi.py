"""The app's OpenAPI document (``GET /openapi.json``): request bodies from the pydantic request models, every error
response with OpenAI's error body.

The generation endpoints read their bodies themselves (bounded, strict, off the event loop), so FastAPI cannot infer
their schemas: each route declares its body with :func:`json_body`, and :func:`install_openapi` adds the models'
schemas to the document's components.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from .lora_bodies import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from .openapi_responses import tighten_responses
from .openapi_rules import ServedFacts, tighten
from .protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .responses_api.request import ResponsesRequest

__all__ = ["ERROR_RESPONSES", "REQUEST_MODELS", "install_openapi", "json_body"]

REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest,
    ChatRequest,
    ResponsesRequest,
    TokenizeRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
_REF = "#/components/schemas/{model}"

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


# One server-sent event: its data is a JSON chunk (or an error body), the last one is "[DONE]".
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error("bad input"),
    401: _error("no known API key (with --api-keys)"),
    404: _error("unknown model"),
    405: _error("method not allowed"),
    408: _error("the body came too slowly"),
    413: _error("the body is too large"),
    429: _error("the queue is full"),
    500: _error("the server failed (a generic message and a request id)"),
    503: _error("shutting down"),
}
"""The error responses of the endpoints that take a body (for ``responses=``)."""


def json_body(model: type[BaseModel], *, streams: bool = True) -> dict[str, Any]:
    """The ``openapi_extra`` of a route whose JSON body is ``model``, answered with JSON (or server-sent events).

    Example:
        >>> json_body(CompletionRequest)["requestBody"]["content"]["application/json"]["schema"]
        {'$ref': '#/components/schemas/CompletionRequest'}
    """
    extra: dict[str, Any] = {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}},
        }
    }
    if streams:
        content = {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": _SSE_EVENT},
        }
        extra["responses"] = {"200": {"description": "the answer (events with stream: true)", "content": content}}
    return extra


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` build the document with the request models' schemas (and the error body's).

    Example:
        >>> app = FastAPI(title="t", version="1")
        >>> install_openapi(app)
        >>> sorted(app.openapi()["components"]["schemas"])[:3]
        ['CacheBreakpoint', 'ChatMessage', 'ChatRequest']
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for model in REQUEST_MODELS:
                schema = model.model_json_schema(ref_template=_REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            schemas["Error"] = ERROR_SCHEMA
            _no_422(document)
            serve = getattr(app.state, "serve", None)
            if serve is not None:  # this app's facts: names, vocabulary, context, and the server's rules
                facts = served_facts(serve)
                tighten(document, facts)
                tighten_responses(document, facts)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _no_422(document: dict[str, Any]) -> None:
    """FastAPI lists a 422 for every operation with parameters; this app answers its checks' failures 400 with
    OpenAI's error body (:mod:`pagedcore.serve.errors`), so the document says that instead."""
    for item in document.get("paths", {}).values():
        for operation in item.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None:
                responses.setdefault("400", ERROR_RESPONSES[400])
    schemas = document.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)


def served_facts(serve: Any) -> ServedFacts:
    """What the document states of the app whose :class:`~pagedcore.serve.context.ServeContext` is ``serve``.

    Example:
        >>> from pagedcore.serve.context import ServeContext
        >>> from pagedcore.serve.prompts import PromptEncoder
        >>> served_facts(ServeContext(loop=None, metrics=None, model_name="m", encoder=PromptEncoder(None, 48))).context
        48
    """
    engine = getattr(serve.loop, "engine", None)
    tokenizer = serve.encoder.tokenizer
    sizes = [len(tokenizer)] if tokenizer is not None else []
    model_vocab = getattr(getattr(getattr(engine, "model", None), "config", None), "vocab_size", None)
    if isinstance(model_vocab, int):
        sizes.append(model_vocab)  # ids the tokenizer has and the model scores
    vocab = min(sizes) if sizes else None
    max_logprobs = getattr(engine, "max_logprobs", None)
    scheduler = getattr(engine, "scheduler", None)
    return ServedFacts(
        model_names=(*serve.model_names, *serve.adapter_names()),
        vocab_size=vocab,
        context=serve.context_length,
        max_prompt_chars=serve.encoder.max_chars,
        max_logprobs=None if max_logprobs in (None, -1) else max_logprobs,
        max_num_seqs=None if scheduler is None else scheduler.config.max_num_seqs,
        trust_request_chat_template=serve.trust_request_chat_template,
        has_chat_template=serve.encoder.renderer.template is not None,
        splits_reasoning=serve.settings.reasoning is not None,
        auto_tool_choice=serve.settings.auto_tool_choice,
    )
