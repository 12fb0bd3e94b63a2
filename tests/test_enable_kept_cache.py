"""enable(): caches returned to the caller stay valid, and generate calls nested in a call work.

Before the fix every enabled call released its cache before returning, so ``out.cache`` was a dead object: passing
it back raised ``InvalidBlockError: this PagedCache was released``, and so did assisted decoding with the model as its
own assistant (the assistant's inner ``generate`` goes through the same wrapper and its cache is passed back by the
candidate generator). Each test compares tokens and fp32 logits with stock ``generate`` on a DynamicCache and checks
that no block is held once the outputs are gone.
"""

from __future__ import annotations

import functools
import gc
import warnings

import pytest
import torch
from models import FIRST_TOKEN, VOCAB, tiny_model
from paged_checks import assert_same_generation, batch, dynamic
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from pagedcore.adapters.transformers import PagedCache

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4


@functools.cache
def model_for(family: str) -> torch.nn.Module:
    return tiny_model(family)


ENABLE_DEFAULTS = {"num_blocks": 256, "block_size": BLOCK}


def greedy(model, ids, mask, max_new, **kwargs):
    return model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_new,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )


def registered_tokens(pool, tokens: list[int], namespace=None) -> int:
    return pool.kv.match(tokens, namespace).num_tokens


# ------------------------------------------------------------------------------------------- continuing a cache
@pytest.mark.parametrize("argument", ["cache", "past_key_values"])
@pytest.mark.parametrize("family", ["llama", "mistral", "gpt_neox"])
def test_continue_from_the_returned_cache_matches_stock(enabled, family, argument):
    """transformers' test_generate_continue_from_past_key_values pattern, on a left-padded batch."""
    model = model_for(family)
    ids, mask = batch([0, 3], 10, seed=1)

    def converse(first_cache):
        first = greedy(model, ids, mask, 5, **({"cache": first_cache} if first_cache is not None else {}))
        history = first.sequences
        history_mask = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # past_key_values= is deprecated in favour of cache=
            second = greedy(model, history, history_mask, 4, **{argument: first.cache})
        return first, second

    want = converse(dynamic(model))
    pool = enabled(model)
    got = converse(None)
    for g, w in zip(got, want):
        assert_same_generation(g, w)
    first, second = got
    assert second.cache is first.cache and isinstance(second.cache, PagedCache)
    # The kept cache's full blocks are in the prefix trie after each call, under the rows' real tokens.
    stored = 10 + 5 + 4 - 1
    for row, pad in enumerate([0, 3]):
        tokens = second.sequences[row, pad:].tolist()
        assert registered_tokens(pool, tokens) == (stored - pad) // BLOCK * BLOCK
    assert pool.kv.num_used_blocks > 0
    second.cache.release()
    assert pool.kv.num_used_blocks == 0


def test_a_kept_cache_registers_after_each_call(enabled):
    model = model_for("llama")
    pool = enabled(model)
    ids = torch.randint(FIRST_TOKEN, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    out = greedy(model, ids, None, 4)
    assert registered_tokens(pool, out.sequences[0].tolist()) == 12  # 12 of the 12 stored tokens
    out = greedy(model, out.sequences, None, 6, cache=out.cache)
    assert registered_tokens(pool, out.sequences[0].tolist()) == 16  # 18 stored: 4 full blocks
    hits = pool.num_hit_tokens
    fresh = greedy(model, out.sequences[:, :17], None, 1)  # a call without the cache hits those blocks
    assert pool.num_hit_tokens - hits == 16
    del fresh, out


def test_a_kept_cache_continued_in_another_namespace_registers_nothing_there(enabled):
    model = model_for("llama")
    pool = enabled(model)
    ids = torch.randint(FIRST_TOKEN, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    out = greedy(model, ids, None, 4, pagedcore_namespace="tenant-a")
    assert out.cache.namespace == "tenant-a"
    more = greedy(model, out.sequences, None, 8, cache=out.cache, pagedcore_namespace="tenant-b")
    tokens = more.sequences[0].tolist()
    assert registered_tokens(pool, tokens, "tenant-b") == 0
    assert registered_tokens(pool, tokens, "tenant-a") == 12  # only what the tenant-a call registered
    more.cache.release()


def test_namespaces_that_compare_equal_are_still_two_namespaces_for_a_kept_cache(enabled):
    # ("t", 1) == ("t", True) in Python, but the trie keeps them apart (namespace_key): continuing a ("t", 1) cache in
    # ("t", True) used to register its new blocks in ("t", 1) (prefix_caching had its own, looser identity).
    model = model_for("llama")
    pool = enabled(model)
    ids = torch.randint(FIRST_TOKEN, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    out = greedy(model, ids, None, 4, pagedcore_namespace=("t", 1))
    more = greedy(model, out.sequences, None, 8, cache=out.cache, pagedcore_namespace=("t", True))
    tokens = more.sequences[0].tolist()
    assert registered_tokens(pool, tokens, ("t", True)) == 0
    assert registered_tokens(pool, tokens, ("t", 1)) == 12  # only what the ("t", 1) call registered
    more.cache.release()


# -------------------------------------------------------------------------------------------- lifetime of a cache
def test_a_kept_cache_holds_its_blocks_until_released_or_dropped(enabled):
    model = model_for("llama")
    pool = enabled(model)
    ids, mask = batch([0, 2], 10, seed=4)
    model.generate(ids, attention_mask=mask, max_new_tokens=3)  # a tensor result: nothing is kept
    assert pool.kv.num_used_blocks == 0

    out = greedy(model, ids, mask, 3)
    assert pool.kv.num_used_blocks == out.cache.memory_stats().blocks == 3 + 3  # 12 and 10 stored tokens
    out.cache.release()
    assert pool.kv.num_used_blocks == 0

    out = greedy(model, ids, mask, 3)
    assert pool.kv.num_used_blocks > 0
    del out  # the last reference: its finalizer gives the blocks back
    assert pool.kv.num_used_blocks == 0

    out = greedy(model, ids, mask, 3)
    cycle = {"out": out}
    cycle["self"] = cycle  # only the cycle collector can free it
    del out, cycle
    gc.collect()
    assert pool.kv.num_used_blocks == 0
    pool.check_invariants()


def test_a_cache_collected_during_bookkeeping_is_released_after_it(enabled):
    """A collection can run at any allocation, also inside a bookkeeping call: the release waits for its end."""
    model = model_for("llama")
    pool = enabled(model)
    ids = torch.randint(FIRST_TOKEN, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    out = greedy(model, ids, None, 3)
    held = pool.kv.num_used_blocks
    cycle = {"out": out}
    cycle["self"] = cycle
    del out, cycle
    with pool.lock:  # a bookkeeping call in progress
        gc.collect()
        assert pool.kv.num_used_blocks == held  # deferred: nothing changed under the running call
        pool.kv.check_invariants()
    assert pool.kv.num_used_blocks == 0
    pool.check_invariants()


# --------------------------------------------------------------------------------------------------- nested calls
@pytest.mark.parametrize("family", ["llama", "mistral", "gpt_neox"])
def test_assisted_decoding_with_the_model_as_its_own_assistant(enabled, family):
    """transformers' test_assisted_decoding_matches_greedy_search pattern."""
    model = model_for(family)
    ids, mask = batch([0], 10, seed=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers warns about its own generation_config handling
        want = greedy(model, ids, mask, 16, cache=dynamic(model), assistant_model=model)
        plain = greedy(model, ids, mask, 16, cache=dynamic(model))
        pool = enabled(model)
        got = [greedy(model, ids, mask, 16, assistant_model=model) for _ in range(2)]  # cold, then warm
    assert want.sequences.tolist() == plain.sequences.tolist()
    for out in got:
        assert_same_generation(out, want)
    # The assistant's calls (nested in the main one) hit what earlier ones registered.
    assert pool.num_hit_tokens > 0
    del got, out  # the main caches; the assistant's went with the candidate generator at the end of each call
    assert pool.kv.num_used_blocks == 0


class NestedCall:
    """Runs a generate of the same model on another prompt at every step of the outer call."""

    def __init__(self, model, prompt: torch.Tensor) -> None:
        self.model = model
        self.prompt = prompt
        self.outputs: list[list[int]] = []

    def run(self) -> None:
        self.outputs.append(self.model.generate(self.prompt, max_new_tokens=3, do_sample=False)[0].tolist())


class NestedInCriteria(StoppingCriteria):
    def __init__(self, nested: NestedCall) -> None:
        self.nested = nested

    def __call__(self, input_ids, scores, **kwargs):
        self.nested.run()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class NestedInProcessor(LogitsProcessor):
    def __init__(self, nested: NestedCall) -> None:
        self.nested = nested

    def __call__(self, input_ids, scores):
        self.nested.run()
        return scores


class NestedInStreamer(BaseStreamer):
    def __init__(self, nested: NestedCall) -> None:
        self.nested = nested

    def put(self, value) -> None:
        self.nested.run()

    def end(self) -> None:
        self.nested.run()


@pytest.mark.parametrize("where", ["stopping_criteria", "logits_processor", "streamer"])
def test_generate_nested_in_a_callback(enabled, where):
    model = model_for("llama")
    ids, mask = batch([0, 3], 10, seed=7)
    inner = torch.randint(FIRST_TOKEN, VOCAB, (1, 9), generator=torch.Generator().manual_seed(8))
    want_inner = model.generate(inner, max_new_tokens=3, do_sample=False, cache=dynamic(model))[0].tolist()
    want = greedy(model, ids, mask, 5, cache=dynamic(model))
    pool = enabled(model)
    nested = NestedCall(model, inner)
    hook = {
        "stopping_criteria": lambda: {"stopping_criteria": StoppingCriteriaList([NestedInCriteria(nested)])},
        "logits_processor": lambda: {"logits_processor": LogitsProcessorList([NestedInProcessor(nested)])},
        "streamer": lambda: {"streamer": NestedInStreamer(nested)},
    }[where]()
    for _ in range(2):  # cold, then warm for both the outer and the nested calls
        got = greedy(model, ids, mask, 5, **hook)
        assert_same_generation(got, want)
        got.cache.release()
    assert len(nested.outputs) >= 2 * 5
    assert all(out == want_inner for out in nested.outputs)
    assert pool.num_hit_tokens > 0


def test_nested_calls_run_in_the_namespace_of_the_call_around_them(enabled):
    model = model_for("llama")
    pool = enabled(model)
    inner = torch.randint(FIRST_TOKEN, VOCAB, (1, 9), generator=torch.Generator().manual_seed(9))
    nested = NestedCall(model, inner)
    criteria = StoppingCriteriaList([NestedInCriteria(nested)])
    outer = torch.randint(FIRST_TOKEN, VOCAB, (1, 6), generator=torch.Generator().manual_seed(10))
    model.generate(outer, max_new_tokens=2, stopping_criteria=criteria, pagedcore_namespace="tenant-a")
    assert registered_tokens(pool, inner[0].tolist(), "tenant-a") == 8  # 11 stored tokens: 2 full blocks
    assert registered_tokens(pool, inner[0].tolist(), None) == 0
