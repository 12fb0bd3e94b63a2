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

from .admission import Admission
from .auth import ApiKeys
from .body import BodyLimits
from .logprob_shapes import LogprobFormat
from .loop import RequestLoop
from .metrics import ServeMetrics
from .prompts import PromptEncoder
from .protocol import ApiError

__all__ = ["Context", "ServeContext", "serve_context"]


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
        eos_token_ids: the model's stop tokens, which a request's ``stop_token_ids`` add to (vLLM's rule).

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
    eos_token_ids: tuple[int, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the model is served under (the first is the one answers carry)."""
        return (self.model_name, *(name for name in self.aliases if name != self.model_name))

    @property
    def context_length(self) -> int | None:
        """The model's context in tokens (None: unknown)."""
        return self.encoder.context

    def authorize(self, request: Request) -> str | None:
        """The tenant of the request's API key (None without keys); raises :class:`ApiError` 401."""
        if self.api_keys is None:
            return None
        tenant = self.api_keys.tenant(request.headers.get("authorization"))
        if tenant is None:
            raise ApiError(401, "a valid API key is required: Authorization: Bearer KEY", code="invalid_api_key")
        return tenant

    def check_model(self, name: str | None) -> None:
        """Raise :class:`ApiError` 404 unless ``name`` is one of the served model's names."""
        if name not in self.model_names:
            served = " or ".join(repr(n) for n in self.model_names)
            raise ApiError(
                404,
                f"the model {name!r} does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )

    def model_card(self, name: str | None = None) -> dict[str, Any]:
        """The served model as ``/v1/models`` lists it (under ``name``, default its first name)."""
        card = {"id": name or self.model_name, "object": "model", "created": self.created, "owned_by": "pagedcore"}
        if self.context_length is not None:
            card["max_model_len"] = self.context_length  # vLLM's field
        return card

    def logprob_format(self, as_ids: bool = False) -> LogprobFormat:
        """How answers show tokens in log-probabilities: decoded by the tokenizer (special tokens kept), or as
        ``token_id:ID`` (``as_ids``, or without a tokenizer)."""
        tokenizer = self.encoder.tokenizer
        if tokenizer is None:
            return LogprobFormat(None, True)
        return LogprobFormat(lambda token_id: str(tokenizer.decode([token_id])), as_ids)

    def max_new_tokens(self, prompt_tokens: int) -> int | None:
        """The most new tokens a request with this prompt can be given: what the context leaves, and what the KV
        pool can hold for one sequence (when the loop can say); None when neither is known."""
        rooms = []
        if self.context_length is not None:
            rooms.append(self.context_length - prompt_tokens)
        pool_room = getattr(self.loop, "max_new_tokens", None)
        if callable(pool_room):
            room = pool_room(prompt_tokens)
            if room is not None:
                rooms.append(room)
        return max(0, min(rooms)) if rooms else None


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
