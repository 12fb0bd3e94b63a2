"""The prefill of an ``enable()``d ``generate`` call on a model with recurrent-state layers: prefix hits that resume
a state, and the snapshots that later prompts resume from.

A recurrent state cannot be cut at an arbitrary token, so a prompt is computed in pieces that end at **snapshot
points** (every ``snapshot_interval`` blocks of the prompt; for a single row that resumes a hit, none: it computes
the rest of its prompt in ``generate``'s own forward) and the state is kept at each of them
(:meth:`~pagedcore.adapters.transformers.PagedCache.snapshot`); when the call registers its blocks, each snapshot is
filed in the block holding its last token (:mod:`pagedcore.state_slots`), as the state where the sequence stops is. A
later prompt then takes the deepest point of its prefix match where every layer kind has what it needs (keys and
values before it, a snapshot at it: :meth:`~pagedcore.kv_pool.KVPool.match`), restores that state and computes from
there.

Each row of a call is computed alone (one row per forward, no padding: a recurrent state sees none, as in transformers,
whose layers zero the padding's inputs), from its hit to its last snapshot point, then the call's cache takes the rows
(:meth:`~pagedcore.adapters.transformers.PagedCache.take_rows`) and ``generate`` computes the rest of every row in its
own forward (a forward costs about the same for a few tokens or a block's: the tail is not a forward of its own). The
rows of a batch must stop at one rectangular position: where their last snapshot points are, when that is one
position (a single row), else at the prompt's last-but-one token (where each row keeps a snapshot too). A batch none
of whose rows hits is computed as stock ``generate`` computes it, in one padded forward (computing each row alone to
its snapshot points would cost a forward per point and row), keeping snapshots only where its rows stop.

Families whose forward of several tokens does not continue a cached state (:attr:`~.state_spec.StateSpec.resumes_chunks`
false: Jamba) resume a hit one token per forward up to the last-but-one token, and only when that is at most
:data:`TOKEN_BY_TOKEN_LIMIT` tokens (else the row is computed from the start, in one forward, as stock does); they keep
a snapshot at that token (a repeated prompt resumes there), not at block boundaries.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedcore.capacity import Reservation
from pagedcore.kv_pool import PoolMatch
from pagedcore.state_slots import TOKEN_BY_TOKEN_LIMIT

from .cache import PagedCache
from .pool import PagedKVPool

__all__ = ["TOKEN_BY_TOKEN_LIMIT", "StatePrefill", "snapshot_points"]


def snapshot_points(start: int, end: int, spacing: int) -> list[int]:
    """The snapshot points of a row that resumes at position ``start`` and whose prompt ends before ``end``: every
    multiple of ``spacing`` after ``start``, up to ``end``.

    Example:
        >>> snapshot_points(0, 10, 4), snapshot_points(4, 9, 4), snapshot_points(6, 7, 4)
        ([4, 8], [8], [])
    """
    return list(range((start // spacing + 1) * spacing, end + 1, spacing))


@dataclass
class _Row:
    tokens: list[int]
    match: PoolMatch
    hit: int
    cache: PagedCache | None = None
    points: list[int] = field(default_factory=list)  # snapshot points up to the last-but-one token

    @property
    def end(self) -> int:
        return len(self.tokens) - 1


class StatePrefill:
    """One call's prefill (see the module docstring): :meth:`plan` and :meth:`attach` under the pool's lock with the
    call's reservation between them, then :meth:`run` (the forwards), :meth:`release` in the end.

    Args:
        model: the enabled model.
        pool: its pool (with state slots).
        namespace: the call's prefix-cache namespace.
        attention_backend: the caches' backend for ``attn_implementation="paged"``.

    Example:
        >>> import torch
        >>> from pagedcore.adapters.transformers import PagedKVPool
        >>> from pagedcore.adapters.transformers.testing import tiny_hybrid
        >>> model = tiny_hybrid()
        >>> pool = PagedKVPool(model, num_blocks=16, block_size=4, state_slots=8)
        >>> prefill = StatePrefill(model, pool, None, None)
        >>> with pool.lock:
        ...     prefill.plan([[5, 6, 7, 8, 9, 10, 11]]), prefill.rows[0].points   # no hit; a snapshot at 4
        ...     prefill.attach(pool.kv.reserve(pool.kv.worst_case()), PagedCache(model, pool=pool), [0])
        ([0], [4])
        >>> cache = PagedCache(model, pool=pool)
        >>> prefill.run(cache, [0], {}), cache.memory_stats().state_slots   # 4 computed: its state and a snapshot
        (4, 2)
        >>> cache.release(); pool.kv.states.num_used
        0
    """

    def __init__(self, model: Any, pool: PagedKVPool, namespace: Hashable, attention_backend: str | None) -> None:
        slots = pool.kv.states
        assert slots is not None
        self.model = model
        self.pool = pool
        self.namespace = namespace
        self.attention_backend = attention_backend
        self.spacing = slots.interval * pool.block_size
        self.resumes_chunks = pool.state_spec.resumes_chunks
        self.snapshot_hits = pool.state_spec.snapshot_hits  # "all", "repeats" or "none" (see StateSpec)
        self.rows: list[_Row] = []

    # ------------------------------------------------------------------ under the pool's lock
    def plan(self, prompts: Sequence[Sequence[int]]) -> list[int]:
        """Each row's hit (tokens resumed from a snapshot; loaded from the tiers below the pool first). Returns them."""
        kv = self.pool.kv
        alone = len(prompts) == 1
        for tokens in prompts:
            kv.load_prefix(tokens, self.namespace)
            match = kv.match(tokens, self.namespace, max_tokens=len(tokens) - 1)
            repeat = match.num_tokens >= len(tokens) - 1  # nothing to resume: the state is where the prompt stops
            hit = match.num_tokens if self.snapshot_hits == "all" or (self.snapshot_hits == "repeats" and repeat) else 0
            if not self.resumes_chunks and len(tokens) - 1 - hit > TOKEN_BY_TOKEN_LIMIT:
                hit = 0  # resuming one token at a time would cost more than computing the row in one forward
            row = _Row(list(tokens), match, hit)
            # A single row that resumes a snapshot computes the rest in generate's own forward: one forward, as a
            # plain prefill (a snapshot point on the way would cost a forward of its own).
            if self.resumes_chunks and not (alone and hit):
                row.points = snapshot_points(hit, row.end, self.spacing)
            self.rows.append(row)
        return [row.hit for row in self.rows]

    @property
    def active(self) -> bool:
        """Whether the rows are computed alone: one row, or a batch with a hit. A batch without any is computed as
        stock ``generate`` computes it, in one padded forward (computing each row to its snapshot points alone would
        cost a forward per point and row); its rows keep a snapshot where they stop."""
        return len(self.rows) == 1 or any(row.hit for row in self.rows)

    def attach(self, reservation: Reservation, cache: PagedCache, pads: Sequence[int]) -> None:
        """Give each row a one-row cache drawing from ``reservation``, its hit attached; when not :attr:`active`,
        declare the rows' padding and prompts to the call's ``cache`` instead."""
        if not self.active:
            cache.attach_prefix([None] * len(self.rows), pads, 0, [row.tokens for row in self.rows])
            return
        for row in self.rows:
            row.cache = PagedCache(
                self.model,
                pool=self.pool,
                namespace=self.namespace,
                attention_backend=self.attention_backend,
                reservation=reservation,
            )
            row.cache.attach_prefix([row.match if row.hit else None], [0], row.hit, [row.tokens])

    # ------------------------------------------------------------------ the forwards
    def stops(self, pads: Sequence[int], width: int) -> tuple[int, list[int]]:
        """The rectangular position every row's prefill stops at, and each row's tokens there (see the module
        docstring); ``width`` is the input's."""
        rows = self.rows
        if not self.resumes_chunks:  # to the last-but-one token, where the state is kept for a repeated prompt
            return width - 1, [row.end for row in rows]
        ends = {pad + (row.points[-1] if row.points else row.hit) for pad, row in zip(pads, rows)}
        if len(ends) == 1:  # every row's last snapshot point (or hit) at one position: generate computes the rest
            length = ends.pop()
            return length, [max(0, length - pad) for pad in pads]
        return width - 1, [row.end for row in rows]  # else every row to its last-but-one token

    def run(self, cache: PagedCache, pads: Sequence[int], extra: dict[str, Any]) -> int:
        """Compute every row from its hit to where it stops (:meth:`stops`), keeping a snapshot at each snapshot
        point (and at the last-but-one token when it stops there), then hand the rows to ``cache`` (``pads[r]``
        positions of left padding before row ``r``). ``extra`` are the call's other model inputs (sequence-long ones
        sliced per row). Returns the rectangular length the cache holds."""
        width = len(self.rows[0].tokens) + pads[0]
        length, stops = self.stops(pads, width)
        for index, (row, stop) in enumerate(zip(self.rows, stops)):
            assert row.cache is not None
            inputs = _row_inputs(extra, index, pads[index], width)
            start = row.hit
            one_by_one = not self.resumes_chunks and row.hit > 0
            ends = range(start + 1, stop + 1) if one_by_one else [p for p in row.points if p <= stop]
            for point in [*ends, *([stop] if stop > max([start, *ends]) else [])]:
                self._forward(row.cache, row.tokens, start, point, inputs)
                if point % self.spacing == 0 or point == row.end:
                    row.cache.snapshot()
                start = point
        prompts = [row.tokens for row in self.rows]
        if not length:
            cache.attach_prefix([None] * len(self.rows), pads, 0, prompts)  # only the padding: generate computes all
            return 0
        cache.take_rows([row.cache for row in self.rows if row.cache is not None], pads, prompts, length)
        return length

    def _forward(self, cache: PagedCache, tokens: list[int], start: int, end: int, extra: dict[str, Any]) -> None:
        model = self.model
        ids = torch.tensor([tokens[:end]], device=model.device)
        inputs = {k: v[..., :end] if _is_sequence(v, len(tokens)) else v for k, v in extra.items()}
        if "position_ids" in _parameters(model):
            inputs["position_ids"] = torch.arange(end, device=ids.device)[None]
        if "logits_to_keep" in _parameters(model):
            inputs.setdefault("logits_to_keep", 1)
        model_inputs = model.prepare_inputs_for_generation(
            ids,
            next_sequence_length=end - start,
            cache=cache,
            attention_mask=torch.ones_like(ids),
            is_first_iteration=True,
            use_cache=True,
            **inputs,
        )
        with torch.no_grad():
            model(**model_inputs)

    def release(self) -> None:
        """Give back what the one-row caches still hold (after a failure; :meth:`run` empties them)."""
        for row in self.rows:
            if row.cache is not None:
                row.cache.release()


def _parameters(model: Any) -> Any:
    return inspect.signature(model.forward).parameters


def _is_sequence(value: Any, length: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[-1] == length


def _row_inputs(extra: dict[str, Any], row: int, pad: int, width: int) -> dict[str, Any]:
    """Row ``row``'s model inputs: batch tensors as long as the input cut to the row, without its padding."""
    out: dict[str, Any] = {}
    for key, value in extra.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[-1] == width:
            value = value[row : row + 1, ..., pad:]
        out[key] = value
    return out
