"""The per-row logits processing of one Engine step, batched as tensors: what each sampling control does to a row's
logits, in which order, and which values each control accepts.

A step's logits are ``(rows, vocab)``, one row per sequence that draws a token. :func:`process_rows` runs the
:data:`PROCESSORS` in order; each one takes only the rows that need it, as one sub-batch (one gather, its tensor
ops, one write back), so rows that need nothing pay nothing and a step where no row needs anything costs one pass
over the rows' parameters. Then the sampler (:mod:`.sampling`) takes greedy rows' argmax, and runs
:func:`warp_rows` on the random rows (again one sub-batch) before each row draws with its own generator.

The order, vLLM's (``vllm/v1/sample/sampler.py``), with transformers' processors where they agree:

1. **masks and bias** (:func:`apply_masks_and_bias`): ``allowed_token_ids`` (every other token ``-inf``), the stop
   tokens before ``min_new_tokens`` (``-inf``, as transformers' ``MinNewTokensLengthLogitsProcessor``), then
   ``logit_bias`` (added to the logit, as OpenAI's and transformers' ``SequenceBiasLogitsProcessor`` for one-token
   sequences).
2. **penalties** (:func:`apply_penalties`): ``repetition_penalty`` over the prompt and generated tokens (a positive
   logit divided by it, a negative one multiplied: transformers' ``RepetitionPenaltyLogitsProcessor``), then
   OpenAI's ``frequency_penalty`` (times each token's count) and ``presence_penalty`` (once per token present),
   over the generated tokens only.
3. **constraints**: a grammar's bitmask for constrained rows (structured outputs, issue 21) goes here, as one more
   :class:`RowProcessor`; a mask after the additive stages is the same as before them (``-inf`` stays ``-inf``).
4. greedy rows take the argmax of the result; random rows go through :func:`warp_rows`: **temperature**, then
   **min_p** (transformers' ``MinPLogitsWarper``), **top_k** (``TopKLogitsWarper``; 0 or -1 is every token), **top_p**,
   then the softmax they draw from. transformers applies min_p after top-k and top-p; vLLM before them. Top-k and
   min-p commute (a set by rank and a set by probability ratio), so only min_p with top_p < 1 differs from
   transformers, and then it follows vLLM.

Log-probabilities (``logprobs``) are taken before step 1, from the model's logits as they come (vLLM's default
``raw_logprobs``): the distribution the model gives, not the one a row draws from (see :mod:`.logprobs`).

Example:
    >>> import torch
    >>> from pagedcore.engine.sampling import SamplingParams
    >>> from pagedcore.engine.sampling import SampleRow
    >>> rows = [SampleRow("a", SamplingParams(logit_bias={1: 2.0}), [torch.Generator()])]
    >>> process_rows(torch.tensor([[1.0, 0.5, 0.0]]), rows).tolist()
    [[1.0, 2.5, 0.0]]
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pagedcore.errors import InvalidRequestError
from pagedcore.sequence import SequenceState
from pagedcore.validation import integer


class RowParams(Protocol):
    """What the processors read of a row's parameters (:class:`~.sampling.SamplingParams` has them all)."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def min_p(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def allowed_token_ids(self) -> Sequence[int] | None: ...
    @property
    def needs_processing(self) -> bool: ...
    @property
    def bias_items(self) -> tuple[tuple[int, float], ...]: ...
    @property
    def token_tables(self) -> TokenTables | None: ...


class Row(Protocol):
    """What the processors read of a row (:class:`~.sampling.SampleRow` is one): its parameters, the tokens it may
    not draw yet, its sequence (the penalties read its tokens)."""

    @property
    def params(self) -> RowParams: ...
    @property
    def suppress(self) -> tuple[int, ...]: ...
    @property
    def sequence(self) -> SequenceState | None: ...


__all__ = [
    "MAX_LOGIT_BIAS",
    "PROCESSORS",
    "RowProcessor",
    "TokenTables",
    "apply_masks_and_bias",
    "apply_penalties",
    "logit_bias_pairs",
    "number",
    "process_rows",
    "warp_rows",
]

MAX_LOGIT_BIAS = 100.0
"""A ``logit_bias`` value lies in ``[-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]`` (OpenAI's range)."""


# ----------------------------------------------------------------------------------------------- what is accepted
def number(
    name: str, value: object, low: float, high: float, *, low_open: bool = False, param: str | None = None
) -> float:
    """``value`` as a finite ``float`` in ``[low, high]`` (``(low, high]`` with ``low_open``); refuses bools,
    strings, NaN and infinities with an :class:`~pagedcore.errors.InvalidRequestError` naming ``name``.

    Example:
        >>> number("min_p", 0.5, 0.0, 1.0)
        0.5
        >>> number("presence_penalty", 3, -2.0, 2.0)
        Traceback (most recent call last):
        ...
        pagedcore.errors.InvalidRequestError: presence_penalty must be a number in [-2.0, 2.0], got 3
    """
    interval = f"{'(' if low_open else '['}{low}, {high}{']' if math.isfinite(high) else ')'}"  # inf is refused
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (low < value if low_open else low <= value) and value <= high  # type: ignore[operator]
    if not ok:
        raise InvalidRequestError(f"{name} must be a number in {interval}, got {value!r}", param=param or name)
    return float(value)  # type: ignore[arg-type]


def logit_bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (a mapping of token id to bias, or the pairs this returns) as ``(token id, bias)`` pairs sorted
    by id; ids are integers >= 0 (the Engine checks them against its vocabulary), biases finite numbers in
    ``[-100, 100]``.

    Example:
        >>> logit_bias_pairs({7: -1, 3: 2.5})
        ((3, 2.5), (7, -1.0))
        >>> logit_bias_pairs({5: 200})
        Traceback (most recent call last):
        ...
        pagedcore.errors.InvalidRequestError: logit_bias[5] must be a number in [-100.0, 100.0], got 200
    """
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (tuple, list)) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        items = list(value)
    else:
        raise InvalidRequestError(f"logit_bias must map token ids to biases, got {value!r}", param="logit_bias")
    pairs: dict[int, float] = {}
    for token, bias in items:
        token_id = integer(
            "logit_bias token ids", token, minimum=0, expected="token ids (integers >= 0)", param="logit_bias"
        )
        pairs[token_id] = number(f"logit_bias[{token_id}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, param="logit_bias")
    return tuple(sorted(pairs.items()))


@dataclass(frozen=True)
class TokenTables:
    """A request's ``logit_bias`` and ``allowed_token_ids`` as tensors, made once with its parameters, so a step
    reads them with a few tensor ops however long they are (up to the vocabulary each) rather than from Python
    lists.

    Attributes:
        bias_ids: the biased token ids (int64, sorted).
        bias_values: their biases (float64: a step casts them to its logits' dtype, as a Python float would be).
        allowed_ids: the ids that may be drawn (int64, sorted, each once; empty: every id).

    Example:
        >>> tables = TokenTables.of(((2, -3.5), (9, 1.0)), None)
        >>> tables.bias_ids.tolist(), tables.bias_values.tolist(), tables.allowed_ids.tolist()
        ([2, 9], [-3.5, 1.0], [])
    """

    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    allowed_ids: torch.Tensor

    @classmethod
    def of(cls, bias: Sequence[tuple[int, float]], allowed: Sequence[int] | None) -> TokenTables:
        """The tables of ``bias`` (``(id, bias)`` pairs, :func:`logit_bias_pairs`; an id given twice adds up) and
        ``allowed`` (ids or None)."""
        summed: dict[int, float] = {}
        for token, value in bias:
            summed[token] = summed.get(token, 0.0) + value
        ids = sorted(summed)
        return cls(
            torch.tensor(ids, dtype=torch.int64),
            torch.tensor([summed[token] for token in ids], dtype=torch.float64),
            torch.tensor(sorted(set(allowed or ())), dtype=torch.int64),
        )


_NO_TABLES = TokenTables.of((), None)


# --------------------------------------------------------------------------------------------------- the stage
@dataclass(frozen=True)
class RowProcessor:
    """One processor of the per-row stage.

    Attributes:
        name: what it is (for errors and profiles).
        applies: whether a row needs it (called for rows that need any processing at all).
        apply: ``(logits (k, vocab), rows (k)) -> logits``: the processed sub-batch (it may work in place on the
            sub-batch, which is the step's own copy of those rows).

    Example:
        >>> [p.name for p in PROCESSORS]
        ['masks and bias', 'penalties']
    """

    name: str
    applies: Callable[[Row], bool]
    apply: Callable[[torch.Tensor, Sequence[Row]], torch.Tensor]


def process_rows(
    logits: torch.Tensor, rows: Sequence[Row], processors: Sequence[RowProcessor] | None = None
) -> torch.Tensor:
    """Each row's logits ``(len(rows), vocab)`` as its request's processors leave them, :data:`PROCESSORS` in order.

    Works in place on ``logits`` (the step's own tensor: whoever needs the raw logits takes them first, as
    :func:`~.sampling.sample_rows` does for log-probabilities and ``return_logits``) and returns it; rows that need
    nothing are neither read nor written.

    Example:
        >>> from pagedcore.engine.sampling import SamplingParams
        >>> from pagedcore.engine.sampling import SampleRow
        >>> rows = [SampleRow("a", SamplingParams(), [torch.Generator()], suppress=(0,)),
        ...         SampleRow("b", SamplingParams(), [torch.Generator()])]
        >>> process_rows(torch.tensor([[1.0, 0.5], [1.0, 0.5]]), rows).tolist()
        [[-inf, 0.5], [1.0, 0.5]]
    """
    todo = [i for i, row in enumerate(rows) if row.suppress or row.params.needs_processing]
    if not todo:
        return logits
    for processor in PROCESSORS if processors is None else processors:
        picked = [i for i in todo if processor.applies(rows[i])]
        if not picked:
            continue
        index = torch.tensor(picked, device=logits.device)
        logits[index] = processor.apply(logits.index_select(0, index), [rows[i] for i in picked])
    return logits


def _flat(rows: Sequence[Any], ids_of: Callable[[Any], Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices and token ids of every id ``ids_of(row)`` gives, as two int64 tensors (one buffer copy each)."""
    where, ids = array("q"), array("q")
    for i, row in enumerate(rows):
        these = ids_of(row)
        if these:
            where.extend([i] * len(these))
            ids.extend(these)
    if not ids:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(where, dtype=torch.int64), torch.frombuffer(ids, dtype=torch.int64)


def _stacked(parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices and the concatenated ``parts`` (one tensor per row, any length)."""
    counts = torch.tensor([len(part) for part in parts], dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(parts)), counts), torch.cat(list(parts))


def _tables(row: Row) -> TokenTables:
    params = row.params
    tables = getattr(params, "token_tables", None)
    if tables is not None:
        return tables
    if not params.bias_items and not params.allowed_token_ids:
        return _NO_TABLES  # e.g. a row masked for min_tokens only
    return TokenTables.of(params.bias_items, params.allowed_token_ids)  # another type of parameters: for this step


def _wants_masks_or_bias(row: Row) -> bool:
    return bool(row.suppress or row.params.bias_items or row.params.allowed_token_ids)


def apply_masks_and_bias(logits: torch.Tensor, rows: Sequence[Row]) -> torch.Tensor:
    """``allowed_token_ids`` (the rest ``-inf``), the tokens a row may not draw yet (``suppress``: ``-inf``), then
    ``logit_bias`` added, on ``logits (len(rows), vocab)`` in place. The ids and biases come from each request's
    :class:`TokenTables`, so a step's cost does not grow with Python lists.

    Example:
        >>> from pagedcore.engine.sampling import SamplingParams
        >>> from pagedcore.engine.sampling import SampleRow
        >>> row = SampleRow("a", SamplingParams(allowed_token_ids=[0, 2], logit_bias={2: 1.0}), [], suppress=(0,))
        >>> apply_masks_and_bias(torch.zeros(1, 3), [row]).tolist()
        [[-inf, -inf, 1.0]]
    """
    device = logits.device
    tables = [_tables(row) for row in rows]
    if any(len(table.allowed_ids) for table in tables):
        keep = torch.zeros(logits.shape, dtype=torch.bool, device=device)
        where, ids = _stacked([table.allowed_ids for table in tables])
        keep[where.to(device), ids.to(device)] = True
        free = [i for i, table in enumerate(tables) if not len(table.allowed_ids)]
        keep[torch.tensor(free, dtype=torch.int64, device=device)] = True
        logits.masked_fill_(~keep, float("-inf"))
    where, ids = _flat(rows, lambda row: row.suppress)
    if len(ids):
        logits[where.to(device), ids.to(device)] = float("-inf")
    if any(len(table.bias_ids) for table in tables):
        where, ids = _stacked([table.bias_ids for table in tables])
        bias = torch.cat([table.bias_values for table in tables]).to(dtype=logits.dtype, device=device)
        at = (where.to(device), ids.to(device))  # each (row, id) once: a gather and a put, no accumulating sort
        logits.index_put_(at, logits[at] + bias)
    return logits


def _wants_penalties(row: Row) -> bool:
    params = row.params
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty or params.frequency_penalty)


def apply_penalties(logits: torch.Tensor, rows: Sequence[Row]) -> torch.Tensor:
    """vLLM's penalties on ``logits (len(rows), vocab)``: ``repetition_penalty`` over every token of the sequence
    (prompt and generated: a positive logit is divided by it, any other multiplied), then ``frequency_penalty`` times
    each generated token's count and ``presence_penalty`` once per generated token present, subtracted.

    Example:
        >>> from pagedcore import SequenceState
        >>> from pagedcore.engine.sampling import SamplingParams
        >>> from pagedcore.engine.sampling import SampleRow
        >>> seq = SequenceState("a", [0], max_new_tokens=4)
        >>> for token in (1, 1, 2):
        ...     _ = seq.append_token(token)
        >>> params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
        >>> apply_penalties(torch.tensor([[4.0, -1.0, 1.0, 3.0]]), [SampleRow("a", params, [], sequence=seq)])
        tensor([[ 2.0000, -3.2500, -0.2500,  3.0000]])
    """
    device, dtype = logits.device, logits.dtype
    if any(row.params.repetition_penalty != 1.0 for row in rows):
        seen = torch.zeros(logits.shape, dtype=torch.bool, device=device)
        where, ids = _flat(rows, _all_tokens)
        seen[where.to(device), ids.to(device)] = True
        penalty = torch.tensor([[row.params.repetition_penalty] for row in rows], dtype=dtype, device=device)
        finfo = torch.finfo(dtype)  # a tiny penalty (5e-324 is 0 in float32) must not make inf, nor -inf * 0 NaN:
        penalty = penalty.clamp(min=finfo.tiny)  # the limit is "repeat one of these": the largest finite logit
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty).clamp(max=finfo.max)
        logits = torch.where(seen, penalized, logits)
    if any(row.params.presence_penalty or row.params.frequency_penalty for row in rows):
        counts = torch.zeros(logits.shape, dtype=dtype, device=device)
        where, ids = _flat(rows, _output_tokens)
        ones = torch.ones(len(ids), dtype=dtype, device=device)
        counts.index_put_((where.to(device), ids.to(device)), ones, accumulate=True)
        frequency = torch.tensor([[row.params.frequency_penalty] for row in rows], dtype=dtype, device=device)
        presence = torch.tensor([[row.params.presence_penalty] for row in rows], dtype=dtype, device=device)
        logits = logits - frequency * counts - presence * (counts > 0).to(dtype)
    return logits


def _all_tokens(row: Row) -> Sequence[int]:
    return row.sequence.token_ids if row.sequence is not None else ()


def _output_tokens(row: Row) -> Sequence[int]:
    return row.sequence.output_token_ids if row.sequence is not None else ()


PROCESSORS: tuple[RowProcessor, ...] = (
    RowProcessor("masks and bias", _wants_masks_or_bias, apply_masks_and_bias),
    RowProcessor("penalties", _wants_penalties, apply_penalties),
    # constraints (a grammar's bitmask, issue 21) go here: after the additive stages, before the warpers.
)
"""The per-row stage's processors, in the order they run (see the module docstring)."""


# ------------------------------------------------------------------------------------------------- the warpers
def warp_rows(logits: torch.Tensor, params: Sequence[RowParams]) -> torch.Tensor:
    """The probabilities random rows draw from: ``logits (len(params), vocab)`` (processed, float32) divided by each
    row's temperature, then min_p, top_k and top_p (each only on the rows that set it), then the softmax.

    Example:
        >>> from pagedcore.engine.sampling import SamplingParams
        >>> probs = warp_rows(torch.tensor([[2.0, 1.0, 0.0]]), [SamplingParams(temperature=1.0, top_k=2)])
        >>> [round(p, 4) for p in probs[0].tolist()]
        [0.7311, 0.2689, 0.0]
    """
    device, dtype = logits.device, logits.dtype
    temperature = torch.tensor([[p.temperature] for p in params], dtype=dtype, device=device)
    # A temperature past the dtype's range (3e307 is inf in float32) would make a masked -inf / inf a NaN.
    scores = logits / temperature.clamp(max=torch.finfo(dtype).max)
    vocab = scores.shape[-1]
    scores = _sub_batch(scores, [i for i, p in enumerate(params) if p.min_p > 0], lambda s, i: _min_p(s, params, i))
    top_k = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    scores = _sub_batch(scores, top_k, lambda s, i: _top_k(s, [params[j].top_k for j in i]))
    top_p = [i for i, p in enumerate(params) if p.top_p < 1.0]
    scores = _sub_batch(scores, top_p, lambda s, i: _top_p(s, [params[j].top_p for j in i]))
    return torch.softmax(scores, dim=-1)


def _sub_batch(
    scores: torch.Tensor, picked: list[int], apply: Callable[[torch.Tensor, list[int]], torch.Tensor]
) -> torch.Tensor:
    """``apply`` to the rows ``picked`` of ``scores`` (all rows: no gather), written back in place."""
    if not picked:
        return scores
    if len(picked) == scores.shape[0]:
        return apply(scores, picked)
    index = torch.tensor(picked, device=scores.device)
    scores[index] = apply(scores.index_select(0, index), picked)
    return scores


def _min_p(scores: torch.Tensor, params: Sequence[RowParams], picked: list[int]) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the most likely one (``MinPLogitsWarper``)."""
    probs = torch.softmax(scores, dim=-1)
    min_p = torch.tensor([[params[i].min_p] for i in picked], dtype=scores.dtype, device=scores.device)
    return scores.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))


def _top_k(scores: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Keep each row's ``k`` highest scores (ties with the k-th kept, as ``TopKLogitsWarper``)."""
    top = torch.topk(scores, max(ks), dim=-1).values
    kth = top.gather(1, torch.tensor([[k - 1] for k in ks], device=scores.device))
    return scores.masked_fill(scores < kth, float("-inf"))


def _top_p(scores: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose probability reaches its ``top_p``."""
    sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
    probs = torch.softmax(sorted_scores, dim=-1)
    top_p = torch.tensor([[p] for p in ps], dtype=scores.dtype, device=scores.device)
    # Drop a token when the tokens before it already reach top_p. The most likely one always stays, also when top_p
    # is below float32's smallest number (1e-320 reads as 0 there, and 0 >= 0 would drop it).
    drop = (probs.cumsum(dim=-1) - probs) >= top_p
    drop[:, 0] = False
    return scores.scatter(1, order, sorted_scores.masked_fill(drop, float("-inf")))
