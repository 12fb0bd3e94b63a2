"""The report shape every benchmark returns (:class:`Section`) and its markdown: the section's head (workload,
model, machine, how it was measured), its figures (:class:`Table` and paragraphs), notes, and the charts it offers;
aims (:class:`Aim`), number formats, and the machine a figure was measured on.

A benchmark's result is :class:`Reported`: it describes its figures as a :class:`Section` and writes no markdown of
its own. Plain Python: torch's version and thread count are read from torch when a model benchmark has imported it,
else from the installed package's metadata, so the core benchmark's report imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
import platform
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .chart import Panel
from .plots import LineChart

__all__ = ["Aim", "Header", "Reported", "Section", "Table", "machine_info", "table"]

QUICK_NOTE = "a smaller model and fewer tokens; a smoke run, not the reference figures."
RATIO_HEADERS = ("ratio", "value", "aim", "status")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: Sequence[str] | None = None) -> str:
    """A markdown table; ``align``: one separator cell per column (e.g. ``"---:"``), else ``" --- "`` each.

    Example:
        >>> print(table(["cache", "bytes"], [["paged", 10], ["dynamic", 17]]))
        | cache | bytes |
        | --- | --- |
        | paged | 10 |
        | dynamic | 17 |
        >>> print(table(["op", "us"], [[1, 2]], align=["---", "---:"]))
        | op | us |
        |---|---:|
        | 1 | 2 |
    """
    separator = "|" + "|".join(align or [" --- " for _ in headers]) + "|"
    lines = ["| " + " | ".join(headers) + " |", separator]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class Table:
    """A table of a section, with an optional caption line above it.

    Example:
        >>> print(Table(["cache", "bytes"], [["paged", 10]], caption="**KV**: bytes").markdown())
        **KV**: bytes
        <BLANKLINE>
        | cache | bytes |
        | --- | --- |
        | paged | 10 |
    """

    headers: Sequence[str]
    rows: Sequence[Sequence[Any]]
    caption: str = ""
    align: Sequence[str] | None = None

    def markdown(self) -> str:
        """The caption (if any), a blank line, the table."""
        body = table(self.headers, self.rows, self.align)
        return f"{self.caption}\n\n{body}" if self.caption else body


@dataclass(frozen=True)
class Aim:
    """A figure's target: at most (``≤``) or at least (``≥``) ``bound``, written with ``fmt``.

    Example:
        >>> speedup = Aim(3.0, at_most=False, fmt="{:g}x")
        >>> speedup.text, speedup.status(3.2), speedup.status(2.0), speedup.status(None)
        ('≥ 3x', 'met', '**missed**', 'n/a')
        >>> Aim(1.05).row("reserved / real", "1.027", 1.027)
        ['reserved / real', '1.027', '≤ 1.05', 'met']
    """

    bound: float
    at_most: bool = True
    fmt: str = "{:g}"

    @property
    def text(self) -> str:
        """``≤ 1.05`` or ``≥ 3x``."""
        return ("≤ " if self.at_most else "≥ ") + self.fmt.format(self.bound)

    def met(self, value: float) -> bool:
        """Whether ``value`` meets the aim."""
        return value <= self.bound if self.at_most else value >= self.bound

    def status(self, value: float | None) -> str:
        """``met``, a bold ``missed``, or ``n/a`` for no value."""
        return "n/a" if value is None else aim_status(self.met(value))

    def row(self, label: str, shown: str, value: float | None) -> list[str]:
        """A row of a ratio table (:data:`RATIO_HEADERS`): what, the value as shown, the aim, its status."""
        return [label, shown, self.text, self.status(value)]


@dataclass(frozen=True)
class Header:
    """What a section's figures were measured on: the quick workload or not, the model, the machine.

    Example:
        >>> Header(quick=True, model="Llama", machine="laptop").quick
        True
    """

    quick: bool
    model: str
    machine: str


@dataclass
class Section:
    """What a benchmark reports: its head (what ran, on which model and machine, how it was measured), then its
    figures (tables and paragraphs, in order), bulleted notes, and links to its line charts; ``panels`` (and
    ``chart_title``) are what it draws in the run's bar chart.

    Example:
        >>> section = Section("9. Demo", Header(True, "Llama", "laptop"), "two calls", "wall time",
        ...     body=[Table(["peer", "wall"], [["Engine", "1.0 s"]]), "Outputs identical."], notes=["one round"])
        >>> print(section.markdown())
        ### 9. Demo (quick workload)
        <BLANKLINE>
        **Quick workload**: a smaller model and fewer tokens; a smoke run, not the reference figures.
        <BLANKLINE>
        - Workload: two calls
        - Model: Llama
        - Machine: laptop
        - Measured: wall time
        <BLANKLINE>
        | peer | wall |
        | --- | --- |
        | Engine | 1.0 s |
        <BLANKLINE>
        Outputs identical.
        <BLANKLINE>
        - one round
        <BLANKLINE>
    """

    title: str
    header: Header
    workload: str
    measured: str
    body: list[Table | str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    panels: list[Panel] = field(default_factory=list)
    chart_title: str = ""
    line_charts: list[LineChart] = field(default_factory=list)
    quick_note: str = QUICK_NOTE

    @property
    def suffix(self) -> str:
        """`` (quick workload)`` for a quick run, else nothing: what titles of its charts end with too."""
        return " (quick workload)" if self.header.quick else ""

    def preamble(self) -> str:
        """The title, then what ran, on which model and machine, and how (a warning first for quick workloads)."""
        lines = [f"### {self.title}{self.suffix}", ""]
        if self.header.quick:
            lines += [f"**Quick workload**: {self.quick_note}", ""]
        lines += [f"- Workload: {self.workload}", f"- Model: {self.header.model}", f"- Machine: {self.header.machine}",
                  f"- Measured: {self.measured}", ""]  # fmt: skip
        return "\n".join(lines) + "\n"

    def markdown(self) -> str:
        """The section: head, figures, notes, chart links, each part after a blank line."""
        parts = [part.markdown() if isinstance(part, Table) else part for part in self.body]
        if self.notes:
            parts.append("\n".join(f"- {note}" for note in self.notes))
        parts += [f"![{chart.alt}]({chart.file})" for chart in self.line_charts]
        return self.preamble() + "\n\n".join(parts) + "\n"


class Reported(ABC):
    """A benchmark's result: its measurements, which it describes as a :class:`Section`.

    Example:
        >>> class Tally(Reported):
        ...     def section(self) -> Section:
        ...         return Section("9. Tally", Header(False, "none", "laptop"), "counting", "by hand", ["3 calls"])
        >>> Tally().markdown().splitlines()[0]
        '### 9. Tally'
    """

    @abstractmethod
    def section(self) -> Section:
        """The report section of this result."""

    def markdown(self) -> str:
        """The section's markdown."""
        return self.section().markdown()


def sentence(text: str) -> str:
    """``text`` ending with a full stop.

    Example:
        >>> sentence("18 steps"), sentence("done.")
        ('18 steps.', 'done.')
    """
    return text if text.endswith(".") else f"{text}."


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
