"""A compiled forward over a ``PagedCache`` (issue 17.19, issue 23 item 2): no graph break in a decode step, and
``torch.compile(model.forward, dynamic=True)`` (and the default) gives the tokens and logits of the eager model.

``PagedLayer.update`` used to plan and reserve the forward in the first layer, reading the positions' values
(``bool(fits.all())`` in ``forward_plan.left_padding``): a graph break in every forward, after which inductor's
generated code crashed with ``dynamic=True`` (``NameError: name 's14' is not defined``). The model's forward
pre-hook now reserves the forward on the host, before the compiled function runs, and the layers only index with
tensors built there. The tests that need only dynamo (graph breaks, recompilations) trace with
``backend="eager"``; the inductor ones are slow (minutes on 2 busy cores) and marked so.
"""

from __future__ import annotations

import pytest
import torch
from models import tiny_model
from paged_checks import assert_same_generation, batch, dynamic, release_and_check
from torch._dynamo.utils import counters

from pagedcore.adapters import transformers as pc
from pagedcore.adapters.transformers import PagedCache

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 4


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def compiled(family: str, *, dynamic_shapes: bool | None, backend: str, fullgraph: bool = True, **overrides):
    """The family's tiny model, and the same model with ``model.forward = torch.compile(model.forward, ...)``."""
    eager = tiny_model(family, **overrides)
    model = tiny_model(family, **overrides)
    model.forward = torch.compile(model.forward, dynamic=dynamic_shapes, backend=backend, fullgraph=fullgraph)
    return eager, model


def greedy(model, cache=None, **kwargs):
    ids, mask = batch([0, 3], 9, seed=1)
    kwargs = {
        "max_new_tokens": NEW_TOKENS,
        "do_sample": False,
        "return_dict_in_generate": True,
        "output_logits": True,
        **kwargs,
    }
    if cache is not None:
        kwargs["cache"] = cache
    return model.generate(ids, attention_mask=mask, **kwargs)


@pytest.mark.parametrize("dynamic_shapes", [True, None], ids=["dynamic", "default"])
def test_decode_steps_have_no_graph_break_and_do_not_recompile(dynamic_shapes):
    """fullgraph=True raises at any graph break; the context grows every step, the graph stays the same."""
    eager, model = compiled("llama", dynamic_shapes=dynamic_shapes, backend="eager", num_hidden_layers=1)
    ids, mask = batch([0, 3], 9, seed=2)
    reference, cache = dynamic(eager), PagedCache(model, num_blocks=64, block_size=4)
    with torch.no_grad():
        want = eager(ids, attention_mask=mask, cache=reference).logits[:, -1:]
        with torch.compiler.set_stance("force_eager"):  # the prefill stays eager here: only decode steps compile
            model(ids, attention_mask=mask, cache=cache)
        positions = mask.sum(dim=1, keepdim=True) - 1
        for step in range(5):
            token = want.argmax(-1)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            positions = positions + 1
            want = eager(token, attention_mask=mask, position_ids=positions, cache=reference).logits
            got = model(token, attention_mask=mask, position_ids=positions, cache=cache).logits
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=lambda m, s=step: f"step {s}: {m}")
    assert not counters["graph_break"]
    # One graph for every decode step (the default mode may specialise the first step's lengths, then goes dynamic).
    assert counters["stats"]["unique_graphs"] <= (1 if dynamic_shapes else 2)
    assert cache.row_padding() == [0, 3]
    release_and_check(cache)


@pytest.mark.parametrize(
    ("how", "dynamic_shapes"),
    [
        ("paged_cache", True),
        ("enable", None),
        pytest.param("paged_cache", None, marks=pytest.mark.slow),
        pytest.param("enable", True, marks=pytest.mark.slow),
    ],
)
def test_compiled_generate_traces_whole_forwards(how, dynamic_shapes):
    """Prefill and decode forwards of generate, each one graph (fullgraph=True), with a PagedCache or enable()."""
    eager, model = compiled("llama", dynamic_shapes=dynamic_shapes, backend="eager", num_hidden_layers=1)
    want = greedy(eager, dynamic(eager))
    if how == "paged_cache":
        cache = PagedCache(model, num_blocks=64, block_size=4)
        assert_same_generation(greedy(model, cache), want)
        release_and_check(cache)
    else:
        pool = pc.enable(model, num_blocks=64, block_size=4)
        try:
            for _ in range(2):  # cold, then with a prefix hit
                got = greedy(model)
                got.cache.release()
                assert_same_generation(got, want)
            assert pool.num_hit_tokens > 0
        finally:
            pc.disable(model)
        assert pool.kv.num_used_blocks == 0
    assert not counters["graph_break"]


# ---------------------------------------------------------------------------------------------- inductor (slow)
@pytest.mark.slow
@pytest.mark.parametrize("dynamic_shapes", [True, None], ids=["dynamic", "default"])
@pytest.mark.parametrize("how", ["paged_cache", "enable"])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_inductor_generate_equals_eager(family, how, dynamic_shapes):
    eager, model = compiled(family, dynamic_shapes=dynamic_shapes, backend="inductor")
    want = greedy(eager, dynamic(eager))
    if how == "paged_cache":
        cache = PagedCache(model, num_blocks=64, block_size=4)
        assert_same_generation(greedy(model, cache), want)
        release_and_check(cache)
    else:
        pool = pc.enable(model, num_blocks=64, block_size=4)
        try:
            got = greedy(model)
            got.cache.release()
            assert_same_generation(got, want)
        finally:
            pc.disable(model)
        assert pool.kv.num_used_blocks == 0


@pytest.mark.slow
def test_inductor_with_graph_breaks_in_paged_attention():
    """Paged attention's backend is not traceable (graph breaks, compiled in pieces): the pieces that resume after
    a break must not lose symbols (the inductor crash), and the output equals eager's."""
    eager, model = compiled(
        "llama", dynamic_shapes=True, backend="inductor", fullgraph=False, attn_implementation="paged"
    )
    cache, reference = PagedCache(model, num_blocks=64, block_size=4), PagedCache(eager, num_blocks=64, block_size=4)
    assert_same_generation(greedy(model, cache), greedy(eager, reference))
    release_and_check(cache, reference)


def test_what_a_layer_stores_under_inductor_is_computed_on_the_host():
    """torch 2.13's inductor loses a symbol when a graph returns an int it computed from one a guard equated with
    another (docs/limits.md: ``lengths[0] = lengths[0] + a`` after ``a == b``). A layer's bookkeeping compares its
    length with the reservation's and stores the new length: it must store the host's value, not a sum."""
    cache = PagedCache(tiny_model("llama"), num_blocks=16, block_size=4)
    state = cache._state

    def bookkeeping(state, q_len, positions):
        for layer in (0, 1):
            state.forward_step(layer, 1, q_len, positions, True, positions.device)
        return positions + 1

    compiled_bookkeeping = torch.compile(bookkeeping, dynamic=True)
    length = 0
    for q_len in (8, 3, 3):
        positions = torch.arange(length, length + q_len)[None]
        cache.before_forward(input_ids=positions)
        compiled_bookkeeping(state, q_len, positions)
        length += q_len
        assert state.layer_len == [length, length]
    release_and_check(cache)


def test_a_one_row_decode_reads_a_view_eager_and_compiled_without_recompiling():
    """A one-row decode whose slots are one contiguous run reads a view of the pool, eager or compiled: no gather
    index is built (it copied the whole context per layer and step: 1.6-1.7x StaticCache's compiled decode at 512 and
    2k tokens). The compiled graph takes the view's start and length as symbolic ints: one graph for every step."""
    eager, model = compiled("llama", dynamic_shapes=True, backend="eager", num_hidden_layers=1)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    for m in (eager, model):
        cache = PagedCache(m, num_blocks=16, block_size=4)
        with torch.no_grad():
            m(ids, cache=cache)
            for position in range(5, 12):
                m(ids[:, :1], position_ids=torch.tensor([[position]]), cache=cache)
                step = cache._state.step
                assert step is not None
                kv_len, _, start, index = step.reads[0]
                assert (kv_len, start is not None, index) == (position + 1, True, None)
        release_and_check(cache)
    assert counters["stats"]["unique_graphs"] <= 2  # the prefill's graph and the decode's


def test_a_compiled_write_indexes_the_pool_and_copies_none_of_it():
    """Inductor functionalized ``write_kv``'s ``index_copy_`` through a flattened view of the pool into a copy of
    the layer's whole pool (keys and values) per step: 10 of a 2k-context decode's 32 ms. Traced, it writes with
    ``index_put_`` on the pool tensor itself, which inductor does in place."""
    from torch._inductor.utils import run_and_get_code

    from pagedcore.attention import write_kv

    def store(key_cache, value_cache, key, value, slots):
        write_kv(key_cache, value_cache, key, value, slots)
        return key_cache.sum()

    for layout in ("slots", "heads"):  # (blocks, block size, heads, dim), or a permuted view of (heads, blocks, ...)
        shape = (37, 4, 3, 8) if layout == "slots" else (3, 37, 4, 8)
        caches = [torch.zeros(shape) if layout == "slots" else torch.zeros(shape).permute(1, 2, 0, 3) for _ in "kv"]
        expected = [c.clone() for c in caches]
        key, value, slots = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.tensor([5, 141])
        write_kv(*expected, key, value, slots)  # eager
        _, (code,) = run_and_get_code(torch.compile(store, backend="inductor"), *caches, key, value, slots)
        assert all(torch.equal(c, e) for c, e in zip(caches, expected))
        buffers = [line for line in code.splitlines() if "= empty_strided_cpu(" in line]
        assert buffers and not [b for b in buffers if "148" in b or "37, 4" in b or "3, 37" in b], buffers


def test_a_traced_paged_mask_traces_no_lru_cache(monkeypatch):
    """Dynamo warned in every suite run: "a call to a `functools.lru_cache`-wrapped function at 'attention.py'"
    (the paged mask asks whether a model uses the attention interface, a cached answer). The answer is now a
    constant to a trace (``torch.compiler.assume_constant_result``) and no cache wrapper is traced."""
    import warnings

    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())  # dynamo warns once per process
    model = tiny_model("llama", attn_implementation="paged")
    model.forward = torch.compile(model.forward, backend="eager")
    ids, mask = batch([0], 6)
    cache = PagedCache(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, cache=cache)
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]
    release_and_check(cache)
