"""Running the app with uvicorn: in the foreground (the command line) or on a background thread (tests, benchmarks).

On shutdown the engine loop is stopped *before* uvicorn waits for open connections, so requests still running
end at once with an error (503 or an error event in the stream) instead of holding the server up.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from .loop import EngineLoop

__all__ = ["BackgroundServer", "make_server"]


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, loop: EngineLoop) -> None:
        super().__init__(config)
        self._engine_loop = loop

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._engine_loop.stop(wait=False)  # pending requests get their error now
        await super().shutdown(sockets)


def make_server(app: Any, loop: EngineLoop, *, host: str = "127.0.0.1", port: int = 8000, **config: Any) -> Any:
    """A ``uvicorn.Server`` for ``app`` that stops ``loop`` when it shuts down (``run()`` it in the foreground).

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
    return _Server(uvicorn.Config(app, host=host, port=port, **config), loop)


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
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
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
