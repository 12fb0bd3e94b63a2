"""Rows of one ``generate`` call that compute their prompt once: identical rows (GRPO's group of ``G`` samples of a
prompt) and ``num_return_sequences`` / beam copies.

RL trainers repeat each prompt ``G`` times in one batch (TRL's ``num_generations``, its ``RepeatSampler``), and
``generate`` would compute every copy's prompt: ``G`` times the same keys and values. :func:`shared_rows` finds
the rows whose input (ids and mask) is the same; ``enable()`` then computes the prompt of each distinct row once,
for the distinct rows only, and forks the rows from it (:meth:`PagedCache.select
<pagedcore.adapters.transformers.PagedCache.batch_select_indices>`: the copies share the prompt's blocks,
copy-on-write), exactly as it does for ``num_return_sequences``. Each row then computes its own last prompt token
(its logits start the sampling, as in stock ``generate``) and its own completion.

Distinct rows that share a prefix (a system prompt, a few-shot preamble) are computed once up to its end in whole
blocks: :func:`shared_prefixes` finds, per row, the longest such prefix another row has too; ``enable()`` computes
each one once and registers it in the prefix cache before the call looks its rows up, so they all hit it (SGLang
holds back requests that share a prefix not cached yet for the same reason).

Rows are merged only when nothing else the model is given per row could tell them apart: a call with other model
inputs (``token_type_ids``, images, ...) merges none. The logits of a merged row are those of its first copy's
computation, which is the same computation (the same tokens at the same positions under the same mask).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from pagedcore.errors import OutOfBlocksError

from .cache import PagedCache
from .pool import PagedKVPool

__all__ = ["SharedRows", "shared_prefixes", "shared_rows", "warm_shared_prefixes"]

Prefill = Callable[[Any, PagedCache, torch.Tensor, torch.Tensor, int, dict[str, Any]], None]
"""``prefill(model, cache, input_ids, mask, start, kwargs)``: computes positions ``start .. width - 2`` of a
left-padded batch into the cache (``enable()``'s shared prefill)."""


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


def shared_prefixes(rows: list[list[int]], block_size: int) -> list[int]:
    """Per row, the length of the longest prefix in whole blocks that it shares with another row (0: none), never
    its last token (which a row always computes itself).

    Example:
        >>> system = [9, 9, 9, 9, 8, 8]
        >>> shared_prefixes([system + [1, 2], system + [3], [5, 5, 5, 5, 5]], block_size=2)
        [6, 6, 0]
    """
    shared = [0] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: rows[i])  # a row's longest common prefix is with a neighbour
    for a, b in itertools.pairwise(order):
        n = _common(rows[a], rows[b])
        shared[a], shared[b] = max(shared[a], n), max(shared[b], n)
    return [min(n, len(row) - 1) // block_size * block_size for n, row in zip(shared, rows)]


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def warm_shared_prefixes(
    model: Any,
    pool: PagedKVPool,
    rows: list[list[int]],
    namespace: Hashable,
    prefill: Prefill,
    kwargs: dict[str, Any],
    *,
    device: torch.device,
    attention_backend: str | None = None,
) -> int:
    """Compute once each prefix (whole blocks) that several of ``rows`` (real tokens, distinct rows) share and the
    prefix cache lacks, and register it, so that the rows' lookup then hits it. Returns the prefixes computed. A
    pool that cannot spare the blocks now warms nothing (the rows compute their prefixes themselves). ``prefill``
    computes a left-padded batch into a cache (``enable()`` passes its shared prefill).

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> model = tiny_llama()
        >>> pool = PagedKVPool(model, num_blocks=16, block_size=4)
        >>> def prefill(model, cache, ids, mask, start, kwargs):   # every position but the last, as enable()'s
        ...     _ = model(ids[:, :-1], attention_mask=mask[:, :-1], cache=cache)
        >>> system = [5, 6, 7, 8, 9, 10, 11, 12]                   # two blocks every row starts with
        >>> rows = [system + [20, 21], system + [30], system + [40, 41, 42]]
        >>> warm_shared_prefixes(model, pool, rows, None, prefill, {}, device=torch.device("cpu"))
        1
        >>> pool.kv.match(system + [99]).num_tokens                # the rows' lookups now hit it
        8
    """
    targets: dict[tuple[int, ...], list[int]] = {}
    with pool.lock:
        for row, n in zip(rows, shared_prefixes(rows, pool.block_size)):
            key = tuple(row[:n])
            if n and key not in targets:
                pool.kv.load_prefix(row, namespace)  # the tiers below the pool may hold it: loaded, not computed
            if n and key not in targets and pool.kv.match(row[:n], namespace).num_tokens < n:
                targets[key] = row[: n + 1]  # one token more: the prefill computes every position but the last
    if not targets:
        return 0
    inputs = list(targets.values())
    width = max(len(tokens) for tokens in inputs)
    pads = [width - len(tokens) for tokens in inputs]
    ids = torch.zeros(len(inputs), width, dtype=torch.long)
    mask = torch.zeros(len(inputs), width, dtype=torch.long)
    for r, (tokens, pad) in enumerate(zip(inputs, pads)):
        ids[r, pad:] = torch.tensor(tokens)
        mask[r, pad:] = 1
    cache = PagedCache(model, pool=pool, namespace=namespace, attention_backend=attention_backend)
    try:
        cache.attach_prefix([None] * len(inputs), pads, 0, inputs)
        prefill(model, cache, ids.to(device), mask.to(device), 0, kwargs)
        cache.cache_prefixes(inputs)
    except OutOfBlocksError:
        return 0
    finally:
        cache.release()
    return len(inputs)
