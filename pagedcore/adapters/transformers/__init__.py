"""pagedcore for Hugging Face transformers.

- :class:`PagedCache`: a drop-in ``Cache`` for ``model.generate`` backed by a paged, ref-counted pool.
- :class:`PagedKVPool`: the paged KV memory of a model, shareable between caches, with a prefix cache.
- :func:`enable` / :func:`disable`: automatic prefix caching for plain ``model.generate`` (:func:`namespace` to
  isolate tenants); identical rows of a call (an RL group) compute their prompt once.
- :func:`sleep_when_training`: a pool that gives its memory back while the model trains (``PagedKVPool.sleep``).
- :class:`Engine`: continuous batching over the model (``generate``, ``stream``, ``add_request``/``step``/``abort``):
  :class:`pagedcore.engine.Engine` driving the model through its :class:`~.runner.TransformersRunner`.
- ``attn_implementation="paged"``: attention that reads straight from the pool (registered on import).

The Engine's types (:class:`SamplingParams`, :class:`RequestOutput`, ...) live in :mod:`pagedcore.engine` and are
re-exported here, with the old submodule paths of the modules that moved there.

Example:
    >>> import torch
    >>> from pagedcore.adapters.transformers.testing import tiny_llama
    >>> from pagedcore.adapters.transformers import PagedCache
    >>> _ = torch.manual_seed(0)   # random weights: the seed keeps a random eos out of the 3 tokens, run after run
    >>> model = tiny_llama()
    >>> ids = torch.tensor([[1, 2, 3, 4]])
    >>> out = model.generate(ids, max_new_tokens=3, do_sample=False, cache=PagedCache(model, num_blocks=32))
    >>> out.shape
    torch.Size([1, 7])
"""

from pagedcore.config import PoolConfig
from pagedcore.engine.config import EngineConfig
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
from pagedcore.engine.request import Request
from pagedcore.engine.sampling import SamplingParams
from pagedcore.lazy_names import keep_old_paths

from .attention import ForwardContext, paged_attention_forward, register
from .cache import CacheMemoryStats, PagedCache
from .model_engine import Engine
from .pool import MemoryStats, PagedKVPool
from .prefix_caching import disable, enable, is_enabled, namespace, prefix_pool
from .runner import TransformersRunner
from .sleep_mode import sleep_when_training
from .spec import LayerSpec, ModelKVSpec

register()

# The Engine and its framework-neutral modules moved to pagedcore.engine: their old paths keep working (the old
# engine module is the transformers Engine's).
keep_old_paths(
    __name__,
    {
        "engine": f"{__name__}.model_engine",
        **{
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
    },
)

__all__ = [
    "CacheMemoryStats",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "ForwardContext",
    "LayerSpec",
    "Logprob",
    "MemoryStats",
    "ModelKVSpec",
    "PagedCache",
    "PagedKVPool",
    "PoolConfig",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "SampleOutput",
    "SamplingParams",
    "StepOutput",
    "TokenEvent",
    "TokenLogprobs",
    "TransformersRunner",
    "disable",
    "enable",
    "is_enabled",
    "namespace",
    "paged_attention_forward",
    "prefix_pool",
    "register",
    "sleep_when_training",
]
