"""OpenAI's and vLLM's shapes for log-probabilities: the Engine's :class:`~pagedcore.engine.outputs.
TokenLogprobs` as completions' ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``),
chat's ``logprobs.content[]`` and vLLM's ``prompt_logprobs``.

Tokens are shown as the tokenizer decodes each alone (a token that is part of a character shows as ``\\ufffd``, as
vLLM shows it), or as ``token_id:ID`` with ``return_tokens_as_token_ids`` (or without a tokenizer). A log-probability
of ``-inf`` is shown as -9999.0 (vLLM's floor: JSON has no infinity).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedcore.engine.outputs import Logprob, TokenLogprobs

__all__ = ["LogprobFormat", "PromptEntry"]

_FLOOR = -9999.0

PromptEntry = tuple[int, TokenLogprobs | None]
"""One position of a completion's log-probabilities: its token id and its entry (None: the prompt's first token)."""


@dataclass(frozen=True)
class LogprobFormat:
    """How one answer shows log-probabilities.

    Args:
        decode: one token id's text (None: show ids, ``token_id:ID``).
        as_ids: show every token as ``token_id:ID`` (vLLM's ``return_tokens_as_token_ids``).

    Example:
        >>> fmt = LogprobFormat(lambda t: "ab"[t])
        >>> entry = TokenLogprobs(Logprob(1, -0.5, 2), (Logprob(0, -0.25, 1),))
        >>> fmt.completion([(0, None), (1, entry)])
        {'tokens': ['a', 'b'], 'token_logprobs': [None, -0.5], 'top_logprobs': [None, {'a': -0.25, 'b': -0.5}], \
'text_offset': [0, 1]}
        >>> fmt.chat([entry])["content"][0]["top_logprobs"]
        [{'token': 'a', 'logprob': -0.25, 'bytes': [97]}]
    """

    decode: Callable[[int], str] | None = None
    as_ids: bool = False

    def token(self, token_id: int) -> str:
        """The token as the answer shows it."""
        if self.as_ids or self.decode is None:
            return f"token_id:{token_id}"
        return self.decode(token_id)

    def completion(self, entries: Sequence[PromptEntry], offset: int = 0) -> dict[str, Any]:
        """Completions' ``logprobs`` of these positions; ``offset`` is the first token's place in the text."""
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, entry in entries:
            text = self.token(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(_value(entry.token))
            top = {self.token(t.token_id): _value(t) for t in entry.top}
            top.setdefault(text, _value(entry.token))  # the chosen token too (vLLM: k + 1 entries at most)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """Chat's ``logprobs``: ``{"content": [...]}``, one item per token with its ``top_logprobs``."""
        content = []
        for entry in entries:
            item = self._chat_item(entry.token)
            item["top_logprobs"] = [self._chat_item(t) for t in entry.top]
            content.append(item)
        return {"content": content}

    def prompt(self, entries: Sequence[PromptEntry]) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{id: {logprob, rank, decoded_token}}``
        of the token and the most likely ones."""
        out: list[dict[str, dict[str, Any]] | None] = []
        for _, entry in entries:
            if entry is None:
                out.append(None)
                continue
            shown = {str(t.token_id): self._vllm(t) for t in entry.top}
            shown.setdefault(str(entry.token.token_id), self._vllm(entry.token))
            out.append(shown)
        return out

    def _chat_item(self, logprob: Logprob) -> dict[str, Any]:
        text = self.token(logprob.token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8", "surrogatepass"))}

    def _vllm(self, logprob: Logprob) -> dict[str, Any]:
        return {"logprob": _value(logprob), "rank": logprob.rank, "decoded_token": self.token(logprob.token_id)}


def _value(logprob: Logprob) -> float:
    return max(logprob.logprob, _FLOOR)
