"""The ops a compiled decode step calls without tracing into them (the pool's writes, the paged attention, the linear
layers, the head: :mod:`.compiled`, :mod:`.prepacked`, :mod:`.argmax_head`), registered with torch's dispatcher.

Why not ``torch.library.custom_op``: its Python wrapper added 2-6 µs to each call, and about 18 µs to each of the
pool's writes (``store_kv``: 31.8 µs a call as a ``custom_op``, 14.0 µs registered here, its kernel alone 11.7), and
a decode step of the benchmark's 8-layer model calls about 80 of them (the ``store_kv`` figures measured while
changing it over; ``python scripts/graph_op_cost.py`` prints the two registrations side by side for a plain op:
5.8 against 3.8 µs returning a tensor, 7.2 against 1.4 µs mutating an argument, and this module's ops against
their kernels called directly). A kernel here is the
Python function itself, for every device (``CompositeExplicitAutograd``: the compiled step runs without autograd), and
the compiler sees the op through its ``fake`` (output shapes, no data).

Example:
    >>> from pagedcore.adapters.transformers import prepacked
    >>> prepacked.ROW_LINEAR._schema.name, prepacked.ROW_LINEAR is torch.ops.pagedcore.row_linear.default
    ('pagedcore::row_linear', True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["graph_op"]

_LIBRARY = torch.library.Library("pagedcore", "FRAGMENT")  # kept alive: the ops live as long as it does


def graph_op(schema: str, kernel: Callable[..., Any], fake: Callable[..., Any]) -> Any:
    """Define ``pagedcore::<schema>`` with ``kernel`` (a Python function, which stays callable as itself) and ``fake``
    (its output shapes); returns the op (``torch.ops.pagedcore.<name>.default``), which a compiled graph calls as one
    node. A mutated argument is annotated in the schema (``Tensor(a!)``), as torch's own in-place ops are.

    Example:
        The linear layers' op (:mod:`.prepacked`: ``graph_op("row_linear(Tensor x, Tensor weight, Tensor? bias) ->
        Tensor", row_linear, ...)``), called as any torch op:

        >>> from pagedcore.adapters.transformers.prepacked import ROW_LINEAR
        >>> weight, x = torch.randn(4, 3), torch.randn(2, 3)
        >>> torch.equal(ROW_LINEAR(x, weight, None), torch.nn.functional.linear(x, weight)), str(ROW_LINEAR)
        (True, 'pagedcore.row_linear.default')
    """
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"pagedcore::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.pagedcore, name).default
