"""What the Engine returns: per-request outputs, streamed token events, log-probabilities and engine statistics."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

__all__ = [
    "EngineStats",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "SampleOutput",
    "StepOutput",
    "TokenEvent",
    "TokenLogprobs",
]


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log-probability at one position.

    Attributes:
        token_id: the token.
        logprob: its natural-log probability under the model's distribution at that position (float32
            ``log_softmax`` of the model's logits, before any logits processing: see :mod:`.sampling`).
        rank: 1 for the most likely token; a token's rank is the number of tokens at least as likely as it (vLLM's
            rule: ties share the worse rank).

    Example:
        >>> Logprob(42, -0.25, 1).rank
        1
    """

    token_id: int
    logprob: float
    rank: int


@dataclass(frozen=True, slots=True)
class TokenLogprobs(Mapping[int, Logprob]):
    """The log-probabilities at one position: the token that was chosen there and the most likely alternatives.

    It is also what vLLM gives for a position, a mapping of token id to :class:`Logprob` over the top tokens and
    the chosen one (``out.outputs[0].logprobs[i][token_id].logprob``), most likely first.

    Attributes:
        token: the chosen token (the sampled one for generated tokens, the prompt's next token for prompt positions).
        top: the ``k`` most likely tokens, most likely first (ranks 1 .. k); the chosen token is among them when its
            rank is at most ``k``. Empty for ``logprobs=0``.

    Example:
        >>> lp = TokenLogprobs(Logprob(7, -1.5, 2), (Logprob(3, -0.5, 1), Logprob(7, -1.5, 2)))
        >>> lp.token.logprob, [t.token_id for t in lp.top], lp.as_dict()
        (-1.5, [3, 7], {3: -0.5, 7: -1.5})
        >>> list(lp), lp[3].rank, 7 in lp, 9 in lp
        ([3, 7], 1, True, False)
    """

    token: Logprob
    top: tuple[Logprob, ...] = ()

    def __getitem__(self, token_id: int) -> Logprob:
        for entry in self.top:
            if entry.token_id == token_id:
                return entry
        if self.token.token_id == token_id:
            return self.token
        raise KeyError(token_id)

    def __iter__(self) -> Iterator[int]:
        seen = False
        for entry in self.top:
            seen = seen or entry.token_id == self.token.token_id
            yield entry.token_id
        if not seen:
            yield self.token.token_id

    def __len__(self) -> int:
        return len(self.top) + (not any(entry.token_id == self.token.token_id for entry in self.top))

    def as_dict(self) -> dict[int, float]:
        """Token id -> log-probability for the top tokens and the chosen one (vLLM's and OpenAI's
        ``top_logprobs`` shape, most likely first, up to ``k + 1`` entries)."""
        out = {t.token_id: t.logprob for t in self.top}
        out.setdefault(self.token.token_id, self.token.logprob)
        return out


@dataclass(slots=True)
class SampleOutput:
    """One parallel sample of a request (vLLM's ``CompletionOutput``: ``request_output.outputs[i]``).

    Attributes:
        index: sample number (0 .. n-1).
        token_ids: generated token ids (the Engine fills them in when the sample finishes), up to and including
            the token that stopped it.
        text: decoded text (with a tokenizer): ``tokenizer.decode(token_ids, skip_special_tokens=True)``, cut before
            the stop string that stopped it (kept with ``include_stop_str_in_output``).
        finish_reason: "stop", "length", "abort" or "error".
        stop_reason: with ``finish_reason="stop"``, what stopped it: the stop string, or the stop token id (eos or
            one of ``stop_token_ids``); else None (vLLM's ``stop_reason``).
        logits: with ``SamplingParams(return_logits=True)``, the float32 logits each token was drawn from.
        logprobs: with ``SamplingParams(logprobs=k)``, one :class:`TokenLogprobs` per generated token (in order;
            as many as ``token_ids``), else None.

    Example:
        >>> SampleOutput(0, [5, 6], finish_reason="length").token_ids
        [5, 6]
        >>> SampleOutput(0, [5], logprobs=[TokenLogprobs(Logprob(5, -0.5, 1))]).cumulative_logprob
        -0.5
    """

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    logits: list[torch.Tensor] | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the generated tokens' log-probabilities (with ``logprobs``), else None."""
        return None if self.logprobs is None else sum(lp.token.logprob for lp in self.logprobs)


@dataclass(slots=True)
class RequestMetrics:
    """Timings of one request (``time.perf_counter`` seconds).

    Attributes:
        arrival_time: when it was added.
        first_token_time: when its first token was sampled.
        finish_time: when its last sample finished.
        num_cached_tokens: prompt tokens served from the prefix cache at its (last) admission.
        num_preemptions: times it was preempted and recomputed.

    Example:
        >>> metrics = RequestMetrics(arrival_time=1.0, first_token_time=1.25, finish_time=2.0)
        >>> metrics.time_to_first_token, metrics.latency
        (0.25, 1.0)
    """

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        """Seconds from arrival to the end."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """The result of one request, read as vLLM's is: ``out.outputs[0].text``, ``.token_ids``, ``.finish_reason``,
    ``.logprobs`` (one mapping of token id to :class:`Logprob` per token), ``out.prompt_token_ids``,
    ``out.finished``, ``out.num_cached_tokens``.

    Attributes:
        request_id: the request's id.
        prompt_token_ids: the prompt.
        samples: one entry per parallel sample (``n``); :attr:`outputs` is the same list, vLLM's name.
        metrics: timings.
        error: why the request failed (``finish_reason == "error"``), else None.
        client_error: whether that failure is the request's own (its grammar could not be followed), not the
            server's: a server answers it 400, not 500.
        prompt_logprobs: with ``SamplingParams(prompt_logprobs=k)``, one entry per prompt token: None for the first
            (nothing predicts it), then the :class:`TokenLogprobs` of each prompt token given the tokens before it;
            else None.
        weights_version: the weights the request was computed with (:attr:`PagedKVPool.weights_version
            <pagedcore.adapters.transformers.PagedKVPool.weights_version>` at its first step): a trainer keeps the
            outputs whose version is the current one (on-policy) and drops or importance-weights the others. A
            request that was running when the weights changed finishes on the keys and values it holds, its new
            tokens computed by the new weights: it keeps the older version. None until a step computed it.

    Example:
        >>> out = RequestOutput("r1", [1, 2], [SampleOutput(0, [7], finish_reason="stop")], RequestMetrics(0.0))
        >>> out.token_ids, out.finish_reason, out.finished, out.outputs[0].token_ids, out.outputs is out.samples
        ([7], 'stop', True, [7], True)
    """

    request_id: str
    prompt_token_ids: list[int]
    samples: list[SampleOutput]
    metrics: RequestMetrics
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    client_error: bool = False
    weights_version: int | None = None

    @property
    def outputs(self) -> list[SampleOutput]:
        """The samples, under vLLM's name (``RequestOutput.outputs``): the same list as :attr:`samples`."""
        return self.samples

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (vLLM's name; ``metrics.num_cached_tokens``)."""
        return self.metrics.num_cached_tokens

    @property
    def token_ids(self) -> list[int]:
        """The first sample's generated token ids."""
        return self.samples[0].token_ids

    @property
    def text(self) -> str | None:
        """The first sample's text."""
        return self.samples[0].text

    @property
    def finish_reason(self) -> str | None:
        """The first sample's finish reason."""
        return self.samples[0].finish_reason

    @property
    def finished(self) -> bool:
        """Whether every sample has finished."""
        return all(s.finish_reason is not None for s in self.samples)


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, as :meth:`Engine.stream` yields it.

    Attributes:
        request_id: the request.
        sample: which parallel sample.
        token_id: the token (None on an event that only reports a finish without a token, e.g. an abort).
        text: the text that became final with this token (with a tokenizer), else None: ``""`` while a character
            spans several tokens or the text could still be the start of a stop string. A sample's texts joined
            are its final ``SampleOutput.text``.
        finish_reason: set on the sample's last event.
        stop_reason: on a last event with ``finish_reason="stop"``: the stop string or stop token id.
        logprobs: with ``SamplingParams(logprobs=k)``, the token's :class:`TokenLogprobs`.
        prompt_logprobs: with ``SamplingParams(prompt_logprobs=k)``, on each sample's first event: the request's
            prompt log-probabilities (as :attr:`RequestOutput.prompt_logprobs`), for streams that echo the prompt.

    Example:
        >>> TokenEvent("r1", 0, 42).finish_reason is None
        True
    """

    request_id: str
    sample: int
    token_id: int | None
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


_new, _set = object.__new__, object.__setattr__


def token_event(
    request_id: str,
    sample: int,
    token_id: int | None,
    text: str | None,
    finish_reason: str | None,
    stop_reason: str | int | None,
    logprobs: TokenLogprobs | None,
    prompt_logprobs: list[TokenLogprobs | None] | None,
) -> TokenEvent:
    """``TokenEvent(...)`` with every field given, made the way a step makes one per running sample: a frozen
    dataclass's ``__init__`` sets each field through ``object.__setattr__`` (about 1.5 µs for eight fields); this
    sets the instance's ``__dict__`` at once (about 0.5 µs). The event is the same: equal, hashable, frozen.

    Example:
        >>> token_event("r1", 0, 42, "hi", None, None, None, None) == TokenEvent("r1", 0, 42, "hi")
        True
    """
    event = _new(TokenEvent)
    _set(event, "__dict__", {"request_id": request_id, "sample": sample, "token_id": token_id, "text": text,
                             "finish_reason": finish_reason, "stop_reason": stop_reason, "logprobs": logprobs,
                             "prompt_logprobs": prompt_logprobs})  # fmt: skip
    return event


@dataclass(frozen=True)
class StepOutput:
    """What one :meth:`Engine.step_events` call produced.

    Attributes:
        finished: requests that finished (every sample done), in the order they finished.
        events: every token event of the step, in order (a sample's last event has ``finish_reason``).

    Example:
        >>> StepOutput([], [TokenEvent("r1", 0, 42)]).events[0].token_id
        42
    """

    finished: list[RequestOutput]
    events: list[TokenEvent]


@dataclass(frozen=True)
class EngineStats:
    """Counters and gauges of an Engine since it was created.

    Attributes:
        num_requests / num_finished / num_aborted / num_failed: request counts.
        num_steps: forward passes.
        num_preemptions: sequences preempted (recomputed later).
        prefix_query_tokens / prefix_hit_tokens: prompt tokens looked up / served by the prefix cache.
        prompt_tokens_computed: prompt tokens whose KV was computed (recomputation after preemption included).
        generated_tokens: tokens sampled.
        kv_usage: fraction of KV blocks in use now (highest over KV groups).
        kv_used_bytes / kv_peak_used_bytes: KV memory held by sequences now / at the peak.
        busy_seconds: time spent inside ``step()``.
        schedule_seconds / prepare_seconds / forward_seconds / sample_seconds / record_seconds: the part of
            ``busy_seconds`` spent in each stage of the steps (cumulative): the scheduler's plan, packing it into
            tensors and metadata, the model forward, drawing the tokens, handing them back (outputs, events).
            Everything but ``forward_seconds`` is the Engine's host work. On a GPU the forward's kernels may still
            run when it returns: their tail is counted in ``sample_seconds``, which waits for the logits.
        kernel_failures: kernel calls of the attention backend that raised and fell back to the torch backend
            (the xformers backend counts them; 0 for backends that do not).
        compiled_steps: decode steps run as the compiled graph (``Engine(compile=...)``; 0 when not compiling).
        compiled_graphs / compiled_buckets: graphs compiled, and the distinct (batch, context) buckets the compiled
            steps ran in: one graph per bucket, so ``compiled_graphs - compiled_buckets`` are recompilations.
        compile_failures: compiled steps that raised (at most 1: compiling is then turned off, the step and the
            Engine's later steps run eagerly; the error is logged).
        kv_store_loaded_blocks / kv_store_loaded_tokens: blocks (summed over KV groups) and prompt tokens loaded
            from the tiers below the pool (``kv_store=``); ``kv_store_hits``: blocks loaded per tier name.
        kv_store_written_blocks: blocks the writer thread wrote down (evicted, or saved at close).
        kv_store_load_seconds / kv_store_write_seconds: time looking up, reading, checking and copying blocks in
            (on the step loop) / encoding and writing them (in the writer thread).
        kv_store_writes_skipped: evicted blocks not written because the writer's queue was full;
            ``kv_store_write_failures``: puts a store refused (no room, disk full).
        kv_store_refused: stored blocks found and refused, by reason (``checksum``, ``fingerprint``, ``foreign``;
            ``file``: not a regular file of this user, or larger than the store's budget).
        kv_store_bytes: bytes each tier holds now.

    Example:
        >>> stats = EngineStats(1, 1, 0, 0, 3, 0, 100, 75, 25, 10, 0.0, 0, 4096, 0.5)
        >>> stats.prefix_hit_rate, stats.generation_throughput
        (0.75, 20.0)
    """

    num_requests: int
    num_finished: int
    num_aborted: int
    num_failed: int
    num_steps: int
    num_preemptions: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prompt_tokens_computed: int
    generated_tokens: int
    kv_usage: float
    kv_used_bytes: int
    kv_peak_used_bytes: int
    busy_seconds: float
    schedule_seconds: float = 0.0
    prepare_seconds: float = 0.0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0
    record_seconds: float = 0.0
    kernel_failures: int = 0
    compiled_steps: int = 0
    compiled_graphs: int = 0
    compiled_buckets: int = 0
    compile_failures: int = 0

    @property
    def recompilations(self) -> int:
        """Graphs compiled beyond one per bucket (0 after warm-up: nothing recompiled)."""
        return max(0, self.compiled_graphs - self.compiled_buckets)

    kv_store_loaded_blocks: int = 0
    kv_store_loaded_tokens: int = 0
    kv_store_written_blocks: int = 0
    kv_store_load_seconds: float = 0.0
    kv_store_write_seconds: float = 0.0
    kv_store_writes_skipped: int = 0
    kv_store_write_failures: int = 0
    kv_store_refused: dict[str, int] = field(default_factory=dict)
    kv_store_hits: dict[str, int] = field(default_factory=dict)
    kv_store_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def host_seconds(self) -> float:
        """Step time outside the model forward: scheduling, packing, sampling and recording."""
        return self.schedule_seconds + self.prepare_seconds + self.sample_seconds + self.record_seconds

    @property
    def prefix_hit_rate(self) -> float:
        """``prefix_hit_tokens / prefix_query_tokens``."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def generation_throughput(self) -> float:
        """Generated tokens per second of ``step()`` time."""
        return self.generated_tokens / self.busy_seconds if self.busy_seconds else 0.0
