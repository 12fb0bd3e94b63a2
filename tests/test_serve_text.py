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


def _stop_reason(choice) -> object:
    return (choice.model_extra or {}).get("stop_reason", "absent")


def test_a_stop_tokens_text_is_kept_only_when_asked_and_stop_reason_names_it(served):
    """vLLM's rule: a stop token's text is left out unless ``include_stop_str_in_output`` (the audit found it always
    kept, and a stop token that is half a character left U+FFFD); every choice carries vLLM's ``stop_reason``."""
    client, _ = served
    space, half = ids_of(TOKENIZER, " ")[0], ids_of(TOKENIZER, "ʖ")[0]  # the script's last token; half of "ʖ"
    prompt = [TOKENIZER.convert_tokens_to_ids(IM_END)]
    for include, expected in ((False, SCRIPT[:-1]), (True, SCRIPT)):
        args = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 48}
        extra = {"stop_token_ids": [space], "include_stop_str_in_output": include}
        out = client.completions.create(**args, extra_body=extra).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(**args, extra_body=extra, stream=True) if c.choices]
        assert out.text == "".join(c.text for c in chunks) == expected
        assert out.finish_reason == chunks[-1].finish_reason == "stop"
        assert _stop_reason(out) == _stop_reason(chunks[-1]) == space
        assert all(_stop_reason(c) is None for c in chunks[:-1])
    out = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=48,
                                    extra_body={"stop_token_ids": [half]}).choices[0]  # fmt: skip
    assert out.text == "中" and _stop_reason(out) == half
    text = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=48, stop=["😀é"]).choices[0]
    assert _stop_reason(text) == "😀é" and text.text == "中ʖ"
    length = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=3).choices[0]
    assert length.finish_reason == "length" and _stop_reason(length) is None
    args = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 12, "temperature": 0}
    first = client.chat.completions.create(**args).choices[0].message.content[0]
    token = ids_of(TOKENIZER, first)[0]
    chat = client.chat.completions.create(**args, extra_body={"stop_token_ids": [token]}).choices[0]
    assert chat.finish_reason == "stop" and _stop_reason(chat) == token and chat.message.content == ""
    chat = client.chat.completions.create(**args, stop=[first]).choices[0]
    assert chat.finish_reason == "stop" and _stop_reason(chat) == first


def test_continuous_usage_is_each_chunks_own_choice(served):
    """vLLM's ``continuous_usage_stats``: a chunk's usage counts its own prompt and the tokens its own choice has
    generated so far (it was the running total of every choice, prompts summed)."""
    client, _ = served
    prompts = [[TOKENIZER.convert_tokens_to_ids(IM_END)], ids_of(TOKENIZER, "中ʖ")]
    options = {"include_usage": True, "continuous_usage_stats": True}
    stream = client.completions.create(
        model=MODEL, prompt=prompts, n=2, temperature=0, max_tokens=3, stream=True, stream_options=options
    )
    counted: dict[int, int] = {}
    chunks = list(stream)
    for chunk in chunks[:-1]:  # a token that completes no character sends no chunk, but it is counted
        choice = chunk.choices[0]
        assert chunk.usage.prompt_tokens == len(prompts[choice.index // 2]), chunk
        assert counted.get(choice.index, 0) <= chunk.usage.completion_tokens <= 3, chunk
        counted[choice.index] = chunk.usage.completion_tokens
        assert choice.finish_reason is None or chunk.usage.completion_tokens == 3
    assert counted == {0: 3, 1: 3, 2: 3, 3: 3}
    total = chunks[-1].usage
    assert not chunks[-1].choices and (total.prompt_tokens, total.completion_tokens) == (2 * 1 + 2 * 2, 12)
