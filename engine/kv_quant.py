"""8-bit KV caches: `--kv-cache-dtype int8 | fp8 | fp8_e4m3 | fp8_e5m2` (vLLM's flag and
values; `auto` keeps the activation dtype).

Owns: `KVQuant`, what the cache's consumers need of an 8-bit cache — its row layout, the
per-tensor scales, and the quantize / dequantize of the torch attention path (the CPU kernels do
the same in C: engine/kernels/kv_cache.c writes, cpu_kernels.c's paged_decode8 reads) — and
`resolve_kv_cache_dtype`, the flag's check.

Layout: the cache keeps its head-major shape `[num_kv_heads, num_blocks, block_size, row]` as
uint8, one row per (token, KV head):
  int8   head_dim int8 values, then the row's float16 scale (2 bytes; max |x| / 127): a scale
         per token and head (llama.cpp's q8_0 keeps one per 32 values, OpenVINO's u8 cache one
         per group). 66 bytes a row at head_dim 64 against bfloat16's 128: 1.94x the blocks.
  fp8    head_dim float8 values (e4m3fn: `fp8`, `fp8_e4m3`; e5m2: `fp8_e5m2`) of x / scale, one
         scale per tensor for K and one for V, 1.0 as vLLM's default (`--kv-cache-dtype fp8`
         without calibrated scales): 2x the blocks of bfloat16.
A block is still one slice along the blocks axis, so block tables, prefix caching (hashes of
tokens), swapping (whole blocks: half the bytes of bfloat16) and copy-on-write are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import check_kv_cache_dtype_name

KINDS = {"int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}          # kernels' KV_* (common.h)
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# cpu_kernels.c reads an e4m3 byte as its value / 256 (a shift into float16's bits); the
# factor is folded into the read scale.
E4M3_UNIT = 256.0


@dataclass(frozen=True)
class KVQuant:
    """An 8-bit KV cache. `name`: "int8", "fp8_e4m3" or "fp8_e5m2"; `k_scale`, `v_scale`: the
    fp8 per-tensor scales (stored value = x / scale; 1.0 for int8, whose scales are per row)."""

    name: str
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def kind(self) -> int:
        """The kernels' kind (common.h: KV_INT8 1, KV_E4M3 2, KV_E5M2 3)."""
        return KINDS[self.name]

    @property
    def k_read_scale(self) -> float:
        """The per-tensor factor the C kernels apply to K (e4m3's unit folded in; 1 for int8,
        whose scales are its rows')."""
        return self._read_scale(self.k_scale)

    @property
    def v_read_scale(self) -> float:
        """The per-tensor factor the C kernels apply to V."""
        return self._read_scale(self.v_scale)

    def _read_scale(self, scale: float) -> float:
        if self.name == "int8":
            return 1.0
        return scale * (E4M3_UNIT if self.name == "fp8_e4m3" else 1.0)

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one (token, KV head) row: head_dim, plus the float16 scale for int8."""
        return head_dim + (2 if self.name == "int8" else 0)

    def quantize(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Rows of `x [..., head_dim]` (any float dtype) as cache rows `[..., row_bytes]`
        uint8. `scale`: the tensor's fp8 scale (k_scale or v_scale; ignored for int8)."""
        if self.name == "int8":
            amax = x.abs().amax(-1, keepdim=True).float()
            s16 = (amax / 127).to(torch.float16)
            s = s16.float()                     # as kv_cache.c: x * (1 / scale), rounded
            inv = torch.where(s > 0, 1 / s.clamp_min(1e-30), 0.0)
            q = (x.float() * inv).round().clamp(-127, 127)
            return torch.cat([q.to(torch.int8).view(torch.uint8), s16.view(torch.uint8)], -1)
        fp8 = FP8[self.name]
        top = torch.finfo(fp8).max
        return (x.float() * (1 / scale)).clamp(-top, top).to(fp8).view(torch.uint8)   # as C

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
                   ) -> torch.Tensor:
        """Cache rows `[..., row_bytes]` uint8 back to `[..., head_dim]` of `dtype`."""
        if self.name == "int8":
            d = rows.shape[-1] - 2
            s = rows[..., d:].contiguous().view(torch.float16).float()
            return (rows[..., :d].contiguous().view(torch.int8).float() * s).to(dtype)
        return (rows.contiguous().view(FP8[self.name]).float() * scale).to(dtype)


def resolve_kv_cache_dtype(name: str) -> KVQuant | None:
    """`--kv-cache-dtype` as a `KVQuant` (None for `auto`: the activation dtype). `fp8` is
    e4m3, as in vLLM. Raises ValueError (one line) for another value."""
    check_kv_cache_dtype_name(name)
    if name == "auto":
        return None
    return KVQuant("fp8_e4m3" if name == "fp8" else name)
