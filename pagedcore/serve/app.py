"""The OpenAI-compatible HTTP app (FastAPI) in front of a :class:`~pagedcore.serve.loop.RequestLoop`.

Endpoints (``routes/``, one router per group): ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST
/v1/completions``, ``POST /v1/chat/completions`` (JSON or server-sent events with ``"stream": true``), ``GET
/health``, ``GET /metrics`` (Prometheus text), ``GET /openapi.json``. Handlers never touch the engine: they submit to
the loop (``pipeline.py``) and read their events from an asyncio queue.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from pagedcore import __version__
from pagedcore.errors import AdapterError, ConfigError

from .auth import ApiKeys
from .body import BodyLimits
from .context import ServeContext, ServeSettings
from .errors import install_error_handlers
from .loop import EngineLoop, RequestLoop
from .metrics import ServeMetrics
from .middleware import RequestIdHeaders, RootPath
from .openapi import install_openapi
from .prompts import PromptEncoder
from .reasoning import Reasoning
from .responses_api.store import DEFAULT_STORE_BYTES, ResponseStore
from .routes import ROUTERS
from .routes import lora as lora_routes
from .routes.completions import DEFAULT_COMPLETION_MAX_TOKENS
from .server_logs import RequestLog
from .tool_calls import TOOL_PARSERS

__all__ = ["DEFAULT_COMPLETION_MAX_TOKENS", "AppOptions", "create_app"]


@dataclass(frozen=True)
class AppOptions:
    """What ``pagedcore serve``'s vLLM-style flags change in the app.

    Attributes:
        aliases: more names the model answers to (``--served-model-name a b``: ``a`` is the model name).
        chat_template: the server's chat template (``--chat-template``), over the tokenizer's.
        trust_request_chat_template: run a request's own ``chat_template`` (``--trust-request-chat-template``).
        allowed_origins: origins a browser may call the API from (``--allowed-origins``; empty: no CORS headers).
        allowed_methods / allowed_headers / allow_credentials: the rest of the CORS policy.
        model_root: the model's path or hub name (``/v1/models``' ``root``; default: the model name).
        response_role: the role of chat answers (``--response-role``; vLLM's: when the prompt ends with the
            generation prompt).
        return_tokens_as_token_ids: every request's logprobs show tokens as ``token_id:ID``.
        auto_tool_choice: read tool calls from free answers (``tool_choice="auto"``); False refuses it (vLLM without
            ``--enable-auto-tool-choice``).
        reasoning_parser: split reasoning off answers (a key of :data:`~pagedcore.serve.reasoning.FORMATS`).
        default_chat_template_kwargs: chat template variables every request gets (its own win).
        sampling_defaults: request field -> default value (``--generation-config``, see
            :mod:`~pagedcore.serve.sampling_defaults`).
        root_path: the path prefix a proxy serves the app under (``--root-path``).
        openapi: serve ``/openapi.json`` (``--disable-fastapi-docs`` turns it off).
        request_id_headers: answers carry ``X-Request-Id`` (``--enable-request-id-headers``).
        request_log: log each request (``--enable-log-requests``; None: no).
        responses_store_bytes: the Responses API keeps responses (for ``previous_response_id``) within this many
            bytes per tenant.
        lora_parents: LoRA adapter name -> the served name ``/v1/models`` shows as its parent (``--lora-modules``'
            ``base_model_name``; default: the model's first name).
        runtime_lora_updating: serve ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's
            ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; they need an engine built with LoRA).

    Example:
        >>> AppOptions(allowed_origins=("*",)).allowed_methods
        ('*',)
    """

    aliases: Sequence[str] = ()
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    allowed_origins: Sequence[str] = ()
    allowed_methods: Sequence[str] = ("*",)
    allowed_headers: Sequence[str] = ("*",)
    allow_credentials: bool = False
    model_root: str | None = None
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    auto_tool_choice: bool = True
    reasoning_parser: str | None = None
    default_chat_template_kwargs: Mapping[str, Any] | None = None
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    root_path: str | None = None
    openapi: bool = True
    request_id_headers: bool = False
    request_log: RequestLog | None = None
    responses_store_bytes: int = DEFAULT_STORE_BYTES
    lora_parents: Mapping[str, str] = field(default_factory=dict)
    runtime_lora_updating: bool = False


def create_app(
    loop: RequestLoop,
    *,
    model_name: str,
    api_keys: ApiKeys | None = None,
    tokenizer: Any = None,
    context_length: int | None = None,
    limits: BodyLimits | None = None,
    options: AppOptions | None = None,
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
        options: model aliases, chat templates and CORS (:class:`AppOptions`).
        tool_call_parser: the format ``tool_choice="auto"`` reads tool calls in (a key of
            :data:`~pagedcore.serve.tool_calls.TOOL_PARSERS`).

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import Engine
        >>> model = tiny_llama(num_hidden_layers=1)
        >>> with Engine(model, num_blocks=16, block_size=8) as engine:
        ...     app = create_app(EngineLoop(engine), model_name="tiny")
        >>> sorted(path for path in app.openapi()["paths"] if path.startswith("/v1"))
        ['/v1/chat/completions', '/v1/completions', '/v1/models', '/v1/models/{model_id}', '/v1/responses', \
'/v1/responses/{response_id}']
    """
    options = options or AppOptions()
    if tool_call_parser not in TOOL_PARSERS:
        raise ConfigError(f"unknown tool-call parser {tool_call_parser!r}: use one of {', '.join(TOOL_PARSERS)}")
    tokenizer, context, eos = _engine_defaults(loop, tokenizer, context_length)
    app = FastAPI(
        title="pagedcore",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json" if options.openapi else None,
    )
    app.state.serve = _context(loop, model_name, api_keys, tokenizer, context, limits, options, tool_call_parser, eos)
    _add_middleware(app, options)
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    if options.runtime_lora_updating and app.state.serve.adapters is not None:  # vLLM's switch, as vLLM
        app.include_router(lora_routes.router)
    install_openapi(app)
    return app


def _add_middleware(app: FastAPI, options: AppOptions) -> None:
    """CORS, ``X-Request-Id`` headers and the root path, as the options ask."""
    _add_cors(app, options)
    if options.request_id_headers:
        app.add_middleware(RequestIdHeaders)
    if options.root_path:
        app.add_middleware(RootPath, root_path=options.root_path)


def _context(
    loop: RequestLoop,
    model_name: str,
    api_keys: ApiKeys | None,
    tokenizer: Any,
    context: int | None,
    limits: BodyLimits | None,
    options: AppOptions,
    tool_call_parser: str,
    eos: tuple[int, ...],
) -> ServeContext:
    """The app's shared state (:class:`~pagedcore.serve.context.ServeContext`)."""
    reasoning = None if options.reasoning_parser is None else Reasoning(options.reasoning_parser, tokenizer)
    return ServeContext(
        loop=loop,
        metrics=ServeMetrics(loop, model_name=model_name, context_length=context),
        model_name=model_name,
        encoder=PromptEncoder(tokenizer, context, options.chat_template, reasoning),
        api_keys=api_keys,
        limits=limits or BodyLimits(),
        loop_errors_are_public=getattr(loop, "public_errors", False) is True,
        aliases=tuple(options.aliases),
        trust_request_chat_template=options.trust_request_chat_template,
        tool_call_parser=tool_call_parser,
        settings=_settings(options, reasoning, model_name, loop),
        responses=ResponseStore(options.responses_store_bytes),
        eos_token_ids=eos,
        adapters=_adapters(loop),
        lora_parents=dict(options.lora_parents),
        runtime_lora_updating=options.runtime_lora_updating,
    )


def _settings(options: AppOptions, reasoning: Reasoning | None, model_name: str, loop: Any) -> ServeSettings:
    engine = loop.engine if isinstance(loop, EngineLoop) else None  # Ray's replicas always keep prefixes
    return ServeSettings(
        prefix_caching=engine is None or engine.scheduler.config.enable_prefix_caching,
        model_root=options.model_root or model_name,
        response_role=options.response_role,
        return_tokens_as_token_ids=options.return_tokens_as_token_ids,
        auto_tool_choice=options.auto_tool_choice,
        reasoning=reasoning,
        default_chat_template_kwargs=dict(options.default_chat_template_kwargs or {}),
        sampling_defaults=dict(options.sampling_defaults),
        request_log=options.request_log,
    )


def _engine_defaults(loop: RequestLoop, tokenizer: Any, context: int | None) -> tuple[Any, int | None, tuple[int, ...]]:
    """The tokenizer, context length and eos ids, defaulting to an :class:`EngineLoop`'s engine's (another loop's
    engines stop at their own eos; a request's ``stop_token_ids`` add the tokenizer's)."""
    eos: tuple[int, ...] = ()
    if isinstance(loop, EngineLoop):
        engine = loop.engine
        tokenizer = engine.tokenizer if tokenizer is None else tokenizer
        eos = engine.eos_token_ids
        if context is None:
            context = engine.context.limit
    elif isinstance(getattr(tokenizer, "eos_token_id", None), int):
        eos = (tokenizer.eos_token_id,)
    return tokenizer, context, eos


def _adapters(loop: RequestLoop) -> Any:
    """An :class:`EngineLoop`'s engine's LoRA adapters, when it serves them (else None)."""
    if not isinstance(loop, EngineLoop):
        return None
    try:
        return loop.engine.loras
    except AdapterError:  # an engine built without enable_lora
        return None


def _add_cors(app: FastAPI, options: AppOptions) -> None:
    """CORS headers for the allowed origins (none: no CORS headers at all)."""
    if options.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.allowed_origins),
            allow_methods=list(options.allowed_methods),
            allow_headers=list(options.allowed_headers),
            allow_credentials=options.allow_credentials,
        )
