"""What one call of an op costs the compiled decode step, by how it is registered (``graph_ops.py``): an op made with
``torch.library.custom_op`` against the same kernel registered with ``torch.library.Library`` (what ``graph_op``
does), for an op that returns a tensor and one that mutates its argument; then the compiled step's own ops called
through the dispatcher against their Python kernels called directly (what the registration adds).

``python scripts/graph_op_cost.py [THREADS]``: microseconds per call, the best of 3 repetitions of 20000 calls.
"""

from __future__ import annotations

import sys
import timeit
from collections.abc import Callable

import torch


def per_call(fn: Callable[[], object], number: int = 20000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=3)) / number * 1e6


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    from pagedcore.adapters.transformers.compiled import STORE_KV, store_kv
    from pagedcore.adapters.transformers.prepacked import ROW_LINEAR, row_linear

    @torch.library.custom_op("cost::returns", mutates_args=())
    def returns(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape)

    @torch.library.custom_op("cost::mutates", mutates_args=("x",))
    def mutates(x: torch.Tensor) -> None:
        pass

    library = torch.library.Library("cost2", "DEF")
    library.define("returns(Tensor x) -> Tensor")
    library.define("mutates(Tensor(a!) x) -> ()")
    library.impl("returns", lambda x: x.new_empty(x.shape), "CompositeExplicitAutograd")
    library.impl("mutates", lambda x: None, "CompositeExplicitAutograd")

    x = torch.randn(4)
    kc, vc = torch.zeros(2049, 16, 2, 64), torch.zeros(2049, 16, 2, 64)
    k, v, slots = torch.randn(1, 2, 64), torch.randn(1, 2, 64), torch.tensor([100])
    weight, row = torch.randn(256, 32), torch.randn(1, 32)
    cases = {
        "custom_op, returns a tensor": lambda: torch.ops.cost.returns.default(x),
        "Library, returns a tensor": lambda: torch.ops.cost2.returns.default(x),
        "custom_op, mutates its argument": lambda: torch.ops.cost.mutates.default(x),
        "Library, mutates its argument": lambda: torch.ops.cost2.mutates.default(x),
        "store_kv, its kernel called directly": lambda: store_kv(kc, vc, k, v, slots, 2048),
        "store_kv, the op (graph_op)": lambda: STORE_KV(kc, vc, k, v, slots, 2048),
        "row_linear, its kernel called directly": lambda: row_linear(row, weight, None),
        "row_linear, the op (graph_op)": lambda: ROW_LINEAR(row, weight, None),
    }
    with torch.inference_mode():
        for name, fn in cases.items():
            print(f"{name:42s} {per_call(fn):7.2f} us")


if __name__ == "__main__":
    main()
