"""The core's side of LoRA adapters (issue 31, item 1): an adapter's namespace is never a base model's nor another
adapter's (in memory, on disk, in the router); an adapter version's scope can be closed (its prefixes forgotten,
nothing of it matched or registered, by sequences running or waiting) and opened again (only sequences that start
afterwards register); the weights watch can leave PEFT adapters to their owner while still seeing every change of the
base model."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")  # a test extra (LoRA adapters): the GPU image has none

import torch
from hypothesis import given
from hypothesis import strategies as st
from lora_helpers import base_model, make_adapter
from peft import PeftModel

from pagedcore.adapters.transformers.weights import WeightsWatch
from pagedcore.block_keys import AdapterNamespace, namespace_bytes, namespace_key, namespace_scope, prefix_hashes
from pagedcore.block_tables import BlockTables
from pagedcore.errors import ConfigError
from pagedcore.kv_pool import KVPool

pytestmark = pytest.mark.usefixtures("one_thread")

SCALARS = st.one_of(st.none(), st.text(max_size=6), st.integers(-3, 3), st.booleans(), st.binary(max_size=4))
NAMESPACES = st.recursive(SCALARS, lambda inner: st.tuples(inner, inner), max_leaves=4)


@given(base=NAMESPACES, other=NAMESPACES, name=st.text(min_size=1, max_size=5), version=st.text(max_size=5))
def test_an_adapters_namespace_is_no_other_namespace(base, other, name, version):
    tuned = AdapterNamespace(base, name, version)
    assert namespace_bytes(tuned) is not None
    assert namespace_key(tuned) != namespace_key(other)  # whatever namespace a caller chooses
    assert namespace_key(tuned) != namespace_key(AdapterNamespace(base, name + "x", version))
    assert namespace_key(tuned) != namespace_key(AdapterNamespace(base, name, version + "x"))
    assert namespace_key(tuned) == namespace_key(AdapterNamespace(base, name, version))
    assert namespace_scope(tuned) == ("adapter", name, version) and namespace_scope(other) is None
    tokens = list(range(32))
    assert prefix_hashes(tokens, 16, tuned)[0] != prefix_hashes(tokens, 16, base)[0]


def test_an_adapter_namespace_names_its_adapter_as_strings():
    with pytest.raises(ConfigError):
        AdapterNamespace(None, "", "v")
    with pytest.raises(ConfigError):
        AdapterNamespace(None, "a", None)  # type: ignore[arg-type]
    assert namespace_bytes(AdapterNamespace(object(), "a", "v")) is None  # no stable base: never persisted


def _cache(pool: KVPool, tokens: list[int], namespace: object) -> BlockTables:
    seq = BlockTables(pool)
    seq.append(len(tokens))
    seq.cache_full_blocks(tokens, len(tokens), namespace)
    return seq


def test_a_closed_scope_is_neither_matched_nor_registered_and_reopening_starts_afresh():
    pool = KVPool(num_blocks=32, block_size=2)
    tokens = [1, 2, 3, 4]
    v1, v1_other_tenant, v2 = (AdapterNamespace(t, "a", v) for t, v in ((None, "1"), ("bob", "1"), (None, "2")))
    for ns in (None, v1, v1_other_tenant, v2):
        _cache(pool, tokens, ns).release()
    running = BlockTables(pool)  # a sequence of version 1 that started before the change
    running.append(4)
    assert pool.close_scope(namespace_scope(v1)) == 4  # both tenants' blocks of version 1
    assert pool.match(tokens, v1).num_tokens == pool.match(tokens, v1_other_tenant).num_tokens == 0
    assert pool.match(tokens).num_tokens == pool.match(tokens, v2).num_tokens == 4  # the rest stays
    running.cache_full_blocks(tokens, 4, v1)
    waiting = _cache(pool, tokens, v1)  # one that starts while it is closed
    assert pool.match(tokens, v1).num_tokens == 0
    assert pool.open_scope(namespace_scope(v1)) and not pool.open_scope(namespace_scope(v1))
    running.cache_full_blocks([*tokens, 5, 6], 6, v1)  # started before the reopening: still never registers
    waiting.cache_partial_block([*tokens, 5], 5, v1)
    assert pool.match(tokens, v1).num_tokens == 0
    _cache(pool, tokens, v1).release()  # one that starts now registers
    assert pool.match(tokens, v1).num_tokens == 4
    running.release()
    waiting.release()
    pool.check_invariants()


def test_forks_and_preempted_sequences_keep_the_rule():
    pool = KVPool(num_blocks=32, block_size=2)
    tuned = AdapterNamespace(None, "a", "1")
    parent = BlockTables(pool)
    parent.append(4)
    child = parent.fork()
    pool.close_scope(namespace_scope(tuned))
    pool.open_scope(namespace_scope(tuned))
    child.cache_full_blocks([1, 2, 3, 4], 4, tuned)
    assert pool.match([1, 2, 3, 4], tuned).num_tokens == 0
    parent.reset()  # preempted: it starts over, after the reopening
    parent.append(4)
    parent.cache_full_blocks([1, 2, 3, 4], 4, tuned)
    assert pool.match([1, 2, 3, 4], tuned).num_tokens == 4
    parent.release()
    child.release()


@pytest.fixture(scope="module")
def adapter_paths(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("watch")
    return [make_adapter(root / "a", seed=1), make_adapter(root / "b", seed=2, targets=("k_proj", "down_proj"))]


def test_a_watch_with_adapters_apart_sees_the_base_model_only(adapter_paths):
    model = base_model()
    apart, whole = WeightsWatch(model, adapters_apart=True), WeightsWatch(model)
    digest = apart.content_hash()
    peft = PeftModel.from_pretrained(model, adapter_paths[0], adapter_name="a")
    peft.load_adapter(adapter_paths[1], adapter_name="b")
    layers = [m for m in model.modules() if hasattr(m, "lora_A")]
    for layer in layers:
        layer.enable_adapters(False)
    assert whole.check() and not apart.check()  # adapters injected: the base model is the same
    assert apart.content_hash() == digest
    with torch.no_grad():
        layers[0].lora_A["a"].weight.add_(1.0)
    assert not apart.check()  # an adapter's weight: its owner's business
    layers[0].enable_adapters(True)  # a plain forward now applies an adapter to every row
    assert apart.check()
    layers[0].enable_adapters(False)
    assert apart.check()
    layers[0].merge(adapter_names=["a"])  # merged into the base weights (through .data)
    assert apart.check()
    layers[0].unmerge()
    assert apart.check()
    peft.delete_adapter("a")
    assert not apart.check()
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.base_layer.weight.add_(1.0)
    assert apart.check() and apart.content_hash() != digest
