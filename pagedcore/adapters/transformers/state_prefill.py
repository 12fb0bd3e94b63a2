"""The prefill of an ``enable()``d ``generate`` call on a model with recurrent-state layers: prefix hits that resume
a state, and the snapshots that later prompts resume from.

A recurrent state cannot be cut at an arbitrary token, so a prompt is computed in pieces that end at **snapshot
points** (every ``snapshot_interval`` blocks of the prompt, and its last computed position) and the state is kept at
each of them (:meth:`~pagedcore.adapters.transformers.PagedCache.snapshot`); when the call registers its blocks, each
snapshot is filed beside the block it ends (:mod:`pagedcore.state_slots`), as the state where the sequence stops is. A
later prompt then takes the deepest point of its prefix match where every layer kind has what it needs (keys and
values before it, a snapshot at it: :meth:`~pagedcore.kv_pool.KVPool.match`), restores that state and computes from
there.

Each row of a call is computed alone (one row per forward, no padding: a recurrent state sees none, as in transformers,
whose layers zero the padding's inputs), from its own hit to its prompt's last-but-one token, then the call's cache
takes the rows (:meth:`~pagedcore.adapters.transformers.PagedCache.take_rows`) and ``generate`` computes the last token
of every row together. Families whose forward of several tokens does not continue a cached state
(:attr:`~.state_spec.StateSpec.resumes_chunks` false: Jamba) resume a hit one token per forward, and only when
that is at most :data:`TOKEN_BY_TOKEN_LIMIT` tokens (else the row is computed from the start, in one forward, as
``generate`` would); their prompts keep one snapshot, at their end.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedcore.capacity import Reservation
from pagedcore.kv_pool import PoolMatch

from .cache import PagedCache
from .pool import PagedKVPool

__all__ = ["TOKEN_BY_TOKEN_LIMIT", "StatePrefill", "snapshot_points"]

TOKEN_BY_TOKEN_LIMIT = 32
"""The most tokens a family that resumes a state one token at a time computes that way after a hit."""


def snapshot_points(start: int, end: int, spacing: int, *, resumes_chunks: bool = True) -> list[int]:
    """Where the forwards of a row computed from position ``start`` to ``end`` stop: every multiple of ``spacing``
    after ``start`` (a snapshot point), and ``end``; a family that does not resume chunks: every position after
    ``start`` when it resumes a hit (one token per forward), else ``end`` only. A row keeps its state at the
    multiples of ``spacing`` and at ``end``.

    Example:
        >>> snapshot_points(0, 10, 4), snapshot_points(4, 9, 4), snapshot_points(6, 6, 4)
        ([4, 8, 10], [8, 9], [])
        >>> snapshot_points(5, 8, 4, resumes_chunks=False), snapshot_points(0, 8, 4, resumes_chunks=False)
        ([6, 7, 8], [8])
    """
    if end <= start:
        return []
    if not resumes_chunks:
        return list(range(start + 1, end + 1)) if start else [end]
    first = (start // spacing + 1) * spacing
    return [*range(first, end, spacing), end]


@dataclass
class _Row:
    tokens: list[int]
    match: PoolMatch
    hit: int
    cache: PagedCache | None = None
    points: list[int] = field(default_factory=list)


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
        ...     prefill.plan([[5, 6, 7, 8, 9, 10, 11]]), prefill.rows[0].points   # no hit; stops at 4 and 6
        ...     prefill.attach(pool.kv.reserve(pool.kv.worst_case()))
        ([0], [4, 6])
        >>> cache = PagedCache(model, pool=pool)
        >>> prefill.run(cache, [0], {}), cache.memory_stats().state_slots   # its state and two snapshots
        (6, 3)
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
        self.rows: list[_Row] = []

    # ------------------------------------------------------------------ under the pool's lock
    def plan(self, prompts: Sequence[Sequence[int]]) -> list[int]:
        """Each row's hit (tokens resumed from a snapshot; loaded from the tiers below the pool first). Returns them."""
        kv = self.pool.kv
        for tokens in prompts:
            kv.load_prefix(tokens, self.namespace)
            match = kv.match(tokens, self.namespace, max_tokens=len(tokens) - 1)
            hit = match.num_tokens
            if not self.resumes_chunks and len(tokens) - 1 - hit > TOKEN_BY_TOKEN_LIMIT:
                hit = 0  # resuming one token at a time would cost more than computing the row in one forward
            end = len(tokens) - 1
            self.rows.append(_Row(list(tokens), match, hit, points=self._points(hit, end)))
        return [row.hit for row in self.rows]

    def _points(self, hit: int, end: int) -> list[int]:
        return snapshot_points(hit, end, self.spacing, resumes_chunks=self.resumes_chunks)

    def attach(self, reservation: Reservation) -> None:
        """Give each row a one-row cache drawing from ``reservation``, its hit attached."""
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
    def run(self, cache: PagedCache, pads: Sequence[int], extra: dict[str, Any]) -> int:
        """Compute every row from its hit to its last-but-one token, keeping a snapshot at each point, then hand the
        rows to ``cache`` (``pads[r]`` positions of left padding before row ``r``). ``extra`` are the call's other
        model inputs (sequence-long ones sliced per row). Returns the rectangular length the cache holds."""
        width = len(self.rows[0].tokens) + pads[0]
        for index, row in enumerate(self.rows):
            assert row.cache is not None
            start = row.hit
            end = len(row.tokens) - 1
            for point in row.points:
                self._forward(row.cache, row.tokens, start, point, _row_inputs(extra, index, pads[index], width))
                if point % self.spacing == 0 or point == end:
                    row.cache.snapshot()
                start = point
        cache.take_rows([row.cache for row in self.rows if row.cache is not None], pads, [r.tokens for r in self.rows])
        return width - 1

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
