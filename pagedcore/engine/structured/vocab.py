"""The grammar engine's view of a tokenizer: which bytes each token id stands for (llguidance's ``LLTokenizer``).

A mask is only as right as this table: a token the grammar engine reads as other bytes than the detokenizer writes
makes "valid" outputs invalid. llguidance reads a fast tokenizer's own definition (byte-level BPE as GPT-2, Llama 3
and Qwen; byte fallback as Llama 2 and Mistral). For a tokenizer it cannot read (a Metaspace decoder without byte
fallback, such as the built-in one), each token's bytes are taken from its text with ``▁`` as a space. Either way
the table is checked against the tokenizer's own ``decode`` on sample sequences, and a tokenizer whose text is not
the concatenation of its tokens' bytes (word-level tokenizers insert spaces) is refused with
:class:`~pagedcore.errors.ConfigError` rather than given masks that would be wrong.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from pagedcore.errors import ConfigError
from pagedcore.extras import install_hint

__all__ = ["SpecialTokens", "import_llguidance", "lltokenizer"]

_CHECKED_SEQUENCES = 64


def import_llguidance() -> Any:
    """The ``llguidance`` module, or :class:`~pagedcore.errors.ConfigError` saying which extra to install.

    Example:
        >>> import_llguidance().__name__
        'llguidance'
    """
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as exc:
        raise ConfigError(f"structured outputs need llguidance ({exc}): {install_hint('structured')}") from None
    return llguidance


def lltokenizer(tokenizer: Any, vocab_size: int | None, stop_token_ids: Sequence[int]) -> Any:
    """llguidance's ``LLTokenizer`` for a transformers ``tokenizer``: masks of ``vocab_size`` tokens (the model's
    logits width; None: the tokenizer's size), ``stop_token_ids`` ending an output. Expensive for a large
    vocabulary (about a second for 150k tokens): build it once.

    Example:
        >>> from pagedcore.adapters.transformers.builtin import builtin_tokenizer
        >>> tok = lltokenizer(builtin_tokenizer(), 99, [2])
        >>> tok.vocab_size, tok.eos_tokens, tok.decode_bytes([4, 5])    # the built-in "▁" is a space
        (99, [2], b' !')
    """
    llg = import_llguidance()
    if not stop_token_ids:
        raise ConfigError("structured outputs need a stop token (an eos token id) to end an output")
    stops = [int(t) for t in stop_token_ids]
    try:
        result = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stops)
    except ValueError:  # a decoder llguidance does not read: the tokens' bytes from their text
        result = llg.LLTokenizer(_wrapper(llg, tokenizer, stops[0]), n_vocab=vocab_size, eos_token=stops)
    _check(result, tokenizer)
    return result


class SpecialTokens:
    """The tokens a mask must not allow unless the matcher accepts them, as the bitmask words and bits that hold
    them: every special token of the vocabulary, the stop tokens included. Computed once per tokenizer, so a step's
    check is one gather over a few words.

    llguidance allows a special token it then refuses where the grammar forces text the vocabulary cannot spell:
    it tokenizes the forced text with the tokenizer, which gives ``<unk>``. It may also allow a stop token where the
    grammar is not complete (after ``a`` in ``start: "a" (<[1]> | "b")``), which
    :meth:`~.matcher.GrammarState.accept` then refuses. A grammar may allow a special token on purpose (``<[id]>``
    in Lark: harmony's markers), so a set bit is cleared only when the matcher refuses it (a stop token: unless the
    grammar is complete).

    Example:
        >>> special = SpecialTokens([0, 1, 3, 40], vocab_size=99, stops=[2])
        >>> special.ids, special.words.tolist(), [hex(b) for b in special.bits.tolist()]
        ((0, 1, 3, 40), [0, 1], ['0xf', '0x100'])
        >>> special.stops, [hex(b) for b in special.stop_bits.tolist()]
        ((2,), ['0x4', '0x0'])
    """

    def __init__(self, ids: Sequence[int], vocab_size: int, stops: Sequence[int] = ()) -> None:
        self.stops = tuple(sorted({int(t) for t in stops if 0 <= int(t) < vocab_size}))
        self.ids = tuple(sorted({int(t) for t in ids if 0 <= int(t) < vocab_size} - set(self.stops)))
        words: dict[int, int] = {}
        for token in (*self.ids, *self.stops):
            words[token // 32] = words.get(token // 32, 0) | 1 << (token % 32)
        self.words = np.array(sorted(words), dtype=np.int64)
        self.bits = np.array([words[w] for w in sorted(words)], dtype=np.uint32)
        stop_bits = {w: sum(1 << (t % 32) for t in self.stops if t // 32 == w) for w in words}
        self.stop_bits = np.array([stop_bits[w] for w in sorted(words)], dtype=np.uint32)
        self.keep_bits = ~self.stop_bits  # a word's bits but its stop tokens'


def special_tokens(lltok: Any, tokenizer: Any, stop_token_ids: Sequence[int]) -> SpecialTokens:
    """The special tokens of ``tokenizer`` (its own, and those llguidance reads as special) and the stop tokens."""
    size = int(lltok.vocab_size)
    ids = _special_ids(tokenizer) | {t for t in range(size) if lltok.is_special_token(t)}
    return SpecialTokens(sorted(ids), size, stops=stop_token_ids)


def _wrapper(llg: Any, tokenizer: Any, eos: int) -> Any:
    """llguidance's ``TokenizerWrapper`` over each token's text, ``▁`` read as a space."""
    special = _special_ids(tokenizer)
    size = max(tokenizer.get_vocab().values()) + 1
    texts = [""] * size
    for text, token in tokenizer.get_vocab().items():
        texts[token] = text

    class Source:
        def __init__(self) -> None:
            self.eos_token_id = eos
            self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
            self.tokens = [b"" if i in special else texts[i].replace("▁", " ").encode("utf-8") for i in range(size)]
            self.special_token_ids = sorted(special)

        def __call__(self, text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return llg.TokenizerWrapper(Source())


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(token for token, added in decoder.items() if getattr(added, "special", False))
    return ids


def _check(lltok: Any, tokenizer: Any) -> None:
    """Refuse a tokenizer whose decoded text is not its tokens' bytes end to end (a space of difference at the
    start is sentencepiece's leading space, which decoding drops)."""
    special = _special_ids(tokenizer)
    size = min(lltok.vocab_size, max(tokenizer.get_vocab().values()) + 1)
    pool = [t for t in range(size) if t not in special and not lltok.is_special_token(t)]
    rng = random.Random(0)
    for _ in range(_CHECKED_SEQUENCES if pool else 0):
        ids = [rng.choice(pool) for _ in range(4)]
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        if "\ufffd" in expected:
            continue  # a sequence that splits a character: not comparable as text
        got = lltok.decode_bytes(ids).decode("utf-8", errors="replace")
        if got != expected and got.removeprefix(" ") != expected:
            raise ConfigError(
                f"structured outputs cannot use this tokenizer: tokens {ids} decode to {expected!r}, but their bytes "
                f"are {got!r} (its text is not the concatenation of its tokens)"
            )
