"""The Engine's packed forward with Llama's, Mistral's, Qwen2's and Qwen3's decoder layers called directly
(``pagedcore/adapters/transformers/direct_layers.py``): the same logits as the model's own forward, to the bit, at
every step; the model's forward wherever a bypassed module is hooked, replaced or of another class; turned off when
its first step's check fails."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from family_configs import tiny_family

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers import direct_layers as direct_module
from pagedcore.adapters.transformers.direct_layers import ENV, FAMILIES, DirectLayers
from pagedcore.adapters.transformers.testing import tiny_llama
from pagedcore.c_library import can_build_avx2

PROMPTS = [[5, 9, 3, 7, 1, 4, 2, 8, 6, 11, 13], [3, 4, 5], [7, 7, 2, 9, 12, 14, 1]]


def trained_norms(model: Any, seed: int = 0) -> Any:
    """``model`` with its norms' weights drawn around 1 (a fresh config's are all ones: any order of the norm's
    products would give the same bits)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.2 * torch.randn(parameter.shape, generator=generator))
    return model


def reference(model: Any, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy tokens, one prompt at a time (DynamicCache)."""
    out = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=new)
        out.append(ids[0, len(prompt) :].tolist())
    return out


def engine(model: Any, **kwargs: Any) -> Engine:
    return Engine(model, num_blocks=64, block_size=4, max_num_batched_tokens=8, **kwargs)  # chunked prefills too


def tokens(outputs: Any) -> list[list[int]]:
    return [o.samples[0].token_ids for o in outputs]


def direct_of(e: Engine) -> DirectLayers | None:
    return e.runner._direct


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_family_runs_its_layers_directly_with_generates_tokens_and_the_same_logits_bits(model_type: str) -> None:
    model = trained_norms(tiny_family(model_type, seed=1))
    want = reference(model, PROMPTS, 9)
    on, off = engine(model), engine(copy.deepcopy(model), compile=False)
    off.runner._direct = None  # the model's own forward: the bits to match
    params = SamplingParams(max_new_tokens=9, ignore_eos=True, return_logits=True)
    got, theirs = on.generate(PROMPTS, params, use_tqdm=False), off.generate(PROMPTS, params, use_tqdm=False)
    direct = direct_of(on)
    assert direct is not None and direct.counts.verified is True
    assert direct.counts.steps > 5  # prefill chunks and decode steps, after the checked first one
    assert tokens(got) == want == tokens(theirs)
    for mine, own in zip(got, theirs):
        for a, b in zip(mine.samples[0].logits, own.samples[0].logits, strict=True):
            assert torch.equal(a, b)


def test_a_sliding_window_family_hands_its_window_to_the_attention() -> None:
    model = trained_norms(tiny_family("mistral", seed=2))  # the tiny configs' window is 8: these prompts pass it
    assert model.config.sliding_window is not None
    prompts = [[(i * 7) % 200 + 3 for i in range(19)], [4, 5, 6]]
    want = reference(model, prompts, 12)
    e = engine(model)
    assert tokens(e.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True), use_tqdm=False)) == want
    direct = direct_of(e)
    assert direct is not None and direct.counts.verified is True and direct.counts.steps > 10


def test_the_fused_greedy_head_still_takes_the_tokens_of_argmax_only_steps() -> None:
    model = tiny_llama(vocab_size=512)
    want = reference(model, PROMPTS, 6)
    e = Engine(model, num_blocks=64, block_size=4)
    head = e.runner.argmax_head
    assert head is not None
    got = e.generate(PROMPTS * 4, SamplingParams(max_new_tokens=6, ignore_eos=True), use_tqdm=False)
    assert tokens(got) == want * 4
    direct = direct_of(e)
    assert direct is not None and direct.counts.steps > 3
    assert head.counts.steps + head.counts.checks > 0  # the head ran inside the direct layers' forward


def hooked_layer(model: Any) -> list[int]:
    calls: list[int] = []
    model.model.layers[1].register_forward_hook(lambda *_: calls.append(1))
    return calls


def hooked_attention(model: Any) -> list[int]:
    calls: list[int] = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def hooked_mlp(model: Any) -> list[int]:
    calls: list[int] = []
    model.model.layers[1].mlp.register_forward_hook(lambda *_: calls.append(1))
    return calls


def own_forward(model: Any) -> list[int]:
    calls: list[int] = []
    layer = model.model.layers[0]
    forward = layer.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return forward(*args, **kwargs)

    layer.forward = counted
    return calls


def global_hook(model: Any) -> list[int]:
    calls: list[int] = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *_: calls.append(1))
    model._test_handle = handle  # removed by the test
    return calls


@pytest.mark.parametrize("change", [hooked_layer, hooked_attention, hooked_mlp, own_forward, global_hook])
def test_a_hooked_or_replaced_bypassed_module_makes_the_step_run_the_models_own_forward(change: Any) -> None:
    model = tiny_llama()
    want = reference(model, PROMPTS, 5)
    e = engine(model)
    e.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2), use_tqdm=False)  # served directly until the change
    direct = direct_of(e)
    assert direct is not None and direct.counts.steps > 0
    before = direct.counts.steps
    calls = change(model)
    try:
        got = tokens(e.generate(PROMPTS, SamplingParams(max_new_tokens=5, ignore_eos=True), use_tqdm=False))
    finally:
        if hasattr(model, "_test_handle"):
            model._test_handle.remove()
    assert got == want
    assert calls  # the hook (or the instance's forward) ran: the model's own forward ran the step
    assert direct.counts.steps == before


def test_modules_it_still_calls_run_their_hooks_and_the_direct_layers_keep_serving() -> None:
    """The linears, the embedding and the activation are called straight through ``forward`` (direct_layers._call)
    only while nothing hooks them: a hook of any kind on one sends that call through ``Module.__call__``."""
    model = tiny_llama()
    want = reference(model, PROMPTS, 5)
    e = engine(model)
    e.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2), use_tqdm=False)
    direct = direct_of(e)
    assert direct is not None and direct.counts.steps > 0
    before = direct.counts.steps
    seen: list[str] = []
    layer = model.model.layers[0]
    handles = [
        layer.self_attn.k_proj.register_forward_hook(lambda *_: seen.append("k_proj")),
        layer.mlp.act_fn.register_forward_pre_hook(lambda *_: seen.append("act_fn")),
        model.model.embed_tokens.register_forward_hook(lambda *_: seen.append("embed")),
        layer.mlp.down_proj.register_full_backward_hook(lambda *_: seen.append("never: no backward here")),
    ]
    try:
        got = tokens(e.generate(PROMPTS, SamplingParams(max_new_tokens=5, ignore_eos=True), use_tqdm=False))
    finally:
        for handle in handles:
            handle.remove()
    assert got == want
    steps = direct.counts.steps - before
    assert steps > 3
    assert seen.count("k_proj") == seen.count("act_fn") == seen.count("embed") == steps


def test_a_global_backward_hook_counts_as_a_global_hook_that_turns_the_direct_layers_off() -> None:
    handle = torch.nn.modules.module.register_module_full_backward_hook(lambda *_: None)
    try:
        assert direct_module._global_hooks()
    finally:
        handle.remove()
    assert not direct_module._global_hooks()


def test_a_layer_of_another_class_makes_the_step_run_the_models_own_forward() -> None:
    model = tiny_llama()
    e = engine(model)
    e.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2), use_tqdm=False)
    direct = direct_of(e)
    assert direct is not None

    class Layer(type(model.model.layers[0])):  # type: ignore[misc]
        pass

    model.model.layers[0].__class__ = Layer
    assert not direct.serves()
    model.model.layers[0].__class__ = Layer.__bases__[0]
    assert direct.serves()


def test_a_first_step_whose_hidden_states_differ_turns_the_direct_layers_off_with_a_warning_and_keeps_the_models_tokens(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_llama()
    want = reference(model, PROMPTS, 6)
    hidden = DirectLayers._hidden

    def off_by_a_little(self: DirectLayers, inner: Any, kwargs: dict[str, Any]) -> torch.Tensor:
        return hidden(self, inner, kwargs) * 1.0001  # e.g. another transformers version's layer code

    monkeypatch.setattr(DirectLayers, "_hidden", off_by_a_little)
    e = engine(model)
    with caplog.at_level(logging.WARNING, logger="pagedcore"):
        got = tokens(e.generate(PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True), use_tqdm=False))
    assert got == want
    direct = direct_of(e)
    assert direct is not None and direct.counts.verified is False and direct.counts.steps == 0
    assert not direct.serves()
    assert "gave other hidden states than its own forward" in caplog.text


def test_a_first_step_that_raises_turns_the_direct_layers_off_and_the_step_runs_the_models_forward(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_llama()
    want = reference(model, PROMPTS, 4)

    def renamed(self: DirectLayers, inner: Any, kwargs: dict[str, Any]) -> torch.Tensor:
        raise AttributeError("'LlamaAttention' object has no attribute 'head_dim'")  # another version's layer code

    monkeypatch.setattr(DirectLayers, "_hidden", renamed)
    e = engine(model)
    with caplog.at_level(logging.WARNING, logger="pagedcore"):
        outputs = e.generate(PROMPTS, SamplingParams(max_new_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.error for o in outputs] == [None] * len(PROMPTS) and tokens(outputs) == want
    direct = direct_of(e)
    assert direct is not None and direct.counts.verified is False and not direct.serves()
    assert "called directly failed" in caplog.text


def test_a_weight_update_between_steps_is_read_by_the_direct_layers() -> None:
    model = tiny_llama()
    e = engine(model)
    e.generate(PROMPTS, SamplingParams(max_new_tokens=3), use_tqdm=False)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(-1.5)
            layer.self_attn.q_proj.weight.add_(0.05)
    want = reference(model, PROMPTS, 7)
    assert tokens(e.generate(PROMPTS, SamplingParams(max_new_tokens=7, ignore_eos=True), use_tqdm=False)) == want
    direct = direct_of(e)
    assert direct is not None and direct.counts.verified is True


def test_not_built_for_other_families_subclasses_or_with_the_switch_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DirectLayers.of(tiny_family("gpt2")) is None
    assert DirectLayers.of(tiny_family("phi3")) is None  # a fused qkv projection: not Llama's layer

    class MyLlama(type(tiny_llama())):  # type: ignore[misc]
        pass

    assert DirectLayers.of(MyLlama(tiny_llama().config)) is None  # its forward may differ
    monkeypatch.setenv(ENV, "0")
    assert DirectLayers.of(tiny_llama()) is None
    monkeypatch.delenv(ENV)
    assert DirectLayers.of(tiny_llama()) is not None


def test_a_family_whose_classes_this_transformers_lacks_is_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(FAMILIES, "llama", ("transformers.models.llama.no_such_module", "Llama", lambda a: None, False))
    monkeypatch.setattr(direct_module, "_CLASSES", {})
    assert DirectLayers.of(tiny_llama()) is None


@pytest.fixture
def no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct_module, "_kernel_for", lambda *_: None)


@pytest.mark.usefixtures("no_kernel")
def test_without_the_kernel_the_torch_ops_give_the_same_bits() -> None:
    model = trained_norms(tiny_llama(), seed=3)
    on, off = engine(model), engine(copy.deepcopy(model))
    off.runner._direct = None
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, return_logits=True)
    got, theirs = on.generate(PROMPTS, params, use_tqdm=False), off.generate(PROMPTS, params, use_tqdm=False)
    direct = direct_of(on)
    assert direct is not None and direct.counts.verified is True and direct.counts.steps > 3
    for mine, own in zip(got, theirs):
        assert all(torch.equal(a, b) for a, b in zip(mine.samples[0].logits, own.samples[0].logits, strict=True))


class _Pool:
    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values

    def layer_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values


class _Cache:
    def __init__(self, pool: _Pool, slots: torch.Tensor) -> None:
        self.pool, self._slots = pool, slots

    def slots(self, layer_idx: int, device: torch.device) -> torch.Tensor:
        return self._slots


@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "d"), [(1, 8, 2, 64), (5, 4, 4, 16), (3, 6, 1, 128)])
def test_the_kernels_rotary_and_store_are_transformers_ops_to_the_bit(tokens: int, heads: int, kv_heads: int, d: int):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    kernel = direct_module.load_kernel()
    if kernel is None:
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(tokens * heads + d)
    q, k, v = (torch.randn(1, tokens, n * d, generator=g) for n in (heads, kv_heads, kv_heads))
    angles = torch.randn(1, tokens, d // 2, generator=g) * 40
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    pool = _Pool(torch.zeros(4, 4, kv_heads, d), torch.zeros(4, 4, kv_heads, d))
    slots = torch.tensor([13, 2, 7, 9, 0][:tokens])

    class Attention:
        head_dim, layer_idx = d, 0

    query = kernel.rope_store(_Cache(pool, slots), Attention(), q, k, v, cos, sin)
    assert query is not None
    shape = (1, tokens, -1, d)
    want_q, want_k = apply_rotary_pos_emb(q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), cos, sin)
    assert torch.equal(query, want_q)
    flat_keys, flat_values = pool.keys.view(-1, kv_heads, d), pool.values.view(-1, kv_heads, d)
    assert torch.equal(flat_keys[slots], want_k[0].transpose(0, 1))
    assert torch.equal(flat_values[slots], v.view(tokens, kv_heads, d))
    others = torch.ones(16, dtype=torch.bool)
    others[slots] = False
    assert not flat_keys[others].any() and not flat_values[others].any()  # nothing else written


def test_the_kernel_declines_layouts_it_does_not_read_and_writes_nothing() -> None:
    kernel = direct_module.load_kernel()
    if kernel is None:
        pytest.skip("no C compiler here")
    q, k, v = torch.randn(1, 2, 32), torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    cos, sin = torch.randn(1, 2, 16), torch.randn(1, 2, 16)

    class Attention:
        head_dim, layer_idx = 16, 0

    heads_first = _Pool(torch.zeros(1, 4, 4, 16).transpose(1, 2), torch.zeros(1, 4, 4, 16).transpose(1, 2))
    assert kernel.rope_store(_Cache(heads_first, torch.tensor([1, 2])), Attention(), q, k, v, cos, sin) is None
    halves = _Pool(torch.zeros(4, 4, 1, 16, dtype=torch.float16), torch.zeros(4, 4, 1, 16, dtype=torch.float16))
    assert kernel.rope_store(_Cache(halves, torch.tensor([1, 2])), Attention(), q, k, v, cos, sin) is None
    assert not heads_first.keys.any() and not halves.keys.any()


WIDTHS = (3, 4, 7, 8, 24, 64, 100, 512, 896, 1536, 3584, 5120, 65536)  # shorter than a vector; powers of two and not


def fresh_kernel(flags: tuple[str, ...] = direct_module._FLAGS) -> direct_module.DirectKernel:
    kernel = direct_module.load_kernel()
    if kernel is None:
        pytest.skip("no C compiler here")
    if flags == direct_module._AVX2_FLAGS and not can_build_avx2("PAGEDCORE_DIRECT_KERNEL"):
        pytest.skip("no AVX2 here")
    return direct_module.DirectKernel(_library(flags))  # its own width checks


def _library(flags: tuple[str, ...] = direct_module._FLAGS) -> Any:
    library = direct_module.build("direct_kernel", direct_module._SOURCE_TEXT, flags)
    assert library is not None
    return library


@pytest.mark.parametrize("flags", [direct_module._FLAGS, direct_module._AVX2_FLAGS], ids=["portable", "avx2"])
@pytest.mark.parametrize("width", WIDTHS)
def test_the_kernels_norm_is_llamas_rmsnorm_to_the_bit_where_its_sum_is_torchs(
    width: int, flags: tuple[str, ...]
) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    kernel = fresh_kernel(flags)
    g = torch.Generator().manual_seed(width)
    norm = LlamaRMSNorm(width, eps=1e-5)
    norm.weight.data = 1 + 0.1 * torch.randn(width, generator=g)
    x = torch.randn(3, 5, width, generator=g) * torch.logspace(-4, 4, 5).view(1, 5, 1)
    with torch.inference_mode():
        got = kernel.rms_norm(x, norm.weight, norm.variance_epsilon)
        if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):  # 8 lanes on both, found on hardware
            assert got is not None, f"torch's sum order at width {width} was not found (lanes {kernel._lanes})"
        if got is not None:
            assert torch.equal(got, norm(x))
            assert kernel._widths[width] is True


def test_a_sum_order_other_than_torchs_is_found_out_and_the_norm_left_to_torch() -> None:
    kernel = fresh_kernel()
    kernel._lanes = 4  # a vector width torch does not use: another order of the same sum
    x, weight = torch.randn(4, 512) * 100, torch.ones(512)
    assert kernel.sums_as_torch(x) is False
    assert kernel.rms_norm(x, weight, 1e-6) is None  # _norm then runs torch's variance and rms_scale
    kernel._lanes = None  # a CPU capability the C code does not follow: never its own sum
    kernel._widths.clear()
    assert kernel.rms_norm(x, weight, 1e-6) is None


def test_the_norm_declines_weights_it_does_not_read() -> None:
    kernel = fresh_kernel()
    x = torch.randn(2, 64)
    assert kernel.rms_norm(x, torch.ones(64, dtype=torch.float64), 1e-6) is None
    assert kernel.rms_norm(x, torch.ones(128)[::2], 1e-6) is None
    assert kernel.rms_norm(x, torch.ones(32), 1e-6) is None


def test_the_kernel_serves_only_float32_cpu_forwards_outside_autograd() -> None:
    x, cos = torch.randn(1, 2, 8), torch.randn(1, 2, 4)
    with torch.inference_mode():
        assert direct_module._kernel_for(x, cos, cos) is direct_module.load_kernel()
        assert direct_module._kernel_for(x.double(), cos, cos) is None
        assert direct_module._kernel_for(x, cos.half(), cos.half()) is None
    assert direct_module._kernel_for(x, cos, cos) is None  # grad enabled: autograd records the ops


def test_the_benchmarks_forward_log_and_counter_leave_the_direct_layers_serving() -> None:
    """A fault found measuring: their hooks sat on the model itself, so every benchmarked Engine ran the model's own
    forward. They hook the embedding, head and rotary embedding now (``forward_edges``)."""
    from pagedcore.benchmarks.common import counting
    from pagedcore.benchmarks.steps import logging_forwards

    model = tiny_llama()
    e = engine(model)
    with logging_forwards(model) as log, counting(model) as counter:
        e.generate(PROMPTS, SamplingParams(max_new_tokens=4, ignore_eos=True), use_tqdm=False)
    direct = direct_of(e)
    assert direct is not None and direct.counts.verified is True
    assert direct.counts.steps == len(log.forwards)  # every step (the checked first one's base model: no head call)
    checked = log.forwards[0].tokens  # the first step's positions, embedded by both forwards
    assert sum(f.tokens for f in log.forwards) == sum(map(len, PROMPTS)) + 3 * 3 == counter.positions - checked
    decode = [f for f in log.forwards if f.tokens == len(PROMPTS)]
    assert [f.first_position for f in decode][-2:] == [4, 5]  # the shortest prompt's last positions (the smallest)


def test_transformers_output_recorders_leave_the_direct_layers_serving() -> None:
    """A fault found reading the hooks: transformers installs its output recorders (forward hooks that record a
    layer's output while ``output_hidden_states`` / ``output_attentions`` collects, and return None) on every decoder
    layer and attention the first time anything asks for them (a value head, an embedding call), and the direct layers
    took them for a user's hook: the Engine ran the model's own, slower forward from then on. They put nothing into
    the values, so the direct layers serve past them; a hook of the user's beside them still sends the step through
    the model's forward, and a later ``output_hidden_states`` call still records every layer."""
    model = tiny_llama()
    want = reference(model, PROMPTS, 5)
    ids = torch.tensor([PROMPTS[0]])
    e = engine(model)
    e.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2), use_tqdm=False)
    with torch.no_grad():
        first = model(ids, output_hidden_states=True, output_attentions=True)
    layer = model.model.layers[0]
    assert layer._forward_hooks and layer.self_attn._forward_hooks  # transformers' recorders, installed now
    direct = direct_of(e)
    assert direct is not None
    before = direct.counts.steps
    assert tokens(e.generate(PROMPTS, SamplingParams(max_new_tokens=5, ignore_eos=True), use_tqdm=False)) == want
    assert direct.counts.steps > before  # served directly past the recorders
    with torch.no_grad():
        again = model(ids, output_hidden_states=True, output_attentions=True)
    assert len(again.hidden_states) == model.config.num_hidden_layers + 1 == len(first.hidden_states)
    assert all(torch.equal(a, b) for a, b in zip(again.hidden_states, first.hidden_states, strict=True))
    assert len(again.attentions) == model.config.num_hidden_layers
    calls: list[int] = []
    handle = model.model.layers[1].register_forward_hook(lambda *_: calls.append(1))
    try:
        before = direct.counts.steps
        assert tokens(e.generate(PROMPTS, SamplingParams(max_new_tokens=5, ignore_eos=True), use_tqdm=False)) == want
    finally:
        handle.remove()
    assert calls and direct.counts.steps == before  # a hook of the user's: the model's own forward


def checkpointing(model: Any) -> Any:
    """``model`` with gradient checkpointing on (transformers' newer name for it where there is one)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    return model


def test_a_model_training_with_gradient_checkpointing_is_served_by_the_direct_layers() -> None:
    """An RL loop keeps its policy in ``train()`` mode with gradient checkpointing on between its generations
    (dropout 0: served). transformers' checkpointing layer runs its forward as is where no gradient is recorded, as
    in every Engine forward, so the direct layers compute the same values; they had counted such a layer as one that
    checkpoints, and the Engine ran the model's own, slower forward (21.6 against 14.6 ms a step at batch 1 on the
    benchmark model)."""
    model = tiny_llama()
    want = reference(model, PROMPTS, 5)
    checkpointing(model).train()
    assert all(layer.gradient_checkpointing and layer.training for layer in model.model.layers)
    e = engine(model)
    got = tokens(e.generate(PROMPTS, SamplingParams(max_new_tokens=5, ignore_eos=True), use_tqdm=False))
    direct = direct_of(e)
    assert got == want
    assert direct is not None and direct.counts.verified is True and direct.counts.steps > 0


def test_the_training_loop_script_measures_each_change_on_the_direct_layers() -> None:
    """``scripts/training_loop_paths.py`` (docs/benchmarks.md, "Fast paths kept through a training loop") at a small
    point: its decode figures and direct steps before and after a change, and the first greedy call after updates."""
    import importlib.util
    import random
    from pathlib import Path

    from pagedcore.benchmarks.common import bench_model

    path = Path(__file__).resolve().parent.parent / "scripts" / "training_loop_paths.py"
    spec = importlib.util.spec_from_file_location("training_loop_paths", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rng, model = random.Random(0), bench_model(size="tiny")
    ms, steps = script.decode_ms(model, 2, rng, rounds=1)
    assert ms > 0 and steps > 0
    ms, steps = script.decode_ms(script.checkpointing(model).train(), 2, rng, rounds=1)
    assert ms > 0 and steps > 0 and model.training
    steady, first, then = script.first_greedy_ms(model.eval(), rng, updates=1)
    assert steady > 0 and len(first) == len(then) == 1 and min(first + then) > 0
    ms, steps = script.decode_ms(script.lora_policy(model), 2, rng, rounds=1)
    assert ms > 0 and steps > 0


def lora_model(task: str | None = "CAUSAL_LM", **config: Any) -> Any:
    """``get_peft_model`` of a tiny Llama with a LoRA on q/k/v/o whose weights are drawn (its tokens are its own)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    lora = LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False,
                      lora_dropout=0.0, task_type=task, **config)  # fmt: skip
    return get_peft_model(tiny_llama(), lora).eval()


@pytest.mark.parametrize("task", ["CAUSAL_LM", None])  # PeftModelForCausalLM, PeftModel
def test_a_peft_lora_model_is_served_by_the_direct_layers_with_its_own_tokens(task: str | None) -> None:
    """An RL loop's LoRA policy (``get_peft_model``) ran the model's own forward through PEFT's wrappers at every step.
    Its forward only calls the causal LM with the same arguments, whose injected LoRA layers the direct layers call
    as modules: they serve it, with the PEFT model's own tokens, after a training step on the adapter too; a hook on
    a wrapper sends the step through the PEFT model's forward."""
    model = lora_model(task)
    e = engine(model)
    direct = direct_of(e)
    assert direct is not None and direct._wrappers is not None
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    assert tokens(e.generate(PROMPTS, params, use_tqdm=False)) == reference(model, PROMPTS, 5)
    assert direct.counts.verified is True and direct.counts.steps > 0
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(3.0)  # the adapter trained in place
    before = direct.counts.steps
    assert tokens(e.generate(PROMPTS, params, use_tqdm=False)) == reference(model, PROMPTS, 5)
    assert direct.counts.steps > before
    calls: list[int] = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        before = direct.counts.steps
        assert tokens(e.generate(PROMPTS, params, use_tqdm=False)) == reference(model, PROMPTS, 5)
    finally:
        handle.remove()
    assert calls and direct.counts.steps == before


def test_peft_models_whose_forward_does_more_run_it() -> None:
    """Prompt learning adds virtual tokens, activated LoRA hands the layers offsets it computes from the input ids:
    their forward is not the causal LM's, so no direct layers (and other tuners than LoRA are not taken either)."""
    from peft import PromptTuningConfig, get_peft_model

    assert DirectLayers.of(lora_model(alora_invocation_tokens=[5, 9])) is None
    prompt = get_peft_model(tiny_llama(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    assert DirectLayers.of(prompt) is None
    model = lora_model()
    direct = DirectLayers.of(model)
    assert direct is not None and direct.serves()
    model.peft_config["default"].alora_invocation_tokens = [5, 9]  # made activated after the Engine was built
    assert not direct.serves()
