"""Model runner: executes one `SchedulerOutput` on the device and returns sampled tokens.

Owns: the physical KV cache `[num_layers, 2, num_kv_heads, num_gpu_blocks, block_size,
head_dim]` on the device (head-major, see `engine.attention`), the CPU swap cache of the same
layout with `num_cpu_blocks`, per-request state that persists between steps (block table,
sampling row), and the device's compiled kernels (`Device.kernels`; None → pure torch). It
never touches a `Request`: everything arrives in the `SchedulerOutput` (full data once, diffs
after).

Per step: drop finished / preempted requests' state → swap out, swap in, copy-on-write →
apply block-table diffs → build the flat batch (decode-like requests first, then prefill
chunks; no padding between requests for the dense layers), the slot mapping and the attention
metadata (a block table per token for the kernels; decode groups and prefill chunks for the
torch path) → forward (meanwhile, on a worker thread, the grammar masks of the rows with
structured outputs, `engine.structured`) → logits only for the requests that sample (and every
prompt row of those that asked for prompt logprobs, `engine.prompt_logprobs`) → sampler →
each matcher consumes its token. A request verifying speculative drafts runs as a chunk of
1 + d tokens, is sampled at every one of them, and keeps the accepted prefix
(`engine.spec_decode.rejection_sampler`). With a draft model the runner also owns the draft's
caches (same block ids and layout, so the one block table serves both; swaps and copies are
mirrored) and lets `engine.spec_decode.draft_model` draft before the target's forward. With an
n-gram proposer (`engine.spec_decode.ngram`) it keeps each request's context and, after
sampling, proposes the drafts of each request that sampled for its next step: they leave in
`ModelRunnerOutput.draft_token_ids`, for the scheduler to keep on the request.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.accel import attention_backend, fused_ops
from engine.accel.metadata import StepBuffers
from engine.accel.step import decode_rows, prepare_step
from engine.attention import (SMALL_DECODE_BATCH, AttentionMetadata, DecodeGroup, PrefillChunk,
                              build_prefill_mask, head_major_cache_shape)
from engine.cpu_step import DecodeInputs
from engine.device import Device
from engine.models.llama import LlamaForCausalLM
from engine.prompt_logprobs import chunks_to_score
from engine.prompt_logprobs import score as score_prompt_logprobs
from engine.sampler import Sampler, SamplingRow
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.rejection_sampler import accepted_prefix
from engine.structured.mask import fill_bitmask
from scheduler.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput


# A decode group's longest context is at most this many times its shortest (in blocks): decodes
# are padded to their group's longest context, not the step's.
DECODE_GROUP_RATIO = 1.5
# ... and gathers at most this many blocks (count x longest), so that its gathered K/V stays
# in cache: past that the gather and the matmuls slow down several-fold (measured below).
DECODE_GROUP_MAX_BLOCKS = 512


def decode_groups(ctx_lens: list[int], block_size: int) -> list[tuple[int, int]]:
    """Split decodes sorted by context length (tokens, ascending) into [start, end) groups.

    From the longest down, a group takes shorter decodes while their block count times
    `DECODE_GROUP_RATIO` still reaches the group's longest, and always at least
    `SMALL_DECODE_BATCH` of them (small groups cost more per op than padding saves); a short
    remainder joins the group above it. One group when the ratio is None."""
    n = len(ctx_lens)
    if n == 0:
        return []
    if DECODE_GROUP_RATIO is None:
        return [(0, n)]
    blocks = [-(-c // block_size) for c in ctx_lens]
    groups, end = [], n
    while end > 0:
        start = end - 1
        while start > 0 and (end - start < SMALL_DECODE_BATCH
                             or (blocks[start - 1] * DECODE_GROUP_RATIO >= blocks[end - 1]
                                 and (end - start + 1) * blocks[end - 1]
                                 <= DECODE_GROUP_MAX_BLOCKS)):
            start -= 1
        groups.append((start, end))
        end = start
    groups.reverse()
    if len(groups) > 1 and groups[0][1] - groups[0][0] < SMALL_DECODE_BATCH:
        groups[1] = (0, groups[1][1])
        groups.pop(0)
    return groups


def _row_spans(ordered: list[ScheduledRequest], num_decodes: int
               ) -> tuple[list[int], list[int]]:
    """(first row, row count) of each request in the step's flat batch: decodes one row each,
    then the prefill chunks (see `ModelRunner._prepare`)."""
    starts, counts, row = [], [], 0
    for i, s in enumerate(ordered):
        n = 1 if i < num_decodes else len(s.token_ids)
        starts.append(row)
        counts.append(n)
        row += n
    return starts, counts


def _index_pair(pairs: list[tuple[int, int]], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, destination) block ids of `pairs` as int64 tensors on `device`."""
    t = torch.tensor(pairs, dtype=torch.long, device=device)
    return t[:, 0], t[:, 1]


@dataclass
class _RequestState:
    block_table: list[int]
    row: SamplingRow
    token_ids: list[int] | None = None    # prompt + output, kept only for an n-gram proposer
    table_edits: int = 0                  # times block_table was cut back (engine.cpu_step)


class ModelRunner:
    """See the module docstring. `eos_token_ids` are masked while `min_tokens` is unmet;
    `proposer` is an `engine.spec_decode.ngram.NgramProposer` (method "ngram"), or None."""

    def __init__(self, model: LlamaForCausalLM, device: Device, block_size: int,
                 num_gpu_blocks: int, num_cpu_blocks: int, eos_token_ids: tuple[int, ...],
                 seed: int = 0, grammars=None, draft_model: LlamaForCausalLM | None = None,
                 proposer=None, max_num_tokens: int = 8192, max_num_seqs: int = 256,
                 kv_quant=None) -> None:
        self.model, self.device, self.block_size = model, device, block_size
        self.kv_quant = kv_quant      # engine.kv_quant.KVQuant: an 8-bit cache; None: model dtype
        # An accelerator's attention backend (engine.accel) and the step buffers it reads.
        self.backend = attention_backend(device.kind, kv_quant)
        if self.backend is not None:
            self.backend.check_dtype(model.dtype)
        self.block_dim = self.backend.block_dim if self.backend is not None else 3
        self.buffers = None if self.backend is None else StepBuffers(
            device.torch_device, max_num_tokens, max_num_seqs,
            -(-model.cos.shape[0] // block_size))
        self.graphs = None            # engine.accel.cuda_graphs.CudaGraphRunner, see capture_graphs
        # The CPU kernels' decode-only steps: their inputs in kept buffers (engine.cpu_step;
        # None: built anew each step).
        self.decode_inputs = None if self.backend is not None else DecodeInputs(
            max_num_seqs, -(-model.cos.shape[0] // block_size))
        self.kv_cache, self.cpu_cache = self._caches(model, num_gpu_blocks, num_cpu_blocks)
        self.drafter = self.draft_kv_cache = self.draft_cpu_cache = None
        if draft_model is not None:       # speculative decoding with a draft model
            self.drafter = DraftModelProposer(draft_model, device.kernels(draft_model.dtype),
                                              block_size)
            self.draft_kv_cache, self.draft_cpu_cache = self._caches(
                draft_model, num_gpu_blocks, num_cpu_blocks)
        self.proposer = proposer
        self.eos_token_ids = eos_token_ids
        self.kernels = device.kernels(model.dtype) if self.backend is None else None
        self.sampler = Sampler(device.torch_device, seed, self.kernels)
        model.set_kernels(self.kernels if self.backend is None
                          else fused_ops(device.kind, model.dtype))
        # Whether the forward pass may take the argmax too (the layer stack's call, where it
        # computes the logits), for steps whose rows are all `Sampler.plain_greedy`; False: the
        # sampler's own argmax, and no rows checked for it.
        self.greedy_in_forward = model.stack is not None and model.stack.has_head
        self.states: dict[str, _RequestState] = {}
        self.grammars = grammars      # engine.structured.grammar.GrammarCompiler, or None
        self._mask_pool: ThreadPoolExecutor | None = None
        self.lora = None              # engine.lora.manager.LoraManager when LoRA is enabled

    def _caches(self, model: LlamaForCausalLM, num_gpu_blocks: int, num_cpu_blocks: int):
        """(device cache, CPU swap cache or None) for `model`, block-aligned with each other."""
        cfg, bd = model.cfg, self.block_dim
        layout = (self.backend.cache_shape if self.backend is not None
                  else head_major_cache_shape)
        kv = self.kv_quant             # 8-bit: uint8 rows of head_dim (+ a scale) bytes
        row, dtype = ((kv.row_bytes(cfg.head_dim), torch.uint8) if kv is not None
                      else (cfg.head_dim, model.dtype))
        shape = layout(cfg.num_layers, cfg.num_kv_heads, num_gpu_blocks, self.block_size, row)
        gpu = self.device.zeros(shape, dtype)
        cpu = None
        if num_cpu_blocks:
            cpu = self.device.swap_pool(shape[:bd] + (num_cpu_blocks,) + shape[bd + 1:], dtype)
        return gpu, cpu

    def capture_graphs(self, enforce_eager: bool = False) -> None:
        """Capture the decode steps' CUDA graphs (`engine.accel.cuda_graphs`) on a CUDA device
        with the Triton backend, unless `enforce_eager`; set any LoRA adapters first (steps with
        adapters run eagerly)."""
        if enforce_eager or self.device.kind != "cuda" or getattr(self.backend, "name", "") \
                != "triton":
            return
        from engine.accel.cuda_graphs import CudaGraphRunner
        self.graphs = CudaGraphRunner(self.model, self.kv_cache, self.buffers, self.backend,
                                      self.buffers.max_seqs)
        self.graphs.capture()

    # ------------------------------------------------------------------ block movement
    def _move_blocks(self, out: SchedulerOutput) -> tuple[int, float] | None:
        """Swap out, swap in, copy-on-write — in the target's caches and the draft's.
        Returns (blocks swapped, seconds) when it swapped, else None."""
        dev = self.device.torch_device
        pairs = [(self.kv_cache, self.cpu_cache)]
        if self.drafter is not None:
            pairs.append((self.draft_kv_cache, self.draft_cpu_cache))
        # The block axis: 3 in [layer, k/v, kv_head, block, slot, dim]; the backend's otherwise.
        bd = self.block_dim
        swap = None
        if out.blocks_to_swap_out or out.blocks_to_swap_in:
            t0 = time.perf_counter()
            for gpu, cpu in pairs:
                if out.blocks_to_swap_out:
                    src, dst = _index_pair(out.blocks_to_swap_out)
                    cpu.index_copy_(bd, dst, gpu.index_select(bd, src.to(dev)).to("cpu"))
                if out.blocks_to_swap_in:
                    src, dst = _index_pair(out.blocks_to_swap_in)
                    gpu.index_copy_(bd, dst.to(dev), cpu.index_select(bd, src).to(dev))
            self.device.synchronize()
            swap = (len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in),
                    time.perf_counter() - t0)
        if out.blocks_to_copy:
            src, dst = _index_pair(out.blocks_to_copy, dev)
            for gpu, _ in pairs:
                gpu.index_copy_(bd, dst, gpu.index_select(bd, src))
        if self.drafter is not None:
            self.drafter.moved(out)
        return swap

    def _update_state(self, s: ScheduledRequest) -> _RequestState:
        if s.is_new:
            stop_ids = tuple(self.eos_token_ids) + tuple(s.sampling_params.stop_token_ids)
            so = s.sampling_params.structured_outputs
            matcher = (self.grammars.matcher(so, s.output_token_ids)
                       if so is not None and self.grammars is not None else None)
            state = _RequestState(list(s.new_block_ids), SamplingRow(
                s.sampling_params, s.prompt_token_ids, list(s.output_token_ids),
                s.choice_index, stop_ids, matcher))
            if self.proposer is not None:
                state.token_ids = s.prompt_token_ids + s.output_token_ids
            self.states[s.request_id] = state
            return state
        state = self.states[s.request_id]
        if s.new_block_ids or s.block_table_start < len(state.block_table):
            if s.block_table_start < len(state.block_table):
                state.table_edits += 1
            del state.block_table[s.block_table_start:]
            state.block_table.extend(s.new_block_ids)
        return state

    def time_swap(self, num_blocks: int = 8) -> tuple[int, float] | None:
        """Copy up to `num_blocks` free blocks' worth to the swap pool and back (a calibration
        before any real swap; the engine calls it at start, when no block holds data).
        Returns (blocks copied, seconds), or None without a swap pool."""
        if self.cpu_cache is None:
            return None
        bd = self.block_dim
        n = min(num_blocks, self.kv_cache.shape[bd], self.cpu_cache.shape[bd])
        ids = list(range(n))
        out = SchedulerOutput(blocks_to_swap_out=list(zip(ids, ids)),
                              blocks_to_swap_in=list(zip(ids, ids)))
        return self._move_blocks(out)

    # ------------------------------------------------------------------ step
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step, in torch's inference mode (entered here unless the caller holds it:
        `engine.core_proc`'s loop does). Raises whatever the forward pass raises (the engine
        handles it)."""
        if torch.is_inference_mode_enabled():
            return self._execute(out)
        with torch.inference_mode():
            return self._execute(out)

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        drafter = self.drafter
        for rid in out.finished_request_ids:
            self.states.pop(rid, None)
            if drafter is not None:
                drafter.forget(rid)
        for rid in out.preempted_request_ids:
            self.states.pop(rid, None)
        timings = dict(swap=self._move_blocks(out))
        if not out.scheduled:
            return ModelRunnerOutput(**timings)
        by_id = {s.request_id: self._update_state(s) for s in out.scheduled}
        scheduled = out.scheduled
        if drafter is not None:               # draft, then score (engine.spec_decode.draft_model)
            scheduled, timings["draft_seconds"], timings["draft_passes"] = drafter.run(
                self, scheduled, by_id, self.draft_kv_cache)
        decodes = [s for s in scheduled if len(s.token_ids) == 1]
        if self.kernels is None and self.backend is None:
            decodes.sort(key=lambda s: s.start_position)      # by context, for decode_groups
        prefills = [s for s in scheduled if len(s.token_ids) > 1]
        ordered = decodes + prefills
        states = [by_id[s.request_id] for s in ordered]
        bucket = (self.graphs.bucket_for(len(ordered)) if self.graphs is not None and not prefills
                  else None)          # a decode step under a CUDA graph (none with LoRA)
        input_ids, positions, meta, sample_idx = self._prepare(ordered, states, len(decodes),
                                                               pad_to=bucket)
        rows_at = [i for i, _ in sample_idx]
        rows = self._sampling_rows(ordered, states, rows_at)
        masks = self._start_masks(rows)         # computed while the forward pass runs
        if self.lora is not None:               # each row's adapter slot (engine.lora)
            self.lora.set_batch([(st.row.params.lora_name, start, n) for st, start, n in
                                 zip(states, *_row_spans(ordered, len(decodes)))])
        scored = chunks_to_score(ordered, states, len(decodes))
        greedy = None                 # the forward pass's argmax of each row, where it took it
        if bucket is not None:
            hidden, logits = self.graphs.replay(bucket)[:len(ordered)], None
        else:
            every_row = len(sample_idx) == input_ids.shape[0] and not scored
            hidden, logits, greedy = self._forward(
                input_ids, positions, meta, every_row,
                greedy=every_row and self.greedy_in_forward and Sampler.plain_greedy(rows))
        prompt_lps = score_prompt_logprobs(self.model, hidden, scored) if scored else None
        if not sample_idx:
            return ModelRunnerOutput(prompt_logprobs=prompt_lps, **timings)
        if logits is None:
            logits = self.model.compute_logits(hidden[[i for _, i in sample_idx]],
                                               reuse_output=True)
        result = self.sampler(logits, rows, masks.result() if masks is not None else None,
                              greedy=greedy)
        sampled, logprobs = {}, {}
        k = 0
        while k < len(rows_at):
            s, state = ordered[rows_at[k]], states[rows_at[k]]
            row = state.row
            n = 1 + s.num_drafts
            drawn = result.token_ids[k:k + n]
            emit = accepted_prefix(s.token_ids[1:], drawn) if s.num_drafts else drawn
            sampled[s.request_id] = emit
            if drafter is not None and s.num_drafts:
                drafter.verified(s.request_id, s.start_position, len(emit), state.block_table)
            row.output_token_ids.extend(emit)
            if state.token_ids is not None:
                state.token_ids.extend(emit)
            if row.matcher is not None:
                for tok in emit:
                    row.matcher.consume_token(tok)
            if result.logprobs[k] is not None:
                logprobs[s.request_id] = [(tok,) + lp for tok, lp
                                          in zip(emit, result.logprobs[k:k + len(emit)])]
            k += n
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs or None,
                                 draft_token_ids=self._propose(sampled, by_id),
                                 prompt_logprobs=prompt_lps, **timings)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                 every_row: bool, greedy: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None, list[int] | None]:
        """(hidden `[T, hidden]`, float32 logits of every row or None, each row's argmax or
        None). Where `every_row` (each row samples, none is scored) and the model folds its LM
        head into the layers' C call (`forward_with_logits`), the logits come from that one
        call, and with `greedy` (every row `Sampler.plain_greedy`) the argmax too: the Python
        that ran after a weight-streaming call did so on caches the weights had just swept,
        at several times its warm cost (docs/cpu.md, "Single stream on an AVX2 host")."""
        if every_row:
            both = self.model.forward_with_logits(input_ids, positions, meta, self.kv_cache,
                                                  greedy=greedy)
            if both is not None:
                return both
        return self.model.forward(input_ids, positions, meta, self.kv_cache), None, None

    def _propose(self, sampled: dict[str, list[int]], by_id: dict[str, _RequestState]
                 ) -> dict[str, list[int]] | None:
        """The n-gram proposer's drafts for the next step of each request that sampled (forked,
        in decode now unless it just finished), none for structured outputs (their grammar
        would have to vet every draft); None without a proposer. The proposer forgets the
        requests this runner no longer holds once it tracks many more than it holds."""
        proposer = self.proposer
        if proposer is None:
            return None
        drafts = {}
        for rid in sampled:
            state = by_id[rid]
            if state.row.params.structured_outputs is None:
                drafts[rid] = proposer.propose(rid, state.token_ids)
        if proposer.num_tracked > 2 * len(self.states) + 16:
            proposer.forget(set(self.states))
        return drafts

    @staticmethod
    def _sampling_rows(ordered: list[ScheduledRequest], states: list[_RequestState],
                       rows_at: list[int]) -> list[SamplingRow]:
        """The sampler's row for each sampled position. A request verifying d drafts has d + 1
        rows; row j sees drafts[:j] as output already (penalties, min_tokens, the seeded
        draw's output index), exactly what non-speculative decoding would see there."""
        rows = []
        prev, j = -1, 0
        for i in rows_at:
            j = j + 1 if i == prev else 0
            prev = i
            row = states[i].row
            if j:
                row = dataclasses.replace(
                    row, output_token_ids=row.output_token_ids + ordered[i].token_ids[1:j + 1])
            rows.append(row)
        return rows

    def _start_masks(self, rows: list[SamplingRow]) -> Future | None:
        """Grammar masks of the constrained rows, (row indices, bitmask), computed on a worker
        thread (llguidance releases the GIL) so that they overlap the forward pass; None when no
        row is constrained."""
        constrained = [k for k, r in enumerate(rows) if r.matcher is not None]
        if not constrained:
            return None
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        matchers = [rows[k].matcher for k in constrained]
        return self._mask_pool.submit(
            lambda: (constrained, fill_bitmask(matchers, self.model.cfg.vocab_size)))

    def _prepare(self, ordered: list[ScheduledRequest], states: list[_RequestState],
                 num_decodes: int, kernels=False, pad_to: int | None = None):
        """Flat input ids, positions, slot mapping and attention metadata for the step (for
        `kernels`, by default the target's: a draft model's may differ). With an accelerator
        backend, in its step buffers (`engine.accel.step`; `pad_to`: a CUDA graph's batch)."""
        if self.backend is not None:
            return prepare_step(self.buffers, self.backend, ordered, states, num_decodes,
                                self.block_size, pad_to)
        kernels = self.kernels if kernels is False else kernels
        bs, dev = self.block_size, self.device.torch_device
        if (kernels is not None and num_decodes == len(ordered) and self.decode_inputs
                is not None and self.decode_inputs.fits(
                    len(ordered), max(s.start_position for s in ordered), bs)):
            input_ids, positions, slots, tables, ctx_lens, sample_idx = \
                self.decode_inputs.fill(ordered, states, bs)
            return input_ids, positions, AttentionMetadata(
                slot_mapping=slots, kernels=kernels, kernel_block_tables=tables,
                kernel_ctx_lens=ctx_lens, kv=self.kv_quant), sample_idx
        ids, pos, slots, sample_idx = decode_rows(ordered[:num_decodes], states, bs)
        slot_parts = [torch.tensor(slots, dtype=torch.long)]
        pos_parts = [torch.tensor(pos, dtype=torch.long)]
        chunks: list[tuple[int, int, int, torch.Tensor]] = []    # offset, n, start, table
        offset = num_decodes
        for i in range(num_decodes, len(ordered)):
            s, st = ordered[i], states[i]
            n, start = len(s.token_ids), s.start_position
            ids.extend(s.token_ids)
            p = torch.arange(start, start + n)
            table = torch.tensor(st.block_table[:-(-(start + n) // bs)], dtype=torch.long)
            slot_parts.append(table[p // bs] * bs + p % bs)
            pos_parts.append(p)
            chunks.append((offset, n, start, table))
            if s.num_drafts:                    # verify: a row at every position
                sample_idx.extend((i, offset + j) for j in range(n))
            elif s.sample:
                sample_idx.append((i, offset + n - 1))
            offset += n
        positions = torch.cat(pos_parts)
        meta = AttentionMetadata(slot_mapping=torch.cat(slot_parts).to(dev), kernels=kernels,
                                 kv=self.kv_quant)
        if kernels is not None:
            self._kernel_metadata(meta, ordered, states, positions)
        else:
            self._torch_metadata(meta, states, pos[:num_decodes], chunks)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        return input_ids, positions.to(dev), meta, sample_idx

    def _kernel_metadata(self, meta: AttentionMetadata, ordered: list[ScheduledRequest],
                         states: list[_RequestState], positions: torch.Tensor) -> None:
        """Every query token — decode or prefill — attends through its request's block table
        to its own position (the chunk's K/V are written first), so one kernel call serves the
        whole step, prefix-cache hits and chunked prefill included."""
        bs, dev = self.block_size, self.device.torch_device
        width = max(-(-(s.start_position + len(s.token_ids)) // bs) for s in ordered)
        tables = torch.tensor([st.block_table[:width] + [0] * (width - min(width,
                                                                           len(st.block_table)))
                               for st in states], dtype=torch.int32)
        if positions.numel() != len(ordered):           # prefill chunks: a row per token
            counts = torch.tensor([len(s.token_ids) for s in ordered])
            tables = tables.repeat_interleave(counts, dim=0)
        meta.kernel_block_tables = tables.to(dev)
        meta.kernel_ctx_lens = (positions + 1).to(device=dev, dtype=torch.int32)

    def _torch_metadata(self, meta: AttentionMetadata, states: list[_RequestState],
                        decode_positions: list[int],
                        chunks: list[tuple[int, int, int, torch.Tensor]]) -> None:
        """Decode groups (gathered, padded per group) and prefill chunks (SDPA)."""
        bs, dev = self.block_size, self.device.torch_device
        ctx_lens = [p + 1 for p in decode_positions]
        for start, end in decode_groups(ctx_lens, bs):
            max_blocks = -(-ctx_lens[end - 1] // bs)
            flat: list[int] = []
            for st in states[start:end]:
                table = st.block_table[:max_blocks]
                flat += table + [0] * (max_blocks - len(table))
            lens = torch.tensor(ctx_lens[start:end], device=dev)
            visible = torch.arange(max_blocks * bs, device=dev)[None, :] < lens[:, None]
            meta.decode_groups.append(DecodeGroup(
                start, end - start, torch.tensor(flat, dtype=torch.long, device=dev),
                torch.zeros(visible.shape, device=dev).masked_fill_(
                    ~visible, float("-inf"))[:, None, :]))
        for offset, n, start, table in chunks:
            meta.prefills.append(PrefillChunk(
                offset, n, start, table.to(dev),
                build_prefill_mask(start, n, dev) if start else None))
