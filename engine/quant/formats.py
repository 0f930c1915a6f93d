"""Quantized weight formats: GGUF block types read in place, and int8 weight-only made at load.

Owns: `QuantWeight` (a weight `[N, K]` kept as N rows of quantized blocks), the block table of
the types the CPU kernels read (`KERNEL_TYPES`), `quantize_int8` (per-output-channel symmetric
int8), dequantization for references and fallbacks (gguf-py's numpy code, float32), and the row
and column slicing that tensor parallelism and the fused projections need.

Block layouts are ggml's (ggml-common.h): Q8_0 `{f16 d; i8 q[32]}`, Q4_0 `{f16 d; u8 q[16]}`,
Q4_1 `{f16 d, m; u8 q[16]}`, Q4_K `{f16 d, dmin; u8 scales[12]; u8 q[128]}` (256 values),
Q6_K `{u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}` (256 values). I8 is Continuum's int8
weight-only format: 32 int8 per block, K zero-padded to whole blocks, one float32 scale per row
(`w ≈ q * scale[n]`, scale = max|w[n]| / 127; the per-channel scheme of LLM.int8()'s weights,
Dettmers et al. 2022, without its outlier split).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

# GGML type id -> (name, values per block, bytes per block), for the types with a CPU kernel.
KERNEL_TYPES = {8: ("Q8_0", 32, 34), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
                12: ("Q4_K", 256, 144), 14: ("Q6_K", 256, 210), 24: ("I8", 32, 32)}
TYPE_IDS = {name: qtype for qtype, (name, _, _) in KERNEL_TYPES.items()}


@dataclass
class QuantWeight:
    """A weight `[N, K]` (out, in) as quantized blocks: `data [N, row_bytes] uint8`, each row
    `ceil(K / block)` blocks of `qtype` (a GGML type id in KERNEL_TYPES); `scale [N] float32`
    for I8 only; `q8_packed`: the int8-activation nest's repacked copy (`CpuKernels.q8_pack`),
    or None; `panel_packed`: the bfloat16 panels' (`CpuKernels.panel_pack`), or None."""

    qtype: int
    data: torch.Tensor
    shape: tuple[int, int]
    scale: torch.Tensor | None = None
    q8_packed: torch.Tensor | None = None
    panel_packed: torch.Tensor | None = None

    @property
    def type_name(self) -> str:
        """The block type's name, e.g. "Q4_1" (the id as text for a type without a kernel)."""
        return KERNEL_TYPES[self.qtype][0] if self.qtype in KERNEL_TYPES else str(self.qtype)

    @property
    def block_values(self) -> int:
        """Weights per block along K (32, or 256 for Q4_K / Q6_K)."""
        return KERNEL_TYPES[self.qtype][1]

    @cached_property
    def kernel_args(self) -> tuple[int, int, int, int | None]:
        """What quant.c takes for this weight, fixed once it exists (data never moves):
        (GGML type id, address of `data`, row bytes, address of `scale` or None)."""
        scale = None if self.scale is None else self.scale.data_ptr()
        return self.qtype, self.data.data_ptr(), self.data.shape[1], scale

    @property
    def nbytes(self) -> int:
        """Bytes a forward pass reads for this weight (blocks and scales)."""
        extra = 0 if self.scale is None else self.scale.numel() * 4
        return self.data.numel() + extra

    def dequantize(self) -> torch.Tensor:
        """float32 `[N, K]`: gguf-py's numpy dequantization (ggml's formulas), or q * scale."""
        n, k = self.shape
        if self.qtype == TYPE_IDS["I8"]:
            q = self.data.view(torch.int8)[:, :k].float()
            return q * self.scale[:, None]
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        out = dequantize(self.data.numpy(), GGMLQuantizationType(self.qtype))
        return torch.from_numpy(np.ascontiguousarray(out[:, :k], dtype=np.float32))

    def rows(self, start: int, count: int) -> QuantWeight:
        """Rows `[start, start + count)`, zero rows past N (zero blocks dequantize to 0)."""
        part = self.data[start:start + count]
        scale = None if self.scale is None else self.scale[start:start + count]
        if part.shape[0] < count:
            pad = count - part.shape[0]
            part = torch.cat([part, part.new_zeros(pad, part.shape[1])])
            if scale is not None:
                scale = torch.cat([scale, scale.new_zeros(pad)])
        return QuantWeight(self.qtype, part.contiguous(), (count, self.shape[1]),
                           None if scale is None else scale.contiguous())

    def cols(self, start: int, count: int) -> QuantWeight | None:
        """Columns `[start, start + count)` as whole blocks, or None where they do not fall on
        block boundaries (the caller dequantizes instead)."""
        per = self.block_values
        if start % per or (count % per and start + count != self.shape[1]):
            return None
        bytes_per = KERNEL_TYPES[self.qtype][2]
        b0, nblk = start // per, -(-count // per)
        part = self.data[:, b0 * bytes_per:(b0 + nblk) * bytes_per].contiguous()
        return QuantWeight(self.qtype, part, (self.shape[0], count), self.scale)

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight | None:
        """Rows of `parts` stacked (the fused QKV and gate/up projections), or None when their
        types or K differ (the caller keeps them apart)."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.shape[1] != first.shape[1] for p in parts):
            return None
        scale = (None if first.scale is None else torch.cat([p.scale for p in parts]))
        return QuantWeight(first.qtype, torch.cat([p.data for p in parts]),
                           (sum(p.shape[0] for p in parts), first.shape[1]), scale)


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """Per-output-channel symmetric int8 of `weight [N, K]` (any float dtype): scale[n] =
    max|w[n]| / 127 (1 for an all-zero row), q = round(w / scale) in [-127, 127], K zero-padded
    to a multiple of 32. Returns an I8 `QuantWeight`."""
    w = weight.detach().float()
    n, k = w.shape
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    kp = -(-k // 32) * 32
    if kp != k:
        q = torch.cat([q, q.new_zeros(n, kp - k)], dim=1)
    return QuantWeight(TYPE_IDS["I8"], q.view(torch.uint8).contiguous(), (n, k),
                       scale.contiguous())
