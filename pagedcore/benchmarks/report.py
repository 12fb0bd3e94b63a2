"""The markdown of the reports: section headers, tables, number formats, and the machine a figure was measured on.

Plain Python: torch's version and thread count are read from torch when a model benchmark has imported it, else
from the installed package's metadata, so the core benchmark's report imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["machine_info", "section_header", "table"]

QUICK_NOTE = "a smaller model and fewer tokens; a smoke run, not the reference figures."


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table.

    Example:
        >>> print(table(["cache", "bytes"], [["paged", 10], ["dynamic", 17]]))
        | cache | bytes |
        | --- | --- |
        | paged | 10 |
        | dynamic | 17 |
    """
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def section_header(
    title: str, quick: bool, workload: str, model: str, machine: str, measured: str, quick_note: str = QUICK_NOTE
) -> str:
    """The head of a benchmark's section: its title, then what ran, on which model and machine, and how it was
    measured (with a warning first for quick workloads).

    Example:
        >>> print(section_header("9. Demo", True, "two calls", "Llama", "laptop", "wall time"))
        ### 9. Demo (quick workload)
        <BLANKLINE>
        **Quick workload**: a smaller model and fewer tokens; a smoke run, not the reference figures.
        <BLANKLINE>
        - Workload: two calls
        - Model: Llama
        - Machine: laptop
        - Measured: wall time
        <BLANKLINE>
        <BLANKLINE>
    """
    suffix = " (quick workload)" if quick else ""
    lines = [f"### {title}{suffix}", ""]
    if quick:
        lines += [f"**Quick workload**: {quick_note}", ""]
    lines += [f"- Workload: {workload}", f"- Model: {model}", f"- Machine: {machine}", f"- Measured: {measured}", ""]
    return "\n".join(lines) + "\n"


def ratio(value: float | None) -> str:
    """``1.23x``, or ``n/a`` for a missing ratio."""
    return "n/a" if value is None or math.isnan(value) else f"{value:.2f}x"


def aim_status(ok: bool) -> str:
    """``met``, or a bold ``missed``."""
    return "met" if ok else "**missed**"


def mib(num_bytes: float) -> str:
    """Bytes as ``1.23 MiB``."""
    return f"{num_bytes / 2**20:.2f} MiB"


def cpu_name() -> str:
    """The CPU model (from /proc/cpuinfo where there is one)."""
    cpu = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return cpu


def num_cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    with contextlib.suppress(OSError, AttributeError):
        return os.getloadavg()[0]
    return None


def package_version(name: str) -> str:
    """A package's version: the imported module's when loaded, else the installed distribution's."""
    module = sys.modules.get(name)
    version = getattr(module, "__version__", None)
    if version is not None:
        return str(version)
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> str:
    """CPU model, cores, torch and transformers versions, torch threads, Python and the load average now.

    Every report section quotes it, so that figures are read next to the machine that measured them.

    Example:
        >>> machine_info()  # doctest: +ELLIPSIS
        '... cores; torch ..., transformers ...; Python ...'
    """
    torch = sys.modules.get("torch")
    threads = f" ({torch.get_num_threads()} threads)" if torch is not None else ""
    load = load_average()
    at_start = "" if load is None else f"; load average {load:.2f} at start"
    return (
        f"{cpu_name()}, {num_cores()} cores; torch {package_version('torch')}{threads}, "
        f"transformers {package_version('transformers')}; Python {platform.python_version()}{at_start}"
    )
