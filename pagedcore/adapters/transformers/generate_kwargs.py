"""``model.generate``'s keyword arguments as the Engine's :class:`~pagedcore.engine.sampling.SamplingParams`.

Callers who think in transformers' terms pass ``generate``'s keyword arguments (``max_new_tokens``, ``do_sample``,
``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, ``sequence_bias``, ``num_return_sequences``,
``eos_token_id``, ``min_new_tokens``, ``output_logits``, ``generation_config=``); :func:`merge_generation_config`
combines them with the model's ``generation_config`` the way ``model.generate`` does, and
:func:`to_sampling_params` turns the result into :class:`~pagedcore.engine.sampling.SamplingParams` for one prompt.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from transformers import GenerationConfig

from pagedcore.engine.admission import structured_kwarg
from pagedcore.engine.sampling import SamplingParams
from pagedcore.engine.structured.spec import StructuredOutput
from pagedcore.errors import InvalidRequestError
from pagedcore.validation import integer, token_ids

__all__ = [
    "GENERATE_EXTENSIONS",
    "GENERATE_KWARGS",
    "GenerateCall",
    "GenerateKwargs",
    "merge_generation_config",
    "to_sampling_params",
]

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
        "min_p",
        "repetition_penalty",
        "sequence_bias",  # one-token sequences only: the logit_bias of those tokens
        "output_logits",  # the raw logits of each token, in SampleOutput.logits (return_logits)
        "return_dict_in_generate",  # no effect: the Engine's outputs are always RequestOutput objects
        "generation_config",
    }
)
"""``generate`` keyword arguments the Engine accepts (and the options it does not implement, at their neutral value,
e.g. ``num_beams=1``)."""

GENERATE_EXTENSIONS = ("seed", "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty")
"""Keyword arguments beside transformers' words for what ``generate`` has no argument for: the :class:`SamplingParams`
fields of the same names (``seed``: transformers uses the global RNG; log-probabilities; OpenAI's penalties)."""

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
    "output_attentions": (False,),
    "output_hidden_states": (False,),
    "low_memory": (False,),
}


def merge_generation_config(
    model_config: GenerationConfig | None, kwargs: Mapping[str, Any]
) -> tuple[GenerationConfig, dict[str, Any]]:
    """Combine ``generate`` keyword arguments with the model's ``generation_config`` as ``model.generate`` does.

    Priority: the keyword arguments, then ``generation_config=`` (a ``GenerationConfig``), then the model's
    ``generation_config``, then transformers' defaults. Returns the merged config (a copy: nothing passed in is
    modified) and the :data:`GENERATE_EXTENSIONS` given (``seed``, ``logprobs``, ...), for
    :func:`to_sampling_params`. Raises :class:`~pagedcore.errors.InvalidRequestError` naming any unknown
    argument, any option the Engine does not implement set to a value that would change the output (e.g.
    ``num_beams=4``, also when it comes from the model's config), and any value that cannot give a request
    whatever the prompt (e.g. ``max_new_tokens=0``, ``do_sample=True`` with ``temperature=0``).

    Example:
        >>> config, extras = merge_generation_config(GenerationConfig(temperature=0.7), {"do_sample": True, "seed": 3})
        >>> config.do_sample, config.temperature, config.top_k, extras
        (True, 0.7, 50, {'seed': 3})
        >>> merge_generation_config(None, {"num_beams": 4})
        Traceback (most recent call last):
        ...
        pagedcore.errors.InvalidRequestError: num_beams=4 (an argument) is not supported by the Engine: ...
    """
    kwargs = dict(kwargs)
    extras = {name: kwargs.pop(name) for name in GENERATE_EXTENSIONS if kwargs.get(name) is not None}
    kwargs = {name: value for name, value in kwargs.items() if name not in GENERATE_EXTENSIONS}
    user_config = kwargs.pop("generation_config", None)
    if user_config is not None and not isinstance(user_config, GenerationConfig):
        raise InvalidRequestError(f"generation_config must be a transformers GenerationConfig, got {user_config!r}")
    unknown = sorted(k for k in kwargs if k not in GENERATE_KWARGS and k not in _NEUTRAL)
    if unknown:
        raise InvalidRequestError(
            f"unknown or unsupported generate() arguments for the Engine: {', '.join(unknown)} (it accepts "
            f"{', '.join(sorted(GENERATE_KWARGS | set(GENERATE_EXTENSIONS)))}, or SamplingParams)"
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
        if not _is_neutral(value, neutral, name):
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
    to_sampling_params(config, prompt_length=0, **extras)  # everything that does not depend on the prompt
    return config, extras


# Token lists at which these options do nothing when empty (``suppress_tokens=[]``: no token is suppressed).
_EMPTY_IS_NEUTRAL = frozenset(
    {"suppress_tokens", "begin_suppress_tokens", "bad_words_ids", "force_words_ids", "constraints"}
)


def _is_neutral(value: object, neutral: tuple[Any, ...], name: str = "") -> bool:
    if name in _EMPTY_IS_NEUTRAL and isinstance(value, (list, tuple)) and not value:
        return True
    return value is None or any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral)


def to_sampling_params(
    config: GenerationConfig, *, prompt_length: int, max_positions: int | None = None, **extras: Any
) -> SamplingParams:
    """Translate a (merged, see :func:`merge_generation_config`) ``GenerationConfig`` for one prompt.

    ``do_sample=False`` is greedy whatever the temperature says; with ``do_sample=True`` the temperature, top-k,
    top-p and min-p apply as transformers applies them. ``repetition_penalty`` and one-token ``sequence_bias``
    entries (``logit_bias``) apply in both modes, as transformers' logits processors do; ``output_logits=True``
    keeps each token's raw logits (``return_logits``). ``max_new_tokens`` wins over ``max_length`` (a total length,
    prompt included); with neither, 20 new tokens, within ``max_positions``. ``eos_token_id`` (None: none) gives
    the stop tokens, ``stop_strings`` the stop strings, and ``min_new_tokens`` (or ``min_length``) holds them off at
    first. ``extras`` are :data:`GENERATE_EXTENSIONS` fields (``seed``, ``logprobs``, ...), passed as they are.

    An option left None does nothing (no top-k, no top-p, temperature 1).

    Example:
        >>> params = to_sampling_params(GenerationConfig(max_length=12, eos_token_id=2), prompt_length=5)
        >>> params.max_new_tokens, params.is_greedy, params.stop_token_ids
        (7, True, (2,))
        >>> to_sampling_params(GenerationConfig(sequence_bias={(5,): -2.0}), prompt_length=5).logit_bias
        ((5, -2.0),)
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
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        stop_token_ids=stop,
        stop_strings=config.stop_strings,
        n=n,
        **_sampling_fields(config) if do_sample else {},
        **_processor_fields(config),
        **extras,
    )


def _sampling_fields(config: GenerationConfig) -> dict[str, Any]:
    """The warpers transformers applies when sampling: temperature, top-k, top-p, min-p (None: not applied)."""
    temperature = config.temperature if config.temperature is not None else 1.0
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature <= 0:
        raise InvalidRequestError(
            f"temperature={temperature!r} with do_sample=True: it must be > 0 (for greedy decoding, do_sample=False)"
        )
    top_k = config.top_k if config.top_k is not None else 0
    top_p = config.top_p if config.top_p is not None else 1.0
    min_p = config.min_p if config.min_p is not None else 0.0
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}


def _processor_fields(config: GenerationConfig) -> dict[str, Any]:
    """The logits processors transformers applies in every mode, and ``output_logits``."""
    penalty = config.repetition_penalty
    output_logits = getattr(config, "output_logits", None)
    return {
        "repetition_penalty": 1.0 if penalty is None else penalty,
        "logit_bias": _sequence_bias(config.sequence_bias),
        "return_logits": False if output_logits is None else output_logits,
    }


def _sequence_bias(value: object) -> dict[Any, Any] | None:
    """transformers' ``sequence_bias`` (``{(ids...): bias}`` or ``[[[ids...], bias], ...]``) as a ``logit_bias``;
    a sequence of more than one token is refused (it biases a token only after the others)."""
    if value is None:
        return None
    try:
        items = list(value.items()) if isinstance(value, Mapping) else [(tuple(k), b) for k, b in value]  # type: ignore[attr-defined]
        bias = {}
        for key, amount in items:
            ids = (key,) if not isinstance(key, (tuple, list)) else tuple(key)
            if len(ids) != 1:
                raise InvalidRequestError(
                    f"sequence_bias for the sequence {list(ids)!r} is not supported by the Engine: only one-token "
                    "sequences (a logit_bias); use model.generate for longer ones"
                )
            bias[ids[0]] = amount
    except (TypeError, ValueError) as exc:
        if isinstance(exc, InvalidRequestError):
            raise
        raise InvalidRequestError(f"sequence_bias must map token-id tuples to biases, got {value!r}") from exc
    return bias


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


@dataclass(frozen=True)
class GenerateCall:
    """One call's ``generate`` keyword arguments, merged with the model's ``generation_config`` (per call), resolved
    per prompt (``max_length`` counts the prompt).

    Example:
        >>> call = GenerateKwargs(None).parse({"max_length": 12, "eos_token_id": 2})
        >>> call.for_prompt(5, None).max_new_tokens, call.n
        (7, 1)
    """

    config: GenerationConfig
    extras: dict[str, Any]  # GENERATE_EXTENSIONS given (seed, logprobs, ...)
    structured: StructuredOutput | None = None  # generate(structured=...) / generate(response_format=...)

    @property
    def n(self) -> int:
        """Parallel samples (``num_return_sequences``)."""
        return self.config.num_return_sequences or 1

    def for_prompt(self, prompt_length: int, max_positions: int | None) -> SamplingParams:
        """The parameters of a prompt of ``prompt_length`` tokens in a context of ``max_positions``."""
        params = to_sampling_params(
            self.config, prompt_length=prompt_length, max_positions=max_positions, **self.extras
        )
        return params if self.structured is None else replace(params, structured=self.structured)


class GenerateKwargs:
    """``model.generate``'s keyword arguments for an Engine over ``model``, with its ``generation_config`` as the
    default exactly as ``model.generate`` uses it (:func:`merge_generation_config`); ``structured=`` and OpenAI's
    ``response_format=`` too.

    Example:
        >>> GenerateKwargs(None).parse({"num_beams": 4})
        Traceback (most recent call last):
        ...
        pagedcore.errors.InvalidRequestError: num_beams=4 (an argument) is not supported by the Engine: ...
    """

    def __init__(self, model: Any) -> None:
        self.model = model

    def parse(self, kwargs: dict[str, Any]) -> GenerateCall:
        """The call's parameters; raises :class:`~pagedcore.errors.InvalidRequestError` for what is wrong whatever
        the prompt."""
        structured = structured_kwarg(kwargs)
        config, extras = merge_generation_config(getattr(self.model, "generation_config", None), kwargs)
        return GenerateCall(config, extras, structured)
