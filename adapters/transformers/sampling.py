"""Per-request sampling parameters and the sampler.

Each sample of each request owns a ``torch.Generator`` seeded from its request's seed, so a seeded request draws
the same tokens whatever else is in the batch, and a recomputed (preempted) request does not draw again.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedcore.errors import InvalidRequestError

__all__ = ["SamplingParams", "sample_tokens"]


@dataclass(frozen=True)
class SamplingParams:
    """How to generate for one request.

    Args:
        max_new_tokens: tokens to generate at most (0 returns at once with no tokens).
        temperature: 0 for greedy decoding, else the softmax temperature (> 0).
        top_k: keep the ``top_k`` most likely tokens (0 = all).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p`` (in (0, 1]).
        seed: seed of this request's random draws (None: drawn from Python's ``random``).
        stop_token_ids: stop after any of these; None means the model's eos token ids.
        ignore_eos: never stop early (benchmarks).
        min_new_tokens: stop tokens are ignored before this many tokens.
        n: parallel samples of the prompt; they share the prompt's KV blocks.
        return_logits: keep each step's float32 logits in the output (for tests and analysis; memory grows with
            ``vocab * tokens``).

    Example:
        >>> SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=1).is_greedy
        False
        >>> SamplingParams(temperature=-1)
        Traceback (most recent call last):
        ...
        pagedcore.errors.InvalidRequestError: temperature must be >= 0, got -1
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    min_new_tokens: int = 0
    n: int = 1
    return_logits: bool = False

    def __post_init__(self) -> None:
        _int("max_new_tokens", self.max_new_tokens, 0)
        _int("top_k", self.top_k, 0)
        _int("min_new_tokens", self.min_new_tokens, 0)
        _int("n", self.n, 1)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise InvalidRequestError(f"temperature must be a number, got {self.temperature!r}")
        if not self.temperature >= 0:  # also catches NaN
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        """Whether tokens are chosen by argmax."""
        return self.temperature == 0

    def generators(self, device: torch.device | str = "cpu") -> list[torch.Generator]:
        """One generator per sample, seeded from ``seed`` (or at random)."""
        seed = self.seed if self.seed is not None else random.getrandbits(63)
        out = []
        for k in range(self.n):
            generator = torch.Generator(device=device)
            generator.manual_seed((seed + 0x9E3779B97F4A7C15 * k) % (2**63))
            out.append(generator)
        return out


def _int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidRequestError(f"{name} must be an integer >= {minimum}, got {value!r}")


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generators: Sequence[torch.Generator]) -> list[int]:
    """Draw ``len(generators)`` tokens from one row of logits ``(vocab,)`` (float32 recommended).

    Example:
        >>> sample_tokens(torch.tensor([0.1, 3.0, 0.2]), SamplingParams(), [torch.Generator()])
        [1]
    """
    if not bool(torch.isfinite(logits).any()):
        raise FloatingPointError("the model produced no finite logit for this sequence")
    if params.is_greedy:
        token = int(torch.argmax(logits))
        return [token] * len(generators)
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token when the tokens before it already reach top_p (the most likely one always stays).
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    return [int(torch.multinomial(probs, 1, generator=g)) for g in generators]
