"""Rows of one ``generate`` call that compute their prompt once: identical rows (GRPO's group of ``G`` samples of a
prompt) and ``num_return_sequences`` / beam copies.

RL trainers repeat each prompt ``G`` times in one batch (TRL's ``num_generations``, its ``RepeatSampler``), and
``generate`` would compute every copy's prompt: ``G`` times the same keys and values. :func:`shared_rows` finds
the rows whose input (ids and mask) is the same; ``enable()`` then computes the prompt of each distinct row once,
for the distinct rows only, and forks the rows from it (:meth:`PagedCache.select
<pagedcore.adapters.transformers.PagedCache.batch_select_indices>`: the copies share the prompt's blocks,
copy-on-write), exactly as it does for ``num_return_sequences``. Each row then computes its own last prompt token
(its logits start the sampling, as in stock ``generate``) and its own completion.

Rows are merged only when nothing else the model is given per row could tell them apart: a call with other model
inputs (``token_type_ids``, images, ...) merges none. The logits of a merged row are those of its first copy's
computation, which is the same computation (the same tokens at the same positions under the same mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SharedRows", "shared_rows"]


@dataclass(frozen=True)
class SharedRows:
    """Which rows of a call compute their prompt, and which row each row is a copy of.

    Attributes:
        unique: the rows that compute their prompt (the first of each set of identical rows), in order.
        source: per row of the call, the index into ``unique`` of the row it copies.

    Example:
        >>> share = SharedRows(unique=(0, 2), source=(0, 0, 1, 1))
        >>> share.copies(), share.rows(expand=2)
        ([2, 2], [0, 0, 0, 0, 1, 1, 1, 1])
    """

    unique: tuple[int, ...]
    source: tuple[int, ...]

    @property
    def num_merged(self) -> int:
        """Rows that copy another row's prompt instead of computing it."""
        return len(self.source) - len(self.unique)

    def copies(self) -> list[int]:
        """Per unique row, how many rows of the call copy it (itself included)."""
        counts = [0] * len(self.unique)
        for s in self.source:
            counts[s] += 1
        return counts

    def rows(self, expand: int = 1) -> list[int]:
        """The cache row (an index into ``unique``) of every row ``generate`` runs: each row of the call ``expand``
        times in a row (``num_return_sequences`` / beams, as ``generate`` expands its input)."""
        return [s for s in self.source for _ in range(expand)]


def shared_rows(input_ids: torch.Tensor, mask: torch.Tensor) -> SharedRows:
    """Group the rows of ``input_ids`` (``(batch, width)``) whose ids and mask are both the same.

    Example:
        >>> ids = torch.tensor([[5, 6], [5, 6], [0, 7], [5, 6]])
        >>> mask = torch.tensor([[1, 1], [1, 1], [0, 1], [1, 1]])
        >>> shared_rows(ids, mask)
        SharedRows(unique=(0, 2), source=(0, 0, 1, 0))
    """
    ids = input_ids.detach().cpu()
    ones = mask.detach().cpu().ne(0)
    first: dict[tuple[tuple[int, ...], tuple[bool, ...]], int] = {}
    unique: list[int] = []
    source: list[int] = []
    for r, (row, row_mask) in enumerate(zip(ids.tolist(), ones.tolist())):
        key = (tuple(row), tuple(row_mask))
        index = first.get(key)
        if index is None:
            index = first[key] = len(unique)
            unique.append(r)
        source.append(index)
    return SharedRows(tuple(unique), tuple(source))
