"""Which order this CPU's ``F.linear`` sums in, and which of the row kernel's orders gives its bits (issue 33).

    python scripts/mkl_order.py                       # the kernel's exact order per weight shape and row count
    python scripts/mkl_order.py --tree 512x512 --rows 2   # F.linear's summation tree, seen from column 0
    python scripts/mkl_order.py --tree sum --width 128    # torch's row sum (a norm's variance), from column 0

The tree is read as FPRev reads one: put ``2^40`` at column i, ``-2^40`` at column j and 1 everywhere else; every 1
added to one of the two big values before they cancel is lost, so the result counts the columns summed outside the
smallest subtree holding both, and ``width - result`` is that subtree's size. Listed per size, from column 0's view, a
chain shows up as sizes 2, 3, 4, ... one column each, lanes as columns a fixed stride apart joining together. This is
how the orders in ``row_kernel.py``'s docstring were found (the sixteen lanes of MKL on an Intel Xeon, 7 December);
each order was then confirmed bit for bit by the kernel itself on random inputs (the default table).
"""

from __future__ import annotations

import argparse
import itertools
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedcore.adapters.transformers.row_kernel import load

BIG = 2.0**40  # past 2^24 times the width: any 1 added to it is lost


def subtree_sizes(width: int, column: int, total: torch.Tensor) -> dict[int, list[int]]:
    """Per subtree size, the columns whose smallest common subtree with ``column`` has that size."""
    sizes: dict[int, list[int]] = defaultdict(list)
    for other in range(width):
        if other != column:
            sizes[width - int(total[other])].append(other)
    return dict(sorted(sizes.items()))


def linear_tree(
    out_features: int, width: int, rows: int, column: int, linear: Callable[..., torch.Tensor] = F.linear
) -> dict[int, list[int]]:
    """``linear``'s tree (F.linear's unless given) at ``rows`` rows through an ``out_features x width`` weight: one
    pair of columns per output row."""
    total = torch.zeros(width)
    others = [j for j in range(width) if j != column]
    for start in range(0, len(others), out_features):
        chunk = others[start : start + out_features]
        weight = torch.ones(out_features, width)
        for r, j in enumerate(chunk):
            weight[r, column], weight[r, j] = BIG, -BIG
        y = linear(torch.ones(rows, width), weight)
        if not bool((y == y[0]).all()):
            raise SystemExit("the rows were summed in different orders: read them one at a time")
        for r, j in enumerate(chunk):
            total[j] = y[0, r]
    return subtree_sizes(width, column, total)


def sum_tree(width: int, column: int) -> dict[int, list[int]]:
    """``x.sum(-1)``'s tree over a contiguous row of ``width`` floats (what ``pow(2).mean(-1)`` sums in)."""
    x = torch.ones(width, width)
    x[:, column] = BIG
    x[torch.arange(width), torch.arange(width)] = -BIG
    total = x.sum(-1)
    return subtree_sizes(width, column, total)


def show(sizes: dict[int, list[int]]) -> None:
    for size, columns in sizes.items():
        steps = sorted({b - a for a, b in itertools.pairwise(columns)})
        shown = columns if len(columns) <= 8 else f"{columns[:6]} ... ({len(columns)} columns, steps {steps[:3]})"
        print(f"  subtree of {size:5d}: {shown}")


def orders(threads: int, shapes: list[tuple[int, int]], rows: list[int]) -> None:
    kernel = load()
    if kernel is None:
        raise SystemExit("no row kernel here (no C compiler, no AVX2, or PAGEDCORE_ROW_KERNEL=0)")
    torch.manual_seed(0)
    print(f"| weight | bias | {' | '.join(str(r) for r in rows)} |")
    print(f"|---|---|{'---|' * len(rows)}")
    for out_features, width in shapes:
        for bias in (False, True):
            weight = torch.randn(out_features, width) * 0.05
            b = torch.randn(out_features) if bias else None
            found = []
            for count in rows:
                x = torch.randn(count, width)
                order = kernel.exact_order(x, weight, b, F.linear(x, weight, b), threads)
                found.append("-" if order is None else order.label(count))
            print(f"| {out_features}x{width} | {bias} | {' | '.join(found)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--shapes", default="512x512,128x512,1536x512,512x1536,32000x512")
    parser.add_argument("--rows", default="1,2,3,4,5,6,7,8,9,11,12,15,16,17,32,64")
    parser.add_argument("--tree", help="a weight OUTxIN for F.linear's tree, or 'sum' for torch's row sum")
    parser.add_argument("--width", type=int, default=128, help="the row width of --tree sum")
    parser.add_argument("--column", type=int, default=0, help="the column the tree is seen from")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads")
    rows = [int(r) for r in args.rows.split(",")]
    if args.tree == "sum":
        print(f"x.sum(-1) over {args.width} columns, from column {args.column}:")
        show(sum_tree(args.width, args.column))
    elif args.tree:
        out_features, width = (int(v) for v in args.tree.split("x"))
        for count in rows:
            print(f"F.linear, {count} rows x {out_features}x{width}, from column {args.column}:")
            show(linear_tree(out_features, width, count, args.column))
    else:
        shapes = [(int(a), int(b)) for a, b in (s.split("x") for s in args.shapes.split(","))]
        orders(args.threads, shapes, rows)


if __name__ == "__main__":
    main()
