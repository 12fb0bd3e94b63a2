"""What each attention variant's description says and what the pool makes of it (issue 28, part A).

The descriptions read from the configs and modules (per-layer head sizes, KV sources, MLA latents, sinks, chunks,
Llama 4's query temperature), the memory they save (``memory_stats()``, against DynamicCache's tensors), finished
chunks given back, the Engine's Llama 4 temperature, attention weights, the compiled decode step and the KV store
below the pool with each variant.
"""

from __future__ import annotations

import pytest
import torch
from paged_checks import ATOL, assert_same_generation, batch, dynamic, generate, release_and_check
from transformers import AutoConfig, AutoModelForCausalLM
from variant_models import CHUNK, WINDOW, variant_config, variant_model

from pagedcore import UnsupportedModelError
from pagedcore.adapters.transformers import Engine, ModelKVSpec, PagedCache, PagedKVPool, SamplingParams
from pagedcore.adapters.transformers import attention as attention_module
from pagedcore.adapters.transformers import compiled as compiled_module
from pagedcore.adapters.transformers.spec import LatentLayout
from pagedcore.attention_kinds import ChunkedAttention, FullAttention, SlidingWindow

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25], [5, 6, 7, 8, 30]]


def dynamic_bytes(cache) -> int:
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(t, torch.Tensor)
    )


# ---------------------------------------------------------------------------------------------- descriptions
def test_gemma4_global_layers_have_their_own_head_size_and_group():
    config = variant_config("gemma4")
    with pytest.raises(Exception, match="per-layer attribute"):
        _ = config.head_dim  # what the old spec read
    spec = ModelKVSpec.from_config(config)
    assert [(x.num_kv_heads, x.head_dim, x.v_head_dim) for x in spec.layers] == [(2, 16, 16), (2, 32, 32)] * 2
    assert spec.kinds == (SlidingWindow(WINDOW), FullAttention()) and spec.layer_groups == (0, 1, 0, 1)
    model = variant_model("gemma4")
    cache = PagedCache(model, num_blocks=16, block_size=4)
    model(torch.tensor([[5, 6, 7]]), cache=cache)
    assert [cache.pool.layer_tensors(i)[0].shape[-1] for i in range(4)] == [16, 32, 16, 32]
    release_and_check(cache)


@pytest.mark.parametrize(
    ("family", "shared"), [("gemma4_shared", {4: 2, 5: 3}), ("gemma3n", {3: 1, 4: 1, 5: 2})]
)  # fmt: skip
def test_kv_shared_layers_read_their_source_and_allocate_nothing(family, shared):
    spec = ModelKVSpec.from_config(variant_config(family))
    assert {i: x.kv_source for i, x in enumerate(spec.layers) if x.keeps == "shared"} == shared
    assert all(spec.layer_groups[i] is None and spec.read_group(i) == spec.layer_groups[s] for i, s in shared.items())
    model = variant_model(family)
    cache = PagedCache(model, num_blocks=32, block_size=4)
    out = model.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=4, do_sample=False, cache=cache)
    assert all(cache.pool.layer_tensors(i) is None for i in shared)  # no tensors, no blocks of their own
    stats = cache.pool.memory_stats()
    storing = [x for x in spec.layers if x.has_cache]
    assert stats.bytes_per_token == 4 * sum(x.num_kv_heads * (x.head_dim + x.v_head_dim) for x in storing)
    assert stats.expanded_bytes_per_token == 4 * sum(x.num_kv_heads * (x.head_dim + x.v_head_dim) for x in spec.layers)
    assert stats.savings == 1 - stats.bytes_per_token / stats.expanded_bytes_per_token > 0.3
    assert out.shape == (1, 9)
    release_and_check(cache)


def test_gemma4_k_eq_v_global_layers_keep_their_own_kv_heads():
    spec = ModelKVSpec.from_config(variant_config("gemma4_shared"))
    assert [(x.num_kv_heads, x.head_dim) for x in spec.layers[:2]] == [(2, 16), (1, 32)]


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "kimi_linear"])
def test_mla_pages_the_latent_as_one_row_and_keeps_its_memory_advantage(family):
    spec = ModelKVSpec.from_config(variant_config(family))
    assert all(x.latent == LatentLayout(16, 8, 4, 16, 16) for x in spec.layers)
    assert all((x.num_kv_heads, x.head_dim, x.v_head_dim) == (1, 16, 8) for x in spec.layers)
    model = variant_model(family)
    reference = dynamic(model)
    model.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=6, do_sample=False, cache=reference)
    cache = PagedCache(model, num_blocks=32, block_size=4)
    model.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=6, do_sample=False, cache=cache)
    latent, values = cache.pool.attention_tensors(0)
    keys, rope = cache.pool.layer_tensors(0)
    assert latent.shape[-2:] == (1, 24) and keys.data_ptr() == values.data_ptr() == latent.data_ptr()
    assert rope.data_ptr() == latent.data_ptr() + 16 * latent.element_size()  # one row: latent, then rotary key
    stats = cache.pool.memory_stats()
    # The latents, not per-head keys and values: as few bytes per token as DynamicCache's (which caches them too).
    assert stats.bytes_per_token == dynamic_bytes(reference) // reference.get_seq_length() == 2 * 24 * 4
    assert stats.expanded_bytes_per_token == 2 * 4 * (16 + 8 + 16) * 4 and stats.savings == 0.85
    assert cache.memory_stats().token_bytes == 10 * stats.bytes_per_token
    release_and_check(cache)


def test_deepseek_v3_latent_against_per_head_keys_and_values_at_real_sizes():
    spec = ModelKVSpec.from_config(AutoConfig.for_model("deepseek_v3"))  # DeepSeek-V3's own sizes
    layer = spec.layers[0]
    assert layer.latent is not None and (layer.latent.width, layer.latent.expanded_width) == (576, 40960)
    assert spec.bytes_per_token(torch.bfloat16) * 71 < spec.expanded_bytes_per_token(torch.bfloat16)


@pytest.mark.parametrize("family", ["gpt_oss", "granite_swa", "granitemoe_swa", "flint"])
def test_sinks_are_read_from_the_attention_modules(family):
    model = variant_model(family)
    assert all(x.sinks for x in ModelKVSpec.from_model(model).layers)
    config_only = ModelKVSpec.from_config(variant_config(family))
    assert not any(x.sinks for x in config_only.layers)
    PagedKVPool(variant_config(family), num_blocks=8).bind(model)  # storage is the same: a config's pool serves it


def test_llama4_chunked_layers_and_query_temperature():
    spec = ModelKVSpec.from_config(variant_config("llama4"))
    assert [x.kind for x in spec.layers] == [ChunkedAttention(CHUNK)] * 3 + [FullAttention()]
    assert [x.query_temperature for x in spec.layers] == [None] * 3 + [(0.1, 4.0)]  # the NoPE layer


@pytest.mark.parametrize(("model_type", "value"), [("gemma3_text", True), ("gemma4_text", "all")])
def test_a_bidirectional_model_is_refused(model_type, value):
    config = AutoConfig.for_model(model_type, use_bidirectional_attention=value)  # an embedding model's encoder
    with pytest.raises(UnsupportedModelError, match="bidirectionally"):
        ModelKVSpec.from_config(config)


# ---------------------------------------------------------------------------------------------- chunks
def test_finished_chunks_blocks_are_given_back():
    model = variant_model("llama4", attn_implementation="paged")
    pads = [0, 3, 9]
    ids, mask = batch(pads, 12, seed=2)
    cache = PagedCache(model, num_blocks=64, block_size=4)
    generate(model, cache, input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    chunked = next(g for g in cache.pool.kv.groups if isinstance(g.kind, ChunkedAttention))
    full = next(g for g in cache.pool.kv.groups if g.kind == FullAttention())
    # Each row holds its last query's chunk's blocks only: positions 24-30 of 31, 24-27 of 28, 16-21 of 22.
    stored = [31 - p for p in pads]
    assert chunked.block_manager.num_used_blocks == sum(-(-n // 4) - (n - 1) // CHUNK * CHUNK // 4 for n in stored) == 5
    assert full.block_manager.num_used_blocks == sum(-(-(31 - p) // 4) for p in pads)
    release_and_check(cache)


def test_the_engine_puts_llama4_query_temperature_right(monkeypatch):
    """The model scales its NoPE layers' queries by the cache's length, which a packed forward does not have: the
    Engine's tokens would be scaled as if at positions 0, 1, ... of the step."""
    model = variant_model("llama4")
    prompt = PROMPTS[2]
    want = generate(model, dynamic(model), input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    params = SamplingParams(max_new_tokens=8, return_logits=True)
    with Engine(model, num_blocks=64, block_size=4) as engine:
        out = engine.generate([prompt], params, use_tqdm=False)[0]
    assert out.token_ids == want.sequences[0, len(prompt) :].tolist()
    for got, expected in zip(out.samples[0].logits, want.logits):
        torch.testing.assert_close(got, expected[0], atol=ATOL, rtol=0)
    monkeypatch.setattr(attention_module, "retemper", lambda query, layer, positions: query)
    with Engine(model, num_blocks=64, block_size=4) as engine:
        wrong = engine.generate([prompt], params, use_tqdm=False)[0]
    assert max((a - b[0]).abs().max().item() for a, b in zip(wrong.samples[0].logits, want.logits)) > 1e-3


# ---------------------------------------------------------------------------------------------- weights, compile, store
@pytest.mark.parametrize("family", ["deepseek_v3", "gemma4_shared", "gpt_oss", "llama4"])
def test_attention_weights_of_paged_attention_equal_eager(family):
    ids, mask = batch([0, 3], 10, seed=1)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 4, "do_sample": False}
    eager = variant_model(family)
    want = generate(eager, dynamic(eager), output_attentions=True, **kwargs)
    model = variant_model(family, attn_implementation="paged")
    cache = PagedCache(model, num_blocks=64, block_size=4)
    got = generate(model, cache, output_attentions=True, **kwargs)
    assert_same_generation(got, want)
    for step, (g_layers, w_layers) in enumerate(zip(got.attentions, want.attentions)):
        for g, w in zip(g_layers, w_layers):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0, msg=lambda m, s=step: f"step {s}: {m}")
    release_and_check(cache)


COMPILED = ["deepseek_v3", "kimi_linear", "gemma4_shared", "gemma3n", "gpt_oss", "llama4"]


def compiled_against_eager(model, backend, prompts, monkeypatch) -> None:
    params = SamplingParams(max_new_tokens=10, return_logits=True)
    runs = {}
    for compiled in (False, True):
        monkeypatch.setattr(compiled_module, "BACKEND", backend)
        with Engine(model, compile=compiled, num_blocks=64, block_size=4) as engine:
            runs[compiled] = engine.generate(prompts, params, use_tqdm=False)
            assert (engine.stats().compiled_steps > 0) == compiled
    for got, want in zip(runs[True], runs[False]):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.samples[0].logits, want.samples[0].logits):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", COMPILED)
def test_the_bucketed_decode_step_equals_the_eager_engine(family, monkeypatch):
    """The compiled decode function's arithmetic, run uncompiled: shared layers, latents, sinks, chunks, temperature."""
    compiled_against_eager(variant_model(family), None, PROMPTS, monkeypatch)


@pytest.mark.parametrize(
    "family", [f if f == "deepseek_v3" else pytest.param(f, marks=pytest.mark.slow) for f in COMPILED]
)
def test_one_captured_decode_graph_equals_the_eager_engine(family, monkeypatch):
    """dynamo's ``eager`` backend captures the whole decode forward as one graph (an MLA layer's latents stored by
    its cache's ``update`` inside it); seconds per family, so the others are ``slow``."""
    compiled_against_eager(variant_model(family), "eager", PROMPTS[:1], monkeypatch)


@pytest.mark.parametrize("family", ["deepseek_v3", "gemma4_shared", "llama4"])
def test_a_restarted_engine_loads_the_variants_blocks_from_the_store(family, tmp_path):
    prompt = list(range(5, 46))  # 41 tokens: 10 full blocks
    model = variant_model(family)
    want = generate(model, dynamic(model), input_ids=torch.tensor([prompt]), max_new_tokens=4, do_sample=False)
    expected = want.sequences[0, len(prompt) :].tolist()

    def run(model):
        with Engine(model, num_blocks=64, block_size=4, kv_store=tmp_path, kv_store_bytes="16MiB") as engine:
            out = engine.generate([prompt], max_new_tokens=4, do_sample=False, use_tqdm=False)[0]
            return out.token_ids, engine.stats()

    assert run(model)[0] == expected
    tokens, stats = run(variant_model(family))  # a restart: the same weights, an empty pool
    assert tokens == expected and stats.kv_store_loaded_tokens > 0 and stats.prefix_hit_tokens > 0


def test_a_kv_sharing_models_cache_without_its_forward_hook_gathers_for_the_shared_layers():
    """A cache made from the config has no forward pre-hook to hand the shared layers the paged context: their
    source's ``update`` then returns its gathered keys, which they attend over (it once returned the new tokens'
    only, and the shared layers attended over those)."""
    ids, mask = batch([0, 0], 9, seed=4)  # no padding: such a cache then attends over the pool
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 6, "do_sample": False}
    eager = variant_model("gemma4_shared")
    want = generate(eager, dynamic(eager), **kwargs)
    model = variant_model("gemma4_shared", attn_implementation="paged")
    cache = PagedCache(model.config, num_blocks=64, block_size=4)
    assert_same_generation(generate(model, cache, **kwargs), want)
    release_and_check(cache)


class _Wrapped(torch.nn.Module):
    """A kv_b_proj behind another module, as PEFT's or a quantizer's wrappers put it."""

    def __init__(self, inner: torch.nn.Linear, bias: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.extra = torch.nn.Parameter(torch.full((inner.out_features,), 0.5)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        return out if self.extra is None else out + self.extra


def test_a_wrapped_up_projection_is_absorbed_exactly_and_a_biased_one_refused():
    eager = variant_model("deepseek_v3")
    ids, mask = batch([0, 2], 9, seed=5)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 6, "do_sample": False}
    want = generate(eager, dynamic(eager), **kwargs)
    model = variant_model("deepseek_v3", attn_implementation="paged")
    for layer in model.model.layers:
        layer.self_attn.kv_b_proj = _Wrapped(layer.self_attn.kv_b_proj)
    cache = PagedCache(model, num_blocks=64, block_size=4)
    assert_same_generation(generate(model, cache, **kwargs), want)  # the map probed once per weights version
    release_and_check(cache)
    with torch.no_grad():  # an update of the wrapped weights: probed again
        for a, b in zip(eager.model.layers, model.model.layers):
            a.self_attn.kv_b_proj.weight.mul_(1.5)
            b.self_attn.kv_b_proj.inner.weight.mul_(1.5)
    cache = PagedCache(model, num_blocks=64, block_size=4)
    assert_same_generation(generate(model, cache, **kwargs), generate(eager, dynamic(eager), **kwargs))
    release_and_check(cache)
    biased = variant_model("deepseek_v3")
    biased.model.layers[1].self_attn.kv_b_proj = _Wrapped(biased.model.layers[1].self_attn.kv_b_proj, bias=True)
    with pytest.raises(UnsupportedModelError, match=r"layer 1 .*bias"):
        Engine(biased, num_blocks=16, block_size=4)
    assert biased.config._attn_implementation == "eager"  # refused before anything changed


_MLA_FAMILIES = {
    "minicpm3": {},
    "glm4_moe_lite": {"moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
                      "topk_group": 1, "first_k_dense_replace": 1},
    "youtu": {},
    "axk1": {"moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
             "topk_group": 1, "first_k_dense_replace": 1},
    "sarvam_mla": {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
                   "topk_group": 1, "first_k_dense_replace": 1},
}  # fmt: skip


@pytest.mark.parametrize(
    "model_type",
    [t if t in ("minicpm3", "glm4_moe_lite") else pytest.param(t, marks=pytest.mark.slow) for t in _MLA_FAMILIES],
)
def test_other_mla_families_are_exact_with_paged_attention(model_type):
    """The latent attention is checked against each module's own expand_kv (verify_latent), so MLA families beyond
    DeepSeek's are served exactly too."""
    fields = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 32,
              "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "initializer_range": 0.3,
              "max_position_embeddings": 512, "tie_word_embeddings": False, **_MLA_FAMILIES[model_type]}  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields), attn_implementation="eager")
    model.eval()
    model.generation_config.eos_token_id = None
    ids, mask = batch([0, 3], 12, seed=6)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    want = generate(model, dynamic(model), **kwargs)
    model.set_attn_implementation("paged")
    cache = PagedCache(model, num_blocks=64, block_size=4)
    assert_same_generation(generate(model, cache, **kwargs), want)
    release_and_check(cache)
    model.set_attn_implementation("eager")
    with Engine(model, num_blocks=64, block_size=4, max_num_batched_tokens=8) as engine:
        out = engine.generate([ids[0].tolist()], SamplingParams(max_new_tokens=8), use_tqdm=False)[0]
    assert out.token_ids == want.sequences[0, 12:].tolist()


def test_an_mla_module_whose_expansion_differs_is_refused():
    model = variant_model("deepseek_v3")
    attention = model.model.layers[0].self_attn
    original = attention.expand_kv
    attention.expand_kv = lambda latent, rope: original(latent * 2, rope)  # not what its kv_b_proj stands for
    with pytest.raises(UnsupportedModelError, match="expand_kv does not compute"):
        Engine(model, num_blocks=16, block_size=4)
