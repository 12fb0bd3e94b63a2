"""Line charts of how a figure grows (time per token against context length, throughput against load): the PNG files
a result writes besides the run's bar chart.

A report section lists its :class:`LineChart` files; the suite draws them into the output folder next to
``results.md``, and the section's markdown links them. matplotlib is imported only when a chart is drawn.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Curve", "LineChart", "LinePanel", "write_lines"]


@dataclass(frozen=True)
class Curve:
    """One line: ``ys[i]`` at ``xs[i]``; a None value is left out (a point that could not be measured).

    Example:
        >>> Curve("DynamicCache", [512, 2048], [21.0, None]).points()
        [(512, 21.0)]
    """

    label: str
    xs: Sequence[float]
    ys: Sequence[float | None]

    def points(self) -> list[tuple[float, float]]:
        """The measured points."""
        return [(x, y) for x, y in zip(self.xs, self.ys) if y is not None]


@dataclass(frozen=True)
class LinePanel:
    """One chart of several curves over the same x axis (logarithmic with ``log_x``).

    Example:
        >>> panel = LinePanel("vocab 32000", "context (tokens)", "ms / token", [Curve("a", [1, 2], [3.0, 4.0])])
        >>> [c.label for c in panel.curves]
        ['a']
    """

    title: str
    x_label: str
    y_label: str
    curves: Sequence[Curve]
    log_x: bool = True


@dataclass(frozen=True)
class LineChart:
    """One PNG file of line panels: its file name, figure title, panels, and the alt text of its markdown link.

    Example:
        >>> chart = LineChart("growth.png", "growth", [LinePanel("t", "x", "y", [Curve("c", [1], [2.0])])], "growth")
        >>> chart.file, len(chart.panels)
        ('growth.png', 1)
    """

    file: str
    title: str
    panels: Sequence[LinePanel]
    alt: str


def write_lines(path: str | os.PathLike[str], panels: Sequence[LinePanel], title: str = "", columns: int = 4) -> None:
    """Draw ``panels`` under ``title`` into the PNG at ``path``, ``columns`` to a row.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> path = Path(tempfile.mkdtemp()) / "lines.png"
        >>> write_lines(path, [LinePanel("demo", "x", "y", [Curve("a", [1, 2, 4], [1.0, None, 3.0])])], "demo")
        >>> path.stat().st_size > 0
        True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(columns, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.4 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        xs: set[float] = set()
        for curve in panel.curves:
            points = curve.points()
            xs.update(x for x, _ in points)
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=curve.label)
        if panel.log_x:
            ax.set_xscale("log", base=2)
        if xs:
            ticks = sorted(xs)
            ax.set_xticks(ticks, [f"{x:g}" for x in ticks], fontsize=8)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(panel.x_label)
        ax.set_ylabel(panel.y_label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
