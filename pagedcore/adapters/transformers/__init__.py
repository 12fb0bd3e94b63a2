"""pagedcore for Hugging Face transformers.

- :class:`PagedCache`: a drop-in ``Cache`` for ``model.generate`` backed by a paged, ref-counted pool.
- :class:`PagedKVPool`: the paged KV memory of a model, shareable between caches, with a prefix cache.
- :func:`enable` / :func:`disable`: automatic prefix caching for plain ``model.generate`` (:func:`namespace` to
  isolate tenants).
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

from typing import TYPE_CHECKING

from pagedcore.engine.outputs import (
    EngineStats,
    Logprob,
    RequestMetrics,
    RequestOutput,
    SampleOutput,
    StepOutput,
    TokenEvent,
    TokenLogprobs,
)
from pagedcore.engine.sampling import SamplingParams
from pagedcore.lazy_names import keep_old_paths

from .attention import ForwardContext, paged_attention_forward, register
from .cache import CacheMemoryStats, PagedCache
from .pool import MemoryStats, PagedKVPool
from .prefix_caching import disable, enable, is_enabled, namespace, prefix_pool
from .spec import LayerSpec, ModelKVSpec

if TYPE_CHECKING:
    from pagedcore.engine.engine import Engine

register()

# The Engine and its framework-neutral modules moved to pagedcore.engine: their old paths keep working.
keep_old_paths(
    __name__,
    {
        name: f"pagedcore.engine.{name}"
        for name in (
            "detokenizer",
            "inputs",
            "locks",
            "logits_processors",
            "logprobs",
            "outputs",
            "request",
            "sampling",
            "stopping",
        )
    },
)

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
]


def __getattr__(name: str) -> object:
    # The Engine still drives the model through this package's modules: imported on first use, once they are loaded.
    if name in ("Engine", "engine"):
        from pagedcore.engine import engine

        return engine.Engine if name == "Engine" else engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
