"""The Engine's results read as vLLM's: ``out.outputs[i].text``, ``.token_ids``, ``.finish_reason``, ``.logprobs``
(one mapping of token id to a ``Logprob`` with ``.logprob`` and ``.rank`` per generated token), ``cumulative_logprob``,
``num_cached_tokens``. A vLLM user's code ran into ``AttributeError: 'RequestOutput' object has no attribute
'outputs'`` (the field is ``samples``): the one result type now answers both names."""

from __future__ import annotations

import math
from collections.abc import Mapping

import pytest

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def vllm_style_summary(outputs) -> list[dict]:
    """What a script written for ``vllm.LLM.generate`` reads from its results, attribute by attribute."""
    rows = []
    for output in outputs:
        for completion in output.outputs:
            chosen = [lp[token].logprob for lp, token in zip(completion.logprobs, completion.token_ids)]
            rows.append(
                {
                    "request": output.request_id,
                    "prompt_tokens": len(output.prompt_token_ids),
                    "cached": output.num_cached_tokens,
                    "finished": output.finished,
                    "index": completion.index,
                    "text": completion.text,
                    "token_ids": list(completion.token_ids),
                    "finish_reason": completion.finish_reason,
                    "chosen_logprobs": chosen,
                    "ranks": [lp[token].rank for lp, token in zip(completion.logprobs, completion.token_ids)],
                    "cumulative_logprob": completion.cumulative_logprob,
                    "top_sizes": [len(lp) for lp in completion.logprobs],
                }
            )
    return rows


def test_results_answer_vllms_attribute_names():
    tokenizer = builtin_tokenizer()
    with Engine(builtin_model(num_hidden_layers=1), tokenizer, num_blocks=64) as engine:
        prompt = "The same system prompt, then a question"
        params = SamplingParams(max_new_tokens=5, n=2, temperature=0.8, seed=3, logprobs=2)
        first, second = engine.generate([prompt, prompt], params)
    assert first.outputs is first.samples and [c.index for c in first.outputs] == [0, 1]
    rows = vllm_style_summary([first, second])
    for row, sample in zip(rows, [*first.samples, *second.samples]):
        assert row["text"] == sample.text == tokenizer.decode(row["token_ids"], skip_special_tokens=True)
        assert row["finish_reason"] == "length" and row["finished"] and len(row["token_ids"]) == 5
        assert row["chosen_logprobs"] == [lp.token.logprob for lp in sample.logprobs]  # the chosen token's entry
        assert all(size in (2, 3) for size in row["top_sizes"])  # top 2, plus the chosen one when not among them
        assert math.isclose(row["cumulative_logprob"], sum(row["chosen_logprobs"]), rel_tol=1e-6)
    assert all(isinstance(lp, Mapping) for lp in first.outputs[0].logprobs)
    assert rows[2]["cached"] > 0 and rows[2]["cached"] == second.metrics.num_cached_tokens  # the second hit the first


def test_a_step_made_token_event_is_a_token_event() -> None:
    """token_event (what a step makes per running sample) gives the dataclass's own event: every field, in order,
    equal and hashed alike, frozen, with a __dict__ as the dataclass's."""
    import dataclasses

    from pagedcore.engine.outputs import TokenEvent, token_event

    values = ("r1", 2, 42, "hi", "stop", "\n", None, [None])
    made, own = token_event(*values), TokenEvent(*values)
    assert made == own and vars(made) == vars(own) and repr(made) == repr(own)
    assert list(vars(made)) == [f.name for f in dataclasses.fields(TokenEvent)]
    assert hash(token_event("r", 0, 1, "", None, None, None, None)) == hash(TokenEvent("r", 0, 1, ""))
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.text = "x"  # type: ignore[misc]
    assert dataclasses.replace(made, text="x").text == "x"


def test_the_objects_a_decode_step_reads_per_sequence_have_no_instance_dict() -> None:
    """A step over hundreds of decoding sequences reads a few fields of each one's sequence, block tables, request,
    output, metrics, parameters and text right after a forward has evicted the caches: their fields live in slots (one
    object each, no separate ``__dict__`` to fetch; docs/benchmarks.md, "The host step's bookkeeping"). A results
    object still round-trips through pickle (Ray Serve sends them between processes)."""
    import pickle

    from pagedcore import BlockTables, KVPool, SequenceState
    from pagedcore.engine.detokenizer import IncrementalDetokenizer
    from pagedcore.engine.outputs import RequestMetrics, RequestOutput, SampleOutput
    from pagedcore.engine.request import RequestState
    from pagedcore.engine.stopping import SampleText, StopStrings

    tokenizer = builtin_tokenizer()
    out = RequestOutput("r", [5, 6], [SampleOutput(0, [7], text="a", finish_reason="stop")], RequestMetrics(0.5))
    text = SampleText(IncrementalDetokenizer(tokenizer), StopStrings())
    seq = SequenceState("r", [5, 6], max_new_tokens=4)
    request = RequestState("r", SamplingParams(), seq, out, [text], [])
    objects = [seq, BlockTables(KVPool(4, 2)), request, out, out.metrics, out.samples[0], request.params, text]
    objects.append(IncrementalDetokenizer(tokenizer))
    assert [type(o).__name__ for o in objects if hasattr(o, "__dict__")] == []
    assert pickle.loads(pickle.dumps(out)) == out
    params = SamplingParams(max_new_tokens=3, stop_strings=["x"], logprobs=2)
    assert pickle.loads(pickle.dumps(params)) == params
