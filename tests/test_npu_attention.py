"""The Ascend NPU attention backend (engine/accel/npu_attention.py) against a torch reference.

No Ascend hardware has run this code. These tests run the backend on the CPU against a stand-in
`torch_npu` (tests/fake_torch_npu.py) that implements `_npu_reshape_and_cache`,
`_npu_paged_attention` and `npu_fused_infer_attention_score` in plain torch as their
documentation and vLLM-Ascend v0.13.0 describe them, and checks every call's arguments (names,
shapes, dtypes, the "TND" layout, the cache layout, the mask, consistent lengths). They prove
the backend's own logic (layouts, lengths, slots, which operator a step takes) under that
reading of the operators; they cannot prove the real operators read their arguments the same
way.

As in tests/test_triton_attention.py, the reference attends each sequence's whole context
(cached prefix + this chunk) with an explicit causal mask in float64 from K/V kept outside the
cache, and the cache holds each prefix at shuffled blocks. float16 and bfloat16 only: the
operators take no float32 (the backend raises ValueError, checked below).
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.accel.metadata import StepBuffers
from engine.accel.npu_attention import NpuAttention
from tests import fake_torch_npu

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
PAGED, FUSED, WRITE = ("_npu_paged_attention", "npu_fused_infer_attention_score",
                       "_npu_reshape_and_cache")


@pytest.fixture
def npu(monkeypatch):
    return fake_torch_npu.install(monkeypatch)


def reference(q, k_full, v_full, ctx_start):
    """`q [n, H, D]` at positions ctx_start.., `k_full, v_full [ctx, KVH, D]` → `[n, H, D]`."""
    n, num_heads, head_dim = q.shape
    group = num_heads // k_full.shape[1]
    k = k_full.double().repeat_interleave(group, dim=1)
    v = v_full.double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * head_dim ** -0.5
    visible = torch.arange(k.shape[0])[None, :] <= torch.arange(ctx_start, ctx_start + n)[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def qkv_views(q, k, v):
    """q, k, v as the model hands them over: non-contiguous views of one fused projection."""
    parts = [q.flatten(1), k.flatten(1), v.flatten(1)]
    fused = torch.cat(parts, dim=1)
    q2, k2, v2 = fused.split([p.shape[1] for p in parts], dim=1)
    return q2.view(q.shape), k2.view(k.shape), v2.view(v.shape)


def run_step(npu, seqs, num_heads, num_kv_heads, head_dim, dtype, block_size=16, seed=0):
    """seqs: (cached tokens, new tokens) per sequence, decodes (new == 1) first. Builds a
    cache in the NPU layout holding each cached prefix at shuffled blocks, runs the backend
    over the stand-in `npu`, compares with the reference and checks that exactly the step's
    slots were written. Returns (max error, the operators this step called)."""
    first_call = len(npu.calls)
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil((c + n) / block_size) for c, n in seqs]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    shape = NpuAttention.cache_shape(1, num_kv_heads, num_blocks, block_size, head_dim)
    cache = torch.zeros(shape, dtype=dtype)
    tables, ks, vs, qs, slots, positions = [], [], [], [], [], []
    for (c, n), nb in zip(seqs, blocks_needed):
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        ks.append(torch.randn(c + n, num_kv_heads, head_dim, generator=g).to(dtype))
        vs.append(torch.randn(c + n, num_kv_heads, head_dim, generator=g).to(dtype))
        qs.append(torch.randn(n, num_heads, head_dim, generator=g).to(dtype))
        for p in range(c + n):
            blk, off = table[p // block_size], p % block_size
            if p < c:                              # the cached prefix, in place
                cache[0, 0, blk, off], cache[0, 1, blk, off] = ks[-1][p], vs[-1][p]
            else:
                slots.append(blk * block_size + off)
                positions.append(p)
    q, k_new, v_new = qkv_views(torch.cat(qs), torch.cat([k[c:] for k, (c, _) in zip(ks, seqs)]),
                                torch.cat([v[c:] for v, (c, _) in zip(vs, seqs)]))
    buffers = StepBuffers(torch.device("cpu"), 96, 8, 16)
    backend = NpuAttention()
    _, _, meta = buffers.fill(backend, [0] * len(slots), torch.tensor(positions),
                              torch.tensor(slots), [n for _, n in seqs], [c + n for c, n in seqs],
                              tables, sum(1 for _, n in seqs if n == 1))
    before = cache.clone()
    out = backend.forward(q, k_new, v_new, cache[0, 0], cache[0, 1], meta, head_dim ** -0.5)
    assert out.shape == (len(slots), num_heads * head_dim) and out.dtype == dtype
    out = out.view(-1, num_heads, head_dim)
    err, t = 0.0, 0
    for (c, n), k_full, v_full, qq in zip(seqs, ks, vs, qs):
        err = max(err, (out[t:t + n].double() - reference(qq, k_full, v_full, c)).abs().max())
        t += n
    # the step's K/V landed at their slots, and nothing else changed
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots] = True
    flat = cache[0].reshape(2, -1, num_kv_heads, head_dim)
    assert torch.equal(flat[0, slots], k_new) and torch.equal(flat[1, slots], v_new)
    assert torch.equal(flat[:, ~written], before[0].reshape(2, -1, num_kv_heads, head_dim)[
        :, ~written])
    return float(err), npu.ops_called()[first_call:]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decodes_only_take_paged_attention(npu, dtype, group):
    """A decode-only step: contexts inside one block, on a block boundary, across several
    blocks; one `_npu_paged_attention` after the write."""
    err, ops = run_step(npu, [(0, 1), (15, 1), (16, 1), (40, 1)], 2 * group, 2, 64, dtype)
    assert err < TOL[dtype], err
    assert ops == [WRITE, PAGED]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_step_with_chunks_and_prefix_takes_fused_attention(npu, dtype):
    """Decodes, a fresh prompt, a chunk after a cached prefix and a chunk that ends on a block
    boundary, in one `npu_fused_infer_attention_score` call."""
    err, ops = run_step(npu, [(7, 1), (33, 1), (0, 21), (32, 9), (5, 11)], 6, 2, 64, dtype)
    assert err < TOL[dtype], err
    assert ops == [WRITE, FUSED]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_head_dims_and_gqa_groups(npu, head_dim, group):
    err, ops = run_step(npu, [(3, 1), (20, 7), (0, 18)], group, 1, head_dim, torch.float16,
                        seed=group)
    assert err < TOL[torch.float16], err
    assert ops == [WRITE, FUSED]


def test_fresh_prompts_only_and_vllm_ascends_block_size(npu):
    """Prefill-only steps (no decodes) at block size 16 and at 128, vLLM-Ascend's only one,
    with a prefix and a chunk crossing a 128-token block boundary."""
    assert run_step(npu, [(0, 5), (0, 17)], 4, 2, 64, torch.float16)[1] == [WRITE, FUSED]
    err, ops = run_step(npu, [(127, 1), (128, 1), (100, 40), (0, 3)], 4, 2, 64, torch.bfloat16,
                        block_size=128)
    assert err < TOL[torch.bfloat16], err
    assert ops == [WRITE, FUSED]


def test_padded_rows_are_not_written_and_return_zeros(npu):
    """A decode batch padded to 4 rows (slot -1, context 0): the operators see the real row
    only, its slot alone is written, and the padding rows come back as zeros."""
    backend = NpuAttention()
    cache = torch.zeros(NpuAttention.cache_shape(1, 1, 4, 16, 64), dtype=torch.float16)
    cache[0, :, 1] = torch.randn(2, 16, 1, 64).half()
    _, _, meta = StepBuffers(torch.device("cpu"), 8, 4, 4).fill(
        backend, [0], torch.tensor([3]), torch.tensor([16 + 3]), [1], [4], [[1]], 1, pad_to=4)
    q = torch.randn(4, 2, 64).half()
    kv = torch.randn(4, 1, 64).half()
    before = cache.clone()
    out = backend.forward(q, kv, kv, cache[0, 0], cache[0, 1], meta, 0.125).view(4, 2, 64)
    changed = (cache != before).nonzero()[:, 2:4].unique(dim=0).tolist()
    assert changed == [[1, 3]]                   # only the real row's slot (block 1, offset 3)
    assert torch.count_nonzero(out[1:]) == 0
    write, paged = npu.calls
    assert write[1]["key"].shape[0] == 1 and write[1]["slot_indices"].tolist() == [19]
    assert paged[1]["query"].shape[0] == 1 and paged[1]["context_lens"].tolist() == [4]
    k_ctx = torch.cat([before[0, 0, 1, :3], kv[:1]])
    v_ctx = torch.cat([before[0, 1, 1, :3], kv[:1]])
    ref = reference(q[:1], k_ctx, v_ctx, 3)      # scale 0.125 = 64 ** -0.5
    assert (out[:1].double() - ref).abs().max() < TOL[torch.float16]


def test_operator_arguments_follow_vllm_ascend(npu):
    """The dtypes, host/device placement and length conventions of each call."""
    run = NpuAttention()
    cache = torch.zeros(NpuAttention.cache_shape(1, 2, 8, 16, 64), dtype=torch.bfloat16)
    _, _, meta = StepBuffers(torch.device("cpu"), 32, 4, 4).fill(
        run, [0] * 6, torch.tensor([4, 0, 1, 2, 3, 4]), torch.tensor([4, 32, 33, 34, 35, 36]),
        [1, 5], [5, 5], [[0], [2]], 1)
    x = torch.randn(6, 4, 64).bfloat16()
    run.forward(x, x[:, :2], x[:, 2:], cache[0, 0], cache[0, 1], meta, 0.125)
    (_, write), (_, fused) = npu.calls
    assert write["slot_indices"].dtype == torch.int32
    assert fused["actual_seq_lengths"] == [1, 6] and fused["actual_seq_lengths_kv"] == [5, 5]
    assert fused["block_table"].dtype == torch.int32 and fused["block_table"].shape[0] == 2
    assert fused["key"].shape == (8, 16, 2 * 64) and fused["atten_mask"].dtype == torch.int8
    assert (fused["input_layout"], fused["sparse_mode"], fused["block_size"]) == ("TND", 3, 16)


def test_stand_in_rejects_the_head_major_cache(npu):
    """The CUDA/CPU layout `[num_kv_heads, num_blocks, block_size, head_dim]` is caught."""
    backend = NpuAttention()
    cache = torch.zeros(2, 2, 8, 16, 64, dtype=torch.float16)       # [k/v, head, block, ...]
    _, _, meta = StepBuffers(torch.device("cpu"), 4, 4, 4).fill(
        backend, [0], torch.tensor([0]), torch.tensor([0]), [1], [1], [[0]], 1)
    kv = torch.randn(1, 2, 64).half()
    with pytest.raises(AssertionError, match="NPU layout"):
        backend.forward(torch.randn(1, 2, 64).half(), kv, kv, cache[0], cache[1], meta, 0.125)


def test_stand_in_rejects_inconsistent_calls(npu):
    """Lengths that disagree with the query, int64 slots, a wrong layout string."""
    q = torch.randn(6, 2, 64).half()
    kv = torch.zeros(4, 16, 128).half()
    good = dict(query=q, key=kv, value=kv, atten_mask=NpuAttention()._mask(q.device),
                block_table=torch.zeros(2, 2, dtype=torch.int32), input_layout="TND",
                block_size=16, actual_seq_lengths=[1, 6], actual_seq_lengths_kv=[5, 5],
                num_key_value_heads=2, num_heads=2, scale=0.125, sparse_mode=3)
    npu.npu_fused_infer_attention_score(**good)
    for bad, match in (({"actual_seq_lengths": [1, 5]}, "sum to 5"),
                       ({"actual_seq_lengths_kv": [5]}, "1 kv lengths for 2"),
                       ({"actual_seq_lengths_kv": [5, 4]}, "context 4 < its 5"),
                       ({"input_layout": "BSND"}, "TND"),
                       ({"block_table": torch.zeros(2, 2, dtype=torch.int64)}, "int32"),
                       ({"atten_mask": torch.ones(2048, 2048, dtype=torch.int8).tril()},
                        "above the diagonal")):
        with pytest.raises(AssertionError, match=match):
            npu.npu_fused_infer_attention_score(**{**good, **bad})
    cache = torch.zeros(4, 16, 2, 64).half()
    with pytest.raises(AssertionError, match="int32"):
        npu._npu_reshape_and_cache(key=q[:1, :2], value=q[:1, :2], key_cache=cache,
                                   value_cache=cache, slot_indices=torch.tensor([3]))
    with pytest.raises(AssertionError, match="outside"):
        npu._npu_reshape_and_cache(key=q[:1, :2], value=q[:1, :2], key_cache=cache,
                                   value_cache=cache,
                                   slot_indices=torch.tensor([-1], dtype=torch.int32))


def test_float32_and_sliding_window_are_refused(npu):
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        NpuAttention().forward(torch.zeros(1, 1, 64), None, None, None, None, None, 1.0)
    with pytest.raises(ValueError, match="sliding window"):
        NpuAttention().forward(torch.zeros(1, 1, 64, dtype=torch.float16), None, None, None,
                               None, None, 1.0, 4096)


def test_cache_shape_puts_blocks_on_block_dim():
    shape = NpuAttention.cache_shape(3, 2, 10, 16, 64)
    assert shape == (3, 2, 10, 16, 2, 64) and shape[NpuAttention.block_dim] == 10
    assert NpuAttention.name == "npu"
