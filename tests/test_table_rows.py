"""TableRows (pagedcore/table_rows.py): the block tables a step packs, kept as rows of one buffer between steps."""

from __future__ import annotations

import random
from array import array

import torch

from pagedcore import BlockTables, KVPool
from pagedcore.attention import stack_block_tables
from pagedcore.table_rows import TableRows


def test_gather_is_what_stack_block_tables_makes_of_the_same_tables_through_growth_and_shrinking() -> None:
    rng = random.Random(0)
    rows = TableRows(pad_block=99, rows=2, width=2)  # small: rows and width both grow on the way
    held: dict[int, list[int]] = {}
    for _ in range(300):
        action = rng.random()
        if action < 0.25 or not held:
            held[rows.acquire()] = []
        elif action < 0.35:
            row = rng.choice(list(held))
            rows.release(row)
            del held[row]
        else:
            row = rng.choice(list(held))
            table = [rng.randrange(99) for _ in range(rng.randrange(0, 40))]  # longer and shorter than before
            rows.write(row, array("i", table))
            held[row] = table
        if held:
            order = rng.sample(list(held), len(held))
            gathered = rows.gather(order)
            assert gathered.dtype == torch.int32
            assert gathered.tolist() == stack_block_tables([held[r] for r in order], 99).tolist()
        assert rows.num_used == len(held)


def test_a_released_row_comes_back_as_padding_and_a_gather_is_a_copy() -> None:
    rows = TableRows(pad_block=7)
    a = rows.acquire()
    rows.write(a, array("i", [1, 2, 3]))
    before = rows.gather([a])
    rows.release(a)
    assert before.tolist() == [[1, 2, 3]]  # the gathered tensor does not see later changes of the buffer
    b = rows.acquire()
    assert b == a and rows.gather([b]).tolist() == [[7]]  # width at least 1, all padding
    assert rows.gather([]).shape == (0, 1)


def test_a_sequence_row_is_written_when_its_table_changes_and_freed_with_it() -> None:
    pool = KVPool(num_blocks=16, block_size=4, sliding_windows=(None, 8))
    seq = BlockTables(pool)
    seq.append(6)
    full, sliding = pool.groups
    row = seq.table_row(0)
    writes = []
    original = TableRows.write

    def counted(self: TableRows, row: int, table: array[int]) -> None:
        writes.append(row)
        original(self, row, table)

    TableRows.write = counted  # type: ignore[method-assign]
    try:
        assert seq.table_row(0) == row and writes == []  # unchanged table: nothing written
        seq.append(1)  # position 6: inside the second block, the table is the same
        assert seq.table_row(0) == row and writes == []
        seq.append(2)  # positions 7 and 8: a third block
        assert seq.table_row(0) == row and writes == [row]
    finally:
        TableRows.write = original  # type: ignore[method-assign]
    assert full.rows.gather([row]).tolist() == [seq.table(0)]
    child = seq.fork()
    assert child.table_row(0) != row and full.rows.num_used == 2
    seq.drop_out_of_window(9)  # the sliding group lets go of blocks: its row follows
    assert sliding.rows.gather([seq.table_row(1)]).tolist() == [seq.table(1)]
    seq.truncate(3)
    assert full.rows.gather([seq.table_row(0)]).tolist() == [seq.table(0)]
    seq.release()
    child.release()
    assert full.rows.num_used == sliding.rows.num_used == 0
