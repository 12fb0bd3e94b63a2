"""``pagedcore serve``: an OpenAI-compatible server over the continuous-batching Engine (needs the ``serve`` extra).

- :class:`EngineLoop` (``loop.py``): the one thread that owns an Engine; requests, aborts and token events cross
  threads through it. It knows nothing of HTTP, so other front ends (e.g. a Ray replica) can wrap it.
- :func:`create_app` (``app.py``): the FastAPI app with ``/v1/models``, ``/v1/completions``,
  ``/v1/chat/completions``, ``/health`` and ``/metrics``.
- :class:`BackgroundServer` / :func:`make_server` (``server.py``): uvicorn, on a thread or in the foreground.
- :class:`ApiKeys` (``auth.py``): API keys and their tenants (prefix-cache namespaces).
- ``cli.py``: ``pagedcore serve``.

Names are imported lazily, so ``import pagedcore.serve`` (as the ``pagedcore`` command does) costs nothing.

Example:
    >>> from pagedcore.serve import EngineLoop, create_app
    >>> EngineLoop.__module__
    'pagedcore.serve.loop'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedcore.lazy_names import lazy_getattr

if TYPE_CHECKING:
    from .app import create_app
    from .auth import ApiKeys
    from .loop import EngineLoop, Request, Submission
    from .server import BackgroundServer, make_server

__all__ = ["ApiKeys", "BackgroundServer", "EngineLoop", "Request", "Submission", "create_app", "make_server"]

_HOMES = {
    "ApiKeys": "auth",
    "BackgroundServer": "server",
    "EngineLoop": "loop",
    "Request": "loop",
    "Submission": "loop",
    "create_app": "app",
    "make_server": "server",
}

__getattr__ = lazy_getattr(__name__, _HOMES)
