"""Stop strings and each sample's text: the one place that decides what text a sample shows and where it stops.

The Engine gives every sample a :class:`SampleText`. Each generated token goes through the sample's
:class:`~.detokenizer.IncrementalDetokenizer` (complete characters only), then through the stop strings: a stop
string matches in the text across token boundaries, and the sample finishes in the step that produced the token
completing it. The text ends before the stop string (OpenAI's and vLLM's rule), or after it with
``include_stop_str_in_output``; text that could still turn out to be the start of a stop string is held back until
it cannot, so what was streamed is never taken back. A stop string that is exactly the text of a special token (e.g.
``<|im_end|>``, which ``skip_special_tokens`` drops from the text) matches by token id instead: :func:`stop_strings`
finds those ids, and the sequence stops on them as on any stop token (``SequenceState.append_token``).

Before ``min_new_tokens`` tokens nothing stops a sample: stop tokens are masked and stop strings are not matched
(vLLM's ``min_tokens`` rule).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedcore.errors import InvalidRequestError

from .detokenizer import IncrementalDetokenizer

__all__ = ["SampleText", "StopMatcher", "StopStrings", "stop_strings"]


class StopMatcher:
    """Every stop string matched at once, one character at a time (Aho-Corasick): a step costs the same for one
    stop string or thousands, so one request's long list does not slow the loop every request shares.

    A state is a node of the stop strings' trie: the longest suffix of the text so far that begins some stop string.
    :meth:`advance` feeds characters; :attr:`longest` [state] is the longest stop string ending at the last one
    (None: none does), :attr:`keep` [state] how many trailing characters could still begin one (they are held).

    Example:
        >>> m = StopMatcher(("lo", "hello"))
        >>> state = m.advance(0, "hel")
        >>> m.keep[state], m.longest[m.advance(state, "lo")]
        (3, 'hello')
    """

    __slots__ = ("_fail", "_goto", "keep", "longest")

    def __init__(self, strings: Sequence[str]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth, own = [0], [""]
        for string in strings:
            node = 0
            for char in string:
                child = goto[node].get(char)
                if child is None:
                    child = goto[node][char] = len(goto)
                    goto.append({})
                    depth.append(depth[node] + 1)
                    own.append("")
                node = child
            own[node] = string
        fail, keep = [0] * len(goto), [0] * len(goto)
        longest: list[str | None] = [None] * len(goto)
        order = deque(goto[0].values())
        while order:  # breadth first: a node's fallback is shallower, so it is done before the node
            node = order.popleft()
            longest[node] = own[node] or longest[fail[node]]
            keep[node] = depth[node] if goto[node] else keep[fail[node]]
            for char, child in goto[node].items():
                back = fail[node]
                while back and char not in goto[back]:
                    back = fail[back]
                fail[child] = goto[back].get(char, 0) if node else 0
                order.append(child)
        self._goto, self._fail = goto, fail
        self.longest = longest
        self.keep = keep

    def advance(self, state: int, text: str) -> int:
        """The state after ``text``."""
        goto, fail = self._goto, self._fail
        for char in text:
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, 0)
        return state

    def first(self, state: int, text: str) -> tuple[int, int, str | None]:
        """Feed ``text`` until a stop string ends: ``(state, characters fed, that stop string)``, or ``(state,
        len(text), None)`` when none does."""
        longest = self.longest
        for i, char in enumerate(text):
            state = self.advance(state, char)
            if longest[state] is not None:
                return state, i + 1, longest[state]
        return state, len(text), None


@dataclass(frozen=True)
class StopStrings:
    """A request's stop strings, ready to match.

    Attributes:
        strings: matched in the text.
        by_id: token id -> stop string, for stop strings that are a special token's text (matched by id).
        include: keep the stop string at the end of the text (``include_stop_str_in_output``).

    Example:
        >>> StopStrings(("\\n",)).hold("ab\\n"), StopStrings(("ab", "bc")).hold("xab")
        (0, 1)
    """

    strings: tuple[str, ...] = ()
    by_id: Mapping[int, str] = field(default_factory=dict)
    include: bool = False
    _matcher: StopMatcher | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def matcher(self) -> StopMatcher:
        """The strings' :class:`StopMatcher`, built at the first use (a request's samples share it)."""
        if self._matcher is None:
            object.__setattr__(self, "_matcher", StopMatcher(self.strings))
        assert self._matcher is not None
        return self._matcher

    def hold(self, text: str) -> int:
        """How many characters at the end of ``text`` could be the start of a stop string (they wait)."""
        matcher = self.matcher
        return matcher.keep[matcher.advance(0, text)]

    def find(self, text: str, start: int) -> tuple[int, int, str] | None:
        """The stop string that completes first in ``text`` after position ``start`` (the earliest-starting one
        when several complete on the same character): ``(start, end, string)``, or None."""
        matcher = self.matcher
        _, fed, string = matcher.first(matcher.advance(0, text[:start]), text[start:])
        return None if string is None else (start + fed - len(string), start + fed, string)


def stop_strings(strings: Sequence[str], include: bool, tokenizer: Any, added: Mapping[str, int]) -> StopStrings:
    """Build a request's :class:`StopStrings`; ``added`` is the tokenizer's added vocabulary (``get_added_vocab()``).

    Raises :class:`~pagedcore.errors.InvalidRequestError` when there are stop strings but no tokenizer.

    Example:
        >>> from pagedcore.adapters.transformers.builtin import builtin_tokenizer
        >>> tokenizer = builtin_tokenizer()
        >>> stops = stop_strings(["</s>", "<s>", "a", "</s>x"], False, tokenizer, tokenizer.get_added_vocab())
        >>> dict(stops.by_id)
        {2: '</s>', 1: '<s>'}
    """
    if not strings:
        return StopStrings(include=include)
    if tokenizer is None:
        raise InvalidRequestError(
            f"stop strings {list(strings)!r} are matched in the text, so they need a tokenizer: "
            "Engine(model, tokenizer=...) (transformers' generate needs one for stop_strings too)",
            param="stop_strings",
        )
    by_id: dict[int, str] = {}
    for s in strings:
        token = added.get(s)
        if token is not None and token not in by_id and _decodes_to_nothing(tokenizer, token):
            by_id[token] = s
    return StopStrings(tuple(strings), by_id, include)


def _decodes_to_nothing(tokenizer: Any, token: int) -> bool:
    try:
        return tokenizer.decode([token], skip_special_tokens=True) == ""
    except Exception:  # a tokenizer that cannot decode it alone: match it in the text only
        return False


class SampleText:
    """One sample's text: decoded incrementally, matched against the stop strings, released when final.

    Args:
        detokenizer: the sample's detokenizer (None without a tokenizer: then there is no text and no stop string).
        stops: the request's stop strings.
        min_new_tokens: stop strings are not matched before this many tokens.

    :meth:`add` feeds a token; :meth:`take` returns the text that became final since the last call; :meth:`finish`
    releases the rest when the sample ends for another reason. The pieces :meth:`take` returned, joined, are
    :attr:`text`.

    Example:
        >>> from pagedcore.adapters.transformers.builtin import builtin_tokenizer
        >>> tokenizer = builtin_tokenizer()
        >>> sample = SampleText(IncrementalDetokenizer(tokenizer), StopStrings(("lo",)))
        >>> pieces = []
        >>> for token in tokenizer("Hello")["input_ids"]:
        ...     sample.add(token, 1)
        ...     pieces.append(sample.take())
        >>> pieces, sample.stop_reason, sample.text
        (['H', 'e', '', 'l', ''], 'lo', 'Hel')
    """

    __slots__ = (
        "_detokenizer",
        "_done",
        "_matcher",
        "_min_new_tokens",
        "_pending",
        "_state",
        "_stops",
        "_taken",
        "stop_reason",
    )

    def __init__(self, detokenizer: IncrementalDetokenizer | None, stops: StopStrings, min_new_tokens: int = 0):
        self._detokenizer = detokenizer
        self._stops = stops
        self._matcher = stops.matcher if stops.strings else None
        self._state = 0  # the matcher's, after every character of the text so far
        self._min_new_tokens = min_new_tokens
        self._taken: list[str] = []  # what take() returned
        self._pending = ""  # the text after it (held back, or not taken yet); a stop's partial match lies here
        self._done = False
        self.stop_reason: str | None = None

    @property
    def text(self) -> str | None:
        """The sample's text (so far; final once it finished). None without a tokenizer."""
        return None if self._detokenizer is None else "".join(self._taken) + self._pending

    @property
    def keeps_stop(self) -> bool:
        """Whether what stopped the sample stays in its text (``include_stop_str_in_output``): a stop string, and
        the text of the stop token that ended it (vLLM's rule; without it, neither is in the text)."""
        return self._stops.include

    @property
    def num_decoded_ids(self) -> int:
        """Ids passed to ``tokenizer.decode`` for this sample (they grow linearly with its length)."""
        return 0 if self._detokenizer is None else self._detokenizer.num_decoded_ids

    def add(self, token_id: int, num_tokens: int) -> None:
        """Feed the sample's ``num_tokens``-th token; sets :attr:`stop_reason` when it completes a stop string.
        Raises :class:`~.detokenizer.DecodeError` when the tokenizer fails."""
        if self._detokenizer is None or self._done:
            return
        new = self._detokenizer.step(token_id)
        self._pending += new
        if self._matcher is None or not new:
            return
        if num_tokens < self._min_new_tokens:  # nothing stops it yet, but the matcher follows the text
            self._state = self._matcher.advance(self._state, new)
            return
        self._state, fed, string = self._matcher.first(self._state, new)
        if string is not None:
            end = len(self._pending) - len(new) + fed
            self._stop(self._pending[: end if self._stops.include else end - len(string)], string)

    def stop_by_id(self, token_id: int) -> str | None:
        """The sequence stopped on ``token_id``: when it is a stop string's special token, end the text there and
        return that stop string."""
        string = self._stops.by_id.get(token_id)
        if string is not None and not self._done:
            self._stop(self._pending + (string if self._stops.include else ""), string)
        return string

    def finish(self) -> None:
        """The sample ended (length, stop token, abort, error): release what is held, an incomplete last character
        included (as U+FFFD, as ``tokenizer.decode`` gives it)."""
        if self._detokenizer is not None and not self._done:
            self._pending += self._detokenizer.flush()
        self._done = True

    def take(self) -> str | None:
        """The text that became final since the last call (None without a tokenizer)."""
        if self._detokenizer is None:
            return None
        pending = self._pending
        held = 0 if self._done or self._matcher is None else self._matcher.keep[self._state]
        end = len(pending) - held
        if end == 0:
            return ""
        self._taken.append(pending[:end])
        self._pending = pending[end:]
        return self._taken[-1]

    def _stop(self, pending: str, string: str) -> None:
        self._pending = pending
        self.stop_reason = string
        self._done = True
