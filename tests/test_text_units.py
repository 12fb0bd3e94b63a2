"""The Engine's text parts alone: the incremental detokenizer on any byte sequence, and stop-string matching on any
pieces of text (the oracle: the text ends where the first stop string completes)."""

from __future__ import annotations

from byte_text import byte_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from python_lines import lines_run

from pagedcore.adapters.transformers.builtin import builtin_tokenizer
from pagedcore.adapters.transformers.detokenizer import IncrementalDetokenizer
from pagedcore.adapters.transformers.stopping import SampleText, StopStrings, stop_strings
from pagedcore.engine.detokenizer import decoder_of

TOKENIZER = byte_tokenizer()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 257), max_size=40))
def test_the_detokenizer_releases_exactly_decode_of_any_ids(ids):
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    pieces = [detokenizer.step(t) for t in ids]
    assert "".join(pieces) + detokenizer.flush() == TOKENIZER.decode(ids, skip_special_tokens=True)
    assert detokenizer.num_decoded_ids <= 8 * max(1, len(ids))


def test_special_ids_after_part_of_a_character_release_nothing_early():
    """CI's hypothesis run found it: two bytes of a three-byte character, three special ids (which decode drops),
    then the last byte. The ids held passed MAX_HELD and the first two were released as U+FFFD, because the three
    after them "left their decode unchanged"; they added no bytes at all."""
    ids = [156, 94, 256, 256, 256, 94]
    for dropped in (True, False):  # special ids skipped (a plain tokenizer), or held in the window (any other)
        detokenizer = IncrementalDetokenizer(TOKENIZER)
        if not dropped:
            detokenizer._dropped = frozenset()
        pieces = [detokenizer.step(t) for t in ids]
        assert pieces == ["", "", "", "", "", TOKENIZER.decode(ids, skip_special_tokens=True)]


def test_a_run_of_special_ids_after_part_of_a_character_costs_linear_decoding():
    ids = [156] + [256, 257] * 30 + [94, 94]
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    pieces = [detokenizer.step(t) for t in ids]
    assert "".join(pieces) + detokenizer.flush() == TOKENIZER.decode(ids, skip_special_tokens=True)
    assert detokenizer.num_decoded_ids <= 8 * len(ids)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 257), max_size=12))
def test_the_backend_decoder_is_exactly_the_tokenizers_decode(ids):
    for tokenizer in (TOKENIZER, builtin_tokenizer()):
        assert decoder_of(tokenizer)(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_changes_its_decoding_is_called_as_it_is():
    """Only a plain fast tokenizer goes through its backend: a subclass's own decoding, clean-up of spaces and
    stand-ins keep their ``decode`` (the backend would drop what they add)."""

    class Shouting(type(TOKENIZER)):  # type: ignore[misc]
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    class StandIn:
        def decode(self, ids, skip_special_tokens=False):
            return "-".join(map(str, ids))

    shouting = byte_tokenizer()
    shouting.__class__ = Shouting
    cleaned = byte_tokenizer()
    cleaned.clean_up_tokenization_spaces = True
    ids = [72, 105, 33]  # "Hi!" in the byte alphabet's order
    assert decoder_of(TOKENIZER)(ids) == TOKENIZER.decode(ids)
    assert decoder_of(TOKENIZER).func == TOKENIZER.backend_tokenizer.decode  # type: ignore[attr-defined]
    assert decoder_of(shouting)(ids) == TOKENIZER.decode(ids).upper()
    assert decoder_of(cleaned).func == cleaned.decode  # type: ignore[attr-defined]
    assert decoder_of(StandIn())(ids) == "72-105-33"
    detokenizer = IncrementalDetokenizer(shouting)
    assert "".join(detokenizer.step(t) for t in ids) + detokenizer.flush() == TOKENIZER.decode(ids).upper()


# ---------------------------------------------------------------------- stop strings
def first_stop(text: str, stops: list[str], after: int = 0) -> int | None:
    """Oracle: where the text is cut: at the stop string that completes first after its first ``after`` characters
    (earliest start on a tie)."""
    for end in range(after + 1, len(text) + 1):
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


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="abc\n", max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=5), max_size=6),
    include=st.booleans(),
    min_new=st.integers(0, 4),
)
def test_sample_text_sends_exactly_the_text_before_the_first_stop(pieces, stops, include, min_new):
    """Before ``min_new`` tokens nothing stops: the oracle cuts at the first stop string completing in a later
    token's text (one that began earlier included)."""
    text = SampleText(_Pieces(pieces), StopStrings(tuple(stops), {}, include), min_new)  # type: ignore[arg-type]
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
    early = len("".join(pieces[: max(0, min_new - 1)]))  # the characters of the tokens before min_new
    cut = first_stop(full, stops, after=early)
    if cut is None:
        assert text.stop_reason is None and sent == full == text.text
    else:
        end = cut + len(text.stop_reason or "") if include else cut
        assert full[cut:].startswith(text.stop_reason or "\0") and sent == full[:end] == text.text


def test_matching_costs_the_same_for_ten_stop_strings_or_ten_thousand():
    """Regression: every generated token looped in Python over every stop string (``StopStrings.find`` and
    ``hold``), in the step that every request shares, so one request's 10**5 stop strings made its neighbours'
    steps 40x slower. Counted in Python lines run, not timed: the same within a few lines for 10 or 10000."""

    def matched(count: int) -> int:
        stops = StopStrings((*(f"zq{i}" for i in range(count)), "a\nb"))
        text = SampleText(_Pieces(["xa", "\n", "zq", "y", "a", "\nb"]), stops)

        def steps() -> None:
            for count in range(1, 7):
                text.add(count, count)
                text.take()

        lines, _ = lines_run(steps)
        assert text.stop_reason == "a\nb" and text.text == "xa\nzqy"
        return lines

    few, many = matched(10), matched(10_000)
    assert many <= few + 10, (few, many)


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


def test_the_detokenizer_benchmark_script_releases_decodes_text_both_ways():
    """``scripts/detokenizer_bench.py`` (docs/benchmarks.md, "Detokenizing through the backend") at a small point: it
    exits non-zero if either way's text differs from ``tokenizer.decode``."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "detokenizer_bench.py"
    args = [sys.executable, str(script), "--tokens", "300", "--rounds", "1"]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=120).stdout
    assert [line.split("|")[1].strip() for line in out.splitlines()[2:]] == ["built-in (characters)", "byte-level BPE"]
