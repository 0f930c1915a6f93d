"""A step's flat batch as an accelerator backend reads it: token ids, positions, slot mapping
and per-sequence metadata, copied into the runner's `StepBuffers`.

Owns: `prepare_step` (a decode-only step takes a short path without tensor ops over tokens)
and `decode_rows` (the CPU path's decode rows too).
In: the model runner's ordered requests (decodes first, then prefill
chunks; `engine.model_runner`) and their block tables. Out: (input_ids, positions,
`SeqMetadata`, sample_idx), the same contract as the CPU path's `ModelRunner._prepare`.
"""

from __future__ import annotations

import torch

from engine.accel.metadata import SeqMetadata, StepBuffers, pad_tables


def prepare_step(buffers: StepBuffers, backend, ordered, states, num_decodes: int,
                 block_size: int, pad_to: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, SeqMetadata, list[tuple[int, int]]]:
    """Build the step for `ordered` (`ScheduledRequest`s, decodes first) with their runner
    `states` (block tables). sample_idx: (request index, flat row) for each sampled row — the
    last token of a chunk that samples, every token of a chunk verifying drafts. `pad_to`: a
    CUDA graph's batch size (decode-only steps). Per token, positions and slots are computed
    with tensor ops over the padded block tables (no Python loop over a prefill's tokens).
    Raises ValueError past the buffers' sizes."""
    if num_decodes == len(ordered):
        return _prepare_decodes(buffers, backend, ordered, states, block_size, pad_to)
    ids: list[int] = []
    query_lens, seq_lens, tables = [], [], []
    sample_idx: list[tuple[int, int]] = []
    row = 0
    for i, (s, st) in enumerate(zip(ordered, states)):
        n, start = len(s.token_ids), s.start_position
        ids.extend(s.token_ids)
        query_lens.append(n)
        seq_lens.append(start + n)
        tables.append(st.block_table[:-(-(start + n) // block_size)])
        if i >= num_decodes and s.num_drafts:          # verify: a row at every position
            sample_idx.extend((i, row + j) for j in range(n))
        elif s.sample:
            sample_idx.append((i, row + n - 1))
        row += n
    host_tables = pad_tables(tables)
    lens = torch.tensor(query_lens)
    seq_of_token = torch.repeat_interleave(torch.arange(len(lens)), lens)
    first_row = torch.cumsum(lens, 0) - lens                 # each sequence's first flat row
    positions = (torch.arange(row) - first_row[seq_of_token]
                 + (torch.tensor(seq_lens) - lens)[seq_of_token])
    slots = (host_tables[seq_of_token, positions // block_size].long() * block_size
             + positions % block_size)
    input_ids, pos, meta = buffers.fill(backend, ids, positions, slots, query_lens, seq_lens,
                                        host_tables, num_decodes, pad_to)
    return input_ids, pos, meta, sample_idx


def decode_rows(ordered, states, block_size: int
                ) -> tuple[list[int], list[int], list[int], list[tuple[int, int]]]:
    """The decode rows of a step, one token each (`ordered` `ScheduledRequest`s with their
    runner `states`, block tables): (token ids, positions, slots `block * block_size +
    offset`, sample_idx `(i, i)` for the rows that sample) as plain lists. Shared by the CPU
    path (`ModelRunner._prepare`) and the accelerators' decode-only steps."""
    bs = block_size
    ids, positions, slots, sample_idx = [], [], [], []
    for i, (s, st) in enumerate(zip(ordered, states)):
        pos = s.start_position
        ids.append(s.token_ids[0])
        positions.append(pos)
        slots.append(st.block_table[pos // bs] * bs + pos % bs)
        if s.sample:
            sample_idx.append((i, i))
    return ids, positions, slots, sample_idx


def _prepare_decodes(buffers: StepBuffers, backend, ordered, states, block_size: int,
                     pad_to: int | None):
    """`prepare_step` for a decode-only step (every request one token, the CUDA-graph case):
    positions and slots in plain Python, one token a request — no tensor ops over tokens."""
    ids, positions, slots, sample_idx = decode_rows(ordered, states, block_size)
    tables = [st.block_table[:pos // block_size + 1] for pos, st in zip(positions, states)]
    input_ids, pos, meta = buffers.fill(backend, ids, torch.tensor(positions),
                                        torch.tensor(slots), [1] * len(ordered),
                                        [p + 1 for p in positions], pad_tables(tables),
                                        len(ordered), pad_to)
    return input_ids, pos, meta, sample_idx
