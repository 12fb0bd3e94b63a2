"""The progress bar of :meth:`Engine.generate <pagedcore.engine.engine.Engine.generate>` (``use_tqdm``): finished
requests out of those asked for."""

from __future__ import annotations

from typing import Any

__all__ = ["progress_bar"]


class _NoProgress:
    def update(self, n: int = 1) -> None:
        """Nothing to show."""

    def close(self) -> None:
        """Nothing to close."""


def progress_bar(total: int, enabled: bool) -> Any:
    """A tqdm bar over ``total`` requests, or (``enabled=False``) one that shows nothing.

    Example:
        >>> bar = progress_bar(3, enabled=False)
        >>> bar.update(2); bar.close()
    """
    if not enabled:
        return _NoProgress()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="pagedcore", unit="req", dynamic_ncols=True)
