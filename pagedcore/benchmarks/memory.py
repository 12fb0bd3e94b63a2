"""Benchmark 3: KV bytes reserved per byte of real tokens for a mixed-length, left-padded batch, per cache."""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers import PreTrainedModel

from pagedcore.adapters.transformers import PagedKVPool

from .common import (
    BLOCK_SIZE,
    blocks_for,
    cache_tensor_bytes,
    kv_bytes_per_token,
    random_tokens,
)
from .context import BenchContext
from .peers import DYNAMIC, PAGED_SDPA, STATIC
from .report import Aim, Header, Reported, Section, Table, mib
from .runner import Runner

__all__ = ["MemoryResult", "MemoryRow", "run"]

AIM_MEMORY_RATIO = Aim(1.05, fmt="{:.2f}")
REFERENCE = "DynamicCache (left padding)"
HEADERS = ["cache", "KV bytes reserved", "real-token bytes", "reserved / real", "aim", "status", "same greedy tokens",
           "how reserved bytes are measured"]  # fmt: skip


@dataclass
class MemoryRow:
    """KV bytes one cache reserved for the batch.

    Example:
        >>> MemoryRow("StaticCache", 2 * 45 * 256, "preallocated", identical=True).reserved_bytes
        23040
    """

    cache: str
    reserved_bytes: int
    how: str
    identical: bool


@dataclass
class MemoryResult(Reported):
    """Mixed-length left-padded batch: KV bytes reserved per byte of real tokens, per cache.

    Example:
        Prompts of 20 and 40 tokens, 5 new tokens, 256 KV bytes per token; blocks of 16 tokens hold 24 + 44 tokens in
        2 + 3 blocks, a ``StaticCache`` reserves 2 rows x 45 positions:

        >>> rows = [MemoryRow("PagedCache", 5 * 16 * 256, "blocks held", True),
        ...         MemoryRow("StaticCache", 2 * 45 * 256, "preallocated", True)]
        >>> result = MemoryResult(Header(True, "Llama", "laptop"), prompt_lengths=[20, 40], new_tokens=5,
        ...     bytes_per_token=256, rows=rows, pool_capacity_bytes=65536)
        >>> result.stored_tokens, result.real_bytes
        (68, 17408)
        >>> round(result.ratio("PagedCache"), 3), round(result.ratio("StaticCache"), 3)
        (1.176, 1.324)
    """

    head: Header
    prompt_lengths: list[int]
    new_tokens: int
    bytes_per_token: int
    rows: list[MemoryRow]
    pool_capacity_bytes: int

    @property
    def stored_tokens(self) -> int:
        """Real tokens stored: every prompt token and every generated token but the last (never fed back)."""
        return sum(n + self.new_tokens - 1 for n in self.prompt_lengths)

    @property
    def real_bytes(self) -> int:
        """Bytes the real tokens need: stored tokens x per-token KV bytes."""
        return self.stored_tokens * self.bytes_per_token

    def ratio(self, cache: str) -> float:
        """Reserved bytes / real-token bytes of one cache."""
        row = next(r for r in self.rows if r.cache == cache)
        return row.reserved_bytes / self.real_bytes

    def section(self) -> Section:
        """The report: workload, model, machine, bytes and ratios with the aim."""
        workload = (
            f"a batch of {len(self.prompt_lengths)} prompts of {sorted(self.prompt_lengths)} tokens (seeded, "
            f"left-padded to {max(self.prompt_lengths)}), {self.new_tokens} new tokens, greedy, one `generate` call"
        )
        measured = (
            f"after `generate`; real-token bytes = {self.stored_tokens} stored tokens (prompt + generated - 1 per row: "
            f"the last sampled token is never stored) x {self.bytes_per_token} bytes of keys and values per token over "
            "all layers"
        )
        figures = Table(HEADERS, [self._row(row) for row in self.rows])
        note = (
            f"The PagedCache took its blocks from a pool of {mib(self.pool_capacity_bytes)} (sized for this batch; "
            "a pool is shared by every cache and request that uses it, so only the blocks held count for this batch)."
        )
        return Section("3. KV memory of a mixed-length batch", self.head, workload, measured, body=[figures, note])

    def _row(self, row: MemoryRow) -> list[str]:
        reserved = row.reserved_bytes / self.real_bytes
        paged = row.cache.startswith("PagedCache")
        same = "reference" if row.cache == REFERENCE else ("yes" if row.identical else "**no**")
        aim = [AIM_MEMORY_RATIO.text, AIM_MEMORY_RATIO.status(reserved)] if paged else ["-", "-"]
        return [row.cache, mib(row.reserved_bytes), mib(self.real_bytes), f"{reserved:.3f}", *aim, same, row.how]


def run(ctx: BenchContext) -> MemoryResult:
    """8 prompts of 64-1024 tokens (quick: 4 of 32-256), left padding, 128 new tokens (quick: 16): KV bytes reserved
    / real-token bytes for ``PagedCache``, ``DynamicCache`` and ``StaticCache``.

    Example:
        >>> from pagedcore.benchmarks import BenchOptions
        >>> ctx = BenchContext(BenchOptions(quick=True, progress=False, model_size="tiny"))
        >>> result = run(ctx)
        >>> [(row.cache, row.identical) for row in result.rows]
        [('PagedCache', True), ('DynamicCache (left padding)', True), ('StaticCache', True)]
        >>> result.ratio("PagedCache") <= 1.05  # the aim  # doctest: +SKIP
        True
    """
    quick, model, seed = ctx.quick, ctx.model(), ctx.options.seed
    batch, (lo, hi), new = (4, (32, 256), 16) if quick else (8, (64, 1024), 128)
    rng = random.Random(seed + 3)
    lengths = [lo, hi] + [rng.randint(lo, hi) for _ in range(batch - 2)]
    rng.shuffle(lengths)
    prompts = [random_tokens(rng, n, model.config.vocab_size) for n in lengths]
    pool = PagedKVPool(model, num_blocks=sum(blocks_for(n + new) for n in lengths) + 4, block_size=BLOCK_SIZE)
    with Runner(ctx, "memory: KV bytes per cache", 3) as runner:
        rows = _rows(runner, model, prompts, new, pool)
    return MemoryResult(
        head=runner.header(),
        prompt_lengths=lengths,
        new_tokens=new,
        bytes_per_token=kv_bytes_per_token(model),
        rows=rows,
        pool_capacity_bytes=pool.memory_stats().capacity_bytes,
    )


def _rows(
    runner: Runner, model: PreTrainedModel, prompts: list[list[int]], new: int, pool: PagedKVPool
) -> list[MemoryRow]:
    """The batch through ``generate`` with each cache: the bytes each reserved, and its tokens against the
    DynamicCache's."""
    batch, width = len(prompts), max(len(p) for p in prompts)
    dynamic = DYNAMIC.new_cache(model)
    reference = DYNAMIC.batch(model, prompts, new, dynamic)
    runner.tick()
    with PAGED_SDPA.cache(model, pool=pool) as paged:
        paged_out = PAGED_SDPA.batch(model, prompts, new, paged)
        stats = paged.memory_stats()
    runner.tick()
    static = STATIC.new_cache(model, width + new)
    static_out = STATIC.batch(model, prompts, new, static)
    runner.tick()
    held = (
        f"`memory_stats().held_bytes`: {stats.blocks} blocks of {BLOCK_SIZE} tokens held ({stats.tokens} tokens "
        f"stored, {stats.padding_tokens} padding positions not stored)"
    )
    return [
        MemoryRow("PagedCache", stats.held_bytes, held, paged_out == reference),
        MemoryRow(REFERENCE, cache_tensor_bytes(dynamic),
                  f"bytes of its key/value tensors: {batch} rows x {width + new - 1} positions", True),
        MemoryRow("StaticCache", cache_tensor_bytes(static),
                  f"bytes of its preallocated key/value tensors: {batch} rows x max_cache_len {width + new}",
                  static_out == reference),
    ]  # fmt: skip
