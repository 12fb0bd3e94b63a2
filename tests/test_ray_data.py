"""pagedcore.serve.ray.GenerateBatch with Ray Data on a local cluster (``ray.init(num_cpus=2)``), one per module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from pagedcore.adapters.transformers import Engine, SamplingParams  # noqa: E402
from pagedcore.serve.ray import GenerateBatch, ModelSpec  # noqa: E402

TINY = ModelSpec(builtin_overrides={"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128}, threads=1)
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        yield
    finally:
        ray.shutdown()


def test_ray_data_run_over_500_prompts_equals_engine_generate_alone(cluster):
    prompts = [f"Prompt {i % 7} shares a prefix; then {i}" for i in range(500)]
    dataset = ray.data.from_items([{"prompt": p, "index": i} for i, p in enumerate(prompts)])
    generated = dataset.map_batches(
        GenerateBatch,
        fn_constructor_kwargs={"model": TINY, "max_new_tokens": 6, "engine_kwargs": {"num_blocks": 256}},
        compute=ray.data.ActorPoolStrategy(size=2),
        batch_size=50,
        num_cpus=1,
    )
    rows = sorted(generated.take_all(), key=lambda row: row["index"])
    model, tokenizer = TINY.load()
    with Engine(model, tokenizer, num_blocks=256) as engine:
        expected = engine.generate(prompts, SamplingParams(max_new_tokens=6), use_tqdm=False)
    assert [row["prompt"] for row in rows] == prompts
    assert [list(row["generated_token_ids"]) for row in rows] == [out.token_ids for out in expected]
    assert [row["generated_text"] for row in rows] == [out.text for out in expected]
    assert all(row["error"] == "" for row in rows)
    assert sum(row["num_cached_tokens"] for row in rows) > 0  # the shared prefixes hit within each worker


def test_generate_batch_takes_token_ids_and_reports_a_bad_prompt_without_failing_the_batch():
    generate = GenerateBatch(TINY, max_new_tokens=3)
    prompts = np.empty(3, dtype=object)
    prompts[:] = [np.array([5, 6, 7]), [], "fine"]
    out = generate({"prompt": prompts})
    assert [len(ids) for ids in out["generated_token_ids"]] == [3, 0, 3]
    assert out["error"][0] == "" and "empty" in out["error"][1] and out["error"][2] == ""
    assert generate.engine.pool.kv.num_used_blocks == 0


def test_the_batch_example_generates_for_every_prompt(cluster, capsys):
    spec = importlib.util.spec_from_file_location("example_ray_batch", EXAMPLES / "ray_batch.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.main(["--prompts", "120", "--workers", "1", "--max-new-tokens", "2", "--batch-size", "30"]) == 0
    out = capsys.readouterr().out
    assert "120 prompts (0 failed) on 1 workers" in out and "prefix cache served" in out
