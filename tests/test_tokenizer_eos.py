"""Issue 26.6: a model folder whose generation config names no eos but whose tokenizer has ``eos_token`` (common for
base models and converted checkpoints) stops at the tokenizer's eos in the Engine and the server, as vLLM does;
``generate(...)`` keeps stock ``generate``'s stop tokens (its generation config's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from models import EOS, tiny_model, tiny_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedcore.adapters.transformers import Engine, SamplingParams

PROMPT = [5, 6, 7, 8, 9]
FORCE_EOS = {EOS: 100.0}  # the model's first token is the tokenizer's eos


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("base-model")
    model = tiny_model("llama")
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None  # no eos but the tokenizer's
    model.save_pretrained(path)
    tokenizer = tiny_tokenizer()
    assert tokenizer.eos_token == "</s>" and tokenizer.eos_token_id == EOS
    tokenizer.save_pretrained(path)
    return path


def test_the_engine_stops_at_the_tokenizers_eos(folder):
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.generation_config.eos_token_id is None and tokenizer.eos_token_id == EOS
    with Engine(model, tokenizer, num_blocks=32, block_size=4) as engine:
        (out,) = engine.generate([PROMPT], SamplingParams(max_new_tokens=8, logit_bias=FORCE_EOS), use_tqdm=False)
        assert out.token_ids == [EOS] and out.finish_reason == "stop"
        assert engine.eos_token_ids == (EOS,)
        ignored = SamplingParams(max_new_tokens=8, logit_bias=FORCE_EOS, ignore_eos=True)
        (out,) = engine.generate([PROMPT], ignored, use_tqdm=False)
        assert out.token_ids == [EOS] * 8 and out.finish_reason == "length"
        # generate's own keywords keep stock generate's stop tokens (the generation config has none)
        (same,) = engine.generate([PROMPT], max_new_tokens=6, do_sample=False, use_tqdm=False)
    stock = model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False)
    assert same.token_ids == stock[0, len(PROMPT) :].tolist()


def read_port(process: subprocess.Popen) -> int:
    assert process.stderr is not None
    lines = []
    for line in process.stderr:
        lines.append(line)
        if line.startswith("pagedcore serve: model"):
            return int(line.split("http://127.0.0.1:", 1)[1].split("/", 1)[0])
    raise AssertionError("the server printed no address: " + "".join(lines))


def test_the_server_stops_at_the_tokenizers_eos_besides_stop_token_ids(folder):
    command = [sys.executable, "-m", "pagedcore", "serve", "--model", str(folder), "--port", "0", "--threads", "1"]
    process = subprocess.Popen([*command, "--num-blocks", "64"], stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{read_port(process)}/v1/completions"
        body = {"model": str(folder), "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logit_bias": {"2": 100}}

        def ask(**fields) -> tuple[str, int]:
            answer = httpx.post(url, json={**body, **fields}, timeout=60).json()
            return answer["choices"][0]["finish_reason"], answer["usage"]["completion_tokens"]

        assert ask() == ("stop", 1)
        assert ask(stop_token_ids=[50]) == ("stop", 1)  # stop_token_ids stop besides eos (vLLM's rule)
        assert ask(ignore_eos=True) == ("length", 8)
        assert ask(ignore_eos=True, stop_token_ids=[EOS]) == ("stop", 1)  # ignore_eos ignores eos alone
    finally:
        process.terminate()
        process.communicate(timeout=60)
