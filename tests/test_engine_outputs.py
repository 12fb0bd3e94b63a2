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
