"""Linear layers: which GEMM computes `y = x @ weight.T (+ bias)` on this device, ISA and dtype.

Owns: the choice of linear path (`linear_path`, said in the engine's ready log) and `Linear`,
which holds a weight in that path's layout. In: a weight `[out, in]` (and bias `[out]`) in the
model dtype at load; per call `x [M, in]`. Out: `[M, out]` in the model dtype (or float32 for
logits).

Paths:
- `onednn`: the weight prepacked once for oneDNN (`mkldnn._reorder_linear_weight`, the path
  torch.compile's CPU backend uses) and applied with `mkldnn._linear_pointwise`. float32 on any
  x86 host; bfloat16 / float16 only where oneDNN has those matmuls (AVX-512 BW/VL/DQ or
  AVX-NE-CONVERT; AVX512-FP16 for float16) and `CONTINUUM_CPU_ISA` does not cap the ISA below it.
- `kernel`: Continuum's bfloat16-weight GEMM with float32 arithmetic (engine/kernels/gemm.c), for
  bfloat16 where oneDNN has no bfloat16 matmul (AVX2-only hosts).
- `torch`: `F.linear` (CUDA, NPU, no oneDNN, no C compiler).
- `quant`: a weight kept quantized (`engine.quant.QuantWeight`: GGUF blocks or int8), read in
  its block format by engine/kernels/quant.c; chosen by the weight, not by `linear_path`.

Measured on an AVX2-only host (AMD EPYC, 2 threads), the model's 30 layers of linears, ms:
rows 1 / 16 / 64 / 1024 — float32 oneDNN 24.6 / 45.1 / 114 / 1394; bfloat16 kernel
10.2 / 23.7 / 86.3 / 1292; bfloat16 `F.linear` 13.4 / 173 / 698 / — (torch's bfloat16 GEMM
without oneDNN); bfloat16 cast to float32 oneDNN 24.5 / — / 113 / —.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)
PATHS = ("onednn", "kernel", "torch", "quant")
# As the engine's ready log says them.
LINEAR_PATH_NAMES = {"onednn": "oneDNN prepacked", "kernel": "bfloat16-weight GEMM kernel",
                     "torch": "torch F.linear", "quant": "quantized kernels"}


def _onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN has a prepacked matmul for `dtype` here, under the project's ISA cap."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    from engine.kernels.isa import at_least, is_capped
    if is_capped() and not at_least("avx512"):   # CONTINUUM_CPU_ISA=avx2 or below: act like it
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def linear_path(device_kind: str, dtype: torch.dtype, kernels) -> str:
    """The linear path (one of PATHS) for a model of `dtype` on `device_kind` ("cpu", "cuda",
    "npu"), given the loaded CPU kernels (`engine.kernels.CpuKernels` or None).

    Raises ValueError, one line saying what to use instead, for float16 on a CPU with no
    float16 matmul (torch's own is ~5x slower than float32 there)."""
    if device_kind != "cpu":
        return "torch"
    if _onednn_supports(dtype):
        return "onednn"
    if dtype == torch.bfloat16:
        if kernels is not None:
            return "kernel"
        logger.warning("bfloat16 without oneDNN bfloat16 support or the CPU kernels: linear "
                       "layers use torch's bfloat16 GEMM, several times slower than float32")
        return "torch"
    if dtype == torch.float16:
        raise ValueError("--dtype float16: this CPU has no float16 matmul (oneDNN needs "
                         "AVX512-FP16 or AVX-NE-CONVERT); use --dtype bfloat16 (same memory) "
                         "or --dtype float32")
    return "torch"


class Linear:
    """`y = x @ weight.T (+ bias)` for `x [M, in]` on `path` (see the module docstring).

    `weight [out, in]` in the model dtype, or quantized: a `QuantWeight`, or a list of them
    stacked along `out` (kept as separate products when their block types differ); `bias [out]`
    or None. `kernels` is required for path "kernel" and quantized weights; `int8_x` quantizes
    x to int8 for a quantized weight where quant_q8.c has a kernel (with the wide nest's copy
    of the weight, `CpuKernels.q8_pack`); otherwise `bf16_x` (the model computes in bfloat16)
    gives a quantized weight the bfloat16 panels' copy (`CpuKernels.panel_pack`) where the
    build has them. Raises ValueError for an unknown path."""

    PACK_BATCH_HINT = 64

    def __init__(self, weight, bias: torch.Tensor | None = None,
                 path: str = "torch", kernels=None, int8_x: bool = False,
                 bf16_x: bool = False) -> None:
        from engine.quant.formats import QuantWeight
        if isinstance(weight, (QuantWeight, list)):
            path = "quant"
        if path not in PATHS or (path in ("kernel", "quant") and kernels is None):
            raise ValueError(f"linear path {path!r} (kernels: {kernels is not None})")
        self.path, self.kernels = path, kernels
        self.int8_x = int8_x and path == "quant"
        self._out: torch.Tensor | None = None        # reuse_output's buffer (flat)
        self._out_view: torch.Tensor | None = None   # ... and its last [m, out] view
        if path == "quant":             # kept as blocks; the bias in float32, as quant.c adds it
            parts = weight if isinstance(weight, list) else [weight]
            merged = QuantWeight.cat(parts) if len(parts) > 1 else parts[0]
            self.parts = [merged] if merged is not None else parts
            for part in self.parts:             # a repacked copy for the nest that reads it
                if self.int8_x:
                    if kernels.q8_available:
                        kernels.q8_pack(part)       # the int8 wide nest (3+ rows)
                elif bf16_x:
                    kernels.panel_pack(part)        # the bfloat16 panels (5+ rows)
            self.out_features = sum(p.shape[0] for p in parts)
            self.weight, self.packed = None, None
            self.bias = None if bias is None else bias.float().contiguous()
            return
        self.weight, self.bias, self.packed = weight, bias, None
        self.out_features = weight.shape[0]
        if path == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.PACK_BATCH_HINT)
            self.weight = None       # the packed copy is the only one read (a second 2 B/param)
        elif path == "kernel":
            self.packed = kernels.pack_linear(weight)
            self.weight = None                       # the packed copy is the only one kept
            self.bias = None if bias is None else bias.to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None,
                 reuse_output: bool = False) -> torch.Tensor:
        """`x [M, in]` → `[M, out]` in `out_dtype` (default: x's dtype). With `reuse_output`
        (honoured on the quantized path with one weight), the result is a view of a buffer
        this layer keeps (grown to the most rows asked) and overwrites on its next such call:
        for an output made and dropped every step (`LlamaForCausalLM.compute_logits`)."""
        if self.path == "quant":
            if len(self.parts) == 1:
                out = (self.reused_output(x.shape[0], out_dtype or x.dtype) if reuse_output
                       else None)
                return self.kernels.quant_linear(x, self.parts[0], self.bias, out_dtype,
                                                 self.int8_x, out=out)
            y = torch.cat([self.kernels.quant_linear(x, p, None, out_dtype, self.int8_x)
                           for p in self.parts], dim=-1)
            return y if self.bias is None else (y + self.bias).to(y.dtype)
        if self.path == "kernel":
            return self.kernels.linear(x, self.packed, self.out_features, self.bias,
                                       out_dtype or x.dtype)
        if self.path == "onednn":
            y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias,
                                                   "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if out_dtype is None else y.to(out_dtype)

    def reused_output(self, m: int, dtype: torch.dtype) -> torch.Tensor:
        """`[m, out]` of `dtype` over the buffer `reuse_output` writes into (a larger one when
        it is too small), valid until the next such call (`engine.kernels.stack` writes the
        LM head's logits there too)."""
        view = self._out_view
        if view is not None and view.shape[0] == m and view.dtype == dtype:
            return view                            # a decode batch's size, again: no torch op
        size = m * self.out_features
        if self._out is None or self._out.dtype != dtype or self._out.numel() < size:
            self._out = torch.empty(size, dtype=dtype)
        self._out_view = view = self._out[:size].view(m, self.out_features)
        return view
