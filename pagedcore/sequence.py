"""SequenceState: one request's tokens and progress, as the scheduler sees it. Plain data, no tensors.

It was called ``Sequence``, which shadowed ``collections.abc.Sequence`` wherever both were used; that name still
works (``pagedcore.Sequence``, ``pagedcore.sequence.Sequence``) with a ``DeprecationWarning``.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Hashable
from dataclasses import dataclass, field

from pagedcore.block_tables import BlockTables
from pagedcore.errors import InvalidRequestError
from pagedcore.validation import integer, token_ids

__all__ = ["FinishReason", "SequenceState", "SequenceStatus"]


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life.

    Example:
        >>> SequenceState("r", [1], max_new_tokens=1).status
        <SequenceStatus.WAITING: 'waiting'>
    """

    WAITING = "waiting"  # queued (new, or preempted and re-queued)
    RUNNING = "running"  # holds blocks and is scheduled step after step
    FINISHED = "finished"  # done; holds nothing


class FinishReason(str, enum.Enum):
    """Why a sequence finished.

    Example:
        >>> SequenceState("r", [1], max_new_tokens=1).append_token(5)
        <FinishReason.LENGTH: 'length'>
    """

    STOP = "stop"  # produced a stop token
    LENGTH = "length"  # reached max_new_tokens
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # the step that computed it failed


@dataclass(eq=False, slots=True)
class SequenceState:
    """One sequence of tokens: a prompt, the tokens generated so far, and how far its KV has been computed.

    Args:
        request_id: unique among waiting and running sequences.
        prompt_token_ids: the prompt (non-empty).
        max_new_tokens: tokens to generate at most (>= 1).
        stop_token_ids: generation stops after any of these (the one place stop tokens are checked: eos, the
            request's stop tokens, and the ids of stop strings that are special tokens; stop strings in the text are
            the Engine's, which finishes the sequence through ``Scheduler.finish``).
        namespace: prefix-cache namespace (cache salt); sequences in different namespaces never share blocks.
        num_samples: parallel samples (``n``); the sequence forks into that many once its prompt is computed.
        min_new_tokens: stop tokens are ignored before this many tokens were generated.
        priority: scheduling priority under ``SchedulerConfig(policy="priority")``: lower values run first (vLLM's
            convention); any integer, 0 by default (other policies refuse a non-zero one).
        read_prefix_cache: whether admission may start from a cached prefix; False computes every position at every
            admission (its blocks are still cached for others), for callers that need each prompt position's logits
            (prompt log-probabilities; vLLM's ``skip_reading_prefix_cache``).

    Example:
        >>> seq = SequenceState("r1", [5, 6, 7], max_new_tokens=2, stop_token_ids=frozenset({0}))
        >>> seq.num_tokens, seq.num_uncomputed_tokens
        (3, 3)
    """

    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    namespace: Hashable = None
    num_samples: int = 1
    min_new_tokens: int = 0
    priority: int = 0
    read_prefix_cache: bool = True
    # --- owned by the scheduler
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at the latest admission
    num_preemptions: int = 0
    sample_index: int = 0  # which of the parent's samples this is (0 for the parent)
    group_id: str = ""  # the request this sequence belongs to (its own id, or its parent's after a fork)
    forks: list[SequenceState] = field(default_factory=list, repr=False)  # the parent's samples 1 .. n-1, once forked
    blocks: BlockTables | None = field(default=None, repr=False)
    _token_ids: list[int] = field(default_factory=list, repr=False)
    _num_prompt: int = 0
    _forked: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequestError(f"request_id must be a non-empty str, got {self.request_id!r}")
        prompt = list(self.prompt_token_ids)
        if not prompt:
            raise InvalidRequestError(f"request {self.request_id!r}: the prompt is empty")
        prompt = token_ids(prompt, name=f"request {self.request_id!r}: prompt token ids")
        where = f"request {self.request_id!r}: "
        self.max_new_tokens = integer(where + "max_new_tokens", self.max_new_tokens, minimum=1)
        self.num_samples = integer(where + "num_samples", self.num_samples, minimum=1)
        self.min_new_tokens = integer(where + "min_new_tokens", self.min_new_tokens, minimum=0)
        self.priority = integer(where + "priority", self.priority)
        try:
            hash(self.namespace)
        except TypeError:
            raise InvalidRequestError(
                f"request {self.request_id!r}: namespace must be hashable (a str is best), got {self.namespace!r}"
            ) from None
        self.stop_token_ids = frozenset(self.stop_token_ids)
        self.prompt_token_ids = prompt
        self._token_ids = list(prompt)
        self._num_prompt = len(prompt)
        self._forked = self.num_samples == 1
        if not self.group_id:
            self.group_id = self.request_id

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by generated tokens (the live list: do not modify)."""
        return self._token_ids

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens so far."""
        return self._token_ids[self._num_prompt :]

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self._token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return self._num_prompt

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self._token_ids) - self._num_prompt

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV still has to be computed."""
        return len(self._token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        """Whether the sequence is done."""
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_fork(self) -> bool:
        """Whether its next sampling step produces ``num_samples`` tokens and forks the sequence."""
        return not self._forked

    def append_token(self, token_id: int) -> FinishReason | None:
        """Add a generated token; returns why the sequence is now finished, if it is."""
        tokens = self._token_ids
        tokens.append(token_id)
        n = len(tokens) - self._num_prompt
        if token_id in self.stop_token_ids and n >= self.min_new_tokens:
            return FinishReason.STOP
        if n >= self.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def child(self, request_id: str, sample_index: int) -> SequenceState:
        """A copy of this sequence for parallel sample ``sample_index``, without blocks (see ``Scheduler``); the
        parent lists it in :attr:`forks`, so whoever owns the samples finds each one's tokens.

        Example:
            >>> parent = SequenceState("r", [5, 6], max_new_tokens=4, num_samples=2)
            >>> child = parent.child("r#1", 1)
            >>> parent.forks == [child], child.token_ids, child.group_id
            (True, [5, 6], 'r')
        """
        seq = SequenceState(
            request_id,
            self.prompt_token_ids,
            self.max_new_tokens,
            self.stop_token_ids,
            self.namespace,
            1,
            self.min_new_tokens,
            self.priority,
        )
        seq._token_ids = list(self._token_ids)
        seq.num_computed_tokens = self.num_computed_tokens
        seq.num_cached_tokens = self.num_cached_tokens
        seq.sample_index = sample_index
        seq.group_id = self.group_id
        self.forks.append(seq)
        return seq

    def mark_forked(self) -> None:
        """Record that the parallel samples were created."""
        self._forked = True


def __getattr__(name: str) -> type[SequenceState]:
    if name == "Sequence":
        return deprecated_sequence()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def deprecated_sequence() -> type[SequenceState]:
    """:class:`SequenceState`, for code that still asks for it by its old name ``Sequence`` (with a warning).

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True):
        ...     deprecated_sequence() is SequenceState
        True
    """
    warnings.warn(
        "pagedcore.Sequence was renamed SequenceState (it shadowed collections.abc.Sequence); the old name will go",
        DeprecationWarning,
        stacklevel=3,
    )
    return SequenceState
