"""Paged attention for Ascend NPUs through torch_npu's fused operators, called the way
vLLM-Ascend calls them: the K/V write through the slot mapping, then one operator that attends
every query token of the step, reading K/V in place through the block tables.

Owns: `NpuAttention` (the NPU attention backend, with `TritonAttention`'s interface: `name`,
`block_dim`, `cache_shape(...)`, `forward(q, k, v, k_cache, v_cache, meta, scale)`). In: the
step's `SeqMetadata` (`engine.accel.metadata`): the host lists `query_lens`, `seq_lens_host`
and `num_decodes` (the operators take lengths on the host), the device `slot_mapping` and
`block_tables`. Out: `[T, num_heads * head_dim]` in q's dtype; rows past the step's real tokens
(a padded batch) are zeros.

Cache layout: K and V per layer `[num_blocks, block_size, num_kv_heads, head_dim]`, the layout
the operators take (vLLM-Ascend's `get_kv_cache_shape` without its leading 2), so the runner's
whole cache is `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`, blocks on
axis 2.

Per layer:
1. `torch_npu._npu_reshape_and_cache` (ATB ReshapeAndCache) writes the step's K/V at their
   slots (int32). Padding rows never reach it: they are the step's tail (rows
   `sum(query_lens)..T-1`, as `StepBuffers.fill(pad_to=...)` lays them out), and the write gets
   the real rows only, as vLLM-Ascend slices to `num_actual_tokens`; ATB documents negative
   slots as skipped only for its NZ cache variant, so slot -1 is not relied upon.
2. A decode-only step (every sequence has one query token): `torch_npu._npu_paged_attention`
   (ATB PagedAttention), `context_lens` an int32 host tensor.
3. Any other step (fresh prompts, chunks after a cached prefix, decodes mixed with prefills):
   `torch_npu.npu_fused_infer_attention_score` in the TND layout: `actual_seq_lengths` the
   cumulative query ends, `actual_seq_lengths_kv` each sequence's context length (not
   cumulative), key/value the caches viewed `[num_blocks, block_size, num_kv_heads * head_dim]`
   and read through `block_table` (int32), `sparse_mode=3` (right-down causal: query i of a
   chunk of n over a context of L sees keys j <= L - n + i) with the compressed 2048 x 2048
   upper-triangular int8 `atten_mask`.

Followed: vLLM-Ascend v0.13.0 (commit 6281c1207a7a499e9f23a42b3a1e7027469f2b10):
`vllm_ascend/attention/attention_v1.py` (`AscendAttentionBackendImpl.reshape_and_cache`,
`forward_paged_attention`, `forward_fused_infer_attention`, `_get_fia_params`),
`attention/attention_mask.py` (`get_splitfuse_attn_mask`), `worker/block_table.py` (int32
block table and slot mapping) and `worker/model_runner_v1.py` (sequence lengths on the host).
One difference: vLLM-Ascend takes `_npu_paged_attention` for decode-only steps only inside a
full ACL graph on listed batch sizes (`using_paged_attention`) and the fused operator otherwise;
this backend always takes it for decode-only steps, and runs eagerly (no ACL graphs).

Limits: float16 and bfloat16 only (the operators' documented dtypes; float32 raises
ValueError); no sliding window (ValueError: sparse_mode 4's `pre_tokens` convention is
unverified here). vLLM-Ascend runs block size 128 only. No Ascend hardware has run this code:
tests/test_npu_attention.py checks it on the CPU against a stand-in `torch_npu`
(tests/fake_torch_npu.py) that implements the three operators as documented.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

DTYPES = (torch.float16, torch.bfloat16)
MASK_SIZE = 2048                 # the compressed causal mask sparse_mode 3 takes


@dataclass
class _StepArgs:
    """The operators' per-step arguments, built once per `SeqMetadata` for all layers."""

    meta: object                 # the SeqMetadata they were built from (held: identity check)
    num_tokens: int              # real query tokens; rows past them are padding
    slots: torch.Tensor          # [num_tokens] int32, device
    block_table: torch.Tensor    # [S, max_blocks] int32, device
    query_ends: list[int]        # [S] cumulative query lengths (TND actual_seq_lengths)
    context_lens: torch.Tensor   # [S] int32, host
    decode_only: bool


class NpuAttention:
    """The Ascend NPU attention backend (see the module docstring). One per runner; it keeps
    the causal mask per device and the current step's arguments.

    No sliding window (`sliding_window` False: the engine caps max_model_len at a model's
    window for it; `forward` raises ValueError for one). Raises ImportError when `torch_npu` is
    not installed."""

    name = "npu"
    block_dim = 2            # the block axis of the runner's [layer, k/v, block, slot, head, d]
    sliding_window = False

    def __init__(self) -> None:
        import torch_npu          # lazily: absent on CUDA and CPU machines

        self._ops = torch_npu
        self._masks: dict[torch.device, torch.Tensor] = {}
        self._step: _StepArgs | None = None

    @staticmethod
    def check_dtype(dtype: torch.dtype) -> None:
        """Raise ValueError (one line, at start) for a dtype the operators do not take."""
        if dtype not in DTYPES:
            raise ValueError(f"the npu attention backend runs float16 or bfloat16, not "
                             f"{str(dtype).removeprefix('torch.')}; use --dtype bfloat16")

    @staticmethod
    def cache_shape(num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int,
                    head_dim: int) -> tuple[int, ...]:
        """The runner's whole cache: `[num_layers, 2, num_blocks, block_size, num_kv_heads,
        head_dim]`."""
        return (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)

    def _mask(self, device: torch.device) -> torch.Tensor:
        """`[2048, 2048]` int8, 1 above the diagonal: vLLM-Ascend's `get_splitfuse_attn_mask`."""
        if device not in self._masks:
            self._masks[device] = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE), diagonal=1).to(
                torch.int8).to(device)
        return self._masks[device]

    def _step_args(self, meta) -> _StepArgs:
        """The step's operator arguments: built by the first layer, reused by the others (keyed
        on `meta`'s identity; `StepBuffers.fill` makes a new one per step)."""
        if self._step is None or self._step.meta is not meta:
            num_seqs = len(meta.query_lens)
            num_tokens = sum(meta.query_lens)
            self._step = _StepArgs(
                meta=meta, num_tokens=num_tokens,
                slots=meta.slot_mapping[:num_tokens].to(torch.int32),
                block_table=meta.block_tables[:num_seqs],
                query_ends=list(itertools.accumulate(meta.query_lens)),
                context_lens=torch.tensor(meta.seq_lens_host, dtype=torch.int32),
                decode_only=meta.num_decodes == num_seqs)
        return self._step

    def cache_write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """Write `k, v [n, num_kv_heads, head_dim]` at `slots [n]` (int32, every one a real
        slot: block s // block_size, offset s % block_size) into `k_cache, v_cache
        [num_blocks, block_size, num_kv_heads, head_dim]`."""
        if k.shape[0] == 0:
            return
        self._ops._npu_reshape_and_cache(key=k.contiguous(), value=v.contiguous(),
                                         key_cache=k_cache, value_cache=v_cache,
                                         slot_indices=slots)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               step: _StepArgs, scale: float, out: torch.Tensor) -> torch.Tensor:
        """Attend the real rows of `q [T, num_heads, head_dim]` into `out` (same shape, dtype,
        contiguous) over the caches, after this step's K/V were written; zero the padding rows.
        Returns `out`."""
        n, num_heads = step.num_tokens, q.shape[1]
        num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
        query = q[:n].contiguous()
        if n and step.decode_only:
            self._ops._npu_paged_attention(
                query=query, key_cache=k_cache, value_cache=v_cache, num_kv_heads=num_kv_heads,
                num_heads=num_heads, scale_value=scale, block_table=step.block_table,
                context_lens=step.context_lens, out=out[:n])
        elif n:
            attn, _ = self._ops.npu_fused_infer_attention_score(
                query=query, key=k_cache.view(num_blocks, block_size, -1),
                value=v_cache.view(num_blocks, block_size, -1), atten_mask=self._mask(q.device),
                block_table=step.block_table, input_layout="TND", block_size=block_size,
                actual_seq_lengths=step.query_ends,
                actual_seq_lengths_kv=list(step.meta.seq_lens_host),
                num_key_value_heads=num_kv_heads, num_heads=num_heads, scale=scale,
                sparse_mode=3)
            out[:n] = attn.view(n, num_heads, -1)
        out[n:].zero_()
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta, scale: float, window: int = 0) -> torch.Tensor:
        """Write the step's K/V, then attend: `q [T, H, D]`, `k, v [T, KVH, D]` (views are
        fine), caches `[num_blocks, block_size, KVH, D]` → `[T, H * D]`. Raises ValueError for
        a dtype other than float16 or bfloat16, or a sliding window."""
        self.check_dtype(q.dtype)
        if window:
            raise ValueError(f"the npu attention backend has no sliding window (a layer has "
                             f"{window})")
        step = self._step_args(meta)
        n = step.num_tokens
        self.cache_write(k[:n], v[:n], k_cache, v_cache, step.slots)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self.attend(q, k_cache, v_cache, step, float(scale), out)
        return out.view(q.shape[0], -1)
