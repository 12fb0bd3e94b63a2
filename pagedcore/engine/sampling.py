"""Per-request sampling parameters, their translation from transformers' ``generate`` arguments, and the sampler.

Each sample of each request owns a ``torch.Generator`` seeded from its request's seed, so a seeded request draws
the same tokens whatever else is in the batch, and a recomputed (preempted) request does not draw again. Sample 0
of a request seeded with ``s`` draws exactly what ``torch.manual_seed(s); model.generate(...)`` draws for that
prompt alone (any Python int: see :func:`torch_seed`).

Callers who think in transformers' terms pass ``generate``'s keyword arguments instead: the transformers adapter
turns them into :class:`SamplingParams` (:mod:`pagedcore.adapters.transformers.generate_kwargs`).

The sampler (:func:`sample_rows`) draws a whole step's tokens in stages, each batched over the rows that need it:

1. the raw logits that were asked for: ``return_logits`` rows keep a copy, ``logprobs`` rows their ``log_softmax``
   (log-probabilities are the model's own distribution, before any processing: vLLM's default ``raw_logprobs``);
2. per-row logits processing (:func:`~.logits_processors.process_rows`): allowed tokens, the stop tokens before
   ``min_new_tokens``, ``logit_bias``, then the repetition, frequency and presence penalties; a grammar's mask for
   constrained rows (structured outputs) joins this stage after them;
3. greedy rows: the argmax of the processed logits; random rows: temperature, ``min_p``, ``top_k``, ``top_p``
   (:func:`~.logits_processors.warp_rows`), then each row draws from its own generator;
4. the log-probabilities of the drawn tokens and the top ``k`` (:mod:`.logprobs`), from stage 1's.

The order and what each control means are in :mod:`.logits_processors`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, field, fields
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from pagedcore.errors import GrammarError, InvalidRequestError
from pagedcore.sequence import SequenceState
from pagedcore.validation import integer, token_ids

from .logits_processors import TokenTables, logit_bias_pairs, number, process_rows, warp_rows
from .logprobs import sample_logprobs
from .outputs import TokenLogprobs
from .structured.spec import StructuredOutput

if TYPE_CHECKING:
    from .structured.masks import GrammarMasks
    from .structured.matcher import GrammarState

__all__ = [
    "GREEDY_BELOW",
    "VLLM_NAMES",
    "SampleRow",
    "SamplingParams",
    "StepSamples",
    "argmax_samples",
    "constrain_rows",
    "greedy_tokens",
    "numpy_greedy",
    "process_rows",
    "sample_rows",
    "sample_tokens",
    "torch_seed",
]

VLLM_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "stop": "stop_strings"}
"""vLLM's names for :class:`SamplingParams` fields that this class names in transformers' words; a dict of fields
(:meth:`SamplingParams.from_fields`, ``Engine.generate(prompts, {...})``) may use either name."""

_TORCH_SEEDS = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes (negatives map to 2**64 - 1 + seed)
_GOLDEN = 0x9E3779B97F4A7C15  # spreads the seeds of a request's parallel samples


GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy (vLLM's threshold too): dividing logits by a temperature near 0 overflows
float32 (``1e-40``, ``1e-300``) and the draw would fail, while its limit is the argmax anyway."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to generate for one request.

    Args:
        max_new_tokens: tokens to generate at most (0 returns at once with no tokens).
        temperature: 0 for greedy decoding, else the softmax temperature (> 0); below :data:`GREEDY_BELOW` it is
            greedy too.
        top_k: keep the ``top_k`` most likely tokens (0 or -1, vLLM's spelling: all; -1 is stored as 0).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p`` (in (0, 1]).
        seed: seed of this request's random draws, any Python int (None: drawn from Python's ``random``); see
            :func:`torch_seed` for how it reaches ``torch.Generator.manual_seed``.
        stop_token_ids: stop after any of these; None means the Engine's ``eos_token_ids`` (the generation
            config's and the tokenizer's eos).
        stop_strings: stop when the text contains one of these (a string or a list; needs the Engine's tokenizer).
            The token that completes it is the sample's last; the text ends before the stop string, and the sample
            reports ``finish_reason="stop"`` and ``stop_reason`` (the string). A stop string that is a special
            token's text (``"<|im_end|>"``) matches by token id, as that text is not in the decoded text.
        include_stop_str_in_output: keep the stop string at the end of the text.
        ignore_eos: never stop at the stop tokens (benchmarks); stop strings still apply.
        min_new_tokens: nothing stops a sample before this many tokens were generated: the stop tokens are masked
            (as transformers' ``min_new_tokens`` does), and stop strings are not matched (vLLM calls it
            ``min_tokens``: :meth:`from_fields` takes either name).
        n: parallel samples of the prompt; they share the prompt's KV blocks.
        return_logits: keep each step's float32 logits in the output, before any masking (for tests and analysis;
            memory grows with ``vocab * tokens``; transformers' ``output_logits``).
        presence_penalty: subtracted from the logit of every token generated so far (OpenAI's; in [-2, 2]).
        frequency_penalty: subtracted once per time a token was generated so far (OpenAI's; in [-2, 2]).
        repetition_penalty: every token of the prompt and the generated text has a positive logit divided by it and
            a negative one multiplied (transformers' and vLLM's; > 0, 1 = none).
        logit_bias: token id -> bias added to its logit at every step (OpenAI's; biases in [-100, 100], ids in the
            vocabulary); stored as ``(id, bias)`` pairs sorted by id.
        allowed_token_ids: only these tokens may be drawn (vLLM's); None: all.
        min_p: drop tokens less likely than ``min_p`` times the most likely one (in [0, 1]; 0 = none; sampling only).
        logprobs: with ``k``, each generated token carries its log-probability, its rank and the ``k`` most likely
            tokens' (``k`` = 0: the token alone; -1: the whole vocabulary), up to the Engine's ``max_logprobs``; the
            log-probabilities are the model's distribution before any processing (see :mod:`.logits_processors`).
        prompt_logprobs: with ``k``, the output carries each prompt token's log-probability given the tokens before
            it, and the ``k`` most likely there. Such a request computes its whole prompt (no prefix-cache hit: those
            positions would have no logits), as vLLM does.
        structured: constrain the output to a JSON schema, any JSON object, a regex, a choice of strings or a
            grammar: a :class:`~.structured.StructuredOutput`, a dict naming one kind (``{"json_schema": {...}}``,
            vLLM's ``{"guided_regex": ...}``) or OpenAI's ``response_format`` (``{"type": "json_object"}``). Each
            sample's output is complete and valid when it finishes with ``finish_reason="stop"``; cut by
            ``max_new_tokens`` it finishes as ``"length"``. Needs the Engine's tokenizer; not with ``ignore_eos``
            or ``min_new_tokens`` (the output ends where the grammar does).

    Integer fields accept anything with ``__index__`` (numpy integers included) and are stored as ``int``;
    ``stop_token_ids``, ``allowed_token_ids`` (sorted, each id once) and ``stop_strings`` are stored as tuples.
    Every field is checked here; what depends on the model (token ids in its vocabulary, ``logprobs`` within
    ``max_logprobs``) is checked when the Engine takes the request.

    vLLM's names ``max_tokens``, ``min_tokens`` and ``stop`` are taken for ``max_new_tokens``, ``min_new_tokens``
    and ``stop_strings`` (one of each pair). Unlike vLLM's, ``temperature`` defaults to 0 (greedy, as
    ``generate``).

    Example:
        >>> SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=1).is_greedy
        False
        >>> SamplingParams(max_tokens=8, stop=["."]).max_new_tokens, SamplingParams(stop="x").stop_strings
        (8, ('x',))
        >>> SamplingParams(temperature=-1)
        Traceback (most recent call last):
        ...
        pagedcore.errors.InvalidRequestError: temperature must be >= 0, got -1
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] | None = None
    stop_strings: Sequence[str] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_new_tokens: int = 0
    n: int = 1
    return_logits: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] | None = None
    allowed_token_ids: Sequence[int] | None = None
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    needs_processing: bool = field(default=False, init=False, repr=False, compare=False)
    """Whether any per-row logits processor applies (set from the fields: the step checks this one flag)."""
    structured: StructuredOutput | Mapping[str, Any] | None = None
    token_tables: TokenTables | None = field(default=None, init=False, repr=False, compare=False)
    """``logit_bias`` and ``allowed_token_ids`` as tensors (None without either): made once, read by every step."""
    max_tokens: InitVar[int | None] = None
    """vLLM's name of ``max_new_tokens`` (:data:`VLLM_NAMES`), taken for it; not stored."""
    min_tokens: InitVar[int | None] = None
    """vLLM's name of ``min_new_tokens``, taken for it; not stored."""
    stop: InitVar[str | Sequence[str] | None] = None
    """vLLM's name of ``stop_strings``, taken for it; not stored."""

    def __post_init__(self, max_tokens: Any, min_tokens: Any, stop: Any) -> None:
        fix = object.__setattr__  # frozen: normalize once, here
        for theirs, value in (("max_tokens", max_tokens), ("min_tokens", min_tokens), ("stop", stop)):
            if value is not None:
                ours = VLLM_NAMES[theirs]
                if getattr(self, ours) not in (_FIELDS[ours].default, [], None):
                    raise InvalidRequestError(f"{theirs} and {ours} are the same field: give one", param=theirs)
                fix(self, ours, value)
        for name, minimum in (("max_new_tokens", 0), ("top_k", -1), ("min_new_tokens", 0), ("n", 1)):
            fix(self, name, integer(name, getattr(self, name), minimum=minimum))
        fix(self, "top_k", max(self.top_k, 0))  # -1 is vLLM's "all", as 0 is
        for name in ("seed", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                fix(self, name, integer(name, getattr(self, name), minimum=None if name == "seed" else -1))
        if self.stop_token_ids is not None:
            stop = token_ids(self.stop_token_ids, name="stop_token_ids", allow_empty=True, param="stop_token_ids")
            fix(self, "stop_token_ids", tuple(stop))
        fix(self, "stop_strings", _stop_strings(self.stop_strings))
        self._check_processors()
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise InvalidRequestError(f"temperature must be a number, got {self.temperature!r}", param="temperature")
        if not self.temperature >= 0 or math.isinf(self.temperature):  # also catches NaN
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}", param="temperature")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        for name in ("ignore_eos", "return_logits", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be True or False, got {getattr(self, name)!r}", param=name)
        if self.structured is not None:
            fix(self, "structured", _structured(self.structured, self.ignore_eos, self.min_new_tokens))

    def _check_processors(self) -> None:
        """The logits processors' fields: their ranges, normalized forms and the ``needs_processing`` flag."""
        fix = object.__setattr__
        fix(self, "presence_penalty", number("presence_penalty", self.presence_penalty, -2.0, 2.0))
        fix(self, "frequency_penalty", number("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        fix(
            self,
            "repetition_penalty",
            number("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True),
        )
        fix(self, "min_p", number("min_p", self.min_p, 0.0, 1.0))
        fix(self, "logit_bias", logit_bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = tuple(
                token_ids(self.allowed_token_ids, name="allowed_token_ids", allow_empty=True, param="allowed_token_ids")
            )
            if not allowed:  # every token masked: nothing could be drawn (vLLM refuses it too)
                raise InvalidRequestError(
                    "allowed_token_ids must not be empty (None allows every token)", param="allowed_token_ids"
                )
            fix(self, "allowed_token_ids", tuple(sorted(set(allowed))))  # at most the vocabulary: each step reads it
        processing = self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        fix(self, "needs_processing", bool(processing or self.logit_bias or self.allowed_token_ids))
        if self.logit_bias or self.allowed_token_ids:
            fix(self, "token_tables", TokenTables.of(self.bias_items, self.allowed_token_ids))

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> SamplingParams:
        """Parameters from a dict of fields, by this class's names or vLLM's (:data:`VLLM_NAMES`: ``max_tokens``,
        ``min_tokens``, ``stop``); refuses a field given under both names, and unknown fields, by name.

        Example:
            >>> SamplingParams.from_fields({"max_tokens": 5, "min_tokens": 2}).min_new_tokens
            2
            >>> SamplingParams.from_fields({"min_tokens": 2, "min_new_tokens": 3})
            Traceback (most recent call last):
            ...
            pagedcore.errors.InvalidRequestError: min_tokens and min_new_tokens are the same field: give one
        """
        renamed: dict[str, Any] = {}
        given: dict[str, str] = {}  # our name -> the name it came as
        for name, value in fields.items():
            ours = VLLM_NAMES.get(name, name)
            if ours in renamed:
                first, second = sorted((given[ours], name), key=lambda n: n in VLLM_NAMES, reverse=True)
                raise InvalidRequestError(f"{first} and {second} are the same field: give one", param=second)
            renamed[ours], given[ours] = value, name
        try:
            return cls(**renamed)
        except TypeError as exc:  # an unknown field
            raise InvalidRequestError(f"bad sampling parameters: {exc}") from exc

    @property
    def bias_items(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as stored: ``(token id, bias)`` pairs sorted by id (empty: none).

        Example:
            >>> SamplingParams(logit_bias={9: 1, 2: -3.5}).bias_items
            ((2, -3.5), (9, 1.0))
        """
        return cast(tuple[tuple[int, float], ...], self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        """Whether tokens are chosen by argmax (temperature 0, or below :data:`GREEDY_BELOW`).

        Example:
            >>> SamplingParams(temperature=1e-40).is_greedy, SamplingParams(temperature=0.5).is_greedy
            (True, False)
        """
        return self.temperature < GREEDY_BELOW

    def generators(self, device: torch.device | str = "cpu") -> list[torch.Generator]:
        """One generator per sample, seeded from ``seed`` (or at random): sample 0's is seeded with
        :func:`torch_seed` of it, as ``torch.manual_seed(seed)`` seeds torch's own; the others from that one's."""
        seed = torch_seed(self.seed) if self.seed is not None else random.getrandbits(63)
        first = torch.Generator(device=device)
        first.manual_seed(seed)
        out = [first]
        base = first.initial_seed()  # in [0, 2**64): what torch made of a negative seed
        for k in range(1, self.n):
            generator = torch.Generator(device=device)
            generator.manual_seed((base + _GOLDEN * k) % (2**63))
            out.append(generator)
        return out


def _structured(value: object, ignore_eos: bool, min_new_tokens: int) -> StructuredOutput | None:
    """A structured-output spec (None for OpenAI's ``{"type": "text"}``); refuses what cannot end where it ends."""
    try:
        if isinstance(value, Mapping) and "type" in value:  # OpenAI's response_format
            spec = StructuredOutput.from_response_format(value)
        else:
            spec = StructuredOutput.from_value(value)  # type: ignore[arg-type]
    except GrammarError as exc:
        exc.param = exc.param or "structured"
        raise
    if spec is not None and (ignore_eos or min_new_tokens):
        what = "ignore_eos=True" if ignore_eos else f"min_new_tokens={min_new_tokens}"
        raise GrammarError(
            f"structured outputs end where their grammar ends: {what} cannot be combined with them",
            param="ignore_eos" if ignore_eos else "min_new_tokens",
        )
    return spec


def torch_seed(seed: int) -> int:
    """What a request's ``seed`` (any Python int) gives ``torch.Generator.manual_seed``: the seed itself when torch
    takes it (``[-2**63, 2**64 - 1]``: vLLM's range, ``[-2**63, 2**63 - 1]``, and more; torch maps a negative seed to
    ``2**64 - 1 + seed``), else ``seed mod 2**64``, so every int seeds deterministically and a seed torch takes
    draws what ``torch.manual_seed(seed)`` draws.

    Example:
        >>> torch_seed(7), torch_seed(-1), torch_seed(2**64 + 7)
        (7, -1, 7)
    """
    low, high = _TORCH_SEEDS
    return seed if low <= seed <= high else seed % 2**64


MAX_STOP_CHARS = 65536
"""The most characters a request's stop strings have in all (matching costs the same whatever their number)."""


def _stop_strings(value: object) -> tuple[str, ...]:
    """Stop strings as a tuple (a str is one stop string, as in transformers); refuses empty or non-str ones."""
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else value
    if isinstance(items, (bytes, Mapping)) or not isinstance(items, Sequence):
        raise InvalidRequestError(
            f"stop_strings must be a string or a list of strings, got {value!r}", param="stop_strings"
        )
    bad = [s for s in items if not isinstance(s, str) or not s]
    if bad:
        raise InvalidRequestError(f"stop strings must be non-empty strings, got {bad[0]!r}", param="stop_strings")
    size = sum(map(len, items))
    if size > MAX_STOP_CHARS:  # the request's matcher holds a node per character (pagedcore.engine.stopping)
        raise InvalidRequestError(
            f"stop strings may have {MAX_STOP_CHARS} characters in all, got {len(items)} with {size}",
            param="stop_strings",
        )
    return tuple(items)


# ------------------------------------------------------------------------------------------------------ the sampler
def sample_tokens(logits: torch.Tensor, params: SamplingParams, generators: Sequence[torch.Generator]) -> list[int]:
    """Draw ``len(generators)`` tokens from one row of logits ``(vocab,)`` (float32 recommended), processed as
    :func:`sample_rows` processes a row (without a sequence: no penalties).

    Example:
        >>> sample_tokens(torch.tensor([0.1, 3.0, 0.2]), SamplingParams(), [torch.Generator()])
        [1]
    """
    out = sample_rows(logits.float()[None, :].clone(), [SampleRow("row", params, list(generators))])
    if "row" in out.failed:
        raise FloatingPointError(out.failed["row"])
    return out.tokens["row"]


_FIELDS = {f.name: f for f in fields(SamplingParams)}  # their defaults: what a vLLM name may replace


@dataclass(slots=True)
class SampleRow:
    """One row of a step's logits to draw tokens from: a sequence that has computed all its known tokens.

    Attributes:
        request_id: the sequence (a parallel sample has its own id).
        params: its request's parameters.
        generators: one per token to draw (all the samples' at the step that forks a request, else one).
        suppress: token ids that may not be drawn yet (the stop tokens, before ``min_new_tokens``).
        sequence: the sequence itself (its tokens so far: what the penalties read).
        grammar: the grammar state the row's next token must follow (structured outputs), or None.
        argmax_only: (set from the others) the row's token is its raw logits' argmax and nothing else reads them:
            greedy, no log-probabilities, no returned logits, no processor, nothing suppressed, no grammar.

    Example:
        >>> SampleRow("r1", SamplingParams(), [torch.Generator()]).suppress
        ()
        >>> SampleRow("r1", SamplingParams(), [torch.Generator()]).argmax_only, SampleRow("r2", SamplingParams(
        ...     logprobs=0), [torch.Generator()]).argmax_only
        (True, False)
    """

    request_id: str
    params: SamplingParams
    generators: list[torch.Generator]
    suppress: tuple[int, ...] = ()
    sequence: SequenceState | None = None
    grammar: GrammarState | None = None
    argmax_only: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        params = self.params
        self.argmax_only = (
            params.is_greedy
            and not params.needs_processing
            and params.logprobs is None
            and not params.return_logits
            and not self.suppress
            and self.grammar is None
        )


@dataclass
class StepSamples:
    """What :func:`sample_rows` drew: the boundary between the step's sampler (which runs without the Engine's lock)
    and its record stage.

    Attributes:
        tokens: per sequence id, the tokens drawn.
        failed: per sequence id, why no token could be drawn (e.g. no finite logit, or the forward failed).
        logits: per sequence id, its float32 logits row (only for requests with ``return_logits``).
        logprobs: per sequence id, one :class:`~.outputs.TokenLogprobs` per token drawn (requests with
            ``logprobs``).
        prompt_logprobs: per request id, the index of the first prompt token computed in this step and the
            :class:`~.outputs.TokenLogprobs` of that token and the ones after it (requests with ``prompt_logprobs``).

    Example:
        >>> StepSamples().tokens
        {}
    """

    tokens: dict[str, list[int]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    client_errors: set[str] = field(default_factory=set)  # failed by the request's own doing (its masks, grammar)
    logits: dict[str, torch.Tensor] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


def sample_rows(logits: torch.Tensor, rows: Sequence[SampleRow], masks: GrammarMasks | None = None) -> StepSamples:
    """Draw the tokens of a whole step: ``logits`` is ``(len(rows), vocab)``, one row per :class:`SampleRow` (the
    step's own tensor: it is processed in place).

    The stages of the module docstring: the raw logits and log-probabilities that were asked for, per-row
    processing (:func:`~.logits_processors.process_rows`), then greedy rows share one batched argmax and random
    rows one batched warp before each draws from its own generator; a row that cannot be sampled (no finite logit)
    fails alone. Between the processing and the draws, :func:`constrain_rows` masks the rows that follow a grammar
    (structured outputs) with ``masks``: every draw sees the masks (the raw log-probabilities do not).

    Example:
        >>> rows = [SampleRow("a", SamplingParams(), [torch.Generator()]),
        ...         SampleRow("b", SamplingParams(logprobs=1), [torch.Generator()], suppress=(1,))]
        >>> out = sample_rows(torch.tensor([[0.0, 2.0, 1.0], [0.0, 2.0, 1.0]]), rows)
        >>> out.tokens, out.logprobs["b"][0].token.rank, [t.token_id for t in out.logprobs["b"][0].top]
        ({'a': [1], 'b': [2]}, 2, [1])
    """
    out = StepSamples()
    if not rows:
        return out
    for i in [i for i, row in enumerate(rows) if row.params.return_logits]:
        out.logits[rows[i].request_id] = logits[i].detach().cpu().clone()  # before any processing
    asking = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    with torch.inference_mode():  # the forward's logits are inference tensors: processed in place in this mode
        raw = torch.log_softmax(logits[asking], dim=-1) if asking else None  # vLLM's raw_logprobs
        logits = process_rows(logits, rows)
        if masks is not None:
            grammar_failed = constrain_rows(logits, rows, masks)
            out.failed.update(grammar_failed)
            out.client_errors.update(grammar_failed)
        greedy, finite = greedy_tokens(logits)
        tokens = out.tokens
        drawing: list[int] = []
        for i, row in enumerate(rows):
            if row.request_id in out.failed:
                continue
            if not finite[i] and (row.params.allowed_token_ids or row.grammar is not None):
                out.failed[row.request_id] = (  # the request's own masks left nothing: its error, not the server's
                    "InvalidRequestError: no token is left to draw: this request's allowed_token_ids and structured "
                    "output exclude every token"
                )
                out.client_errors.add(row.request_id)
            elif not finite[i]:
                out.failed[row.request_id] = "FloatingPointError: the model produced no finite logit for this sequence"
            elif row.params.is_greedy:
                tokens[row.request_id] = [greedy[i]] * len(row.generators)
            else:
                drawing.append(i)
        if drawing:
            _draw(logits, rows, drawing, out)
        if raw is not None:
            _logprobs(raw, [rows[i] for i in asking], out)
    return out


def argmax_samples(rows: Sequence[SampleRow], tokens: Sequence[int]) -> StepSamples:
    """The samples of a step whose rows are all :attr:`~SampleRow.argmax_only`, from their argmax ``tokens`` (the
    runner's :class:`~.runner.ArgmaxTokens`): what :func:`sample_rows` gives for those rows' logits.

    Example:
        >>> rows = [SampleRow("a", SamplingParams(), [torch.Generator()]),
        ...         SampleRow("b", SamplingParams(n=2), [torch.Generator(), torch.Generator()])]
        >>> argmax_samples(rows, [7, 3]).tokens
        {'a': [7], 'b': [3, 3]}
    """
    return StepSamples({row.request_id: [token] * len(row.generators) for row, token in zip(rows, tokens, strict=True)})


def _draw(logits: torch.Tensor, rows: Sequence[SampleRow], drawing: list[int], out: StepSamples) -> None:
    """The random rows' draws: one batched warp, then each row's generators (a row whose draw fails fails alone)."""
    index = torch.tensor(drawing, device=logits.device)
    probs = warp_rows(logits.index_select(0, index), [rows[i].params for i in drawing])
    for j, i in enumerate(drawing):
        row = rows[i]
        try:
            out.tokens[row.request_id] = [int(torch.multinomial(probs[j], 1, generator=g)) for g in row.generators]
        except RuntimeError as exc:  # e.g. NaN logits: "probability tensor contains inf, nan or element < 0"
            out.failed[row.request_id] = f"{type(exc).__name__}: {exc}"


def _logprobs(raw: torch.Tensor, rows: Sequence[SampleRow], out: StepSamples) -> None:
    """The drawn tokens' log-probabilities, for the rows that asked (``raw``: their ``log_softmax``, in order)."""
    vocab = raw.shape[-1]
    drawn = [(j, row) for j, row in enumerate(rows) if row.request_id in out.tokens]
    if not drawn:
        return
    picked = raw if len(drawn) == len(rows) else raw[[j for j, _ in drawn]]
    ks = [vocab if row.params.logprobs == -1 else min(row.params.logprobs or 0, vocab) for _, row in drawn]
    found = sample_logprobs(picked, ks, [out.tokens[row.request_id] for _, row in drawn])
    for (_, row), entries in zip(drawn, found):
        out.logprobs[row.request_id] = entries


def constrain_rows(logits: torch.Tensor, rows: Sequence[SampleRow], masks: GrammarMasks | None) -> dict[str, str]:
    """Mask, in place, the rows that follow a grammar (``row.grammar``): one batched fill and one apply for all of
    them (:class:`~.structured.GrammarMasks`); the other rows are not touched. Returns the rows whose grammar failed
    (a limit of the grammar engine exceeded), by sequence id, with why.

    Example:
        >>> constrain_rows(torch.zeros(1, 3), [SampleRow("a", SamplingParams(), [torch.Generator()])], None)
        {}
    """
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
    states = [state for state in (row.grammar for row in rows) if state is not None]
    if not constrained or masks is None:
        return {}
    with torch.inference_mode():  # the forward's logits are inference tensors: changed in place only in this mode
        masks.apply(logits, constrained, states)
    return {rows[i].request_id: f"GrammarError: {state.error}" for i, state in zip(constrained, states) if state.error}


_BLOCK = 256  # columns per block of greedy_tokens' two-level search (logits numpy cannot read)
_NUMPY_DTYPES = (torch.float32, torch.float64)  # the logits numpy's vectorized argmax reads in place


def greedy_tokens(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Per row of ``logits (rows, vocab)``: ``torch.argmax`` (the first maximal index) and whether the row has any
    finite value; the same answers as ``argmax(-1)`` and ``isfinite(logits).any(-1)``, several times faster on CPU.

    ``torch.argmax`` and ``isfinite`` are scalar loops on CPU. Float32 and float64 logits on the CPU (a model's
    usual logits) are read in place by numpy's ``argmax``, one vectorized pass that returns the first maximal
    index too; the value at that index says whether the row is finite. Other logits (half precision, another device)
    take ``amax`` over blocks of 256 columns, then only the first block holding the maximum is searched (one
    ``gather`` of a block per row, then ``argmax`` over 256 columns). Right after a forward has streamed the weights
    through the caches each distinct op costs tens of microseconds, so both are kept to the fewest ops (numpy's three
    calls: 0.16 ms at one row of 32000 against the blocks' 0.29 ms, ``scripts/greedy_bench.py``).

    A row whose maximum is not finite (a NaN anywhere, which both numpy and torch take as the maximum, an infinity,
    or no finite value at all) takes the two reference ops on that row alone.

    Example:
        >>> greedy_tokens(torch.tensor([[0.0, 2.0, 2.0], [float("nan"), 1.0, 0.0], [float("-inf")] * 3]))
        ([1, 0, 0], [True, True, False])
    """
    rows, vocab = logits.shape
    if rows == 0:
        return [], []
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES:
        tokens, finite = numpy_greedy(logits)
    elif vocab < _BLOCK:  # a vocabulary under one block: the reference ops are cheap
        return logits.argmax(dim=-1).tolist(), torch.isfinite(logits).any(dim=-1).tolist()
    else:
        tokens, finite = _block_greedy(logits)
    for i, ok in enumerate(finite):
        if not ok:  # NaN (the maximum of both searches, equal to nothing) or an infinite maximum: the reference ops
            tokens[i] = int(logits[i].argmax())
            finite[i] = bool(torch.isfinite(logits[i]).any())
    return tokens, finite


def numpy_greedy(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """The first maximal index per row of float32 / float64 CPU ``logits (rows, vocab)`` (numpy's ``argmax`` over the
    tensor's own memory, any strides) and whether that maximum is finite: :func:`greedy_tokens`' one pass, before
    its rules for the rows whose maximum is not (the fused head's whole-GEMM way takes it too).

    Example:
        >>> numpy_greedy(torch.tensor([[0.0, 2.0, 2.0], [float("nan"), 1.0, 0.0]]))
        ([1, 0], [True, False])
    """
    values = logits.detach().numpy()
    tokens = values.argmax(axis=1)
    maxima = values[np.arange(values.shape[0]), tokens]
    return tokens.tolist(), np.isfinite(maxima).tolist()


def _block_greedy(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """The first maximal index per row from block maxima (at least one whole block of columns), and whether the
    row's maximum is finite."""
    rows, vocab = logits.shape
    count = vocab // _BLOCK  # whole blocks
    logits = logits.contiguous()  # a no-op for the step's logits
    whole = count * _BLOCK
    blocks = logits[:, :whole].view(rows, count, _BLOCK)
    block_max = blocks.amax(dim=-1)  # (rows, whole blocks)
    if whole < vocab:
        block_max = torch.cat([block_max, logits[:, whole:].amax(dim=-1, keepdim=True)], dim=1)
    row_max, first_block = block_max.max(dim=-1)  # a small tensor: the first block holding each row's maximum
    searched = first_block.clamp(max=count - 1) if whole < vocab else first_block
    picked = blocks.gather(1, searched.view(rows, 1, 1).expand(rows, 1, _BLOCK)).view(rows, _BLOCK)
    tokens = (first_block * _BLOCK + picked.argmax(dim=-1)).tolist()  # equal maxima: argmax takes the first
    finite = [math.isfinite(m) for m in row_max.tolist()]
    if whole < vocab:  # rows whose maximum is first met in the last, partial block
        for i, token in enumerate(tokens):
            if token >= whole:
                tokens[i] = whole + int(logits[i, whole:].argmax())
    return tokens, finite
