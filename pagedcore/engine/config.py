"""EngineConfig: an Engine's settings, validated once, one config per owner inside it.

- :class:`~pagedcore.config.PoolConfig`: the settings of a new pool (the runner's; see :mod:`pagedcore.config`);
- :class:`~pagedcore.scheduler.SchedulerConfig`: the token budget, the sequences at once, the watermark, prefix
  caching and the policy (the scheduler's);
- the Engine's own: ``max_logprobs``, ``max_model_len`` (the context served), the compiled decode step
  (``compile``, read by the runner that runs it), ``compile_timeout`` (structured outputs), ``attention_backend`` and
  the LoRA adapters' settings (``lora``: a :class:`~.lora.LoRAConfig`, read by the runner that holds the adapters;
  ``enable_lora=True``, ``max_loras``, ``max_lora_rank`` as keyword arguments).

``Engine(model, num_blocks=64, max_num_seqs=8)`` is a convenience for ``Engine(model, config=EngineConfig(
pool=PoolConfig(num_blocks=64), scheduler=SchedulerConfig(max_num_seqs=8)))``: :meth:`EngineConfig.of` sorts the
keyword arguments into their configs (``scheduling_policy`` is the scheduler's ``policy``).

Example:
    >>> config = EngineConfig.of(num_blocks=64, max_num_seqs=8, scheduling_policy="fcfs", max_logprobs=5)
    >>> config.pool.num_blocks, config.scheduler.max_num_seqs, config.scheduler.policy, config.max_logprobs
    (64, 8, 'fcfs', 5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pagedcore.config import PoolConfig, split_kwargs
from pagedcore.errors import ConfigError
from pagedcore.scheduler import SchedulerConfig
from pagedcore.validation import integer

from .lora import LoRAConfig

__all__ = ["COMPILE_MODES", "EngineConfig"]

COMPILE_MODES = (True, False, "auto", "cudagraphs")
"""``compile=``: decode steps compiled (inductor), eagerly, ``"auto"`` (the runner decides: eager for now), or
``"cudagraphs"`` (captured from the eager step per bucket; CUDA only)."""

_RENAMED = {"scheduling_policy": "policy"}  # Engine keyword -> SchedulerConfig field


@dataclass(frozen=True)
class EngineConfig:
    """An Engine's settings.

    Args:
        pool: the settings of the pool the runner builds (when it builds one).
        scheduler: the scheduler's limits and policy.
        max_logprobs: the most ``logprobs`` / ``prompt_logprobs`` a request may ask for (vLLM's default, 20; -1:
            no limit, so ``-1``, the whole vocabulary, is allowed).
        max_model_len: the context served (prompt + new tokens), at most the model's own; None: the model's.
        compile: run decode-only steps as a compiled graph (:data:`COMPILE_MODES`; the runner owns the graph and
            turns it off when a compiled step fails).
        compile_timeout: seconds a structured-output request may wait for its grammar to compile (in a worker, off
            the step loop) before it fails with :class:`~pagedcore.errors.GrammarTimeoutError`.
        attention_backend: the attention backend's name (None: the plugins' choice for the device).
        lora: serve LoRA adapters with these settings (:class:`~.lora.LoRAConfig`); None: no adapters.

    Example:
        >>> EngineConfig(compile="yes")
        Traceback (most recent call last):
        ...
        pagedcore.errors.ConfigError: compile must be True, False, "auto" or "cudagraphs", got 'yes'
    """

    pool: PoolConfig = field(default_factory=PoolConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_logprobs: int = 20
    max_model_len: int | None = None
    compile: bool | str = "auto"
    compile_timeout: float = 30.0
    attention_backend: str | None = None
    lora: LoRAConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pool, PoolConfig):
            raise ConfigError(f"pool must be a PoolConfig, got {type(self.pool).__name__}", param="pool")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ConfigError(f"scheduler must be a SchedulerConfig, got {type(self.scheduler).__name__}")
        fix = object.__setattr__
        fix(self, "max_logprobs", integer("max_logprobs", self.max_logprobs, minimum=-1, error=ConfigError))
        if self.max_model_len is not None:
            fix(self, "max_model_len", integer("max_model_len", self.max_model_len, minimum=1, error=ConfigError))
        if not any(self.compile is mode for mode in COMPILE_MODES[:2]) and self.compile not in COMPILE_MODES[2:]:
            raise ConfigError(
                f'compile must be True, False, "auto" or "cudagraphs", got {self.compile!r}', param="compile"
            )
        timeout = self.compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ConfigError(f"compile_timeout must be > 0 seconds, got {timeout!r}", param="compile_timeout")
        fix(self, "compile_timeout", float(timeout))
        if self.attention_backend is not None and not isinstance(self.attention_backend, str):
            raise ConfigError(f"attention_backend must be a name, got {self.attention_backend!r}")
        if self.lora is not None and not isinstance(self.lora, LoRAConfig):
            raise ConfigError(f"lora must be a LoRAConfig, got {type(self.lora).__name__}", param="lora")

    @classmethod
    def of(cls, config: EngineConfig | None = None, **kwargs: Any) -> EngineConfig:
        """``config``, or the config the keyword arguments describe (None: not given): pool settings
        (:class:`~pagedcore.config.PoolConfig`'s fields), scheduler settings (:class:`~pagedcore.scheduler.
        SchedulerConfig`'s, ``scheduling_policy`` for ``policy``) and this class's own; not both.

        Example:
            >>> EngineConfig.of(EngineConfig(), max_num_seqs=4)
            Traceback (most recent call last):
            ...
            pagedcore.errors.ConfigError: give config= or the keyword arguments max_num_seqs, not both
            >>> EngineConfig.of(colour="red")
            Traceback (most recent call last):
            ...
            pagedcore.errors.ConfigError: not an Engine setting: colour
        """
        given = {_RENAMED.get(name, name): value for name, value in kwargs.items() if value is not None}
        _lora_kwargs(given)
        if config is not None:
            if not isinstance(config, cls):
                raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
            if given:
                names = ", ".join(sorted(name for name, value in kwargs.items() if value is not None))
                raise ConfigError(f"give config= or the keyword arguments {names}, not both")
            return config
        pool, scheduler, own, unknown = split_kwargs(given, PoolConfig, SchedulerConfig, cls)
        unknown.update({name: own.pop(name) for name in ("pool", "scheduler") if name in own})
        if unknown:
            raise ConfigError(f"not an Engine setting: {', '.join(sorted(unknown))}")
        return cls(PoolConfig(**pool), SchedulerConfig(**scheduler), **own)


def _lora_kwargs(given: dict[str, Any]) -> None:
    """``enable_lora=True`` with ``max_loras`` / ``max_lora_rank`` (vLLM's keywords) as ``lora=LoRAConfig(...)``.

    Example:
        >>> given = {"enable_lora": True, "max_loras": 4}
        >>> _lora_kwargs(given); given
        {'lora': LoRAConfig(max_loras=4, max_lora_rank=16)}
    """
    settings = {name: given.pop(name) for name in ("max_loras", "max_lora_rank") if name in given}
    enable = given.pop("enable_lora", None)
    if not enable and not settings:
        return
    if enable is not True:
        names = ", ".join(sorted(settings)) or "enable_lora"
        raise ConfigError(f"{names}: LoRA settings need enable_lora=True", param="enable_lora")
    if "lora" in given:
        raise ConfigError("give lora= or enable_lora=True (with max_loras, max_lora_rank), not both", param="lora")
    given["lora"] = LoRAConfig(**settings)
