"""Which forward hooks may change what a model computes, by id: what the weights watch compares with its settings
(a hook added or removed is a change of the model: a steering vector added to a layer's output, a hook on the head)
and what the fused greedy head checks before each step (:mod:`.argmax_head`); and which hooks the Engine's direct
layers may skip (:func:`recorders_only`).

Counted: every forward hook and forward pre-hook on a module (``register_forward_hook``,
``register_forward_pre_hook``), by the id of its handle (torch numbers handles from one counter: a hook removed and
added again is a new one), and the global ones (``torch.nn.modules.module.register_module_forward_hook`` and
``register_module_forward_pre_hook``). Backward hooks change no forward and do not count.

Not counted, because they put nothing into the forward's values:

- pagedcore's own (:func:`transparent_hook`): the cache's plumbing (:mod:`.forward_hooks`), sleep mode's, the
  Engine's per-request LoRA deltas (its adapters are keyed per request, :mod:`.lora`) and the benchmarks' timers;
- transformers' output capturing hooks (``output_hidden_states``, ``output_attentions``: installed once on the
  layers, they record outputs and return None).

A hook's body is not read: one that changes nothing (a logger) counts as a change when it is added and when it is
removed, which costs the prefixes cached before it, never a wrong token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from torch.nn.modules import module as torch_module

__all__ = ["counted", "global_hooks", "module_hooks", "recorders_only", "transparent_hook"]

_MARK = "__pagedcore_transparent_hook__"
_CAPTURING = "transformers.utils.output_capturing"  # transformers' output recorders: they return None

_F = TypeVar("_F", bound=Callable[..., Any])


def transparent_hook(hook: _F) -> _F:
    """Mark ``hook`` (a function, or a ``functools.partial``) as one that puts nothing into the forward's values:
    :func:`counted` leaves it out. Returns ``hook``.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> _ = layer.register_forward_hook(transparent_hook(lambda module, args, out: None))
        >>> counted(layer._forward_hooks)
        ()
    """
    setattr(hook, _MARK, True)
    return hook


def counted(hooks: Mapping[int, Callable[..., Any]]) -> tuple[int, ...]:
    """The ids of the hooks (a module's ``_forward_hooks`` or ``_forward_pre_hooks``) that count (module docstring).

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> handle = layer.register_forward_hook(lambda module, args, out: out * 2)
        >>> counted(layer._forward_hooks) == (handle.id,)
        True
    """
    if not hooks:
        return ()
    return tuple(key for key, hook in hooks.items() if not _transparent(hook))


def _transparent(hook: Callable[..., Any]) -> bool:
    return bool(getattr(hook, _MARK, False)) or getattr(hook, "__module__", None) == _CAPTURING


def recorders_only(hooks: Mapping[int, Callable[..., Any]]) -> bool:
    """Whether every hook of ``hooks`` (a module's ``_forward_hooks``) is one of transformers' output recorders: a
    call that skips them computes the same values (they return None, and record only into the collector of a model
    call that asked for its hidden states or attentions), which the Engine's direct layers do
    (:mod:`.direct_layers`). A hook marked :func:`transparent_hook` is not skipped: a user's counter counts calls.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> recorders_only(layer._forward_hooks)
        True
        >>> _ = layer.register_forward_hook(transparent_hook(lambda module, args, out: None))
        >>> recorders_only(layer._forward_hooks)
        False
    """
    return all(getattr(hook, "__module__", None) == _CAPTURING for hook in hooks.values())


def module_hooks(fields: list[dict[str, Any]], pre: list[bool]) -> list[tuple[int, ...]]:
    """Per hooked module of ``fields`` (the modules' ``__dict__``s): ``(index, hook ids...)`` of the hooks that count,
    in order; a module's pre-hooks only where ``pre[index]`` (PEFT's tuner layers take a call's ``adapter_names``
    through pre-hooks, which the prefix cache handles apart: ``WeightsWatch.tuners_hooked``).

    Example:
        >>> import torch
        >>> layers = [torch.nn.Linear(2, 2), torch.nn.ReLU()]
        >>> handle = layers[1].register_forward_pre_hook(lambda module, args: None)
        >>> module_hooks([vars(m) for m in layers], [True, True]) == [(1, handle.id)]
        True
        >>> module_hooks([vars(m) for m in layers], [True, False])  # its pre-hooks left out
        []
    """
    hooked = [i for i, found in enumerate(fields) if found.get("_forward_hooks") or found.get("_forward_pre_hooks")]
    out = []
    for i in hooked:
        found = fields[i]
        ids = counted(found.get("_forward_hooks") or {})
        if pre[i]:
            ids += counted(found.get("_forward_pre_hooks") or {})
        if ids:
            out.append((i, *ids))
    return out


def global_hooks() -> tuple[int, ...]:
    """The ids of the global forward hooks and pre-hooks that count (every module's forward runs them).

    Example:
        >>> import torch
        >>> handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
        >>> handle.id in global_hooks()
        True
        >>> handle.remove()
    """
    return counted(torch_module._global_forward_hooks) + counted(torch_module._global_forward_pre_hooks)  # noqa: SLF001
