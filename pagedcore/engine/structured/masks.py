"""GrammarMasks: the token masks of a step's constrained rows, filled together and applied in one operation.

Per step: every constrained row's allowed tokens go into one int32 bitmask (one bit per token, bit ``t % 32`` of
word ``t // 32``; several rows are filled by llguidance's parallel call, which releases the GIL), then one gather
turns the bitmask's bytes into ``0`` / ``-inf`` per token and one ``index_add_`` adds that to those rows of the
logits, on the logits' device. Unconstrained rows are not read or written. (``masked_fill`` would be the obvious
apply, but on CPU it is a scalar loop, about 8 ns per element; the lookup-table add is vectorized:
docs/structured.md has the figures.)

A mask never allows a special token that the matcher refuses, nor a stop token before the grammar is complete:
llguidance's may, where the grammar forces text the vocabulary cannot spell or (a stop token) around a special token
the grammar names (:class:`~.vocab.SpecialTokens`); such a bit is cleared after the fill, and a row left with no token
at all has its state's :attr:`~.matcher.GrammarState.error` say so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .matcher import GrammarState
from .vocab import import_llguidance

__all__ = ["GrammarMasks"]

# (256, 8): a bitmask byte -> per bit (token), 0.0 where allowed and -inf where not (bit 0 is the lowest token).
_BITS = (torch.arange(256)[:, None] >> torch.arange(8)[None, :]) & 1
_PENALTY = torch.where(_BITS.bool(), 0.0, float("-inf"))


class GrammarMasks:
    """Applies the grammars of constrained rows to a step's logits.

    Args:
        threads: threads of llguidance's parallel fill (None: up to 8, half the CPUs).

    Example:
        >>> from pagedcore.adapters.transformers.builtin import builtin_tokenizer
        >>> from pagedcore.engine.structured import GrammarCompiler, GrammarState, StructuredOutput
        >>> tok = builtin_tokenizer()
        >>> compiler = GrammarCompiler(tok, vocab_size=99)
        >>> state = GrammarState(compiler.compile(StructuredOutput.choice(["yes", "no"])))
        >>> logits = torch.zeros(2, 99)
        >>> GrammarMasks().apply(logits, [1], [state])    # row 1 is constrained, row 0 is not
        >>> allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
        >>> tok.convert_ids_to_tokens(allowed), bool(logits[0].eq(0).all())
        (['n', 'y'], True)
        >>> compiler.close()
    """

    def __init__(self, threads: int | None = None) -> None:
        import os

        self._threads = threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        self._executor: Any = None
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)
        self._penalty: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def apply(self, logits: torch.Tensor, rows: Sequence[int], states: Sequence[GrammarState]) -> None:
        """Mask ``logits (batch, vocab)`` in place: row ``rows[i]`` may only draw what ``states[i]`` allows."""
        if not rows:
            return
        self.apply_bitmask(logits, rows, self.fill(states))

    def fill(self, states: Sequence[GrammarState]) -> torch.Tensor:
        """The bitmask ``(len(states), ceil(vocab_size / 32))`` of the states' allowed next tokens, over their
        grammars' vocabulary (one for all: one compiler's), in a reused buffer valid until the next call."""
        sizes = {state.vocab_size for state in states}
        if len(sizes) != 1:
            raise ValueError(f"one step's grammars must share one vocabulary, got sizes {sorted(sizes)}")
        words = (sizes.pop() + 31) // 32
        count = len(states)
        if self._bitmask.shape[0] < count or self._bitmask.shape[1] != words:
            self._bitmask = torch.empty(max(count, 2 * self._bitmask.shape[0]), words, dtype=torch.int32)
        bitmask = self._bitmask[:count]
        if count == 1:
            states[0].fill(bitmask, 0)
        else:
            llg = import_llguidance()
            if self._executor is None:
                self._executor = llg.LLExecutor(num_threads=self._threads)
            llg.torch.fill_next_token_bitmask_par(
                self._executor, [(s.matcher, i) for i, s in enumerate(states)], bitmask
            )
        _refuse_special(bitmask, states)
        return bitmask

    def apply_bitmask(self, logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
        """Add ``0`` / ``-inf`` from ``bitmask (len(rows), words)`` to those rows of ``logits`` (in place); columns
        past the bitmask's tokens (a model wider than its grammar's vocabulary) are never allowed."""
        vocab = logits.shape[1]
        table = self._table(logits.device, logits.dtype)
        index = bitmask.view(torch.uint8).reshape(-1).to(logits.device, non_blocking=True).long()
        penalty = table.index_select(0, index).view(len(rows), -1)  # (rows, words * 32)
        covered = min(vocab, penalty.shape[1])
        first = rows[0]
        if list(rows) == list(range(first, first + len(rows))):  # contiguous rows: a view, no scatter
            logits[first : first + len(rows), :covered].add_(penalty[:, :covered])
            if covered < vocab:
                logits[first : first + len(rows), covered:] = float("-inf")
            return
        where = torch.tensor(list(rows), device=logits.device)
        if covered < vocab:
            penalty = torch.cat(
                [penalty[:, :covered], penalty.new_full((len(rows), vocab - covered), float("-inf"))], 1
            )
        logits.index_add_(0, where, penalty[:, :vocab])

    def _table(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        table = self._penalty.get((device, dtype))
        if table is None:
            table = self._penalty[(device, dtype)] = _PENALTY.to(device=device, dtype=dtype)
        return table


def _refuse_special(bitmask: torch.Tensor, states: Sequence[GrammarState]) -> None:
    """Clear the bits of the special tokens the states' matchers refuse, and of the stop tokens where a grammar is
    not complete (one gather over the words that hold them; a state is asked only about a bit that is set); a row
    left with no token is marked stuck."""
    special = states[0].special
    if any(state.special is not special for state in states):  # grammars of several compilers: row by row
        for i, state in enumerate(states):
            _refuse_special(bitmask[i : i + 1], [state])
        return
    if not special.words.size:
        return
    words = bitmask.numpy().view(np.uint32)
    hits = words[:, special.words] & special.bits
    if not hits.any():
        return
    cleared: set[int] = set()
    stop_hits = hits & special.stop_bits
    if stop_hits.any():  # a stop token ends the output: allowed where the grammar is complete (GrammarState.accept)
        for row in np.flatnonzero(stop_hits.any(axis=1)).tolist():
            if not states[row].is_complete:
                words[row, special.words] &= special.keep_bits
                cleared.add(row)
        hits ^= stop_hits
    for row, col in zip(*(index.tolist() for index in np.nonzero(hits))):
        state, word, bits = states[row], int(special.words[col]), int(hits[row, col])
        while bits:
            low = bits & -bits
            bits ^= low
            if not state.matcher.validate_tokens([word * 32 + low.bit_length() - 1]):
                words[row, word] &= np.uint32(~low & 0xFFFFFFFF)
                cleared.add(row)
    for row in cleared:
        if not words[row].any():
            states[row].set_stuck()
