"""LoRA adapters through the server (issue 31, item 1), with the clients vLLM users drive it with: ``pagedcore serve
--enable-lora --lora-modules ... --max-loras --max-lora-rank`` as a real process, the official openai client choosing
an adapter by ``model`` (answers equal PEFT's ``generate`` with that adapter alone, and carry its name),
``/v1/models`` listing adapters with their ``parent``, ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` over
HTTP (vLLM's bodies, answers and statuses, only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), lm-eval's
``local-completions`` against an adapter (its log-likelihoods equal PEFT's), and the flags refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

pytest.importorskip("openai")  # the serve and test extras: the GPU image has neither
pytest.importorskip("fastapi")
pytest.importorskip("peft")

import httpx
import openai
import torch
from lora_helpers import ALL_LINEAR, base_model, make_adapter, peft_model, reference
from models import tiny_tokenizer
from test_serve_flags import serve

from pagedcore.adapters.transformers import Engine
from pagedcore.cli import main
from pagedcore.serve import BackgroundServer, EngineLoop, create_app

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 5
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("serve_lora")
    model = base_model()
    model.generation_config.eos_token_id = None
    model.save_pretrained(root / "base")
    tiny_tokenizer().save_pretrained(root / "base")
    return {
        "base": str(root / "base"),
        "a": make_adapter(root / "a", seed=1, r=4),
        "b": make_adapter(root / "b", seed=2, r=8, targets=ALL_LINEAR),
        "c": make_adapter(root / "c", seed=3, r=2, targets=("q_proj", "o_proj")),
        "big": make_adapter(root / "big", seed=4, r=32),
    }


@pytest.fixture(scope="module")
def expected(files):
    models: dict[str | None, torch.nn.Module] = {}

    def answer(lora: str | None, prompt: list[int]) -> list[int]:
        if lora not in models:
            models[lora] = peft_model(None if lora is None else files[lora])
        return reference(models[lora], prompt, NEW)[0]

    return answer


def complete(client: openai.OpenAI, model: str, prompt: list[int]) -> tuple[list[int], str]:
    answer = client.completions.create(
        model=model, prompt=prompt, max_tokens=NEW, temperature=0, extra_body={"return_token_ids": True}
    )
    return answer.choices[0].model_extra["token_ids"], answer.model


def words(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def test_adapters_by_model_name_through_a_server_process(files, expected, tmp_path):
    argv = [files["base"], "--port", "0", "--threads", "1", "--num-blocks", "128", "--served-model-name", "base",
            "--enable-lora", "--lora-modules", f"a={files['a']}", json.dumps({"name": "b", "path": files["b"]}),
            "--max-loras", "2", "--max-lora-rank", "8"]  # fmt: skip
    with serve(tmp_path, *argv, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        cards = {card.id: card for card in client.models.list().data}
        assert list(cards) == ["base", "a", "b"]
        assert cards["a"].model_extra["parent"] == "base" and cards["a"].model_extra["root"] == files["a"]
        assert cards["base"].model_extra["parent"] is None
        assert client.models.retrieve("b").id == "b"
        for lora in (None, "a", "b"):
            for prompt in PROMPTS:
                tokens, model = complete(client, lora or "base", prompt)
                assert tokens == expected(lora, prompt) and model == (lora or "base")
        chat = client.chat.completions.create(
            model="a", messages=[{"role": "user", "content": words(PROMPTS[1])}], max_tokens=3, temperature=0
        )
        assert chat.model == "a" and chat.usage.completion_tokens == 3
        responses = client.responses.create(model="b", input=words(PROMPTS[1]), max_output_tokens=3)
        assert responses.model == "b"
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model="nope", prompt=PROMPTS[0], max_tokens=1)
        assert missing.value.body["param"] == "model" and "LoRA adapter" in missing.value.body["message"]
        _load_and_unload_over_http(server.url, client, files, expected)


def _load_and_unload_over_http(url: str, client: openai.OpenAI, files: dict[str, str], expected) -> None:
    load = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": files["c"]})
    assert load.status_code == 200 and load.text == "Success: LoRA adapter 'c' added successfully."
    assert [card.id for card in client.models.list().data] == ["base", "a", "b", "c"]
    assert complete(client, "c", PROMPTS[0])[0] == expected("c", PROMPTS[0])
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": files["c"]})
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    missing = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": "/no/such/adapter"})
    assert missing.status_code == 404 and "No adapter found" in missing.json()["error"]["message"]
    big = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": files["big"]})
    assert big.status_code == 400 and "LoRA rank 32 is greater than max_lora_rank 8" in big.json()["error"]["message"]
    extra = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": files["c"], "x": 1})
    assert extra.status_code == 400 and "x" in extra.json()["error"]["message"]
    inplace = {"lora_name": "a", "lora_path": files["c"], "load_inplace": True}  # vLLM's in-place reload
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=inplace).status_code == 200
    assert complete(client, "a", PROMPTS[1])[0] == expected("c", PROMPTS[1])
    unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert unload.status_code == 200 and unload.text == "Success: LoRA adapter 'c' removed successfully."
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt=PROMPTS[0], max_tokens=1)
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]
    ids = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "b", "lora_int_id": 2})
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "lora_int_id"


def test_runtime_loading_is_off_without_vllms_switch(files, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    with served_in_process(files) as url:
        body = {"lora_name": "c", "lora_path": files["c"]}
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 404
        assert "/v1/load_lora_adapter" not in httpx.get(f"{url}/openapi.json").json()["paths"]
        assert [card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"]] == ["base", "a"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-loras", "2"], "--max-loras needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "nopath"], "expected name=path"),
        (["--enable-lora", "--max-loras", "0"], "--max-loras must be >= 1"),
        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "--lora-modules names a more than once"),
        (["--enable-lora", "--lora-modules", "pagedcore-builtin=/x"], "served under that name already"),
        (["--enable-lora", "--max-cpu-loras", "4"], "--max-cpu-loras 4 is not supported: every loaded adapter"),
        (["--enable-lora", "--lora-dtype", "float16"], "--lora-dtype float16 is not supported"),
        (["--enable-lora", "--fully-sharded-loras"], "--fully-sharded-loras is not supported"),
        (["--enable-lora", "--lora-modules", "x=/no/such/adapter"], "--lora-modules x=/no/such/adapter: No adapter"),
        (["--enable-lora", "--ray", "--lora-modules", "x=/y"], "--enable-lora is not supported with --ray"),
    ],
)
def test_lora_flags_that_cannot_be_served_exit_2_naming_them(argv, message, capsys):
    try:
        code = main(["serve", "--port", "0", "--num-blocks", "16", *argv])
    except SystemExit as exc:  # argparse's own refusal of a value
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


class _InProcess:
    def __init__(self, files: dict[str, str], **options) -> None:
        self.engine = Engine(base_model(), tiny_tokenizer(), num_blocks=128, block_size=4, enable_lora=True)
        self.engine.loras.load("a", files["a"])
        from pagedcore.serve.app import AppOptions

        self.loop = EngineLoop(self.engine)
        app = create_app(self.loop, model_name="base", options=AppOptions(**options))
        self.server = BackgroundServer(app, self.loop)


def served_in_process(files: dict[str, str], **options):
    import contextlib

    @contextlib.contextmanager
    def run() -> Iterator[str]:
        served = _InProcess(files, **options)
        served.server.start()
        try:
            yield served.server.url
        finally:
            served.server.stop()
            served.engine.close()

    return run()


LM_EVAL_DOCS = [
    {"question": "t5 t6 t7", "choices": [" t8 t9", " t10", " t11 t12 t13"], "answer": 0},
    {"question": "t14 t15 t16 t17", "choices": [" t18", " t19 t20"], "answer": 1},
]
LM_EVAL_TASK = """task: lora_mc
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


def test_lm_eval_local_completions_against_an_adapter(files, tmp_path, monkeypatch):
    """lm-eval's log-likelihood requests naming the adapter: each equals the log-likelihood PEFT's model gives."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in LM_EVAL_DOCS))
    (tmp_path / "lora_mc.yaml").write_text(LM_EVAL_TASK.format(data=data))
    with served_in_process(files) as url:
        args = {"model": "a", "base_url": f"{url}/v1/completions", "num_concurrent": "2",
                "tokenizer_backend": "huggingface", "tokenizer": files["base"]}  # fmt: skip
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=",".join(f"{k}={v}" for k, v in args.items()),
            tasks=["lora_mc"],
            task_manager=TaskManager(include_path=str(tmp_path)),
            log_samples=True,
        )
    adapter, base = peft_model(files["a"]), base_model()
    for sample in results["samples"]["lora_mc"]:
        for (context, continuation), ((loglikelihood, _),) in zip(sample["arguments"], sample["resps"]):
            assert loglikelihood == pytest.approx(_loglikelihood(adapter, context, continuation), abs=1e-4)
            assert (
                abs(loglikelihood - _loglikelihood(base, context, continuation)) > 1e-3
            )  # the adapter's, not the base's


def _loglikelihood(model: torch.nn.Module, context: str, continuation: str) -> float:
    tokenizer = tiny_tokenizer()
    context_ids, continuation_ids = tokenizer.encode(context), tokenizer.encode(continuation)
    with torch.no_grad():
        logits = model(torch.tensor([context_ids + continuation_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[len(context_ids) + i - 1, t]) for i, t in enumerate(continuation_ids))
