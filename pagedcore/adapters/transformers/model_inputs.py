"""Which keyword arguments of a ``generate`` call reach the model's forward (its ``model_kwargs``): what
``enable()``'s own forwards pass on (:mod:`.prefix_caching`), and what holds a call's images, video or audio
(:mod:`.multimodal`).
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["SEQUENCE_INPUTS", "model_inputs"]

# Model inputs as long as the prompt, which generate slices with it.
SEQUENCE_INPUTS = ("token_type_ids", "mm_token_type_ids", "moe_mm_token_type_ids")
# generate()'s own keyword arguments that are neither generation settings nor model inputs.
_GENERATE_ARGUMENTS = frozenset({"tokenizer", "assistant_tokenizer", "trust_remote_code", "use_model_defaults"})
_CALL_INPUTS = frozenset({"input_ids", "inputs", "attention_mask", "position_ids", "cache", "past_key_values"})


def model_inputs(model: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a ``generate`` call that ``generate`` hands to the model's forward (its
    ``model_kwargs``): neither a generation setting, nor one of ``generate``'s own parameters, nor the inputs the
    prefill sets itself.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> sorted(model_inputs(tiny_llama(), {"max_new_tokens": 2, "token_type_ids": None, "input_ids": None}))
        ['token_type_ids']
    """
    config = kwargs.get("generation_config") or model.generation_config
    own = set(inspect.signature(type(model).generate).parameters) | _GENERATE_ARGUMENTS | _CALL_INPUTS
    return {k: v for k, v in kwargs.items() if k not in own and not hasattr(config, k)}
