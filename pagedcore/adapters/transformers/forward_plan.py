"""One forward's plan for a :class:`~pagedcore.adapters.transformers.PagedCache`: which rows grow by how many real
tokens, and which new positions are left padding (never stored).

transformers hands the cache rectangular batches. Row ``r`` of a cache stores only its real tokens; its left padding
is read from the ``position_ids`` that reach ``update`` through the model's kwargs (:func:`left_padding`), or was
declared up front (``PagedCache.attach_prefix``; then the positions, when the model passes them, must agree:
:func:`positions_fit`). :func:`plan_forward` decides it once per forward, before anything is reserved; a pure
function of the rows' state and the positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ForwardPlan", "left_padding", "plan_forward", "positions_fit"]


@dataclass(frozen=True)
class ForwardPlan:
    """What one forward stores, decided before anything is reserved.

    Attributes:
        batch: rows in the forward.
        q_len: new rectangular positions per row.
        start: rectangular positions per row before the forward.
        before: per row, real tokens stored before the forward.
        pads: per row, how many of the ``q_len`` new positions are left padding (not stored).
        exact: whether the unstored positions are exactly the rows' left padding, so the rows store their real
            tokens at positions 0, 1, ... (else a row stores what it cannot tell from padding).

    Example:
        >>> plan = ForwardPlan(batch=2, q_len=3, start=0, before=(0, 0), pads=(1, 0), exact=True)
        >>> plan.real_new, plan.real_index.tolist()
        ([2, 3], [1, 2, 3, 4, 5])
    """

    batch: int
    q_len: int
    start: int
    before: tuple[int, ...]
    pads: tuple[int, ...]
    exact: bool

    @property
    def real_new(self) -> list[int]:
        """Per row, the real (stored) tokens among the new positions."""
        return [self.q_len - p for p in self.pads]

    @property
    def real_index(self) -> torch.Tensor | None:
        """Flat ``row * q_len + t`` indices of the stored new tokens; None when every position is stored."""
        if not any(self.pads):
            return None
        q_len = self.q_len
        return torch.tensor(
            [r * q_len + t for r, pad in enumerate(self.pads) for t in range(pad, q_len)], dtype=torch.long
        )


def plan_forward(
    *,
    start: int,
    before: Sequence[int],
    declared: Sequence[int | None],
    q_len: int,
    positions: Any,
) -> ForwardPlan:
    """The plan of a forward of ``q_len`` new positions per row.

    Args:
        start: rectangular positions per row before the forward.
        before: per row, real tokens stored before it.
        declared: per row, its whole left padding when declared (``attach_prefix``), else None.
        q_len: new positions per row.
        positions: the ``position_ids`` the model passed to the cache (None when it passes no kwargs).

    Declared padding decides; ``position_ids``, when the model passes them, must agree with it. Without a
    declaration the positions decide (:func:`left_padding`).

    Example:
        >>> plan_forward(start=0, before=[0, 0], declared=[2, 0], q_len=4, positions=None).pads
        (2, 0)
        >>> plan_forward(start=0, before=[0], declared=[None], q_len=3, positions=torch.tensor([[0, 0, 1]])).pads
        (1,)
    """
    batch = len(before)
    whole = [d for d in declared if d is not None]
    if len(whole) != batch:
        pads, exact = left_padding(positions, batch, q_len, before)
    else:  # a row's declared padding is taken by its first forward(s), before its first stored token
        pads = [min(max(d - start, 0), q_len) if n == 0 else 0 for d, n in zip(whole, before)]
        if positions is None:
            exact = True
        elif not any(pads):  # the common case (every decode step): no tensor work beyond left_padding's fast path
            derived, fits = left_padding(positions, batch, q_len, before)
            exact = fits and not any(derived)
        else:
            exact = positions_fit(positions, pads, batch, q_len, before)
    return ForwardPlan(batch, q_len, start, tuple(before), tuple(pads), exact)


def left_padding(positions: Any, batch: int, q_len: int, before: Sequence[int]) -> tuple[list[int], bool]:
    """Per row, how many of the new positions are left padding (from ``position_ids``), and whether the
    positions are exactly explained by left padding. Rows that do not fit the pattern store every position.

    Example:
        >>> left_padding(torch.tensor([[0, 0, 1], [0, 1, 2]]), 2, 3, [0, 0])
        ([1, 0], True)
    """
    none = [0] * batch
    if q_len == 1 and isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[1] == 1:
        # Decode step: one new position per row, which must be the row's next one (no tensor work beyond .tolist()).
        values = positions[:, 0].tolist()
        if len(values) == 1 and batch > 1:
            values = values * batch
        if len(values) == batch and all(v == n for v, n in zip(values, before)):
            return none, True
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        return none, False
    pos = positions.detach().to("cpu", torch.long)
    if pos.shape[0] == 1 and batch > 1:
        pos = pos.expand(batch, -1)
    if tuple(pos.shape) != (batch, q_len) or q_len == 0:
        return none, False
    prior = torch.tensor(list(before), dtype=torch.long)
    pads = q_len - (pos[:, -1] + 1 - prior)
    fits = (pads >= 0) & (pads < q_len) & _fits(pos, pads, prior, q_len)
    exact = bool(fits.all())
    return [int(p) if ok else 0 for p, ok in zip(pads.tolist(), fits.tolist())], exact


def positions_fit(positions: Any, pads: Sequence[int], batch: int, q_len: int, before: Sequence[int]) -> bool:
    """Whether ``position_ids`` are exactly those of rows whose first ``pads[r]`` new positions are padding.

    Example:
        >>> positions_fit(torch.tensor([[0, 0, 1]]), [1], 1, 3, [0])
        True
        >>> positions_fit(torch.tensor([[0, 1, 2]]), [1], 1, 3, [0])   # position 1 where padding was declared
        False
    """
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        return False
    pos = positions.detach().to("cpu", torch.long)
    if pos.shape[0] == 1 and batch > 1:
        pos = pos.expand(batch, -1)
    if tuple(pos.shape) != (batch, q_len):
        return False
    pad = torch.tensor(list(pads), dtype=torch.long)
    return bool(_fits(pos, pad, torch.tensor(list(before), dtype=torch.long), q_len).all())


def _fits(pos: torch.Tensor, pads: torch.Tensor, prior: torch.Tensor, q_len: int) -> torch.Tensor:
    """Per row: padding only before a row's first token (position 0 there, as generate makes it), then positions
    that continue the ``prior`` stored ones."""
    t = torch.arange(q_len)
    is_pad = t[None, :] < pads[:, None]
    expected = prior[:, None] + t[None, :] - pads[:, None]
    return ((pads == 0) | (prior == 0)) & torch.where(is_pad, pos == 0, pos == expected).all(dim=1)
