"""The direct layers' decode step as one C call (``pagedcore/adapters/transformers/decode_tape.py``): stock tokens and
logits to the bit with the tape running, for each family it takes; a weight replaced, a training step, or a hooked
layer between steps seen; its first step checked; its SiLU torch's bits."""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import tiny_model
from test_direct_layers import trained_norms
from test_weights_engine import sgd_step, workload

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers import decode_tape as tape_module
from pagedcore.adapters.transformers.decode_tape import Tapes
from pagedcore.adapters.transformers.linear_routes import PLAIN
from pagedcore.adapters.transformers.row_kernel import BLAS, RowKernel
from pagedcore.adapters.transformers.row_kernel import load as load_row_kernel
from pagedcore.plugins.decode_kernel import load as load_decode_kernel

TAPE = tape_module.load()
needs_tape = pytest.mark.skipif(
    TAPE is None or load_row_kernel() is None or load_decode_kernel() is None,
    reason="no C compiler, no AVX2 or no Sleef exp in this torch",
)
GREEDY = SamplingParams(max_new_tokens=24, return_logits=True, ignore_eos=True)


def model_of(family: str, seed: int) -> Any:
    return trained_norms(tiny_model(family, seed=seed, hidden_size=128, intermediate_size=256), seed)


def mirror(model: Any) -> Any:
    """A second tiny model of ``model``'s family and sizes holding its weights as they are now (the reference)."""
    config = model.config
    ref = tiny_model(config.model_type, seed=99, hidden_size=config.hidden_size,
                     intermediate_size=config.intermediate_size)  # fmt: skip
    ref.load_state_dict(model.state_dict())
    return ref


def assert_stock(ref: Any, prompts: list[list[int]], outputs: Any) -> None:
    """transformers' greedy tokens (DynamicCache, no EOS stop), logits within float32 noise (another kernel's sums)."""
    new = GREEDY.max_new_tokens
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.error is None, out.error
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                            return_dict_in_generate=True, output_logits=True)  # fmt: skip
        assert out.token_ids == want.sequences[0, len(prompt) :].tolist()
        for got, logits in zip(out.samples[0].logits, want.logits, strict=True):
            torch.testing.assert_close(got, logits[0].float(), atol=1e-3, rtol=0)


def tapes_of(engine: Engine) -> Tapes:
    direct = engine.runner._direct
    assert direct is not None and isinstance(direct.tapes, Tapes)
    return direct.tapes


@needs_tape
@pytest.mark.parametrize(
    ("family", "seqs"), [("llama", 1), ("llama", 3), ("llama", 8), ("mistral", 4), ("qwen2", 4), ("qwen3", 4)]
)
def test_decode_steps_run_on_the_tape_with_stock_tokens_and_logits(family, seqs, two_threads, kernel_wins):
    model = model_of(family, 31 + seqs)
    ref, python = mirror(model), mirror(model)
    prompts = [[3 + (7 * i + j) % 90 for j in range(5 + 3 * i)] for i in range(seqs)]
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=seqs) as engine:
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
        tapes = tapes_of(engine)
    with Engine(python, num_blocks=256, block_size=4, max_num_seqs=seqs) as engine:
        direct = engine.runner._direct
        assert direct is not None
        direct.tapes = False  # the direct layers' Python: the bits to match
        theirs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert tapes.runs > 3 and not tapes.off  # checked at its first step, then run
    for mine, own in zip(outputs, theirs, strict=True):
        assert mine.token_ids == own.token_ids
        for a, b in zip(mine.samples[0].logits, own.samples[0].logits, strict=True):
            assert torch.equal(a, b)
    assert_stock(ref, prompts, outputs)


@pytest.fixture
def plain_wins(monkeypatch: pytest.MonkeyPatch, trial_clock: list[float]) -> None:
    """The trials' clock made to find every timed kernel call slower than ``F.linear``: the layers settle on it."""
    real = RowKernel.linear

    def slow(self: RowKernel, x: torch.Tensor, weight: torch.Tensor, bias: Any, order: Any, threads: int) -> Any:
        trial_clock[0] += 0.75
        return real(self, x, weight, bias, order, threads)

    monkeypatch.setattr(RowKernel, "linear", slow)


@needs_tape
def test_layers_whose_trials_chose_f_linear_are_on_the_tape_through_the_blas_call(two_threads, plain_wins):
    """Layers settled on F.linear (on a Xeon with AVX-512 MKL streams a weight 2-2.5x faster than the kernel) are on
    the tape through the BLAS's own sgemm, called from C as F.linear calls it: the tape runs and the bits are the
    Python layers'."""
    model = model_of("llama", 81)
    ref, python = mirror(model), mirror(model)
    prompts = workload(81, 3)
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=3) as engine:
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
        tapes = tapes_of(engine)
        forward = model.model.layers[0].self_attn.k_proj.__dict__["forward"]
        routes = [forward.route(torch.empty(1, rows, 128)) for rows in (1, 2, 3)]
    with Engine(python, num_blocks=256, block_size=4, max_num_seqs=3) as engine:
        direct = engine.runner._direct
        assert direct is not None
        direct.tapes = False
        theirs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert PLAIN in routes  # the layers' own way: F.linear
    assert tapes.runs > 3 and not tapes.off
    if load_row_kernel().blas:  # type: ignore[union-attr]
        heads = {linear.check.c_call()[1][5] for tape in tapes._tapes.values() if tape for linear in tape.linears}
        assert heads == {BLAS.head}  # every linear on the tape: the BLAS's call
    for mine, own in zip(outputs, theirs, strict=True):
        for a, b in zip(mine.samples[0].logits, own.samples[0].logits, strict=True):
            assert torch.equal(a, b)
    assert_stock(ref, prompts, outputs)


@needs_tape
def test_a_training_step_and_a_replaced_weight_between_steps_are_seen(two_threads, kernel_wins):
    model = model_of("llama", 41)
    first, second, third = workload(41, 4), workload(42, 4), workload(43, 4)
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=4) as engine:
        engine.generate(first, GREEDY, use_tqdm=False)
        runs = tapes_of(engine).runs
        assert runs > 0
        sgd_step(model, first)  # in place: the tape reads the new values
        ref = mirror(model)
        assert_stock(ref, second, engine.generate(second, GREEDY, use_tqdm=False))
        assert tapes_of(engine).runs > runs
        layer = model.model.layers[1].mlp.down_proj
        with torch.no_grad():
            layer.weight = torch.nn.Parameter(layer.weight * 0.5)  # another tensor: its route and the tape go
        ref = mirror(model)
        assert_stock(ref, third, engine.generate(third, GREEDY, use_tqdm=False))


@needs_tape
def test_a_value_heads_output_hidden_states_call_leaves_the_tape_running(two_threads, kernel_wins):
    """RL with a value head (TRL's ``AutoModelForCausalLMWithValueHead`` asks the policy for its hidden states):
    that call installs transformers' output recorders on every decoder layer, which turned the direct layers and
    with them the tape off for good (``direct_layers._plain``)."""
    model = model_of("llama", 44)
    first, second = workload(44, 4), workload(45, 4)
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=4) as engine:
        engine.generate(first, GREEDY, use_tqdm=False)
        runs = tapes_of(engine).runs
        with torch.no_grad():
            hidden = model(torch.tensor([first[0]]), output_hidden_states=True).hidden_states
        assert len(hidden) == model.config.num_hidden_layers + 1
        assert_stock(mirror(model), second, engine.generate(second, GREEDY, use_tqdm=False))
        assert tapes_of(engine).runs > runs


@needs_tape
def test_a_weight_read_another_way_at_the_same_address_no_longer_holds(two_threads, kernel_wins):
    """``.data`` swapped for a transposed view of the same memory: the same tensor and data pointer, which the tape
    would read as before; its check sees the layout, as the layer's route's does. (The Engine as a whole does not
    follow writes through ``.data``: the prepacked copies of prefill's weights are not refreshed, docs/limits.md.)"""
    model = model_of("llama", 45)
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=1) as engine:
        engine.generate([[3, 4, 5, 6, 7]], GREEDY, use_tqdm=False)
        tape = next(tape for tape in tapes_of(engine)._tapes.values() if tape is not None)
        square = model.model.layers[0].self_attn.q_proj
        (linear,) = [linear for linear in tape.linears if linear.module is square]
        assert linear.holds() and tape_module._calls_hold(tape, layers_of(model))
        pointer = square.weight.data_ptr()
        square.weight.data = square.weight.data.t()
        assert square.weight.data_ptr() == pointer
        assert not linear.holds() and not tape_module._calls_hold(tape, layers_of(model))
        square.weight.data = square.weight.data.t()
        assert linear.holds()
        square.weight.data = square.weight.data.clone()  # another address
        assert not linear.holds()


@needs_tape
def test_another_thread_count_or_a_dispatch_mode_no_longer_holds(two_threads, kernel_wins):
    """Each linear's route serves the thread count it was made for, and no dispatch mode may record the ops: the tape
    checks both once for all its linears (``_calls_hold``), each linear only its weights. At another thread count the
    tape does not hold; back at its own it does; steps at another count give stock tokens."""
    model = model_of("llama", 47)
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=1) as engine:
        engine.generate([[3, 4, 5, 6, 7]], GREEDY, use_tqdm=False)
        tape = next(tape for tape in tapes_of(engine)._tapes.values() if tape is not None)
        assert tape.threads == 2 and tape_module._calls_hold(tape, layers_of(model))
        assert all(linear.holds() for linear in tape.linears)  # the weights' part alone
        torch.set_num_threads(1)
        assert not tape_module._calls_hold(tape, layers_of(model))
        torch.set_num_threads(2)
        assert tape_module._calls_hold(tape, layers_of(model))
        with torch.utils._python_dispatch.TorchDispatchMode():  # e.g. a FLOP counter recording the ops
            assert not tape_module._calls_hold(tape, layers_of(model))
        torch.set_num_threads(1)  # steps at one thread: the tape dropped, the layers' routes made again
        prompts = workload(47, 1)
        assert_stock(mirror(model), prompts, engine.generate(prompts, GREEDY, use_tqdm=False))


def layers_of(model: Any) -> list[Any]:
    """The decoder layers the base model runs now (what the direct layers hand the tapes)."""
    return list(model.model.layers)[: model.config.num_hidden_layers]


def assert_model_tokens(model: Any, prompts: list[list[int]], outputs: Any) -> None:
    """The greedy tokens of ``model``'s own forward (as it is now, its modules included)."""
    new = GREEDY.max_new_tokens
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.error is None, out.error
        want = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
        assert out.token_ids == want[0, len(prompt) :].tolist()


def scaled_layer(model: Any, index: int) -> Any:
    """A new decoder layer of ``model``'s class holding layer ``index``'s weights halved (eval mode)."""
    layer = model.model.layers[index]
    new = type(layer)(model.config, layer_idx=index)
    new.load_state_dict({name: value * 0.5 for name, value in layer.state_dict().items()})
    return new.eval()


@needs_tape
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: its query and key head norms on the tape too
def test_a_peft_adapter_injected_after_the_tape_was_written_is_computed(family, two_threads, kernel_wins):
    """Regression: the tape checked each linear it calls (hooks, weights, route) but not that the model still calls
    it. PEFT's injection wraps ``q_proj`` and ``down_proj`` (the old linears become the wrappers' ``base_layer``):
    the tape went on running the bare linears, and from the fourth token on the Engine's tokens were the base
    model's, not the adapted model's (an RL loop that adds LoRA to a model it already serves)."""
    peft = pytest.importorskip("peft")
    model = model_of(family, 61)
    prompts = workload(61, 2)
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=2) as engine:
        engine.generate(prompts, GREEDY, use_tqdm=False)
        assert tapes_of(engine).runs > 0
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
        peft.inject_adapter_in_model(config, model).eval()
        assert_model_tokens(model, prompts, engine.generate(prompts, GREEDY, use_tqdm=False))


@needs_tape
@pytest.mark.parametrize("how", ["assigned", "inserted", "inserted, the old one kept"])
def test_a_decoder_layer_replaced_after_the_tape_was_written_is_computed(how, two_threads, kernel_wins):
    """Regression: ``layers[1] = new`` (a registration) and ``layers.insert(1, new); del layers[2]`` (none: torch's
    containers edit their dict) left the tape running the old layer, which it also kept alive (so the weights watch
    saw no tensor go: the prefix cache served keys of the old layer). The tape now holds its modules weakly and checks
    each step that the model's layers and their submodules are the ones it was written from; the watch compares the
    layer list's children (the old layer may live on: a caller's reference)."""
    model = model_of("llama", 62)
    prompts = workload(62, 2)
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=2) as engine:
        engine.generate(prompts, GREEDY, use_tqdm=False)
        assert tapes_of(engine).runs > 0
        old, new = model.model.layers[1], scaled_layer(model, 1)
        if how == "assigned":
            model.model.layers[1] = new
        else:
            model.model.layers.insert(1, new)
            del model.model.layers[2]
        gone = weakref.ref(old)
        kept = [old] if "kept" in how else []  # a caller's reference: the watch sees the list's children change
        del old
        gc.collect()
        assert (gone() is None) != bool(kept)  # nothing of the Engine keeps the replaced layer
        assert_model_tokens(model, prompts, engine.generate(prompts, GREEDY, use_tqdm=False))


@needs_tape
def test_an_attentions_scaling_set_after_the_tape_was_written_is_read_again(two_threads, kernel_wins):
    """Regression: the tape took each attention's ``scaling`` as a number when it was written and did not check it
    again, so after ``self_attn.scaling = ...`` (an attention temperature set between steps) its decode steps
    computed with the old scale while the prompt's steps used the new one: other tokens from the second on, on new
    prompts too (no prefix of theirs cached). The tape now checks each step the attention settings it took."""
    model = model_of("llama", 63)
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=2) as engine:
        engine.generate(workload(63, 2), GREEDY, use_tqdm=False)
        assert tapes_of(engine).runs > 0
        for layer in layers_of(model):
            layer.self_attn.scaling = layer.self_attn.scaling * 1.5
        prompts = workload(64, 2)
        runs = tapes_of(engine).runs
        assert_model_tokens(model, prompts, engine.generate(prompts, GREEDY, use_tqdm=False))
        assert tapes_of(engine).runs > runs  # written again with the new scale


def _resized(model: Any) -> None:
    model.resize_token_embeddings(model.config.vocab_size + 64)
    model.lm_head.weight[-64:].normal_(0, 1.0)  # new tokens the head may choose


def _parametrized(model: Any) -> None:
    import torch.nn.utils.parametrize as parametrize

    class Scaled(torch.nn.Module):
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return weight * 1.5

    parametrize.register_parametrization(model.model.layers[0].self_attn.q_proj, "weight", Scaled())


def _pruned(model: Any) -> None:
    from torch.nn.utils import prune

    prune.l1_unstructured(model.model.layers[0].mlp.down_proj, "weight", amount=0.5)


def _tied(model: Any) -> None:
    model.lm_head.weight = model.model.embed_tokens.weight


def _bias_added(model: Any) -> None:
    o_proj = model.model.layers[1].self_attn.o_proj
    o_proj.bias = torch.nn.Parameter(torch.randn(o_proj.out_features))


def _rotary_replaced(model: Any) -> None:
    rotary = model.model.rotary_emb
    rotary.register_buffer("inv_freq", rotary.inv_freq * 0.5, persistent=False)


def _weight_replaced(model: Any) -> None:
    up = model.model.layers[1].mlp.up_proj
    up.weight = torch.nn.Parameter(up.weight.detach() * 2)


def _norm_replaced(model: Any) -> None:
    norm = model.model.layers[0].post_attention_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach() * 3)


def _embedding_scaled(model: Any) -> None:
    model.model.embed_tokens.weight.mul_(2)


SEEN = {
    "resize_token_embeddings": _resized,
    "a parametrization": _parametrized,
    "pruning": _pruned,
    "the head tied": _tied,
    "a bias added": _bias_added,
    "rotary frequencies replaced": _rotary_replaced,
    "a weight replaced": _weight_replaced,
    "a norm's weight replaced": _norm_replaced,
    "the embedding in place": _embedding_scaled,
}


@needs_tape
@pytest.mark.parametrize("change", sorted(SEEN))
def test_changes_made_between_steps_are_computed(change, two_threads, kernel_wins):
    """What a training or tooling loop may do to a model the Engine serves, between two calls on the same prompts
    (their prefixes cached, the tape written): the second call's tokens are the model's own as it is then. (In-place
    writes into a rotary ``inv_freq`` are not seen: docs/limits.md.)"""
    model = model_of("llama", 65)
    prompts = workload(65, 2)
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=2) as engine:
        engine.generate(prompts, GREEDY, use_tqdm=False)
        assert tapes_of(engine).runs > 0
        with torch.no_grad():
            SEEN[change](model)
        assert_model_tokens(model, prompts, engine.generate(prompts, GREEDY, use_tqdm=False))


@needs_tape
def test_a_sleeping_pool_frees_its_tensors_though_a_tape_read_them(two_threads, kernel_wins):
    """Regression: the tapes held each layer's key and value caches, so ``pool.sleep()`` (an RL loop giving the
    memory back to a training step) dropped the pool's references and freed nothing. The tape holds them weakly
    now; after the pool wakes (new tensors), the tape is stale and written again, and the tokens are stock."""
    model = model_of("llama", 63)
    prompts = workload(63, 2)
    ref = mirror(model)
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=2) as engine:
        engine.generate(prompts, GREEDY, use_tqdm=False)
        assert tapes_of(engine).runs > 0
        keys = weakref.ref(engine.pool.layer_tensors(0)[0])
        assert engine.pool.sleep() > 0
        gc.collect()
        assert keys() is None
        runs = tapes_of(engine).runs
        assert_stock(ref, prompts, engine.generate(prompts, GREEDY, use_tqdm=False))
        assert tapes_of(engine).runs > runs  # written again over the new tensors


@needs_tape
def test_a_hooked_linear_is_called_as_a_module_and_the_tape_waits(two_threads, kernel_wins):
    model = model_of("llama", 51)
    prompts = workload(51, 3)
    ref = mirror(model)
    calls = []
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=3) as engine:
        engine.generate(prompts, GREEDY, use_tqdm=False)
        runs = tapes_of(engine).runs
        handle = model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda *_: calls.append(1))
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
        assert tapes_of(engine).runs == runs  # every step ran the Python layers, which call the hooked module
        handle.remove()
        engine.generate(prompts, GREEDY, use_tqdm=False)
        assert tapes_of(engine).runs > runs
    assert_stock(ref, prompts, outputs)
    assert len(calls) >= GREEDY.max_new_tokens


@needs_tape
def test_a_first_step_that_differs_turns_the_tape_off_with_a_warning_and_keeps_stock_tokens(
    two_threads, kernel_wins, monkeypatch, caplog
):
    model = model_of("llama", 61)
    prompts = workload(61, 2)
    ref = mirror(model)
    monkeypatch.setattr(tape_module, "same_bits", lambda a, b: False)
    with caplog.at_level(logging.WARNING, logger="pagedcore"), Engine(model, num_blocks=256, block_size=4) as engine:
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
        tapes = tapes_of(engine)
    assert_stock(ref, prompts, outputs)
    assert tapes.off and tapes.runs == 0
    assert "decode tape gave other hidden states" in caplog.text


@needs_tape
@pytest.mark.parametrize("seqs", [1, 3])
def test_a_tape_is_checked_in_the_step_that_writes_it(seqs, two_threads, kernel_wins, monkeypatch):
    """Every forward either runs a tape or the Python layers, never both: the tape's check runs it right after the
    step whose calls wrote it (a row count met a few steps a run would otherwise pay a double step a run later)."""
    from pagedcore.adapters.transformers import direct_layers

    calls = {"forwards": 0, "python": 0}
    hidden, layers = direct_layers.DirectLayers._hidden, direct_layers.DirectLayers.layers_hidden

    def counted_hidden(self: Any, *args: Any) -> Any:
        calls["forwards"] += 1
        return hidden(self, *args)

    def counted_layers(self: Any, *args: Any) -> Any:
        calls["python"] += 1
        return layers(self, *args)

    monkeypatch.setattr(direct_layers.DirectLayers, "_hidden", counted_hidden)
    monkeypatch.setattr(direct_layers.DirectLayers, "layers_hidden", counted_layers)
    model = model_of("llama", 91)
    ref, prompts = mirror(model), workload(91, seqs)
    with Engine(model, num_blocks=256, block_size=4, max_num_seqs=seqs) as engine:
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
        tapes = tapes_of(engine)
    assert tapes.runs > 10 and not tapes.off
    assert all(tape.verified for tape in tapes._tapes.values() if tape is not None)
    assert calls["python"] == calls["forwards"] - tapes.runs
    assert_stock(ref, prompts, outputs)


@needs_tape
def test_a_tape_found_wrong_where_it_is_written_leaves_the_python_layers_keys_and_values(
    two_threads, kernel_wins, monkeypatch, caplog
):
    """A tape whose norms' epsilon and attention scale are not the model's: checked in the step that wrote it, where
    it has already written that step's keys and values; the Python layers write them again, so every later token
    and logit is still transformers'."""
    model = model_of("llama", 93)
    ref, prompts = mirror(model), workload(93, 2)
    bits = tape_module._bits
    monkeypatch.setattr(tape_module, "_bits", lambda value: bits(value * 1e6))
    with caplog.at_level(logging.WARNING, logger="pagedcore"), Engine(model, num_blocks=256, block_size=4) as engine:
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
        tapes = tapes_of(engine)
    assert tapes.off and tapes.runs == 0
    assert "decode tape gave other hidden states" in caplog.text
    assert_stock(ref, prompts, outputs)


@needs_tape
def test_a_silu_whose_bits_are_not_torchs_leaves_the_row_count_untaped(two_threads, kernel_wins, monkeypatch):
    assert TAPE is not None
    monkeypatch.setattr(TAPE, "_widths", {256: False})
    model = model_of("llama", 71)
    prompts = workload(71, 2)
    ref = mirror(model)
    with Engine(model, num_blocks=256, block_size=4) as engine:
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
        tapes = tapes_of(engine)
    assert_stock(ref, prompts, outputs)
    assert tapes.runs == 0 and len(tapes) == 0


@needs_tape
@pytest.mark.parametrize(
    ("rows", "width"),
    [(1, 1), (1, 7), (1, 15), (2, 16), (1, 17), (3, 100), (4, 256), (5, 1536), (1, 1537), (3, 11008), (8, 4099),
     (7, 5003)],
)  # fmt: skip
def test_the_tapes_silu_times_up_is_torchs_to_the_bit(rows, width, two_threads):
    """Over torch's grain size (32768 elements) its two threads' parts each end in a scalar tail: so do the tape's."""
    assert TAPE is not None
    generator = torch.Generator().manual_seed(width)
    gate = torch.randn(rows, width, generator=generator) * torch.logspace(-4, 3, rows).unsqueeze(1)
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), -104.0, 89.0, 0.0, -0.0])
    gate.view(-1)[::13] = specials[torch.arange(gate.view(-1)[::13].numel()) % 7]
    up = torch.randn(rows, width, generator=generator)
    got, want = TAPE.silu_mul(gate, up), F.silu(gate) * up
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert TAPE.silu_as_torch(width)


@needs_tape
def test_without_torchs_parts_the_scalar_tails_would_differ(two_threads, monkeypatch):
    """The case the parts are for: one loop over 8 x 4099 elements puts other elements in the vector loop than
    torch's two parts do, and Sleef's exp and libm's differ in the last bit for some of them."""
    assert TAPE is not None
    gate, up = torch.randn(8, 4099, generator=torch.Generator().manual_seed(5)) * 3, torch.ones(8, 4099)
    gate.view(-1)[16384:16396] = -29.389972686767578  # the first part's scalar tail: an exp the two round apart
    want = F.silu(gate) * up
    assert torch.equal(TAPE.silu_mul(gate, up), want)
    monkeypatch.setattr(tape_module, "silu_chunk", lambda n, threads: n)
    assert not torch.equal(TAPE.silu_mul(gate, up), want)


def test_the_switch_turns_the_tape_off(monkeypatch):
    monkeypatch.setenv(tape_module.ENV, "0")
    assert tape_module._build() is None
