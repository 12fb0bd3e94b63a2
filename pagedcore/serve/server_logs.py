"""What ``pagedcore serve`` writes to its log besides errors, as vLLM does: one line per request
(``--enable-log-requests``) and, every ``VLLM_LOG_STATS_INTERVAL`` seconds (10 by default), a stats line while the
server is busy (unless ``--disable-log-stats``). Both are INFO lines of the ``pagedcore.serve`` logger, which
:func:`configure_logging` sends to stderr at ``--log-level``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RequestLog", "StatsLogger", "configure_logging", "stats_interval"]

logger = logging.getLogger("pagedcore.serve")

_DEFAULT_INTERVAL = 10.0


def configure_logging(level: str) -> None:
    """Send the ``pagedcore`` loggers' records at ``level`` (``--log-level``) and above to stderr, once.

    Example:
        >>> configure_logging("warning")
        >>> logging.getLogger("pagedcore").getEffectiveLevel() <= logging.WARNING
        True
    """
    root = logging.getLogger("pagedcore")
    numeric = logging.getLevelName("DEBUG" if level.lower() == "trace" else level.upper())
    numeric = numeric if isinstance(numeric, int) else logging.WARNING
    if numeric < root.getEffectiveLevel():  # only ever lowered: a caller (a test's caplog) may want more
        root.setLevel(numeric)
    handler = next((h for h in root.handlers if getattr(h, "pagedcore_serve", False)), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handler.pagedcore_serve = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    handler.setLevel(numeric)


@dataclass(frozen=True)
class RequestLog:
    """``--enable-log-requests``: one INFO line per request as it is submitted (its id, the client's address, its
    prompts' lengths and start, its sampling parameters).

    Attributes:
        max_len: the most characters or token ids of a prompt shown (``--max-log-len``; None: all of it).

    Example:
        >>> RequestLog(max_len=3).prompt([1, 2, 3, 4, 5])
        '[1, 2, 3] (5 token ids)'
    """

    max_len: int | None = None

    def prompt(self, prompt: str | Sequence[int]) -> str:
        """How a prompt appears in the log line."""
        if isinstance(prompt, str):
            shown = prompt if self.max_len is None else prompt[: self.max_len]
            return f"{shown!r} ({len(prompt)} characters)"
        ids = list(prompt) if self.max_len is None else list(prompt[: self.max_len])
        return f"{ids} ({len(prompt)} token ids)"

    def log(self, request_id: str, client: str | None, prompts: Sequence[str | Sequence[int]], params: Any) -> None:
        """Write the line of one request."""
        shown = "; ".join(self.prompt(p) for p in prompts)
        logger.info("request %s from %s: prompt %s, params %s", request_id, client or "?", shown, params)


def stats_interval() -> float:
    """The seconds between stats lines: ``VLLM_LOG_STATS_INTERVAL`` (vLLM's variable), else 10.

    Example:
        >>> stats_interval() > 0
        True
    """
    text = os.environ.get("VLLM_LOG_STATS_INTERVAL")
    try:
        value = float(text) if text else _DEFAULT_INTERVAL
    except ValueError:
        value = _DEFAULT_INTERVAL
    return value if value > 0 else _DEFAULT_INTERVAL


class StatsLogger:
    """A thread that logs the loop's throughput and load every ``interval`` seconds while something happened
    (tokens computed, requests running or waiting), as vLLM's ``LoggingStatLogger`` does.

    Args:
        loop: the request loop (its ``stats``: :class:`~pagedcore.serve.loop.LoopStats`).
        interval: seconds between lines.

    Example:
        >>> StatsLogger(loop=None, interval=5.0).interval
        5.0
    """

    def __init__(self, loop: Any, interval: float) -> None:
        self.loop = loop
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: tuple[int, int] | None = None

    def start(self) -> None:
        """Start logging (a daemon thread)."""
        self._thread = threading.Thread(target=self._run, name="pagedcore-stats-log", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop logging and wait for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval + 5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                line = self.line()
            except Exception:  # a stats snapshot must never take the server down
                logger.debug("pagedcore: the stats line failed", exc_info=True)
                continue
            if line is not None:
                logger.info("%s", line)

    def line(self) -> str | None:
        """The stats line for the last interval (None when nothing happened)."""
        stats = self.loop.stats
        engine = stats.engine
        now = (engine.prompt_tokens_computed, engine.generated_tokens)
        last = self._last or (0, 0)
        self._last = now
        prompt, generated = now[0] - last[0], now[1] - last[1]
        if not (prompt or generated or stats.num_running or stats.num_waiting):
            return None
        hits = engine.prefix_hit_tokens / engine.prefix_query_tokens if engine.prefix_query_tokens else 0.0
        return (
            f"Avg prompt throughput: {prompt / self.interval:.1f} tokens/s, "
            f"Avg generation throughput: {generated / self.interval:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {100 * engine.kv_usage:.1f}%, Prefix cache hit rate: {100 * hits:.1f}%"
        )
