"""Memory back to training: a pool that sleeps while its model trains.

A training loop that samples from the model it trains (GRPO, RLOO, online DPO) needs the KV pool during a rollout
and the memory for activations, gradients and optimizer states during the training step. :meth:`PagedKVPool.sleep
<pagedcore.adapters.transformers.PagedKVPool.sleep>` releases the pool's tensors explicitly;
:func:`sleep_when_training` does it by itself, at the first training forward after a rollout.

**What counts as a training forward.** A forward of the model with gradients enabled while the model is in
training mode (``torch.is_grad_enabled() and model.training``), and without a :class:`~.cache.PagedCache`. Generation
runs without gradients (``generate`` is ``torch.no_grad``, the Engine ``torch.inference_mode``), and so do the
scoring forwards trainers run before the loss (TRL's old and reference log-probabilities). Switching ``train()`` /
``eval()`` is no signal: TRL's default path generates with the model in training mode, and keeps it there.

**What it keeps.** Nothing of the pool's contents: the cached prefixes go with the tensors (in a training loop the
optimizer step that follows would make them stale anyway). A pool whose blocks are held (a kept ``generate`` result,
an Engine's running requests) is left awake: those keys and values are still in use. The next ``generate`` call or
Engine step re-creates the tensors where they were.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from .cache import PagedCache
from .hook_ids import transparent_hook
from .pool import PagedKVPool

__all__ = ["sleep_when_training"]


def sleep_when_training(model: torch.nn.Module, pool: PagedKVPool) -> RemovableHandle:
    """Put ``pool`` to sleep at the start of every training forward of ``model`` (see the module docstring), when
    no block is held. ``enable(model, sleep_when_training=True)`` does this for its pool; call it for an Engine's
    pool (``engine.pool``). Returns the hook's handle (``handle.remove()`` stops it).

    Example:
        >>> import torch
        >>> from pagedcore.adapters.transformers.testing import tiny_llama
        >>> from pagedcore.adapters.transformers import enable
        >>> model = tiny_llama()
        >>> pool = enable(model, num_blocks=16, block_size=4)
        >>> handle = sleep_when_training(model, pool)
        >>> _ = model.generate(torch.arange(1, 10)[None], max_new_tokens=2, do_sample=False)  # the rollout
        >>> pool.has_tensors
        True
        >>> loss = model.train()(torch.arange(1, 10)[None], labels=torch.arange(1, 10)[None]).loss  # training
        >>> pool.is_sleeping
        True
        >>> handle.remove()
    """
    pool_ref = weakref.ref(pool)

    @transparent_hook  # it computes nothing into the forward (hook_ids)
    def before_forward(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        target = pool_ref()
        if target is None or not target.has_tensors:
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, PagedCache):
            return  # a forward that writes the pool (generation with gradients on), not a training step
        with target.lock:
            if not target.kv.num_used_blocks:
                target.sleep()

    return model.register_forward_pre_hook(before_forward, with_kwargs=True)
