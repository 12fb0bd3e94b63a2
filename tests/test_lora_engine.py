"""LoRA adapters in the Engine (issue 31, item 1): several adapters per Engine, a request names its adapter, one
forward serves a batch mixing them, and every row's tokens equal ``generate`` of the base model with that adapter
alone (PEFT; fp32 greedy, logits within 1e-4), in mixed batches and on prefix hits. The prefix cache keys blocks by
adapter version; loading and unloading at run time keep the other prefixes; a change of an adapter's weights
forgets exactly its prefixes; ``max_loras`` bounds the adapters in the model (least recently used first);
``max_lora_rank`` and what cannot be served are refused when loaded."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("peft")  # a test extra (LoRA adapters): the GPU image has none

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lora_helpers import ALL_LINEAR, assert_reference, base_model, make_adapter, peft_model, reference
from models import FIRST_TOKEN, VOCAB

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.block_keys import AdapterNamespace, namespace_key
from pagedcore.errors import AdapterError, AdapterNotFoundError, ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_new_tokens=5, return_logits=True)
NEW = GREEDY.max_new_tokens


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "a": make_adapter(root / "a", seed=1, r=4),
        "b": make_adapter(root / "b", seed=2, r=8, targets=ALL_LINEAR),
        "c": make_adapter(root / "c", seed=3, r=2, targets=("q_proj", "k_proj", "o_proj"), use_rslora=True),
    }


@pytest.fixture(scope="module")
def expected(adapters: dict[str, str]):
    """``expected(lora, prompt)``: the reference answer, each computed once."""
    cache: dict[tuple[str | None, tuple[int, ...]], tuple[list[int], torch.Tensor]] = {}
    models: dict[str | None, torch.nn.Module] = {}

    def answer(lora: str | None, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
        key = (lora, tuple(prompt))
        if key not in cache:
            if lora not in models:
                models[lora] = peft_model(None if lora is None else adapters[lora])
            cache[key] = reference(models[lora], prompt, NEW)
        return cache[key]

    return answer


def prompts(seed: int, count: int, shared: int = 9) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    prefix = torch.randint(FIRST_TOKEN, VOCAB, (shared,), generator=rng).tolist()
    return [prefix + torch.randint(FIRST_TOKEN, VOCAB, (1 + i,), generator=rng).tolist() for i in range(count)]


def engine(adapters: dict[str, str], names=("a", "b", "c"), **settings) -> Engine:
    settings = {"max_loras": 3, **settings}
    built = Engine(base_model(), num_blocks=96, block_size=4, enable_lora=True, **settings)
    for name in names:
        built.loras.load(name, adapters[name])
    return built


def resident(built: Engine) -> set[str]:
    return {info.name for info in built.loras.adapters() if info.resident}


def test_every_row_of_a_mixed_batch_equals_peft_with_its_adapter_alone(adapters, expected):
    work = prompts(0, 6)
    loras = ["a", None, "b", "c", "a", "b"]
    with engine(adapters) as built:
        outs = built.generate(work, GREEDY, lora=loras, use_tqdm=False)
    for prompt, lora, out in zip(work, loras, outs):
        assert_reference(out, expected(lora, prompt))
    # Not vacuous: every adapter changes the base model's answer to the same prompt.
    for lora in ("a", "b", "c"):
        assert expected(lora, work[0])[0] != expected(None, work[0])[0]


def test_prefix_hits_stay_within_their_adapter_and_stay_exact(adapters, expected):
    work = prompts(1, 3)
    with engine(adapters) as built:
        built.generate(work[:1], GREEDY, lora="a", use_tqdm=False)
        # The same prompt under the base model and another adapter: nothing of a's blocks is served.
        cold = built.generate([work[0], work[0]], GREEDY, lora=[None, "b"], use_tqdm=False)
        assert [o.metrics.num_cached_tokens for o in cold] == [0, 0]
        # Its own adapter hits (the prompt's full blocks and the partly filled last one) and stays exact.
        hot = built.generate(work, GREEDY, lora=["a", "a", "b"], use_tqdm=False)
        assert hot[0].metrics.num_cached_tokens == len(work[0]) - 1
        assert hot[1].metrics.num_cached_tokens >= 8 and hot[2].metrics.num_cached_tokens >= 8
        for prompt, lora, out in zip(work, ["a", "a", "b"], hot):
            assert_reference(out, expected(lora, prompt))


def test_tenants_stay_apart_under_one_adapter(adapters):
    work = prompts(2, 1)
    with engine(adapters, names=("a",)) as built:
        built.generate(work, GREEDY, lora="a", namespace="alice", use_tqdm=False)
        (bob,) = built.generate(work, GREEDY, lora="a", namespace="bob", use_tqdm=False)
        (alice,) = built.generate(work, GREEDY, lora="a", namespace="alice", use_tqdm=False)
    assert bob.metrics.num_cached_tokens == 0 and alice.metrics.num_cached_tokens > 0


def test_loading_and_unloading_adapters_keep_the_other_prefixes(adapters, expected):
    work = prompts(3, 2)
    with engine(adapters, names=("a",)) as built:
        built.generate(work, GREEDY, lora=[None, "a"], use_tqdm=False)
        cached = built.runner.kv.num_cached_blocks
        built.loras.load("b", adapters["b"])
        built.generate(work[:1], GREEDY, lora="b", use_tqdm=False)  # b enters the model: a forward with it
        built.loras.unload("b")
        again = built.generate(work, GREEDY, lora=[None, "a"], use_tqdm=False)
        assert built.runner.kv.num_cached_blocks >= cached
        assert [o.metrics.num_cached_tokens for o in again] == [len(p) - 1 for p in work]
        for prompt, lora, out in zip(work, [None, "a"], again):
            assert_reference(out, expected(lora, prompt))
        assert built.pool.weights is not None and built.pool.weights.epoch == 0  # no change of the base model seen


def test_an_adapter_changed_in_place_forgets_exactly_its_prefixes(adapters):
    work = prompts(4, 1)
    with engine(adapters, names=("a", "b")) as built:
        built.generate(work * 3, GREEDY, lora=[None, "a", "b"], use_tqdm=False)
        (before,) = [i.version for i in built.loras.adapters() if i.name == "a"]
        layer = next(m for m in built.model.modules() if hasattr(m, "lora_B") and len(m.lora_B) == 2)
        internal = next(name for name in layer.lora_B if layer.lora_A[name].weight.shape[0] == 4)  # a's (rank 4)
        with torch.no_grad():
            layer.lora_B[internal].weight.mul_(-1.0)  # an in-place update (an optimizer step, say)
        outs = built.generate(work * 3, GREEDY, lora=[None, "a", "b"], use_tqdm=False)
        (after,) = [i.version for i in built.loras.adapters() if i.name == "a"]
        assert after != before
        assert [o.metrics.num_cached_tokens for o in outs] == [len(work[0]) - 1, 0, len(work[0]) - 1]
        # The changed adapter computes with its new weights: PEFT with the same change.
        ref = peft_model(adapters["a"])
        ref_layer = ref.get_submodule(_path(built.model, layer).replace("model.", "base_model.model.model.", 1))
        with torch.no_grad():
            ref_layer.lora_B["default"].weight.mul_(-1.0)
        assert_reference(outs[1], reference(ref, work[0], NEW))
        # Its old version's namespace is closed: nothing of it is matched or registered again.
        old = AdapterNamespace(None, "a", before)
        assert built.runner.kv.match(work[0], old).num_tokens == 0
        assert all(
            namespace_key(ns) != namespace_key(old) for g in built.runner.kv.groups for ns in g.trie.namespaces()
        )


def test_a_change_of_the_base_weights_forgets_every_prefix(adapters):
    work = prompts(5, 1)
    with engine(adapters, names=("a",)) as built:
        built.generate(work * 2, GREEDY, lora=[None, "a"], use_tqdm=False)
        with torch.no_grad():
            built.model.lm_head.weight.mul_(0.5)
        outs = built.generate(work * 2, GREEDY, lora=[None, "a"], use_tqdm=False)
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 0]


def test_max_loras_bounds_the_adapters_in_the_model_least_recently_used_first(adapters, expected):
    work = prompts(6, 4)
    loras = ["a", "b", "c", "a"]
    seen: list[set[str]] = []
    with engine(adapters, max_loras=1) as built:
        assert built.loras.config.max_loras == 1
        original = built.runner.execute

        def spy(prepared):
            seen.append(resident(built))
            return original(prepared)

        built.runner.execute = spy
        outs = built.generate(work, GREEDY, lora=loras, use_tqdm=False)
        for prompt, lora, out in zip(work, loras, outs):
            assert_reference(out, expected(lora, prompt))
        assert max(len(names) for names in seen) == 1 and set().union(*seen) == {"a", "b", "c"}
        # Two slots: the least recently used adapter leaves for the next one.
    with engine(adapters, max_loras=2) as built:
        for lora in ("a", "b", "a", "c"):
            built.generate(work[:1], GREEDY, lora=lora, use_tqdm=False)
        assert resident(built) == {"a", "c"}


def test_requests_using_an_unloaded_adapter_finish_with_it(adapters, expected):
    work = prompts(7, 2)
    with engine(adapters, names=("a",)) as built:
        rid = built.add_request(work[0], GREEDY, lora="a")
        built.step()
        built.loras.unload("a")
        with pytest.raises(AdapterNotFoundError) as refused:
            built.add_request(work[1], GREEDY, lora="a")
        assert refused.value.param == "lora"
        done = {}
        while built.has_unfinished():
            done.update({o.request_id: o for o in built.step()})
        assert_reference(done[rid], expected("a", work[0]))
        built.step()  # the next step takes it out of the model
        assert built.loras.adapters() == [] and not any(len(getattr(m, "lora_A", ())) for m in built.model.modules())


def test_load_inplace_serves_the_new_version_and_none_of_the_old_prefixes(adapters, expected):
    work = prompts(8, 1)
    with engine(adapters, names=()) as built:
        built.loras.load("x", adapters["a"])
        built.generate(work, GREEDY, lora="x", use_tqdm=False)
        with pytest.raises(AdapterError, match="has already been loaded"):
            built.loras.load("x", adapters["b"])
        info = built.loras.load("x", adapters["b"], replace=True)
        (out,) = built.generate(work, GREEDY, lora="x", use_tqdm=False)
        assert out.metrics.num_cached_tokens == 0 and info.rank == 8
        assert_reference(out, expected("b", work[0]))


def test_refusals_name_what_cannot_be_served(adapters, tmp_path):
    with Engine(base_model(), num_blocks=16, block_size=4) as plain:
        with pytest.raises(AdapterError, match="enable_lora=True") as refused:
            plain.add_request([5, 6, 7], GREEDY, lora="a")
        assert refused.value.param == "lora" and not plain.has_unfinished()
        (out,) = plain.generate([[5, 6, 7]], GREEDY, lora="a", use_tqdm=False)
        assert "enable_lora=True" in out.error
        with pytest.raises(AdapterError, match="enable_lora=True"):
            plain.loras.load("a", adapters["a"])
    with engine(adapters, names=("a",), max_lora_rank=4) as built:
        with pytest.raises(AdapterError, match="LoRA rank 8 is greater than max_lora_rank 4"):
            built.loras.load("b", adapters["b"])
        with pytest.raises(AdapterNotFoundError, match="No adapter found"):
            built.loras.load("d", str(tmp_path / "missing"))
        dora = make_adapter(tmp_path / "dora", seed=4, use_dora=True)
        with pytest.raises(AdapterError, match="DoRA"):
            built.loras.load("d", dora)
        embed = make_adapter(tmp_path / "embed", seed=5, targets=("embed_tokens",))
        with pytest.raises(AdapterError, match="linear layer"):
            built.loras.load("d", embed)
        pickled = make_adapter(tmp_path / "pickled", seed=6, safe_serialization=False)
        with pytest.raises(AdapterError, match="pickle"):
            built.loras.load("d", pickled)
        config = json.loads((tmp_path / "dora" / "adapter_config.json").read_text())
        assert config["use_dora"] is True
        (out,) = built.generate([[5, 6, 7]], GREEDY, lora="nope", use_tqdm=False)
        assert "AdapterNotFoundError" in out.error and "nope" in out.error
        assert [info.name for info in built.loras.adapters()] == ["a"]  # nothing refused was kept


def test_files_whose_weights_do_not_match_what_they_say_are_refused_and_the_base_stays(adapters, tmp_path):
    """Regression (an outside audit): a PiSSA / OLoRA adapter saved as trained was injected with its initialiser,
    which rewrote the base weights for every request (and after close); a config rank other than the weights' rank
    and a file without weights were taken at load, and the first failed inside PEFT at every request, untyped, and
    left half-injected layers behind; a file missing a targeted layer was served with PEFT's initial weights."""
    import shutil

    from safetensors.torch import save_file

    def edited(name: str, **changes: object) -> str:
        folder = tmp_path / name
        shutil.copytree(adapters["a"], folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))
        return str(folder)

    model = base_model()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with Engine(model, num_blocks=32, block_size=4, enable_lora=True) as built:
        for init in ("pissa", "pissa_niter_4", "olora", "corda", "loftq"):
            extra = {"loftq_config": {"loftq_bits": 4}} if init == "loftq" else {}
            with pytest.raises(AdapterError, match=f"init_lora_weights='{init}' rewrites the base model's weights"):
                built.loras.load("p", edited(init, init_lora_weights=init, **extra))
        with pytest.raises(AdapterError, match="rank 4, but the adapter's config says r=2"):
            built.loras.load("r", edited("rank", r=2))
        empty = edited("empty")
        save_file({}, f"{empty}/adapter_model.safetensors")
        with pytest.raises(AdapterError, match="holds no LoRA weights"):
            built.loras.load("e", empty)
        assert built.loras.adapters() == []
        # PEFT failing inside the first injection (its PeftModel) leaves no wrapped layer behind (review)
        built.loras.load("act", edited("act", target_modules=["q_proj", "act_fn"]))
        (out,) = built.generate([[5, 6, 7]], GREEDY, lora="act", use_tqdm=False)
        assert out.error is not None and "AdapterError" in out.error
        assert not any(hasattr(module, "lora_A") for module in model.modules())
        built.loras.load("m", edited("missing", target_modules=["q_proj", "k_proj", "v_proj"]))
        (out,) = built.generate([[5, 6, 7]], GREEDY, lora="m", use_tqdm=False)
        assert out.error is not None and "AdapterError" in out.error and "no weights for" in out.error
        assert not any("lora_A" in name for name, _ in model.named_parameters())  # nothing half-injected
        built.loras.load("a", adapters["a"])
        (out,) = built.generate([[5, 6, 7]], GREEDY, lora="a", use_tqdm=False)
        assert_reference(out, reference(peft_model(adapters["a"]), [5, 6, 7], NEW))
        assert built.pool.kv.num_used_blocks == 0
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[name], before[name]) for name in before)


def test_an_lm_head_adapter_saved_with_the_whole_head_is_served_when_the_head_is_the_models(adapters, tmp_path):
    """PEFT saves an adapter of ``lm_head`` with the whole head beside it (``save_embedding_layers``): served when
    that copy equals the model's head, refused by name when it differs (another vocabulary or base model)."""
    from safetensors.torch import load_file, save_file

    head = make_adapter(tmp_path / "head", seed=11, targets=("q_proj", "lm_head"))
    weights = load_file(f"{head}/adapter_model.safetensors")
    assert "base_model.model.lm_head.base_layer.weight" in weights
    with Engine(base_model(), num_blocks=32, block_size=4, enable_lora=True) as built:
        built.loras.load("head", head)
        (out,) = built.generate([[5, 6, 7]], GREEDY, lora="head", use_tqdm=False)
        assert_reference(out, reference(peft_model(head), [5, 6, 7], NEW))
    # a copy saved from a bfloat16 model is the same head for a float32 one (review: it was refused across dtypes)
    from pagedcore.adapters.transformers.lora_files import _same

    head_weight = base_model().lm_head.weight
    assert _same(head_weight, head_weight.to(torch.bfloat16)) and not _same(
        head_weight, head_weight.to(torch.bfloat16) + 1
    )
    with Engine(base_model(), num_blocks=32, block_size=4, enable_lora=True) as built:
        weights["base_model.model.lm_head.base_layer.weight"] += 1
        save_file(weights, f"{head}/adapter_model.safetensors")
        with pytest.raises(AdapterError, match=r"lm_head\.base_layer\.weight' is a whole layer's weights"):
            built.loras.load("other", head)


def test_a_model_that_carries_its_own_peft_lora_is_refused_rather_than_disabled(adapters):
    """Regression: ``enable_lora`` on a model with the user's own PEFT LoRA layers disabled them for every request
    and removed them at close (the trained adapter lost)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(base_model(), adapters["a"])
    with pytest.raises(ConfigError, match="already carries PEFT LoRA layers"):
        Engine(model.get_base_model(), num_blocks=16, block_size=4, enable_lora=True)
    assert any("lora_A" in name for name, _ in model.named_parameters())
    with Engine(model.get_base_model(), num_blocks=16, block_size=4) as plain:  # the adapter applies to every row
        (out,) = plain.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert_reference(out, reference(peft_model(adapters["a"]), [5, 6, 7], NEW))


def test_closing_the_engine_gives_the_base_model_back(adapters):
    model = base_model()
    names = [name for name, _ in model.named_parameters()]
    before = model(torch.tensor([[5, 6, 7]])).logits
    with Engine(model, num_blocks=16, block_size=4, enable_lora=True) as built:
        built.loras.load("a", adapters["a"])
        built.generate([[5, 6, 7]], GREEDY, lora="a", use_tqdm=False)
    assert [name for name, _ in model.named_parameters()] == names
    torch.testing.assert_close(model(torch.tensor([[5, 6, 7]])).logits, before)


def _path(model: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


POOL = prompts(9, 4)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    plan=st.lists(
        st.tuples(st.integers(0, len(POOL) - 1), st.sampled_from([None, "a", "b"]), st.sampled_from([None, "t"])),
        min_size=2,
        max_size=6,
    ),
    batch=st.integers(1, 4),
)
def test_property_no_prefix_crosses_an_adapter_or_a_tenant(adapters, expected, plan, batch):
    """Whatever the order and batching of requests over the base model, two adapters and two tenants: every answer
    equals PEFT's with its adapter alone, and no request is served more of a prefix than it shares with an earlier
    (or concurrent) request of the same tenant and adapter."""
    seen: list[tuple[object, int]] = []  # (tenant and adapter, prompt) of every request so far
    with engine(adapters, names=("a", "b"), max_loras=2) as built:
        for start in range(0, len(plan), batch):
            ids = {}
            for index, lora, tenant in plan[start : start + batch]:
                rid = built.add_request(POOL[index], GREEDY, lora=lora, namespace=tenant)
                ids[rid] = (len(seen), index, lora)
                seen.append(((lora, tenant), index))
            done = {}
            while built.has_unfinished():
                done.update({o.request_id: o for o in built.step()})
            for rid, (serial, index, lora) in ids.items():
                out = done[rid]
                assert_reference(out, expected(lora, POOL[index]))
                others = [other for n, (key, other) in enumerate(seen) if key == seen[serial][0] and n != serial]
                shared = max((_common(POOL[index], POOL[other]) for other in others), default=0)
                assert out.metrics.num_cached_tokens <= shared
            built.runner.kv.check_invariants()


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_the_disk_tier_keys_blocks_by_adapter_version(adapters, expected, tmp_path):
    """Prefixes written to the store below the pool carry their adapter version: a restarted Engine finds an
    adapter's prefixes for that adapter again (exactly), and never for the base model, another adapter, or other
    weights loaded under the same name."""
    work = prompts(10, 1) * 3
    store = {"kv_store": tmp_path, "kv_store_bytes": "16MiB"}
    with engine(adapters, names=("a",), **store) as built:
        built.generate(work[:1], GREEDY, lora="a", use_tqdm=False)
    with engine(adapters, names=("a", "b"), **store) as restarted:
        outs = restarted.generate(work, GREEDY, lora=["a", None, "b"], use_tqdm=False)
        full = (len(work[0]) - 1) // 4 * 4  # the store keeps full blocks
        assert [o.metrics.num_cached_tokens for o in outs] == [full, 0, 0]
        for prompt, lora, out in zip(work, ["a", None, "b"], outs):
            assert_reference(out, expected(lora, prompt))
    with Engine(base_model(), num_blocks=96, block_size=4, enable_lora=True, **store) as renamed:
        renamed.loras.load("a", adapters["b"])  # another adapter under the same name
        (out,) = renamed.generate(work[:1], GREEDY, lora="a", use_tqdm=False)
        assert out.metrics.num_cached_tokens == 0
        assert_reference(out, expected("b", work[0]))


def test_the_compiled_decode_step_runs_steps_without_adapter_rows_and_adapter_rows_run_eagerly(
    adapters, expected, monkeypatch
):
    """Decode steps as one captured graph (dynamo, fullgraph) with PEFT's layers in the model: steps whose rows are
    all the base model's run compiled (the adapters' hooks add nothing to the graph), steps with adapter rows run
    eagerly; every answer is exact either way."""
    from pagedcore.adapters.transformers import compiled as compiled_module

    monkeypatch.setattr(compiled_module, "BACKEND", "eager")
    work = prompts(11, 2)
    with engine(adapters, names=("a",), compile=True) as built:
        mixed = built.generate(work, GREEDY, lora=["a", None], use_tqdm=False)  # "a" enters the model
        assert built.stats().compiled_steps == 0  # no step of the mixed batch ran compiled
        plain = built.generate(work, GREEDY, use_tqdm=False)  # PEFT's layers (disabled) and hooks in the graph
        stats = built.stats()
    assert stats.compiled_steps > 0 and stats.compile_failures == 0
    for prompt, out in zip(work, plain):
        assert_reference(out, expected(None, prompt))
    for prompt, lora, out in zip(work, ["a", None], mixed):
        assert_reference(out, expected(lora, prompt))
