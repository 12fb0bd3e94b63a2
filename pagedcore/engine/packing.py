"""A step's tokens packed for a torch forward: one row of every scheduled token, and each KV group's metadata.

Any runner whose attention reads the pool through :class:`~pagedcore.attention.PagedAttentionMetadata` packs its
step with :func:`pack_tokens` (the transformers runner and the plain-PyTorch one alike): every scheduled token of
every sequence in one ``(1, num_tokens)`` row without padding, their positions, and per KV group the sequences'
block tables (padded with the pool's zero block), their dropped-block offsets (sliding windows) and the slots the
new tokens' keys and values go to. One pass over the plan: a decode step of hundreds of sequences spends its host
time here. The block tables come from each group's :class:`~pagedcore.table_rows.TableRows`, where a sequence's
row is rewritten only when its table changed: one gather per step. A decode step of many sequences (one token each,
from :data:`GATHER_FROM` sequences) reads each one's token, position and table row in list comprehensions and
computes every slot at once from the gathered tables, rather than asking each table for its slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedcore.attention import PagedAttentionMetadata, long_tensor
from pagedcore.block_tables import BlockTables
from pagedcore.errors import InvalidBlockError
from pagedcore.kv_pool import KVPool
from pagedcore.scheduler import ScheduledSequence

__all__ = ["GATHER_FROM", "PackedTokens", "pack_tokens"]

# Decode steps of at least this many sequences take their slots in one gather (_pack_decode): below it the gather's
# fixed cost (a few numpy calls, ~20 us) outweighs the per-sequence calls it saves (hot, 1 thread: 0.049 vs 0.042 ms
# at 32 rows, 0.049 vs 0.060 at 48, 0.19 vs 0.31 at 256).
GATHER_FROM = 40


@dataclass(frozen=True)
class PackedTokens:
    """A step's packed inputs.

    Attributes:
        input_ids / position_ids: the packed tokens and their positions.
        metadata: per KV group, the paged-attention metadata of the packed sequences (on the CPU).

    Example:
        >>> PackedTokens([], [], []).num_tokens
        0
    """

    input_ids: list[int]
    position_ids: list[int]
    metadata: list[PagedAttentionMetadata]

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this step."""
        return len(self.input_ids)


def pack_tokens(scheduled: Sequence[ScheduledSequence], kv: KVPool) -> PackedTokens:
    """Pack a step's plan (call it under the pool's lock: it reads the live block tables). The pool's zero block
    (``kv.num_blocks``: a layer tensor holds one block more) pads the tables.

    Example:
        >>> from pagedcore import Scheduler, SequenceState
        >>> kv = KVPool(num_blocks=8, block_size=4)
        >>> scheduler = Scheduler(kv)
        >>> scheduler.add(SequenceState("r", [5, 6, 7, 8, 9], max_new_tokens=2))
        >>> packed = pack_tokens(scheduler.schedule().scheduled, kv)
        >>> packed.input_ids, packed.position_ids, packed.metadata[0].block_tables.tolist()
        ([5, 6, 7, 8, 9], [0, 1, 2, 3, 4], [[0, 1]])
    """
    if len(scheduled) >= GATHER_FROM and all(item.num_new_tokens == 1 for item in scheduled):
        return _pack_decode(scheduled, kv)
    return _pack_rows(scheduled, kv)


def _pack_rows(scheduled: Sequence[ScheduledSequence], kv: KVPool) -> PackedTokens:
    """:func:`pack_tokens` sequence by sequence: any mix of prompt chunks and decode tokens."""
    group_ids = range(len(kv.groups))
    tokens: list[int] = []
    positions: list[int] = []
    rows: list[list[int]] = [[] for _ in group_ids]
    offsets: list[list[int]] = [[] for _ in group_ids]
    slots: list[list[int]] = [[] for _ in group_ids]
    query_lens: list[int] = []
    seq_lens: list[int] = []
    for item in scheduled:  # one pass: per token only list appends
        seq = item.sequence
        start, count, end = item.start, item.num_new_tokens, item.end
        if count == 1:
            tokens.append(seq.token_ids[start])
            positions.append(start)
        else:
            tokens.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
        query_lens.append(count)
        seq_lens.append(end)
        blocks = item.blocks
        for g in group_ids:
            rows[g].append(blocks.table_row(g))
            offsets[g].append(blocks.num_dropped(g))
            slots[g].extend(blocks.slots(g, start, end))
    pad = kv.num_blocks
    metadata = [
        PagedAttentionMetadata(
            block_size=kv.block_size,
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_offsets=offsets[g.index],
            block_tables=g.rows.gather(rows[g.index]),
            slot_mapping=long_tensor(slots[g.index]),
            sliding_window=g.sliding_window,
            pad_block=pad,
            group_kind=g.kind,
        )
        for g in kv.groups
    ]
    return PackedTokens(tokens, positions, metadata)


def _pack_decode(scheduled: Sequence[ScheduledSequence], kv: KVPool) -> PackedTokens:
    """:func:`pack_tokens` for a step that computes one token of every sequence: per sequence only list
    comprehensions read its token, position and table row; the slots come from the gathered tables in one numpy
    gather (``table[position // block_size - dropped] * block_size + position % block_size``; numpy, not torch: a
    torch op costs tens of microseconds right after a forward, and a step of 64 rows would lose what it saves), after
    the check :meth:`~pagedcore.block_tables.BlockTables.slots` makes (each position held: inside the live blocks,
    below the tables' token count)."""
    bs, pad, n = kv.block_size, kv.num_blocks, len(scheduled)
    positions = [item.start for item in scheduled]
    tokens = [item.sequence.token_ids[p] for item, p in zip(scheduled, positions)]
    blocks = [item.blocks for item in scheduled]
    pos = np.array(positions, dtype=np.int64)
    outside = pos >= np.array([b.num_tokens for b in blocks], dtype=np.int64)
    rows = np.arange(n)
    metadata = []
    for g in kv.groups:
        i = g.index
        offsets = [b.num_dropped(i) for b in blocks]
        logical = pos // bs
        if any(offsets):
            logical -= np.array(offsets, dtype=np.int64)
        if outside.any() or (logical < 0).any():
            _refuse(blocks, positions, i)
        stacked = g.rows.gather([b.table_row(i) for b in blocks])
        slots = stacked.numpy()[rows, logical].astype(np.int64) * bs + pos % bs
        metadata.append(
            PagedAttentionMetadata(
                block_size=bs,
                query_lens=[1] * n,
                seq_lens=[p + 1 for p in positions],
                block_offsets=offsets,
                block_tables=stacked,
                slot_mapping=torch.from_numpy(slots),
                sliding_window=g.sliding_window,
                pad_block=pad,
                group_kind=g.kind,
            )
        )
    return PackedTokens(tokens, positions, metadata)


def _refuse(blocks: list[BlockTables], positions: list[int], group: int) -> None:
    """Raise the error :meth:`~pagedcore.block_tables.BlockTables.slots` raises for the first position not held."""
    for b, p in zip(blocks, positions):
        b.slots(group, p, p + 1)
    raise InvalidBlockError("slots: a position is not held")  # unreachable: slots() raised above
