"""The fused elementwise ops of a layer on CUDA, as kernels in Triton's language: residual add +
RMSNorm, rotate-half RoPE on q and k together, SiLU-and-mul — one launch each where torch runs
four to six (the H200 profile of a batch-1 decode step: ~0.3 ms of small elementwise kernels in
a 1.8 ms step, 20-odd launches a layer).

Owns: `TritonFused`, the CUDA counterpart of `engine.kernels.CpuKernels`' fused ops, with the
same call contracts, so `engine.models.llama` runs either through `model.fused`. In: half-
precision activations (float16 / bfloat16: the model runner gives these ops to such models
only; float32 keeps torch's ops, bit-identical to transformers, the parity reference). Out: new
tensors or in-place updates, as each method says. Every op computes in float32 and rounds once
(torch rounds after every op): the CPU kernels' numerics.

Runs under `TRITON_INTERPRET=1` on CPU tensors in float32 and float16 (numpy has no bfloat16),
how tests/test_triton_fused.py checks them on CPU-only machines.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, hidden, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: (res += x; out = rms_norm(res) * w) or (out = rms_norm(x) * w)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_ptr.dtype.element_ty)          # the residual stream's rounding
        tl.store(res_ptr + row * hidden + cols, s, mask=mask)
        x = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (x * inv * w).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    """Program (row, column block): out = silu(gate) * up, gate and up the row's two halves."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, stride_t, pos_ptr, cos_ptr, sin_ptr, heads, head_dim,
                   BLOCK_H: tl.constexpr, HEAD_D: tl.constexpr):
    """Program (token, head block): x = x * cos + roll(x, D/2) * sin_signed, in place."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_D)
    dmask = d < head_dim
    mask = (h < heads)[:, None] & dmask[None, :]
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * head_dim + d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * head_dim + d, mask=dmask, other=0.0).to(tl.float32)
    rot = (d + head_dim // 2) % head_dim                 # roll by D/2: the other half
    base = x_ptr + t * stride_t + h[:, None] * head_dim
    x = tl.load(base + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + rot[None, :], mask=mask, other=0.0).to(tl.float32)
    out = x * cos[None, :] + x2 * sin[None, :]
    tl.store(base + d[None, :], out.to(x_ptr.dtype.element_ty), mask=mask)


class TritonFused:
    """The fused ops on CUDA (module docstring); contracts as `engine.kernels.CpuKernels`'.
    `layer_stack` False: `engine.kernels.stack` (the CPU's one-call layer loop) does not run
    on these."""

    layer_stack = False

    @staticmethod
    def _norm(x, residual, weight, out, eps: float) -> torch.Tensor:
        if x.shape[0]:
            _add_rms_norm_kernel[(x.shape[0],)](
                x, x if residual is None else residual, weight, out, x.shape[1], eps,
                HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(x.shape[1]))
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`x [n, hidden]` (contiguous) → new `rms_norm(x) * weight`, float32 math."""
        return self._norm(x, None, weight, torch.empty_like(x), eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """In place, both `[n, hidden]` contiguous: `residual += x` (rounded to its dtype),
        then `x = rms_norm(residual) * weight`; returns `x`."""
        return self._norm(x, residual, weight, x, eps)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        """`x [n, 2 * inter]` (contiguous, gate then up) → new `silu(gate) * up [n, inter]`."""
        n, two_inter = x.shape
        inter = two_inter // 2
        out = x.new_empty((n, inter))
        if n:
            block = min(1024, triton.next_power_of_2(inter))
            _silu_and_mul_kernel[(n, triton.cdiv(inter, block))](x, out, inter, BLOCK=block)
        return out

    @staticmethod
    def rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin_signed: torch.Tensor) -> None:
        """Rotate-half RoPE in place on `x [n, heads, head_dim]` (rows may be strided, heads
        contiguous) at `positions [n] int64`; `cos`, `sin_signed [max_pos, head_dim]`
        (contiguous) with the first half of sin negated."""
        n, heads, head_dim = x.shape
        if not n:
            return
        if x.stride(2) != 1 or x.stride(1) != head_dim:
            raise ValueError("rotary: heads must be contiguous rows of head_dim")
        block_h = min(16, triton.next_power_of_2(heads))
        _rotary_kernel[(n, triton.cdiv(heads, block_h))](
            x, x.stride(0), positions, cos, sin_signed, heads, head_dim,
            BLOCK_H=block_h, HEAD_D=triton.next_power_of_2(head_dim))
