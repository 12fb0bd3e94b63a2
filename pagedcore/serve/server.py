"""Running the app with uvicorn: in the foreground (the command line) or on a background thread (tests, benchmarks).

Shutting down (SIGTERM, Ctrl-C) with a ``shutdown_timeout`` drains first: the app stops admitting (new requests get
503 with ``Retry-After``, ``/health`` says 503) while the listening socket stays open, and the requests being answered
get up to ``shutdown_timeout`` seconds to finish. Then the engine loop is stopped *before* uvicorn waits for open
connections, so requests still running end at once with an error (503 or an error event in the stream) instead of
holding the server up.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import uvicorn

from .admission import Admission
from .connections import ConnectionLimits, guarded_protocol
from .loop import EngineLoop

__all__ = ["BackgroundServer", "bind", "make_server", "start_listening"]


class _Server(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, loop: EngineLoop, admission: Admission | None, shutdown_timeout: float
    ) -> None:
        super().__init__(config)
        self._engine_loop = loop
        self._admission = admission
        self._shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._admission is not None and self._shutdown_timeout > 0:
            await self._drain(self._admission)
        self._engine_loop.stop(wait=False)  # what is still running gets its error now
        await super().shutdown(sockets)

    async def _drain(self, admission: Admission) -> None:
        """Stop admitting; wait for the admitted requests (a second signal, ``force_exit``, stops waiting)."""
        admission.close()
        deadline = time.monotonic() + self._shutdown_timeout
        while admission.active and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)


def bind(host: str, port: int, *, listen: bool = True) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one; ``getsockname()`` says which); ``listen=False``:
    bound only (the port is taken, connections are refused until :func:`listen`: ``serve`` binds before loading
    the model, so a taken port is said at once, and listens once it can answer).

    Example:
        >>> sock = bind("127.0.0.1", 0)
        >>> sock.getsockname()[1] > 0
        True
        >>> sock.close()
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        if listen:
            start_listening(sock)
    except OSError:
        sock.close()
        raise
    return sock


def start_listening(sock: socket.socket) -> None:
    """Listen on ``sock`` before the start-up line names its port, not when uvicorn starts: a client that read the
    line before uvicorn serves waits in the backlog instead of being refused.

    Example:
        >>> sock = bind("127.0.0.1", 0, listen=False)
        >>> start_listening(sock)
        >>> socket.create_connection(sock.getsockname()).close()
        >>> sock.close()
    """
    sock.listen(2048)


def make_server(
    app: Any,
    loop: EngineLoop,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_timeout: float = 0.0,
    limits: ConnectionLimits | None = None,
    **config: Any,
) -> Any:
    """A ``uvicorn.Server`` for ``app`` that stops ``loop`` when it shuts down (``run()`` it in the foreground),
    after draining for up to ``shutdown_timeout`` seconds (0: no drain; needs the app of
    :func:`~pagedcore.serve.app.create_app`, whose admission it closes). Connections are held to ``limits``
    (default :class:`~pagedcore.serve.connections.ConnectionLimits`: a header timeout, a per-client cap).

    ``config`` goes to ``uvicorn.Config`` (default: ``log_level="warning"``, 5 s of graceful shutdown).

    Example:
        >>> from fastapi import FastAPI
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import Engine
        >>> model = tiny_llama(num_hidden_layers=1)
        >>> with Engine(model, num_blocks=16, block_size=8) as engine:
        ...     server = make_server(FastAPI(), EngineLoop(engine), port=8123)
        >>> server.config.port
        8123
    """
    config.setdefault("log_level", "warning")
    config.setdefault("timeout_graceful_shutdown", 5)
    config.setdefault("http", guarded_protocol(limits or ConnectionLimits()))
    serve = getattr(getattr(app, "state", None), "serve", None)
    admission = getattr(serve, "admission", None)
    return _Server(uvicorn.Config(app, host=host, port=port, **config), loop, admission, shutdown_timeout)


class BackgroundServer:
    """Serve an app on a background thread, on a free loopback port; ``stop()`` shuts down cleanly.

    Args:
        app: the ASGI app (see :func:`~pagedcore.serve.app.create_app`).
        loop: its engine loop (started by :meth:`start` if not running, stopped by :meth:`stop`).
        host: interface to bind (default loopback).
        port: 0 picks a free port.
        start_loop: start the loop with the server (False: the caller starts it, e.g. to fill its queue first).

    Example:
        >>> import urllib.request
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import Engine
        >>> from pagedcore.serve.app import create_app
        >>> model = tiny_llama(num_hidden_layers=1)
        >>> with Engine(model, num_blocks=16, block_size=8) as engine:
        ...     loop = EngineLoop(engine)
        ...     with BackgroundServer(create_app(loop, model_name="tiny"), loop) as server:
        ...         status = urllib.request.urlopen(f"{server.url}/health").status
        >>> status
        200
    """

    def __init__(
        self, app: Any, loop: EngineLoop, *, host: str = "127.0.0.1", port: int = 0, start_loop: bool = True
    ) -> None:
        self._loop = loop
        self._start_loop = start_loop
        self._socket = bind(host, port)
        self.host = host
        self.port: int = self._socket.getsockname()[1]
        self._server = make_server(app, loop, host=host, port=self.port)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        """Start the loop (if needed) and the server; returns once it accepts connections."""
        if self._start_loop and not self._loop.is_running:
            self._loop.start()
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="pagedcore-uvicorn", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server and the loop (running requests end with an error); waits for both threads."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._loop.stop(timeout=timeout)
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
