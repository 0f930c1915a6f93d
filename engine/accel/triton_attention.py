"""Paged attention for CUDA as kernels in Triton's language: the K/V write through the slot
mapping, and one launch that attends every query token of a step — decodes, prefill chunks and
prefix-cache hits alike — reading K/V in place through the block tables.

Owns: `TritonAttention` (the CUDA attention backend: `forward(q, k, v, k_cache, v_cache, meta,
scale)`) and the `@triton.jit` kernels behind it (the write, the attention, the split-KV decode
pair). In: the step's `SeqMetadata`
(`engine.accel.metadata`: per sequence its query span `query_start_loc`, its context length
after the step `seq_lens`, its `block_tables` row; per token its `slot_mapping`, -1 = write
nothing, as a padded CUDA-graph row has). Out: `[T, num_heads * head_dim]` in q's dtype.

Cache layout: Continuum's head-major K and V per layer, `[num_kv_heads, num_blocks, block_size,
head_dim]` (the CPU kernels' layout too, `engine.attention`); the kernels take strides, so any
layout with contiguous head_dim would do. An 8-bit cache (`--kv-cache-dtype`, engine/kv_quant.py)
is uint8 rows of `KVQuant.row_bytes(head_dim)`: the write kernel quantizes each row as the CPU
kernels do (the same bytes), the attention kernel dequantizes K/V tiles as it loads them, to
q's dtype, never a full-precision copy of a block.

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

Split-KV decode, after vLLM's 3-D unified attention and Flash-Decoding (Dao et al. 2023): a
decode-only step with few (sequence, KV head) programs — batch 1 has one per KV head, each
walking the whole context alone — splits each context's key tiles into `NUM_SPLITS` shares,
grid `(num_seqs, num_kv_heads, NUM_SPLITS)`; each program writes its share's unnormalised
output, running max and sum (float32 scratch kept per shape), and a second kernel, grid
`(num_seqs, num_heads)`, merges them with the usual rescaling. The shares are computed in the
kernel from `seq_lens`, so the grid is fixed per batch size, as CUDA graphs need. Taken below
`SPLIT_BELOW` programs (vLLM's threshold), `TritonAttention.uses_split`.

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
def _store_row(cache_ptr, row, x, d, dmask, head_dim, inv_scale, KV_KIND: tl.constexpr):
    """Store one row `x [HEAD_D]` (float32; masked by `dmask`) at element `row` of a cache:
    as is (KV_KIND 0), or as engine/kv_quant.py's 8-bit rows, the bytes its torch path and
    engine/kernels/kv_cache.c write: int8 values round(x / s) with s = float16(max |x| / 127)
    after them (1), or float8 e4m3fn (2) / e5m2 (3) of x * inv_scale, saturated
    (`_f32_to_fp8`)."""
    if KV_KIND == 0:
        tl.store(cache_ptr + row + d, x.to(cache_ptr.dtype.element_ty), mask=dmask)
    elif KV_KIND == 1:
        s16 = (tl.max(tl.abs(x), axis=0) / 127.0).to(tl.float16)
        s = s16.to(tl.float32)
        inv = tl.where(s > 0.0, 1.0 / tl.where(s > 0.0, s, 1.0), 0.0)
        # round half to even, as torch.round and rintf: |x * inv| <= 127.5 < 2**22
        r = (x * inv + 12582912.0) - 12582912.0
        r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        tl.store(cache_ptr + row + d, r.to(tl.int8).to(tl.uint8, bitcast=True), mask=dmask)
        bits = s16.to(tl.uint16, bitcast=True)           # the scale, little-endian
        tl.store(cache_ptr + row + head_dim, (bits & 0xFF).to(tl.uint8))
        tl.store(cache_ptr + row + head_dim + 1, (bits >> 8).to(tl.uint8))
    else:
        code = _f32_to_fp8(x * inv_scale, 3, 7, 0x7E) if KV_KIND == 2 else \
            _f32_to_fp8(x * inv_scale, 2, 15, 0x7B)
        tl.store(cache_ptr + row + d, code, mask=dmask)


@triton.jit
def _f32_to_fp8(x, M: tl.constexpr, B: tl.constexpr, MAXCODE: tl.constexpr):
    """float32 to the bytes of an fp8 format with M mantissa bits and exponent bias B (e4m3fn:
    3, 7, saturating at 0x7E = 448; e5m2: 2, 15, at 0x7B = 57344), rounded to nearest even from
    float32's bits, subnormals included: engine/kernels/common.h's f32_to_fp8 in integer ops,
    so the GPU, the interpreter and the CPU kernels write the same bytes."""
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    e = (a >> 23) - 127 + B                          # the fp8 exponent field
    mant = (a & 0x7FFFFF) | 0x800000                  # the significand, hidden bit on
    shift = 23 - M + tl.where(e < 1, 1 - e, 0)        # an fp8 subnormal: fewer bits
    e = tl.maximum(e, 0)
    sh = tl.minimum(shift, 30)
    r = (mant + (1 << (sh - 1)) - 1 + ((mant >> sh) & 1)) >> sh
    code = tl.where(e == 0, r, (e << M) + r - (1 << M))       # a carry bumps the exponent
    code = tl.minimum(code, MAXCODE)
    code = tl.where((shift > 24) | ((a >> 23) == 0), 0, code)  # to zero (and f32 subnormals)
    code = tl.where(a > 0x7F800000, 0x7F, code)               # NaN stays NaN
    return (sign | code).to(tl.uint8)


@triton.jit
def _load_rows(cache_ptr, off, d, mask, rows_ok, head_dim, scale, KV_KIND: tl.constexpr):
    """Rows at element offsets `off [N]` of a cache as float32 `[N, HEAD_D]` (8-bit kinds
    dequantized: int8 times its row's float16 scale, float8 times the tensor's `scale`), or in
    the cache's own dtype (KV_KIND 0)."""
    x = tl.load(cache_ptr + off[:, None] + d[None, :], mask=mask, other=0)
    if KV_KIND == 1:
        lo = tl.load(cache_ptr + off + head_dim, mask=rows_ok, other=0).to(tl.uint16)
        hi = tl.load(cache_ptr + off + head_dim + 1, mask=rows_ok, other=0).to(tl.uint16)
        s = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        return x.to(tl.int8, bitcast=True).to(tl.float32) * s[:, None]
    elif KV_KIND == 2:     # e4m3's bits shifted into float16's: the value / 256 (common.h)
        b = x.to(tl.uint16)
        h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        return h.to(tl.float16, bitcast=True).to(tl.float32) * (scale * 256.0)
    elif KV_KIND == 3:     # e5m2 is float16's upper byte
        return (x.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32) * scale
    else:
        return x


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, k_pos, k_ok, visible,
                 d, dmask, block_size, head_dim, kv_base, stride_cb, stride_cs, scale, k_scale,
                 v_scale, KV_KIND: tl.constexpr):
    """Fold one tile of keys into the rows' running max `m_i`, sum `l_i` and output `acc`
    (FlashAttention-2's online softmax): keys at positions `k_pos [TILE_N]`, loaded where
    `k_ok` (their blocks looked up in the sequence's block-table row `table_row`), seen by the
    rows where `visible [BLOCK_M, TILE_N]`. Returns the new (m_i, l_i, acc)."""
    blk = tl.load(table_row + k_pos // block_size, mask=k_ok, other=0)
    kv_off = kv_base + blk.to(tl.int64) * stride_cb + (k_pos % block_size) * stride_cs
    kv_mask = k_ok[:, None] & dmask[None, :]
    k = _load_rows(k_cache_ptr, kv_off, d, kv_mask, k_ok, head_dim, k_scale, KV_KIND).to(q.dtype)
    v = _load_rows(v_cache_ptr, kv_off, d, kv_mask, k_ok, head_dim, v_scale, KV_KIND).to(q.dtype)
    # "ieee": float32 products in full float32 (tensor cores would round them to TF32, 10-bit
    # mantissas); ignored for float16 / bfloat16
    s = tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)     # a row with nothing seen yet
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee").to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def _cache_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                        stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_ch, stride_cb, stride_cs,
                        block_size, head_dim, k_inv_scale, v_inv_scale,
                        HEAD_D: tl.constexpr, KV_KIND: tl.constexpr):
    """One program per (token, KV head): its K and V row into the token's slot (quantized
    for an 8-bit cache, `_store_row`)."""
    t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)              # int64 offsets: a cache may pass 2**31
    slot = tl.load(slot_ptr + t)
    if slot < 0:                         # a padded row: nothing to write
        return
    blk = slot // block_size
    off = slot % block_size
    d = tl.arange(0, HEAD_D)
    dmask = d < head_dim
    row = h * stride_ch + blk * stride_cb + off * stride_cs
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dmask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dmask, other=0.0)
    # float32 is exact for every model dtype: KV_KIND 0 stores the same values back
    _store_row(k_cache_ptr, row, k.to(tl.float32), d, dmask, head_dim, k_inv_scale, KV_KIND)
    _store_row(v_cache_ptr, row, v.to(tl.float32), d, dmask, head_dim, v_inv_scale, KV_KIND)


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_ptr,
        scale, block_size, head_dim, window, k_scale, v_scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_ch, stride_cb, stride_cs, stride_bt,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr, HEAD_D: tl.constexpr, USE_WINDOW: tl.constexpr,
        KV_KIND: tl.constexpr):
    """See the module docstring. `window` is used only with USE_WINDOW; `k_scale`, `v_scale`
    (fp8's per-tensor scales) only with KV_KIND 2 and 3."""
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
    table_row = block_tables_ptr + seq * stride_bt
    for start in range((key_begin // TILE_N) * TILE_N, key_end, TILE_N):
        k_pos = start + cols
        # keys before key_begin are never read: their blocks may have been freed (a window)
        k_ok = (k_pos < key_end) & (k_pos >= key_begin)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row,
                                     k_pos, k_ok, visible, d, dmask, block_size, head_dim,
                                     kv_base, stride_cb, stride_cs, scale, k_scale, v_scale,
                                     KV_KIND)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
             + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dmask[None, :])


@triton.jit
def _split_decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_ptr,
        scale, block_size, head_dim, window, k_scale, v_scale, num_heads,
        stride_qt, stride_qh, stride_ch, stride_cb, stride_cs, stride_bt,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
        HEAD_D: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr,
        KV_KIND: tl.constexpr):
    """Split-KV decode, pass 1 (module docstring): program (seq, kvh, split) attends the one
    query token of `seq` with the GROUP heads of KV head `kvh` over its share of the context's
    key tiles, and writes the unnormalised partial output `part_acc [S, H, NUM_SPLITS, HEAD_D]`
    with its running max `part_m` and sum `part_l [S, H, NUM_SPLITS]` (float32; an empty share:
    -inf, 0, zeros)."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)          # int64 offsets: a cache may pass 2**31
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_start = tl.load(query_start_ptr + seq)
    q_pos = seq_len - 1                          # the decode token's position

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    head = kvh * GROUP + rows % GROUP
    d = tl.arange(0, HEAD_D)
    dmask = d < head_dim
    q = tl.load(q_ptr + q_start * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & dmask[None, :], other=0.0)

    key_begin = 0
    if USE_WINDOW:
        key_begin = tl.maximum(q_pos - window + 1, 0)
    first_tile = key_begin // TILE_N
    num_tiles = tl.cdiv(seq_len, TILE_N) - first_tile      # <= 0 for a padding row
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = first_tile + split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, first_tile + num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
    cols = tl.arange(0, TILE_N)
    kv_base = kvh * stride_ch
    table_row = block_tables_ptr + seq * stride_bt
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE_N + cols
        k_ok = (k_pos < seq_len) & (k_pos >= key_begin)
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row,
                                     k_pos, k_ok, k_ok[None, :] & row_ok[:, None], d, dmask,
                                     block_size, head_dim, kv_base, stride_cb, stride_cs,
                                     scale, k_scale, v_scale, KV_KIND)

    part = (seq * num_heads + head) * NUM_SPLITS + split          # [BLOCK_M]
    tl.store(part_m_ptr + part, m_i, mask=row_ok)
    tl.store(part_l_ptr + part, l_i, mask=row_ok)
    tl.store(part_acc_ptr + part[:, None] * HEAD_D + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _split_reduce_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, query_start_ptr,
                         head_dim, num_heads, stride_ot, stride_oh,
                         HEAD_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Split-KV decode, pass 2: program (seq, head) merges the NUM_SPLITS partials — each
    rescaled by exp(m_split - max m), the sum likewise — into the output row (zeros where
    nothing was seen: a padding row)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_D)
    part = (seq * num_heads + head) * NUM_SPLITS + sp
    m = tl.load(part_m_ptr + part)
    l_s = tl.load(part_l_ptr + part)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_D + d[None, :])
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_safe)                       # an empty split: exp(-inf) = 0
    total = tl.sum(w * l_s, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    q_start = tl.load(query_start_ptr + seq)
    tl.store(out_ptr + q_start * stride_ot + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


SPLIT_BELOW = 128     # vLLM's threshold: a decode step of fewer 2-D programs splits its keys
NUM_SPLITS = 16       # key shares per (sequence, KV head) in the split path (vLLM's segments)


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
    """The CUDA attention backend (see the module docstring); one per runner. `tile_n`: keys
    per tile (a power of two >= 16); `kv`: the runner's 8-bit cache (`engine.kv_quant.KVQuant`)
    or None; `split_below`, `num_splits`: the split-KV decode path's threshold in programs and
    its shares per context (a power of two; None: `NUM_SPLITS`, or 2 under `TRITON_INTERPRET=1`,
    where every program costs milliseconds — the kernel tests pass 16). Sliding windows are
    per call (a model's layers may differ)."""

    name = "triton"
    block_dim = 3            # the block axis of the runner's [layer, k/v, head, block, slot, d]
    sliding_window = True    # forward takes a window

    def __init__(self, tile_n: int = 32, kv=None, split_below: int = SPLIT_BELOW,
                 num_splits: int | None = None) -> None:
        self.tile_n = tile_n
        self.kv = kv             # engine.kv_quant.KVQuant: an 8-bit cache; None: the model dtype
        self.split_below = split_below     # split-KV decode below this many 2-D programs
        if num_splits is None:   # the interpreter runs each program in numpy: 2 shares there
            num_splits = 2 if os.environ.get("TRITON_INTERPRET") == "1" else NUM_SPLITS
        self.num_splits = num_splits       # a power of two
        self._parts: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def uses_split(self, meta, num_kv_heads: int) -> bool:
        """Whether `attend` takes the split-KV decode path: a decode-only step (one query token
        a sequence) of fewer than `split_below` (sequence, KV head) programs — vLLM's choice
        between its 2-D and 3-D unified attention. Fixed per CUDA-graph bucket (it reads only
        the padded batch size)."""
        return meta.max_query_len == 1 and \
            meta.seq_lens.shape[0] * num_kv_heads < self.split_below

    def _partials(self, num_seqs: int, num_heads: int, head_d: int, device):
        """The split path's float32 scratch (acc `[S * H * splits, head_d]`, m and l
        `[S * H * splits]`), kept per shape: allocated once, so a CUDA graph captures
        pointers that stay valid, and an eager step allocates nothing."""
        key = (num_seqs, num_heads, head_d, str(device))
        if key not in self._parts:
            n = num_seqs * num_heads * self.num_splits
            self._parts[key] = (torch.empty(n, head_d, dtype=torch.float32, device=device),
                                torch.empty(n, dtype=torch.float32, device=device),
                                torch.empty(n, dtype=torch.float32, device=device))
        return self._parts[key]

    def _kv_args(self) -> tuple[int, float, float]:
        """(KV_KIND, K's fp8 scale, V's) of the kernels (0, 1, 1: the model dtype)."""
        kv = self.kv
        return (0, 1.0, 1.0) if kv is None else (kv.kind, kv.k_scale, kv.v_scale)

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
        `k_cache, v_cache [num_kv_heads, num_blocks, block_size, head_dim]` (8-bit: uint8
        rows of `kv.row_bytes(head_dim)`, quantized here)."""
        num_tokens, num_kv_heads, head_dim = k.shape
        if num_tokens == 0:
            return
        kind, k_scale, v_scale = self._kv_args()
        _cache_write_kernel[(num_tokens, num_kv_heads)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            k_cache.shape[2], head_dim, 1.0 / k_scale, 1.0 / v_scale,
            HEAD_D=triton.next_power_of_2(head_dim), KV_KIND=kind)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
               scale: float, out: torch.Tensor, window: int = 0) -> torch.Tensor:
        """Attend `q [T, num_heads, head_dim]` into `out` (same shape) over the cache, after
        this step's K/V were written. `meta`: `SeqMetadata` (its `max_query_len` sizes the
        grid); `window`: sliding window in tokens, 0 = full attention. Returns `out`."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[0]
        group = num_heads // num_kv_heads
        if self.uses_split(meta, num_kv_heads):
            return self._attend_split(q, k_cache, v_cache, meta, scale, out, window)
        block_m, block_q = _tile_shapes(group, meta.max_query_len)
        num_seqs = meta.seq_lens.shape[0]
        grid = (num_seqs, triton.cdiv(meta.max_query_len, block_q), num_kv_heads)
        kind, k_scale, v_scale = self._kv_args()
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            scale, k_cache.shape[2], head_dim, window, k_scale, v_scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
            GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=self.tile_n,
            HEAD_D=triton.next_power_of_2(head_dim), USE_WINDOW=window > 0, KV_KIND=kind)
        return out

    def _attend_split(self, q, k_cache, v_cache, meta, scale, out, window):
        """`attend` for a decode-only step by split-KV (module docstring): grid `(S, KVH,
        num_splits)` writes partials, `(S, H)` merges them into `out`."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[0]
        group = num_heads // num_kv_heads
        num_seqs = meta.seq_lens.shape[0]
        head_d = triton.next_power_of_2(head_dim)
        acc, m, l_sum = self._partials(num_seqs, num_heads, head_d, q.device)
        kind, k_scale, v_scale = self._kv_args()
        _split_decode_kernel[(num_seqs, num_kv_heads, self.num_splits)](
            q, k_cache, v_cache, acc, m, l_sum, meta.block_tables, meta.seq_lens,
            meta.query_start_loc, scale, k_cache.shape[2], head_dim, window, k_scale, v_scale,
            num_heads, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
            GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(group)), TILE_N=self.tile_n,
            HEAD_D=head_d, NUM_SPLITS=self.num_splits, USE_WINDOW=window > 0, KV_KIND=kind)
        _split_reduce_kernel[(num_seqs, num_heads)](
            acc, m, l_sum, out, meta.query_start_loc, head_dim, num_heads,
            out.stride(0), out.stride(1), HEAD_D=head_d, NUM_SPLITS=self.num_splits)
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta, scale: float, window: int = 0) -> torch.Tensor:
        """Write the step's K/V, then attend: `q [T, H, D]`, `k, v [T, KVH, D]` →
        `[T, H * D]`; `window`: the layer's sliding window in tokens, 0 = full attention."""
        self.cache_write(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self.attend(q, k_cache, v_cache, meta, scale, out, window)
        return out.view(q.shape[0], -1)
