"""Counting the Python lines a call runs: how tests bound per-step work without timing it (a timed assertion would
fail on a loaded machine, and pass on a fast one whatever the code does)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def lines_run(call: Callable[[], T]) -> tuple[int, T]:
    """``call()``'s result and the Python lines it ran (every frame's, counted by ``sys.settrace``)."""
    lines = 0

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal lines
        lines += event == "line"
        return trace

    sys.settrace(trace)
    try:
        result = call()
    finally:
        sys.settrace(None)
    return lines, result
