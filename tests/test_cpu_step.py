"""A decode step's kept input buffers (`engine.cpu_step.DecodeInputs`): each row's block table
written where it changed, never stale where the kernels read it."""

from types import SimpleNamespace

import torch

from engine.cpu_step import DecodeInputs


def decode(position: int, token: int = 7):
    return SimpleNamespace(start_position=position, token_ids=[token], sample=True)


def state(table: list[int]):
    return SimpleNamespace(block_table=table, table_edits=0)


def read(inputs: DecodeInputs, ordered, states, bs: int = 4):
    ids, positions, slots, tables, ctx_lens, sample_idx = inputs.fill(ordered, states, bs)
    lens = ctx_lens.tolist()
    return (ids.tolist(), positions.tolist(), slots.tolist(),
            [tables[i, :-(-n // bs)].tolist() for i, n in enumerate(lens)], lens, sample_idx)


def test_tables_follow_growth_new_rows_and_cut_back_tables():
    inputs, bs = DecodeInputs(max_seqs=4, max_blocks=8), 4
    a, b = state([3, 9]), state([5])
    assert read(inputs, [decode(5, 11), decode(2, 12)], [a, b]) == (
        [11, 12], [5, 2], [9 * bs + 1, 5 * bs + 2], [[3, 9], [5]], [6, 3], [(0, 0), (1, 1)])
    a.block_table.append(4)                       # a grows into a third block
    assert read(inputs, [decode(8), decode(3)], [a, b])[3] == [[3, 9, 4], [5]]
    c = state([6, 2])                             # another request takes row 0
    assert read(inputs, [decode(4), decode(3)], [c, b])[3:5] == ([[6, 2], [5]], [5, 4])
    b.block_table.append(1)                       # ... and b's second block is written too
    assert read(inputs, [decode(4), decode(4)], [c, b])[3:5] == ([[6, 2], [5, 1]], [5, 5])
    c.block_table[1:] = [8]                       # c's table cut back and regrown (recompute)
    c.table_edits += 1
    assert read(inputs, [decode(5)], [c])[3] == [[6, 8]]
    assert inputs.fits(4, 31, bs) and not inputs.fits(5, 0, bs) and not inputs.fits(1, 32, bs)


def test_views_are_kept_per_batch_size():
    inputs = DecodeInputs(max_seqs=4, max_blocks=2)
    first = inputs.fill([decode(0)], [state([1])], 4)
    again = inputs.fill([decode(1)], [state([1])], 4)
    assert all(x is y for x, y in zip(first[:5], again[:5]))
    assert first[0].dtype == torch.long and first[3].dtype == torch.int32
