"""Log-probabilities, batched: of the tokens a step drew (``logprobs=k``) and of the prompt's own tokens
(``prompt_logprobs=k``).

Both are taken from the model's logits as they come, in float32 (``log_softmax``), before any logits processing:
vLLM's default (``raw_logprobs``), so they are the model's distribution whatever penalties, biases or temperature a
request asked for (a greedy row's token is then rank 1 unless a processor changed the argmax). A token's rank is
the number of tokens at least as likely as it (vLLM's rule); the top ``k`` come most likely first with ranks
1 .. k. One pass per step over the rows that asked: a ``topk`` of the largest ``k`` among them, one gather and one
comparison for the ranks, one copy to Python lists.

Example:
    >>> import torch
    >>> (entry,) = sample_logprobs(torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0]]), -1), [1], [[1]])[0]
    >>> entry.token.token_id, entry.token.rank, [t.token_id for t in entry.top]
    (1, 2, [0])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .outputs import Logprob, TokenLogprobs

__all__ = ["PROMPT_CHUNK", "prompt_logprobs", "sample_logprobs", "token_logprobs"]

PROMPT_CHUNK = 256
"""Prompt positions whose ``log_softmax`` is taken at once (bounds the step's extra memory to this many rows)."""


def token_logprobs(logprobs: torch.Tensor, targets: Sequence[int], ks: Sequence[int]) -> list[TokenLogprobs]:
    """Per row ``i`` of ``logprobs (rows, vocab)``: the :class:`TokenLogprobs` of token ``targets[i]`` with the top
    ``ks[i]`` tokens.

    Example:
        >>> lp = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
        >>> [(e.token.rank, len(e.top)) for e in token_logprobs(lp, [2, 0], [0, 2])]
        [(3, 0), (3, 2)]
    """
    rows = logprobs.shape[0]
    if rows == 0:
        return []
    device = logprobs.device
    chosen = logprobs.gather(1, torch.tensor(list(targets), dtype=torch.int64, device=device)[:, None])  # (rows, 1)
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()
    values = chosen[:, 0].tolist()
    k_max = max(ks)
    top_values: list[list[float]] = [[]] * rows
    top_ids: list[list[int]] = [[]] * rows
    if k_max:
        top = torch.topk(logprobs, k_max, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    return [
        TokenLogprobs(
            Logprob(int(targets[i]), values[i], ranks[i]),
            tuple(Logprob(top_ids[i][j], top_values[i][j], j + 1) for j in range(ks[i])),
        )
        for i in range(rows)
    ]


def sample_logprobs(
    logprobs: torch.Tensor, ks: Sequence[int], tokens: Sequence[Sequence[int]]
) -> list[list[TokenLogprobs]]:
    """Per row of ``logprobs (rows, vocab)`` (a step's ``log_softmax`` rows that asked), the entries of the tokens
    drawn from it (several at the step that forks a request into its samples), each with its row's top ``ks[i]``.

    Example:
        >>> lp = torch.log_softmax(torch.tensor([[0.0, 1.0]]), -1)
        >>> [[e.token.token_id for e in entries] for entries in sample_logprobs(lp, [0], [[1, 0]])]
        [[1, 0]]
    """
    if all(len(drawn) == 1 for drawn in tokens):
        found = token_logprobs(logprobs, [drawn[0] for drawn in tokens], ks)
        return [[entry] for entry in found]
    rows = [i for i, drawn in enumerate(tokens) for _ in drawn]
    flat = token_logprobs(
        logprobs[torch.tensor(rows, device=logprobs.device)],
        [token for drawn in tokens for token in drawn],
        [ks[i] for i in rows],
    )
    out: list[list[TokenLogprobs]] = [[] for _ in tokens]
    for i, entry in zip(rows, flat):
        out[i].append(entry)
    return out


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], ks: Sequence[int]) -> list[TokenLogprobs]:
    """The prompt positions' entries: ``logits (rows, vocab)`` (float32, as the model gave them) of positions whose
    next token is ``targets[i]``, with the top ``ks[i]``; :data:`PROMPT_CHUNK` rows at a time.

    Example:
        >>> [e.token.token_id for e in prompt_logprobs(torch.tensor([[0.0, 3.0], [2.0, 0.0]]), [1, 1], [1, 1])]
        [1, 1]
    """
    out: list[TokenLogprobs] = []
    for start in range(0, logits.shape[0], PROMPT_CHUNK):
        end = start + PROMPT_CHUNK
        chunk = torch.log_softmax(logits[start:end].float(), dim=-1)
        out.extend(token_logprobs(chunk, targets[start:end], ks[start:end]))
    return out
