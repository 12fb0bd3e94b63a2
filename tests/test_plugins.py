"""Plugin hooks: every hookspec exercised, backend and policy selection, events, observer isolation,
hook validation (``check_pending``), the built-ins the host registers itself, and end-to-end entry-point loading
from a throwaway distribution.

Tests use a manager with entry points off (the host still registers its built-ins), so another installed plugin
cannot change the answers; whatever a test registers goes through fixtures that always unregister it. The
process-wide ``default_plugin_manager()`` is only read, and an autouse fixture checks that it is left as it was.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import logging
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pluggy
import pytest
import torch
from fake_model import FakeModel, reference_output, run_to_completion
from transformers import Gemma2Config, LlamaConfig

from pagedcore import (
    EvictionPolicy,
    LRUEvictionPolicy,
    PluginError,
    PluginManager,
    Scheduler,
    SchedulerConfig,
    SequenceState,
    default_plugin_manager,
    hookimpl,
    hookspecs,
    plugin_manager,
)
from pagedcore.adapters.transformers import PagedKVPool, disable, enable
from pagedcore.adapters.transformers.testing import tiny_llama
from pagedcore.attention import AttentionBackend
from pagedcore.errors import ConfigError
from pagedcore.kv_store import MemoryKVStore
from pagedcore.plugins import eviction as lru_plugin
from pagedcore.plugins import kv_store as kv_store_plugin
from pagedcore.plugins import logging_observer, torch_backend, xformers_backend

# ---------------------------------------------------------------- which test exercises which hook

HOOK_NAMES = frozenset(
    name
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
    if name.startswith("pagedcore_") and hasattr(fn, "pagedcore_spec")  # set by the HookspecMarker
)


@contextmanager
def hooks_called() -> Iterator[set[str]]:
    """Collect the names of the hooks called inside the block: selection hooks go through
    ``PluginManager.select``, events through ``PluginManager.emit`` (and anything calling pluggy's HookCaller)."""
    called: set[str] = set()
    call, emit, select = pluggy.HookCaller.__call__, PluginManager.emit, PluginManager.select

    def spy_call(caller: pluggy.HookCaller, **kwargs: Any) -> Any:
        called.add(caller.name)
        return call(caller, **kwargs)

    def spy_emit(manager: PluginManager, hook_name: str, **kwargs: Any) -> None:
        called.add(hook_name)
        emit(manager, hook_name, **kwargs)

    def spy_select(manager: PluginManager, hook_name: str, **kwargs: Any) -> Any:
        called.add(hook_name)
        return select(manager, hook_name, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pluggy.HookCaller, "__call__", spy_call)
        patch.setattr(PluginManager, "emit", spy_emit)
        patch.setattr(PluginManager, "select", spy_select)
        yield called


def covers(*hooks: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare the hooks a test exercises. A name that is not a hookspec fails at import (typos cannot hide), and
    the test fails when it runs without calling each of them, so a declaration cannot go stale."""
    unknown = sorted(set(hooks) - HOOK_NAMES)
    if unknown or not hooks:
        raise ValueError(f"covers(): {unknown or 'no hooks'} are not pagedcore hookspecs ({sorted(HOOK_NAMES)})")

    def mark(test: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(test)  # keeps the signature (fixtures) and the parametrize marks
        def checked(*args: Any, **kwargs: Any) -> None:
            with hooks_called() as called:
                test(*args, **kwargs)
            not_called = sorted(set(hooks) - called)
            assert not not_called, f"{test.__name__} declares @covers for {not_called} but never called them"

        checked.covered_hooks = frozenset(hooks)  # type: ignore[attr-defined]
        return checked

    return mark


def test_every_hook_has_a_test():
    # The enumeration must agree with what pluggy itself registered from the hookspecs module.
    relay = PluginManager(load_entrypoints=False).hook
    registered = {name for name, caller in vars(relay).items() if not name.startswith("_") and caller.has_spec()}
    assert registered == HOOK_NAMES and len(HOOK_NAMES) >= 7
    covered: set[str] = set()
    for name, obj in globals().items():
        hooks = getattr(obj, "covered_hooks", None)
        if hooks is not None:
            assert name.startswith("test_") and inspect.isfunction(obj), f"@covers on {name}, which is not a test"
            covered |= hooks
    missing = sorted(HOOK_NAMES - covered)
    assert not missing, f"hooks without a test in {Path(__file__).name}: {missing}"


# ---------------------------------------------------------------- fixtures and helpers

# In the order the host registers them, the torch backend (the fallback for any device) last, so that pluggy asks
# it after every other trylast backend.
BUILTINS = {
    "lru": lru_plugin,
    "kv-store": kv_store_plugin,
    "logging": logging_observer,
    "xformers": xformers_backend,
    "torch": torch_backend,
}

LLAMA = LlamaConfig(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=128
)
GEMMA2 = Gemma2Config(  # layer 0 sliding (window 8) -> KV group 0, layer 1 full attention -> KV group 1
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    intermediate_size=128,
    head_dim=16,
    sliding_window=8,
)


def _snapshot(pm: PluginManager) -> tuple[Any, ...]:
    return tuple(pm.plugins()), pm.num_observer_errors


@pytest.fixture(autouse=True)
def _default_manager_untouched() -> Iterator[None]:
    default = default_plugin_manager()
    before = _snapshot(default)
    yield
    assert _snapshot(default) == before, "a test left state in default_plugin_manager()"


@pytest.fixture
def pm() -> Iterator[PluginManager]:
    """A fresh manager with entry points off: exactly the built-ins, which the host registers itself."""
    manager = PluginManager(load_entrypoints=False)
    assert {info.name: info.source for info in manager.plugins()} == dict.fromkeys(BUILTINS, "built-in")
    yield manager
    assert {info.name for info in manager.plugins()} == set(BUILTINS), "a test left a plugin registered"


@pytest.fixture
def use(pm: PluginManager) -> Iterator[Callable[[Any, str], Any]]:
    """``use(plugin, name)`` registers a plugin on ``pm`` for this test only; always unregistered afterwards."""
    names: list[str] = []

    def register(plugin: Any, name: str) -> Any:
        names.append(pm.register(plugin, name=name))
        return plugin

    yield register
    for name in reversed(names):
        pm.unregister(name=name)
    assert not {info.name for info in pm.plugins()} & set(names)


def make_pool(pm: PluginManager, *, num_blocks: int = 32, block_size: int = 4, config: Any = LLAMA, **kw: Any):
    return PagedKVPool(config, num_blocks=num_blocks, block_size=block_size, dtype=torch.float32, plugins=pm, **kw)


class Recorder:
    """Observes every event hook and keeps ``(event, *arguments)`` in call order."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [event[1:] for event in self.events if event[0] == kind]

    @hookimpl
    def pagedcore_request_admitted(self, request_id: str, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.events.append(("admitted", request_id, num_prompt_tokens, num_cached_tokens))

    @hookimpl
    def pagedcore_request_preempted(self, request_id: str, num_computed_tokens: int) -> None:
        self.events.append(("preempted", request_id, num_computed_tokens))

    @hookimpl
    def pagedcore_request_finished(self, request_id: str, finish_reason: str, num_output_tokens: int) -> None:
        self.events.append(("finished", request_id, finish_reason, num_output_tokens))

    @hookimpl
    def pagedcore_prefix_hit(self, request_id: str, num_query_tokens: int, num_hit_tokens: int, namespace: Any) -> None:
        self.events.append(("prefix_hit", request_id, num_query_tokens, num_hit_tokens, namespace))

    @hookimpl
    def pagedcore_blocks_evicted(self, group: int, block_ids: list[int]) -> None:
        self.events.append(("evicted", group, list(block_ids)))


# ---------------------------------------------------------------- attention backend (firstresult)


class FakeBackend:
    name = "fake"

    def forward(self, query, key_cache, value_cache, metadata, *, scale, softcap=None):  # pragma: no cover
        return query


class FakeBackendPlugin:
    """A third-party backend, registered normally (not trylast): answers for its own name and for "best available"."""

    def __init__(self) -> None:
        self.backend = FakeBackend()
        self.calls: list[tuple[str, Any, str | None]] = []

    @hookimpl
    def pagedcore_attention_backend(self, device_type: str, dtype: Any, name: str | None) -> Any:
        self.calls.append((device_type, dtype, name))
        return self.backend if name in (None, "fake") else None


@covers("pagedcore_attention_backend")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_default_manager_gives_torch_backend_on_cpu(dtype):
    backend = default_plugin_manager().attention_backend("cpu", dtype)
    assert isinstance(backend, torch_backend.TorchPagedAttention) and isinstance(backend, AttentionBackend)
    assert backend.name == "torch"


@covers("pagedcore_attention_backend")
def test_third_party_backend_wins_over_trylast_builtins(pm, use):
    assert pm.attention_backend("cpu", torch.float32).name == "torch"
    plugin = use(FakeBackendPlugin(), "fake-backend")
    assert pm.attention_backend("cpu", torch.float16) is plugin.backend
    assert pm.attention_backend("cuda", torch.bfloat16, name="fake") is plugin.backend
    assert pm.attention_backend("cpu", torch.float32, name="torch").name == "torch"  # it declines: built-in answers
    assert plugin.calls == [
        ("cpu", torch.float16, None),
        ("cuda", torch.bfloat16, "fake"),
        ("cpu", torch.float32, "torch"),
    ]


@covers("pagedcore_attention_backend")
@pytest.mark.parametrize("name", ["no-such-backend", "xformers"])  # xformers declines on CPU
def test_backend_nobody_offers_raises_naming_it(pm, name):
    with pytest.raises(PluginError, match=rf"no plugin offers backend '{name}' for device 'cpu'.*'torch'"):
        pm.attention_backend("cpu", torch.float16, name=name)


@covers("pagedcore_attention_backend")
def test_paged_pool_caches_the_backend_lookup(pm, use):
    plugin = use(FakeBackendPlugin(), "fake-backend")
    pool = make_pool(pm)
    cpu = torch.device("cpu")
    first = pool.attention_backend(cpu, torch.float32)
    assert first is plugin.backend
    assert pool.attention_backend(cpu, torch.float32) is first
    assert len(plugin.calls) == 1  # cached: the hook ran once
    assert pool.attention_backend(cpu, torch.float16) is plugin.backend  # another key: asked again
    by_name = pool.attention_backend(cpu, torch.float32, name="torch")
    assert by_name.name == "torch" and pool.attention_backend(cpu, torch.float32, name="torch") is by_name
    assert plugin.calls == [("cpu", torch.float32, None), ("cpu", torch.float16, None), ("cpu", torch.float32, "torch")]


# ---------------------------------------------------------------- eviction policy


class MRUPolicy:
    """Most recently released first: the opposite of the built-in LRU, so the victim tells which policy chose."""

    name = "mru"

    def __init__(self) -> None:
        self.order: list[int] = []
        self.popped: list[int] = []

    def add(self, block_id: int) -> None:
        self.order.append(block_id)

    def remove(self, block_id: int) -> None:
        self.order.remove(block_id)

    def pop(self) -> int:
        self.popped.append(self.order.pop())
        return self.popped[-1]

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self.order


class MRUPlugin:
    def __init__(self) -> None:
        self.calls: list[tuple[str | None, int]] = []
        self.policies: list[MRUPolicy] = []

    @hookimpl
    def pagedcore_eviction_policy(self, name: str | None, num_blocks: int) -> EvictionPolicy | None:
        self.calls.append((name, num_blocks))
        if name != "mru":
            return None
        self.policies.append(MRUPolicy())
        return self.policies[-1]


class DirtyPolicyPlugin:
    @hookimpl
    def pagedcore_eviction_policy(self, name: str | None) -> EvictionPolicy | None:
        if name != "dirty":
            return None
        policy = LRUEvictionPolicy()
        policy.add(0)
        return policy


def _cache_three_single_block_prompts(pool: PagedKVPool) -> list[int]:
    """Cache [1]*4, [2]*4, [3]*4 as three one-block chains, released in that order; return their blocks."""
    group = pool.kv.groups[0]
    blocks = group.block_manager.allocate(3)
    for value, block_id in zip((1, 2, 3), blocks):
        group.trie.insert([value] * 4, [block_id])
    for block_id in blocks:
        group.block_manager.release([block_id])
    return blocks


@covers("pagedcore_eviction_policy", "pagedcore_blocks_evicted")
@pytest.mark.parametrize(("policy", "victim"), [("mru", 3), (None, 1)])  # None: the built-in LRU default
def test_plugin_eviction_policy_decides_the_victim(pm, use, policy, victim):
    plugin = use(MRUPlugin(), "mru")
    recorder = use(Recorder(), "recorder")
    pool = make_pool(pm, num_blocks=4, eviction_policy=policy)
    group = pool.kv.groups[0]
    assert plugin.calls == [(policy, 4), (policy, 4)]  # validated once at construction, then once per KV group
    if policy == "mru":
        assert group.block_manager.eviction_policy is plugin.policies[-1]
    else:
        assert isinstance(group.block_manager.eviction_policy, LRUEvictionPolicy)
    blocks = _cache_three_single_block_prompts(pool)
    group.block_manager.allocate(2)  # one free block + one eviction
    victim_block = blocks[victim - 1]
    assert recorder.events == [("evicted", 0, [victim_block])]
    for value, block_id in zip((1, 2, 3), blocks):
        assert group.trie.match([value] * 4).block_ids == ([] if block_id == victim_block else [block_id])
    if policy == "mru":
        assert plugin.policies[-1].popped == [victim_block]
    pool.check_invariants()


@covers("pagedcore_eviction_policy")
def test_plugin_manager_eviction_policy_by_name(pm, use):
    plugin = use(MRUPlugin(), "mru")
    policy = pm.eviction_policy("mru", num_blocks=7)
    assert policy is plugin.policies[-1] and len(policy) == 0
    assert plugin.calls == [("mru", 7)]
    assert isinstance(pm.eviction_policy(None), LRUEvictionPolicy)  # the trylast built-in is the default
    assert isinstance(pm.eviction_policy("lru"), LRUEvictionPolicy)


@pytest.mark.parametrize("num_blocks", [-3, 2.5, True, "4", None])
def test_eviction_policy_refuses_a_bad_num_blocks_before_asking_any_plugin(pm, use, num_blocks):
    plugin = use(MRUPlugin(), "mru")
    names = [info.name for info in pm.plugins()]
    with pytest.raises(ConfigError, match="num_blocks must be an integer >= 0") as raised:
        pm.eviction_policy("mru", num_blocks=num_blocks)
    assert raised.value.param == "num_blocks"
    assert plugin.calls == [] and plugin.policies == []  # no plugin was asked, nothing was made
    assert [info.name for info in pm.plugins()] == names
    assert pm.eviction_policy("mru", num_blocks=0) is plugin.policies[-1]  # 0 (the default) stays valid


@covers("pagedcore_eviction_policy")
def test_unknown_eviction_policy_raises(pm):
    with pytest.raises(PluginError, match="eviction policy 'clock'"):
        pm.eviction_policy("clock", num_blocks=4)
    with pytest.raises(PluginError, match="eviction policy 'clock'"):
        make_pool(pm, eviction_policy="clock")


@covers("pagedcore_eviction_policy")
def test_non_empty_eviction_policy_is_refused(pm, use):
    use(DirtyPolicyPlugin(), "dirty")
    with pytest.raises(PluginError, match="'dirty' returned by plugin 'dirty' is not empty"):
        pm.eviction_policy("dirty", num_blocks=4)
    with pytest.raises(PluginError, match="not empty"):
        make_pool(pm, eviction_policy="dirty")


class DictStorePlugin:
    """A third-party tier in one class: a dict behind the ``dict://`` scheme."""

    def __init__(self) -> None:
        self.stores: list[Any] = []
        self.asked: list[tuple[str, int]] = []

    @hookimpl
    def pagedcore_kv_store(self, location: str, max_bytes: int) -> Any:
        self.asked.append((location, max_bytes))
        if not location.startswith("dict://"):
            return None
        store = MemoryKVStore(max_bytes)
        store.name = "dict"  # type: ignore[misc]
        self.stores.append(store)
        return store


@covers("pagedcore_kv_store", "pagedcore_blocks_evicted")
def test_plugin_kv_store_is_a_tier_below_the_pool(pm, use, tmp_path):
    plugin = use(DictStorePlugin(), "dict-store")
    recorder = use(Recorder(), "recorder")
    pool = make_pool(pm, num_blocks=3, block_size=4, kv_store=["dict://x", str(tmp_path)], kv_store_bytes="1MiB")
    assert plugin.asked == [("dict://x", 1 << 20), (str(tmp_path), 1 << 20)]  # asked first; the path: built-in
    assert [store.name for store in pool.tiers.stores] == ["dict", "disk"]
    with pytest.raises(PluginError, match="no plugin offers a KV store for 'redis://h'"):
        make_pool(pm, kv_store="redis://h", kv_store_bytes=1024)
    with pytest.raises(ConfigError, match="needs kv_store_bytes"):
        make_pool(pm, kv_store="dict://x")
    # The tier in action: the evicted block goes down to both stores, and comes back from the first.
    model = tiny_llama()
    pool = make_pool(
        pm, config=model, num_blocks=3, block_size=4, kv_store=["dict://x", str(tmp_path)], kv_store_bytes=1e6
    )
    enable(model, pool=pool)
    try:
        prompt = torch.arange(3, 12)[None]
        expected = model.generate(prompt, max_new_tokens=2, do_sample=False)
        model.generate(torch.arange(40, 49)[None], max_new_tokens=2, do_sample=False)  # evicts the first prompt
        assert any(event[0] == "evicted" for event in recorder.events)
        assert pool.tiers.flush(30)
        assert torch.equal(model.generate(prompt, max_new_tokens=2, do_sample=False), expected)
        stats = pool.tier_stats()
        assert stats.stores["dict"]["hits"] == 2 and stats.stores["disk"]["hits"] == 0
    finally:
        disable(model)
        pool.tiers.close()
    pool.check_invariants()


# ---------------------------------------------------------------- events


@covers("pagedcore_request_admitted", "pagedcore_request_finished", "pagedcore_prefix_hit")
def test_request_events_carry_the_right_values(pm, use, caplog):
    caplog.set_level(logging.DEBUG, logger="pagedcore.events")  # the built-in logging observer
    recorder = use(Recorder(), "recorder")
    pool = make_pool(pm, num_blocks=32, block_size=4)
    sched = Scheduler(pool.kv, SchedulerConfig(max_num_batched_tokens=64), plugins=pm)
    model = FakeModel(sched)
    prompt_a = list(range(1, 11))
    sched.add(SequenceState("a", prompt_a, max_new_tokens=2, namespace="t1"))
    run_to_completion(sched, model)  # 10 prompt tokens + 1 decoded -> two full blocks (8 tokens) cached
    sched.add(SequenceState("b", [*prompt_a[:8], 50, 51, 52], max_new_tokens=1, namespace="t1"))
    sched.add(SequenceState("b2", [*prompt_a[:8], 50], max_new_tokens=1, namespace="t2"))  # other namespace: no hit
    run_to_completion(sched, model)
    stop = reference_output([20, 21, 22], 1)[0]
    sched.add(SequenceState("c", [20, 21, 22], max_new_tokens=5, stop_token_ids=frozenset({stop})))
    run_to_completion(sched, model)
    sched.add(SequenceState("d", [30, 31], max_new_tokens=3))
    sched.abort("d")  # while waiting: never admitted
    sched.add(SequenceState("e", [40, 41, 42], max_new_tokens=3))
    out = sched.schedule()
    sched.update(out, model.step(out))
    sched.abort("e")  # while running, after one sampled token
    assert recorder.events == [
        ("prefix_hit", "a", 10, 0, "t1"),
        ("admitted", "a", 10, 0),
        ("finished", "a", "length", 2),
        ("prefix_hit", "b", 11, 8, "t1"),
        ("admitted", "b", 11, 8),
        ("prefix_hit", "b2", 9, 0, "t2"),
        ("admitted", "b2", 9, 0),
        ("finished", "b", "length", 1),
        ("finished", "b2", "length", 1),
        ("prefix_hit", "c", 3, 0, None),
        ("admitted", "c", 3, 0),
        ("finished", "c", "stop", 1),
        ("finished", "d", "abort", 0),
        ("prefix_hit", "e", 3, 0, None),
        ("admitted", "e", 3, 0),
        ("finished", "e", "abort", 1),
    ]
    assert pm.num_observer_errors == 0
    assert "finished a (length) with 2 tokens" in caplog.text
    assert "prefix b: 8 of 11 tokens cached (namespace 't1')" in caplog.text


@covers("pagedcore_request_preempted", "pagedcore_request_admitted", "pagedcore_prefix_hit")
def test_preemption_events_match_the_scheduler(pm, use):
    recorder = use(Recorder(), "recorder")
    pool = make_pool(pm, num_blocks=8, block_size=4)  # three sequences growing to 5 blocks each cannot all run
    sched = Scheduler(pool.kv, SchedulerConfig(max_num_batched_tokens=64), plugins=pm)
    model = FakeModel(sched)
    prompts = {name: [i + 1] * 8 for i, name in enumerate("abc")}
    for name, prompt in prompts.items():
        sched.add(SequenceState(name, prompt, max_new_tokens=12))
    expected_preempted: list[tuple[str, int]] = []
    readmissions: list[tuple[str, int, int]] = []  # (id, tokens at re-admission, hit)
    done: dict[str, SequenceState] = {}
    while sched.has_unfinished():
        computed = {s.request_id: s.num_computed_tokens for s in sched.sequences()}
        tokens = {s.request_id: s.num_tokens for s in sched.sequences()}
        waiting = {s.request_id for s in sched.sequences() if s.blocks is None}
        out = sched.schedule()
        expected_preempted += [(rid, computed[rid]) for rid in out.preempted]
        for item in out.scheduled:
            seq = item.sequence
            if seq.request_id in waiting and seq.num_preemptions:
                readmissions.append((seq.request_id, tokens[seq.request_id], seq.num_cached_tokens))
        for seq in sched.update(out, model.step(out)):
            done[seq.request_id] = seq
        sched.check_invariants()
    assert expected_preempted and recorder.of("preempted") == expected_preempted
    assert all(n > 0 for _, n in expected_preempted)
    assert sched.stats.num_preemptions == len(expected_preempted)
    admitted = recorder.of("admitted")
    assert len(admitted) == 3 + len(expected_preempted)
    assert all(num_prompt == 8 for _, num_prompt, _ in admitted)  # the prompt, not prompt + generated
    # A re-admitted sequence looks up prompt + generated tokens and re-hits its own cached prefix.
    hits = recorder.of("prefix_hit")
    assert [(rid, q, h) for rid, q, h, _ in hits[3:]] == readmissions
    assert [(rid, h) for rid, _, h in admitted[3:]] == [(rid, h) for rid, _, h in readmissions]
    assert any(h > 0 for _, _, h in readmissions)
    assert recorder.of("finished") == [(rid, "length", 12) for rid in done]
    for name, prompt in prompts.items():
        assert done[name].output_token_ids == reference_output(prompt, 12)


@covers("pagedcore_blocks_evicted")
def test_blocks_evicted_event_names_the_evicted_blocks(pm, use):
    recorder = use(Recorder(), "recorder")
    pool = make_pool(pm, num_blocks=4, block_size=4)
    sched = Scheduler(pool.kv, SchedulerConfig(max_num_batched_tokens=64), plugins=pm)
    model = FakeModel(sched)
    sched.add(SequenceState("a", list(range(1, 9)), max_new_tokens=1))
    out = sched.schedule()
    (a_table,) = out.scheduled[0].block_tables
    sched.update(out, model.step(out))
    assert pool.kv.num_cached_blocks == 2 and recorder.of("evicted") == []
    sched.add(SequenceState("b", list(range(20, 32)), max_new_tokens=1))  # 3 blocks: 2 free + 1 evicted
    out = sched.schedule()
    (b_table,) = out.scheduled[0].block_tables
    sched.update(out, model.step(out))
    assert recorder.of("evicted") == [(0, [a_table[1]])]  # LRU: a's chain goes from its leaf
    assert pool.kv.match(list(range(1, 9))).block_ids == (a_table[:1],)
    sched.add(SequenceState("c", list(range(40, 55)), max_new_tokens=1))  # 4 blocks: all of them evicted
    run_to_completion(sched, model)
    # Oldest release first (a's root), then b's chain from its leaf; one allocate call -> one event.
    assert recorder.of("evicted") == [(0, [a_table[1]]), (0, [a_table[0], *b_table[::-1]])]
    assert pool.kv.groups[0].block_manager.num_evicted == 5
    assert pool.kv.match(list(range(1, 9))).num_tokens == 0
    pool.check_invariants()


@covers("pagedcore_blocks_evicted")
def test_blocks_evicted_event_names_the_group(pm, use):
    recorder = use(Recorder(), "recorder")
    pool = make_pool(pm, num_blocks=6, block_size=4, config=GEMMA2)  # group 0: sliding window 8; group 1: full
    assert [g.sliding_window for g in pool.kv.groups] == [8, None]
    sched = Scheduler(pool.kv, SchedulerConfig(max_num_batched_tokens=64), plugins=pm)
    model = FakeModel(sched)
    for i in range(4):
        sched.add(SequenceState(f"r{i}", [i + 1] * 12, max_new_tokens=2))
        run_to_completion(sched, model)
    evicted = recorder.of("evicted")
    assert {group for group, _ in evicted} == {0, 1}
    for g, group in enumerate(pool.kv.groups):
        ids = [b for group_index, block_ids in evicted if group_index == g for b in block_ids]
        assert len(ids) == group.block_manager.num_evicted > 0
        assert all(0 <= b < pool.num_blocks for b in ids)
    pool.check_invariants()


# ---------------------------------------------------------------- observer isolation


class Boom:
    """An observer that raises in every event hook."""

    @hookimpl(tryfirst=True)
    def pagedcore_request_admitted(self, request_id: str) -> None:
        raise RuntimeError(f"boom admitted {request_id}")

    @hookimpl(tryfirst=True)
    def pagedcore_request_preempted(self, request_id: str) -> None:
        raise RuntimeError("boom preempted")

    @hookimpl(tryfirst=True)
    def pagedcore_request_finished(self, request_id: str) -> None:
        raise RuntimeError("boom finished")

    @hookimpl(tryfirst=True)
    def pagedcore_prefix_hit(self, request_id: str) -> None:
        raise RuntimeError("boom prefix hit")

    @hookimpl(tryfirst=True)
    def pagedcore_blocks_evicted(self, block_ids: list[int]) -> None:
        raise RuntimeError("boom evicted")


@covers(
    "pagedcore_request_admitted",
    "pagedcore_request_preempted",
    "pagedcore_request_finished",
    "pagedcore_prefix_hit",
    "pagedcore_blocks_evicted",
)
def test_raising_observer_is_isolated_and_counted(pm, use, caplog):
    use(Boom(), "boom")
    recorder = use(Recorder(), "recorder")
    pool = make_pool(pm, num_blocks=8, block_size=4)
    sched = Scheduler(pool.kv, SchedulerConfig(max_num_batched_tokens=64), plugins=pm)
    model = FakeModel(sched)
    prompts = {name: [i + 1] * 8 for i, name in enumerate("abcd")}
    for name, prompt in prompts.items():
        sched.add(SequenceState(name, prompt, max_new_tokens=12))
    with caplog.at_level(logging.ERROR, logger="pagedcore.plugin_manager"):
        done = run_to_completion(sched, model)  # checks scheduler and pool invariants after every step
    for name, prompt in prompts.items():
        assert done[name].output_token_ids == reference_output(prompt, 12)
    pool.check_invariants()
    assert pool.kv.num_used_blocks == 0
    kinds = {event[0] for event in recorder.events}
    assert kinds == {"admitted", "preempted", "finished", "prefix_hit", "evicted"}  # every hook raised at least once
    assert pm.num_observer_errors == len(recorder.events)  # Boom failed once per event; the recorder saw them all
    assert "plugin 'boom' failed in pagedcore_request_finished; ignored" in caplog.text
    assert "RuntimeError: boom evicted" in caplog.text


class Waiting:
    """An observer that takes its time: each admission waits until the test lets it go."""

    def __init__(self) -> None:
        self.entered, self.go = threading.Event(), threading.Event()

    @hookimpl
    def pagedcore_request_admitted(self, request_id: str) -> None:
        self.entered.set()
        self.go.wait(60)


@covers("pagedcore_request_admitted", "pagedcore_request_finished", "pagedcore_prefix_hit")
def test_a_slow_observer_runs_after_the_engine_releases_its_lock(pm, use):
    """The Engine's events are delivered once it has released its lock, in the order emitted, so an observer that
    waits holds up only the thread that delivers them: another thread's add_request goes on (it waited for the
    observer while events ran under the lock)."""
    from pagedcore.adapters.torch_reference import TorchLlama, TorchRunner
    from pagedcore.engine import Engine

    recorder = use(Recorder(), "recorder")
    slow = use(Waiting(), "slow")
    with Engine(TorchRunner(TorchLlama.tiny(), num_blocks=32, block_size=4, plugins=pm)) as engine:
        engine.add_request([1, 2, 3], {"max_new_tokens": 2}, request_id="a")
        stepper = threading.Thread(target=engine.step)
        stepper.start()
        try:
            assert slow.entered.wait(60), "the step admitted no request"
            adder = threading.Thread(target=engine.add_request, args=([4, 5],), kwargs={"request_id": "b"})
            adder.start()
            adder.join(30)  # a deadlock guard, not a timing: it returns at once unless it waits for the observer
            assert not adder.is_alive(), "add_request waited for an observer the step is running"
        finally:
            slow.go.set()
            stepper.join(60)
        while engine.has_unfinished():
            for out in engine.step():  # one thread: a step's events are delivered before it returns
                assert ("finished", out.request_id) in [event[:2] for event in recorder.events]
    events = [event[:2] for event in recorder.events]
    for rid in "ab":
        assert [kind for kind, of in events if of == rid] == ["prefix_hit", "admitted", "finished"]
    assert events[:2] == [("prefix_hit", "a"), ("admitted", "a")] and pm.num_observer_errors == 0


# ---------------------------------------------------------------- hook validation (check_pending)


class Misspelled:
    @hookimpl
    def pagedcore_request_finshed(self, request_id: str) -> None:  # sic
        pass


class WrongArgument:
    @hookimpl
    def pagedcore_request_finished(self, request_id: str, reason: str) -> None:
        pass


class WrongSelectionArgument:
    @hookimpl
    def pagedcore_eviction_policy(self, policy_name: str) -> None:
        pass


class FewerArguments:
    """Accepts fewer arguments than the spec: allowed, so specs can grow without breaking plugins."""

    def __init__(self) -> None:
        self.finished: list[str] = []

    @hookimpl
    def pagedcore_request_finished(self, request_id: str) -> None:
        self.finished.append(request_id)


@covers("pagedcore_request_finished")
def test_misspelled_hook_is_refused(pm):
    before = pm.plugins()
    with pytest.raises(PluginError, match="unknown hook 'pagedcore_request_finshed'"):
        pm.register(Misspelled(), name="misspelled")
    assert pm.plugins() == before  # nothing left behind
    fewer = FewerArguments()
    with pm.plugin(fewer, name="fine"):  # the manager still takes valid plugins afterwards
        pm.emit("pagedcore_request_finished", request_id="r1", finish_reason="stop", num_output_tokens=3)
    assert fewer.finished == ["r1"]
    assert pm.plugins() == before


@covers("pagedcore_request_finished", "pagedcore_eviction_policy")
@pytest.mark.parametrize(("plugin", "argument"), [(WrongArgument, "reason"), (WrongSelectionArgument, "policy_name")])
def test_wrong_argument_name_is_refused(pm, plugin, argument):
    before = pm.plugins()
    with pytest.raises(PluginError, match=rf"{argument}.*can not be found in the hookspec"):
        pm.register(plugin(), name="wrong")
    assert pm.plugins() == before
    # Nothing of the refused plugin is left: had its impl stayed, these calls would hit the bad argument.
    pm.emit("pagedcore_request_finished", request_id="r1", finish_reason="stop", num_output_tokens=3)
    assert pm.num_observer_errors == 0
    assert isinstance(pm.eviction_policy(None), LRUEvictionPolicy)


# ---------------------------------------------------------------- built-ins: registered by the host itself


def test_the_host_registers_its_builtins_without_any_entry_point(monkeypatch):
    # Issue 11.3: the built-ins existed only through installed entry points: without them the manager had no
    # plugins and choosing an eviction policy raised.
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kwargs: [])
    pm = PluginManager()
    assert {info.name: info.source for info in pm.plugins()} == dict.fromkeys(BUILTINS, "built-in")
    assert isinstance(pm.eviction_policy(None), LRUEvictionPolicy)
    assert pm.attention_backend("cpu", torch.float32).name == "torch"
    assert pm.load_errors == []
    assert PluginManager(load_entrypoints=False, builtins=False).plugins() == []


def test_builtins_load_lazily_and_in_order(pm):
    assert [info.name for info in pm.plugins()] == sorted(BUILTINS)  # plugins() sorts by name
    # Registration order decides the order pluggy asks trylast implementations: the torch fallback last.
    impls = pm.hook.pagedcore_attention_backend.get_hookimpls()  # pluggy calls them from the end of this list
    assert [impl.plugin_name for impl in reversed(impls)] == ["xformers", "torch"]
    code = "import sys, pagedcore; pagedcore.PluginManager(); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"  # building a manager imports no built-in yet


class DefaultMRUPlugin(MRUPlugin):
    """A third party whose policy is also the default (answers ``name=None``), registered normally."""

    @hookimpl
    def pagedcore_eviction_policy(self, name: str | None, num_blocks: int) -> EvictionPolicy | None:
        return super().pagedcore_eviction_policy("mru" if name is None else name, num_blocks)


@covers("pagedcore_eviction_policy", "pagedcore_attention_backend")
def test_a_third_party_plugin_overrides_the_builtin_defaults(pm, use):
    assert isinstance(pm.eviction_policy(None), LRUEvictionPolicy)
    plugin = use(DefaultMRUPlugin(), "default-mru")
    backend = use(FakeBackendPlugin(), "fake-backend")
    assert pm.eviction_policy(None) is plugin.policies[-1]
    assert isinstance(pm.eviction_policy("lru"), LRUEvictionPolicy)  # the built-in still answers by name
    assert pm.attention_backend("cpu", torch.float32) is backend.backend
    pool = make_pool(pm, num_blocks=4)
    assert pool.kv.groups[0].block_manager.eviction_policy is plugin.policies[-1]


def test_a_builtin_whose_dependency_is_missing_is_not_registered(monkeypatch):
    monkeypatch.setattr(
        plugin_manager,
        "BUILTIN_PLUGINS",
        (
            *plugin_manager.BUILTIN_PLUGINS,
            plugin_manager.BuiltinPlugin("needs-nothing-installed", "pagedcore.plugins.eviction", ("no_such_module",)),
            plugin_manager.BuiltinPlugin("broken-builtin", "pagedcore.plugins.no_such_module"),
        ),
    )
    pm = PluginManager(load_entrypoints=False)
    names = {info.name for info in pm.plugins()}
    assert names == set(BUILTINS)
    (error,) = pm.load_errors  # a missing optional dependency is not an error; a built-in that fails to import is
    assert (error.name, error.source) == ("broken-builtin", "built-in")
    assert error.reason.startswith("ModuleNotFoundError")


def test_an_entry_point_for_a_builtin_is_not_registered_twice(install, loaded_pm, caplog):
    # An older pagedcore listed its built-ins as entry points: such metadata is ignored, the host registers them.
    install("pagedcore-old-metadata", "pagedcore.plugins.torch_backend", "torch", None)
    # Another distribution cannot take a built-in's name.
    install("pagedcore-impostor", "pagedcore_impostor_demo", "lru", "from pagedcore import hookimpl\n")
    pm = loaded_pm()
    with caplog.at_level("ERROR", logger="pagedcore.plugin_manager"):
        infos = {info.name: info.source for info in pm.plugins()}
    assert infos == dict.fromkeys(BUILTINS, "built-in")
    (error,) = pm.load_errors
    assert error.name == "lru" and "pagedcore_impostor_demo" in error.source
    assert error.reason == "the name 'lru' is reserved for a built-in plugin"
    assert "reserved for a built-in" in caplog.text
    assert "pagedcore_impostor_demo" not in sys.modules


# ---------------------------------------------------------------- entry points, end to end

THIRD_PARTY = '''
"""A third-party pagedcore plugin, installed from a throwaway distribution."""
from pagedcore import hookimpl

FINISHED = []


class Backend:
    name = "thirdparty"

    def forward(self, query, key_cache, value_cache, metadata, *, scale, softcap=None):
        return query


@hookimpl
def pagedcore_attention_backend(name):
    return Backend() if name == "thirdparty" else None


@hookimpl
def pagedcore_request_finished(request_id, finish_reason):
    FINISHED.append((request_id, finish_reason))
'''


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str, str, str | None], None]]:
    """``install(dist, module, entry_name, source)`` writes a module and its ``*.dist-info`` under a tmp dir on
    ``sys.path`` (with ``source=None``, only an entry point naming ``module``). Afterwards sys.path, the imported
    modules and importlib's caches are restored."""
    modules: list[str] = []
    entry_names: list[str] = []

    def write(dist: str, module: str, entry_name: str, source: str | None) -> None:
        if source is not None:
            (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        info = tmp_path / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[pagedcore]\n{entry_name} = {module}\n")
        if source is not None:
            modules.append(module)
        entry_names.append(entry_name)
        importlib.invalidate_caches()

    with monkeypatch.context() as patch:
        patch.syspath_prepend(str(tmp_path))  # also invalidates importlib's caches
        yield write
        for module in modules:
            sys.modules.pop(module, None)
    importlib.invalidate_caches()
    assert str(tmp_path) not in sys.path
    left = {ep.name for ep in importlib.metadata.entry_points(group="pagedcore")} & set(entry_names)
    assert not left, f"entry points {left} still visible after the test"


@pytest.fixture
def loaded_pm() -> Iterator[Callable[[], PluginManager]]:
    """``loaded_pm()``: a fresh manager that loads the entry points; everything it loaded is unregistered after."""
    managers: list[PluginManager] = []

    def make() -> PluginManager:
        managers.append(PluginManager())
        return managers[-1]

    yield make
    for manager in managers:
        for info in manager.plugins():
            manager.unregister(name=info.name)
        assert manager.plugins() == []


@covers("pagedcore_attention_backend", "pagedcore_request_finished")
def test_entry_points_load_third_party_and_builtins(install, loaded_pm):
    install("pagedcore-thirdparty-demo", "pagedcore_thirdparty_demo", "thirdparty", THIRD_PARTY)
    assert "pagedcore_thirdparty_demo" not in sys.modules
    pm = loaded_pm()
    assert "pagedcore_thirdparty_demo" not in sys.modules  # lazy: nothing loads before first use
    infos = {info.name: info for info in pm.plugins()}
    assert {"thirdparty", *BUILTINS} <= set(infos)
    third = infos["thirdparty"]
    assert third.source == "entry point pagedcore_thirdparty_demo (pagedcore-thirdparty-demo)"
    assert third.hooks == ("pagedcore_attention_backend", "pagedcore_request_finished")
    for name in BUILTINS:
        assert infos[name].source == "built-in"
    assert infos["torch"].hooks == ("pagedcore_attention_backend",)
    assert infos["lru"].hooks == ("pagedcore_eviction_policy",)
    event_hooks = {name for name in HOOK_NAMES if not getattr(hookspecs, name).pagedcore_spec["firstresult"]}
    assert set(infos["logging"].hooks) == event_hooks and len(event_hooks) == 5

    module = sys.modules["pagedcore_thirdparty_demo"]
    assert pm.attention_backend("cpu", torch.float32, name="thirdparty").name == "thirdparty"
    assert pm.attention_backend("cpu", torch.float32).name == "torch"  # it only answers for its own name
    pm.emit("pagedcore_request_finished", request_id="r1", finish_reason="stop", num_output_tokens=2)
    assert module.FINISHED == [("r1", "stop")]


FALLBACK = '''
"""A third-party backend for any device, marked trylast like the built-ins."""
from pagedcore import hookimpl


class Backend:
    name = "fallback"

    def forward(self, query, key_cache, value_cache, metadata, *, scale, softcap=None):
        return query


@hookimpl(trylast=True)
def pagedcore_attention_backend(device_type, name):
    return Backend() if name in (None, "fallback") else None
'''


@covers("pagedcore_attention_backend")
def test_torch_backend_is_asked_after_every_other_trylast_backend(install, loaded_pm):
    # "zzz" sorts after "torch", yet the torch fallback still loads last and so is asked last.
    install("pagedcore-fallback-demo", "pagedcore_fallback_demo", "zzz-fallback", FALLBACK)
    pm = loaded_pm()
    assert pm.attention_backend("cpu", torch.float32).name == "fallback"
    assert pm.attention_backend("cpu", torch.float32, name="torch").name == "torch"


def test_entry_point_that_fails_to_import_is_skipped_and_named(install, loaded_pm, caplog):
    install("pagedcore-broken-demo", "pagedcore_broken_demo", "broken", "raise ImportError('missing dependency')\n")
    pm = loaded_pm()
    with caplog.at_level("ERROR", logger="pagedcore.plugin_manager"):
        assert pm.attention_backend("cpu").name == "torch"  # the others (built-ins included) still load
        assert pm.attention_backend("cpu").name == "torch"  # and stay loaded on later calls
    (error,) = pm.load_errors
    assert error.name == "broken" and "pagedcore_broken_demo" in error.source
    assert error.reason == "ImportError: missing dependency"
    assert "'broken'" in caplog.text and "missing dependency" in caplog.text
    assert "broken" not in {info.name for info in pm.plugins()}


MISSPELLED = """
from pagedcore import hookimpl


@hookimpl
def pagedcore_request_finshed(request_id):
    pass
"""


def test_entry_point_with_a_misspelled_hook_is_skipped_and_the_manager_stays_usable(install, loaded_pm):
    install("pagedcore-typo-demo", "pagedcore_typo_demo", "typo", MISSPELLED)
    pm = loaded_pm()
    assert pm.attention_backend("cpu").name == "torch"
    assert [e.name for e in pm.load_errors] == ["typo"] and "pagedcore_request_finshed" in pm.load_errors[0].reason

    class Fine:
        @hookimpl
        def pagedcore_request_finished(self, request_id):
            pass

    assert pm.register(Fine(), name="fine") == "fine"  # the bad plugin does not poison later registrations


class Observer:
    """An observer of one event that does nothing (a plugin to register under a name)."""

    @hookimpl
    def pagedcore_request_finished(self, request_id):
        pass


def test_unregister_by_object_forgets_the_source(pm):
    plugin = Observer()
    pm.register(plugin, name="mine")
    pm.unregister(plugin)
    pm.register(Observer(), name="mine")
    assert {i.name: i.source for i in pm.plugins()}["mine"] == "registered"
    pm.unregister(name="mine")
    with pytest.raises(PluginError, match="not registered"):
        pm.unregister(name="nobody")


def test_plugin_answers_are_type_checked(pm):
    class Bad:
        @hookimpl
        def pagedcore_eviction_policy(self, name):
            return [] if name == "list" else None

        @hookimpl
        def pagedcore_attention_backend(self, name):
            return object() if name == "junk" else None

    with pm.plugin(Bad(), name="bad"):
        with pytest.raises(PluginError, match="not an EvictionPolicy"):
            pm.eviction_policy("list")
        with pytest.raises(PluginError, match="forward"):
            pm.attention_backend("cpu", None, "junk")


def test_event_hooks_refuse_wrappers_and_emit_checks_its_arguments(pm):
    class Wrapper:
        @hookimpl(wrapper=True)
        def pagedcore_request_finished(self, request_id):
            return (yield)

    with pytest.raises(PluginError, match="cannot be implemented as a wrapper"):
        pm.register(Wrapper(), name="wrapper")
    assert "wrapper" not in {i.name for i in pm.plugins()}
    with pytest.raises(TypeError, match="missing arguments"):
        pm.emit("pagedcore_request_finished", finish_reason="stop")
    with pytest.raises(PluginError, match="'pagedcore_no_such_hook' is not a pagedcore event"):
        pm.emit("pagedcore_no_such_hook", x=1)
    with pytest.raises(PluginError, match="'pagedcore_eviction_policy' is not a pagedcore event"):
        pm.emit("pagedcore_eviction_policy", name=None, num_blocks=1)

    class SelectionWrapper:
        @hookimpl(wrapper=True)
        def pagedcore_eviction_policy(self, name):
            return (yield)

    with pytest.raises(PluginError, match="selection hook pagedcore_eviction_policy cannot be implemented as a wr"):
        pm.register(SelectionWrapper(), name="wrapper")


class RaisingPolicy:
    @hookimpl
    def pagedcore_eviction_policy(self, name):
        raise RuntimeError("policy hook boom")


class RaisingBackend:
    @hookimpl
    def pagedcore_attention_backend(self, name):
        raise RuntimeError("backend hook boom")


class RaisingStore:
    @hookimpl
    def pagedcore_kv_store(self, location):
        raise RuntimeError("store hook boom")


@covers("pagedcore_eviction_policy", "pagedcore_attention_backend", "pagedcore_kv_store")
def test_a_selection_hook_that_raises_is_a_plugin_error_naming_the_plugin_and_the_hook(pm):
    with pm.plugin(RaisingPolicy(), name="raising"):
        with pytest.raises(PluginError, match=r"plugin 'raising' failed in pagedcore_eviction_policy\(name=None.*boom"):
            pm.eviction_policy(None, num_blocks=4)
        with pytest.raises(PluginError, match="plugin 'raising' failed in pagedcore_eviction_policy"):
            make_pool(pm, num_blocks=4)
    backend_error = r"plugin 'raising' failed in pagedcore_attention_backend\(.*hook boom"
    with pm.plugin(RaisingBackend(), name="raising"), pytest.raises(PluginError, match=backend_error):
        pm.attention_backend("cpu", torch.float32)
    with pm.plugin(RaisingStore(), name="raising"):
        with pytest.raises(PluginError, match=r"plugin 'raising' failed in pagedcore_kv_store\(location='memory://'"):
            pm.kv_store("memory://", 1024)
        with pytest.raises(PluginError, match="plugin 'raising' failed in pagedcore_kv_store"):
            make_pool(pm, num_blocks=4, kv_store="memory://", kv_store_bytes=1024)


class DefaultLRUPlugin:
    """A second third party whose policy is the default too."""

    @hookimpl
    def pagedcore_eviction_policy(self, name: str | None) -> EvictionPolicy | None:
        return LRUEvictionPolicy() if name is None else None


@covers("pagedcore_eviction_policy", "pagedcore_attention_backend")
@pytest.mark.parametrize("reverse", [False, True])
def test_two_installed_plugins_answering_one_call_are_refused_naming_both(pm, use, reverse):
    plugins = [(DefaultMRUPlugin(), "default-mru"), (DefaultLRUPlugin(), "default-lru")]
    for plugin, name in plugins[::-1] if reverse else plugins:
        use(plugin, name)
    first, second = ("'default-lru'", "'default-mru'") if reverse else ("'default-mru'", "'default-lru'")
    with pytest.raises(PluginError, match=rf"plugins ({first} and {second}|{second} and {first}) both answer"):
        pm.eviction_policy(None)  # which one wins would depend on the order they were registered
    assert isinstance(pm.eviction_policy("mru"), MRUPolicy)  # a name only one answers: no conflict
    use(FakeBackendPlugin(), "fake-1")
    use(FakeBackendPlugin(), "fake-2")
    with pytest.raises(PluginError, match=r"plugins 'fake-(1|2)' and 'fake-(2|1)' both answer pagedcore_attention"):
        pm.attention_backend("cpu", torch.float32)
    assert pm.attention_backend("cpu", torch.float32, "torch").name == "torch"  # the built-ins never conflict


def test_registering_under_a_taken_name_is_refused_naming_it(pm):
    plugin = Observer()
    pm.register(plugin, name="mine")
    try:
        with pytest.raises(PluginError, match=r"^the plugin name 'mine' is taken \(registered\)"):
            pm.register(Observer(), name="mine")
        with pytest.raises(PluginError, match=r"^the plugin name 'torch' is taken \(built-in\)"):
            pm.register(Observer(), name="torch")
        with pytest.raises(PluginError, match="already registered, as 'mine'"):
            pm.register(plugin, name="other")
    finally:
        pm.unregister(name="mine")


@covers("pagedcore_attention_backend")
def test_the_attention_backend_is_refused_when_the_engine_or_cache_is_built(pm):
    from pagedcore.adapters.torch_reference import TorchLlama, TorchRunner
    from pagedcore.adapters.transformers import Engine, PagedCache

    model = tiny_llama()
    model.set_attn_implementation("paged")  # the path that asks the backend at every forward
    nobody = r"no plugin offers backend 'nobody' for device 'cpu'"
    with pytest.raises(PluginError, match=nobody):
        Engine(model, pool=make_pool(pm, config=model, num_blocks=8), attention_backend="nobody")
    with pytest.raises(PluginError, match=nobody):
        PagedCache(model, pool=make_pool(pm, config=model, num_blocks=8), attention_backend="nobody")
    failing = "plugin 'raising' failed in pagedcore_attention_backend"
    with pm.plugin(RaisingBackend(), name="raising"):
        with pytest.raises(PluginError, match=failing):
            Engine(model, pool=make_pool(pm, config=model, num_blocks=8))
        with pytest.raises(PluginError, match=failing):
            enable(model, pool=make_pool(pm, config=model, num_blocks=8))
        with pytest.raises(PluginError, match=failing):
            TorchRunner(TorchLlama.tiny(), num_blocks=8, plugins=pm)
    assert "generate" not in vars(model)  # enable() changed nothing


class ArmedPolicyPlugin:
    """An LRU policy whose ``pop()`` raises once armed (a plugin's bug that shows only under pressure)."""

    armed = False

    @hookimpl
    def pagedcore_eviction_policy(self, name: str | None) -> EvictionPolicy | None:
        if name != "armed":
            return None
        plugin = self

        class Armed(LRUEvictionPolicy):
            name = "armed"

            def pop(self) -> int:
                if plugin.armed:
                    raise RuntimeError("pop boom")
                return super().pop()

        return Armed()


@covers("pagedcore_eviction_policy")
def test_an_engine_whose_eviction_policy_fails_fails_that_request_and_keeps_its_pool(pm):
    from pagedcore.adapters.transformers import Engine

    plugin = ArmedPolicyPlugin()
    model = tiny_llama()
    with pm.plugin(plugin, name="armed-policy"):
        pool = make_pool(pm, config=model, num_blocks=8, block_size=4, eviction_policy="armed")
        with Engine(model, pool=pool) as engine:
            engine.generate([list(range(3, 19))], max_new_tokens=2, use_tqdm=False)  # 4 blocks cached
            cached = pool.kv.num_cached_blocks
            plugin.armed = True
            (out,) = engine.generate([list(range(40, 64))], max_new_tokens=2, use_tqdm=False)  # must evict
            assert re.match(r"PluginError: eviction policy 'armed' .*pop\(\) raised RuntimeError: pop boom", out.error)
            assert out.finish_reason == "error" and not engine.has_unfinished()  # the Engine serves on
            pool.check_invariants()
            assert pool.kv.num_cached_blocks == cached and pool.kv.num_used_blocks == 0
            plugin.armed = False
            assert engine.generate([list(range(40, 64))], max_new_tokens=2, use_tqdm=False)[0].error is None
