"""Requests' default sampling values from the model's generation config, as vLLM's ``--generation-config``:
``auto`` (the default) reads the model's ``generation_config.json`` and every request that leaves ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` or its length unset gets the model's value (what the model's
authors recommend, e.g. Qwen3's ``temperature: 0.6``); ``vllm`` uses none of it (OpenAI's defaults); a folder reads
its ``generation_config.json``. ``--override-generation-config`` sets values over them.

A request's own values always win. The values are applied to the parsed request (:func:`apply_defaults`), so
everything after (validation, the engine's parameters, the answer's usage) sees one request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["DEFAULTED", "apply_defaults", "generation_defaults"]

DEFAULTED = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""Generation config name -> request field: vLLM's list of the values a generation config sets for requests."""


def generation_defaults(
    source: str,
    model: str | None,
    overrides: Mapping[str, Any] | None = None,
    **hub: Any,
) -> dict[str, Any]:
    """The request defaults (request field -> value) of ``--generation-config source`` for ``model`` (a folder or
    hub name; None: the built-in model, which has none), with ``overrides`` (generation config names) over them.
    ``hub`` goes to ``GenerationConfig.from_pretrained`` (``revision``, ``cache_dir``).

    Example:
        >>> generation_defaults("vllm", None, {"temperature": 0.5, "max_new_tokens": 8})
        {'temperature': 0.5, 'max_tokens': 8}
    """
    values: dict[str, Any] = {}
    where = model if source == "auto" else None if source == "vllm" else source
    if where is not None:
        from transformers import GenerationConfig

        try:
            config = GenerationConfig.from_pretrained(where, **hub)
        except OSError:  # no generation_config.json: no defaults (vLLM's rule)
            config = None
        if config is not None:
            values = config.to_diff_dict()
    values.update(overrides or {})
    unknown = sorted(set(overrides or {}) - set(DEFAULTED))
    if unknown:
        raise ValueError(
            f"--override-generation-config: {', '.join(unknown)} cannot be a request default (use "
            f"{', '.join(DEFAULTED)})"
        )
    return {field: values[name] for name, field in DEFAULTED.items() if values.get(name) is not None}


def apply_defaults(body: Any, defaults: Mapping[str, Any]) -> Any:
    """``body`` (a parsed request) with each default set where the request left the field unset; a chat request's
    length default applies only when neither ``max_tokens`` nor ``max_completion_tokens`` is given.

    Example:
        >>> from types import SimpleNamespace
        >>> body = apply_defaults(SimpleNamespace(temperature=None, top_p=0.5), {"temperature": 0.6, "top_p": 0.9})
        >>> body.temperature, body.top_p
        (0.6, 0.5)
    """
    for field, value in defaults.items():
        if field == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
            continue
        if hasattr(body, field) and getattr(body, field) is None:
            setattr(body, field, value)
    return body
