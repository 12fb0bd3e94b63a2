"""What every endpoint of one app shares: the loop, the metrics, the served model's names, the API keys, the prompt
encoder, the body limits and the admission (open, or draining for a shutdown). The app keeps one
:class:`ServeContext` in ``app.state.serve``; routers reach it with the :func:`serve_context` dependency, so a new
endpoint (or a new flag) needs no closure over ``create_app``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends
from starlette.requests import Request

from pagedcore.engine.context import ContextWindow

from .admission import Admission
from .auth import ApiKeys
from .body import BodyLimits
from .logprob_shapes import LogprobFormat
from .loop import RequestLoop
from .metrics import ServeMetrics
from .prompts import PromptEncoder
from .protocol import ApiError
from .responses_api.store import ResponseStore

__all__ = ["Context", "ServeContext", "ServeSettings", "serve_context"]


@dataclass(frozen=True)
class ServeSettings:
    """What ``pagedcore serve``'s vLLM flags set for every request (see :class:`~pagedcore.serve.app.AppOptions`).

    Attributes:
        model_root: the model's path or hub name (``/v1/models``' ``root``).
        response_role: the role of chat answers.
        return_tokens_as_token_ids: logprobs show tokens as ``token_id:ID`` for every request.
        auto_tool_choice: ``tool_choice="auto"`` is served (False: refused, as vLLM without
            ``--enable-auto-tool-choice``).
        reasoning: the reasoning parser (:class:`~pagedcore.serve.reasoning.Reasoning`), or None.
        default_chat_template_kwargs: chat template variables under each request's own.
        sampling_defaults: request field -> default (the generation config's).
        request_log: logs each request (None: no).
        prefix_caching: the engine keeps computed prompt blocks for later requests (the Responses API's
            ``cache_write_tokens`` counts them).

    Example:
        >>> ServeSettings().response_role
        'assistant'
    """

    model_root: str | None = None
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    auto_tool_choice: bool = True
    reasoning: Any = None
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    request_log: Any = None
    prefix_caching: bool = True


@dataclass
class ServeContext:
    """The shared state of one app (see the module docstring).

    Args:
        loop: the engine loop (or another request loop).
        metrics: the app's metrics.
        model_name: the name clients give as ``model`` (and answers carry).
        aliases: other names clients may give (``--served-model-name a b``).
        encoder: turns prompts into token ids (its ``context`` is the model's context in tokens, or None).
        api_keys: the known keys (None: no authentication).
        limits: bounds on request bodies.
        loop_errors_are_public: whether the loop's error messages are fit for clients already (a loop that says
            so with a ``public_errors = True`` attribute, as Ray's ``ReplicaLoop`` does); else a server error's
            message is replaced by a generic one naming the request id (:func:`~pagedcore.serve.errors.public_error`).
        trust_request_chat_template: whether a request's own ``chat_template`` is used (else it gets a 400, as vLLM
            without ``--trust-request-chat-template``).
        admission: open, or closed while the server drains for a shutdown.
        tool_call_parser: the tool-call format ``tool_choice="auto"`` reads (:mod:`pagedcore.serve.tool_calls`).
        settings: what the vLLM flags set for every request (:class:`ServeSettings`).
        responses: the responses kept for ``previous_response_id`` (the Responses API).
        eos_token_ids: the model's stop tokens, which a request's ``stop_token_ids`` add to (vLLM's rule).
        adapters: the engine's LoRA adapters (:class:`~pagedcore.engine.lora.AdapterSet`: a request's ``model`` may
            name one), or None.
        lora_parents: adapter name -> the served name ``/v1/models`` shows as its ``parent`` (default: the first).
        runtime_lora_updating: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` are served (vLLM's
            ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).

    Example:
        >>> ctx = ServeContext(loop=None, metrics=None, model_name="tiny", encoder=PromptEncoder(None, None))
        >>> ctx.check_model("other")
        Traceback (most recent call last):
        ...
        pagedcore.serve.protocol.ApiError: the model 'other' does not exist; this server serves 'tiny'
        >>> ctx.model_card()["id"]
        'tiny'
    """

    loop: RequestLoop
    metrics: ServeMetrics
    model_name: str
    encoder: PromptEncoder
    api_keys: ApiKeys | None = None
    limits: BodyLimits = field(default_factory=BodyLimits)
    loop_errors_are_public: bool = False
    aliases: tuple[str, ...] = ()
    trust_request_chat_template: bool = False
    admission: Admission = field(default_factory=Admission)
    tool_call_parser: str = "hermes"
    settings: ServeSettings = field(default_factory=ServeSettings)
    responses: ResponseStore = field(default_factory=ResponseStore)
    eos_token_ids: tuple[int, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))
    adapters: Any = None
    lora_parents: dict[str, str] = field(default_factory=dict)
    runtime_lora_updating: bool = False

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the model is served under (the first is the one answers carry)."""
        return (self.model_name, *(name for name in self.aliases if name != self.model_name))

    @property
    def context_length(self) -> int | None:
        """The model's context in tokens (None: unknown)."""
        return self.encoder.context

    @property
    def context(self) -> ContextWindow:
        """The context served, and its rule (:class:`~pagedcore.engine.context.ContextWindow`)."""
        return ContextWindow(self.encoder.context)

    def authorize(self, request: Request) -> str | None:
        """The tenant of the request's API key (None without keys); raises :class:`ApiError` 401."""
        if self.api_keys is None:
            return None
        tenant = self.api_keys.tenant(request.headers.get("authorization"))
        if tenant is None:
            raise ApiError(401, "a valid API key is required: Authorization: Bearer KEY", code="invalid_api_key")
        return tenant

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter ``name`` names (None: the base model, under one of its names); raise :class:`ApiError`
        404 for any other name."""
        if name in self.model_names:
            return None
        if self.adapters is not None and isinstance(name, str) and name in self.adapter_names():
            return name
        served = " or ".join(repr(n) for n in self.model_names)
        loaded = " or a loaded LoRA adapter (GET /v1/models)" if self.adapters is not None else ""
        raise ApiError(
            404,
            f"the model {name!r} does not exist; this server serves {served}{loaded}",
            param="model",
            code="model_not_found",
        )

    def adapter_names(self) -> list[str]:
        """The LoRA adapters loaded now, in load order (none without ``--enable-lora``)."""
        return [] if self.adapters is None else [info.name for info in self.adapters.adapters()]

    def model_cards(self) -> list[dict[str, Any]]:
        """``/v1/models``' list: the model under each of its names, then each loaded adapter (vLLM's cards)."""
        cards = [self.model_card(name) for name in self.model_names]
        if self.adapters is not None:
            cards.extend(self._adapter_card(info) for info in self.adapters.adapters())
        return cards

    def model_card(self, name: str | None = None) -> dict[str, Any]:
        """The served model as ``/v1/models`` lists it (under ``name``, default its first name), with vLLM's fields:
        ``root`` (the model's path), ``parent`` (None: a base model), ``max_model_len`` and ``permission``; a LoRA
        adapter's name gives the adapter's card."""
        if name is not None and name not in self.model_names and self.adapters is not None:
            for info in self.adapters.adapters():
                if info.name == name:
                    return self._adapter_card(info)
        card: dict[str, Any] = {
            "id": name or self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "pagedcore",
            "root": self.settings.model_root or self.model_name,
            "parent": None,
        }
        if self.context_length is not None:
            card["max_model_len"] = self.context_length
        card["permission"] = [_permission(self.created)]
        return card

    def _adapter_card(self, info: Any) -> dict[str, Any]:
        """vLLM's card of a LoRA adapter: its folder as ``root``, the base model's name as ``parent``."""
        return {
            "id": info.name,
            "object": "model",
            "created": self.created,
            "owned_by": "pagedcore",
            "root": info.path,
            "parent": self.lora_parents.get(info.name, self.model_name),
            "max_model_len": None,
            "permission": [_permission(self.created)],
        }

    def logprob_format(self, as_ids: bool = False, *, server_default: bool = True) -> LogprobFormat:
        """How answers show tokens in log-probabilities: decoded by the tokenizer (special tokens kept), or as
        ``token_id:ID`` (``as_ids``, the server's ``--return-tokens-as-token-ids`` unless not ``server_default``,
        or without a tokenizer)."""
        tokenizer = self.encoder.tokenizer
        if tokenizer is None:
            return LogprobFormat(None, True)
        as_ids = as_ids or (server_default and self.settings.return_tokens_as_token_ids)
        return LogprobFormat(lambda token_id: str(tokenizer.decode([token_id])), as_ids)

    def max_new_tokens(self, prompt_tokens: int) -> int | None:
        """The most new tokens a request with this prompt can be given: what the context leaves, and what the loop
        says its engine can hold for one sequence; None when neither is known."""
        rooms = [self.context.room(prompt_tokens), self.loop.max_new_tokens(prompt_tokens)]
        bounded = [room for room in rooms if room is not None]
        return max(0, min(bounded)) if bounded else None


def _permission(created: int) -> dict[str, Any]:
    """vLLM's ``permission`` entry of a model card (what any client may do with the model)."""
    return {
        "id": f"modelperm-{created}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def serve_context(request: Request) -> ServeContext:
    """The app's :class:`ServeContext` (the FastAPI dependency behind :data:`Context`).

    Example:
        >>> from fastapi import FastAPI
        >>> app = FastAPI()
        >>> app.state.serve = "the context"
        >>> serve_context(Request({"type": "http", "app": app, "headers": []}))
        'the context'
    """
    context: ServeContext = request.app.state.serve
    return context


Context = Annotated[ServeContext, Depends(serve_context)]
"""A handler's parameter ``ctx: Context`` receives the app's :class:`ServeContext`."""
