"""The run's PNG chart (matplotlib, Agg): one bar panel per :class:`Panel` the results offer, side by side.

A report section offers panels (``Section.panels``, with a ``chart_title``); the registry's ``chart_rank`` orders
them. matplotlib is imported only when a chart is drawn.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Panel", "write_chart"]


@dataclass(frozen=True)
class Panel:
    """One bar chart: a bar per label; a None value is drawn empty and labelled ``n/a``.

    Example:
        >>> panel = Panel("wall time (lower is better)", "s", ["generate", "Engine"], [6.0, 1.5], "{:.2f}")
        >>> panel.bar_texts()
        ['6.00', '1.50']
    """

    title: str
    unit: str
    labels: Sequence[str]
    values: Sequence[float | None]
    fmt: str = "{:.2f}"
    colors: Sequence[str] = ("#999999", "#bbbbbb", "#7a9cc6", "#d9822b")

    def bar_texts(self) -> list[str]:
        """The figure written over each bar."""
        return ["n/a" if v is None else self.fmt.format(v) for v in self.values]


def write_chart(path: str | os.PathLike[str], panels: Sequence[Panel], title: str = "") -> None:
    """Draw ``panels`` side by side under ``title`` into the PNG at ``path``.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> path = Path(tempfile.mkdtemp()) / "chart.png"
        >>> write_chart(path, [Panel("tokens/s", "tok/s", ["generate", "Engine"], [16.0, None], "{:.0f}")], "demo")
        >>> path.stat().st_size > 0
        True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        values = [v or 0.0 for v in panel.values]
        bars = ax.bar(range(len(values)), values, color=list(panel.colors[: len(values)]))
        ax.set_xticks(range(len(values)), list(panel.labels), fontsize=8)
        ax.set_title(panel.title, fontsize=10)
        ax.set_ylabel(panel.unit)
        for rect, text in zip(bars, panel.bar_texts()):
            ax.annotate(text, (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center", va="bottom",
                        fontsize=8)  # fmt: skip
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
