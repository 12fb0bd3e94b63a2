"""A LoRA adapter's files, read and checked against the model before anything is loaded into it.

:func:`read_adapter` reads a PEFT adapter folder (``adapter_config.json`` and ``adapter_model.safetensors``, what
``PeftModel.save_pretrained`` writes) into host memory and refuses, with an
:class:`~pagedcore.errors.AdapterError` that says why, what the Engine cannot serve exactly:

- anything but plain LoRA (another PEFT method, DoRA, activated LoRA, QA-LoRA, ``modules_to_save``, trainable
  tokens, layer replication, LoRA on parameters rather than modules);
- LoRA on anything but a linear layer (embeddings, convolutions), or whose weights do not fit the model's layers
  (an adapter made for another base model);
- a rank above ``max_lora_rank`` (vLLM's message), or weights of another rank than the config gives their layer;
- an adapter initialised by changing the base model (PiSSA, OLoRA, CorDA, LoftQ saved as trained: its weights are
  relative to that changed base; PEFT's ``path_initial_model_for_weight_conversion`` saves it as plain LoRA);
- a file without LoRA weights, or a base layer's weights that differ from the model's (PEFT's
  ``save_embedding_layers`` copies the whole ``lm_head``: taken when equal to the model's own, as it then changes
  nothing);
- weights saved as a pickle (``adapter_model.bin``): only safetensors are read, as loading a pickle runs code.

The adapter's **version** is a digest of what it computes (its configuration less names and paths, and every
weight's name, dtype, shape and bytes): the same files give the same version in every process, so its requests'
prefixes can be kept in the tiers below the pool and found again after a restart.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from pagedcore.errors import AdapterError, AdapterNotFoundError

__all__ = ["AdapterFiles", "adapter_digest", "read_adapter"]

_CONFIG = "adapter_config.json"
_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_REFUSED = {  # config field -> what it is (refused when set)
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save (whole layers trained beside the LoRA)",
    "layer_replication": "layer replication",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "alora_invocation_tokens": "activated LoRA",
    "use_qalora": "QA-LoRA",
    "trainable_token_indices": "trainable tokens",
}
_BASE_CHANGING = ("pissa", "olora", "corda", "loftq")  # init_lora_weights that rewrite the base layer's weights
_NOT_COMPUTE = ("base_model_name_or_path", "revision", "inference_mode", "task_type", "auto_mapping", "peft_version")


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter read from its folder.

    Attributes:
        path: the folder.
        config: its ``peft.LoraConfig``.
        state: its weights in host memory, under the names PEFT saved them with (without an adapter name).
        rank: its LoRA rank (the largest over its layers).
        version: the digest of what it computes (see the module docstring).
        modules: the model's modules it adapts (their names in the unwrapped model).

    Example:
        >>> AdapterFiles("/a", None, {}, 8, "v", ("model.layers.0.self_attn.q_proj",)).rank
        8
    """

    path: str
    config: Any
    state: dict[str, torch.Tensor]
    rank: int
    version: str
    modules: tuple[str, ...]


def read_adapter(path: str, model: torch.nn.Module, *, max_rank: int) -> AdapterFiles:
    """Read and check the adapter in folder ``path`` for ``model`` (see the module docstring for what is refused).

    Raises :class:`~pagedcore.errors.AdapterNotFoundError` when ``path`` holds no adapter, and
    :class:`~pagedcore.errors.AdapterError` for one that cannot be served.

    Example:
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> read_adapter("/nowhere", tiny_llama(), max_rank=16)
        Traceback (most recent call last):
        ...
        pagedcore.errors.AdapterNotFoundError: No adapter found at '/nowhere': a folder with adapter_config.json
    """
    if not isinstance(path, str) or not path or not os.path.isfile(os.path.join(path, _CONFIG)):
        raise AdapterNotFoundError(f"No adapter found at {path!r}: a folder with {_CONFIG}", param="lora_path")
    config = _config(path)
    rank = max([int(config.r), *(int(r) for r in (getattr(config, "rank_pattern", None) or {}).values())])
    if rank > max_rank:
        raise AdapterError(
            f"LoRA rank {rank} is greater than max_lora_rank {max_rank} (start the engine with a larger "
            "--max-lora-rank / max_lora_rank)",
            param="lora_path",
        )
    state = _without_base_copies(_weights(path), model)
    modules = _check_shapes(state, model, config)
    return AdapterFiles(path, config, state, rank, adapter_digest(config, state), modules)


def adapter_digest(config: Any, state: dict[str, torch.Tensor], *, seed: bytes = b"") -> str:
    """The digest of an adapter's configuration (less what does not change a forward) and weights.

    Example:
        >>> import torch
        >>> from peft import LoraConfig
        >>> weights = {"w": torch.ones(2)}
        >>> a = adapter_digest(LoraConfig(r=2), weights)
        >>> a == adapter_digest(LoraConfig(r=2), weights), a == adapter_digest(LoraConfig(r=4), weights)
        (True, False)
    """
    fields = {k: v for k, v in config.to_dict().items() if k not in _NOT_COMPUTE}
    digest = hashlib.blake2b(seed, digest_size=16)
    digest.update(json.dumps(fields, sort_keys=True, default=_plain).encode())
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"\0{name}\0{tensor.dtype}\0{tuple(state[name].shape)}\0".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def _plain(value: Any) -> Any:
    """A config value JSON cannot write, the same in every process (a set's order is not)."""
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    return str(value)


def _config(path: str) -> Any:
    from peft import PeftConfig, PeftType

    try:
        config = PeftConfig.from_pretrained(path)
    except Exception as exc:  # a malformed or foreign config: the client's error
        raise AdapterError(f"cannot read the adapter config in {path!r}: {type(exc).__name__}: {exc}") from exc
    if config.peft_type != PeftType.LORA:
        raise AdapterError(f"{path!r} is a {config.peft_type} adapter; only LoRA adapters are served")
    for field, what in _REFUSED.items():
        if getattr(config, field, None):
            raise AdapterError(f"{path!r}: {what} is not served (plain LoRA on linear layers only)")
    init = getattr(config, "init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING):
        raise AdapterError(
            f"{path!r}: init_lora_weights={init!r} rewrites the base model's weights, and this adapter's weights are "
            "relative to that rewritten base; save it with PEFT's path_initial_model_for_weight_conversion (plain "
            "LoRA on the original base) to serve it"
        )
    return config


def _weights(path: str) -> dict[str, torch.Tensor]:
    weights = os.path.join(path, _WEIGHTS)
    if not os.path.isfile(weights):
        found = (
            "adapter_model.bin (a pickle, not read: loading it runs code)"
            if os.path.isfile(os.path.join(path, "adapter_model.bin"))
            else "no weights"
        )
        raise AdapterError(f"{path!r} has {found}; save the adapter with safetensors (save_pretrained's default)")
    from safetensors.torch import load_file

    try:
        return load_file(weights, device="cpu")
    except Exception as exc:
        raise AdapterError(f"cannot read {weights!r}: {type(exc).__name__}: {exc}") from exc


def _without_base_copies(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``state`` less the base layers' weights it carries that equal the model's own (PEFT's
    ``save_embedding_layers`` saves ``lm_head`` whole); one that differs is refused."""
    kept = {}
    for key, tensor in state.items():
        module, _, part = key.removeprefix(_PREFIX).replace(".base_layer.", ".").rpartition(".")
        if ".lora_" in key or part not in ("weight", "bias"):
            kept[key] = tensor  # a LoRA weight, or what _check_shapes refuses by name
            continue
        try:
            layer = model.get_submodule(module)
        except AttributeError:
            layer = None
        own = getattr(getattr(layer, "base_layer", layer), part, None)
        if not isinstance(own, torch.Tensor) or own.shape != tensor.shape or own.is_meta or not _same(own, tensor):
            raise AdapterError(
                f"weight {key!r} is a whole layer's weights (PEFT's save_embedding_layers) that differ from this "
                "model's: a resized vocabulary or another base model; LoRA weights are served, not changed layers"
            )
    return kept


def _same(own: torch.Tensor, saved: torch.Tensor) -> bool:
    """Whether ``saved`` is ``own`` as saved in its dtype (a bfloat16 model's head read by a float32 one: compared
    in the coarser dtype), compared where ``own`` lies."""
    coarse = own.dtype if torch.finfo(own.dtype).bits <= torch.finfo(saved.dtype).bits else saved.dtype
    with torch.no_grad():
        return bool(torch.equal(own.to(coarse), saved.to(own.device, coarse)))


def _check_shapes(state: dict[str, torch.Tensor], model: torch.nn.Module, config: Any) -> tuple[str, ...]:
    """The modules the weights adapt, each checked to be a linear layer of the model their shapes fit, with the
    rank the config gives it."""
    if not state:
        raise AdapterError("the adapter's file holds no LoRA weights")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        module, _, part = key.removeprefix(_PREFIX).rpartition(".lora_")
        if part not in ("A.weight", "B.weight", "B.bias"):
            raise AdapterError(f"weight {key!r} is not a LoRA weight of a linear layer; only those are served")
        pairs.setdefault(module, {})[part] = tensor
    for module, parts in pairs.items():
        try:
            layer = model.get_submodule(module)
        except AttributeError:
            raise AdapterError(f"the adapter adapts {module!r}, which this model does not have") from None
        layer = getattr(layer, "base_layer", layer)  # already wrapped by another adapter
        a, b = parts.get("A.weight"), parts.get("B.weight")
        out_in = _linear_shape(layer)
        if a is None or b is None or out_in is None or a.dim() != 2 or b.dim() != 2:
            raise AdapterError(f"{module!r}: LoRA is served on linear layers with both A and B weights")
        if (b.shape[0], a.shape[1]) != out_in or a.shape[0] != b.shape[1]:
            raise AdapterError(
                f"{module!r}: the adapter's weights ({tuple(a.shape)}, {tuple(b.shape)}) do not fit the layer "
                f"(out, in) = {out_in}: an adapter of another base model?"
            )
        rank = _rank(config, module)
        if a.shape[0] != rank:
            raise AdapterError(f"{module!r}: LoRA weights of rank {a.shape[0]}, but the adapter's config says r={rank}")
    return tuple(sorted(pairs))


def _rank(config: Any, module: str) -> int:
    """The rank PEFT gives ``module`` (``rank_pattern``'s first key that ends its name, else ``r``)."""
    from peft.utils.other import get_pattern_key

    pattern = getattr(config, "rank_pattern", None) or {}
    return int(pattern.get(get_pattern_key(list(pattern), module), config.r))


def _linear_shape(layer: torch.nn.Module) -> tuple[int, int] | None:
    """``(out_features, in_features)`` of a linear layer (``nn.Linear``, or GPT-2's ``Conv1D``), else None."""
    if isinstance(layer, torch.nn.Linear):
        return (layer.out_features, layer.in_features)
    weight = getattr(layer, "weight", None)
    if type(layer).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return (int(weight.shape[1]), int(weight.shape[0]))  # Conv1D keeps its weight as (in, out)
    return None
