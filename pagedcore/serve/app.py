"""The OpenAI-compatible HTTP app (FastAPI) in front of a :class:`~pagedcore.serve.loop.RequestLoop`.

Endpoints (``routes/``, one router per group): ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST
/v1/completions``, ``POST /v1/chat/completions`` (JSON or server-sent events with ``"stream": true``), ``GET
/health``, ``GET /metrics`` (Prometheus text), ``GET /openapi.json``. Handlers never touch the engine: they submit to
the loop (``pipeline.py``) and read their events from an asyncio queue.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from pagedcore import __version__
from pagedcore.adapters.transformers.spec import text_config
from pagedcore.errors import ConfigError

from .auth import ApiKeys
from .body import BodyLimits
from .context import ServeContext
from .errors import install_error_handlers
from .loop import EngineLoop, RequestLoop
from .metrics import ServeMetrics
from .openapi import install_openapi
from .prompts import PromptEncoder
from .routes import ROUTERS
from .routes.completions import DEFAULT_COMPLETION_MAX_TOKENS
from .tool_calls import TOOL_PARSERS

__all__ = ["DEFAULT_COMPLETION_MAX_TOKENS", "create_app"]


def create_app(
    loop: RequestLoop,
    *,
    model_name: str,
    api_keys: ApiKeys | None = None,
    tokenizer: Any = None,
    context_length: int | None = None,
    limits: BodyLimits | None = None,
    tool_call_parser: str = "hermes",
) -> FastAPI:
    """The OpenAI-compatible app over ``loop`` (which the caller starts and stops).

    Args:
        loop: the engine loop (or another :class:`~pagedcore.serve.loop.RequestLoop`, e.g. engine replicas on Ray).
        model_name: the name clients give as ``model`` (``GET /v1/models`` lists it).
        api_keys: when given, every ``/v1`` request needs ``Authorization: Bearer KEY`` of a known key (else 401),
            and runs in its tenant's prefix-cache namespace.
        tokenizer: default: the engine's (an :class:`EngineLoop`'s); chat needs one. Prompts are tokenized with it
            in a worker thread, and the engine receives token ids.
        context_length: the model's context in tokens (the default length of a chat answer, and the bound on a
            prompt's length); default: the engine's model's ``max_position_embeddings``.
        limits: bounds on request bodies (default :class:`~pagedcore.serve.body.BodyLimits`: 8 MiB, 30 s).
        tool_call_parser: the format ``tool_choice="auto"`` reads tool calls in (a key of
            :data:`~pagedcore.serve.tool_calls.TOOL_PARSERS`).

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import Engine
        >>> model = tiny_llama(num_hidden_layers=1)
        >>> with Engine(model, num_blocks=16, block_size=8) as engine:
        ...     app = create_app(EngineLoop(engine), model_name="tiny")
        >>> sorted(path for path in app.openapi()["paths"] if path.startswith("/v1"))
        ['/v1/chat/completions', '/v1/completions', '/v1/models', '/v1/models/{model_id}']
    """
    if tool_call_parser not in TOOL_PARSERS:
        raise ConfigError(f"unknown tool-call parser {tool_call_parser!r}: use one of {', '.join(TOOL_PARSERS)}")
    context = context_length
    if isinstance(loop, EngineLoop):
        engine = loop.engine
        tokenizer = engine.tokenizer if tokenizer is None else tokenizer
        if context is None:
            context = getattr(text_config(engine.model), "max_position_embeddings", None)
    app = FastAPI(title="pagedcore", version=__version__, docs_url=None, redoc_url=None)
    app.state.serve = ServeContext(
        loop=loop,
        metrics=ServeMetrics(loop),
        model_name=model_name,
        encoder=PromptEncoder(tokenizer, context),
        api_keys=api_keys,
        limits=limits or BodyLimits(),
        loop_errors_are_public=getattr(loop, "public_errors", False) is True,
        tool_call_parser=tool_call_parser,
    )
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    install_openapi(app)
    return app
