"""`pagedcore serve` on byte-level text, through the official openai client: streamed and plain answers equal and
intact on CJK, emoji and rare symbols, non-ASCII and special-token stop strings, parallel samples that stop on their
own without being computed further. Model: :mod:`byte_text`'s successor model over a byte-level BPE tokenizer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("openai")  # the optional client and server: the suite runs without them
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import openai
from byte_text import IM_END, byte_tokenizer, ids_of, successor_model

from pagedcore.adapters.transformers import Engine
from pagedcore.serve.app import create_app
from pagedcore.serve.loop import EngineLoop
from pagedcore.serve.server import BackgroundServer

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "bytes"
SCRIPT = "中ʖ😀é∑ "
TOKENIZER = byte_tokenizer()


def table() -> dict[int, list[int]]:
    """The script, then <|im_end|> (invisible in the text), then the script again; and 'x' -> 'a' | 'b' (a tie),
    'a' -> 'a', 'b' -> 'b'."""
    cycle = [*ids_of(TOKENIZER, SCRIPT), TOKENIZER.convert_tokens_to_ids(IM_END)]
    successors = {t: [cycle[(i + 1) % len(cycle)]] for i, t in enumerate(cycle)}
    x, a, b = (ids_of(TOKENIZER, c)[0] for c in "xab")
    successors.update({x: [a, b], a: [a], b: [b]})
    return successors


@pytest.fixture(scope="module")
def served(one_thread) -> Iterator[tuple[openai.OpenAI, Engine]]:
    model = successor_model(len(TOKENIZER), table())
    engine = Engine(model, TOKENIZER, num_blocks=256, block_size=8, max_num_seqs=16)
    loop = EngineLoop(engine)
    server = BackgroundServer(create_app(loop, model_name=MODEL, context_length=512), loop)
    server.start()
    try:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120), engine
    finally:
        server.stop()
        engine.close()
    assert engine.pool.kv.num_used_blocks == 0, "blocks leaked"
    engine.pool.check_invariants()


def complete(client: openai.OpenAI, **kwargs) -> tuple[str, str | None, str, str | None]:
    """The plain answer's text and finish reason, then the streamed one's."""
    args = {"model": MODEL, "prompt": [TOKENIZER.convert_tokens_to_ids(IM_END)], "temperature": 0, **kwargs}
    out = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return out.choices[0].text, out.choices[0].finish_reason, streamed, reasons[-1] if reasons else None


def test_streamed_and_plain_answers_are_equal_and_intact(served):
    client, _ = served
    text, reason, streamed, streamed_reason = complete(client, max_tokens=48)
    assert text == streamed == SCRIPT * 3 and reason == streamed_reason == "length"
    args = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 12, "temperature": 0}
    chat = client.chat.completions.create(**args).choices[0].message.content
    chunks = client.chat.completions.create(**args, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat


def test_a_non_ascii_stop_string_across_tokens_matches(served):
    client, _ = served
    text, reason, streamed, streamed_reason = complete(client, max_tokens=48, stop=["never", "😀é"])
    assert text == streamed == SCRIPT[: SCRIPT.index("😀é")] and reason == streamed_reason == "stop"
    text, _, streamed, _ = complete(client, max_tokens=48, stop=["∑"], extra_body={"include_stop_str_in_output": True})
    assert text == streamed == SCRIPT[: SCRIPT.index("∑") + 1]


def test_a_special_token_stop_string_matches_by_id(served):
    client, _ = served
    text, reason, streamed, streamed_reason = complete(client, max_tokens=48, stop=[IM_END])
    assert text == streamed == SCRIPT and reason == streamed_reason == "stop"


def test_parallel_samples_stop_on_their_own_and_are_not_computed_after(served):
    client, engine = served
    before = engine.stats().generated_tokens
    out = client.completions.create(model=MODEL, prompt="x", n=6, temperature=1.0, seed=5, max_tokens=8, stop=["bb"])
    texts = sorted(choice.text for choice in out.choices)
    assert set(texts) == {"", "a" * 8}, texts  # seed 5 draws both branches
    for choice in out.choices:
        assert choice.finish_reason == ("stop" if choice.text == "" else "length")
    # A stopped sample ends with the token that completed its stop string: nothing is computed for it after that.
    assert out.usage.completion_tokens == 2 * texts.count("") + 8 * texts.count("a" * 8)
    assert engine.stats().generated_tokens - before == out.usage.completion_tokens
