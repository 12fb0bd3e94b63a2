"""What every endpoint of one app shares: the loop, the metrics, the served model's name, the API keys, the prompt
encoder and the body limits. The app keeps one :class:`ServeContext` in ``app.state.serve``; routers reach it with
the :func:`serve_context` dependency, so a new endpoint (or a new flag) needs no closure over ``create_app``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends
from starlette.requests import Request

from .auth import ApiKeys
from .body import BodyLimits
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
        model_name: the name clients give as ``model``.
        encoder: turns prompts into token ids (its ``context`` is the model's context in tokens, or None).
        api_keys: the known keys (None: no authentication).
        limits: bounds on request bodies.
        loop_errors_are_public: whether the loop's error messages are fit for clients already (a loop that says
            so with a ``public_errors = True`` attribute, as Ray's ``ReplicaLoop`` does); else a server error's
            message is replaced by a generic one naming the request id (:func:`~pagedcore.serve.errors.public_error`).
        tool_call_parser: the tool-call format ``tool_choice="auto"`` reads (:mod:`pagedcore.serve.tool_calls`).

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
    tool_call_parser: str = "hermes"
    created: int = field(default_factory=lambda: int(time.time()))

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

    def check_model(self, name: str) -> None:
        """Raise :class:`ApiError` 404 unless ``name`` is the served model."""
        if name != self.model_name:
            raise ApiError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def model_card(self) -> dict[str, Any]:
        """The served model as ``/v1/models`` lists it."""
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pagedcore"}


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
