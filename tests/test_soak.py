"""Soak: a long randomized Engine run under memory pressure, checked step by step and against the reference.

Random prompt and output lengths, shared and unshared prefixes, several namespaces, arrivals between steps, aborts,
parallel samples, and a pool small enough to force eviction and preemption. After every step the BlockManager and
trie invariants hold; at the end no block is held; every greedy output equals ``model.generate`` on that prompt
alone (an aborted one is a prefix of it).

CI runs a bounded version. The long run: ``PAGEDCORE_SOAK_REQUESTS=2000 pytest tests/test_soak.py -s``.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest
import torch
from models import FIRST_TOKEN, VOCAB, tiny_model
from transformers import DynamicCache

from pagedcore import PagedCoreError, hookimpl
from pagedcore.adapters.transformers import Engine, SamplingParams

REQUESTS = int(os.environ.get("PAGEDCORE_SOAK_REQUESTS", "400"))


@dataclass
class SoakReport:
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    rejected: int = 0
    steps: int = 0
    preemptions: int = 0
    evictions: int = 0
    prefix_hit_tokens: int = 0
    samples_checked: int = 0
    observer_faults: int = 0
    leaked_blocks: int = 0
    notes: list[str] = field(default_factory=list)


class Evictions:
    def __init__(self) -> None:
        self.count = 0

    @hookimpl
    def pagedcore_blocks_evicted(self, block_ids):
        self.count += len(block_ids)


class FlakyObserver:
    """Raises in every 7th event: an observer bug must never reach the pool or the requests."""

    def __init__(self) -> None:
        self.calls = 0

    @hookimpl
    def pagedcore_request_admitted(self, request_id):
        self.calls += 1
        if self.calls % 7 == 0:
            raise RuntimeError("observer bug")


def run_soak(family: str, num_requests: int, seed: int) -> SoakReport:
    model = tiny_model(family)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(rng.choice([8, 16, 24]))] for _ in range(4)]
    report = SoakReport()
    references: dict[tuple[int, ...], list[int]] = {}

    def reference(prompt: list[int], max_new: int) -> list[int]:
        key = (*prompt, -max_new)
        if key not in references:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, cache=DynamicCache(config=model.config)
            )
            references[key] = out[0, len(prompt) :].tolist()
        return references[key]

    engine = Engine(model, num_blocks=24, block_size=4, max_num_batched_tokens=rng.choice([16, 32]), max_num_seqs=8)
    evictions, flaky = Evictions(), FlakyObserver()
    engine.pool.plugins.register(evictions, name="soak-evictions")
    engine.pool.plugins.register(flaky, name="soak-flaky")
    errors_before = engine.pool.plugins.num_observer_errors
    submitted: dict[str, tuple[list[int], SamplingParams]] = {}
    outputs = {}
    try:
        while report.requests < num_requests or engine.has_unfinished():
            for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):  # arrivals between steps
                if report.requests >= num_requests:
                    break
                prompt = (rng.choice(prefixes) if rng.random() < 0.7 else []) + [
                    rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(rng.randrange(1, 16))
                ]
                params = SamplingParams(max_new_tokens=rng.randrange(1, 12), n=rng.choice([1, 1, 1, 2, 3]))
                report.requests += 1
                try:
                    rid = engine.add_request(prompt, params, namespace=rng.choice([None, None, "tenant-b"]))
                except PagedCoreError:
                    report.rejected += 1
                    continue
                submitted[rid] = (prompt, params)
            if submitted and rng.random() < 0.02:
                victim = rng.choice(list(submitted))
                if victim not in outputs:
                    try:
                        engine.abort(victim)
                    except PagedCoreError:
                        pass  # finished in the meantime
            for out in engine.step():
                outputs[out.request_id] = out
            report.steps += 1
            engine.pool.check_invariants()
        report.leaked_blocks = engine.pool.kv.num_used_blocks
        stats = engine.stats()
        report.preemptions = stats.num_preemptions
        report.prefix_hit_tokens = stats.prefix_hit_tokens
        report.evictions = evictions.count
        report.observer_faults = engine.pool.plugins.num_observer_errors - errors_before
    finally:
        engine.pool.plugins.unregister(name="soak-evictions")
        engine.pool.plugins.unregister(name="soak-flaky")
        engine.close()
    for rid, (prompt, params) in submitted.items():
        out = outputs[rid]
        want = reference(prompt, params.max_new_tokens)
        for sample in out.samples:
            if sample.finish_reason == "abort":
                assert sample.token_ids == want[: len(sample.token_ids)], f"{rid}: aborted output diverged"
            else:
                assert sample.finish_reason == "length", (rid, sample.finish_reason, out.error)
                assert sample.token_ids == want, f"{rid} (sample {sample.index}) differs from generate alone"
            report.samples_checked += 1
        report.aborted += out.finish_reason == "abort"
        report.finished += out.finish_reason == "length"
    return report


@pytest.mark.parametrize(("family", "seed"), [("llama", 0), ("gemma3", 1)])
def test_soak(family, seed):
    report = run_soak(family, REQUESTS if family == "llama" else max(REQUESTS // 2, 40), seed)
    print(f"\nsoak {family}: {report}")
    assert report.leaked_blocks == 0
    assert report.preemptions > 0, "the pool should be small enough to force preemption"
    assert report.evictions > 0, "the pool should be small enough to force eviction"
    assert report.prefix_hit_tokens > 0
    assert report.observer_faults > 0  # faults were injected and survived
    assert report.finished + report.aborted + report.rejected == report.requests
