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
