"""One forward's plan for a :class:`~pagedcore.adapters.transformers.PagedCache`: which rows grow by how many real
tokens, and which new positions are left padding (never stored).

transformers hands the cache rectangular batches. A row stores only its real tokens when its padding is known to be
left padding, which only the 2-D attention mask can say: ``position_ids`` alone cannot tell ``[pad, pad, tok]`` from
a token followed by masked positions (both read ``[0, 0, 0]``, as transformers' testers' ``torch.tril`` masks make
them). So the padding is decided, in order, from:

1. the forward's attention mask (:class:`MaskRows`), which the cache is told about before layer 0 by the model's
   forward pre-hook: a row whose mask is zeros then ones stores its ones; any other row (right padding, holes, a
   ``[1, 0, 0, ...]`` row) stores every position, and the standard mask hides what it hides (a dense computation, as
   ``DynamicCache`` does it);
2. padding declared up front (``PagedCache.attach_prefix``; ``position_ids``, when the model passes them, must agree:
   :func:`positions_fit`);
3. neither known: every position is stored (:func:`positions_continue` only says whether the positions are the
   rows' next ones, which the prefix cache needs).

:func:`plan_forward` decides it once per forward, before anything is reserved; a pure function of the rows' state,
the mask summary and the positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedcore.errors import InvalidRequestError

__all__ = ["ForwardPlan", "MaskRows", "plan_forward", "positions_continue", "positions_fit", "text_positions"]


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
        from_mask: whether the padding was read from the forward's attention mask (then the mask hides exactly the
            unstored positions, by construction).

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
    from_mask: bool = False

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


@dataclass(frozen=True)
class MaskRows:
    """What a forward's 2-D attention mask ``(batch, start + q_len)`` says about each row's padding.

    Attributes:
        width: the mask's length (rectangular positions up to the end of the forward).
        leading: per row, the zeros before its first one (``width`` for a row of zeros only).
        left_padded: per row, whether it is zeros then ones with at least one one (left padding, or none).

    Example:
        >>> rows = MaskRows.of(torch.tensor([[0, 0, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]), batch=3)
        >>> rows.leading, rows.left_padded
        ((2, 0, 0), (True, False, True))
        >>> MaskRows.of(None, batch=2, width=5).left_padded   # no mask: every position is a token
        (True, True)
    """

    width: int
    leading: tuple[int, ...]
    left_padded: tuple[bool, ...]

    @classmethod
    def of(cls, mask: torch.Tensor | None, *, batch: int, width: int | None = None) -> MaskRows:
        """Summarise ``mask`` (None: no mask, every position a token; then ``width`` is required). Reads the mask
        once (one device synchronisation): two reductions per row."""
        if mask is None:
            if width is None:
                raise ValueError("MaskRows.of(None) needs the width")
            return cls(width, (0,) * batch, (True,) * batch)
        ones = mask.ne(0)
        if ones.shape[0] == 1 and batch > 1:
            ones = ones.expand(batch, -1)
        count = ones.sum(dim=1)
        first = torch.where(count > 0, ones.to(torch.uint8).argmax(dim=1), ones.shape[1])
        counts, firsts = torch.stack([count, first]).tolist()
        width = ones.shape[1]
        return cls(width, tuple(firsts), tuple(c > 0 and c == width - f for c, f in zip(counts, firsts)))


def plan_forward(
    *,
    start: int,
    before: Sequence[int],
    row_pads: Sequence[int],
    declared: Sequence[int | None],
    q_len: int,
    positions: Any,
    mask: MaskRows | None = None,
) -> ForwardPlan:
    """The plan of a forward of ``q_len`` new positions per row.

    Args:
        start: rectangular positions per row before the forward.
        before: per row, real tokens stored before it.
        row_pads: per row, the leading positions it left out so far (unstored padding).
        declared: per row, its whole left padding when declared (``attach_prefix``), else None.
        q_len: new positions per row.
        positions: the ``position_ids`` the model passed to the cache (None when it passes no kwargs).
        mask: the forward's attention mask, summarised (None when the cache was not told about it).

    Raises :class:`~pagedcore.errors.InvalidRequestError`, before anything changes, for a mask that shows as a token
    a position the cache left out as padding (its keys were never stored).

    Example:
        >>> plan_forward(start=0, before=[0, 0], row_pads=[0, 0], declared=[None] * 2, q_len=3, positions=None,
        ...              mask=MaskRows.of(torch.tensor([[0, 1, 1], [1, 0, 0]]), batch=2)).pads
        (1, 0)
        >>> plan_forward(start=0, before=[0, 0], row_pads=[0, 0], declared=[2, 0], q_len=4, positions=None).pads
        (2, 0)
        >>> plan_forward(start=0, before=[0], row_pads=[0], declared=[None], q_len=3,
        ...              positions=torch.tensor([[0, 0, 1]])).exact   # padding or a masked token? Stored densely
        False
    """
    batch = len(before)
    if mask is not None and mask.width == start + q_len and len(mask.leading) == batch:
        pads, fits = _mask_padding(mask, start, q_len, row_pads)
        exact = all(fits) and positions_fit(positions, pads, batch, q_len, before, pads_at_zero=False)
        return ForwardPlan(batch, q_len, start, tuple(before), tuple(pads), exact, from_mask=True)
    whole = [d for d in declared if d is not None]
    if len(whole) != batch:
        return ForwardPlan(
            batch, q_len, start, tuple(before), (0,) * batch, positions_continue(positions, batch, q_len, before)
        )
    # A row's declared padding is taken by its first forward(s), before its first stored token.
    pads = [min(max(d - start, 0), q_len) if n == 0 else 0 for d, n in zip(whole, before)]
    exact = True if positions is None else positions_fit(positions, pads, batch, q_len, before)
    return ForwardPlan(batch, q_len, start, tuple(before), tuple(pads), exact)


def _mask_padding(mask: MaskRows, start: int, q_len: int, row_pads: Sequence[int]) -> tuple[list[int], list[bool]]:
    """Per row, the new positions that are left padding (by the mask), and whether the row stays left-padded."""
    pads: list[int] = []
    fits: list[bool] = []
    for r, (zeros, left, done) in enumerate(zip(mask.leading, mask.left_padded, row_pads)):
        if zeros < done:
            raise InvalidRequestError(
                f"the attention mask of row {r} shows position {zeros} as a token, but this cache left positions "
                f"0-{done - 1} of that row out as padding (their keys were never stored): continue a cache with "
                "the mask it was built with"
            )
        if left and done == min(zeros, start):
            pads.append(min(max(zeros - start, 0), q_len))
            fits.append(True)
        else:  # not left padding (or not the padding the row has): store every position, the mask hides them
            pads.append(0)
            fits.append(False)
    return pads, fits


def positions_continue(positions: Any, batch: int, q_len: int, before: Sequence[int]) -> bool:
    """Whether ``position_ids`` are exactly each row's next ``q_len`` positions (no padding among them).

    Example:
        >>> positions_continue(torch.tensor([[3], [5]]), 2, 1, [3, 5]), positions_continue(None, 1, 2, [0])
        (True, False)
    """
    return positions_fit(positions, [0] * batch, batch, q_len, before)


def positions_fit(
    positions: Any,
    pads: Sequence[int],
    batch: int,
    q_len: int,
    before: Sequence[int],
    *,
    pads_at_zero: bool = True,
) -> bool:
    """Whether ``position_ids`` are exactly those of rows whose first ``pads[r]`` new positions are padding: real
    tokens continue the ``before[r]`` stored ones; padding is at position 0 (as ``generate`` makes it), unless
    ``pads_at_zero`` is False (then padding positions may hold anything: the mask hides them). None (the model passes
    no kwargs) fits only with ``pads_at_zero=False`` (the mask decided).

    Example:
        >>> positions_fit(torch.tensor([[0, 0, 1]]), [1], 1, 3, [0])
        True
        >>> positions_fit(torch.tensor([[0, 1, 2]]), [1], 1, 3, [0])   # position 1 where padding was declared
        False
    """
    if positions is None:
        return not pads_at_zero
    positions = text_positions(positions)
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or q_len == 0:
        return False
    if q_len == 1 and positions.shape[1] == 1 and not any(pads):
        # Decode step: one new position per row, which must be the row's next one (no tensor work beyond .tolist()).
        values = positions[:, 0].tolist()
        if len(values) == 1 and batch > 1:
            values = values * batch
        return len(values) == batch and all(v == n for v, n in zip(values, before))
    pos = positions.detach().to("cpu", torch.long)
    if pos.shape[0] == 1 and batch > 1:
        pos = pos.expand(batch, -1)
    if tuple(pos.shape) != (batch, q_len):
        return False
    pad = torch.tensor(list(pads), dtype=torch.long)
    prior = torch.tensor(list(before), dtype=torch.long)
    t = torch.arange(q_len)
    is_pad = t[None, :] < pad[:, None]
    expected = prior[:, None] + t[None, :] - pad[:, None]
    at_pads = pos == 0 if pads_at_zero else torch.ones_like(is_pad)
    ok = torch.where(is_pad, at_pads, pos == expected).all(dim=1)
    if pads_at_zero:
        ok &= (pad == 0) | (prior == 0)
    return bool(ok.all())


def text_positions(positions: Any) -> Any:
    """The ``(batch, q_len)`` token positions of ``position_ids``: 2-D ones as they are; multimodal RoPE's 3-D
    ones (Qwen2-VL and its kind) by their text row, the first of the four that ``generate`` makes (text, then
    temporal, height, width), or the one row of three that agree (a text-only prompt); anything else None.

    Example:
        >>> t = torch.tensor([[0, 1, 2]])
        >>> text_positions(torch.stack([t, t, t + 5, t])).tolist(), text_positions(torch.stack([t, t, t])).tolist()
        ([[0, 1, 2]], [[0, 1, 2]])
        >>> text_positions(torch.stack([t, t + 1, t])) is None   # three rows that differ: not a token position
        True
    """
    if not isinstance(positions, torch.Tensor) or positions.dim() != 3:
        return positions
    if positions.shape[0] == 4:
        return positions[0]
    if bool((positions == positions[:1]).all()):
        return positions[0]
    return None
