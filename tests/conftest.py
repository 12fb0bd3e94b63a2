"""Shared fixtures."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and several threads on 2 busy cores stall each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """The few-row linears' split and kernel need threads to share: two, as this machine has."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def trial_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The row split's trial clock (``row_split._clock``) stepping by 1.0 a reading; a test subtracts from the
    returned cell inside a way it wants timed faster."""
    from pagedcore.adapters.transformers import row_split

    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    monkeypatch.setattr(row_split, "_clock", clock)
    return now


@pytest.fixture
def kernel_wins(monkeypatch: pytest.MonkeyPatch, trial_clock: list[float]) -> None:
    """The trials' clock made to find the row kernel fastest (on tiny weights the call's cost decides), so the decode
    steps run through it wherever its bits are F.linear's, and must still give stock's bits."""
    from pagedcore.adapters.transformers.row_kernel import RowKernel

    real = RowKernel.linear

    def fast(self: RowKernel, x: torch.Tensor, weight: torch.Tensor, bias: Any, order: Any, threads: int) -> Any:
        trial_clock[0] -= 0.75  # every timed kernel call looks a quarter as long
        return real(self, x, weight, bias, order, threads)

    monkeypatch.setattr(RowKernel, "linear", fast)


@pytest.fixture
def enabled(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """``enable()`` models for one test (with the module's ``ENABLE_DEFAULTS`` under the caller's keywords);
    afterwards each is disabled, no block may be held and the pool's bookkeeping must be consistent."""
    import pagedcore.adapters.transformers as pc

    defaults = dict(getattr(request.module, "ENABLE_DEFAULTS", {}))
    models: list[torch.nn.Module] = []

    def _enable(model: torch.nn.Module, **kwargs: Any) -> Any:
        models.append(model)
        return pc.enable(model, **{**defaults, **kwargs})

    yield _enable
    gc.collect()  # outputs of a failed test may sit in a traceback cycle, holding their caches
    for model in models:
        if pc.is_enabled(model):
            pool = pc.disable(model)
            assert pool.kv.num_used_blocks == 0, "blocks are still held after the test"
            pool.check_invariants()
