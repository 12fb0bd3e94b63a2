"""A request: what a caller asks (:class:`Request`), and the Engine's state of it from admission to its report
(:class:`RequestState`).

A front end converts what it received once, at its edge (the server's request bodies, ``generate``'s arguments),
into :class:`Request` objects; the Engine validates one in :meth:`~pagedcore.engine.engine.Engine.add_request` and
tracks it as a :class:`RequestState` until it reports it. The request's tokens live in its
:class:`~pagedcore.sequence.SequenceState` (and, once it forked, in its samples' sequences: ``sequence.forks``), its
text in one :class:`~.stopping.SampleText` per sample; its :class:`~.outputs.RequestOutput` gets each sample's tokens
and text when that sample finishes. Nothing is stored twice while it runs.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from pagedcore.sequence import SequenceState

from .outputs import RequestOutput
from .sampling import SampleRow, SamplingParams
from .stopping import SampleText
from .structured.requests import RequestGrammar

__all__ = ["EngineRequest", "Request", "RequestState"]


@dataclass(frozen=True)
class Request:
    """One request as a caller hands it to the Engine (or to a loop that runs one).

    Args:
        prompt: token ids, or a text the Engine's tokenizer encodes (a 1-D tensor of ids too).
        params: its sampling parameters (stop strings, structured output and log-probabilities included).
        request_id: its id (None: the Engine picks one); no ``#``, which marks a parallel sample's sequence.
        namespace: its prefix-cache namespace (the tenant): it shares cached blocks only within it.
        priority: with the ``"priority"`` scheduling policy, lower values are admitted first.
        lora: the name of the LoRA adapter to serve it with (None: the base model); see :mod:`.lora`.

    Example:
        >>> Request([5, 6, 7], SamplingParams(max_new_tokens=4), namespace="tenant-a").params.max_new_tokens
        4
    """

    prompt: str | Sequence[int] | torch.Tensor
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    namespace: Hashable = None
    priority: int = 0
    lora: str | None = None


@dataclass(eq=False, slots=True)
class RequestState:
    """A validated request: what the scheduler computes for it, each sample's text, its output, who reports it.

    Attributes:
        request_id: its id.
        params: its parameters.
        sequence: what the scheduler computes (sample 0's sequence; the others fork from it), or None when there is
            nothing to compute (``max_new_tokens=0``).
        output: its output; a sample's tokens and text are filled in when it finishes.
        texts: per sample, its text (decoded incrementally, cut at a stop string).
        generators: per sample, its random generator.
        owner: the ``generate``/``stream`` call that reports it, or None for ``step()``/``step_events()``.
        done: samples finished.
        grammar: its structured output's grammar and each sample's state in it, or None.
        rows: per sample, its sampling row while nothing in it changes from step to step (``engine.batch``).

    Example:
        >>> from pagedcore.engine.outputs import RequestMetrics, SampleOutput
        >>> from pagedcore.engine.stopping import StopStrings
        >>> out = RequestOutput("r", [5], [SampleOutput(0)], RequestMetrics(0.0))
        >>> texts = [SampleText(None, StopStrings())]
        >>> request = RequestState("r", SamplingParams(), SequenceState("r", [5], 4), out, texts, [])
        >>> request.is_done, request.sample_sequence(0) is request.sequence
        (False, True)
    """

    request_id: str
    params: SamplingParams
    sequence: SequenceState | None
    output: RequestOutput
    texts: list[SampleText]
    generators: list[torch.Generator]
    owner: object | None = None
    done: int = 0
    grammar: RequestGrammar | None = None
    rows: dict[int, SampleRow] = field(default_factory=dict, repr=False)

    @property
    def is_done(self) -> bool:
        """Whether every sample has finished."""
        return self.done == len(self.output.samples)

    def sample_sequence(self, index: int) -> SequenceState | None:
        """The sequence of sample ``index`` (None before the request forked into its samples, or without one)."""
        if self.sequence is None or index == 0:
            return self.sequence
        forks = self.sequence.forks
        return forks[index - 1] if index <= len(forks) else None

    def sequences(self) -> list[SequenceState]:
        """Every sequence of the request so far (sample 0's, then its forks)."""
        return [] if self.sequence is None else [self.sequence, *self.sequence.forks]


EngineRequest = RequestState  # its old name
