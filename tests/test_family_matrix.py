"""The family matrix: every causal-LM model type of transformers, tiny, in the four modes against stock generate,
exact or refused at construction, as tests/family_expected.py says (and docs/families.md shows).

The flagships (``FLAGSHIPS``) run by default; the long tail with ``-m slow``. A family whose outcome changes (an
engineer makes it exact, transformers changes) fails here until its row in family_expected.py says so; then
``python scripts/families_page.py`` rewrites the page.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from family_configs import CAUSAL_LM_TYPES
from family_expected import EXPECTED, FLAGSHIPS, NOT_BUILT, REASONS
from family_matrix import MODES, Outcome, run_family

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parent.parent


def _matches(expected: str, outcome: Outcome) -> bool:
    if expected.startswith("refused"):
        reason = expected.partition(":")[2].strip()
        return outcome.status == "refused" and reason in outcome.detail
    return outcome.label() == expected


@pytest.mark.parametrize(
    "model_type",
    [pytest.param(t, marks=() if t in FLAGSHIPS else pytest.mark.slow) for t in sorted(EXPECTED)],
)
def test_family_is_exact_or_refused_as_expected(model_type):
    outcomes = run_family(model_type)
    got = {mode: outcomes[mode] for mode in MODES}
    wrong = {
        mode: f"expected {expected!r}, got {got[mode].label()!r}: {got[mode].detail[:400]}"
        for mode, expected in zip(MODES, EXPECTED[model_type])
        if not _matches(expected, got[mode])
    }
    assert not wrong, wrong
    assert all(o.status in ("exact", "refused") for o in got.values())  # never wrong tokens, never a crash


def test_every_causal_lm_type_is_in_the_matrix():
    assert set(EXPECTED) | set(NOT_BUILT) == set(CAUSAL_LM_TYPES)
    assert not set(EXPECTED) & set(NOT_BUILT)
    assert set(FLAGSHIPS) <= set(EXPECTED)


def test_expectations_are_exact_or_a_named_refusal():
    for model_type, labels in EXPECTED.items():
        assert len(labels) == len(MODES), model_type
        for label in labels:
            if label.startswith("refused"):
                assert label.partition(":")[2].strip() in REASONS, (model_type, label)
            else:
                assert label in ("exact", "exact (padded)", "exact (gathered)", "exact (no prefix hits)"), label


def test_the_families_page_is_current():
    spec = importlib.util.spec_from_file_location("families_page", ROOT / "scripts" / "families_page.py")
    assert spec is not None and spec.loader is not None
    page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page)
    assert (ROOT / "docs" / "families.md").read_text() == page.render(), "run python scripts/families_page.py"
