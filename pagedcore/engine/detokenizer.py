"""Incremental detokenization: one sample's text, a few ids at a time, never a character cut in half.

Byte-level tokenizers (GPT-2, Llama 3, Qwen) spell a CJK character, an emoji or a rare symbol as several tokens, and
decoding a prefix that ends inside such a character gives U+FFFD. Re-decoding the whole sample per token and slicing
by length (what the Engine did) sends that U+FFFD and later loses the character; it is also quadratic in the output
length. :class:`IncrementalDetokenizer` uses the technique of vLLM's ``detokenize_incrementally`` and
text-generation-inference: it decodes only a window of ids, ``ids[prefix_offset:]``, and the new text is what that
decode adds to the decode of ``ids[prefix_offset:read_offset]`` (the ids read last time, kept as context so that
tokenizers that treat the first token of a decode specially, e.g. SentencePiece's leading space, are cut the same
way on both sides). Text is released only when the window's decode does not end in U+FFFD: an incomplete character
is held back until the token that completes it arrives.

Rules, each decided here:

- **Held back.** A window ending in U+FFFD releases nothing. So that invalid bytes (which never complete) cannot hold
  text back for ever, once more than :data:`MAX_HELD` ids are held the ids before the last three are released when
  their decode is a prefix of the window's (the later ids did not change it: a UTF-8 character has at most four
  bytes, so three more complete or refute it).
- **A token that adds no text** is held with the window, as in vLLM: the window keeps the last text it released as
  context, which tokenizers that strip a decode's leading space need (a window starting at a dropped token would lose
  the space before the next word). A transformers tokenizer's special ids, which ``skip_special_tokens`` drops before
  decoding (:func:`dropped_ids`), are not added to the window at all: the same text, and a run of them after an
  incomplete character cannot grow the window.
- **Proven** means the later ids added text after the head's: a head whose decode ends in U+FFFD is released only
  once a later character closed it (three later ids that add no text, say dropped special tokens, prove nothing; a
  hypothesis run in CI found it releasing U+FFFD where three special ids followed two bytes of a character).
- **Flush.** When the sample ends, :meth:`IncrementalDetokenizer.flush` releases what is held, an incomplete character
  included, as ``tokenizer.decode`` gives it (U+FFFD). The released pieces joined are then the sample's text, equal to
  ``tokenizer.decode(ids, skip_special_tokens=True)`` for tokenizers whose decode of a sequence is the decode of its
  parts joined (byte-level BPE, SentencePiece, character-level).

Cost: each token decodes the window (a few ids) twice at most, so the ids passed to ``decode`` grow linearly with the
output (:attr:`IncrementalDetokenizer.num_decoded_ids` counts them). A transformers fast tokenizer whose ``decode`` is
its Rust backend's with nothing after it (:func:`decoder_of`) is called through that backend: 0.85 us a call instead
of 2.3 us through transformers' wrapper, which a server pays twice per token per running sequence.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from typing import Any

__all__ = ["MAX_HELD", "DecodeError", "IncrementalDetokenizer", "decoder_of", "dropped_ids"]

MAX_HELD = 4  # ids held back before the proven part of them is released (see the module docstring)
_REPLACEMENT = "\ufffd"


class DecodeError(Exception):
    """``tokenizer.decode`` raised or returned something that is not text (the request it serves fails)."""


def decoder_of(tokenizer: Any) -> Callable[[list[int]], Any]:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=True)``, called through the Rust backend where that is what
    ``decode`` computes: a transformers fast tokenizer whose class overrides neither ``decode`` nor ``_decode`` and
    whose ``clean_up_tokenization_spaces`` is off (the wrapper then returns the backend's text unchanged). Anything
    else (a slow tokenizer, a subclass with its own decoding, clean-up on, a stand-in) is called as it is.

    Example:
        >>> from pagedcore.adapters.transformers.builtin import builtin_tokenizer
        >>> tokenizer = builtin_tokenizer()
        >>> decode = decoder_of(tokenizer)
        >>> decode([72, 105]) == tokenizer.decode([72, 105], skip_special_tokens=True)
        True
    """
    generic = partial(tokenizer.decode, skip_special_tokens=True)
    plain = _plain_fast(tokenizer) and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
    backend = getattr(tokenizer, "backend_tokenizer", None) if plain else None
    if backend is None or not callable(getattr(backend, "decode", None)):
        return generic
    return partial(backend.decode, skip_special_tokens=True)


def _plain_fast(tokenizer: Any) -> bool:
    """A transformers fast tokenizer whose class overrides neither ``decode`` nor ``_decode``."""
    library = sys.modules.get("transformers")  # loaded wherever one of its tokenizers exists; the engine imports none
    fast = getattr(library, "PreTrainedTokenizerFast", None)
    base = getattr(library, "PreTrainedTokenizerBase", None)
    if not isinstance(fast, type) or not isinstance(tokenizer, fast) or base is None:
        return False
    cls = type(tokenizer)
    return getattr(cls, "decode", None) is getattr(base, "decode", ()) and getattr(cls, "_decode", None) is getattr(
        fast, "_decode", ()
    )


def dropped_ids(tokenizer: Any) -> frozenset[int]:
    """The ids ``tokenizer.decode(ids, skip_special_tokens=True)`` drops before decoding: a plain transformers fast
    tokenizer's ``all_special_ids``; none known for anything else (a wrapper that keeps them, a stand-in).

    Example:
        >>> from pagedcore.adapters.transformers.builtin import builtin_tokenizer
        >>> len(dropped_ids(builtin_tokenizer())) > 0, dropped_ids(object())
        (True, frozenset())
    """
    if not _plain_fast(tokenizer):
        return frozenset()
    return frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())


class IncrementalDetokenizer:
    """One sample's text, decoded a window of ids at a time (see the module docstring for the rules).

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=True) -> str`` (a transformers tokenizer).

    Example:
        >>> from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        >>> from transformers import PreTrainedTokenizerFast
        >>> alphabet = pre_tokenizers.ByteLevel.alphabet()
        >>> core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
        >>> core.pre_tokenizer, core.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        >>> tokenizer = PreTrainedTokenizerFast(tokenizer_object=core)
        >>> ids = tokenizer("a中")["input_ids"]           # 'a' is one byte, '中' three
        >>> detok = IncrementalDetokenizer(tokenizer)
        >>> [detok.step(i) for i in ids]                   # nothing until the character is whole
        ['a', '', '', '中']
        >>> detok.step(ids[1]), detok.flush()              # a character cut short by the end: U+FFFD
        ('', '�')
    """

    __slots__ = ("_decode_ids", "_dropped", "_prefix_text", "_read", "_window", "num_decoded_ids")

    def __init__(self, tokenizer: Any) -> None:
        self._decode_ids = decoder_of(tokenizer)
        self._dropped = dropped_ids(tokenizer)
        self._window: list[int] = []  # ids[prefix_offset:]
        self._read = 0  # read_offset - prefix_offset: the window's ids before it were released already
        self._prefix_text = ""  # decode(window[:read])
        self.num_decoded_ids = 0

    @property
    def num_held(self) -> int:
        """Ids read but not released yet."""
        return len(self._window) - self._read

    def step(self, token_id: int) -> str:
        """Add one id; returns the text it completes (``""`` while a character is incomplete)."""
        if token_id in self._dropped:
            return ""  # decode drops it before decoding: no text, no context
        self._window.append(token_id)
        text = self._decode(self._window)
        if text.endswith(_REPLACEMENT):
            return self._release_proven(text) if self.num_held > MAX_HELD else ""
        if len(text) <= len(self._prefix_text):
            return ""  # no new text (a dropped special token), or a tokenizer's clean-up shrank it: wait for more
        return self._advance(len(self._window), text)

    def flush(self) -> str:
        """Release what is held (the sample ended); an incomplete character reads as ``tokenizer.decode`` gives it."""
        if not self.num_held:
            return ""
        text = self._decode(self._window)
        delta = text[len(self._prefix_text) :]
        self._window, self._read, self._prefix_text = [], 0, ""
        return delta

    def _advance(self, end: int, text: str) -> str:
        """Release ``text`` (the decode of ``window[:end]``) past the prefix; the ids read so far become the context."""
        delta = text[len(self._prefix_text) :]
        self._window = self._window[self._read :]
        end -= self._read
        self._prefix_text = self._decode(self._window[:end]) if end else ""
        self._read = end
        return delta

    def _release_proven(self, text: str) -> str:
        """Too many ids held: release those before the last three when the later ones left their decode unchanged."""
        end = len(self._window) - 3
        head = self._decode(self._window[:end])
        if len(head) <= len(self._prefix_text) or len(text) <= len(head) or not text.startswith(head):
            return ""  # (text no longer than head: the later ids closed none of its characters)
        return self._advance(end, head)

    def _decode(self, ids: list[int]) -> str:
        self.num_decoded_ids += len(ids)
        try:
            text = self._decode_ids(ids)
        except Exception as exc:  # the tokenizer is user code: its failure is this request's error
            raise DecodeError(f"tokenizer.decode failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(text, str):
            raise DecodeError(f"tokenizer.decode returned a {type(text).__name__}, not a str")
        return text
