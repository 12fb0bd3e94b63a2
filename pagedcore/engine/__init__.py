"""pagedcore's Engine: continuous batching with prefix caching over a model, framework-agnostic.

The Engine (:class:`Engine`), its requests (:class:`Request`) and outputs, sampling and logits processors,
log-probabilities, stopping and detokenizing, and structured outputs. It depends on the core (:mod:`pagedcore`:
blocks, prefix trie, capacity, scheduler) and on a small protocol, :class:`ModelRunner`, that a framework adapter
implements (:class:`~pagedcore.adapters.transformers.runner.TransformersRunner`; the plain-PyTorch
:class:`~pagedcore.adapters.torch_reference.TorchRunner`). It imports no framework and no front end.

Example:
    >>> from pagedcore.adapters.torch_reference import TorchLlama, TorchRunner
    >>> with Engine(TorchRunner(TorchLlama.tiny(), num_blocks=32, block_size=4)) as engine:
    ...     (out,) = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3), use_tqdm=False)
    >>> len(out.token_ids)
    3
"""

from pagedcore.config import PoolConfig
from pagedcore.scheduler import SchedulerConfig

from .admission import GenerateArguments, PromptParams
from .config import EngineConfig
from .context import ContextWindow
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
from .request import Request, RequestState
from .runner import CompileCounts, ForwardBatch, ModelInfo, ModelRunner, RunnerStats
from .sampling import SamplingParams

__all__ = [
    "CompileCounts",
    "ContextWindow",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "ForwardBatch",
    "GenerateArguments",
    "Logprob",
    "ModelInfo",
    "ModelRunner",
    "PoolConfig",
    "PromptParams",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "RequestState",
    "RunnerStats",
    "SampleOutput",
    "SamplingParams",
    "SchedulerConfig",
    "StepOutput",
    "TokenEvent",
    "TokenLogprobs",
]
