"""The step sampler's batched greedy path against the reference ops it replaces: ``argmax(-1)`` (the first maximal
index) and ``isfinite(...).any(-1)`` (a row can be sampled), also with ties, NaN and infinities anywhere."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedcore.adapters.transformers.sampling import (
    GREEDY_BELOW,
    SampleRow,
    SamplingParams,
    greedy_tokens,
    sample_rows,
)

SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 3.0]


@st.composite
def logit_rows(draw: st.DrawFn) -> torch.Tensor:
    rows = draw(st.integers(1, 5))
    vocab = draw(st.sampled_from([1, 3, 127, 128, 129, 256, 300, 512, 1000]))  # under, at, between whole blocks
    seed = draw(st.integers(0, 2**31 - 1))
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)).round(decimals=1)  # ties
    for _ in range(draw(st.integers(0, 6))):  # special values at random places
        i, j = draw(st.integers(0, rows - 1)), draw(st.integers(0, vocab - 1))
        x[i, j] = draw(st.sampled_from(SPECIAL))
    if draw(st.booleans()):  # a whole row of one special value
        x[draw(st.integers(0, rows - 1))] = draw(st.sampled_from(SPECIAL))
    if draw(st.booleans()):  # the maximum in the last, partial block
        x[draw(st.integers(0, rows - 1)), -1] = 9.0
    x = x.to(draw(st.sampled_from(DTYPES)))
    return x.t().contiguous().t() if draw(st.booleans()) else x  # the same values, column-major


# float32 and float64 take numpy's argmax over the tensor's memory, half precision the block search
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@settings(max_examples=400, deadline=None)
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


# Temperatures and top_p values that pass validation but once made the draw fail ("probability tensor contains
# inf/nan"): a tiny temperature overflows float32 when it divides the logits, a top_p below float32's smallest
# number reads as 0 and dropped every token.
TINY = [1e-40, 1e-300, 5e-324, 1e-6]


def test_temperatures_below_the_threshold_are_greedy() -> None:
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [10.0, -3.0, 40.0, 39.5]])
    for temperature in TINY:
        params = SamplingParams(temperature=temperature, seed=1)
        assert params.is_greedy, temperature
        rows = [SampleRow(name, params, [torch.Generator(), torch.Generator()]) for name in "ab"]
        out = sample_rows(logits, rows)
        assert not out.failed and out.tokens == {"a": [1, 1], "b": [2, 2]}, temperature
    assert not SamplingParams(temperature=GREEDY_BELOW).is_greedy  # at the threshold it samples


def test_a_top_p_below_float32s_smallest_number_keeps_the_most_likely_token() -> None:
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    for top_p in (1e-320, 1e-45, 1e-30):
        params = SamplingParams(temperature=1.0, top_p=top_p, seed=3)
        out = sample_rows(logits, [SampleRow("a", params, params.generators())])
        assert not out.failed and out.tokens == {"a": [1]}, top_p


def test_the_engine_serves_tiny_temperatures_and_top_p_as_the_greedy_answer() -> None:
    from pagedcore.adapters.transformers import Engine
    from pagedcore.adapters.transformers.testing import tiny_llama

    with Engine(tiny_llama(num_hidden_layers=1), num_blocks=32, block_size=8) as engine:
        (greedy,) = engine.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=6), use_tqdm=False)
        for params in (
            SamplingParams(max_new_tokens=6, temperature=1e-40),
            SamplingParams(max_new_tokens=6, temperature=1e-300, n=2),
            SamplingParams(max_new_tokens=6, temperature=0.8, top_p=1e-320, seed=5),
        ):
            (out,) = engine.generate([[1, 2, 3, 4]], params, use_tqdm=False)
            assert out.error is None, params
            assert [s.token_ids for s in out.samples] == [greedy.samples[0].token_ids] * params.n, params
        assert engine.pool.kv.num_used_blocks == 0


def test_the_greedy_benchmark_script_finds_the_same_answers_every_way():
    """``scripts/greedy_bench.py`` (docs/benchmarks.md, "The greedy pass read by numpy") at a small point: numpy, the
    block search and the reference ops agree (its table's last column)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "greedy_bench.py"
    args = [sys.executable, str(script), "--size", "tiny", "--rows", "1,5", "--rounds", "2"]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=120).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row[0].strip() for row in rows] == ["1", "5"]
    assert all(row[-1].strip() == "yes" for row in rows)


def test_vllms_field_names_are_taken_as_keywords_too():
    """Regression (an outside audit): ``SamplingParams(max_tokens=8, stop=[...])``, as a vLLM user writes it, was a
    bare TypeError; only a dict of fields took vLLM's names."""
    params = SamplingParams(max_tokens=8, min_tokens=2, stop=["."], temperature=0.5)
    assert (params.max_new_tokens, params.min_new_tokens, params.stop_strings) == (8, 2, (".",))
    assert params == SamplingParams(max_new_tokens=8, min_new_tokens=2, stop_strings=["."], temperature=0.5)
    from pagedcore import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="max_tokens and max_new_tokens are the same field"):
        SamplingParams(max_tokens=8, max_new_tokens=4)
