"""Engine reliability under hostile use: aborts from other threads during a forward, user code that raises (a
tokenizer, an observer), generators closed early, bad requests among good ones, token ids that are not integers.

Each fault fails only what it must (one request, with ``error`` set), every other request finishes with the same
tokens as ``model.generate`` alone, every added request is reported exactly once, and no block stays held.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from models import FIRST_TOKEN, VOCAB, tiny_model, tiny_tokenizer
from test_engine import reference, settle, workload

from pagedcore import InvalidRequestError, LRUEvictionPolicy, PluginManager, hookimpl
from pagedcore.adapters.transformers import Engine, PagedKVPool, SamplingParams


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def drain(engine: Engine) -> dict:
    """Step until nothing is left; returns what the steps reported, by request id (each reported once)."""
    done: dict = {}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            assert out.request_id not in done, f"{out.request_id} reported twice"
            done[out.request_id] = out
    assert not engine.has_unfinished(), "the step loop never ends"
    return done


class FlakyTokenizer:
    """The tiny tokenizer, but ``decode`` raises on the calls listed in ``fail_on`` (1-based; "all" for every call)
    and ``__call__`` raises on texts containing "boom"."""

    def __init__(self, fail_on: set[int] | str = frozenset()) -> None:
        self.inner = tiny_tokenizer()
        self.fail_on = fail_on
        self.decodes = 0

    def __call__(self, text, **kwargs):
        if "boom" in text:
            raise RuntimeError("encode boom")
        return self.inner(text, **kwargs)

    def decode(self, token_ids, **kwargs):
        self.decodes += 1
        if self.fail_on == "all" or self.decodes in self.fail_on:
            raise RuntimeError(f"decode boom {self.decodes}")
        return self.inner.decode(token_ids, **kwargs)


# ---------------------------------------------------------------- 5. abort from another thread during the forward
@pytest.mark.parametrize("method", ["step", "step_events"])
def test_abort_from_another_thread_during_the_forward(model, method, one_thread):
    prompts = workload(20, 3)
    with Engine(model, num_blocks=64, block_size=4) as engine:
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=4)) for p in prompts]
        engine.step()  # prefill: one token each
        seen: dict = {}

        def abort_in_another_thread(module, args):
            if seen:
                return
            used = engine.pool.kv.num_used_blocks
            thread = threading.Thread(target=lambda: seen.setdefault("out", engine.abort(ids[1])))
            thread.start()
            thread.join()
            # The forward is writing into the aborted request's blocks: they go back only after the step.
            seen["held"] = engine.pool.kv.num_used_blocks == used

        handle = model.model.layers[0].register_forward_pre_hook(abort_in_another_thread)
        try:
            result = getattr(engine, method)()  # must not raise
        finally:
            handle.remove()
        assert seen["out"].finish_reason == "abort" and seen["held"]
        done = {o.request_id: o for o in (result.finished if method == "step_events" else result)}
        done.update(drain(engine))
        settle(engine)
        engine.scheduler.check_invariants()
    assert set(done) == set(ids)
    aborted = done[ids[1]]
    assert aborted.token_ids == reference(model, prompts[1], 4)[0][:1]  # the token sampled during the abort: dropped
    for i in (0, 2):
        assert done[ids[i]].token_ids == reference(model, prompts[i], 4)[0]  # the others keep every token


# ---------------------------------------------------------------- 6. user code that raises: tokenizer, observer
def test_a_tokenizer_that_raises_on_decode_fails_only_its_request(model, one_thread):
    prompts = workload(21, 3)
    tokenizer = FlakyTokenizer(fail_on={2})
    with Engine(model, tokenizer, num_blocks=64, block_size=4) as engine:
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=4), use_tqdm=False)
        assert not engine.has_unfinished()
        settle(engine)
        stats = engine.stats()
    failed = [o for o in outs if o.error]
    assert len(failed) == 1 and "decode boom 2" in failed[0].error and failed[0].finish_reason == "error"
    for prompt, out in zip(prompts, outs):
        if out.error is None:
            assert out.token_ids == reference(model, prompt, 4)[0] and out.text is not None
    assert stats.num_failed == 1 and stats.num_finished == 2
    assert model.config._attn_implementation == "sdpa"


class _RaisingLRU(LRUEvictionPolicy):
    """A plugin's eviction policy with a bug: every ``pop()`` raises."""

    name = "raising"

    def pop(self) -> int:
        raise RuntimeError("policy bug")


class _RaisingPolicyPlugin:
    @hookimpl
    def pagedcore_eviction_policy(self, name):
        return _RaisingLRU() if name == "raising" else None


def test_an_eviction_policy_that_raises_fails_only_the_requests_that_needed_an_eviction(model, one_thread):
    plugins = PluginManager(load_entrypoints=False)
    plugins.register(_RaisingPolicyPlugin(), "raising")
    pool = PagedKVPool(
        model, num_blocks=16, block_size=4, dtype=torch.float32, plugins=plugins, eviction_policy="raising"
    )
    prompts = [[FIRST_TOKEN + i] * 20 for i in range(3)]
    with Engine(model, pool=pool) as engine:
        engine.generate(workload(4, 2), SamplingParams(max_new_tokens=4), use_tqdm=False)  # leaves cached blocks
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=8), use_tqdm=False)  # used to raise
        assert not engine.has_unfinished()
        settle(engine)
        stats = engine.stats()
    failed = [o for o in outs if o.error]
    assert failed and len(failed) < len(outs) and stats.num_failed == len(failed)
    for out in failed:
        assert out.error.startswith("PluginError: eviction policy 'raising'") and out.finish_reason == "error"
    for prompt, out in zip(prompts, outs):
        if out.error is None:
            assert out.token_ids == reference(model, prompt, 8)[0]
    assert pool.kv.num_used_blocks == 0


def test_a_tokenizer_that_always_raises_leaves_no_zombie_and_close_restores_the_model(model):
    tokenizer = FlakyTokenizer(fail_on="all")
    engine = Engine(model, tokenizer, num_blocks=64, block_size=4)
    outs = engine.generate(workload(22, 2), SamplingParams(max_new_tokens=3), use_tqdm=False)
    assert all(o.finish_reason == "error" and "decode boom" in o.error for o in outs)
    assert not engine.has_unfinished()
    tokenizer.fail_on = set()
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=8))
    engine.step()
    engine.step()
    assert engine.has_unfinished()
    tokenizer.fail_on = "all"
    engine.close()  # its abort decodes too: must neither raise nor leave the model on "paged"
    assert model.config._attn_implementation == "sdpa"
    assert not engine.has_unfinished() and engine.pool.kv.num_used_blocks == 0


def test_close_restores_the_model_even_when_aborting_raises(model, monkeypatch):
    engine = Engine(model, num_blocks=64, block_size=4)
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=8))
    engine.step()

    def broken_abort(request_id):
        raise RuntimeError("abort failed")

    monkeypatch.setattr(engine.scheduler, "abort", broken_abort)
    engine.close()
    assert model.config._attn_implementation == "sdpa"
    assert not engine.has_unfinished()


def test_an_observer_that_raises_changes_nothing(model):
    class Raising:
        @hookimpl
        def pagedcore_request_finished(self, request_id):
            raise RuntimeError("observer bug")

    prompts = workload(23, 3)
    with Engine(model, num_blocks=64, block_size=4) as engine:
        engine.pool.plugins.register(Raising(), name="raising-observer")
        try:
            outs = engine.generate(prompts, SamplingParams(max_new_tokens=3), use_tqdm=False)
        finally:
            engine.pool.plugins.unregister(name="raising-observer")
        settle(engine)
    assert [o.token_ids for o in outs] == [reference(model, p, 3)[0] for p in prompts]


# ---------------------------------------------------------------- 7. generators closed early
def test_closing_a_stream_early_loses_no_other_request(model, one_thread):
    with Engine(model, num_blocks=64, block_size=4) as engine:
        other = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=1))  # finishes in the first step
        stream = engine.stream([[8, 9, 10]], SamplingParams(max_new_tokens=6))
        first = next(stream)
        assert first.token_id is not None
        stream.close()  # while the first step's events were being yielded
        done = drain(engine)
        settle(engine)
    assert done[other].token_ids == reference(model, [5, 6, 7], 1)[0]
    assert len(done) == 2  # the stream's own request: aborted, and reported once by step()
    (mine,) = (o for rid, o in done.items() if rid != other)
    assert mine.finish_reason == "abort"


def test_interleaved_streams_and_generate_each_get_all_their_tokens(model, one_thread):
    prompts = workload(24, 3)
    want = [reference(model, p, 5)[0] for p in prompts]
    params = SamplingParams(max_new_tokens=5)
    with Engine(model, num_blocks=96, block_size=4) as engine:
        a, b = engine.stream([prompts[0]], params), engine.stream([prompts[1]], params)
        got: dict[str, list[int]] = {"a": [], "b": []}
        generated = None
        while True:
            progressed = False
            for name, stream in (("a", a), ("b", b)):
                event = next(stream, None)
                if event is not None:
                    progressed = True
                    if event.token_id is not None:
                        got[name].append(event.token_id)
            if generated is None:  # a generate() call in the middle, on the same thread
                generated = engine.generate([prompts[2]], params, use_tqdm=False)[0]
            if not progressed:
                break
        assert not engine.has_unfinished()
        settle(engine)
    assert got["a"] == want[0] and got["b"] == want[1] and generated.token_ids == want[2]


def test_a_suspended_stream_keeps_its_requests_and_a_step_loop_still_ends(model, one_thread):
    with Engine(model, num_blocks=64, block_size=4) as engine:
        stream = engine.stream([[8, 9, 10]], SamplingParams(max_new_tokens=4))
        tokens = [next(stream).token_id]
        other = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2))
        done = drain(engine)  # runs the stream's request to its end too, but does not report it
        assert set(done) == {other}
        tokens += [e.token_id for e in stream if e.token_id is not None]  # the stream still gets all its tokens
        assert not engine.has_unfinished()
        settle(engine)
    assert tokens == reference(model, [8, 9, 10], 4)[0]


# ---------------------------------------------------------------- 8. one bad request among good ones
def test_a_bad_prompt_in_a_stream_queues_nothing(model):
    with Engine(model, num_blocks=64, block_size=4) as engine:
        with pytest.raises(InvalidRequestError, match="empty"):
            list(engine.stream([[5, 6, 7], []], SamplingParams(max_new_tokens=2)))
        assert not engine.has_unfinished() and engine.scheduler.num_waiting == 0
        with pytest.raises(InvalidRequestError, match="never fit"):
            list(engine.stream([[5, 6, 7], [5] * 300], SamplingParams(max_new_tokens=2)))
        assert not engine.has_unfinished()
        settle(engine)


@pytest.mark.parametrize(
    ("stop", "match"),
    [(["x"], "'x'"), (5, "stop_token_ids must be a sequence"), ([2.5], "2.5"), ([True], "True"), ("ab", "'ab'")],
)
def test_stop_token_ids_are_validated(stop, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(stop_token_ids=stop)


def test_stop_token_ids_outside_the_vocabulary_fail_that_request_alone(model):
    with Engine(model, num_blocks=64, block_size=4) as engine:
        outs = engine.generate(
            [[5, 6], [7, 8]],
            [SamplingParams(max_new_tokens=2, stop_token_ids=[VOCAB + 1]), SamplingParams(max_new_tokens=2)],
            use_tqdm=False,
        )
        settle(engine)
    assert "stop_token_ids" in outs[0].error and str(VOCAB + 1) in outs[0].error
    assert outs[1].error is None and outs[1].token_ids == reference(model, [7, 8], 2)[0]


def test_a_tokenizer_that_raises_on_encode_fails_that_request_alone(model):
    tokenizer = FlakyTokenizer()
    good = " ".join(f"t{i}" for i in range(FIRST_TOKEN, FIRST_TOKEN + 5))
    with Engine(model, tokenizer, num_blocks=64, block_size=4) as engine:
        outs = engine.generate([good, "boom"], SamplingParams(max_new_tokens=2), use_tqdm=False)
        assert outs[0].error is None and "encode boom" in outs[1].error
        with pytest.raises(InvalidRequestError, match="encode boom"):
            list(engine.stream([good, "boom"], SamplingParams(max_new_tokens=2)))
        assert not engine.has_unfinished()
        settle(engine)


@pytest.mark.parametrize("field", ["ignore_eos", "return_logits"])
def test_boolean_sampling_fields_are_validated(field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: "yes"})


# ---------------------------------------------------------------- 9. token ids that are not integers
@pytest.mark.parametrize(
    ("prompt", "shown"),
    [
        ([5.7, 6.2], "5.7, 6.2"),
        (torch.tensor([5.9, 6.1]), "5.9"),
        (["5", "6"], "'5', '6'"),
        ([True, 5], "True"),
        (torch.tensor([True, False]), "True"),
        (np.array([5.5, 6.0]), "5.5"),
        ([[5, 6]], "[5, 6]"),
    ],
)
def test_non_integer_token_ids_are_refused_by_value(model, prompt, shown):
    with Engine(model, num_blocks=16, block_size=4) as engine:
        with pytest.raises(InvalidRequestError, match="must be integers") as info:
            engine.add_request(prompt, SamplingParams(max_new_tokens=1))
        assert shown in str(info.value)
        assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "prompt",
    [torch.tensor([5, 6, 7]), torch.tensor([[5, 6, 7]]), np.array([5, 6, 7]), [np.int64(5), np.int32(6), 7]],
    ids=["tensor", "tensor-1xN", "numpy", "numpy-ints"],
)
def test_integer_tensors_and_numpy_integers_are_accepted(model, prompt):
    with Engine(model, num_blocks=16, block_size=4) as engine:
        rid = engine.add_request(prompt, SamplingParams(max_new_tokens=2))
        (out,) = drain(engine).values()
    assert out.request_id == rid and out.prompt_token_ids == [5, 6, 7]
    assert out.token_ids == reference(model, [5, 6, 7], 2)[0]


@pytest.mark.parametrize("compile", [False, True])
def test_non_finite_leftovers_in_free_blocks_reach_no_later_request(model, compile, one_thread):
    """A request whose forward overflowed leaves NaN / Inf in its blocks; freed, they go to the next requests with
    those contents. The slots a new owner has not written yet are masked, and must add nothing: every later request
    (batched, so the bucket path reads whole blocks) gets the tokens of ``model.generate`` alone."""
    prompts = workload(11, 5)
    expected = [reference(model, p, 6)[0] for p in prompts]
    for leftover in (float("nan"), float("inf")):
        with Engine(model, num_blocks=48, block_size=8, enable_prefix_caching=False, compile=compile) as engine:
            engine.generate([prompts[0]], SamplingParams(max_new_tokens=2), use_tqdm=False)  # the pool exists
            pool = engine.pool
            assert pool.kv.num_used_blocks == 0
            for layer in range(pool.spec.num_layers):
                tensors = pool.layer_tensors(layer)
                if tensors is not None:
                    tensors[0][: pool.kv.num_blocks] = leftover  # every real block, not the pad block
                    tensors[1][: pool.kv.num_blocks] = leftover
            outs = engine.generate(prompts, SamplingParams(max_new_tokens=6), use_tqdm=False)
            assert [o.error for o in outs] == [None] * len(prompts)
            assert [o.outputs[0].token_ids for o in outs] == expected
            settle(engine)


# ---------------------------------------------------------------- a model that draws dropout
@pytest.mark.parametrize("overrides", [{"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.0}, {}])
def test_a_model_drawing_dropout_fails_its_requests_and_dropout_zero_is_served(overrides):
    """GPT-2 in train() with hidden-state dropout only (no attention dropout, which the paged attention refuses) was
    served with dropout drawn and prefixes reused, which stock generate never computes. Any dropout drawn now fails
    the step's requests with UnsupportedModelError ("eval()"); train() with dropout 0 (TRL's default) is served,
    with the tokens of eval() mode; a submodule alone put in train() counts too."""
    zero = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "summary_first_dropout": 0.0}
    model = tiny_model("gpt2", **{**zero, **overrides})
    prompts = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11]]
    with Engine(model, num_blocks=32, block_size=4) as engine:
        want = [o.token_ids for o in engine.generate(prompts, max_new_tokens=3, do_sample=False, use_tqdm=False)]
        model.train()
        outs = engine.generate(prompts, max_new_tokens=3, do_sample=False, use_tqdm=False)
        if overrides:
            assert all(o.finish_reason == "error" and "UnsupportedModelError" in o.error for o in outs)
            assert all("eval()" in o.error for o in outs)
            model.eval()
            model.transformer.h[1].train()  # one block only: its dropout draws all the same
            outs = engine.generate(prompts, max_new_tokens=3, do_sample=False, use_tqdm=False)
            assert all(o.finish_reason == "error" and "eval()" in o.error for o in outs)
            model.eval()
            outs = engine.generate(prompts, max_new_tokens=3, do_sample=False, use_tqdm=False)
        assert [o.token_ids for o in outs] == want
        assert engine.pool.kv.num_used_blocks == 0


def test_a_dropout_module_inserted_without_a_registration_is_seen():
    """The dropout check reads the weights watch's list of modules instead of walking the tree each step, where that
    list is still the model's tree. ``ModuleList.insert`` edits the list's dict without a registration: the watch
    compares the list's children, so the inserted dropout (in training mode, as a new module is) is seen, and the
    step's requests fail with the dropout's error (not with the forward's, which would call it as a block)."""
    model = tiny_model("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)
    prompts = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11]]
    with Engine(model, num_blocks=32, block_size=4) as engine:
        want = [o.token_ids for o in engine.generate(prompts, max_new_tokens=3, do_sample=False, use_tqdm=False)]
        watch = engine.pool.weights
        assert watch is not None and watch.modules(model) == list(model.modules())  # read instead of a walk
        blocks = model.transformer.h
        blocks.insert(len(blocks), torch.nn.Dropout(0.5))  # no registration hook runs
        outs = engine.generate(prompts, max_new_tokens=3, do_sample=False, use_tqdm=False)
        assert all(o.finish_reason == "error" and "eval()" in o.error for o in outs), [o.error for o in outs]
        del blocks[len(blocks) - 1]
        outs = engine.generate(prompts, max_new_tokens=3, do_sample=False, use_tqdm=False)
        assert [o.token_ids for o in outs] == want
        assert engine.pool.kv.num_used_blocks == 0
