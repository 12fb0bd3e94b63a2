"""The Engine owns text and stopping: incremental detokenization on byte-level text, stop strings matched across
token boundaries and finished in the step that completed them, special-token stops, parallel samples that stop on
their own. Models: :mod:`byte_text`'s script models over a byte-level BPE tokenizer (every multi-byte character is
several tokens)."""

from __future__ import annotations

import pytest
import torch
from byte_text import EOS_TEXT, IM_END, byte_tokenizer, ids_of, script_model, spelled, successor_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedcore import InvalidRequestError
from pagedcore.adapters.transformers import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPT = "中ʖ😀é∑ "  # CJK (3 bytes), a rare symbol (2), an emoji (4), an accent (2), a math symbol (3), a space
TOKENIZER = byte_tokenizer()
IDS = ids_of(TOKENIZER, SCRIPT)
START = IDS[-1]  # the prompt: the script's last byte, so the model spells the script from its first character


def script_text(count: int) -> str:
    return TOKENIZER.decode(spelled(IDS, len(IDS) - 1, count), skip_special_tokens=True)


@pytest.fixture(scope="module")
def engine():
    model, _ = script_model(TOKENIZER, SCRIPT)
    with Engine(model, TOKENIZER, num_blocks=256, block_size=8, max_num_seqs=16) as engine:
        yield engine
    assert engine.pool.kv.num_used_blocks == 0, "blocks leaked"
    engine.pool.check_invariants()


def joined(events, sample: int = 0) -> str:
    return "".join(e.text or "" for e in events if e.sample == sample)


# ---------------------------------------------------------------------- text
def test_streamed_text_joins_to_the_final_text_and_keeps_every_character(engine):
    params = SamplingParams(max_new_tokens=45)
    (out,) = engine.generate([[START]], params, use_tqdm=False)
    events = list(engine.stream([[START]], params))
    assert out.token_ids == spelled(IDS, len(IDS) - 1, 45)
    assert out.text == script_text(45) == TOKENIZER.decode(out.token_ids, skip_special_tokens=True)
    assert out.text.startswith(SCRIPT * 3) and "\ufffd" not in out.text[: len(SCRIPT) * 3]
    assert joined(events) == out.text
    assert all("\ufffd" not in (e.text or "") for e in events)  # never half a character on the way


def test_a_sample_cut_inside_a_character_ends_with_what_decode_gives(engine):
    # 2 tokens: the first two bytes of the three of '中'; flushed at the end as decode gives them (U+FFFD).
    events = list(engine.stream([[START]], SamplingParams(max_new_tokens=2)))
    (out,) = engine.generate([[START]], SamplingParams(max_new_tokens=2), use_tqdm=False)
    assert out.text == TOKENIZER.decode(out.token_ids) == joined(events)
    assert [e.text for e in events] == ["", out.text]


def test_decode_work_grows_linearly_with_the_output(engine, monkeypatch):
    counted = {"ids": 0}
    decode = TOKENIZER.decode

    def counting(ids, *args, **kwargs):
        counted["ids"] += len(ids)
        return decode(ids, *args, **kwargs)

    monkeypatch.setattr(TOKENIZER, "decode", counting)
    per_token = []
    for length in (60, 240):
        counted["ids"] = 0
        (out,) = engine.generate([[START]], SamplingParams(max_new_tokens=length), use_tqdm=False)
        assert len(out.token_ids) == length
        per_token.append(counted["ids"] / length)
    # Re-decoding the whole sample per token costs ~length/2 ids per token (30, then 120): here a constant.
    assert max(per_token) <= 8, per_token
    assert per_token[1] <= per_token[0] * 1.25, per_token


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    successors=st.lists(st.integers(0, 257), min_size=258, max_size=258),
    start=st.integers(0, 255),
    length=st.integers(1, 40),
)
def test_random_byte_sequences_stream_exactly_their_final_text(successors, start, length):
    model = successor_model(len(TOKENIZER), {t: [s] for t, s in enumerate(successors)})
    with Engine(model, TOKENIZER, num_blocks=64, block_size=8) as engine:
        events = list(engine.stream([[start]], SamplingParams(max_new_tokens=length, stop_token_ids=[])))
        (out,) = engine.generate([[start]], SamplingParams(max_new_tokens=length, stop_token_ids=[]), use_tqdm=False)
    assert [e.token_id for e in events if e.token_id is not None] == out.token_ids
    assert joined(events) == out.text == TOKENIZER.decode(out.token_ids, skip_special_tokens=True)


def test_stop_strings_need_a_tokenizer():
    model, _ = script_model(TOKENIZER, SCRIPT)
    with Engine(model, num_blocks=32, block_size=8) as engine:
        with pytest.raises(InvalidRequestError, match="need a tokenizer"):
            engine.add_request([START], SamplingParams(stop_strings=["x"]))
        with pytest.raises(InvalidRequestError, match="need a tokenizer"):
            engine.add_request([START], max_new_tokens=4, stop_strings="x")
    with pytest.raises(InvalidRequestError, match="non-empty"):
        SamplingParams(stop_strings=[""])
    with pytest.raises(InvalidRequestError, match="stop_strings must be"):
        SamplingParams(stop_strings=5)  # type: ignore[arg-type]


def test_a_non_ascii_stop_string_across_tokens_ends_the_sample_in_its_step(engine):
    stop = "😀é"  # 6 tokens, starting mid-script
    before = engine.stats()
    (out,) = engine.generate([[START]], SamplingParams(max_new_tokens=40, stop_strings=[stop]), use_tqdm=False)
    after = engine.stats()
    cut = SCRIPT.index(stop)
    completing = len(ids_of(TOKENIZER, SCRIPT[: cut + len(stop)]))  # the token that completes the stop string
    assert out.finish_reason == "stop" and out.samples[0].stop_reason == stop
    assert out.text == SCRIPT[:cut]
    assert out.token_ids == spelled(IDS, len(IDS) - 1, completing)
    # One step computes the prompt and samples token 1; each further token is one step: none after the stop.
    assert after.num_steps - before.num_steps == completing
    assert after.generated_tokens - before.generated_tokens == completing


def test_streamed_stop_text_is_what_generate_returns_and_include_keeps_the_stop(engine):
    stop = "∑ 中"
    for include in (False, True):
        params = SamplingParams(max_new_tokens=40, stop_strings=["never", stop], include_stop_str_in_output=include)
        events = list(engine.stream([[START]], params))
        (out,) = engine.generate([[START]], params, use_tqdm=False)
        cut = (SCRIPT * 2).index(stop) + (len(stop) if include else 0)
        assert out.text == (SCRIPT * 2)[:cut] == joined(events)
        assert events[-1].finish_reason == "stop" and events[-1].stop_reason == stop


def test_stop_strings_as_transformers_generate_kwargs_stop_where_generate_stops(engine):
    (out,) = engine.generate([[START]], max_new_tokens=40, do_sample=False, stop_strings="é", use_tqdm=False)
    assert out.text == SCRIPT[: SCRIPT.index("é")] and out.finish_reason == "stop"
    model, _ = script_model(TOKENIZER, SCRIPT)  # the same weights, outside the Engine
    reference = model.generate(
        torch.tensor([[START]]), max_new_tokens=40, do_sample=False, stop_strings="é", tokenizer=TOKENIZER
    )
    assert out.token_ids == reference[0, 1:].tolist()  # the same last token: the one that completes the stop


def test_nothing_stops_before_min_new_tokens(engine):
    params = SamplingParams(max_new_tokens=40, stop_strings=["ʖ"], min_new_tokens=6)
    (out,) = engine.generate([[START]], params, use_tqdm=False)
    assert out.text == (SCRIPT * 2)[: len(SCRIPT) + 1] and out.finish_reason == "stop"


# ---------------------------------------------------------------------- special tokens
def special_model():
    """A ... 'a' -> 'b' -> <|im_end|> -> <|endoftext|> -> 'a' model."""
    a, b = ids_of(TOKENIZER, "a")[0], ids_of(TOKENIZER, "b")[0]
    im_end, eos = TOKENIZER.convert_tokens_to_ids([IM_END, EOS_TEXT])
    return successor_model(len(TOKENIZER), {a: [b], b: [im_end], im_end: [eos], eos: [a]}), a, im_end


def test_a_stop_string_that_is_a_special_token_stops_by_id():
    model, a, im_end = special_model()
    with Engine(model, TOKENIZER, num_blocks=32, block_size=8) as engine:
        plain = engine.generate([[a]], SamplingParams(max_new_tokens=6, stop_token_ids=[]), use_tqdm=False)[0]
        assert plain.text == "bab"  # the special tokens' text is not in the text: it cannot match there
        for include, text in ((False, "b"), (True, "b" + IM_END)):
            params = SamplingParams(
                max_new_tokens=6, stop_token_ids=[], stop_strings=[IM_END], include_stop_str_in_output=include
            )
            events = list(engine.stream([[a]], params))
            (out,) = engine.generate([[a]], params, use_tqdm=False)
            assert out.token_ids == [plain.token_ids[0], im_end] and out.finish_reason == "stop"
            assert out.samples[0].stop_reason == IM_END and out.text == text == joined(events)
        # A stop token that is no stop string reports its id.
        (out,) = engine.generate([[a]], SamplingParams(max_new_tokens=6, stop_token_ids=[im_end]), use_tqdm=False)
        assert out.samples[0].stop_reason == im_end and out.text == "b"


# ---------------------------------------------------------------------- parallel samples
def test_parallel_samples_stop_on_their_own_and_a_stopped_one_is_no_longer_computed():
    x, a, b = (ids_of(TOKENIZER, c)[0] for c in "xab")
    # After 'x' an exact tie between 'a' and 'b'; 'a' and 'b' repeat themselves.
    model = successor_model(len(TOKENIZER), {x: [a, b], a: [a], b: [b]})
    params = SamplingParams(max_new_tokens=8, n=6, temperature=1.0, seed=5, stop_strings=["bb"], stop_token_ids=[])
    with Engine(model, TOKENIZER, num_blocks=64, block_size=4, max_num_seqs=8) as engine:
        rid = engine.add_request([x], params)
        steps: list[set[int]] = []
        outputs = []
        while engine.has_unfinished():
            step = engine.step_events()
            outputs += step.finished
            live = {s.sample_index for s in engine.scheduler.sequences() if s.group_id == rid}
            for event in step.events:
                if event.finish_reason is not None:
                    assert event.sample not in live  # finished in the step that stopped it: not scheduled again
            steps.append(live)
        (out,) = outputs
        assert engine.stats().generated_tokens == sum(len(s.token_ids) for s in out.samples)
    texts = [s.text for s in out.samples]
    assert set(texts) == {"", "a" * 8}, texts  # seed 5 draws both branches
    for sample in out.samples:
        if sample.text == "":
            assert sample.finish_reason == "stop" and sample.stop_reason == "bb" and len(sample.token_ids) == 2
        else:
            assert sample.finish_reason == "length" and len(sample.token_ids) == 8
    assert len(steps) == 8 and [len(live) for live in steps][-1] == 0
