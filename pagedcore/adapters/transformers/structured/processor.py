"""StructuredLogitsProcessor: structured outputs for plain ``model.generate``, with or without ``enable()``.

transformers calls a logits processor with the whole ``input_ids`` so far and the next token's scores. Each row's
generated tokens (after the prompt) say where its grammar is: a row whose history extends a row of the previous
call continues that row's state (forked when several rows continue one, as beams and ``num_return_sequences`` do),
and any other history is rebuilt from the start. So greedy, sampling, ``num_return_sequences`` and beam search
(which reorders rows between steps) all keep each row's grammar exact.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import LogitsProcessor

from pagedcore.engine.structured.compiler import GrammarCompiler
from pagedcore.engine.structured.masks import GrammarMasks
from pagedcore.engine.structured.matcher import GrammarState
from pagedcore.engine.structured.spec import StructuredOutput
from pagedcore.errors import GrammarError

__all__ = ["StructuredLogitsProcessor"]


class StructuredLogitsProcessor(LogitsProcessor):
    """Constrain ``model.generate`` by a :class:`StructuredOutput` (or a dict of one, or OpenAI's
    ``response_format``).

    Args:
        structured: what to constrain to.
        tokenizer: the model's tokenizer.
        vocab_size: the model's logits width (``model.config.vocab_size``); None: the tokenizer's size.
        stop_token_ids: the tokens that end the output when the grammar is complete (None: the tokenizer's eos).
            Pass ``generate`` the same ones as ``eos_token_id`` so it stops there.
        compiler: a :class:`GrammarCompiler` to share (its cache) between processors; None: a new one.

    The spec is compiled here, so bad input raises :class:`~pagedcore.errors.GrammarError` before ``generate``
    runs; a row whose grammar cannot go on (no token of the vocabulary may come next, or a limit of llguidance's
    exceeded) raises it from ``generate``. A row that ended (its stop token accepted, or a pad token after it) is
    left alone. Use one processor per
    ``generate`` call (a new call with another prompt starts again by itself).

    Example:
        >>> import json, torch
        >>> from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer
        >>> model, tok = builtin_model(num_hidden_layers=1), builtin_tokenizer()
        >>> schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        ...           "additionalProperties": False}
        >>> processor = StructuredLogitsProcessor({"json_schema": schema}, tok, vocab_size=99)
        >>> out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=40, do_sample=False,
        ...                      logits_processor=[processor], eos_token_id=tok.eos_token_id)
        >>> json.loads(tok.decode(out[0, 3:], skip_special_tokens=True))["ok"] in (True, False)
        True
    """

    def __init__(
        self,
        structured: StructuredOutput | Mapping[str, Any],
        tokenizer: Any,
        *,
        vocab_size: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        compiler: GrammarCompiler | None = None,
    ) -> None:
        spec = _spec(structured)
        if compiler is None:
            compiler = GrammarCompiler(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.spec = spec
        self.compiler = compiler
        self._compiled = compiler.compile(spec)
        self._masks = GrammarMasks()
        self._prompt: torch.Tensor | None = None
        self._states: dict[tuple[int, ...], GrammarState | None] = {}

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """Mask ``scores (batch, vocab)`` in place so each row draws only what its grammar allows next."""
        if not self._continues(input_ids):
            self._prompt = input_ids.detach().clone().cpu()
            self._states = {}
        assert self._prompt is not None
        histories = [tuple(row) for row in input_ids[:, self._prompt.shape[1] :].tolist()]
        previous = self._states
        current: dict[tuple[int, ...], GrammarState | None] = {}
        children = Counter(h[:-1] for h in set(histories) if h)  # rows continuing each previous row
        rows, states = [], []
        for i, history in enumerate(histories):
            if history in current:  # an identical row this call: its own copy of the same state
                state = current[history]
                state = state.fork() if state is not None else None
            else:
                state = self._state_for(history, previous, children)
                current[history] = state
            if state is not None and not state.is_terminated:
                rows.append(i)
                states.append(state)
        self._states = current
        self._masks.apply(scores, rows, states)
        for i, state in zip(rows, states):
            if state.error is not None:  # no token may come (or llguidance's limits): generate cannot go on validly
                raise GrammarError(f"{self.spec.describe()}: row {i}: {state.error}")
        return scores

    def _continues(self, input_ids: torch.Tensor) -> bool:
        """Whether this call continues the previous one (same prompt rows, more tokens)."""
        prompt = self._prompt
        if prompt is None or input_ids.shape[0] != prompt.shape[0] or input_ids.shape[1] <= prompt.shape[1]:
            return prompt is not None and input_ids.shape == prompt.shape and bool(torch.equal(input_ids.cpu(), prompt))
        return bool(torch.equal(input_ids[:, : prompt.shape[1]].cpu(), prompt))

    def _state_for(
        self,
        history: tuple[int, ...],
        previous: dict[tuple[int, ...], GrammarState | None],
        children: Counter[tuple[int, ...]],
    ) -> GrammarState | None:
        """The state after ``history``: the previous call's row it extends (forked while other rows still have to
        continue it, taken by the last), else a fresh state that consumes it all. None once the row ended or left
        the grammar."""
        parent_key = history[:-1]
        if history and parent_key in previous:
            parent = previous[parent_key]
            children[parent_key] -= 1
            if parent is None or parent.is_terminated:
                return None
            state = parent.fork() if children[parent_key] > 0 else parent
            return state if state.accept(history[-1]) else None
        state = GrammarState(self._compiled)
        return state if state.sync(history) else None


def _spec(structured: StructuredOutput | Mapping[str, Any]) -> StructuredOutput:
    if isinstance(structured, Mapping) and "type" in structured:  # OpenAI's response_format
        spec = StructuredOutput.from_response_format(structured)
        if spec is None:
            raise GrammarError('response_format {"type": "text"} is no constraint: do not pass a processor')
        return spec
    return StructuredOutput.from_value(structured)
