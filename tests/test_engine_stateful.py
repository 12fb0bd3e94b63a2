"""Property-based test of the Engine's request bookkeeping: any interleaving of add_request, abort, step, generate
and streams (advanced, left suspended or closed early) reports every request exactly once, keeps the Engine's view
equal to the scheduler's after every operation, and holds no block once everything is drained."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from models import FIRST_TOKEN, tiny_model

from pagedcore import PagedCoreError
from pagedcore.adapters.transformers import Engine, SamplingParams

MODEL = None


def model():
    global MODEL
    if MODEL is None:
        MODEL = tiny_model("llama")
    return MODEL


prompts = st.lists(st.integers(FIRST_TOKEN, FIRST_TOKEN + 20), min_size=1, max_size=9)
params = st.builds(SamplingParams, max_new_tokens=st.integers(1, 4), n=st.sampled_from([1, 1, 2]))


class EngineReporting(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # A small pool: requests wait, get preempted and evict each other's cached blocks.
        self.engine = Engine(model(), num_blocks=12, block_size=4, max_num_batched_tokens=12, max_num_seqs=4)
        self.reports: dict[str, int] = {}
        self.known: set[str] = set()
        self.streams: list[dict] = []  # {"it": iterator, "rid": id or None, "finals": int, "n": samples}

    def report(self, rid: str) -> None:
        self.reports[rid] = self.reports.get(rid, 0) + 1

    def on_event(self, stream: dict, event) -> None:
        if stream["rid"] is None:
            stream["rid"] = event.request_id
            self.known.add(event.request_id)
        stream["finals"] += event.finish_reason is not None
        if event.finish_reason is not None and stream["finals"] == stream["n"]:
            self.report(event.request_id)  # its consumer saw every sample's last event

    @rule(prompt=prompts, sp=params)
    def add(self, prompt, sp):
        self.known.add(self.engine.add_request(prompt, sp))

    @rule(data=st.data())
    def abort(self, data):
        running = sorted({seq.group_id for seq in self.engine.scheduler.sequences()})
        if running:
            try:
                self.engine.abort(data.draw(st.sampled_from(running)))
            except PagedCoreError:
                pass

    @rule()
    def step(self):
        for out in self.engine.step():
            self.report(out.request_id)

    @rule(batch=st.lists(st.tuples(prompts, params), min_size=1, max_size=3))
    def generate(self, batch):
        outs = self.engine.generate([p for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
        for out in outs:
            self.known.add(out.request_id)
            self.report(out.request_id)

    @rule(prompt=prompts, sp=params)
    def open_stream(self, prompt, sp):
        self.streams.append({"it": self.engine.stream([prompt], sp), "rid": None, "finals": 0, "n": sp.n})

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), count=st.integers(1, 3))
    def advance_stream(self, data, count):
        stream = data.draw(st.sampled_from(self.streams))
        for _ in range(count):
            event = next(stream["it"], None)
            if event is None:
                self.streams.remove(stream)
                return
            self.on_event(stream, event)

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def close_stream(self, data):
        stream = data.draw(st.sampled_from(self.streams))
        stream["it"].close()
        self.streams.remove(stream)

    @invariant()
    def engine_and_scheduler_agree(self):
        self.engine.scheduler.check_invariants()
        running = {seq.group_id for seq in self.engine.scheduler.sequences()}
        assert running == set(self.engine._requests)

    def teardown(self):
        try:
            for stream in self.streams:  # consume what was left suspended, as its caller would
                for event in stream["it"]:
                    self.on_event(stream, event)
            for _ in range(1000):
                if not self.engine.has_unfinished():
                    break
                self.step()
            assert not self.engine.has_unfinished()
            assert self.engine.pool.kv.num_used_blocks == 0
            assert set(self.reports) == self.known
            assert all(count == 1 for count in self.reports.values()), self.reports
        finally:
            self.engine.close()


@pytest.mark.usefixtures("one_thread")
def test_engine_reporting_state_machine():
    settings_ = settings(
        max_examples=25,
        stateful_step_count=15,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    EngineReporting.TestCase.settings = settings_
    EngineReporting.TestCase().runTest()
