"""The scheduler's settings (:class:`SchedulerConfig`: its limits and policy) and counters (:class:`SchedulerStats`);
the scheduler itself is :mod:`pagedcore.scheduler`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedcore.errors import ConfigError
from pagedcore.validation import integer

__all__ = ["POLICIES", "SchedulerConfig", "SchedulerStats"]

POLICIES = ("fair", "fcfs", "priority")
"""The scheduling policies (see the module docstring); ``"fair"`` is the default."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling limits.

    Attributes:
        max_num_batched_tokens: tokens computed per step, over all sequences (the token budget).
        max_num_seqs: sequences running at once.
        watermark: fraction of each group's blocks kept free when admitting a new sequence, so running sequences
            can grow without preempting at once.
        enable_prefix_caching: look prompts up in the prefix cache and register computed blocks in it.
        policy: the order of admission and preemption: ``"fair"`` (round-robin over namespaces), ``"fcfs"`` or
            ``"priority"`` (lowest :attr:`SequenceState.priority` first); see the module docstring.

    Example:
        >>> SchedulerConfig(max_num_batched_tokens=0)
        Traceback (most recent call last):
        ...
        pagedcore.errors.ConfigError: max_num_batched_tokens must be an integer >= 1, got 0
        >>> SchedulerConfig().policy, SchedulerConfig(policy="priority").policy
        ('fair', 'priority')
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    policy: str = "fair"

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            object.__setattr__(self, name, integer(name, getattr(self, name), minimum=1, error=ConfigError))
        mark = self.watermark
        if isinstance(mark, bool) or not isinstance(mark, (int, float)) or not 0.0 <= mark < 1.0:  # NaN: refused
            raise ConfigError(f"watermark must be a number in [0, 1), got {mark!r}", param="watermark")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(
                f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}",
                param="enable_prefix_caching",
            )
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(map(repr, POLICIES))}, got {self.policy!r}")


@dataclass
class SchedulerStats:
    """Counters since the scheduler was created.

    Example:
        >>> SchedulerStats().num_steps
        0
    """

    num_steps: int = 0
    num_preemptions: int = 0
    num_admitted: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_computed_tokens: int = 0  # tokens whose KV was computed (prefill and decode)
    num_prompt_tokens_computed: int = 0  # prompt tokens computed, i.e. not served from the prefix cache
