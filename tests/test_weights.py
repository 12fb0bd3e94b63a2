"""The prefix cache after the model's weights change (issue 17.1): ``enable()``d ``generate`` and a ``PagedCache`` on
a shared pool forget the prefixes computed with the old weights, so every call gives stock ``generate``'s tokens and
fp32 logits on the weights as they are now; and nothing that leaves the weights alone (``generate`` itself, other
models, accelerate's offload hooks) makes them forget.

Each "after" call is compared with stock ``generate`` on a ``DynamicCache`` on the new weights; the hit counters say
whether the pool served the old prefix (which today's main did: the outputs differed)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("peft")  # a test extra (PEFT adapters' weight changes): the GPU image has none

import torch
from models import FIRST_TOKEN, VOCAB, tiny_model
from paged_checks import assert_same_generation, dynamic, generate
from peft import LoraConfig, get_peft_model

from pagedcore import PoolMismatchError
from pagedcore.adapters import transformers as pc
from pagedcore.adapters.transformers import PagedCache, PagedKVPool
from pagedcore.adapters.transformers.weights import WeightsWatch

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4
ENABLE_DEFAULTS = {"num_blocks": 256, "block_size": BLOCK}
NEW = {"max_new_tokens": 8, "do_sample": False}


def tokens(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(FIRST_TOKEN, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def sgd_step(model: torch.nn.Module, ids: torch.Tensor, lr: float = 0.5) -> None:
    """One optimizer step of language-model training on ``ids`` (the eval-while-fine-tuning pattern)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def warm(model: torch.nn.Module, pool: PagedKVPool, ids: torch.Tensor) -> None:
    """Two calls: the second one hits every position of the prompt but the last token's (to the token)."""
    model.generate(ids, **NEW)
    before = pool.num_hit_tokens
    model.generate(ids, **NEW)
    assert pool.num_hit_tokens - before == ids.shape[1] - 1


def assert_like_stock(model: torch.nn.Module, pool: PagedKVPool, ids: torch.Tensor, *, hit: bool = False) -> None:
    """The enabled call gives stock generate's tokens and fp32 logits on the weights as they are now, and takes no
    prefix hit (``hit=False``: the old prefixes are gone), then a hit on the new prefixes with the same output."""
    want = generate(model, dynamic(model), input_ids=ids, **NEW)
    before = pool.num_hit_tokens
    assert_same_generation(generate(model, None, input_ids=ids, **NEW), want)
    assert (pool.num_hit_tokens > before) == hit
    assert_same_generation(generate(model, None, input_ids=ids, **NEW), want)  # the new prefixes are served
    assert pool.num_hit_tokens > before


# --------------------------------------------------------------------------------------------- enable(): updates
@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_an_optimizer_step_between_calls_gives_stock_generate_on_the_new_weights(enabled, family):
    model = tiny_model(family)
    ids = tokens(14, seed=1)
    pool = enabled(model)
    warm(model, pool, ids)
    sgd_step(model, ids)
    assert_like_stock(model, pool, ids)
    pool.check_invariants()


def test_load_state_dict_between_calls(enabled):
    model = tiny_model("llama")
    other = tiny_model("llama", seed=7).state_dict()
    ids = tokens(13, seed=2)
    pool = enabled(model)
    warm(model, pool, ids)
    model.load_state_dict(other)  # copies into the same tensors
    assert_like_stock(model, pool, ids)
    warm(model, pool, ids)
    model.load_state_dict(tiny_model("llama", seed=8).state_dict(), assign=True)  # new tensors
    assert_like_stock(model, pool, ids)


def test_a_replaced_parameter(enabled):
    model = tiny_model("llama")
    ids = tokens(13, seed=3)
    pool = enabled(model)
    warm(model, pool, ids)
    model.model.layers[0].self_attn.k_proj.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight[:32]))
    assert_like_stock(model, pool, ids)


def test_an_in_place_update_under_no_grad(enabled):
    model = tiny_model("llama")
    ids = tokens(13, seed=4)
    pool = enabled(model)
    warm(model, pool, ids)
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight.add_(0.3)
    assert_like_stock(model, pool, ids)


def test_a_fused_optimizer_that_bumps_no_version_counter(enabled):
    """``AdamW(fused=True)``'s kernel writes the parameters without bumping their version counters; the optimizer
    step hook sees it."""
    model = tiny_model("llama")
    ids = tokens(13, seed=5)
    pool = enabled(model)
    warm(model, pool, ids)
    versions = [p._version for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert [p._version for p in model.parameters()] == versions  # torch's counters saw nothing
    assert_like_stock(model, pool, ids)


def test_training_mode_and_back(enabled):
    """Generation in training mode works and hits its own prefixes; switching mode forgets them (dropout would
    make them differ; these tiny models have none, so the outputs agree either way)."""
    model = tiny_model("llama")
    ids = tokens(13, seed=6)
    pool = enabled(model)
    warm(model, pool, ids)
    model.train()
    assert_like_stock(model, pool, ids)
    model.eval()
    assert_like_stock(model, pool, ids)


def test_a_kept_cache_continues_on_what_it_computed_and_is_never_cached_after_the_update(enabled):
    """A cache returned before the update holds keys and values of the old weights: continuing it goes on from them
    exactly as a kept DynamicCache does, and none of its blocks reaches the prefix cache afterwards."""
    model = tiny_model("llama")
    ids = tokens(11, seed=7)
    pool = enabled(model)
    kept = model.generate(ids, **NEW, return_dict_in_generate=True)
    reference = dynamic(model)
    first = model.generate(ids, **NEW, cache=reference, return_dict_in_generate=True)
    assert kept.sequences.tolist() == first.sequences.tolist()
    sgd_step(model, ids)
    longer = kept.sequences
    want = generate(model, reference, input_ids=longer, **NEW)
    got = generate(model, kept.cache, input_ids=longer, **NEW)
    assert_same_generation(got, want)
    kept.cache.release()
    before = pool.num_hit_tokens
    assert_same_generation(
        generate(model, None, input_ids=longer, **NEW), generate(model, dynamic(model), input_ids=longer, **NEW)
    )
    assert pool.num_hit_tokens == before  # neither the kept cache's nor the old call's blocks were served


def test_a_conversion_while_a_cache_is_kept_still_raises_and_a_weight_update_does_not(enabled):
    model = tiny_model("llama")
    ids = tokens(13, seed=8)
    pool = enabled(model)
    kept = model.generate(ids, **NEW, return_dict_in_generate=True)
    sgd_step(model, ids)
    assert_like_stock(model, pool, ids)  # a weight update leaves the kept cache alone and serves the call
    model.to(torch.bfloat16)
    with pytest.raises(PoolMismatchError, match=r"torch.bfloat16.*release"):
        model.generate(ids, **NEW)
    kept.cache.release()
    want = model.generate(ids, **NEW, cache=dynamic(model))
    assert torch.equal(model.generate(ids, **NEW), want)
    assert pool.layer_tensors(0)[0].dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------- enable(): PEFT LoRA
def lora(**overrides) -> LoraConfig:
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    return LoraConfig(**{**config, "init_lora_weights": False, **overrides})  # random B: the adapter changes outputs


def test_peft_lora_adapters_added_switched_merged_disabled_and_unloaded(enabled):
    model = tiny_model("llama")
    ids = tokens(14, seed=9)
    pool = enabled(model)
    warm(model, pool, ids)
    torch.manual_seed(1)
    peft_model = get_peft_model(model, lora())  # injected into the enabled model itself
    assert_like_stock(model, pool, ids)
    torch.manual_seed(2)
    peft_model.add_adapter("other", lora())
    peft_model.set_adapter("other")
    assert_like_stock(model, pool, ids)
    peft_model.set_adapter("default")
    assert_like_stock(model, pool, ids)
    peft_model.merge_adapter()  # writes the base weights through .data: only the tuner state says so
    assert_like_stock(model, pool, ids)
    peft_model.unmerge_adapter()
    assert_like_stock(model, pool, ids)
    with peft_model.disable_adapter():
        assert_like_stock(model, pool, ids)
        want = model.generate(ids, **NEW, cache=dynamic(model))
    assert_like_stock(model, pool, ids)  # the adapter is back
    assert not torch.equal(model.generate(ids, **NEW, cache=dynamic(model)), want)
    unloaded = peft_model.merge_and_unload(adapter_names=["other"])  # the base now carries "other", not "default"
    assert unloaded is model
    assert_like_stock(model, pool, ids)


def test_peft_models_own_generate_on_an_enabled_model(enabled):
    """``PeftModel.generate`` calls the enabled model's ``generate``: the same check applies."""
    model = tiny_model("llama")
    ids = tokens(13, seed=10)
    pool = enabled(model)
    warm(model, pool, ids)
    torch.manual_seed(3)
    peft_model = get_peft_model(model, lora())
    want = generate(model, dynamic(model), input_ids=ids, **NEW)
    before = pool.num_hit_tokens
    assert_same_generation(generate(peft_model, None, input_ids=ids, **NEW), want)
    assert pool.num_hit_tokens == before


def test_peft_prompt_tuning_on_an_enabled_model_runs_as_stock(enabled):
    """Regression: PEFT's prompt tuning puts virtual tokens before the ids inside ``generate`` (its
    ``prepare_inputs_for_generation``), so the enabled call filed 18 positions of keys under 14 token ids: the
    second call and a later plain call of the base model hit them and gave other tokens. Such a call runs as stock
    (nothing reused or cached), and the base model's own calls stay exact."""
    import copy

    from peft import PromptTuningConfig, TaskType

    model = tiny_model("llama")
    ids = tokens(14, seed=1)
    config = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)
    torch.manual_seed(11)
    reference = get_peft_model(copy.deepcopy(model), copy.deepcopy(config))
    pool = enabled(model)
    peft_model = get_peft_model(model, config)
    peft_model.load_state_dict(reference.state_dict())
    want = generate(reference, None, input_ids=ids, **NEW)
    for _ in range(2):
        assert_same_generation(generate(peft_model, None, input_ids=ids, **NEW), want)
    assert pool.num_hit_tokens == 0 and pool.kv.num_used_blocks == 0
    base = generate(model, dynamic(model), input_ids=ids, **NEW)
    assert_same_generation(generate(model, None, input_ids=ids, **NEW), base)


def test_peft_adapter_names_per_row_on_an_enabled_model_run_as_stock(enabled):
    """Regression: PEFT's mixed-batch ``adapter_names`` chooses each row's adapter through forward pre-hooks, which
    neither the token ids nor the weights show: a prompt cached under adapter ``a`` was served to ``b`` and to the
    base, and one call of the same prompt for ``a`` and ``b`` computed it once and crashed in PEFT."""
    import copy

    model = tiny_model("llama")
    ids = tokens(14, seed=1)
    torch.manual_seed(1)
    peft_model = get_peft_model(model, lora(target_modules=["q_proj", "v_proj"]), adapter_name="a")
    peft_model.add_adapter("b", lora(target_modules=["q_proj", "v_proj"]))
    peft_model.eval()  # PEFT takes adapter_names in eval mode only
    reference = copy.deepcopy(peft_model)
    pool = enabled(model)
    for names, rows in ((["a"], ids), (["b"], ids), (["__base__"], ids), (["a", "b"], ids.repeat(2, 1))):
        want = generate(reference, None, input_ids=rows, adapter_names=names, **NEW)
        assert_same_generation(generate(peft_model, None, input_ids=rows, adapter_names=names, **NEW), want)
    assert pool.num_hit_tokens == 0


# --------------------------------------------------------------------------------- no spurious invalidation
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3", "gpt2", "gpt_neox", "falcon", "phi3", "qwen3_moe"])
def test_generate_itself_never_moves_the_fingerprint(enabled, family):
    model = tiny_model(family)
    ids = tokens(14, seed=11)
    pool = enabled(model)
    model.generate(ids, **NEW)
    watch = pool.weights
    assert watch is not None
    epoch, walks = watch.epoch, watch.num_walks
    for kwargs in ({}, {"num_return_sequences": 2, "do_sample": True}, {"num_beams": 2}):
        model.generate(ids, **{**NEW, **kwargs})
    assert not watch.check() and watch.epoch == epoch
    assert watch.num_walks == walks  # every check read the tensors only (no registration on the model)
    before = pool.num_hit_tokens
    model.generate(ids, **NEW)
    assert pool.num_hit_tokens - before == 13  # the 14-token prompt but its last token


def test_other_models_built_and_trained_meanwhile_change_nothing(enabled):
    """Registrations and optimizer steps anywhere in the process only make the watch look again."""
    model = tiny_model("llama")
    ids = tokens(13, seed=12)
    pool = enabled(model)
    warm(model, pool, ids)
    other = tiny_model("llama", seed=3)  # registers modules and parameters
    sgd_step(other, ids)  # steps an optimizer
    before = pool.num_hit_tokens
    assert_same_generation(
        generate(model, None, input_ids=ids, **NEW), generate(model, dynamic(model), input_ids=ids, **NEW)
    )
    assert pool.num_hit_tokens - before == 12


def test_offloaded_weights_on_the_meta_device_count_by_name_and_shape(enabled, tmp_path):
    """accelerate's offload hooks put new meta tensors in place of the offloaded weights at every forward: that is
    no weight change (the pool keeps its hits, and data_ptr is never asked of a meta tensor); an update of the
    weights on a device still is one."""
    from accelerate import dispatch_model

    model = tiny_model("llama")
    ids = tokens(13, seed=13)
    device_map = {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu"}
    device_map |= {"model.rotary_emb": "cpu", "lm_head": "disk"}
    model = dispatch_model(model, device_map=device_map, main_device="cpu", offload_dir=str(tmp_path))
    assert model.lm_head.weight.device.type == "meta"
    pool = enabled(model)
    warm(model, pool, ids)
    warm(model, pool, ids)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    assert_like_stock(model, pool, ids)


# ------------------------------------------------------------------------- pools shared, namespaces, explicit reset
def test_a_paged_cache_on_a_shared_pool_forgets_the_old_prefixes():
    model = tiny_model("llama")
    pool = PagedKVPool(model, num_blocks=64, block_size=BLOCK)
    ids = tokens(13, seed=14)
    cache = PagedCache(model, pool=pool)
    out = model.generate(ids, **NEW, cache=cache)
    cache.cache_prefixes([out[0].tolist()])
    cache.release()
    assert pool.kv.match(ids[0].tolist()).num_tokens == 13  # to the token: the partly filled last block too
    sgd_step(model, ids)
    late = PagedCache(model, pool=pool)  # made after the update: the pool forgets first
    assert pool.kv.match(ids[0].tolist()).num_tokens == 0
    late.release()
    assert pool.kv.num_used_blocks == 0


def test_rows_filled_before_an_update_are_not_registered_after_it():
    model = tiny_model("llama")
    pool = PagedKVPool(model, num_blocks=64, block_size=BLOCK)
    ids = tokens(13, seed=15)
    cache = PagedCache(model, pool=pool)
    out = model.generate(ids, **NEW, cache=cache)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    cache.cache_prefixes([out[0].tolist()])  # computed with the old weights
    assert pool.kv.num_cached_blocks == 0
    cache.release()
    pool.check_invariants()


def test_namespaces_stay_isolated_across_an_update(enabled):
    model = tiny_model("llama")
    ids = tokens(13, seed=16)
    pool = enabled(model)
    for ns in ("a", "b"):
        model.generate(ids, **NEW, pagedcore_namespace=ns)
    sgd_step(model, ids)
    with pc.namespace("a"):
        assert_like_stock(model, pool, ids)
    before = pool.num_hit_tokens
    want = generate(model, dynamic(model), input_ids=ids, **NEW)
    assert_same_generation(generate(model, None, input_ids=ids, **NEW, pagedcore_namespace="b"), want)
    assert pool.num_hit_tokens == before  # "a"'s new prefixes are not "b"'s, and "b"'s old ones are gone


def test_reset_prefix_cache_for_what_the_fingerprint_cannot_see(enabled):
    model = tiny_model("llama")
    ids = tokens(13, seed=17)
    pool = enabled(model)
    warm(model, pool, ids)
    model.lm_head.weight.data.mul_(2)  # through .data: no version counter, no new tensor
    assert pool.check_weights() == 0
    cached = pool.kv.num_cached_blocks
    assert cached == 5  # 13 prompt + 7 stored new tokens
    assert pool.reset_prefix_cache() == cached
    assert pool.reset_prefix_cache() == 0
    assert_like_stock(model, pool, ids)


# ---------------------------------------------------------------- what a model computes with besides its tensors
def _activation(model: torch.nn.Module) -> None:
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()  # a registration that adds and replaces no tensor


def _norm_setting(model: torch.nn.Module) -> None:
    model.model.layers[0].post_attention_layernorm.variance_epsilon = 0.5


def _attention_setting(model: torch.nn.Module) -> None:
    for layer in model.model.layers:
        layer.self_attn.scaling = layer.self_attn.scaling * 2


def _instance_forward(model: torch.nn.Module) -> None:
    mlp = model.model.layers[0].mlp
    forward = mlp.forward
    mlp.forward = lambda x: forward(x) * 2


_KEPT: list[torch.nn.Module] = []  # layers a caller still holds


def _written_into_modules(model: torch.nn.Module) -> None:
    attention = model.model.layers[0].self_attn
    old = attention.q_proj
    _KEPT.append(old)  # alive: no tensor of the model dies
    new = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    with torch.no_grad():
        new.weight.copy_(old.weight * 2)
    attention._modules["q_proj"] = new  # no registration: torch's quantization and fusion swap layers so


def _steering_hook(model: torch.nn.Module) -> None:
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out + 0.5)  # a steering vector


def _pre_hook(model: torch.nn.Module) -> None:
    model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda module, args: (args[0] * 2,))


def _global_hook(model: torch.nn.Module) -> None:
    def doubled(module: torch.nn.Module, args: Any, out: Any) -> Any:
        return out * 2 if isinstance(module, torch.nn.Linear) else None

    _HANDLES.append(torch.nn.modules.module.register_module_forward_hook(doubled))


_HANDLES: list[Any] = []  # global hooks, removed after each test (they would reach every model)


@pytest.fixture(autouse=True)
def _no_global_hooks_left() -> Iterator[None]:
    yield
    while _HANDLES:
        _HANDLES.pop().remove()


UNSEEN_BEFORE = {
    "a forward hook (a steering vector)": _steering_hook,
    "a forward pre-hook": _pre_hook,
    "a global forward hook": _global_hook,
    "a layer written into its parent's _modules": _written_into_modules,
    "an activation replaced": _activation,
    "a norm's epsilon": _norm_setting,
    "an attention's scaling": _attention_setting,
    "a forward set on the instance": _instance_forward,
}


@pytest.mark.parametrize("change", sorted(UNSEEN_BEFORE))
def test_a_change_that_moves_no_tensor_forgets_the_prefixes(enabled, change):
    """Regression: an activation replaced (a registration, after which the watch walked the tree again but compared
    only the tensors), a setting held as a plain attribute, a ``forward`` set on a module, a layer written into
    its parent's ``_modules`` while the old one lives on, or a forward hook (on a module, or global) changed no
    tensor, so
    the watch saw nothing and the next call was served the prompt's keys of the model before: other logits than
    stock. The watch now compares the modules after a registration, and each module's settings at every check that
    asks for them (enable()'s, at each call)."""
    model = tiny_model("llama")
    ids = tokens(13, seed=23)
    pool = enabled(model)
    warm(model, pool, ids)
    UNSEEN_BEFORE[change](model)
    assert_like_stock(model, pool, ids)


def test_settings_are_compared_where_asked_and_the_runners_own_forwards_do_not_count():
    """The Engine leaves the settings out of steps that admit no request (``check(settings=False)``): a change is
    then seen at the next check that compares them, also across a walk after a registration; the forwards the
    runner installs on its linears are the modules' own computation."""
    from pagedcore.adapters.transformers.prepacked import PrepackedLinears

    model = tiny_model("llama")
    watch = WeightsWatch(model)
    packs = PrepackedLinears(model)  # a forward set on every linear and the head: the same computation
    assert not watch.check()
    norm = model.model.norm
    norm.variance_epsilon = 0.25
    assert not watch.check(settings=False)
    assert watch.check() and not watch.check() and watch.fingerprint().epoch == 1
    norm.variance_epsilon = 0.25  # the same value again
    assert not watch.check()
    norm.variance_epsilon = 0.5
    model.model.norm = norm  # a registration: the walk after it finds the new value, compared with the old
    assert watch.check(settings=False) and watch.fingerprint().epoch == 2
    packs.close()
    assert not watch.check()
    attention = model.model.layers[0].self_attn
    old = attention.q_proj
    attention._modules["q_proj"] = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    assert not watch.check(settings=False)  # the old layer lives on (``old``): no tensor died, no registration
    assert watch.check() and watch.fingerprint().epoch == 3


# ------------------------------------------------------------------------------------------------ the watch itself
def test_the_watch_holds_no_replaced_tensor_and_tolerates_a_dead_model():
    import gc
    import weakref

    model = tiny_model("llama")
    watch = WeightsWatch(model)
    old = weakref.ref(model.lm_head.weight)
    model.lm_head.weight = torch.nn.Parameter(torch.zeros_like(model.lm_head.weight))
    gc.collect()
    assert old() is None  # the watch only holds weak references
    assert watch.check() and watch.fingerprint().epoch == 1
    del model
    gc.collect()
    assert not watch.check()


@pytest.mark.parametrize("edit", ["insert", "delete", "insert and delete"])
def test_a_container_edited_without_a_registration_is_seen(edit):
    """Regression: ``ModuleList.insert`` and ``del layers[i]`` (``Sequential``'s too) edit the container's dict
    without a registration, so the watch saw no change while the layers it had walked stayed alive (here: a list
    that keeps them; in an Engine, its decode tape did), and the prefix cache served keys of layers the forward no
    longer runs. The watch now compares each torch container's children at every check."""
    model = tiny_model("llama")
    watch = WeightsWatch(model)
    layers = model.model.layers
    kept = list(layers)  # every layer the watch walked, alive
    new = type(kept[0])(model.config, layer_idx=0).eval()
    if "insert" in edit:
        layers.insert(0, new)
    if "delete" in edit:
        del layers[1 if "insert" in edit else 0]
    assert watch.check() and watch.fingerprint().epoch == 1
    assert not watch.check()  # seen once
    assert len(kept) == model.config.num_hidden_layers


def test_peft_adapter_names_on_an_enabled_encoder_decoder_run_as_stock(enabled):
    """Regression (review): the check ran after enable()'s encoder-decoder branch, so on BART a decoder prefix
    cached under adapter ``a`` was served to ``b`` with other tokens."""
    import copy

    from test_encoder_decoder import bart

    model = bart()
    torch.manual_seed(1)
    peft_model = get_peft_model(model, lora(target_modules=["q_proj", "v_proj"]), adapter_name="a")
    peft_model.add_adapter("b", lora(target_modules=["q_proj", "v_proj"]))
    peft_model.eval()
    reference = copy.deepcopy(peft_model)
    pool = enabled(model)
    ids = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(3))
    call = {"max_new_tokens": 6, "do_sample": False, "decoder_input_ids": torch.tensor([[0, 5, 9, 17, 33, 41, 52]])}
    for names in (["a"], ["b"], ["__base__"], ["a"]):
        want = reference.generate(input_ids=ids, adapter_names=names, **call)
        assert torch.equal(peft_model.generate(input_ids=ids, adapter_names=names, **call), want)
    assert pool.num_hit_tokens == 0


def test_hooks_count_by_their_handles_and_the_ones_that_compute_nothing_do_not():
    """A forward hook or pre-hook added, or removed, is a change of the model (its body is not read); pagedcore's
    own hooks (``transparent_hook``) and transformers' output recorders, installed by the first call with
    ``output_hidden_states``, are not; a hook's change waits for a check that compares the settings."""
    from pagedcore.adapters.transformers.hook_ids import transparent_hook

    model = tiny_model("llama")
    watch = WeightsWatch(model)
    layer = model.model.layers[1]
    handle = layer.register_forward_hook(lambda module, args, out: None)  # computes nothing, counts all the same
    assert not watch.check(settings=False)
    assert watch.check() and not watch.check() and watch.fingerprint().epoch == 1
    handle.remove()
    assert watch.check() and watch.fingerprint().epoch == 2
    counter = layer.register_forward_pre_hook(transparent_hook(lambda module, args: None))
    with torch.no_grad():
        model(torch.tensor([[FIRST_TOKEN, 5, 6]]), output_hidden_states=True, output_attentions=True)
    assert not watch.check() and watch.fingerprint().epoch == 2
    counter.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    try:
        assert watch.check() and watch.fingerprint().epoch == 3
    finally:
        handle.remove()
    assert watch.check() and not watch.check() and watch.fingerprint().epoch == 4
