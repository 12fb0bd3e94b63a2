"""Adversarial and edge-case inputs: each gets a clear, typed error or correct output, and leaves no block held.

The table in docs/limits.md ("Bad input") lists these cases; keep the two in step. ``pytest tests/test_adversarial.py
-s`` prints the table as measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from models import FIRST_TOKEN, VOCAB, tiny_model
from transformers import DynamicCache

from pagedcore import ConfigError, InvalidRequestError, OutOfBlocksError, PagedCoreError, PoolMismatchError
from pagedcore.adapters import transformers as pc
from pagedcore.adapters.transformers import Engine, PagedCache, PagedKVPool

BLOCK = 4
NUM_BLOCKS = 16  # 64 tokens per KV group


@dataclass
class Case:
    name: str
    run: Callable[[], object]  # returns a description of the output, or raises
    expect: type[Exception] | None  # the typed error expected, or None for correct output
    match: str = ""


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def reference(model, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, cache=DynamicCache(config=model.config)
    )
    return out[0, len(prompt) :].tolist()


def engine_cases(model, engine: Engine) -> list[Case]:
    def one(prompt, **params):
        def run():
            out = engine.generate([prompt], params if params else None, use_tqdm=False)[0]
            if out.error:  # generate() reports a bad request in its output; raise it to check its type and text
                kind, _, message = out.error.partition(": ")
                assert kind == "InvalidRequestError", out.error
                raise InvalidRequestError(message)
            return out

        return run

    def exact(prompt, max_new):
        def run():
            out = one(prompt, max_new_tokens=max_new)()
            assert out.token_ids == reference(model, prompt, max_new)
            return f"{len(out.token_ids)} tokens, equal to generate alone"

        return run

    def duplicate_id():
        engine.add_request([5, 6], request_id="dup")
        try:
            engine.add_request([5, 6], request_id="dup")
        finally:
            engine.abort("dup")

    tokens = list(range(FIRST_TOKEN, FIRST_TOKEN + 70))
    return [
        Case("Engine: empty prompt", one([]), InvalidRequestError, "empty"),
        Case("Engine: token id >= vocabulary size", one([5, VOCAB]), InvalidRequestError, "vocabulary"),
        Case("Engine: negative token id", one([5, -1]), InvalidRequestError, "vocabulary"),
        Case("Engine: non-integer token", one([5, "x"]), InvalidRequestError, "token ids"),
        Case("Engine: prompt of exactly one block", exact(tokens[:BLOCK], 3), None),
        Case("Engine: prompt one token over a block", exact(tokens[: BLOCK + 1], 3), None),
        # The last new token is sampled but never stored: 61 + 4 - 1 = 64 positions fill the pool's 16 blocks of 4.
        Case("Engine: prompt + new tokens - 1 = the whole pool", exact(tokens[:61], 4), None),
        Case(
            "Engine: one token more than the pool", one(tokens[:62], max_new_tokens=4), InvalidRequestError, "never fit"
        ),
        Case(
            "Engine: prompt longer than the model's context",
            one([5] * 600, max_new_tokens=1),
            InvalidRequestError,
            "context",
        ),
        Case("Engine: max_new_tokens=0", lambda: one([5, 6], max_new_tokens=0)().token_ids, None),
        Case("Engine: temperature < 0", one([5], temperature=-1.0), InvalidRequestError, "temperature"),
        Case("Engine: temperature NaN", one([5], temperature=float("nan")), InvalidRequestError, "temperature"),
        Case("Engine: top_p = 0", one([5], top_p=0.0), InvalidRequestError, "top_p"),
        Case("Engine: top_p > 1", one([5], top_p=1.5), InvalidRequestError, "top_p"),
        Case("Engine: top_k < 0", one([5], top_k=-3), InvalidRequestError, "top_k"),
        Case("Engine: n = 0", one([5], n=0), InvalidRequestError, "n must be"),
        Case("Engine: huge n (10,000)", one([5], n=10_000), InvalidRequestError, "parallel samples"),
        Case("Engine: unknown sampling field", one([5], beams=3), InvalidRequestError, "beams"),
        Case("Engine: duplicate request id", duplicate_id, InvalidRequestError, "already in use"),
        Case(
            "Engine: request id with '#'",
            lambda: engine.add_request([5], request_id="a#1"),
            InvalidRequestError,
            "without '#'",
        ),
        Case(
            "Engine: abort of an unknown id", lambda: engine.abort("nobody"), InvalidRequestError, "no running request"
        ),
        Case(
            "Engine: unhashable namespace",
            lambda: engine.add_request([5], namespace=["t"]),
            InvalidRequestError,
            "hashable",
        ),
        Case(
            "Engine: string prompt without a tokenizer",
            lambda: engine.add_request("hi"),
            InvalidRequestError,
            "tokenizer",
        ),
    ]


def generate_cases(model, pool: PagedKVPool) -> list[Case]:
    def gen(ids, **kwargs):
        return lambda: model.generate(torch.tensor(ids), **{"max_new_tokens": 2, **kwargs}).shape

    return [
        Case(
            "enable()d generate: token id >= vocabulary size", gen([[5, VOCAB + 3]]), InvalidRequestError, "vocabulary"
        ),
        Case("enable()d generate: empty prompt", gen([[]]), InvalidRequestError, "empty"),
        Case(
            "enable()d generate: float input_ids",
            lambda: model.generate(torch.tensor([[5.0, 6.0]]), max_new_tokens=2),
            InvalidRequestError,
            "torch.float32",
        ),
        Case(
            "enable()d generate: bool input_ids",
            lambda: model.generate(torch.tensor([[True, False]]), max_new_tokens=2),
            InvalidRequestError,
            "torch.bool",
        ),
        Case(
            "enable()d generate: prompt + new tokens over the model's context",
            gen([[5] * 510], max_new_tokens=5),
            InvalidRequestError,
            "context",
        ),
        Case(
            "enable()d generate: unhashable namespace",
            gen([[5, 6]], pagedcore_namespace={"a": 1}),
            InvalidRequestError,
            "hashable",
        ),
        Case(
            "enable()d generate: request larger than the pool",
            gen([[5] * 40], max_new_tokens=40),
            OutOfBlocksError,
            "needs up to",
        ),
        Case(
            "enable()d generate: max_new_tokens=0 (transformers' own check)",
            gen([[5, 6]], max_new_tokens=0),
            ValueError,
            "max_new_tokens",
        ),
        Case(
            "enable()d generate: prompt of exactly one block, twice",
            lambda: [gen([[5, 6, 7, 8]])() for _ in "ab"],
            None,
        ),
    ]


def cache_cases(model) -> list[Case]:
    other = tiny_model("llama", num_hidden_layers=3)

    def too_small():
        cache = PagedCache(model, num_blocks=2, block_size=BLOCK)
        try:
            model.generate(torch.tensor([[5] * 12]), max_new_tokens=2, cache=cache)
        finally:
            assert cache.pool.kv.num_used_blocks == 0 or cache.release() is None
            assert cache.pool.kv.num_used_blocks == 0

    return [
        Case("PagedCache: pool too small for the prompt", too_small, OutOfBlocksError, "cannot hold"),
        Case(
            "PagedCache: pool of another model",
            lambda: PagedCache(other, pool=PagedKVPool(model, num_blocks=4)),
            PoolMismatchError,
            "layers",
        ),
        Case("PagedKVPool: num_blocks=0", lambda: PagedKVPool(model, num_blocks=0), ConfigError, "num_blocks"),
        Case("PagedKVPool: block_size=-1", lambda: PagedKVPool(model, block_size=-1), ConfigError, "block_size"),
        Case(
            "PagedKVPool: memory budget below one block",
            lambda: PagedKVPool(model, memory_budget="1KiB"),
            ConfigError,
            "holds no block",
        ),
        Case(
            "PagedKVPool: memory budget not a size",
            lambda: PagedKVPool(model, memory_budget="lots"),
            ConfigError,
            "must be a size",
        ),
        Case(
            "PagedKVPool: both num_blocks and memory_budget",
            lambda: PagedKVPool(model, num_blocks=4, memory_budget="1MiB"),
            ConfigError,
            "not both",
        ),
    ]


TABLE: list[tuple[str, str]] = []


def check(case: Case, pool: PagedKVPool) -> None:
    if case.expect is None:
        result = case.run()
        TABLE.append((case.name, f"correct output ({result})" if isinstance(result, str) else "correct output"))
    else:
        with pytest.raises(case.expect, match=case.match) as info:
            case.run()
        TABLE.append((case.name, f"{type(info.value).__name__}: {str(info.value).splitlines()[0][:90]}"))
    assert pool.kv.num_used_blocks == 0, f"{case.name}: blocks leaked"
    pool.check_invariants()


def test_engine_inputs(model):
    with Engine(model, num_blocks=NUM_BLOCKS, block_size=BLOCK, max_num_seqs=8) as engine:
        for case in engine_cases(model, engine):
            check(case, engine.pool)


def test_enabled_generate_inputs(model):
    pool = pc.enable(model, num_blocks=NUM_BLOCKS, block_size=BLOCK)
    try:
        for case in generate_cases(model, pool):
            check(case, pool)
    finally:
        pc.disable(model)


def test_cache_and_pool_inputs(model):
    for case in cache_cases(model):
        check(case, PagedKVPool(model, num_blocks=4))


def test_errors_are_typed():
    for error in (InvalidRequestError, OutOfBlocksError, PoolMismatchError, ConfigError):
        assert issubclass(error, PagedCoreError)


def test_print_table():
    if TABLE:
        width = max(len(name) for name, _ in TABLE)
        print("\n" + "\n".join(f"{name:<{width}}  {result}" for name, result in TABLE))
