"""The CUDA attention kernels (engine/accel/triton_attention.py) against a torch reference, run
by Triton's interpreter on the CPU (`TRITON_INTERPRET=1`, set in conftest.py; numpy has no
bfloat16, so float32 and float16 here; bfloat16 is checked on a GPU by
benchmarks/device_check.py).

The reference attends each sequence's whole context (cached prefix + this chunk) with an
explicit causal (and sliding-window) mask in float64, from K/V kept outside the cache: so the
kernel's reads through a shuffled block table, its cache writes and its masking are all
checked. Shapes are tiny (the interpreter runs every program in numpy)."""

from __future__ import annotations

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="the triton package is not installed")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 (conftest sets it) or a GPU", allow_module_level=True)

from engine.accel.metadata import StepBuffers  # noqa: E402
from engine.accel.triton_attention import NUM_SPLITS, TritonAttention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def reference(q, k_full, v_full, ctx_start, scale, window):
    """`q [n, H, D]` at positions ctx_start.., `k_full, v_full [ctx, KVH, D]` → `[n, H, D]`."""
    n, num_heads, _ = q.shape
    group = num_heads // k_full.shape[1]
    k = k_full.double().repeat_interleave(group, dim=1)
    v = v_full.double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    qpos = torch.arange(ctx_start, ctx_start + n)[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    visible = kpos <= qpos
    if window:
        visible &= kpos > qpos - window
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def run_step(seqs, num_heads, num_kv_heads, head_dim, dtype, block_size=16, window=None,
             seed=0, kv=None, split=None):
    """seqs: (cached tokens, new tokens) per sequence, decodes (new == 1) first. Builds a cache
    holding each sequence's cached prefix at shuffled blocks, runs the backend's write and
    attention for the new tokens, and compares with the reference. Returns the max error.
    `kv` (engine.kv_quant.KVQuant): an 8-bit cache, its rows written by the torch path's
    quantize; the reference then attends the dequantized rows, and the kernel's writes must be
    the torch path's bytes. `split`: True / False forces the split-KV decode path on or off
    (None: the backend's own choice); the step must then be decode-only (or not split)."""
    g = torch.Generator().manual_seed(seed)
    backend = TritonAttention(tile_n=16, kv=kv, num_splits=NUM_SPLITS,
                              **({} if split is None else
                                 dict(split_below=10**9 if split else 0)))
    blocks_needed = [math.ceil((c + n) / block_size) for c, n in seqs]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    row = head_dim if kv is None else kv.row_bytes(head_dim)
    cache = torch.zeros(2, num_kv_heads, num_blocks, block_size, row,
                        dtype=dtype if kv is None else torch.uint8)

    def stored(x, which):              # x [..., D] as the cache holds it
        if kv is None:
            return x
        return kv.quantize(x, kv.k_scale if which == 0 else kv.v_scale)

    def read(x, which):                # what attention sees of x
        if kv is None:
            return x
        scale = kv.k_scale if which == 0 else kv.v_scale
        return kv.dequantize(stored(x, which), torch.float32, scale).to(dtype)
    tables, ks, vs, qs, slots, positions = [], [], [], [], [], []
    for c, n in seqs:
        table = [perm.pop() for _ in range(math.ceil((c + n) / block_size))]
        tables.append(table)
        k_full = torch.randn(c + n, num_kv_heads, head_dim, generator=g).to(dtype)
        v_full = torch.randn(c + n, num_kv_heads, head_dim, generator=g).to(dtype)
        for p in range(c):                         # the cached prefix, in place
            cache[0, :, table[p // block_size], p % block_size] = stored(k_full[p], 0)
            cache[1, :, table[p // block_size], p % block_size] = stored(v_full[p], 1)
        ks.append(k_full)
        vs.append(v_full)
        qs.append(torch.randn(n, num_heads, head_dim, generator=g).to(dtype))
        for p in range(c, c + n):
            slots.append(table[p // block_size] * block_size + p % block_size)
            positions.append(p)
    cache = cache.to(DEVICE)
    q = torch.cat(qs).to(DEVICE)
    k_new = torch.cat([k[c:] for k, (c, _) in zip(ks, seqs)]).to(DEVICE)
    v_new = torch.cat([v[c:] for v, (c, _) in zip(vs, seqs)]).to(DEVICE)
    buffers = StepBuffers(DEVICE, 64, 8, max(16, max(blocks_needed)))
    num_decodes = sum(1 for _, n in seqs if n == 1)
    _, _, meta = buffers.fill(backend, [0] * len(slots), torch.tensor(positions),
                              torch.tensor(slots), [n for _, n in seqs],
                              [c + n for c, n in seqs], tables, num_decodes)
    scale = head_dim ** -0.5
    if split is not None:
        assert backend.uses_split(meta, num_kv_heads) == split
    out = backend.forward(q, k_new, v_new, cache[0], cache[1], meta, scale, window or 0).cpu()
    out = out.view(-1, num_heads, head_dim)
    err, t = 0.0, 0
    for (c, n), k_full, v_full, qq in zip(seqs, ks, vs, qs):
        ref = reference(qq, read(k_full, 0), read(v_full, 1), c, scale, window)
        err = max(err, (out[t:t + n].double() - ref).abs().max().item())
        t += n
    # the step's K/V landed at their slots
    for (c, n), table, k_full, v_full in zip(seqs, tables, ks, vs):
        for p in range(c, c + n):
            got = cache[:, :, table[p // block_size], p % block_size].cpu()
            assert torch.equal(got[0], stored(k_full[p], 0))
            assert torch.equal(got[1], stored(v_full[p], 1))
    return err


@pytest.mark.parametrize("dtype, split", [
    (torch.float32, False), (torch.float32, True), (torch.float16, False),
    # ~1.8 s each in the interpreter; float16's split path also runs in the long decodes below
    pytest.param(torch.float16, True, marks=pytest.mark.extended)])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decodes_only(dtype, group, split):
    """A decode-only step (the CUDA-graph shape): contexts inside one block, on a block
    boundary, and across several blocks — by the one-pass kernel and by split-KV."""
    err = run_step([(0, 1), (15, 1), (16, 1), (40, 1)], 2 * group, 2, 64, dtype, split=split)
    assert err < TOL[dtype], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [0, 7, 100])
def test_split_kv_long_single_decodes(dtype, window):
    """Long single decodes, the split path's case: one sequence of 1,000 keys (63 tiles over 16
    shares, the last one short) and beside it a short one (most shares empty), GQA group 4,
    with and without a sliding window (a window inside one share and one across several)."""
    err = run_step([(999, 1), (20, 1)], 8, 2, 64, dtype, window=window, seed=window,
                   split=True)
    assert err < TOL[dtype], err


def test_split_kv_takes_small_decode_steps_only():
    """The backend's choice (vLLM's): split-KV for decode-only steps of fewer than 128
    (sequence, KV head) programs, the one-pass kernel for prefill chunks and big batches."""
    backend = TritonAttention()
    buffers = StepBuffers(DEVICE, 256, 64, 4)

    def meta(query_lens, pad_to=None):
        n = len(query_lens)
        _, _, m = buffers.fill(backend, [0] * sum(query_lens), torch.zeros(sum(query_lens)),
                               torch.full((sum(query_lens),), -1), query_lens,
                               [5] * n, [[0]] * n, sum(1 for q in query_lens if q == 1),
                               pad_to=pad_to)
        return m
    assert backend.uses_split(meta([1]), 8)
    assert backend.uses_split(meta([1] * 15), 8)            # 120 programs
    assert not backend.uses_split(meta([1] * 16), 8)        # 128
    assert not backend.uses_split(meta([1, 3]), 8)          # a chunk in the step
    assert backend.uses_split(meta([1], pad_to=8), 8)       # a graph bucket: its padded size
    assert not backend.uses_split(meta([1], pad_to=32), 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_step_with_chunks_and_prefix(dtype):
    """Decodes, a fresh prompt, a chunk after a cached prefix (a prefix-cache hit or a later
    chunk of a chunked prefill) and a chunk that ends on a block boundary, in one launch."""
    err = run_step([(7, 1), (33, 1), (0, 21), (32, 9), (5, 11)], 6, 2, 64, dtype)
    assert err < TOL[dtype], err


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_head_dims_and_gqa_groups(head_dim, group):
    """Every GQA group size the issue names (a group of 3 packs 5 tokens into 16 rows) at both
    head dims, a chunk longer than one program's query block."""
    err = run_step([(3, 1), (20, 7), (0, 18)], group, 1, head_dim, torch.float32, seed=group)
    assert err < TOL[torch.float32], err


@pytest.mark.parametrize("window", [1, 5, 16, 24])
def test_sliding_window(window):
    """A query sees itself and the window - 1 keys before it (HF's convention), in decodes and
    in chunks with a cached prefix; windows smaller than, equal to and larger than a tile."""
    err = run_step([(40, 1), (9, 1), (30, 13), (0, 20)], 4, 2, 64, torch.float32,
                   window=window, seed=window)
    assert err < TOL[torch.float32], err


def test_small_blocks_and_odd_head_dim():
    """Block size 8 (a tile spans pages) and head_dim 80 (padded to 128, masked)."""
    err = run_step([(12, 1), (6, 10)], 4, 2, 80, torch.float32, block_size=8)
    assert err < TOL[torch.float32], err


@pytest.mark.parametrize("split", [False, True])
def test_padded_rows_write_nothing_and_attend_to_nothing(split):
    """A CUDA graph's padding rows (slot -1, context 0): no cache write, zero output, and the
    real rows are unchanged by them — by both decode paths."""
    backend = TritonAttention(split_below=10**9 if split else 0, num_splits=NUM_SPLITS)
    cache = torch.zeros(2, 1, 4, 16, 64, device=DEVICE)
    cache[:, :, 1] = torch.randn(2, 1, 16, 64)
    buffers = StepBuffers(DEVICE, 8, 4, 4)
    _, _, meta = buffers.fill(backend, [0], torch.tensor([3]), torch.tensor([16 + 3]), [1], [4],
                              [[1]], 1, pad_to=4)
    q = torch.randn(4, 2, 64, device=DEVICE)
    kv = torch.randn(4, 1, 64, device=DEVICE)
    before = cache.clone()
    out = backend.forward(q, kv, kv, cache[0], cache[1], meta, 0.125).view(4, 2, 64)
    changed = (cache != before).nonzero()[:, 2:4].unique(dim=0).tolist()
    assert changed == [[1, 3]]                   # only the real row's slot (block 1, offset 3)
    assert torch.count_nonzero(out[1:]) == 0
    ref = reference(q[:1].cpu(), torch.cat([before[0, :, 1, :3], kv[:1].cpu().transpose(0, 1)],
                                           1).transpose(0, 1),
                    torch.cat([before[1, :, 1, :3], kv[:1].cpu().transpose(0, 1)],
                              1).transpose(0, 1), 3, 0.125, None)
    assert (out[:1].cpu().double() - ref).abs().max() < 2e-5


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_8bit_caches_write_the_cpu_bytes_and_attend_their_values(kv, dtype):
    """`--kv-cache-dtype` on the Triton kernels: the write kernel stores the bytes of
    engine/kv_quant.py's torch path (which engine/kernels/kv_cache.c matches byte for byte),
    and attention over the 8-bit rows, decodes and a prefill chunk with a cached prefix,
    equals the reference over the dequantized K/V; fp8 with per-tensor scales other than 1."""
    from engine.kv_quant import KVQuant
    quant = KVQuant(kv) if kv == "int8" else KVQuant(kv, k_scale=0.5, v_scale=2.0)
    err = run_step([(20, 1), (3, 1), (17, 9)], 6, 2, 64, dtype, kv=quant)
    assert err < TOL[dtype] * 4, err
    err = run_step([(130, 1), (3, 1)], 6, 2, 64, dtype, kv=quant, split=True)   # split-KV
    assert err < TOL[dtype] * 4, err
