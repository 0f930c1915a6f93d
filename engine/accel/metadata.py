"""One step's inputs for an accelerator attention backend, in device buffers allocated once.

Owns: `SeqMetadata` (what the Triton and NPU backends read: per sequence, per token) and
`StepBuffers` (the device tensors it and the step's token ids and positions live in, sized at
start by `--max-num-batched-tokens`, `--max-num-seqs` and `--max-model-len`: a step copies into
them and allocates nothing on the device; the CUDA graphs, `engine.accel.cuda_graphs`, are
captured over the same buffers). In: the model runner's flat batch (decodes first, then the
prefill chunks; `engine.model_runner`). Out: views of the buffers.

Terms as in vLLM's attention metadata: `query_start_loc [S + 1]` cumulative query lengths,
`seq_lens [S]` each sequence's context after this step (cached + new tokens), `block_tables
[S, max_blocks]` (rows as wide as the buffer; a kernel reads only the blocks a sequence has).
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass

import torch


def pad_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one host tensor `[len(tables), max(1, longest)]` int32, rows padded
    with block 0 (never read: a kernel reads only the blocks a sequence's context covers).
    Built in one flat `array` (a tensor per row cost 5 us each: 1.3 ms for 256 rows)."""
    width = max((len(t) for t in tables), default=1) or 1
    if not tables:
        return torch.zeros(0, width, dtype=torch.int32)
    flat, pad = array("i"), [0] * width
    for t in tables:
        flat.extend(t)
        flat.extend(pad[len(t):])
    return torch.frombuffer(flat, dtype=torch.int32).view(len(tables), width)


@dataclass
class SeqMetadata:
    """Device views for the step (see the module docstring) plus the host-side figures the
    launch needs: `max_query_len` (grid size), the query and context lengths as lists (the NPU
    operators take them as host ints), `num_decodes` (sequences with one query token, first)."""

    backend: object                      # TritonAttention or NpuAttention
    slot_mapping: torch.Tensor           # [T] int64, -1 = padding (nothing written)
    query_start_loc: torch.Tensor        # [S + 1] int32
    seq_lens: torch.Tensor               # [S] int32
    block_tables: torch.Tensor           # [S, max_blocks] int32
    max_query_len: int
    query_lens: list[int]
    seq_lens_host: list[int]
    num_decodes: int


class StepBuffers:
    """Device buffers for a step's inputs, allocated once.

    `max_tokens`: tokens a step may hold (`--max-num-batched-tokens`, speculative drafts
    included); `max_seqs`: sequences a step may hold (`--max-num-seqs`); `max_blocks`: blocks a
    sequence may hold (`cdiv(max_model_len, block_size)`). A step larger than that raises
    ValueError (the scheduler never builds one)."""

    def __init__(self, device: torch.device, max_tokens: int, max_seqs: int,
                 max_blocks: int) -> None:
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)
        self.arange = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)

    def fill(self, backend, ids: list[int], positions: torch.Tensor, slots: torch.Tensor,
             query_lens: list[int], seq_lens: list[int],
             tables: list[list[int]] | torch.Tensor, num_decodes: int,
             pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor, SeqMetadata]:
        """Copy a step into the buffers: token `ids` and `positions [T]`, `slots [T]` int64,
        per sequence its query and context lengths and block table (lists, or already
        `pad_tables`'d). With `pad_to` (a CUDA graph's batch size, decode-only steps) rows
        T..pad_to-1 are padding: token 0, position 0, no slot, a context of 0 (their attention
        writes zeros).

        Returns (input_ids, positions, metadata), views of the buffers. Raises ValueError when
        the step exceeds the buffers."""
        num_tokens, num_seqs = len(ids), len(seq_lens)
        host_tables = tables if isinstance(tables, torch.Tensor) else pad_tables(tables)
        width = host_tables.shape[1]
        rows = pad_to or num_tokens
        if rows > self.max_tokens or max(num_seqs, pad_to or 0) > self.max_seqs \
                or width > self.max_blocks:
            raise ValueError(f"step of {num_tokens} tokens, {num_seqs} sequences, {width} blocks "
                             f"exceeds the step buffers ({self.max_tokens}, {self.max_seqs}, "
                             f"{self.max_blocks})")
        self.input_ids[:num_tokens].copy_(torch.tensor(ids, dtype=torch.long), non_blocking=True)
        self.positions[:num_tokens].copy_(positions, non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(slots, non_blocking=True)
        self.block_tables[:num_seqs, :width].copy_(host_tables, non_blocking=True)
        self.seq_lens[:num_seqs].copy_(torch.tensor(seq_lens, dtype=torch.int32),
                                       non_blocking=True)
        seqs = num_seqs
        if pad_to is not None:                  # a decode graph: one token per row, padded
            self.input_ids[num_tokens:pad_to].zero_()
            self.positions[num_tokens:pad_to].zero_()
            self.slot_mapping[num_tokens:pad_to].fill_(-1)
            self.seq_lens[num_seqs:pad_to].zero_()
            query_start = self.arange[:pad_to + 1]
            seqs = pad_to
        else:
            query_start = self.query_start_loc[:num_seqs + 1]
            query_start.copy_(torch.tensor([0, *itertools.accumulate(query_lens)],
                                           dtype=torch.int32), non_blocking=True)
        meta = SeqMetadata(
            backend=backend, slot_mapping=self.slot_mapping[:rows],
            query_start_loc=query_start, seq_lens=self.seq_lens[:seqs],
            block_tables=self.block_tables[:seqs], max_query_len=max(query_lens, default=1),
            query_lens=list(query_lens),
            seq_lens_host=list(seq_lens), num_decodes=num_decodes)
        return self.input_ids[:rows], self.positions[:rows], meta
