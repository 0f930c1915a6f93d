"""Paged attention for CUDA as kernels in Triton's language: the K/V write through the slot
mapping, and one launch that attends every query token of a step — decodes, prefill chunks and
prefix-cache hits alike — reading K/V in place through the block tables.

Owns: `TritonAttention` (the CUDA attention backend: `forward(q, k, v, k_cache, v_cache, meta,
scale)`) and the two `@triton.jit` kernels behind it. In: the step's `SeqMetadata`
(`engine.accel.metadata`: per sequence its query span `query_start_loc`, its context length
after the step `seq_lens`, its `block_tables` row; per token its `slot_mapping`, -1 = write
nothing, as a padded CUDA-graph row has). Out: `[T, num_heads * head_dim]` in q's dtype.

Cache layout: Continuum's head-major K and V per layer, `[num_kv_heads, num_blocks, block_size,
head_dim]` (the CPU kernels' layout too, `engine.attention`); the kernels take strides, so any
layout with contiguous head_dim would do.

The attention kernel, after vLLM's unified attention (`triton_unified_attention.py`, whose
design it follows and whose code it does not copy) and FlashAttention-2 (Dao 2023, Algorithm 1:
online softmax):
- grid `(num_seqs, cdiv(max_query_len, BLOCK_Q), num_kv_heads)`: a program owns BLOCK_Q query
  tokens of one sequence and all `G = num_heads / num_kv_heads` query heads that share one KV
  head (GQA), packed as BLOCK_M = BLOCK_Q * G rows (row r: token r // G, head r % G), so every K/V
  tile is read once for the whole group. BLOCK_M is 16 when every chunk fits (decode steps),
  64 for prefill chunks (`_tile_shapes`). Programs past their sequence's query length return at
  once; a decode-only step is `(num_seqs, 1, num_kv_heads)`, a fixed grid for CUDA graphs.
- it walks the context in tiles of TILE_N keys, looking each key's block up in the block table
  (a tile may span pages, so any block size works), with a running max and sum in float32.
- key j is visible to query position i when `j <= i` (causal within the chunk; the context
  before the chunk is all visible) and, with a sliding window W, `j > i - W` (HF's
  `sliding_window` convention: a query sees itself and the W - 1 keys before it). Tiles wholly
  outside every row's range are skipped by the loop bounds.
- rows of padding (seq_lens 0) write zeros.

Runs under `TRITON_INTERPRET=1` on CPU tensors (numpy, no bfloat16 there): that is how the
tests check it on CPU-only machines; `benchmarks/device_check.py` checks it on a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.attention import head_major_cache_shape


@triton.jit
def _cache_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                        stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_ch, stride_cb, stride_cs,
                        block_size, head_dim, HEAD_D: tl.constexpr):
    """One program per (token, KV head): copy its K and V row to the token's slot."""
    t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)              # int64 offsets: a cache may pass 2**31
    slot = tl.load(slot_ptr + t)
    if slot < 0:                         # a padded row: nothing to write
        return
    blk = slot // block_size
    off = slot % block_size
    d = tl.arange(0, HEAD_D)
    dmask = d < head_dim
    dst = h * stride_ch + blk * stride_cb + off * stride_cs + d
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dmask),
             mask=dmask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dmask),
             mask=dmask)


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_ptr,
        scale, block_size, head_dim, window,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_ch, stride_cb, stride_cs, stride_bt,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr, HEAD_D: tl.constexpr, USE_WINDOW: tl.constexpr):
    """See the module docstring. `window` is used only with USE_WINDOW."""
    seq = tl.program_id(0)
    qb = tl.program_id(1)
    kvh = tl.program_id(2).to(tl.int64)          # int64 offsets: a cache may pass 2**31
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_start = seq_len - q_len                  # position of the chunk's first token

    rows = tl.arange(0, BLOCK_M)
    tok = qb * BLOCK_Q + rows // GROUP           # token index within the chunk
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = ctx_start + tok                      # each row's position in the sequence
    d = tl.arange(0, HEAD_D)
    dmask = d < head_dim
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
                + d[None, :], mask=row_ok[:, None] & dmask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)

    last_q = ctx_start + tl.minimum(q_len, (qb + 1) * BLOCK_Q) - 1
    key_end = last_q + 1                         # keys past the last row's position: unseen
    key_begin = 0
    if USE_WINDOW:
        key_begin = tl.maximum(ctx_start + qb * BLOCK_Q - window + 1, 0)
    cols = tl.arange(0, TILE_N)
    kv_base = kvh * stride_ch
    for start in range((key_begin // TILE_N) * TILE_N, key_end, TILE_N):
        k_pos = start + cols
        k_ok = k_pos < key_end
        blk = tl.load(block_tables_ptr + seq * stride_bt + k_pos // block_size, mask=k_ok,
                      other=0)
        kv_off = kv_base + blk.to(tl.int64) * stride_cb + (k_pos % block_size) * stride_cs
        kv_mask = k_ok[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)

        # "ieee": float32 products in full float32 (tensor cores would round them to TF32,
        # 10-bit mantissas); ignored for float16 / bfloat16
        s = tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32) * scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)     # a row with nothing seen yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v,
                                            input_precision="ieee").to(tl.float32)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
             + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dmask[None, :])


def _tile_shapes(group: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): BLOCK_M rows (a power of two, >= 16 for `tl.dot`) hold BLOCK_Q
    tokens of `group` heads each. 16 rows where every chunk fits in them (decodes: a small
    grid, one program per sequence and KV head), 64 otherwise (a prefill's K/V tiles are then
    read by 4x fewer programs)."""
    block_m = max(16, triton.next_power_of_2(group))
    if max_query_len > block_m // group:
        block_m = max(64, block_m)
    return block_m, block_m // group


class TritonAttention:
    """The CUDA attention backend (see the module docstring). Stateless; one per runner.
    `tile_n`: keys per tile (a power of two >= 16). Sliding windows are per call (a model's
    layers may differ)."""

    name = "triton"
    block_dim = 3            # the block axis of the runner's [layer, k/v, head, block, slot, d]
    sliding_window = True    # forward takes a window

    def __init__(self, tile_n: int = 32) -> None:
        self.tile_n = tile_n

    @staticmethod
    def check_dtype(dtype: torch.dtype) -> None:
        """float32, float16 and bfloat16 run on a GPU; Triton's interpreter (numpy) has no
        bfloat16 and would compute garbage silently, so there it raises ValueError (one
        line)."""
        if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
            raise ValueError("bfloat16 attention under TRITON_INTERPRET=1: Triton's interpreter "
                             "has no bfloat16; use --dtype float32 or float16")

    cache_shape = staticmethod(head_major_cache_shape)     # the CPU kernels' layout too

    def cache_write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write `k, v [T, num_kv_heads, head_dim]` (last dim contiguous) at `slot_mapping [T]`
        (int64; slot s = block s // block_size, offset s % block_size; -1 = skip) into
        `k_cache, v_cache [num_kv_heads, num_blocks, block_size, head_dim]`."""
        num_tokens, num_kv_heads, head_dim = k.shape
        if num_tokens == 0:
            return
        _cache_write_kernel[(num_tokens, num_kv_heads)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            k_cache.shape[2], head_dim, HEAD_D=triton.next_power_of_2(head_dim))

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
               scale: float, out: torch.Tensor, window: int = 0) -> torch.Tensor:
        """Attend `q [T, num_heads, head_dim]` into `out` (same shape) over the cache, after
        this step's K/V were written. `meta`: `SeqMetadata` (its `max_query_len` sizes the
        grid); `window`: sliding window in tokens, 0 = full attention. Returns `out`."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[0]
        group = num_heads // num_kv_heads
        block_m, block_q = _tile_shapes(group, meta.max_query_len)
        num_seqs = meta.seq_lens.shape[0]
        grid = (num_seqs, triton.cdiv(meta.max_query_len, block_q), num_kv_heads)
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            scale, k_cache.shape[2], head_dim, window,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
            GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=self.tile_n,
            HEAD_D=triton.next_power_of_2(head_dim), USE_WINDOW=window > 0)
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta, scale: float, window: int = 0) -> torch.Tensor:
        """Write the step's K/V, then attend: `q [T, H, D]`, `k, v [T, KVH, D]` →
        `[T, H * D]`; `window`: the layer's sliding window in tokens, 0 = full attention."""
        self.cache_write(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self.attend(q, k_cache, v_cache, meta, scale, out, window)
        return out.view(q.shape[0], -1)
