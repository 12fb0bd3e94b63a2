"""The Engine's text parts alone: the incremental detokenizer on any byte sequence, and stop-string matching on any
pieces of text (the oracle: the text ends where the first stop string completes)."""

from __future__ import annotations

from byte_text import byte_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedcore.adapters.transformers.builtin import builtin_tokenizer
from pagedcore.adapters.transformers.detokenizer import IncrementalDetokenizer
from pagedcore.adapters.transformers.stopping import SampleText, StopStrings, stop_strings

TOKENIZER = byte_tokenizer()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 257), max_size=40))
def test_the_detokenizer_releases_exactly_decode_of_any_ids(ids):
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    pieces = [detokenizer.step(t) for t in ids]
    assert "".join(pieces) + detokenizer.flush() == TOKENIZER.decode(ids, skip_special_tokens=True)
    assert detokenizer.num_decoded_ids <= 8 * max(1, len(ids))


# ---------------------------------------------------------------------- stop strings
def first_stop(text: str, stops: list[str]) -> int | None:
    """Oracle: where the text is cut: at the stop string that completes first (earliest start on a tie)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if end >= len(s) and text[end - len(s) : end] == s]
        if starts:
            return min(starts)
    return None


class _Pieces:
    """A detokenizer stand-in that releases given pieces of text (one per token)."""

    def __init__(self, pieces: list[str]) -> None:
        self._pieces = iter(pieces)
        self.num_decoded_ids = 0

    def step(self, token_id: int) -> str:
        return next(self._pieces)

    def flush(self) -> str:
        return ""


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="abc\n", max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3),
    include=st.booleans(),
)
def test_sample_text_sends_exactly_the_text_before_the_first_stop(pieces, stops, include):
    text = SampleText(_Pieces(pieces), StopStrings(tuple(stops), {}, include))  # type: ignore[arg-type]
    sent = ""
    for count in range(1, len(pieces) + 1):
        text.add(count, count)
        sent += text.take() or ""
        assert (text.text or "").startswith(sent)  # what was sent is final
        if text.stop_reason is not None:
            break
    else:
        text.finish()
        sent += text.take() or ""
    full = "".join(pieces)
    cut = first_stop(full, stops)
    if cut is None:
        assert text.stop_reason is None and sent == full == text.text
    else:
        end = cut + len(text.stop_reason or "") if include else cut
        assert full[cut:].startswith(text.stop_reason or "\0") and sent == full[:end] == text.text


def test_stop_strings_that_are_special_tokens_match_by_id():
    tokenizer = builtin_tokenizer()
    stops = stop_strings(["</s>", "<s>", "a", "</s>x"], False, tokenizer, tokenizer.get_added_vocab())
    assert dict(stops.by_id) == {2: "</s>", 1: "<s>"} and stops.strings == ("</s>", "<s>", "a", "</s>x")


def test_without_stop_strings_text_is_sent_at_once():
    text = SampleText(IncrementalDetokenizer(builtin_tokenizer()), StopStrings())
    text.add(5, 1)
    assert text.take() == "!"
    text.finish()
    assert text.take() == "" and text.text == "!"
