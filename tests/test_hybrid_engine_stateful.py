"""The Engine's request bookkeeping property test (``test_engine_stateful``) on a hybrid model: any interleaving of
add_request, abort, step, generate and streams on a Qwen3.5-like model with few blocks and few state slots (requests
wait, are preempted, fork into samples, abort mid-prefill, hit each other's snapshots) reports every request once,
keeps the scheduler's invariants (state slot references included) after every operation, and holds no block and no
state slot once everything is drained."""

from __future__ import annotations

import pytest
from hybrid_models import hybrid_model
from hypothesis import HealthCheck, settings
from test_engine_stateful import EngineReporting

from pagedcore.adapters.transformers import Engine

MODEL = None


def model():
    global MODEL
    if MODEL is None:
        MODEL = hybrid_model("qwen3_5")
    return MODEL


class HybridEngineReporting(EngineReporting):
    def __init__(self) -> None:
        super().__init__()
        self.engine.close()
        self.engine = Engine(
            model(), num_blocks=12, block_size=4, max_num_batched_tokens=12, max_num_seqs=4, state_slots=5
        )

    def teardown(self):
        engine = self.engine
        try:
            super().teardown()
        finally:
            assert engine.pool.kv.states.num_used == 0, "state slots leaked"
            engine.pool.check_invariants()


@pytest.mark.usefixtures("one_thread")
def test_hybrid_engine_reporting_state_machine():
    HybridEngineReporting.TestCase.settings = settings(
        max_examples=20,
        stateful_step_count=15,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    HybridEngineReporting.TestCase().runTest()
