"""Soak: a long randomized Engine run under memory pressure and user-code faults, checked step by step and against
the reference.

Random prompt and output lengths, shared and unshared prefixes, several namespaces, arrivals between steps, aborts,
parallel samples, and a pool small enough to force eviction and preemption. Requests come through all three doors:
``add_request`` (reported by ``step()``), ``generate`` and ``stream``. User code misbehaves throughout: the tokenizer
raises on every Nth ``decode``, observer plugins raise, stream consumers close their stream early, and a second
thread aborts running requests while the model forward runs.

After every step the BlockManager, trie and scheduler invariants hold and the Engine tracks exactly the requests the
scheduler runs (no zombie). At the end nothing is unfinished and no block is held; every request was reported
exactly once (by ``generate``, by its ``stream`` or by ``step()``); every greedy output that finished equals
``model.generate`` on that prompt alone, and an aborted or failed one is a prefix of it (up to a near-tie of the
reference's two best logits, within the 1e-4 fp32 tolerance, after which paths may differ; counted in the report).

CI runs a bounded version (about 20 s on an idle 2-core machine). The long run:
``PAGEDCORE_SOAK_REQUESTS=2000 pytest tests/test_soak.py -s``.
"""

from __future__ import annotations

import os
import random
import threading
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from models import FIRST_TOKEN, VOCAB, tiny_model, tiny_tokenizer
from transformers import DynamicCache

from pagedcore import PagedCoreError, hookimpl
from pagedcore.adapters.transformers import Engine, RequestOutput, SamplingParams

REQUESTS = int(os.environ.get("PAGEDCORE_SOAK_REQUESTS", "400"))
DECODE_FAULT_EVERY = 151  # the tokenizer raises on every Nth decode call
FORWARD_ABORT_RATE = 0.03  # chance that a forward sees an abort from a second thread


@dataclass
class SoakReport:
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    rejected: int = 0
    steps: int = 0
    preemptions: int = 0
    evictions: int = 0
    prefix_hit_tokens: int = 0
    samples_checked: int = 0
    observer_faults: int = 0
    decode_faults: int = 0
    forward_aborts: int = 0
    streams_closed_early: int = 0
    generate_calls: int = 0
    leaked_blocks: int = 0
    greedy_ties: int = 0  # outputs that left the reference at a near-tie of its two best logits (float noise)
    notes: list[str] = field(default_factory=list)


class Evictions:
    def __init__(self) -> None:
        self.count = 0

    @hookimpl
    def pagedcore_blocks_evicted(self, block_ids):
        self.count += len(block_ids)


class FlakyObserver:
    """Raises in every 7th admission and every 5th finish: an observer bug must never reach the pool or the
    requests."""

    def __init__(self) -> None:
        self.admitted = self.finished = 0

    @hookimpl
    def pagedcore_request_admitted(self, request_id):
        self.admitted += 1
        if self.admitted % 7 == 0:
            raise RuntimeError("observer bug")

    @hookimpl
    def pagedcore_request_finished(self, request_id):
        self.finished += 1
        if self.finished % 5 == 0:
            raise RuntimeError("observer bug")


class FaultyTokenizer:
    """The tiny tokenizer, raising on every ``every``-th ``decode``: that request fails, the others go on."""

    def __init__(self, every: int) -> None:
        self.inner = tiny_tokenizer()
        self.every = every
        self.calls = self.faults = 0

    def __call__(self, text, **kwargs):
        return self.inner(text, **kwargs)

    def decode(self, token_ids, **kwargs):
        self.calls += 1
        if self.calls % self.every == 0:
            self.faults += 1
            raise RuntimeError("tokenizer bug")
        return self.inner.decode(token_ids, **kwargs)


class AbortDuringForward:
    """A forward pre-hook that now and then aborts a running request from a second thread (and waits for it)."""

    def __init__(self, engine: Engine, rng: random.Random) -> None:
        self.engine, self.rng, self.count = engine, rng, 0

    def __call__(self, module, args):
        running = sorted({seq.group_id for seq in self.engine.scheduler.sequences()})
        if not running or self.rng.random() >= FORWARD_ABORT_RATE:
            return
        victim = self.rng.choice(running)

        def abort():
            try:
                self.engine.abort(victim)
                self.count += 1
            except PagedCoreError:
                pass  # it finished in the meantime

        thread = threading.Thread(target=abort)
        thread.start()
        thread.join()


class Soak:
    """One randomized run; ``known`` maps every request id to its prompt and parameters, ``reports`` counts how often
    each id was reported."""

    def __init__(self, family: str, seed: int) -> None:
        self.model = tiny_model(family)
        self.rng = random.Random(seed)
        rng = self.rng
        self.prefixes = [[rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(rng.choice([8, 16, 24]))] for _ in range(4)]
        self.tokenizer = FaultyTokenizer(DECODE_FAULT_EVERY)
        self.engine = Engine(
            self.model,
            self.tokenizer,
            num_blocks=24,
            block_size=4,
            max_num_batched_tokens=rng.choice([16, 32]),
            max_num_seqs=8,
        )
        self.report = SoakReport()
        self.known: dict[str, tuple[list[int], SamplingParams]] = {}
        self.reports: Counter[str] = Counter()
        self.outputs: dict[str, RequestOutput] = {}
        self.streamed: dict[str, dict[int, tuple[list[int], str | None]]] = {}  # id -> sample -> tokens, reason
        self._references: dict[tuple[int, ...], list[int]] = {}

    # ------------------------------------------------------------------ workload
    def prompt(self) -> list[int]:
        rng = self.rng
        prefix = rng.choice(self.prefixes) if rng.random() < 0.7 else []
        return prefix + [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(rng.randrange(1, 16))]

    def params(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.rng.randrange(1, 12), n=self.rng.choice([1, 1, 1, 2, 3]))

    def namespace(self) -> str | None:
        return self.rng.choice([None, None, "tenant-b"])

    def add(self) -> None:
        prompt, params = self.prompt(), self.params()
        self.report.requests += 1
        try:
            rid = self.engine.add_request(prompt, params, namespace=self.namespace())
        except PagedCoreError:
            self.report.rejected += 1
            return
        self.known[rid] = (prompt, params)

    def generate(self) -> None:
        prompts = [self.prompt() for _ in range(self.rng.randrange(1, 4))]
        params = [self.params() for _ in prompts]
        self.report.requests += len(prompts)
        self.report.generate_calls += 1
        outs = self.engine.generate(prompts, params, use_tqdm=False, namespace=self.namespace())
        assert len(outs) == len(prompts)
        for prompt, sp, out in zip(prompts, params, outs):
            if out.request_id.startswith("rejected-"):
                self.report.rejected += 1
                continue
            self.known[out.request_id] = (prompt, sp)
            self.reported(out)

    def stream(self) -> None:
        """One prompt, consumed for a random number of events; closed early about half the time."""
        prompt, params = self.prompt(), self.params()
        self.report.requests += 1
        try:
            events = self.engine.stream([prompt], params, namespace=self.namespace())
        except PagedCoreError:
            self.report.rejected += 1
            return
        budget = self.rng.choice([1, 2, 5, 10**6])
        rid, samples = None, {}
        for count, event in enumerate(events, 1):
            if rid is None:
                rid = event.request_id
                self.known[rid] = (prompt, params)
            assert event.request_id == rid
            tokens, reason = samples.get(event.sample, ([], None))
            assert reason is None, "an event after the sample's last one"
            samples[event.sample] = (
                [*tokens, event.token_id] if event.token_id is not None else tokens,
                event.finish_reason,
            )
            if count >= budget:
                events.close()
                self.report.streams_closed_early += 1
                break
        assert rid is not None, "a stream yields at least one event"
        if len(samples) == params.n and all(reason is not None for _, reason in samples.values()):
            self.reports[rid] += 1  # its consumer saw every sample's last event: the stream reported it
            self.streamed[rid] = samples

    def abort_one(self) -> None:
        live = sorted({seq.group_id for seq in self.engine.scheduler.sequences()})
        if live:
            try:
                self.engine.abort(self.rng.choice(live))
            except PagedCoreError:
                pass

    def step(self) -> None:
        for out in self.engine.step():
            self.reported(out)
        self.report.steps += 1
        self.check_state()

    def reported(self, out: RequestOutput) -> None:
        self.reports[out.request_id] += 1
        self.outputs[out.request_id] = out

    # ------------------------------------------------------------------ checks
    def check_state(self) -> None:
        engine = self.engine
        engine.scheduler.check_invariants()  # the pool's too
        running = {seq.group_id for seq in engine.scheduler.sequences()}
        assert running == set(engine._requests), "the engine and the scheduler disagree on what runs (zombie)"

    def reference(self, prompt: list[int], max_new: int) -> tuple[list[int], list[torch.Tensor]]:
        key = (*prompt, -max_new)
        if key not in self._references:
            out = self.model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new,
                do_sample=False,
                cache=DynamicCache(config=self.model.config),
                return_dict_in_generate=True,
                output_logits=True,
            )
            self._references[key] = (out.sequences[0, len(prompt) :].tolist(), [x[0].float() for x in out.logits])
        return self._references[key]

    def check_sample(self, rid: str, tokens: list[int], reason: str | None) -> None:
        prompt, params = self.known[rid]
        want, logits = self.reference(prompt, params.max_new_tokens)
        assert reason in ("length", "abort", "error"), (rid, reason)
        self.report.samples_checked += 1
        if reason == "length":
            assert len(tokens) == len(want), f"{rid}: {len(tokens)} tokens, not {len(want)}"
        for step, (got, expected) in enumerate(zip(tokens, want)):
            if got != expected:
                # Equal only up to float noise is a tie, not an error: the reference's two logits must be within
                # the fp32 tolerance the project holds outputs to (1e-4). Later tokens follow another path.
                margin = float(logits[step][expected] - logits[step][got])
                assert margin <= 1e-4, f"{rid} differs from generate alone at token {step} (margin {margin:.2e})"
                self.report.greedy_ties += 1
                return

    def run(self, num_requests: int) -> SoakReport:
        rng, engine, report = self.rng, self.engine, self.report
        evictions, flaky = Evictions(), FlakyObserver()
        engine.pool.plugins.register(evictions, name="soak-evictions")
        engine.pool.plugins.register(flaky, name="soak-flaky")
        errors_before = engine.pool.plugins.num_observer_errors
        forward_aborts = AbortDuringForward(engine, rng)
        handle = self.model.model.layers[0].register_forward_pre_hook(forward_aborts)
        try:
            while report.requests < num_requests:
                for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):  # arrivals between steps
                    self.add()
                roll = rng.random()
                if roll < 0.02:
                    self.abort_one()
                elif roll < 0.05:
                    self.generate()
                elif roll < 0.12:
                    self.stream()
                self.step()
            for _ in range(10_000):  # everything ends: no request stays unfinished
                if not engine.has_unfinished():
                    break
                self.step()
            assert not engine.has_unfinished(), "zombie requests"
            report.leaked_blocks = engine.pool.kv.num_used_blocks
            stats = engine.stats()
            report.preemptions = stats.num_preemptions
            report.prefix_hit_tokens = stats.prefix_hit_tokens
            report.evictions = evictions.count
            report.observer_faults = engine.pool.plugins.num_observer_errors - errors_before
            report.decode_faults = self.tokenizer.faults
            report.forward_aborts = forward_aborts.count
            assert stats.num_requests == stats.num_finished + stats.num_aborted + stats.num_failed
        finally:
            handle.remove()
            engine.pool.plugins.unregister(name="soak-evictions")
            engine.pool.plugins.unregister(name="soak-flaky")
            engine.close()
        self.check_outputs()
        return report

    def check_outputs(self) -> None:
        report = self.report
        assert set(self.reports) == set(self.known), "a request was never reported, or an unknown one was"
        twice = [rid for rid, count in self.reports.items() if count != 1]
        assert not twice, f"reported more than once: {twice[:5]}"
        outcomes: list[set[str | None]] = []
        for rid, samples in self.streamed.items():
            for tokens, reason in samples.values():
                self.check_sample(rid, tokens, reason)
            outcomes.append({reason for _, reason in samples.values()})
        for rid, out in self.outputs.items():
            for sample in out.samples:
                self.check_sample(rid, sample.token_ids, sample.finish_reason)
            assert (out.error is not None) == any(s.finish_reason == "error" for s in out.samples), rid
            outcomes.append({s.finish_reason for s in out.samples})
        for reasons in outcomes:
            if "error" in reasons:
                report.failed += 1
            elif "abort" in reasons:
                report.aborted += 1
            else:
                report.finished += 1


def run_soak(family: str, num_requests: int, seed: int) -> SoakReport:
    return Soak(family, seed).run(num_requests)


@pytest.mark.parametrize(("family", "seed"), [("llama", 0), ("gemma3", 1)])
def test_soak(family, seed, one_thread):
    report = run_soak(family, REQUESTS if family == "llama" else max(REQUESTS // 2, 40), seed)
    print(f"\nsoak {family}: {report}")
    assert report.leaked_blocks == 0
    assert report.preemptions > 0, "the pool should be small enough to force preemption"
    assert report.evictions > 0, "the pool should be small enough to force eviction"
    assert report.prefix_hit_tokens > 0
    assert report.observer_faults > 0  # faults were injected and survived
    assert report.decode_faults > 0 and report.failed > 0
    assert report.forward_aborts > 0 and report.streams_closed_early > 0 and report.generate_calls > 0
    assert report.finished + report.aborted + report.failed + report.rejected == report.requests
    assert report.greedy_ties * 100 <= report.samples_checked, "too many near-ties to be float noise"
