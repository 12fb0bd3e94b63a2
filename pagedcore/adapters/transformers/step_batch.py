"""One Engine step as tensors: the packed batch and the cache its forward writes through.

:func:`pack` turns the scheduler's plan into a :class:`StepBatch`: every scheduled token of every sequence in one
``(1, num_tokens)`` row without padding, each KV group's paged-attention metadata, a :class:`SampleRow` per
sequence that completed its known tokens, and a :class:`PromptSpan` per request with ``prompt_logprobs`` whose
prompt positions this step computes (their logits are kept too; nobody else's are). The batch holds everything the
forward and the sampler read, so they run without the Engine's lock while other threads add and abort requests.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer

from pagedcore.attention import PagedAttentionMetadata, stack_block_tables, to_device, write_kv
from pagedcore.engine.request import EngineRequest
from pagedcore.engine.sampling import SampleRow
from pagedcore.scheduler import ScheduledSequence, SchedulerOutput

from .attention import ForwardContext
from .pool import PagedKVPool

__all__ = ["PackedCache", "PromptSpan", "StepBatch", "pack"]


class _PackedLayer(CacheLayerMixin):
    """Layer view for transformers' mask code; the engine's attention does not use masks."""

    is_compileable = False

    def __init__(self, sliding_window: int | None) -> None:
        super().__init__()
        self.is_sliding = sliding_window is not None
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("updated through the engine's cache")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class PackedCache(Cache):
    """The cache a packed Engine forward writes through: every new token's keys/values go to its slot.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> model = tiny_llama()
        >>> PackedCache(PagedKVPool(model, num_blocks=8, block_size=4)).get_seq_length()
        0
    """

    def __init__(self, pool: PagedKVPool) -> None:
        layers: list[Any] = [
            _PackedLayer(spec.sliding_window) if spec.has_cache else DummyLayer() for spec in pool.spec.layers
        ]
        super().__init__(layers=layers)
        self._pool = pool
        self._slots: list[torch.Tensor] = []
        self._on: dict[tuple[int, torch.device], torch.Tensor] = {}

    def begin(self, slots: list[torch.Tensor]) -> None:
        """Start a forward whose new tokens go to ``slots`` (one tensor per KV group)."""
        self._slots = slots
        self._on = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        group = self._pool.group_of(layer_idx)
        keys = key_states[0].transpose(0, 1)  # (tokens, kv_heads, head_dim)
        values = value_states[0].transpose(0, 1)
        key_cache, value_cache = self._pool.layer_kv(layer_idx, keys, values)
        slots = self._on.get((group, keys.device))
        if slots is None:
            slots = self._on[(group, keys.device)] = to_device(self._slots[group], keys.device)
        write_kv(key_cache, value_cache, keys, values, slots)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class PromptSpan:
    """Prompt positions of one request whose logits a step keeps, for its ``prompt_logprobs``.

    Attributes:
        request_id: the request.
        first: the index of the first prompt token these positions predict (position ``first - 1`` predicts it).
        targets: the prompt tokens they predict, in order (``prompt[first : first + len(targets)]``).
        k: how many top tokens each entry carries.

    Example:
        >>> PromptSpan("r", 1, [6, 7], 2).targets
        [6, 7]
    """

    request_id: str
    first: int
    targets: list[int]
    k: int


@dataclass(frozen=True)
class StepBatch:
    """Everything one step's forward and sampler read, taken under the Engine's lock.

    Attributes:
        plan: the scheduler's plan for this step.
        owners: per scheduled sequence id, the request it belongs to.
        input_ids / position_ids: the packed tokens and their positions.
        logit_rows: per :class:`SampleRow`, the index of its last token in the packed batch.
        rows: the sequences to sample for, in the order of ``logit_rows``.
        context: each KV group's paged-attention metadata and the backend choice.
        prompt_rows: the packed indices of the prompt positions whose logits are kept for ``prompt_logprobs``
            (after ``logit_rows`` in the forward's logits), in the order of ``prompt_spans``.
        prompt_spans: what those positions are, one span per request.

    Example:
        >>> StepBatch(SchedulerOutput([]), {}, [], [], [], [], ForwardContext(None, [], None, None)).num_tokens
        0
    """

    plan: SchedulerOutput
    owners: dict[str, EngineRequest]
    input_ids: list[int]
    position_ids: list[int]
    logit_rows: list[int]
    rows: list[SampleRow]
    context: ForwardContext
    prompt_rows: list[int] = field(default_factory=list)
    prompt_spans: list[PromptSpan] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this step."""
        return len(self.input_ids)


def pack(
    plan: SchedulerOutput,
    pool: PagedKVPool,
    requests: Mapping[str, EngineRequest],
    attention_backend: str | None = None,
) -> StepBatch:
    """Pack a non-empty plan (call it under the lock that guards ``requests``: it reads the live block tables), after
    the plan's copy-on-write block copies.

    Example:
        >>> from pagedcore import Scheduler, SequenceState
        >>> from pagedcore.adapters.transformers import RequestMetrics, RequestOutput, SampleOutput, SamplingParams
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> pool = PagedKVPool(tiny_llama(), num_blocks=8, block_size=4)
        >>> sched, seq = Scheduler(pool.kv), SequenceState("r", [5, 6, 7], max_new_tokens=2)
        >>> sched.add(seq)
        >>> out = RequestOutput("r", [5, 6, 7], [SampleOutput(0)], RequestMetrics(0.0))
        >>> request = EngineRequest("r", SamplingParams(), seq, out, [], [torch.Generator()])
        >>> batch = pack(sched.schedule(), pool, {"r": request})
        >>> batch.input_ids, batch.position_ids, batch.logit_rows, [row.request_id for row in batch.rows]
        ([5, 6, 7], [0, 1, 2], [2], ['r'])
    """
    pool.copy_blocks(plan.copies)
    group_ids = range(len(pool.kv.groups))
    tokens: list[int] = []
    positions: list[int] = []
    tables: list[list[array[int]]] = [[] for _ in group_ids]
    offsets: list[list[int]] = [[] for _ in group_ids]
    slots: list[list[int]] = [[] for _ in group_ids]
    query_lens: list[int] = []
    seq_lens: list[int] = []
    logit_rows: list[int] = []
    rows: list[SampleRow] = []
    owners: dict[str, EngineRequest] = {}
    scored = _Scored()
    for item in plan.scheduled:  # one pass; a decode step of hundreds of sequences spends its host time here
        seq = item.sequence
        request = owners[item.request_id] = requests[seq.group_id]
        start, count, end = item.start, item.num_new_tokens, item.end
        if request.params.prompt_logprobs is not None:
            scored.keep(item, request, len(tokens))
        if count == 1:
            tokens.append(seq.token_ids[start])
            positions.append(start)
        else:
            tokens.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
        query_lens.append(count)
        seq_lens.append(end)
        if item.sample:
            logit_rows.append(len(tokens) - 1)
            rows.append(_sample_row(item, request))
        blocks = item.blocks
        for g in group_ids:
            tables[g].append(blocks.table_array(g))
            offsets[g].append(blocks.num_dropped(g))
            slots[g].extend(blocks.slots(g, start, end))
    metas = _metadata(pool, query_lens, seq_lens, offsets, tables, slots)
    context = ForwardContext(pool, metas, None, attention_backend)
    return StepBatch(plan, owners, tokens, positions, logit_rows, rows, context, scored.rows, scored.spans)


@dataclass
class _Scored:
    """The prompt positions a step keeps the logits of (requests with ``prompt_logprobs``)."""

    rows: list[int] = field(default_factory=list)
    spans: list[PromptSpan] = field(default_factory=list)

    def keep(self, item: ScheduledSequence, request: EngineRequest, base: int) -> None:
        """The prompt positions of ``item`` (packed from index ``base``) whose next prompt token has no
        log-probability yet: a prompt recomputed after a preemption is not scored twice."""
        seq = item.sequence
        done = len(request.output.prompt_logprobs or (None,))  # prompt tokens with an entry (the first has None)
        first = max(item.start, done - 1)  # the first position to keep: it predicts token first + 1
        last = min(item.end, seq.num_prompt_tokens - 1)  # the positions before it
        if first >= last:
            return
        self.rows.extend(range(base + first - item.start, base + last - item.start))
        k = request.params.prompt_logprobs or 0
        self.spans.append(PromptSpan(request.request_id, first + 1, seq.prompt_token_ids[first + 1 : last + 1], k))


def _metadata(
    pool: PagedKVPool,
    query_lens: list[int],
    seq_lens: list[int],
    offsets: list[list[int]],
    tables: list[list[array[int]]],
    slots: list[list[int]],
) -> list[PagedAttentionMetadata | None]:
    """Each KV group's paged-attention metadata for the packed sequences (per group: their dropped-block offsets,
    block tables and the new tokens' slots)."""
    return [
        PagedAttentionMetadata(
            block_size=pool.block_size,
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_offsets=offsets[g.index],
            block_tables=stack_block_tables(tables[g.index], pool.pad_block),
            slot_mapping=torch.tensor(slots[g.index], dtype=torch.int64),
            sliding_window=g.sliding_window,
            pad_block=pool.pad_block,
        )
        for g in pool.kv.groups
    ]


def _sample_row(item: ScheduledSequence, request: EngineRequest) -> SampleRow:
    """What the sampler needs for a sequence that completed its known tokens: all the samples' generators at the
    step that forks the request, else its own; the stop tokens masked before ``min_new_tokens``; the grammar state
    its next token follows (a structured output), in step with its tokens."""
    seq = item.sequence
    if item.num_samples > 1:
        generators = request.generators[: item.num_samples]
    else:
        generators = [request.generators[seq.sample_index]]
    suppress: tuple[int, ...] = ()
    if seq.min_new_tokens and seq.num_output_tokens < seq.min_new_tokens:
        suppress = tuple(sorted(seq.stop_token_ids))
    grammar = request.grammar.row_state(seq, item.num_samples) if request.grammar is not None else None
    return SampleRow(item.request_id, request.params, generators, suppress, seq, grammar)
