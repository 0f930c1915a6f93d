"""The C kernels (engine/kernels) against float64 / plain-torch references, and the engine's
pure-torch path against the kernel path. Three builds are checked: this machine's (-march=native:
AVX-512 where it has it), an AVX2 + FMA one (-march=x86-64-v3, as under CONTINUUM_CPU_ISA=avx2;
skipped on a CPU without AVX2) and a portable one (-march=x86-64-v2), which takes the generic C
loops."""

import pytest
import torch

from engine import kernels
from engine.attention import AttentionMetadata, DecodeGroup, PrefillChunk, paged_attention
from tests.conftest import pairs_build

COMPILER = kernels.find_compiler()
pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C compiler")
# the `lib` fixture (one build per ISA: native, avx512-no-amx, avx2, portable) is in conftest.py


def test_processes_building_the_same_library_at_once_compile_it_once(tmp_path, monkeypatch):
    """An API server and its engine core (or servers started together) that find the library
    missing at the same moment: one compiles, the others wait for it and get its path."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    compiled = []

    def compile_slowly(compiler, flags, target):
        compiled.append(target)
        time.sleep(0.3)                  # long enough for every builder to have looked
        target.write_bytes(b"the library")

    monkeypatch.setattr(kernels, "_compile", compile_slowly)
    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: kernels.build(COMPILER, ["-O2"], tmp_path), range(3)))
    assert len(compiled) == 1
    assert len(set(paths)) == 1 and paths[0].read_bytes() == b"the library"


def test_a_compile_past_its_time_limit_leaves_no_compiler_running(tmp_path):
    """A compile step that runs out of time is killed with its children (a driver's cc1 and
    as), so they do not go on taking the CPU from the server that gave up on them."""
    import subprocess
    import time

    pidfile = tmp_path / "child.pid"
    driver = tmp_path / "cc"
    driver.write_text(f"#!/bin/sh\nsleep 30 &\necho $! > {pidfile}\nwait\n")
    driver.chmod(0o755)
    with pytest.raises(subprocess.TimeoutExpired):
        kernels._run_compiler([str(driver)], timeout_s=1.0)
    child = int(pidfile.read_text())
    for _ in range(50):                  # killed: gone once its parent shell has reaped it
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().split()[2] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the compiler's child still runs after the time limit")


def test_each_build_runs_the_inner_loops_of_its_isa(lib, request):
    """The ISA guards pick the loops the flags allow: AVX-512 only with AVX-512 (an AMX host's
    vector loops are AVX-512's, with or without its AMX extensions built), AVX2 + FMA on
    x86-64-v3, the generic C loops on x86-64-v2; AMX tiles only in an AMX host's own build."""
    from engine.kernels.isa import cpu_isa, host_isa

    build = request.node.callspec.params["lib"]
    host = host_isa()
    expected = {"native": "avx512" if host == "amx" else host, "avx512-no-amx": "avx512",
                "avx2": "avx2", "portable": "generic"}[build]
    assert lib.isa == expected
    # the tiles are turned on where the engine's level (the cap included) is amx
    assert bool(lib.amx_rows) == (build == "native" and cpu_isa() == "amx")


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 64, 130])
@pytest.mark.parametrize("n,k", [(48, 64), (33, 17), (200, 576)])
def test_bf16_weight_gemm_matches_float64(lib, m, n, k):
    """`linear` (packed bfloat16 weights, float32 arithmetic) against a float64 product of the
    same bfloat16 values: every row-tile size (1..6 rows and remainders), N not a multiple of
    the 16-column panel, odd K, strided bfloat16 input and float32 input, with a bias."""
    torch.manual_seed(m * 1000 + n)
    w = (torch.randn(n, k) * 0.1).bfloat16()
    bias = torch.randn(n).bfloat16()
    x = torch.randn(m, k + 3).bfloat16()[:, 2:k + 2]          # strided rows
    packed = lib.pack_linear(w)
    assert packed.shape == (-(-n // 16), k, 16)
    ref = x.double() @ w.double().T + bias.double()
    out32 = lib.linear(x, packed, n, bias, torch.float32)
    assert out32.dtype == torch.float32 and out32.shape == (m, n)
    assert (out32.double() - ref).abs().max().item() < 1e-4
    out16 = lib.linear(x, packed, n, bias)
    assert out16.dtype == torch.bfloat16
    assert torch.equal(out16, out32.bfloat16())               # rounded once, to nearest even
    xf = x.float().contiguous()
    assert (lib.linear(xf, packed, n, None, torch.float32).double()
            - xf.double() @ w.double().T).abs().max().item() < 1e-4


def test_pack_linear_refuses_other_dtypes(lib):
    with pytest.raises(ValueError, match="bfloat16"):
        lib.pack_linear(torch.randn(4, 4))


def reference_decode(q, k_cache, v_cache, tables, lens, scale):
    """float64 softmax attention of each sequence's query over its first `lens[b]` tokens."""
    kvh, _, bs, d = k_cache.shape
    b_, h, _ = q.shape
    out = torch.empty(b_, h, d, dtype=torch.float64)
    for b in range(b_):
        n = int(lens[b])
        blocks = tables[b, : -(-n // bs)].long()
        k = k_cache[:, blocks].reshape(kvh, -1, d)[:, :n].double()
        v = v_cache[:, blocks].reshape(kvh, -1, d)[:, :n].double()
        qb = q[b].double().view(kvh, h // kvh, d)
        out[b] = (torch.softmax(qb @ k.transpose(1, 2) * scale, -1) @ v).reshape(h, d)
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim",
                         [(9, 3, 64), (4, 4, 128), (6, 2, 24), (10, 2, 64), (16, 2, 32)])
def test_paged_decode_matches_reference(lib, dtype, tol, heads, kv_heads, head_dim):
    torch.manual_seed(0)
    bs, num_blocks = 16, 64
    lens = torch.tensor([1, 15, 16, 17, 100, 200], dtype=torch.int32)   # block edges included
    max_blocks = -(-int(lens.max()) // bs)
    k_cache = torch.randn(kv_heads, num_blocks, bs, head_dim).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, bs, head_dim).to(dtype)
    tables = torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in lens]).int()
    # q rows strided as in the model (q heads followed by k heads in one tensor)
    q = torch.randn(len(lens), heads + kv_heads, head_dim).to(dtype)[:, :heads]
    out = torch.empty(len(lens), heads, head_dim, dtype=dtype)
    lib.paged_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, out)
    ref = reference_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    assert (out.double() - ref).abs().max().item() < tol


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,lens,threads,parts", [
    (9, 3, 64, [1000], 2, 3),        # the embedded model's single decode: 3 pairs, 2 threads
    (9, 3, 64, [4100], 8, 11),       # 32 items for 8 threads over 3 pairs
    (4, 1, 128, [1100, 5], 4, 4),    # the short context's parts past its end are empty
    (6, 2, 24, [777], 3, 3),         # head_dim 24: the generic loop; a part's last block cut
])
def test_a_split_decode_matches_reference(lib, cache, heads, kv_heads, head_dim, lens,
                                          threads, parts):
    """Too few (sequence, KV head) pairs for the threads: each context is cut into parts
    attended in parallel and merged (split-KV decode) — against float64 attention over what
    the cache holds, for every cache type and both output dtypes."""
    from engine.kv_quant import KVQuant

    torch.manual_seed(len(lens) * 100 + head_dim)
    bs = 16
    lens = torch.tensor(lens, dtype=torch.int32)
    max_blocks = -(-int(lens.max()) // bs)
    num_blocks = max_blocks * len(lens) + 4
    k = torch.randn(kv_heads, num_blocks, bs, head_dim)
    v = torch.randn(kv_heads, num_blocks, bs, head_dim) * 2
    kv = None
    if cache in ("float32", "bfloat16"):
        k_cache, v_cache = k.to(getattr(torch, cache)), v.to(getattr(torch, cache))
        k_ref, v_ref = k_cache, v_cache
    else:
        kv = KVQuant(cache, 0.25, 3.0) if cache != "int8" else KVQuant(cache)
        k_cache, v_cache = kv.quantize(k, kv.k_scale), kv.quantize(v, kv.v_scale)
        k_ref = kv.dequantize(k_cache, torch.float64, kv.k_scale)
        v_ref = kv.dequantize(v_cache, torch.float64, kv.v_scale)
    perm = torch.randperm(num_blocks).int()
    tables = torch.stack([perm[i * max_blocks:(i + 1) * max_blocks] for i in range(len(lens))])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert lib.paged_decode_parts(lens, kv_heads) == parts
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            if cache in ("float32", "bfloat16") and dtype != k_cache.dtype:
                continue                 # a 16 / 32-bit cache serves a model of its dtype
            q = torch.randn(len(lens), heads, head_dim).to(dtype)
            out = torch.empty(len(lens), heads, head_dim, dtype=dtype)
            lib.paged_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, out, kv)
            ref = reference_decode(q, k_ref, v_ref, tables, lens, head_dim ** -0.5)
            assert (out.double() - ref).abs().max().item() < \
                tol * max(1.0, ref.abs().max().item())
    finally:
        torch.set_num_threads(before)


def test_decodes_enough_for_the_threads_are_not_split(lib):
    """Two pairs a thread or more, or contexts too short to give each part 256 tokens: every
    (sequence, KV head) is attended whole."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert lib.paged_decode_parts(torch.tensor([5000, 5000], dtype=torch.int32), 2) == 1
        assert lib.paged_decode_parts(torch.tensor([511], dtype=torch.int32), 3) == 1
        assert lib.paged_decode_parts(torch.tensor([512], dtype=torch.int32), 3) == 2
        torch.set_num_threads(1)
        assert lib.paged_decode_parts(torch.tensor([5000], dtype=torch.int32), 1) == 1
    finally:
        torch.set_num_threads(before)


def prefill_step(kernels, heads: int, kv_heads: int, head_dim: int) -> tuple[int, float]:
    """Rows of a step as the engine lays them out: decodes first, then prefill chunks — a run
    of 40 tokens after a cached prefix of 10, one of 17 from position 0, and one of 5 (below
    the pair products' 16 rows, so on the vector loops) — each chunk's rows with its request's
    block table and consecutive context lengths, through `kernels.paged_decode` (bfloat16).
    Returns the rows attention_amx.c took and the largest error against float64, relative to
    the largest output."""
    torch.manual_seed(heads)
    bs, num_blocks = 16, 64
    k_cache = torch.randn(kv_heads, num_blocks, bs, head_dim).bfloat16()
    v_cache = torch.randn(kv_heads, num_blocks, bs, head_dim).bfloat16()
    perm = torch.randperm(num_blocks).int()
    seqs = [(perm[0:4], [37]), (perm[4:8], [60]), (perm[8:12], range(11, 51)),
            (perm[12:14], range(1, 18)), (perm[14:16], range(3, 8))]
    tables = torch.zeros(0, 4, dtype=torch.int32)
    lens = []
    for table, ctxs in seqs:
        padded = torch.cat([table, torch.zeros(4 - len(table), dtype=torch.int32)])
        tables = torch.cat([tables, padded.repeat(len(ctxs), 1)])
        lens += list(ctxs)
    lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), heads + kv_heads, head_dim).bfloat16()[:, :heads]
    out = torch.empty(len(lens), heads, head_dim, dtype=torch.bfloat16)
    before = kernels._fn["attention_amx_rows"]()
    kernels.paged_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, out)
    paired = kernels._fn["attention_amx_rows"]() - before
    ref = reference_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    return paired, (out.double() - ref).abs().max().item() / ref.abs().max().item()


@pytest.mark.parametrize("heads,kv_heads,head_dim",
                         [(9, 3, 64), (4, 4, 128), (16, 2, 32), (10, 2, 96), (6, 2, 24)])
def test_prefill_runs_on_amx_tiles_match_reference(amx_lib, heads, kv_heads, head_dim):
    """The runs of 16 rows and more are attended on AMX tiles (softmax in float32, P rounded to
    bfloat16); head_dim 24 is not a multiple of 32 and stays on the vector loops."""
    tiled, err = prefill_step(amx_lib, heads, kv_heads, head_dim)
    assert tiled == (40 + 17 if head_dim % 32 == 0 else 0)
    assert err < 2e-2, err


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (10, 2, 96), (6, 2, 24)])
def test_prefill_runs_in_bf16_pairs_match_reference(lib, request, heads, kv_heads, head_dim):
    """The same rows through each build: where it has AVX512-BF16 (this host's own build on an
    EPYC or an AMX host, the avx512-no-amx one) the runs take attention_amx.c's pair products —
    tiles where AMX is on, vdpbf16ps register tiles elsewhere; builds without BF16 run every
    row on the vector loops."""
    paired, err = prefill_step(lib, heads, kv_heads, head_dim)
    assert paired == (40 + 17 if pairs_build(request) and head_dim % 32 == 0 else 0)
    assert err < 2e-2, err


def test_cache_write_puts_each_token_at_its_slot(lib):
    kv_heads, head_dim = 3, 64
    k_cache = torch.zeros(kv_heads, 10, 16, head_dim)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(4, (9 + 2 * kv_heads) * head_dim)               # strided rows, as the model's
    k = qkv[:, 9 * head_dim:12 * head_dim].view(4, kv_heads, head_dim)
    v = qkv[:, 12 * head_dim:].view(4, kv_heads, head_dim)
    slots = torch.tensor([0, 17, 40, 159])
    lib.cache_write(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(kv_heads, -1, head_dim), v_cache.view(kv_heads, -1, head_dim)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(flat_k[:, s], k[i]) and torch.equal(flat_v[:, s], v[i])
    assert int((flat_k.abs().sum(-1) > 0).sum()) == 4 * kv_heads        # nothing else written


@pytest.mark.parametrize("kv_name", [None, "int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_path_equals_torch_path_for_a_mixed_step(lib, dtype, kv_name):
    """One step with decodes of different lengths and a prefill chunk over a cached prefix:
    the kernel path (engine default on CPU: every token attends through the block table) and
    the pure-torch path (CUDA, NPU: decode groups and SDPA) agree — over a cache of the model
    dtype, and over 8-bit caches (`--kv-cache-dtype`), which both quantize on write (to the
    same bytes) and dequantize on read."""
    from engine.kv_quant import KVQuant
    kv = None if kv_name is None else KVQuant(kv_name, 0.5, 1.5)
    torch.manual_seed(1)
    heads, kv_heads, d, bs, nb = 9, 3, 64, 16, 40
    ctx = [5, 40, 70]                         # decodes: context incl. the new token
    chunk_start, chunk_len = 20, 12           # prefill chunk at positions 20..31
    tables = [torch.randperm(nb)[:8] for _ in range(4)]
    slots = [int(t[(c - 1) // bs]) * bs + (c - 1) % bs for t, c in zip(tables, ctx)]
    pos = torch.arange(chunk_start, chunk_start + chunk_len)
    slots += (tables[3][pos // bs] * bs + pos % bs).tolist()
    n = len(ctx) + chunk_len
    q = torch.randn(n, heads, d).to(dtype)
    k = torch.randn(n, kv_heads, d).to(dtype)
    v = torch.randn(n, kv_heads, d).to(dtype)
    base = torch.randn(kv_heads, nb, bs, d).to(dtype), torch.randn(kv_heads, nb, bs, d).to(dtype)
    if kv is not None:
        base = kv.quantize(base[0], kv.k_scale), kv.quantize(base[1], kv.v_scale)
    mask = torch.arange(chunk_start + chunk_len)[None] <= pos[:, None]
    prefill = PrefillChunk(len(ctx), chunk_len, chunk_start, tables[3][:2], mask)
    width = -(-max(ctx) // bs)
    group_ids = torch.cat([t[:width] for t in tables[:3]])
    visible = torch.arange(width * bs)[None] < torch.tensor(ctx)[:, None]
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[:, None]
    torch_meta = AttentionMetadata(torch.tensor(slots), [DecodeGroup(0, 3, group_ids, bias)],
                                   [prefill], kv=kv)
    # the kernel path: one row per query token (its request's table, its position + 1)
    rows = [t[:width] for t in tables[:3]] + [tables[3][:width]] * chunk_len
    kernel_meta = AttentionMetadata(torch.tensor(slots), kernels=lib,
                                    kernel_block_tables=torch.stack(rows).int(),
                                    kernel_ctx_lens=torch.tensor(ctx + (pos + 1).tolist(),
                                                                 dtype=torch.int32), kv=kv)
    results = []
    for meta in (torch_meta, kernel_meta):
        kc, vc = base[0].clone(), base[1].clone()
        results.append((paged_attention(q, k, v, kc, vc, meta, d ** -0.5), kc, vc))
    (a, ka, va), (b, kb, vb) = results
    assert torch.equal(ka, kb) and torch.equal(va, vb)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (a.float() - b.float()).abs().max().item() < tol


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("CONTINUUM_CPU_KERNELS", "0")
    kernels.load.cache_clear()
    try:
        assert kernels.load() is None
    finally:
        kernels.load.cache_clear()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_fused_elementwise_ops_match_torch(lib, dtype, tol):
    torch.manual_seed(2)
    n, hidden, inter, eps = 20, 96, 40, 1e-5      # 20 rows: the multi-threaded branch too
    close = lambda a, b: (a.float() - b.float()).abs().max().item() < tol * max(  # noqa: E731
        1.0, b.float().abs().max().item())
    x, res, w = (torch.randn(n, hidden).to(dtype) for _ in range(3))
    w = w[0]
    ref_res = (x.float() + res.float()).to(dtype)
    ref = torch.nn.functional.rms_norm(ref_res.float(), (hidden,), w.float(), eps)
    assert close(lib.rms_norm(x, w, eps), torch.nn.functional.rms_norm(x.float(), (hidden,),
                                                                        w.float(), eps))
    xin, rin = x.clone(), res.clone()
    out = lib.add_rms_norm(xin, rin, w, eps)
    assert out.data_ptr() == xin.data_ptr() and torch.equal(rin, ref_res) and close(out, ref)

    gu = torch.randn(n, 2 * inter).to(dtype)
    g, u = gu.float().chunk(2, dim=-1)
    assert close(lib.silu_and_mul(gu), torch.nn.functional.silu(g) * u)

    heads, d, max_pos = 5, 64, 50
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.outer(torch.arange(max_pos).float(), inv)
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    sin_signed = sin.clone()
    sin_signed[:, :d // 2] *= -1
    base = torch.randn(n, heads + 2, d).to(dtype)
    tail = base[:, heads:].clone()
    qk = base[:, :heads]                                  # strided rows, as in the model
    pos = torch.randint(0, max_pos, (n,))
    xf = qk.float()
    rotated = torch.cat([-xf[..., d // 2:], xf[..., :d // 2]], dim=-1)
    ref = xf * cos[pos][:, None] + rotated * sin[pos][:, None]
    lib.rotary(qk, pos, cos.to(dtype), sin_signed.to(dtype))
    assert close(base[:, :heads], ref)
    assert torch.equal(base[:, heads:], tail)             # the other heads are left alone


def test_argmax_is_torchs_argmax_ties_nans_and_infinities_included(lib):
    torch.manual_seed(3)
    x = torch.randn(70, 1000)                             # 1000: a tail after 64-value chunks
    x[1, 10] = x[1, 900] = 50.0                           # a tie: the first index
    x[2, 700] = x[2, 5] = float("nan")                    # NaN is the largest: the first NaN
    x[3] = float("-inf")                                  # all -inf: index 0
    x[4, 999] = float("inf")                              # +inf in the tail
    x[5] = 1.5                                            # a constant row
    x[6, 0] = float("nan")
    assert torch.equal(lib.argmax(x), x.argmax(dim=-1))
    strided = torch.randn(9, 130)[:, :127]                # rows apart by more than their length
    assert torch.equal(lib.argmax(strided), strided.argmax(dim=-1))
    assert torch.equal(lib.argmax(x[:1, :3]), x[:1, :3].argmax(dim=-1))
    with pytest.raises(ValueError):
        lib.argmax(x.to(torch.bfloat16))


@pytest.mark.parametrize("threads", [2, 3])
def test_a_single_rows_argmax_split_over_threads_is_torchs(lib, threads):
    """One row of 4,096 values or more is cut into a slice a thread (single-stream decode's
    logits): the merge keeps the first index of the maximum across slices, a NaN anywhere
    wins (the first one), and a row of -inf answers 0."""
    torch.manual_seed(4)
    n = 10_007
    rows = [torch.randn(n) for _ in range(9)]
    rows[1][20] = rows[1][9_000] = 40.0                   # a tie across slices: the first
    rows[2][9_000] = 40.0                                 # the maximum in the last slice
    rows[3][8_000] = float("nan")                         # a NaN in a later slice wins
    rows[4][8_000] = rows[4][6_000] = float("nan")        # ... the first NaN
    rows[5][:] = float("-inf")
    rows[6][:] = 2.0                                      # constant: index 0
    rows[7][n - 1] = float("inf")                         # +inf in the tail
    rows[8][5_003] = rows[8][5_004] = 40.0                # near a slice boundary
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for r in rows:
            assert torch.equal(lib.argmax(r[None]), r[None].argmax(dim=-1))
    finally:
        torch.set_num_threads(old)


def test_bfloat16_forward_with_fused_ops_matches_torch_ops(model_dir):
    """The model's fused bfloat16 path (kernels for residual add + RMSNorm, SiLU-and-mul, RoPE)
    against its torch-op path on a real prompt, both measured against float32: the fused path
    is no further from float32 than bfloat16 torch ops are."""
    from engine.attention import AttentionMetadata
    from engine.device import resolve_device
    from engine.models.llama import load_model

    ids = torch.tensor([1, 504, 3458, 282, 4649, 314, 253, 1342, 30, 378, 2128, 314, 2725, 9202,
                        28])
    n = ids.numel()

    def logits(model):
        cfg = model.cfg
        kv = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, 4, 16, cfg.head_dim,
                         dtype=model.dtype)
        meta = AttentionMetadata(torch.arange(n), [], [PrefillChunk(0, n, 0, torch.tensor([0]))])
        return model.compute_logits(model.forward(ids, torch.arange(n), meta, kv))

    cpu = resolve_device("cpu")
    reference = logits(load_model(model_dir, cpu, torch.float32, 256))
    model = load_model(model_dir, cpu, torch.bfloat16, 256)
    kernels.load.cache_clear()
    model.set_kernels(kernels.load())
    assert model.fused is not None
    fused = logits(model)
    model.set_kernels(None)
    plain = logits(model)

    def error(x):        # worst 1 - cosine similarity to float32 over the positions
        return (1 - torch.nn.functional.cosine_similarity(x, reference, dim=-1)).max().item()

    # 2x the torch ops' distance, or 2e-3 where that is tinier than the hosts' spread: on an
    # Intel host without AVX512-BF16 (oneDNN computing bfloat16 in float32) plain measured
    # 3.4e-4 and fused 7.2e-4; a wrong eps, table or rotation is far above 2e-3
    assert error(fused) < max(2 * error(plain), 2e-3) and error(plain) < 0.01
    agree = lambda x: int((x.argmax(-1) == reference.argmax(-1)).sum())  # noqa: E731
    assert agree(fused) >= agree(plain) - 1
