"""A step's tokens packed for a torch forward: one row of every scheduled token, and each KV group's metadata.

Any runner whose attention reads the pool through :class:`~pagedcore.attention.PagedAttentionMetadata` packs its
step with :func:`pack_tokens` (the transformers runner and the plain-PyTorch one alike): every scheduled token of
every sequence in one ``(1, num_tokens)`` row without padding, their positions, and per KV group the sequences'
block tables (padded with the pool's zero block), their dropped-block offsets (sliding windows) and the slots the
new tokens' keys and values go to. One pass over the plan: a decode step of hundreds of sequences spends its host
time here.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedcore.attention import PagedAttentionMetadata, stack_block_tables
from pagedcore.kv_pool import KVPool
from pagedcore.scheduler import ScheduledSequence

__all__ = ["PackedTokens", "pack_tokens"]


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
    group_ids = range(len(kv.groups))
    tokens: list[int] = []
    positions: list[int] = []
    tables: list[list[array[int]]] = [[] for _ in group_ids]
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
            tables[g].append(blocks.table_array(g))
            offsets[g].append(blocks.num_dropped(g))
            slots[g].extend(blocks.slots(g, start, end))
    pad = kv.num_blocks
    metadata = [
        PagedAttentionMetadata(
            block_size=kv.block_size,
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_offsets=offsets[g.index],
            block_tables=stack_block_tables(tables[g.index], pad),
            slot_mapping=torch.tensor(slots[g.index], dtype=torch.int64),
            sliding_window=g.sliding_window,
            pad_block=pad,
            group_kind=g.kind,
        )
        for g in kv.groups
    ]
    return PackedTokens(tokens, positions, metadata)
