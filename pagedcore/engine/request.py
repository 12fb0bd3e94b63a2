"""EngineRequest: one request as the Engine tracks it, from the moment it was validated to its report.

The request's tokens live in its :class:`~pagedcore.sequence.SequenceState` (and, once it forked, in its samples'
sequences: ``sequence.forks``), its text in one :class:`~.stopping.SampleText` per sample; its
:class:`~.outputs.RequestOutput` gets each sample's tokens and text when that sample finishes. Nothing is stored
twice while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedcore.sequence import SequenceState

from .outputs import RequestOutput
from .sampling import SamplingParams
from .stopping import SampleText
from .structured.requests import RequestGrammar

__all__ = ["EngineRequest"]


@dataclass(eq=False)
class EngineRequest:
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

    Example:
        >>> from pagedcore.adapters.transformers import RequestMetrics, SampleOutput
        >>> from pagedcore.engine.stopping import StopStrings
        >>> out = RequestOutput("r", [5], [SampleOutput(0)], RequestMetrics(0.0))
        >>> texts = [SampleText(None, StopStrings())]
        >>> request = EngineRequest("r", SamplingParams(), SequenceState("r", [5], 4), out, texts, [])
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
