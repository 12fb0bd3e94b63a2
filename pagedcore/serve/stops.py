"""Stop sequences as OpenAI applies them: generation ends where the text first contains a stop string, and the
stop string itself is not returned.

One :class:`StopChecker` follows one sample. It sees the text each token adds (and the token id, so that a stop
string which is one vocabulary token also matches when that token decodes to nothing, e.g. a special token such
as ``<|im_end|>``), and releases text only when it can no longer turn out to be the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

__all__ = ["StopChecker"]


class StopChecker:
    """Incremental stop-string matching for one sample.

    Args:
        stop: stop strings (non-empty).
        stop_token_ids: token ids that stop generation too (the ids of stop strings that are one token); the
            text of the token that stops is not returned.

    :meth:`feed` returns the text that is safe to send (it never contains a stop string or a prefix of one that
    may still complete) and whether the sample stopped; :meth:`flush` returns what was held back once the sample
    ends for another reason. A match ends the text at the stop string that completes first (the earliest-starting
    one if several complete on the same character).

    Example:
        >>> checker = StopChecker(["\\nUser:"])
        >>> checker.feed("Hello"), checker.feed(" there\\nUs"), checker.feed("er: hi")
        (('', False), ('Hello the', False), ('re', True))
        >>> checker.text
        'Hello there'
    """

    def __init__(self, stop: Sequence[str] = (), stop_token_ids: Collection[int] = ()) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self._stop = tuple(stop)
        self._stop_ids = frozenset(stop_token_ids)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._buffer = ""  # all text seen (up to the stop, once stopped)
        self._sent = 0  # characters of _buffer already returned
        self.stopped = False

    @property
    def text(self) -> str:
        """The sample's text so far (cut before the stop string once stopped)."""
        return self._buffer

    def feed(self, delta: str, token_id: int | None = None) -> tuple[str, bool]:
        """Add one token's text; returns ``(text safe to send, stopped)``. Nothing is returned after a stop."""
        if self.stopped:
            return "", True
        before = len(self._buffer)
        self._buffer += delta
        cut = self._find(before)
        if cut is None and token_id is not None and token_id in self._stop_ids:
            cut = before
        if cut is not None:
            self._buffer = self._buffer[:cut]
            self.stopped = True
            return self._release(len(self._buffer)), True
        return self._release(len(self._buffer) - self._hold), False

    def flush(self) -> str:
        """The text held back, when the sample ends without a stop string (length or end of sequence)."""
        return self._release(len(self._buffer))

    def _find(self, before: int) -> int | None:
        """Start of the stop string that completes first in the new text, or None."""
        best: tuple[int, int] | None = None  # (end, start)
        for s in self._stop:
            start = self._buffer.find(s, max(0, before - len(s) + 1))
            if start >= 0 and (best is None or (start + len(s), start) < best):
                best = (start + len(s), start)
        return None if best is None else best[1]

    def _release(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        out = self._buffer[self._sent : upto]
        self._sent = upto
        return out
