"""EngineLoop without HTTP: event order, stop strings per sample, aborts, failures, queue bound, shutdown."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer
from pagedcore.serve.loop import Delta, EngineLoop, Finished, LoopClosedError, QueueFullError, Started, Submission

pytestmark = pytest.mark.usefixtures("one_thread")


class Sink:
    """Collects one request's events (called on the loop thread)."""

    def __init__(self) -> None:
        self.events: list = []
        self.done = threading.Event()

    def __call__(self, event) -> None:
        self.events.append(event)
        if isinstance(event, Finished):
            self.done.set()

    def wait(self) -> Finished:
        assert self.done.wait(60), "no Finished event"
        return self.events[-1]

    def texts(self, n: int = 1) -> list[str]:
        out = [""] * n
        for event in self.events:
            if isinstance(event, Delta):
                out[event.sample] += event.text
        return out


@pytest.fixture
def engine() -> Iterator[Engine]:
    model = builtin_model(hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256)
    with Engine(model, builtin_tokenizer(), num_blocks=128, block_size=8) as engine:
        yield engine
    assert engine.pool.kv.num_used_blocks == 0, "blocks leaked"
    engine.pool.check_invariants()


@pytest.fixture
def loop(engine) -> Iterator[EngineLoop]:
    loop = EngineLoop(engine)
    loop.start()
    yield loop
    loop.stop()


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def run(loop: EngineLoop, prompt, params: SamplingParams, stop: tuple[str, ...] = ()) -> Sink:
    sink = Sink()
    loop.submit([Submission(prompt, replace(params, stop_strings=stop))], sink)
    sink.wait()
    return sink


def test_events_come_in_order_and_match_the_engine_alone(loop):
    sink = run(loop, "Sea", SamplingParams(max_new_tokens=6))
    assert isinstance(sink.events[0], Started)
    assert all(isinstance(e, Delta) for e in sink.events[1:-1])
    finished = sink.events[-1]
    assert replace(finished, timings=None) == Finished(finished.request_id, 3, (6,), ("length",))
    assert [len(e.token_ids) for e in sink.events[1:-1]] == [1] * 6  # one delta per token
    timings = finished.timings
    assert timings is not None and len(timings.inter_token) == 5 and min(timings.inter_token) > 0
    assert 0 <= timings.queued <= timings.first_token <= timings.total  # type: ignore[operator]
    assert timings.prefill == pytest.approx(timings.first_token - timings.queued)  # type: ignore[operator]
    assert timings.decode == pytest.approx(timings.total - timings.first_token)  # type: ignore[operator]
    reference = Engine(loop.engine.model, builtin_tokenizer(), num_blocks=64, block_size=8)
    with reference:
        (out,) = reference.generate(["Sea"], SamplingParams(max_new_tokens=6), use_tqdm=False)
    assert sink.texts() == [out.text]


def test_a_request_whose_samples_all_stopped_is_aborted_before_the_next_step(loop):
    full = run(loop, "Waves", SamplingParams(max_new_tokens=40)).texts()[0]
    stop = full[3:5]
    cut = full.find(stop)
    generated_before = loop.engine.stats().generated_tokens
    finished = run(loop, "Waves", SamplingParams(max_new_tokens=40), stop=(stop,))
    assert finished.texts() == [full[:cut]]
    assert finished.events[-1].finish_reasons == ("stop",)
    # The character tokenizer makes one token per character: the stop's last token was the last one computed.
    assert finished.events[-1].completion_tokens == (cut + len(stop),)
    assert loop.engine.stats().generated_tokens - generated_before == cut + len(stop)


def test_parallel_samples_stop_on_their_own(loop):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=11, n=3)
    texts = run(loop, "Gulls", params).texts(3)
    stop = next(texts[0][i : i + 2] for i in range(10) if texts[0][i : i + 2] not in texts[1])
    sink = run(loop, "Gulls", params, stop=(stop,))
    expected = [t[: t.find(stop)] if stop in t else t for t in texts]
    assert sink.texts(3) == expected
    reasons = sink.events[-1].finish_reasons
    assert reasons == tuple("stop" if stop in t else "length" for t in texts)
    assert reasons[0] == "stop" and reasons[1] == "length"


def test_rejected_requests_end_with_an_invalid_error_and_no_start(loop):
    sink = run(loop, "", SamplingParams(max_new_tokens=3))
    empty = Finished(sink.events[0].request_id, 0, (), (), "the prompt is empty", "invalid", error_param="prompt")
    assert sink.events == [empty]  # the field the engine's error concerns travels with it
    sink = run(loop, "x" * 300, SamplingParams(max_new_tokens=3))
    assert sink.events[-1].error_kind == "invalid" and "context" in (sink.events[-1].error or "")
    assert sink.events[-1].error_param == "prompt"


def test_zero_max_tokens_finishes_without_tokens(loop):
    sink = run(loop, "Tide", SamplingParams(max_new_tokens=0))
    assert sink.events[-1].finish_reasons == ("length",) and sink.events[-1].completion_tokens == (0,)


def test_abort_is_idempotent_and_unknown_ids_are_ignored(loop, engine):
    gate = threading.Event()
    original = engine.step_events

    def held():
        gate.wait(60)
        return original()

    engine.step_events = held  # type: ignore[method-assign]
    sink = Sink()
    (rid,) = loop.submit([Submission("Foam", SamplingParams(max_new_tokens=50))], sink)
    loop.abort(rid)
    loop.abort(rid)
    loop.abort("no-such-request")
    gate.set()
    finished = sink.wait()
    del engine.step_events
    assert finished.error_kind == "aborted" and finished.finish_reasons == (None,)
    assert run(loop, "Foam", SamplingParams(max_new_tokens=2)).events[-1].completion_tokens == (2,)


def test_a_broken_engine_fails_each_request_once_without_spinning(loop, engine):
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("broken for good")

    engine.step_events = broken  # type: ignore[method-assign]
    first = run(loop, "Rock", SamplingParams(max_new_tokens=3)).events[-1]
    assert first.error_kind == "failed" and "broken for good" in (first.error or "")
    second = run(loop, "Rock", SamplingParams(max_new_tokens=3)).events[-1]
    assert second.error_kind == "failed"
    assert len(calls) == 2  # one failed step per new request, not a loop stepping a broken engine
    wait_for(lambda: loop.stats.num_failed_steps == 2)  # published after the step's events were sent
    del engine.step_events
    assert run(loop, "Rock", SamplingParams(max_new_tokens=3)).events[-1].error is None


def test_a_sink_that_raises_does_not_stop_the_loop(loop):
    def bad_sink(event):
        raise RuntimeError("client gone")

    loop.submit([Submission("Sand", SamplingParams(max_new_tokens=3))], bad_sink)
    assert run(loop, "Sand", SamplingParams(max_new_tokens=3)).events[-1].error is None


def test_the_queue_bound_admits_a_batch_whole_or_not_at_all(engine):
    loop = EngineLoop(engine, max_queue=3)  # not started: everything stays queued
    sinks = [Sink(), Sink()]
    loop.submit([Submission("a", SamplingParams(max_new_tokens=1))], sinks[0])
    loop.submit([Submission("b", SamplingParams(max_new_tokens=1))], sinks[1])
    with pytest.raises(QueueFullError, match="queue bound of 3"):
        loop.submit([Submission("c", SamplingParams()), Submission("d", SamplingParams())], Sink())
    assert loop.stats.num_waiting == 2
    loop.stop()  # never started: the queued requests end here with a shutdown error
    assert [s.wait().error_kind for s in sinks] == ["shutdown", "shutdown"]
    with pytest.raises(LoopClosedError):
        loop.submit([Submission("e", SamplingParams())], Sink())
    with pytest.raises(LoopClosedError):
        loop.start()


def test_stop_ends_running_requests_with_a_shutdown_error(engine):
    loop = EngineLoop(engine)
    produced, gate = threading.Event(), threading.Event()
    original = engine.step_events

    def step_events():
        out = original()
        produced.set()
        gate.wait(60)
        return out

    engine.step_events = step_events  # type: ignore[method-assign]
    loop.start()
    sink = Sink()
    loop.submit([Submission("Reef", SamplingParams(max_new_tokens=100))], sink)
    assert produced.wait(60)
    stopper = threading.Thread(target=loop.stop)
    stopper.start()
    gate.set()
    stopper.join(60)
    del engine.step_events
    assert not stopper.is_alive() and not loop.is_running
    assert sink.wait().error_kind == "shutdown"


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_max_queue_must_be_a_count(engine, bad):
    with pytest.raises(ValueError, match="max_queue"):
        EngineLoop(engine, max_queue=bad)
