"""The app's endpoints, one router per group; :data:`ROUTERS` is what :func:`~pagedcore.serve.app.create_app`
includes. A new group (e.g. tokenization) is a module here with a ``router`` and one line in :data:`ROUTERS`.

Example:
    >>> sorted({route.path for router in ROUTERS for route in router.routes})[:3]
    ['/detokenize', '/health', '/metrics']
"""

from __future__ import annotations

from fastapi import APIRouter

from . import cache, chat, completions, health, models, responses, tokenize

__all__ = ["ROUTERS"]

ROUTERS: tuple[APIRouter, ...] = (
    health.router,
    models.router,
    completions.router,
    chat.router,
    responses.router,
    tokenize.router,
    cache.router,
)
