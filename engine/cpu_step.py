"""A decode-only step's inputs for the CPU kernels, written into kept buffers.

Owns: `DecodeInputs`, int64 / int32 tensors allocated once (token ids, positions, slot
mapping, context lengths `[max_seqs]`, block tables `[max_seqs, max_blocks]`) and written
through numpy views of the same memory, so that a decode step's inputs cost no torch op: at one
row, a torch op that takes 15 µs warm took 100-300 µs as the first code after the weights
streamed through the caches (docs/cpu.md, "Single stream on an AVX2 host"), and the step built
six of them. A row's block table is written only where it changed since the row's last write
(tables grow by a block every `block_size` tokens), the persistent-batch idea of vLLM v1's
`InputBatch` / `BlockTable`.

In: the model runner's decode requests (`ScheduledRequest`s, one token each) and their runner
states (`block_table`, `table_edits`). Out: tensors for `AttentionMetadata` (`slot_mapping`,
`kernel_block_tables`, `kernel_ctx_lens`), `input_ids` and `positions` — views valid until the
next `fill` — and sample_idx, the same contract as `ModelRunner._prepare`.
"""

from __future__ import annotations

import torch

from engine.accel.step import decode_rows


class DecodeInputs:
    """Kept buffers for decode steps of up to `max_seqs` requests whose contexts span up to
    `max_blocks` blocks each (see the module docstring)."""

    def __init__(self, max_seqs: int, max_blocks: int) -> None:
        self.max_seqs, self.max_blocks = max_seqs, max_blocks
        self._ids = torch.zeros(max_seqs, dtype=torch.long)
        self._positions = torch.zeros(max_seqs, dtype=torch.long)
        self._slots = torch.zeros(max_seqs, dtype=torch.long)
        self._ctx_lens = torch.zeros(max_seqs, dtype=torch.int32)
        self._tables = torch.zeros((max_seqs, max_blocks), dtype=torch.int32)
        self._np = [t.numpy() for t in (self._ids, self._positions, self._slots,
                                        self._ctx_lens, self._tables)]
        # Per row: (the state whose table it holds, that state's table_edits, blocks written).
        self._rows: list[tuple[object, int, int] | None] = [None] * max_seqs
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}

    def fits(self, num_seqs: int, positions_max: int, block_size: int) -> bool:
        """Whether a decode step of `num_seqs` rows, the furthest at `positions_max`, fits."""
        return num_seqs <= self.max_seqs and positions_max // block_size < self.max_blocks

    def fill(self, ordered, states, block_size: int):
        """(input_ids `[n]` int64, positions `[n]` int64, slot mapping `[n]` int64, block
        tables `[n, max_blocks]` int32, context lengths `[n]` int32, sample_idx) of the decode
        rows `ordered` with their runner `states`; the caller checked `fits`. Table entries
        past a row's context are stale: the kernels read `ceil(ctx_len / block_size)` of them."""
        n = len(ordered)
        ids, positions, slots, sample_idx = decode_rows(ordered, states, block_size)
        np_ids, np_pos, np_slots, np_ctx, np_tables = self._np
        np_ids[:n] = ids
        np_pos[:n] = positions
        np_slots[:n] = slots
        np_ctx[:n] = [p + 1 for p in positions]
        rows = self._rows
        for i, (pos, st) in enumerate(zip(positions, states)):
            need = pos // block_size + 1
            held = rows[i]
            done = held[2] if held is not None and held[0] is st and held[1] == st.table_edits \
                else 0
            if done < need:
                np_tables[i, done:need] = st.block_table[done:need]
                rows[i] = (st, st.table_edits, need)
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = (self._ids[:n], self._positions[:n], self._slots[:n],
                                      self._tables[:n], self._ctx_lens[:n])
        return (*views, sample_idx)
