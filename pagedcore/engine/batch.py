"""One Engine step as the Engine sees it: which rows it samples, which prompt positions it scores, what the runner
computes.

:func:`plan_step` turns the scheduler's plan into a :class:`StepBatch`: a :class:`~.sampling.SampleRow` per sequence
that completed its known tokens (its request's parameters, generators and grammar state), a :class:`PromptSpan` per
request with ``prompt_logprobs`` whose prompt positions this step computes, and the runner's
:class:`~.runner.ForwardBatch` (the plan, its block copies and the packed indices whose logits come back). The batch
holds everything the sampler reads, so the forward and the sampling run without the Engine's lock while other
threads add and abort requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedcore.scheduler import ScheduledSequence, SchedulerOutput

from .request import RequestState
from .runner import ForwardBatch
from .sampling import SampleRow

__all__ = ["PromptSpan", "StepBatch", "plan_step"]


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


@dataclass
class StepBatch:
    """Everything one step's sampler reads, taken under the Engine's lock, and the runner's share of it.

    Attributes:
        plan: the scheduler's plan for this step.
        owners: per scheduled sequence id, the request it belongs to.
        rows: the sequences to sample for, in the order of the forward's first logits rows.
        prompt_spans: the prompt positions whose logits follow the sampled rows', one span per request.
        forward: what the runner computes (:class:`~.runner.ForwardBatch`).
        prepared: what the runner's ``prepare`` made of it (the runner's own object).

    Example:
        >>> StepBatch(SchedulerOutput([]), {}, [], [], ForwardBatch([], [], [], 0, False)).forward.num_rows
        0
    """

    plan: SchedulerOutput
    owners: dict[str, RequestState]
    rows: list[SampleRow]
    prompt_spans: list[PromptSpan]
    forward: ForwardBatch
    prepared: Any = None


def plan_step(plan: SchedulerOutput, requests: Mapping[str, RequestState]) -> StepBatch:
    """The step's sampled rows, scored prompt positions and forward batch (call it under the lock that guards
    ``requests``).

    Example:
        >>> import torch
        >>> from pagedcore import KVPool, Scheduler, SequenceState
        >>> from pagedcore.engine.outputs import RequestMetrics, RequestOutput, SampleOutput
        >>> from pagedcore.engine.sampling import SamplingParams
        >>> sched, seq = Scheduler(KVPool(num_blocks=8, block_size=4)), SequenceState("r", [5, 6, 7], max_new_tokens=2)
        >>> sched.add(seq)
        >>> out = RequestOutput("r", [5, 6, 7], [SampleOutput(0)], RequestMetrics(0.0))
        >>> request = RequestState("r", SamplingParams(), seq, out, [], [torch.Generator()])
        >>> batch = plan_step(sched.schedule(), {"r": request})
        >>> batch.forward.logit_rows, batch.forward.is_decode, [row.request_id for row in batch.rows]
        ([2], False, ['r'])
        >>> batch.forward.argmax_only   # greedy, nothing else reads the logits: the runner may return tokens
        True
    """
    logit_rows: list[int] = []
    rows: list[SampleRow] = []
    owners: dict[str, RequestState] = {}
    scored = _Scored()
    decode = argmax = True
    offset = 0
    for item in plan.scheduled:
        request = owners[item.request_id] = requests[item.sequence.group_id]
        count = item.num_new_tokens
        if request.params.prompt_logprobs is not None:
            scored.keep(item, request, offset)
        offset += count
        if item.sample:
            logit_rows.append(offset - 1)
            row = _sample_row(item, request)
            rows.append(row)
            argmax = argmax and row.argmax_only
        if count != 1 or not item.sample:
            decode = False
    decode = decode and bool(plan.scheduled) and not scored.rows
    argmax = argmax and bool(rows) and not scored.rows
    forward = ForwardBatch(plan.scheduled, plan.copies, logit_rows + scored.rows, offset, decode, argmax)
    return StepBatch(plan, owners, rows, scored.spans, forward)


@dataclass
class _Scored:
    """The prompt positions a step keeps the logits of (requests with ``prompt_logprobs``)."""

    rows: list[int] = field(default_factory=list)
    spans: list[PromptSpan] = field(default_factory=list)

    def keep(self, item: ScheduledSequence, request: RequestState, base: int) -> None:
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


def _sample_row(item: ScheduledSequence, request: RequestState) -> SampleRow:
    """What the sampler needs for a sequence that completed its known tokens: all the samples' generators at the
    step that forks the request, else its own; the stop tokens masked before ``min_new_tokens``; the grammar state
    its next token follows (a structured output), in step with its tokens. A row with none of these three is kept
    on the request and given again at the sequence's next steps (a step of hundreds of decoding sequences would
    otherwise build as many identical rows)."""
    seq = item.sequence
    row = request.rows.get(seq.sample_index)
    if row is not None and row.sequence is seq:
        return row  # a plain decode row: the same from step to step
    if item.num_samples > 1:
        generators = request.generators[: item.num_samples]
    else:
        generators = [request.generators[seq.sample_index]]
    suppress: tuple[int, ...] = ()
    if seq.min_new_tokens and seq.num_output_tokens < seq.min_new_tokens:
        suppress = tuple(sorted(seq.stop_token_ids))
    grammar = request.grammar.row_state(seq, item.num_samples) if request.grammar is not None else None
    row = SampleRow(item.request_id, request.params, generators, suppress, seq, grammar)
    if item.num_samples == 1 and not suppress and grammar is None:  # nothing in it changes until it finishes
        request.rows[seq.sample_index] = row
    return row
