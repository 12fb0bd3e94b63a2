"""pagedcore for Hugging Face transformers.

- :class:`PagedCache`: a drop-in ``Cache`` for ``model.generate`` backed by a paged, ref-counted pool.
- :class:`PagedKVPool`: the paged KV memory of a model, shareable between caches, with a prefix cache.
- :func:`enable` / :func:`disable`: automatic prefix caching for plain ``model.generate`` (:func:`namespace` to
  isolate tenants); identical rows of a call (an RL group) compute their prompt once.
- :func:`sleep_when_training`: a pool that gives its memory back while the model trains (``PagedKVPool.sleep``).
- :class:`Engine`: continuous batching over the model (``generate``, ``stream``, ``add_request``/``step``/``abort``).
- ``attn_implementation="paged"``: attention that reads straight from the pool (registered on import).

Example:
    >>> import torch
    >>> from pagedcore.adapters.transformers.testing import tiny_llama
    >>> from pagedcore.adapters.transformers import PagedCache
    >>> model = tiny_llama()
    >>> ids = torch.tensor([[1, 2, 3, 4]])
    >>> out = model.generate(ids, max_new_tokens=3, do_sample=False, cache=PagedCache(model, num_blocks=32))
    >>> out.shape
    torch.Size([1, 7])
"""

from .attention import ForwardContext, paged_attention_forward, register
from .cache import CacheMemoryStats, PagedCache
from .engine import Engine
from .outputs import (
    EngineStats,
    Logprob,
    RequestMetrics,
    RequestOutput,
    SampleOutput,
    StepOutput,
    TokenEvent,
    TokenLogprobs,
)
from .pool import MemoryStats, PagedKVPool
from .prefix_caching import disable, enable, is_enabled, namespace, prefix_pool
from .sampling import SamplingParams
from .sleep_mode import sleep_when_training
from .spec import LayerSpec, ModelKVSpec

register()

__all__ = [
    "CacheMemoryStats",
    "Engine",
    "EngineStats",
    "ForwardContext",
    "LayerSpec",
    "Logprob",
    "MemoryStats",
    "ModelKVSpec",
    "PagedCache",
    "PagedKVPool",
    "RequestMetrics",
    "RequestOutput",
    "SampleOutput",
    "SamplingParams",
    "StepOutput",
    "TokenEvent",
    "TokenLogprobs",
    "disable",
    "enable",
    "is_enabled",
    "namespace",
    "paged_attention_forward",
    "prefix_pool",
    "register",
    "sleep_when_training",
]
