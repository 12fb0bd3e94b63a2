"""lm-evaluation-harness against the server, offline, on tiny local tasks: a multiple-choice (log-likelihood) task
through ``local-completions`` with a saved Hugging Face tokenizer and with ``tokenizer_backend=remote`` (the
server's ``/tokenizer_info``, ``/tokenize``, ``/detokenize``), a generate_until task through ``local-completions``
and through ``local-chat-completions``. The log-likelihoods lm-eval reports equal those computed from the model."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_serve import MODEL, Served, serving, tiny_model

from pagedcore.adapters.transformers.builtin import builtin_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when datasets is imported: set before lm_eval loads it
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = [
    {"question": "The sea rises at", "choices": [" high tide", " low tide", " noon"], "answer": 0},
    {"question": "Tides follow the", "choices": [" moon", " wind"], "answer": 0},
    {"question": "Ebb means the water", "choices": [" falls", " rises", " boils"], "answer": 0},
]

MULTIPLE_CHOICE = """task: tides_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""

GENERATE = """task: tides_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def served(one_thread) -> Iterator[Served]:
    with serving() as s:
        yield s


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    data = folder / "tides.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (folder / "tides_mc.yaml").write_text(MULTIPLE_CHOICE.format(data=data))
    (folder / "tides_gen.yaml").write_text(GENERATE.format(data=data))
    builtin_tokenizer().save_pretrained(folder / "tokenizer")
    return folder


def evaluate(served: Served, tasks: Path, model: str, task: str, **model_args: str):
    from lm_eval.tasks import TaskManager

    path = "/v1/chat/completions" if model == "local-chat-completions" else "/v1/completions"
    args = {"model": MODEL, "base_url": f"{served.url}{path}", "num_concurrent": "2", **model_args}
    return lm_eval.simple_evaluate(
        model=model,
        model_args=",".join(f"{k}={v}" for k, v in args.items()),
        tasks=[task],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        apply_chat_template=model == "local-chat-completions",
    )


def direct_loglikelihood(context: str, continuation: str) -> float:
    tokenizer = builtin_tokenizer()
    context_ids = tokenizer.encode(context)
    continuation_ids = tokenizer.encode(continuation)
    ids = context_ids + continuation_ids
    with torch.no_grad():
        logits = tiny_model().eval()(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[len(context_ids) + i - 1, t]) for i, t in enumerate(continuation_ids))


@pytest.mark.parametrize("backend", ["huggingface", pytest.param("remote", marks=pytest.mark.slow)])
def test_multiple_choice_loglikelihoods_equal_the_models(served, tasks, backend, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    extra = {"tokenizer_backend": backend}
    if backend == "huggingface":
        extra["tokenizer"] = str(tasks / "tokenizer")
    results = evaluate(served, tasks, "local-completions", "tides_mc", **extra)
    samples = results["samples"]["tides_mc"]
    assert len(samples) == len(DOCS)
    for sample in samples:
        for (context, continuation), ((loglikelihood, _),) in zip(sample["arguments"], sample["resps"]):
            assert loglikelihood == pytest.approx(direct_loglikelihood(context, continuation), abs=1e-3)
    assert 0.0 <= results["results"]["tides_mc"]["acc,none"] <= 1.0


@pytest.mark.slow  # lm-eval's start-up is most of it: the log-likelihood test above runs in CI
@pytest.mark.parametrize("model", ["local-completions", "local-chat-completions"])
def test_generate_until_runs_without_error(served, tasks, model, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    extra = {"tokenizer_backend": "None"} if model == "local-chat-completions" else {"tokenizer_backend": "remote"}
    results = evaluate(served, tasks, model, "tides_gen", **extra)
    samples = results["samples"]["tides_gen"]
    assert len(samples) == len(DOCS) and all(isinstance(s["resps"][0][0], str) for s in samples)
