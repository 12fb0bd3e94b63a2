"""Encoder-decoder models (Whisper, T5, BART): the decoder's self-attention paged inside transformers'
EncoderDecoderCache, exact against stock generate; enable() keys prefixes by the encoder input as well.

Before, PagedCache refused them all, and WhisperForCausalLM given encoder outputs crashed half-way (its
cross-attention's keys reached the paged cache: "layer 1 got 14 new tokens ... reserved 46").
"""

from __future__ import annotations

import pytest
import torch
from paged_checks import assert_same_generation
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSpeechSeq2Seq,
    DynamicCache,
    EncoderDecoderCache,
)

import pagedcore.adapters.transformers as pc
from pagedcore import ConfigError, UnsupportedModelError

pytestmark = pytest.mark.usefixtures("one_thread")

FEATURES = (8, 32)  # tiny Whisper: 8 mel bins, 2 * max_source_positions frames
NEW = 6


def _whisper_config():
    return AutoConfig.for_model(
        "whisper", vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=FEATURES[0],
        max_source_positions=FEATURES[1] // 2, max_target_positions=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, init_std=0.3, suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip


def whisper():
    torch.manual_seed(0)
    return _eval(AutoModelForSpeechSeq2Seq.from_config(_whisper_config()))


def t5():
    config = AutoConfig.for_model(
        "t5", vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        pad_token_id=0, eos_token_id=2, decoder_start_token_id=0, initializer_factor=1.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return _eval(AutoModelForSeq2SeqLM.from_config(config))


def bart():
    config = AutoConfig.for_model(
        "bart", vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, init_std=0.3,
        forced_eos_token_id=None, forced_bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return _eval(AutoModelForSeq2SeqLM.from_config(config))


def _eval(model):
    model.eval()
    model.generation_config.eos_token_id = None
    return model


MODELS = {"whisper": whisper, "t5": t5, "bart": bart}


def encoder_input(name: str, seed: int) -> dict[str, torch.Tensor]:
    """A batch of two encoder inputs: audio features, or token ids with the second row left-padded."""
    generator = torch.Generator().manual_seed(seed)
    if name == "whisper":
        return {"input_features": torch.randn(2, *FEATURES, generator=generator)}
    ids = torch.randint(3, 250, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def decoder_prompt(name: str) -> torch.Tensor:
    start = 0 if name == "t5" else 1
    return torch.tensor([[start, 5, 6, 7, 11, 12, 13], [start, 8, 9, 10, 14, 15, 16]])


def run(model, name, seed=1, **kwargs):
    return model.generate(**encoder_input(name, seed), decoder_input_ids=decoder_prompt(name), max_new_tokens=NEW,
                          do_sample=False, return_dict_in_generate=True, output_logits=True, **kwargs)  # fmt: skip


@pytest.mark.parametrize("name", list(MODELS))
def test_the_decoders_self_attention_is_paged_exactly(name):
    model = MODELS[name]()
    want = run(model, name)
    paged = pc.PagedCache(model, num_blocks=64, block_size=4)
    got = run(model, name, cache=EncoderDecoderCache(paged, DynamicCache()))
    assert_same_generation(got, want)
    assert paged.memory_stats().tokens == 2 * want.cache.self_attention_cache.get_seq_length()  # as DynamicCache
    paged.release()
    assert paged.pool.kv.num_used_blocks == 0


@pytest.mark.parametrize("name", ["t5", "whisper"])
def test_beam_search_reorders_the_paged_rows(name):
    model = MODELS[name]()
    want = run(model, name, num_beams=3)
    paged = pc.PagedCache(model, num_blocks=96, block_size=4)
    assert_same_generation(run(model, name, num_beams=3, cache=EncoderDecoderCache(paged, DynamicCache())), want)
    paged.release()


@pytest.mark.parametrize("name", list(MODELS))
def test_a_bare_paged_cache_is_refused_before_any_layer_runs(name):
    model = MODELS[name]()
    paged = pc.PagedCache(model, num_blocks=64, block_size=4)
    with pytest.raises(ConfigError, match=r"EncoderDecoderCache\(PagedCache\(model\), DynamicCache\(\)\)"):
        run(model, name, cache=paged)
    assert paged.pool.kv.num_used_blocks == 0


def test_whisper_as_a_causal_lm_over_encoder_outputs():
    model = _eval(AutoModelForCausalLM.from_config(_whisper_config()))
    states = torch.randn(2, FEATURES[1] // 2, 64, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([[1, 5, 6, 7, 8], [1, 9, 10, 11, 12]])
    kwargs = {"input_ids": ids, "encoder_outputs": (states,), "max_new_tokens": NEW, "do_sample": False,
              "return_dict_in_generate": True, "output_logits": True}  # fmt: skip
    want = model.generate(**kwargs, cache=EncoderDecoderCache(DynamicCache(), DynamicCache()))
    paged = pc.PagedCache(model, num_blocks=64, block_size=4)
    assert_same_generation(model.generate(**kwargs, cache=EncoderDecoderCache(paged, DynamicCache())), want)
    with pytest.raises(ConfigError, match="EncoderDecoderCache"):  # it crashed half-way before
        model.generate(**kwargs, cache=pc.PagedCache(model, num_blocks=64, block_size=4))


@pytest.mark.parametrize("name", list(MODELS))
def test_enable_reuses_a_decoder_prefix_under_the_same_encoder_input_only(name, enabled):
    model = MODELS[name]()
    want, other = run(model, name, seed=1), run(model, name, seed=2)
    pool = enabled(model, num_blocks=64, block_size=4)

    def kept(out):  # a result carrying its paged cache (return_dict_in_generate) keeps it: give its blocks back
        paged = getattr(out.cache, "self_attention_cache", None)
        if isinstance(paged, pc.PagedCache):
            paged.release()
        return out

    assert_same_generation(kept(run(model, name, seed=1)), want)
    assert pool.num_hit_tokens == 0
    assert_same_generation(kept(run(model, name, seed=1)), want)
    hits = pool.num_hit_tokens
    assert hits == 2 * (decoder_prompt(name).shape[1] - 1)  # every decoder prompt token but the last
    assert_same_generation(kept(run(model, name, seed=2)), other)  # other audio / text: the same decoder tokens miss
    assert pool.num_hit_tokens == hits


def test_a_refused_call_counts_no_lookup(enabled):
    """A call whose reservation is refused leaves the pool's statistics as they were (its lookups were counted)."""
    from pagedcore import OutOfBlocksError

    model = bart()
    pool = enabled(model, num_blocks=8, block_size=4)
    run(model, "bart").cache.self_attention_cache.release()  # warm: the call below would hit its decoder prefix
    before = (pool.num_query_tokens, pool.num_hit_tokens, pool.kv.num_used_blocks)
    with pytest.raises(OutOfBlocksError, match="this generate call needs up to"):
        model.generate(**encoder_input("bart", 1), decoder_input_ids=decoder_prompt("bart"), max_new_tokens=40)
    assert (pool.num_query_tokens, pool.num_hit_tokens, pool.kv.num_used_blocks) == before


def test_enable_returns_a_kept_encoder_decoder_cache(enabled):
    model = bart()  # (Whisper's generate returns a cache of its own making)
    pool = enabled(model, num_blocks=64, block_size=4)
    out = run(model, "bart")
    assert isinstance(out.cache, EncoderDecoderCache)
    assert pool.kv.num_used_blocks > 0  # the kept cache holds its rows' blocks
    out.cache.self_attention_cache.release()
    assert pool.kv.num_used_blocks == 0


@pytest.mark.parametrize("name", list(MODELS))
def test_the_engine_refuses_an_encoder_decoder_model_with_the_reason(name):
    model = MODELS[name]()
    with pytest.raises(UnsupportedModelError, match="encoder-decoder model: the Engine takes decoder prompts only"):
        pc.Engine(model, num_blocks=32, block_size=4)
