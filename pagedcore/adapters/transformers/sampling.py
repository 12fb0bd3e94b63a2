"""Per-request sampling parameters, their translation from transformers' ``generate`` arguments, and the sampler.

Each sample of each request owns a ``torch.Generator`` seeded from its request's seed, so a seeded request draws
the same tokens whatever else is in the batch, and a recomputed (preempted) request does not draw again. Sample 0
of a request seeded with ``s`` draws exactly what ``torch.manual_seed(s); model.generate(...)`` draws for that
prompt alone.

Callers who think in transformers' terms pass ``generate``'s keyword arguments (``max_new_tokens``, ``do_sample``,
``temperature``, ``top_k``, ``top_p``, ``num_return_sequences``, ``eos_token_id``, ``min_new_tokens``,
``generation_config=``); :func:`merge_generation_config` combines them with the model's ``generation_config`` the
way ``model.generate`` does, and :func:`to_sampling_params` turns the result into :class:`SamplingParams`.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig

from pagedcore.errors import GrammarError, InvalidRequestError
from pagedcore.sequence import SequenceState
from pagedcore.validation import integer, token_ids

from .structured.spec import StructuredOutput

if TYPE_CHECKING:
    from .structured.masks import GrammarMasks
    from .structured.matcher import GrammarState

__all__ = [
    "GENERATE_KWARGS",
    "GREEDY_BELOW",
    "SampleRow",
    "SamplingParams",
    "StepSamples",
    "constrain_rows",
    "greedy_tokens",
    "merge_generation_config",
    "process_rows",
    "sample_rows",
    "sample_tokens",
    "to_sampling_params",
]


GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy (vLLM's threshold too): dividing logits by a temperature near 0 overflows
float32 (``1e-40``, ``1e-300``) and the draw would fail, while its limit is the argmax anyway."""


@dataclass(frozen=True)
class SamplingParams:
    """How to generate for one request.

    Args:
        max_new_tokens: tokens to generate at most (0 returns at once with no tokens).
        temperature: 0 for greedy decoding, else the softmax temperature (> 0); below :data:`GREEDY_BELOW` it is
            greedy too.
        top_k: keep the ``top_k`` most likely tokens (0 = all).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p`` (in (0, 1]).
        seed: seed of this request's random draws (None: drawn from Python's ``random``).
        stop_token_ids: stop after any of these; None means the model's eos token ids.
        stop_strings: stop when the text contains one of these (a string or a list; needs the Engine's tokenizer).
            The token that completes it is the sample's last; the text ends before the stop string, and the sample
            reports ``finish_reason="stop"`` and ``stop_reason`` (the string). A stop string that is a special
            token's text (``"<|im_end|>"``) matches by token id, as that text is not in the decoded text.
        include_stop_str_in_output: keep the stop string at the end of the text.
        ignore_eos: never stop at the stop tokens (benchmarks); stop strings still apply.
        min_new_tokens: nothing stops a sample before this many tokens were generated: the stop tokens are masked
            (as transformers' ``min_new_tokens`` does), and stop strings are not matched (as vLLM's ``min_tokens``).
        n: parallel samples of the prompt; they share the prompt's KV blocks.
        return_logits: keep each step's float32 logits in the output, before any masking (for tests and analysis;
            memory grows with ``vocab * tokens``).
        structured: constrain the output to a JSON schema, any JSON object, a regex, a choice of strings or a
            grammar: a :class:`~.structured.StructuredOutput`, a dict naming one kind (``{"json_schema": {...}}``,
            vLLM's ``{"guided_regex": ...}``) or OpenAI's ``response_format`` (``{"type": "json_object"}``). Each
            sample's output is complete and valid when it finishes with ``finish_reason="stop"``; cut by
            ``max_new_tokens`` it finishes as ``"length"``. Needs the Engine's tokenizer; not with ``ignore_eos``
            or ``min_new_tokens`` (the output ends where the grammar does).

    Integer fields accept anything with ``__index__`` (numpy integers included) and are stored as ``int``;
    ``stop_token_ids`` and ``stop_strings`` are stored as tuples.

    Example:
        >>> SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=1).is_greedy
        False
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
    structured: StructuredOutput | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        fix = object.__setattr__  # frozen: normalize once, here
        for name, minimum in (("max_new_tokens", 0), ("top_k", 0), ("min_new_tokens", 0), ("n", 1)):
            fix(self, name, integer(name, getattr(self, name), minimum=minimum))
        if self.seed is not None:
            fix(self, "seed", integer("seed", self.seed))
        if self.stop_token_ids is not None:
            fix(self, "stop_token_ids", tuple(token_ids(self.stop_token_ids, name="stop_token_ids", allow_empty=True)))
        fix(self, "stop_strings", _stop_strings(self.stop_strings))
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise InvalidRequestError(f"temperature must be a number, got {self.temperature!r}")
        if not self.temperature >= 0 or math.isinf(self.temperature):  # also catches NaN
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        for name in ("ignore_eos", "return_logits", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.structured is not None:
            fix(self, "structured", _structured(self.structured, self.ignore_eos, self.min_new_tokens))

    @property
    def is_greedy(self) -> bool:
        """Whether tokens are chosen by argmax (temperature 0, or below :data:`GREEDY_BELOW`).

        Example:
            >>> SamplingParams(temperature=1e-40).is_greedy, SamplingParams(temperature=0.5).is_greedy
            (True, False)
        """
        return self.temperature < GREEDY_BELOW

    def generators(self, device: torch.device | str = "cpu") -> list[torch.Generator]:
        """One generator per sample, seeded from ``seed`` (or at random); sample 0's seed is ``seed`` itself."""
        seed = self.seed if self.seed is not None else random.getrandbits(63)
        out = []
        for k in range(self.n):
            generator = torch.Generator(device=device)
            generator.manual_seed((seed + 0x9E3779B97F4A7C15 * k) % (2**63))
            out.append(generator)
        return out


def _structured(value: object, ignore_eos: bool, min_new_tokens: int) -> StructuredOutput | None:
    """A structured-output spec (None for OpenAI's ``{"type": "text"}``); refuses what cannot end where it ends."""
    if isinstance(value, Mapping) and "type" in value:  # OpenAI's response_format
        spec = StructuredOutput.from_response_format(value)
    else:
        spec = StructuredOutput.from_value(value)  # type: ignore[arg-type]
    if spec is not None and (ignore_eos or min_new_tokens):
        what = "ignore_eos=True" if ignore_eos else f"min_new_tokens={min_new_tokens}"
        raise GrammarError(f"structured outputs end where their grammar ends: {what} cannot be combined with them")
    return spec


def _stop_strings(value: object) -> tuple[str, ...]:
    """Stop strings as a tuple (a str is one stop string, as in transformers); refuses empty or non-str ones."""
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else value
    if isinstance(items, (bytes, Mapping)) or not isinstance(items, Sequence):
        raise InvalidRequestError(f"stop_strings must be a string or a list of strings, got {value!r}")
    bad = [s for s in items if not isinstance(s, str) or not s]
    if bad:
        raise InvalidRequestError(f"stop strings must be non-empty strings, got {bad[0]!r}")
    return tuple(items)


# ---------------------------------------------------------------------------------------------- transformers' words
GENERATE_KWARGS = frozenset(
    {
        "max_new_tokens",
        "max_length",
        "min_new_tokens",
        "min_length",
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "num_return_sequences",
        "eos_token_id",
        "stop_strings",  # matched on the Engine's tokenizer's text (transformers needs generate(tokenizer=) for them)
        "pad_token_id",  # no effect: the Engine never pads
        "bos_token_id",  # no effect: the prompt is used as given
        "generation_config",
        "seed",  # not a transformers argument: the seed of the request's draws (transformers uses the global RNG)
    }
)
"""``generate`` keyword arguments the Engine accepts (and the options it does not implement, at their neutral value,
e.g. ``num_beams=1``)."""

# transformers' defaults for what is still unset after the model's generation_config (5.x:
# ``GenerationConfig._get_default_generation_params``); only the fields the translation reads.
_DEFAULTS: dict[str, Any] = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
_DEFAULT_MAX_NEW_TOKENS = 20  # transformers generates 20 new tokens when no length is set anywhere

# Options the Engine does not implement, with the values at which they do nothing (None always does nothing).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "num_beams": (1,),
    "num_beam_groups": (1,),
    "penalty_alpha": (),
    "diversity_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "encoder_repetition_penalty": (1.0,),
    "no_repeat_ngram_size": (0,),
    "encoder_no_repeat_ngram_size": (0,),
    "bad_words_ids": (),
    "force_words_ids": (),
    "constraints": (),
    "suppress_tokens": (),
    "begin_suppress_tokens": (),
    "forced_bos_token_id": (),
    "forced_eos_token_id": (),
    "sequence_bias": (),
    "min_p": (),
    "top_h": (),
    "typical_p": (1.0,),
    "epsilon_cutoff": (0.0,),
    "eta_cutoff": (0.0,),
    "exponential_decay_length_penalty": (),
    "guidance_scale": (1.0,),
    "max_time": (),
    "renormalize_logits": (False,),
    "remove_invalid_values": (False,),
    "token_healing": (False,),
    "watermarking_config": (),
    "dola_layers": (),
    "prompt_lookup_num_tokens": (),
    "use_mtp": (False,),
    "use_cache": (True,),
    "output_scores": (False,),
    "output_logits": (False,),
    "output_attentions": (False,),
    "output_hidden_states": (False,),
    "return_dict_in_generate": (False,),
    "low_memory": (False,),
}


def merge_generation_config(
    model_config: GenerationConfig | None, kwargs: Mapping[str, Any]
) -> tuple[GenerationConfig, int | None]:
    """Combine ``generate`` keyword arguments with the model's ``generation_config`` as ``model.generate`` does.

    Priority: the keyword arguments, then ``generation_config=`` (a ``GenerationConfig``), then the model's
    ``generation_config``, then transformers' defaults. Returns the merged config (a copy: nothing passed in is
    modified) and the ``seed`` argument. Raises :class:`~pagedcore.errors.InvalidRequestError` naming any unknown
    argument, any option the Engine does not implement set to a value that would change the output (e.g.
    ``num_beams=4``, also when it comes from the model's config), and any value that cannot give a request
    whatever the prompt (e.g. ``max_new_tokens=0``, ``do_sample=True`` with ``temperature=0``).

    Example:
        >>> config, seed = merge_generation_config(GenerationConfig(temperature=0.7), {"do_sample": True, "seed": 3})
        >>> config.do_sample, config.temperature, config.top_k, seed
        (True, 0.7, 50, 3)
        >>> merge_generation_config(None, {"num_beams": 4})
        Traceback (most recent call last):
        ...
        pagedcore.errors.InvalidRequestError: num_beams=4 (an argument) is not supported by the Engine: ...
    """
    kwargs = dict(kwargs)
    seed = kwargs.pop("seed", None)
    if seed is not None:
        seed = integer("seed", seed)
    user_config = kwargs.pop("generation_config", None)
    if user_config is not None and not isinstance(user_config, GenerationConfig):
        raise InvalidRequestError(f"generation_config must be a transformers GenerationConfig, got {user_config!r}")
    unknown = sorted(k for k in kwargs if k not in GENERATE_KWARGS and k not in _NEUTRAL)
    if unknown:
        raise InvalidRequestError(
            f"unknown or unsupported generate() arguments for the Engine: {', '.join(unknown)} (it accepts "
            f"{', '.join(sorted(GENERATE_KWARGS))}, or SamplingParams)"
        )
    config = copy.deepcopy(user_config) if user_config is not None else GenerationConfig()
    try:
        if model_config is not None:
            config.update(**model_config.to_dict(), defaults_only=True)
        config.update(**_DEFAULTS, defaults_only=True)
        config.update(**kwargs)  # last, as in transformers: an explicit None unsets an option
    except (ValueError, TypeError) as exc:  # transformers' own validation of the values
        raise InvalidRequestError(f"bad generation arguments: {exc}") from exc
    for name, neutral in _NEUTRAL.items():
        value = getattr(config, name, None)
        if not _is_neutral(value, neutral):
            where = (
                "an argument"
                if name in kwargs
                else "from generation_config"
                if user_config is not None and getattr(user_config, name, None) is not None
                else "from the model's generation_config"
            )
            raise InvalidRequestError(
                f"{name}={value!r} ({where}) is not supported by the Engine: "
                f"use {' or '.join(repr(v) for v in (*neutral, None)[:2])}, or model.generate"
            )
    to_sampling_params(config, prompt_length=0, seed=seed)  # everything that does not depend on the prompt
    return config, seed


def _is_neutral(value: object, neutral: tuple[Any, ...]) -> bool:
    return value is None or any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral)


def to_sampling_params(
    config: GenerationConfig, *, prompt_length: int, max_positions: int | None = None, seed: int | None = None
) -> SamplingParams:
    """Translate a (merged, see :func:`merge_generation_config`) ``GenerationConfig`` for one prompt.

    ``do_sample=False`` is greedy whatever the temperature says; with ``do_sample=True`` the temperature, top-k
    and top-p apply as transformers applies them. ``max_new_tokens`` wins over ``max_length`` (a total length,
    prompt included); with neither, 20 new tokens, within ``max_positions``. ``eos_token_id`` (None: none) gives
    the stop tokens, ``stop_strings`` the stop strings, and ``min_new_tokens`` (or ``min_length``) holds them off at
    first.

    An option left None does nothing (no top-k, no top-p, temperature 1).

    Example:
        >>> params = to_sampling_params(GenerationConfig(max_length=12, eos_token_id=2), prompt_length=5)
        >>> params.max_new_tokens, params.is_greedy, params.stop_token_ids
        (7, True, (2,))
    """
    do_sample = bool(config.do_sample) if config.do_sample in (None, True, False) else config.do_sample
    if not isinstance(do_sample, bool):
        raise InvalidRequestError(f"do_sample must be True or False, got {do_sample!r}")
    n = config.num_return_sequences
    n = 1 if n is None else integer("num_return_sequences", n, minimum=1)
    if n > 1 and not do_sample:
        raise InvalidRequestError(
            f"num_return_sequences={n} needs do_sample=True: greedy decoding has one answer (transformers "
            "refuses it too)"
        )
    max_new_tokens, min_new_tokens = _lengths(config, prompt_length, max_positions)
    eos = config.eos_token_id
    stop: tuple[int, ...] = ()
    if eos is not None:
        stop = tuple(token_ids([eos] if isinstance(eos, int) else eos, name="eos_token_id", allow_empty=True))
    fields: dict[str, Any] = {}
    if do_sample:
        temperature = config.temperature if config.temperature is not None else 1.0
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature <= 0:
            raise InvalidRequestError(
                f"temperature={temperature!r} with do_sample=True: it must be > 0 (for greedy decoding, "
                "do_sample=False)"
            )
        top_k = config.top_k if config.top_k is not None else 0
        top_p = config.top_p if config.top_p is not None else 1.0
        fields = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        stop_token_ids=stop,
        stop_strings=config.stop_strings,
        n=n,
        seed=seed,
        **fields,
    )


def _lengths(config: GenerationConfig, prompt_length: int, max_positions: int | None) -> tuple[int, int]:
    """``max_new_tokens`` (over ``max_length``, a total; else 20 within the context) and ``min_new_tokens`` (over
    ``min_length``) for a prompt of ``prompt_length`` tokens."""
    if config.max_new_tokens is not None:
        max_new_tokens = config.max_new_tokens
    elif config.max_length is not None:
        max_new_tokens = config.max_length - prompt_length
        if max_new_tokens <= 0:
            raise InvalidRequestError(
                f"the prompt has {prompt_length} tokens but max_length={config.max_length} counts the prompt too: "
                "set max_new_tokens instead"
            )
    else:
        max_new_tokens = _DEFAULT_MAX_NEW_TOKENS
        if max_positions is not None:
            max_new_tokens = min(max_new_tokens, max_positions - prompt_length)
    if config.min_new_tokens is not None:
        min_new_tokens = config.min_new_tokens
    else:
        min_new_tokens = max(0, (config.min_length or 0) - prompt_length)
    return max_new_tokens, min_new_tokens


# ------------------------------------------------------------------------------------------------------ the sampler
def sample_tokens(logits: torch.Tensor, params: SamplingParams, generators: Sequence[torch.Generator]) -> list[int]:
    """Draw ``len(generators)`` tokens from one row of logits ``(vocab,)`` (float32 recommended).

    Example:
        >>> sample_tokens(torch.tensor([0.1, 3.0, 0.2]), SamplingParams(), [torch.Generator()])
        [1]
    """
    if not bool(torch.isfinite(logits).any()):
        raise FloatingPointError("the model produced no finite logit for this sequence")
    if params.is_greedy:
        token = int(torch.argmax(logits))
        return [token] * len(generators)
    scores = logits.float() / params.temperature  # >= GREEDY_BELOW: no real logit overflows float32 here
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token when the tokens before it already reach top_p. The most likely one always stays, also when
        # top_p is below float32's smallest number (1e-320 reads as 0 there, and 0 >= 0 would drop it).
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        drop[0] = False
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    return [int(torch.multinomial(probs, 1, generator=g)) for g in generators]


@dataclass(slots=True)
class SampleRow:
    """One row of a step's logits to draw tokens from: a sequence that has computed all its known tokens.

    Attributes:
        request_id: the sequence (a parallel sample has its own id).
        params: its request's parameters.
        generators: one per token to draw (all the samples' at the step that forks a request, else one).
        suppress: token ids that may not be drawn yet (the stop tokens, before ``min_new_tokens``).
        sequence: the sequence itself (what a logits processor that reads the tokens so far would read).
        grammar: the grammar state the row's next token must follow (structured outputs), or None.

    Example:
        >>> SampleRow("r1", SamplingParams(), [torch.Generator()]).suppress
        ()
    """

    request_id: str
    params: SamplingParams
    generators: list[torch.Generator]
    suppress: tuple[int, ...] = ()
    sequence: SequenceState | None = None
    grammar: GrammarState | None = None


@dataclass
class StepSamples:
    """What :func:`sample_rows` drew: the boundary between the step's sampler (which runs without the Engine's lock)
    and its record stage.

    Attributes:
        tokens: per sequence id, the tokens drawn.
        failed: per sequence id, why no token could be drawn (e.g. no finite logit, or the forward failed).
        logits: per sequence id, its float32 logits row (only for requests with ``return_logits``).

    Example:
        >>> StepSamples().tokens
        {}
    """

    tokens: dict[str, list[int]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    logits: dict[str, torch.Tensor] = field(default_factory=dict)


def sample_rows(logits: torch.Tensor, rows: Sequence[SampleRow], masks: GrammarMasks | None = None) -> StepSamples:
    """Draw the tokens of a whole step: ``logits`` is ``(len(rows), vocab)``, one row per :class:`SampleRow`.

    Three stages: keep the raw logits that were asked for, process each row's logits (:func:`process_rows`: where
    per-row logits processors go; then :func:`constrain_rows`, the grammars of structured outputs, with ``masks``),
    then draw (greedy rows share one batched argmax; a row that cannot be sampled fails alone). Whatever is drawn
    or reported from the logits after that (log-probabilities included) sees the masks: a token a grammar forbids
    has probability 0.

    Example:
        >>> rows = [SampleRow("a", SamplingParams(), [torch.Generator()]),
        ...         SampleRow("b", SamplingParams(), [torch.Generator()], suppress=(1,))]
        >>> sample_rows(torch.tensor([[0.0, 2.0, 1.0], [0.0, 2.0, 1.0]]), rows).tokens
        {'a': [1], 'b': [2]}
    """
    out = StepSamples()
    if not rows:
        return out
    for i in [i for i, row in enumerate(rows) if row.params.return_logits]:
        out.logits[rows[i].request_id] = logits[i].detach().cpu().clone()  # before any processing
    logits = process_rows(logits, rows)
    if masks is not None:
        out.failed.update(constrain_rows(logits, rows, masks))
    greedy, finite = greedy_tokens(logits)
    tokens = out.tokens
    for i, row in enumerate(rows):
        if row.request_id in out.failed:
            continue
        if row.params.is_greedy and finite[i]:
            tokens[row.request_id] = [greedy[i]] * len(row.generators)
            continue
        try:
            tokens[row.request_id] = sample_tokens(logits[i], row.params, row.generators)
        except Exception as exc:  # one row's failure (e.g. no finite logit) fails that sequence only
            out.failed[row.request_id] = f"{type(exc).__name__}: {exc}"
    return out


def process_rows(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Each row's logits as its request's processors leave them (a copy when any row changes; ``logits`` itself
    otherwise). Today one processor: the tokens a row may not draw yet (``suppress``) get ``-inf``.

    Example:
        >>> rows = [SampleRow("a", SamplingParams(), [torch.Generator()], suppress=(0,))]
        >>> process_rows(torch.tensor([[1.0, 0.5]]), rows).tolist()
        [[-inf, 0.5]]
    """
    masked = [(i, row.suppress) for i, row in enumerate(rows) if row.suppress]
    if not masked:
        return logits
    logits = logits.clone()
    for i, ids in masked:
        logits[i, list(ids)] = float("-inf")
    return logits


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


_BLOCK = 256  # columns per block of greedy_tokens' two-level search


def greedy_tokens(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Per row of ``logits (rows, vocab)``: ``torch.argmax`` (the first maximal index) and whether the row has any
    finite value; the same answers as ``argmax(-1)`` and ``isfinite(logits).any(-1)``, about ten times faster on CPU.

    ``argmax`` and ``isfinite`` are scalar loops on CPU while ``amax`` is vectorized: the row maxima come from
    ``amax`` over blocks of 256 columns, then only the first block holding the maximum is searched. A row whose
    maximum is not finite (a NaN or an infinity somewhere) takes the two reference ops on that row alone.

    Example:
        >>> greedy_tokens(torch.tensor([[0.0, 2.0, 2.0], [float("nan"), 1.0, 0.0], [float("-inf")] * 3]))
        ([1, 0, 0], [True, True, False])
    """
    rows, vocab = logits.shape
    if rows == 0:
        return [], []
    whole = vocab // _BLOCK * _BLOCK
    block_max = logits[:, :whole].reshape(rows, -1, _BLOCK).amax(dim=-1)  # (rows, whole blocks)
    if whole < vocab:
        block_max = torch.cat([block_max, logits[:, whole:].amax(dim=-1, keepdim=True)], dim=1)
    row_max = block_max.amax(dim=-1, keepdim=True)
    first_block = (block_max == row_max).to(torch.uint8).argmax(dim=-1)  # a small tensor: cheap
    starts = first_block * _BLOCK
    columns = (starts[:, None] + torch.arange(_BLOCK, device=logits.device)[None, :]).clamp(max=vocab - 1)
    within = (logits.gather(1, columns) == row_max).to(torch.uint8).argmax(dim=-1)
    tokens = (starts + within).tolist()
    finite = torch.isfinite(row_max[:, 0]).tolist()
    for i, ok in enumerate(finite):
        if not ok:  # NaN (propagated by amax, equal to nothing) or an infinite maximum: the reference ops
            tokens[i] = int(logits[i].argmax())
            finite[i] = bool(torch.isfinite(logits[i]).any())
    return tokens, finite
