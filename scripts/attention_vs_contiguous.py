"""Decode attention over the paged pool vs SDPA over contiguous tensors, per layer call (issue 33: "paged attention
at batch 16 no slower than sdpa over contiguous tensors").

For the benchmark model's attention shapes (8 query heads, 2 KV heads, head dim 64, float32, block size 16) and
``ROWS`` sequences decoding one token each, with contexts drawn from ``[CONTEXT / 2, CONTEXT]`` (seeded), the time of
one layer's attention, four ways:

- ``kernel``: :class:`~pagedcore.plugins.torch_backend.TorchPagedAttention` (the Engine's and ``PagedCache``'s torch
  backend) as it runs where the decode kernel serves (:mod:`pagedcore.plugins.decode_kernel`: each row's keys and
  values read where the pool holds them), over a pool whose blocks are shuffled, as after the prefix cache has
  recycled them. Its metadata is built once per step and serves every layer, as in a forward;
- ``paged``: the same backend with the kernel turned off (its way before the kernel, and wherever the kernel does
  not serve): it gathers each row's blocks, then one SDPA call;
- ``transformers``: what transformers' ``sdpa_attention_forward`` runs on a left-padded ``DynamicCache`` batch: the
  padding mask, so ``repeat_kv`` of the keys and values to every query head, then SDPA (with equal lengths and no
  mask it passes ``enable_gqa`` instead);
- ``contiguous, packed``: the backend's own compute (:func:`~pagedcore.plugins.torch_backend.attend_rows`, the
  query heads of a KV head as its rows) over contiguous left-padded tensors: the paged path without its gathers.

Every layer has its own pool (or cache) tensors and a step visits the layers in turn, so each layer's keys come from
memory as in a forward (the 8 layers' keys are larger than the caches from 16 rows at 512 on). Medians of
``--rounds`` steps, the ways alternating; outputs compared (largest difference from ``transformers``).

    python scripts/attention_vs_contiguous.py [--rows 1,4,16,64] [--contexts 512,2048] [--rounds 9] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from pagedcore.attention import PagedAttentionMetadata
from pagedcore.plugins import torch_backend
from pagedcore.plugins.decode_kernel import load
from pagedcore.plugins.torch_backend import TorchPagedAttention, attend_rows

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 8, 2, 64, 16, 8


@contextlib.contextmanager
def _without_kernel() -> Iterator[None]:
    """The torch backend's ways without the decode kernel, inside the block."""
    chosen = torch_backend._decode_kernel  # noqa: SLF001
    torch_backend._decode_kernel = lambda *args: None  # noqa: SLF001
    try:
        yield
    finally:
        torch_backend._decode_kernel = chosen  # noqa: SLF001


def _case(rows: int, context: int, seed: int) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """The four ways for one (rows, context) point: each a callable running one step's 8 layer calls."""
    rng = random.Random(seed)
    lengths = [rng.randint(context // 2, context) for _ in range(rows)]
    blocks_per_row = [-(-n // BLOCK) for n in lengths]
    num_blocks = sum(blocks_per_row)
    order = list(range(num_blocks))
    rng.shuffle(order)
    tables, start = [], 0
    for count in blocks_per_row:
        tables.append(order[start : start + count])
        start += count
    g = torch.Generator().manual_seed(seed)
    scale = DIM**-0.5
    pools = [
        (torch.randn(num_blocks + 1, BLOCK, KV_HEADS, DIM, generator=g),
         torch.randn(num_blocks + 1, BLOCK, KV_HEADS, DIM, generator=g))
        for _ in range(LAYERS)
    ]  # fmt: skip
    for k, v in pools:
        k[num_blocks].zero_(), v[num_blocks].zero_()
    queries = [torch.randn(rows, HEADS, DIM, generator=g) for _ in range(LAYERS)]
    width = max(lengths)

    def contiguous(cache: torch.Tensor) -> torch.Tensor:  # (rows, kv_heads, width, dim), left-padded with zeros
        out = cache.new_zeros(rows, KV_HEADS, width, DIM)
        flat = cache.view(-1, KV_HEADS, DIM)
        for i, (table, n) in enumerate(zip(tables, lengths)):
            slots = torch.tensor([b * BLOCK + j for b in table for j in range(BLOCK)][:n])
            out[i, :, width - n :] = flat[slots].transpose(0, 1)
        return out

    dense = [(contiguous(k), contiguous(v)) for k, v in pools]
    pad = torch.tensor([[j >= width - n for j in range(width)] for n in lengths])[:, None, None, :]
    mask = None if all(n == width for n in lengths) else pad
    backend = TorchPagedAttention()

    def kernel() -> list[torch.Tensor]:
        meta = PagedAttentionMetadata.build(
            block_size=BLOCK, query_lens=[1] * rows, seq_lens=lengths, block_offsets=[0] * rows, tables=tables,
            slots=[[t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK] for t, n in zip(tables, lengths)],
            sliding_window=None, pad_block=num_blocks,
        )  # fmt: skip
        return [backend.forward(q, k, v, meta, scale=scale) for q, (k, v) in zip(queries, pools)]

    def paged() -> list[torch.Tensor]:
        with _without_kernel():
            return kernel()

    def transformers_sdpa() -> list[torch.Tensor]:
        outs = []
        for q, (k, v) in zip(queries, dense):
            q4 = q[:, :, None, :]
            if mask is None:
                o = F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
            else:
                groups = HEADS // KV_HEADS
                kr = k[:, :, None].expand(rows, KV_HEADS, groups, width, DIM).reshape(rows, HEADS, width, DIM)
                vr = v[:, :, None].expand(rows, KV_HEADS, groups, width, DIM).reshape(rows, HEADS, width, DIM)
                o = F.scaled_dot_product_attention(q4, kr, vr, attn_mask=mask, scale=scale)
            outs.append(o[:, :, 0])
        return outs

    def packed() -> list[torch.Tensor]:
        return [attend_rows(q[:, :, None, :], k, v, mask, scale, None)[:, :, 0] for q, (k, v) in zip(queries, dense)]

    return {"kernel": kernel, "paged": paged, "transformers": transformers_sdpa, "contiguous, packed": packed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    built = "built" if load() is not None else "NOT built here: the kernel column is the paged way"
    print(f"torch {torch.__version__}, {args.threads} thread(s); ms per layer call, medians of {args.rounds} steps; "
          f"decode kernel {built}")  # fmt: skip
    print("| context | rows | kernel | paged | transformers | contiguous, packed | kernel / paged "
          "| kernel / transformers | paged / packed | largest difference |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for context in (int(c) for c in args.contexts.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            ways = _case(rows, context, seed=rows * 7919 + context)
            times: dict[str, list[float]] = {name: [] for name in ways}
            outs: dict[str, list[torch.Tensor]] = {}
            with torch.inference_mode():
                for r in range(args.rounds + 1):
                    names = list(ways) if r % 2 == 0 else list(reversed(ways))
                    for name in names:
                        start = time.perf_counter()
                        outs[name] = ways[name]()
                        if r:  # the first round warms up
                            times[name].append((time.perf_counter() - start) / LAYERS * 1e3)
            ms = {name: statistics.median(t) for name, t in times.items()}
            diff = max(
                float((a - b).abs().max()) for name in ("kernel", "paged", "contiguous, packed")
                for a, b in zip(outs[name], outs["transformers"])
            )  # fmt: skip
            print(f"| {context} | {rows} | {ms['kernel']:.3f} | {ms['paged']:.3f} | {ms['transformers']:.3f} | "
                  f"{ms['contiguous, packed']:.3f} | {ms['kernel'] / ms['paged']:.2f}x | "
                  f"{ms['kernel'] / ms['transformers']:.2f}x | {ms['paged'] / ms['contiguous, packed']:.2f}x | "
                  f"{diff:.1e} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
