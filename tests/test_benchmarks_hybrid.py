"""The hybrid-model benchmark (``pagedcore bench --only hybrid``): multi-session chat on a Qwen3.5-like model, the
Engine against the padded batch per turn. It runs its quick workload on the tiny shape, its correctness check (replies
compared with the padded batch's) really runs and catches a difference, its counts are right and its report has the
structure docs/benchmarks.md shows.

Nothing here asserts on timings; figures come from ``pagedcore bench`` (docs/benchmarks.md).
"""

from __future__ import annotations

import pytest

from pagedcore.benchmarks import BenchOptions, hybrid
from pagedcore.benchmarks.chat import ENGINE, PADDED, ChatRun, ChatWorkload
from pagedcore.benchmarks.context import BenchContext
from pagedcore.benchmarks.options import MODEL_SIZES
from pagedcore.benchmarks.report import Header

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def result():
    return hybrid.run(BenchContext(BenchOptions(quick=True, progress=False, model_size="tiny")))


def test_hybrid_benchmark_runs_a_hybrid_model_and_matches_the_padded_batch(result):
    assert result.head.model.startswith("Qwen3.5-like with random weights: 4 layers (3 Gated DeltaNet")
    assert result.mismatches() == []
    padded, served = result.run(PADDED), result.run(ENGINE)
    w = result.workload
    for t in range(w.turns):  # the padded batch computes every prompt of every turn
        assert padded.prefill_per_turn[t] == sum(len(w.prompt(c, t, padded.replies[c])) for c in range(w.conversations))
    # the Engine computes the system prompt once, then what no earlier turn computed: each turn resumes the state
    # snapshot filed where the session's previous reply ended
    assert served.prefill_per_turn[0] == len(w.system) + sum(len(w.users[c][0]) for c in range(w.conversations))
    assert sum(served.prefill_per_turn) == w.unique_prompt_tokens
    assert result.cpu is not None and result.cpu[PADDED] > 0 and result.cpu[ENGINE] > 0


def test_hybrid_benchmark_report(result):
    text = result.markdown()
    assert text.startswith("### 11. Hybrid model (Qwen3.5-like): multi-session chat (quick workload)")
    assert "| Engine speedup vs the padded batch (median CPU time) |" in text
    assert "| Engine prefill positions / unique prompt tokens | 1.000 | ≤ 1.10 | met |" in text
    assert "| replies identical to the padded batch's | yes | all | met |" in text
    assert "state slots" in text


def test_hybrid_report_names_a_differing_reply():
    workload = ChatWorkload(system=[5] * 4, users=[[[6], [7]], [[8], [9]]], replies=[[1, 1], [1, 1]])
    padded = ChatRun(PADDED, [2.0], [[[3], [4]], [[5], [6]]], [10, 12])
    served = ChatRun(ENGINE, [1.0], [[[3], [4]], [[5], [7]]], [6, 4])
    cpu = {PADDED: 3.0, ENGINE: 1.0}
    text = hybrid.HybridChatResult(Header(False, "Qwen3.5-like", "laptop"), workload, [padded, served], 1, "", cpu=cpu)
    markdown = text.markdown()
    assert "| replies identical to the padded batch's | no: 1 differ | all | **missed** |" in markdown
    assert "| Engine speedup vs the padded batch (median CPU time) | 3.00x | ≥ 3x | met |" in markdown


def test_hybrid_config_has_the_qwen35_pattern():
    config = hybrid.hybrid_config(MODEL_SIZES["small"])  # the model: hidden >= 512, 8+ layers
    assert config.hidden_size >= 512 and config.num_hidden_layers >= 8
    assert config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
