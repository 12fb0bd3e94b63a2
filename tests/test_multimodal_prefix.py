"""enable() on a model with multimodal RoPE (Qwen2-VL: 3-D position ids): prefix hits for text prompts, and for
image prompts keyed by the image's content; every call exact against stock generate.

Before, no call ever hit (the cache took the 3-D positions for unknown positions and cached nothing). Keying is by
content: a prompt with another image at the same placeholders reuses only the text before it.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, Qwen2VLForConditionalGeneration

pytestmark = pytest.mark.usefixtures("one_thread")

IMAGE, VIDEO, START, END = 250, 251, 252, 253
NEW = 5


def tiny_qwen2_vl() -> Qwen2VLForConditionalGeneration:
    text = {
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "initializer_range": 0.3,
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    }  # fmt: skip
    vision = {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2, "patch_size": 4,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}  # fmt: skip
    config = AutoConfig.for_model(
        "qwen2_vl", text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
        vision_start_token_id=START, vision_end_token_id=END, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def image_prompt(text_after: list[int], seed: int) -> tuple[torch.Tensor, dict]:
    """A prompt with one 4x4-patch image (4 placeholders after merging), and its image inputs."""
    ids = torch.tensor([[10, 11, START] + [IMAGE] * 4 + [END] + text_after])
    pixels = torch.randn(16, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(seed))
    return ids, {
        "pixel_values": pixels,
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        "mm_token_type_ids": (ids == IMAGE).long(),
    }


@pytest.fixture
def model():
    return tiny_qwen2_vl()


def stock(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=NEW, do_sample=False, **kwargs)


def test_text_prompts_hit(model, enabled):
    prompt = torch.tensor([list(range(10, 40))])
    want = stock(model, prompt)
    pool = enabled(model, num_blocks=64, block_size=4)
    assert torch.equal(model.generate(prompt, max_new_tokens=NEW, do_sample=False), want)
    assert torch.equal(model.generate(prompt, max_new_tokens=NEW, do_sample=False), want)
    assert pool.num_hit_tokens == 29  # all but the last prompt token


def test_image_prompts_hit_their_own_image_only(model, enabled):
    ids, cat = image_prompt(list(range(20, 30)), seed=1)
    _, dog = image_prompt(list(range(20, 30)), seed=2)
    want_cat, want_dog = stock(model, ids, **cat), stock(model, ids, **dog)
    assert not torch.equal(want_cat, want_dog)
    pool = enabled(model, num_blocks=64, block_size=4)
    assert torch.equal(model.generate(ids, max_new_tokens=NEW, do_sample=False, **cat), want_cat)
    assert torch.equal(model.generate(ids, max_new_tokens=NEW, do_sample=False, **cat), want_cat)
    assert pool.num_hit_tokens == ids.shape[1] - 1  # the image and the text after it, from the cache
    assert torch.equal(model.generate(ids, max_new_tokens=NEW, do_sample=False, **dog), want_dog)
    assert pool.num_hit_tokens == ids.shape[1] - 1 + 3  # another image: only the text before it


def test_a_longer_prompt_with_the_same_image_continues_its_prefix(model, enabled):
    ids, cat = image_prompt(list(range(20, 30)), seed=1)
    longer = torch.cat([ids, torch.tensor([[60, 61, 62, 63, 64, 65]])], dim=1)
    more = {**cat, "mm_token_type_ids": (longer == IMAGE).long()}
    want = stock(model, longer, **more)
    pool = enabled(model, num_blocks=64, block_size=4)
    model.generate(ids, max_new_tokens=NEW, do_sample=False, **cat)
    assert torch.equal(model.generate(longer, max_new_tokens=NEW, do_sample=False, **more), want)
    assert pool.num_hit_tokens >= ids.shape[1] - 1


def test_a_text_prompt_after_an_image_call_is_placed_by_its_own_positions(model, enabled):
    # Qwen2-VL keeps the last call's rope_deltas and, when the cache already holds tokens, places new ones by them:
    # after an image call they are the image prompt's. A prefix hit must not inherit them.
    text = torch.tensor([list(range(10, 40))])
    longer = torch.tensor([[*range(10, 40), 41, 42]])
    want = stock(model, longer)
    ids, cat = image_prompt(list(range(20, 30)), seed=1)
    pool = enabled(model, num_blocks=64, block_size=4)
    model.generate(text, max_new_tokens=NEW, do_sample=False)
    model.generate(ids, max_new_tokens=NEW, do_sample=False, **cat)
    assert torch.equal(model.generate(longer, max_new_tokens=NEW, do_sample=False), want)
    assert pool.num_hit_tokens >= 29


def test_a_left_padded_batch_of_two_images(model, enabled):
    ids, cat = image_prompt(list(range(20, 30)), seed=1)
    other, dog = image_prompt(list(range(20, 32)), seed=2)
    batch = torch.tensor([[0, 0, *ids[0].tolist()], other[0].tolist()])
    mask = (batch != 0).long()
    kwargs = {
        "attention_mask": mask,
        "pixel_values": torch.cat([cat["pixel_values"], dog["pixel_values"]]),
        "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4]]),
        "mm_token_type_ids": (batch == IMAGE).long(),
    }
    want = stock(model, batch, **kwargs)
    pool = enabled(model, num_blocks=64, block_size=4)
    assert torch.equal(model.generate(batch, max_new_tokens=NEW, do_sample=False, **kwargs), want)
    assert torch.equal(model.generate(batch, max_new_tokens=NEW, do_sample=False, **kwargs), want)
    assert pool.num_hit_tokens > 2 * 8  # both rows took their image from the cache


def test_keys_name_the_content_at_the_placeholders(model):
    ids, cat = image_prompt([20, 21], seed=1)
    _, dog = image_prompt([20, 21], seed=2)
    from pagedcore.adapters.transformers.multimodal import prompt_keys

    a = prompt_keys(model.config, ids, {k: cat[k] for k in ("pixel_values", "image_grid_thw")})
    b = prompt_keys(model.config, ids, {k: dog[k] for k in ("pixel_values", "image_grid_thw")})
    c = prompt_keys(model.config, ids, {k: cat[k].clone() for k in ("pixel_values", "image_grid_thw")})
    assert a[0][:3] == b[0][:3] == ids[0, :3].tolist() and a[0][7:] == b[0][7:] == ids[0, 7:].tolist()
    assert a[0][3:7] != b[0][3:7] and min(a[0][3:7]) < 0
    assert a == c  # the same content gives the same key
