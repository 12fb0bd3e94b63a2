"""The step sampler's batched greedy path against the reference ops it replaces: ``argmax(-1)`` (the first maximal
index) and ``isfinite(...).any(-1)`` (a row can be sampled), also with ties, NaN and infinities anywhere."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedcore.adapters.transformers.sampling import SampleRow, SamplingParams, greedy_tokens, sample_rows

SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 3.0]


@st.composite
def logit_rows(draw: st.DrawFn) -> torch.Tensor:
    rows = draw(st.integers(1, 5))
    vocab = draw(st.sampled_from([1, 3, 127, 128, 129, 300, 1000]))
    seed = draw(st.integers(0, 2**31 - 1))
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)).round(decimals=1)  # ties
    for _ in range(draw(st.integers(0, 6))):  # special values at random places
        i, j = draw(st.integers(0, rows - 1)), draw(st.integers(0, vocab - 1))
        x[i, j] = draw(st.sampled_from(SPECIAL))
    if draw(st.booleans()):  # a whole row of one special value
        x[draw(st.integers(0, rows - 1))] = draw(st.sampled_from(SPECIAL))
    return x


@settings(max_examples=300, deadline=None)
@given(logit_rows())
def test_greedy_tokens_match_the_reference_ops(x: torch.Tensor) -> None:
    tokens, finite = greedy_tokens(x)
    assert tokens == x.argmax(dim=-1).tolist()
    assert finite == torch.isfinite(x).any(dim=-1).tolist()


def test_rows_without_a_finite_logit_fail_alone_and_nan_rows_keep_their_argmax() -> None:
    nan_row = torch.zeros(300)
    nan_row[200] = float("nan")
    logits = torch.stack([torch.full((300,), float("-inf")), nan_row, torch.arange(300.0), torch.full((300,), 1.0)])
    rows = [SampleRow(name, SamplingParams(), [torch.Generator()]) for name in "abcd"]
    out = sample_rows(logits, rows)
    assert set(out.failed) == {"a"} and "no finite logit" in out.failed["a"]
    assert out.tokens == {"b": [200], "c": [299], "d": [0]}
