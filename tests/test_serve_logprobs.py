"""Log-probabilities and echo through the server, driven by the official openai client: completions' ``logprobs``
with ``echo`` (lm-eval's log-likelihood call), chat's ``logprobs`` / ``top_logprobs``, in streams too; each value
equals ``log_softmax`` of transformers' own logits for the same positions (fp32, 1e-4)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import torch
from test_serve import MODEL, Served, chat_ids, idle, serving, tiny_model, wait_for

from pagedcore.adapters.transformers.builtin import builtin_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def served(one_thread) -> Iterator[Served]:
    with serving() as s:
        yield s


@pytest.fixture(scope="module")
def logprobs_of():
    """token ids -> (positions - 1, vocab) float32 log-probabilities of each next token, from transformers alone."""
    model = tiny_model().eval()

    def compute(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return compute


def test_completion_echo_logprobs_equal_the_models(served, logprobs_of):
    tokenizer = builtin_tokenizer()
    prompt = tokenizer.encode("The tide turns twice a day")
    answer = served.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    (choice,) = answer.choices
    lp = choice.logprobs
    completion = tokenizer.encode(choice.text[len(tokenizer.decode(prompt)) :], add_special_tokens=False)
    ids = prompt + completion
    assert len(lp.tokens) == len(ids) == len(prompt) + 3
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = logprobs_of(ids)
    for position in range(1, len(ids)):
        expected = float(want[position - 1, ids[position]])
        assert lp.token_logprobs[position] == pytest.approx(expected, abs=1e-4)
        top = lp.top_logprobs[position]
        best = torch.topk(want[position - 1], 2)
        for value, token in zip(best.values.tolist(), best.indices.tolist()):
            assert top[tokenizer.decode([token])] == pytest.approx(value, abs=1e-4)
        assert len(top) <= 3
    # greedy: each generated token is the most likely one there
    for position in range(len(prompt), len(ids)):
        assert lp.token_logprobs[position] == pytest.approx(max(lp.top_logprobs[position].values()), abs=1e-6)
    offsets = lp.text_offset
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], lp.tokens))
    wait_for(lambda: idle(served), "idle")


def test_lm_eval_loglikelihood_call_with_max_tokens_0_and_a_batch(served, logprobs_of):
    """lm-eval's request: token-id prompts in a batch, echo, logprobs=1; max_tokens 0 scores the prompt alone."""
    tokenizer = builtin_tokenizer()
    prompts = [tokenizer.encode("Spring tides"), tokenizer.encode("Neap tides are weak")]
    answer = served.client().completions.create(model=MODEL, prompt=prompts, max_tokens=0, logprobs=1, echo=True)
    assert [c.index for c in answer.choices] == [0, 1]
    for prompt, choice in zip(prompts, answer.choices):
        assert choice.text == tokenizer.decode(prompt)
        values = choice.logprobs.token_logprobs
        assert len(values) == len(prompt) and values[0] is None
        want = logprobs_of(prompt)
        expected = [float(want[i - 1, prompt[i]]) for i in range(1, len(prompt))]
        assert values[1:] == pytest.approx(expected, abs=1e-4)


def test_completion_logprobs_without_echo_and_streamed(served, logprobs_of):
    tokenizer = builtin_tokenizer()
    prompt = tokenizer.encode("High water")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 0}
    whole = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).json()
    (choice,) = whole["choices"]
    generated = tokenizer.encode(choice["text"], add_special_tokens=False)
    want = logprobs_of(prompt + generated)
    expected = [float(want[len(prompt) + i - 1, t]) for i, t in enumerate(generated)]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"])  # logprobs=0: the token alone
    with httpx.stream("POST", f"{served.url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line.removeprefix("data: "))["choices"][0] for line in lines]
    streamed = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(expected, abs=1e-4)
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == list(range(len(generated)))  # one character per token here


def test_chat_logprobs_and_top_logprobs(served, logprobs_of):
    tokenizer = builtin_tokenizer()
    messages = [{"role": "user", "content": "Why are there tides?"}]
    answer = served.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    (choice,) = answer.choices
    content = choice.logprobs.content
    prompt = chat_ids(messages)
    generated = tokenizer.encode(choice.message.content, add_special_tokens=False)
    assert [item.token for item in content] == [tokenizer.decode([t]) for t in generated]
    want = logprobs_of(prompt + generated)
    for i, (item, token) in enumerate(zip(content, generated)):
        row = want[len(prompt) + i - 1]
        assert item.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(torch.topk(row, 3).values.tolist(), abs=1e-4)
        assert item.bytes == list(item.token.encode())
    zero = served.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, logprobs=True, top_logprobs=0
    )
    assert all(item.top_logprobs == [] for item in zero.choices[0].logprobs.content)
    plain = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_stream_carries_logprobs_per_token(served):
    messages = [{"role": "user", "content": "Ebb?"}]
    stream = served.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=1, stream=True
    )
    choices = [choice for chunk in stream for choice in chunk.choices]
    items = [item for choice in choices if choice.logprobs for item in choice.logprobs.content]
    assert len(items) == 5 and all(len(item.top_logprobs) == 1 for item in items)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": 10**6}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ],
)
def test_bad_logprobs_get_a_400_naming_the_field(served, path, body, param):
    response = httpx.post(served.url + path, json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_prompt_logprobs_are_vllms_shape(served, logprobs_of):
    tokenizer = builtin_tokenizer()
    prompt = tokenizer.encode("Moon")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 1}
    (choice,) = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).json()["choices"]
    shown = choice["prompt_logprobs"]
    assert len(shown) == len(prompt) and shown[0] is None
    want = logprobs_of(prompt)
    for i in range(1, len(prompt)):
        entry = shown[i][str(prompt[i])]
        assert entry["logprob"] == pytest.approx(float(want[i - 1, prompt[i]]), abs=1e-4)
        assert entry["decoded_token"] == tokenizer.decode([prompt[i]])
    assert choice["logprobs"] is None
