"""The CUDA fused elementwise ops (engine/accel/triton_fused.py) against float64 references of
the formulas the model's torch path computes, run by Triton's interpreter on the CPU
(`TRITON_INTERPRET=1`, set in conftest.py) in float32 and float16 (numpy has no bfloat16; the
GPU check runs bfloat16). Odd sizes on purpose: a hidden size and head dim that are not powers
of two, more heads than one program's block, rows strided as q and k are inside the fused QKV
projection's output. Then the model's forward with these ops against its torch path."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="the triton package is not installed")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 (conftest sets it) or a GPU", allow_module_level=True)

from engine.accel.triton_fused import TritonFused  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.float16]


def rand(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def rel_err(got, want):
    return ((got.double().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


def rms_norm_ref(x, w, eps):
    x = x.double().cpu()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double().cpu()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_add_rms_norm(dtype):
    """rms_norm returns a new tensor; add_rms_norm updates the residual in place (rounded to
    its dtype, as `x + attn` is) and overwrites x with the normed sum."""
    ops = TritonFused()
    x, res, w = rand(5, 96, dtype=dtype), rand(5, 96, dtype=dtype, seed=1), \
        rand(96, dtype=dtype, seed=2)
    out = ops.rms_norm(x, w, 1e-5)
    assert out.data_ptr() != x.data_ptr() and rel_err(out, rms_norm_ref(x, w, 1e-5)) < TOL[dtype]
    x0, res0 = x.clone(), res.clone()
    got = ops.add_rms_norm(x, res, w, 1e-6)
    assert got.data_ptr() == x.data_ptr()
    assert torch.equal(res.cpu(), (x0.cpu().float() + res0.cpu().float()).to(dtype))
    assert rel_err(got, rms_norm_ref(res, w, 1e-6)) < TOL[dtype]
    assert ops.rms_norm(x[:0], w, 1e-5).shape == (0, 96)          # an empty step


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    """Gate then up halves of each row; an intermediate size past one 1,024-column block."""
    ops = TritonFused()
    x = rand(3, 2 * 1100, dtype=dtype)
    gate, up = x.double().cpu().chunk(2, dim=-1)
    assert rel_err(ops.silu_and_mul(x), torch.nn.functional.silu(gate) * up) < TOL[dtype]


@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_strided_q_and_k(dtype, head_dim):
    """q and k heads (20 + 4: two head blocks) as a strided view of the QKV output, rotated in
    place at random positions; V's columns after them untouched."""
    ops = TritonFused()
    heads, n, max_pos = 24, 7, 64
    qkv = rand(n, (heads + 4) * head_dim, dtype=dtype)
    qk = qkv[:, :heads * head_dim].view(n, heads, head_dim)
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    ang = torch.arange(max_pos).double()[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], -1)
    sin = emb.sin()
    sin[:, :head_dim // 2] *= -1                                    # sin_signed
    cos_t, sin_t = emb.cos().to(dtype).to(DEVICE), sin.to(dtype).to(DEVICE)
    positions = torch.tensor([0, 5, 63, 17, 17, 2, 40]).to(DEVICE)
    before, v_before = qk.double().cpu().clone(), qkv[:, heads * head_dim:].clone()
    ops.rotary(qk, positions, cos_t, sin_t)
    c = cos_t.double().cpu()[positions.cpu()][:, None]
    s = sin_t.double().cpu()[positions.cpu()][:, None]
    want = before * c + before.roll(head_dim // 2, -1) * s
    assert rel_err(qk, want) < TOL[dtype]
    assert torch.equal(qkv[:, heads * head_dim:], v_before)


def test_the_runner_gives_these_ops_to_half_precision_models_on_cuda_only():
    """`fused_ops`: TritonFused for float16 / bfloat16 with the Triton backend; float32 keeps
    torch's ops (transformers' bit-exact reference) and the CPU keeps its own kernels."""
    from engine.accel import fused_ops
    assert isinstance(fused_ops("cuda", torch.bfloat16), TritonFused)
    assert isinstance(fused_ops("cuda", torch.float16), TritonFused)
    assert fused_ops("cuda", torch.float32) is None and fused_ops("cpu", torch.bfloat16) is None


def test_model_forward_with_the_fused_ops_matches_its_torch_path(model_dir, tmp_path):
    """The tiny Llama, one prefill of 9 tokens through the Triton attention: hidden states with
    `TritonFused` as `model.fused` against the per-op torch path — float16 on a GPU (within its
    rounding: the fused ops round once where torch rounds after every op), float32 under the
    interpreter (this CPU has no float16 matmul; the ops are set directly there, as the runner
    gives them to half-precision models only)."""
    from benchmarks.checkpoints import build_checkpoint
    from engine.accel.metadata import StepBuffers
    from engine.accel.triton_attention import TritonAttention
    from engine.device import Device
    from engine.models.llama import load_model

    dtype = torch.float16 if DEVICE.type == "cuda" else torch.float32
    path = build_checkpoint(model_dir, tmp_path / "t", "tiny")
    model = load_model(path, Device(DEVICE.type, DEVICE), dtype, 64)
    cfg, backend = model.cfg, TritonAttention()
    cache = torch.zeros(backend.cache_shape(cfg.num_layers, cfg.num_kv_heads, 4, 16,
                                            cfg.head_dim), dtype=dtype, device=DEVICE)
    ids = [1, 17, 300, 4, 99, 7, 8, 1000, 5]
    buffers = StepBuffers(DEVICE, 16, 2, 4)

    def forward():
        cache.zero_()
        input_ids, pos, meta = buffers.fill(backend, ids, torch.arange(9), torch.arange(9), [9],
                                            [9], [[0]], 0)
        return model.forward(input_ids, pos, meta, cache).double().cpu()
    model.set_kernels(None)
    plain = forward()
    model.set_kernels(TritonFused())
    if dtype == torch.float32:
        assert model.fused is None            # float32: torch's ops, unless set directly
        model.fused = TritonFused()
    assert model.fused is not None and model.stack is None
    fused = forward()
    assert (fused - plain).abs().max() / plain.abs().max() < (2e-2 if dtype != torch.float32
                                                              else 1e-4)
