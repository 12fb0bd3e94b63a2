"""enable(): prefix hits on left-padded batches, for the models whose attention hides the padding from the cache.

GPT-NeoX, Falcon, Bloom, GPT-Neo and CTRL call ``cache.update`` without the model kwargs, so no ``position_ids``
reach the cache and a plain PagedCache cannot tell their padding from tokens. ``enable`` knows the padding (it
reads the mask) and declares it to the cache; before that fix the padding was stored as if it were the row's first
tokens, those blocks were registered under the row's real tokens, and a later prefix hit served keys and values at
the wrong positions (the padded row generated different tokens on the second call).

Each case compares greedy tokens and fp32 per-step logits with stock ``generate`` on a DynamicCache, for a shared
prefix ``L`` shorter than, equal to and longer than the padded row's padding, and for the same call twice.
Llama (whose ``update`` gets ``position_ids``) is the control.
"""

from __future__ import annotations

import functools

import pytest
import torch
from models import FIRST_TOKEN, NO_KWARGS_FAMILIES, PAD, VOCAB, tiny_model
from paged_checks import assert_same_generation, dynamic

from pagedcore.adapters import transformers as pc

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 6
# Per block size: the padded row's padding and the batch width; the width leaves room for a 3-block hit in row 0.
LAYOUT = {4: (5, 21), 16: (18, 52)}
# Per case: the cached tokens (in blocks) of row 0 and of the padded row 1 before the call. With padding P the
# shared prefix is L = min(hit0, P + hit1): one block < P, P itself, and P + one block.
HITS = {"below_padding": (1, 0), "equal_to_padding": (2, 0), "above_padding": (3, 1)}


@functools.cache
def model_for(family: str) -> torch.nn.Module:
    return tiny_model(family)


def padded_batch(block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    pad, width = LAYOUT[block_size]
    ids = torch.randint(FIRST_TOKEN, VOCAB, (2, width), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :pad] = PAD
    mask[1, :pad] = 0
    return ids, mask, pad


def greedy(model, ids, mask, **kwargs):
    kwargs = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "return_dict_in_generate": True, **kwargs}
    return model.generate(ids, attention_mask=mask, output_logits=True, **kwargs)


def release(out) -> None:
    if out.cache is not None:
        out.cache.release()


FAMILIES = [*sorted(NO_KWARGS_FAMILIES), "llama"]  # Llama: the control, its update gets position_ids


@pytest.mark.parametrize("block_size", sorted(LAYOUT))
@pytest.mark.parametrize("case", list(HITS))
@pytest.mark.parametrize("family", FAMILIES)
def test_padded_prefix_hit_matches_stock_generate(family, case, block_size):
    model = model_for(family)
    ids, mask, pad = padded_batch(block_size, seed=3)
    want = greedy(model, ids, mask, cache=dynamic(model))
    pool = pc.enable(model, num_blocks=256, block_size=block_size)
    try:
        blocks0, blocks1 = HITS[case]
        for row, blocks in ((ids[0], blocks0), (ids[1, pad:], blocks1)):
            if blocks:  # exactly ``blocks`` blocks of positions computed (the one new token is never fed)
                release(greedy(model, row[None, : blocks * block_size], None, max_new_tokens=1))
        hits_before = pool.num_hit_tokens
        got = greedy(model, ids, mask)
        release(got)
        assert_same_generation(got, want)
        shared = min(blocks0 * block_size, pad + blocks1 * block_size)
        assert {"below_padding": shared < pad, "equal_to_padding": shared == pad}.get(case, shared > pad)
        assert pool.num_hit_tokens - hits_before == shared + max(0, shared - pad)
        # Again: now both rows hit what that call registered (the padded row's blocks were wrong before the fix).
        again = greedy(model, ids, mask)
        release(again)
        assert_same_generation(again, want)
        assert pool.kv.num_used_blocks == 0
        pool.check_invariants()
    finally:
        pc.disable(model)


@pytest.mark.parametrize("block_size", sorted(LAYOUT))
@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_padded_call_twice_matches_stock_generate(family, block_size):
    """The reported fault: the cold call was right, the warm one was not for the padded row."""
    model = model_for(family)
    ids, mask, pad = padded_batch(block_size, seed=4)
    want = greedy(model, ids, mask, cache=dynamic(model))
    pool = pc.enable(model, num_blocks=256, block_size=block_size)
    try:
        for _ in range(2):
            got = greedy(model, ids, mask)
            assert_same_generation(got, want)
            # The padding is declared to the cache: not stored, even by models that never pass position_ids.
            assert got.cache.row_padding() == [0, pad]
            release(got)
        assert pool.num_hit_tokens > pad  # the second call did hit, past the padding
        assert pool.kv.num_used_blocks == 0
        pool.check_invariants()
    finally:
        pc.disable(model)
