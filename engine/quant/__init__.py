"""Quantized weights on the CPU: GGUF blocks served as they are, and int8 weight-only.

Owns: the `--quantization` and `--activation-quantization` choices (`resolve_quantization`),
the weight formats
(`engine.quant.formats`: `QuantWeight`, `quantize_int8`) and reading a GGUF file's tensors in
their block format under HF names (`engine.quant.gguf_weights`). The kernels that read the blocks
are `engine/kernels/quant.c` (float32 activations) and `quant_q8.c` (int8 activations);
`engine.linear.Linear` runs them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

logger = logging.getLogger(__name__)

METHODS = ("gguf", "int8", "none")
ACTIVATION_METHODS = ("auto", "none", "int8")


@dataclass(frozen=True)
class Quantization:
    """How the model's weights are served: `method` "gguf" (the GGUF file's blocks, read by
    the kernels), "int8" (per-channel int8 made at load) or "none" (the model dtype); `gguf` the
    GGUF file for "gguf"; `int8_activations`: x quantized to int8 per block of 32 in the
    quantized products (`engine/kernels/quant_q8.c`, `quant_q8_wide.c`: AVX-512 VNNI or
    AVX2)."""

    method: str = "none"
    gguf: str | None = None
    int8_activations: bool = False

    def describe(self, types: list[str], isa: str | None, int8_nest: str = "vnni") -> str:
        """The ready log's linear path, e.g. `gguf Q4_1/Q8_0 kernels (avx512)`, with
        `, int8 activations (vnni)` when they are on (`int8_nest`: `CpuKernels.q8_label`,
        `avx2` where the products are vpmaddubsw's)."""
        extra = f", int8 activations ({int8_nest})" if self.int8_activations else ""
        return f"{self.method} {'/'.join(types)} kernels ({isa}){extra}"


def gguf_file(model: str | None) -> Path | None:
    """The GGUF file `model` (the `MODEL` argument) names: the embedded model's for None, the
    path for a `.gguf` file, else None (an HF directory)."""
    if model is None:
        from engine.loader import embedded_gguf_path
        return embedded_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_quantization(requested: str | None, model: str | None, device,
                         activations: str = "none", dtype: str = "auto") -> Quantization:
    """`--quantization` (None = the default) for `model` on `device` (`engine.device.Device`):
    the block kernels need the CPU and its compiled kernels (built for float32 and bfloat16
    alike, so this comes before `--dtype auto`, which depends on it).

    Default: "gguf" for a GGUF model on a CPU with the kernels, else "none" (vLLM's default of
    the checkpoint's own format; a GGUF elsewhere is served dequantized). Raises ValueError,
    one line naming the flag: an unknown method, "gguf" for a model that is not a GGUF file,
    "gguf" / "int8" off the CPU or without the kernels, `activations` "int8" (the
    `--activation-quantization` flag) without quantized weights. Where the host has no AVX-512
    VNNI or AVX2, int8 activations are off with one warning line (float32 activations, same
    kernels).
    `activations` "auto" (the flag's default) is `auto_int8_activations`'s choice; `dtype`:
    the `--dtype` flag it depends on."""
    if activations not in ACTIVATION_METHODS:
        raise ValueError(f"--activation-quantization must be one of "
                         f"{', '.join(ACTIVATION_METHODS)}, got {activations!r}")
    quant = _weights(requested, model, device)
    if activations == "auto":
        on = quant.method != "none" and auto_int8_activations(_kernels(device).q8_available,
                                                              dtype)
        return replace(quant, int8_activations=True) if on else quant
    if activations == "none":
        return quant
    if quant.method == "none":
        raise ValueError("--activation-quantization int8 needs quantized weights "
                         "(--quantization gguf or int8)")
    if not _kernels(device).q8_available:
        logger.warning("--activation-quantization int8: the kernels have no int8 products "
                       "here (AVX-512 VNNI or AVX2); activations stay float32")
        return quant
    return replace(quant, int8_activations=True)


def auto_int8_activations(q8_available: bool, dtype: str, flags: set[str] | None = None,
                          vendor: str | None = None) -> bool:
    """`--activation-quantization auto` over quantized weights: int8 where the kernels have
    int8 products (`q8_available`) and the engine's level (`flags`, default this host's, with
    `CONTINUUM_CPU_ISA`'s cap) has no bfloat16 matmul units that beat them
    (`engine.kernels.isa.bf16_matmul`, less `slow_bf16_dot`: AVX512-BF16 on an Intel core
    without AMX tiles, where `vdpbf16ps` runs at half float32 FMAs' rate) and either AVX-512
    VNNI — an Ice Lake or Cascade Lake Xeon, a Cooper Lake, or a Sapphire / Emerald Rapids whose
    hypervisor hides AMX: VNNI's `vpdpbusd` does four times float32's multiply-adds an
    instruction — or only AVX2 (EPYC Rome / Milan, Haswell / Broadwell Xeons: `vpmaddubsw`, and
    4-bit weights unpacked without conversions), and `dtype` (`--dtype`) is "auto" or
    "bfloat16". `vendor`: the CPU's `vendor_id` (default this host's). Measured gains and the
    accuracy cost: docs/quantization.md. Where fast bfloat16 units exist (AMX tiles, AMD's
    AVX512-BF16) their pair products stay (int8 gained only at 2-8 sequences on a Zen 5);
    AVX-512 without VNNI (Skylake) keeps float32 products (emulated on Zen 5: 0.90-1.33x,
    unmeasured on a Skylake); `--dtype float32` keeps float32 activations as the exact
    reference."""
    from engine.kernels.isa import bf16_matmul, flags_and_level, slow_bf16_dot
    have, level = flags_and_level(flags)            # None: this host at the engine's level
    int8_units = level == "avx2" or (level in ("avx512", "amx") and "avx512_vnni" in have)
    fast_bf16 = bf16_matmul(flags) and not slow_bf16_dot(flags, vendor)
    return q8_available and dtype in ("auto", "bfloat16") and not fast_bf16 and int8_units


def _kernels(device):
    """The device's CPU kernels (one build serves float32 and bfloat16), or None."""
    import torch
    return device.kernels(torch.float32)


def _weights(requested: str | None, model: str | None, device) -> Quantization:
    """resolve_quantization's weight format."""
    if requested is not None and requested not in METHODS:
        raise ValueError(f"--quantization must be one of {', '.join(METHODS)}, got {requested!r}")
    if requested == "none":
        return Quantization()
    have_kernels = _kernels(device) is not None
    cpu = device.kind == "cpu" and have_kernels
    gguf = gguf_file(model)
    if requested is None:
        return Quantization("gguf", str(gguf)) if gguf is not None and cpu else Quantization()
    if not cpu:
        raise ValueError(f"--quantization {requested} runs on the CPU kernels only "
                         f"({device.kind}{'' if have_kernels else ', no C compiler'}); "
                         "drop the flag to serve the dequantized model")
    if requested == "gguf":
        if gguf is None:
            raise ValueError(f"--quantization gguf needs a .gguf model; {model!r} is not one "
                             "(use --quantization int8 for an HF checkpoint)")
        return Quantization("gguf", str(gguf))
    return Quantization("int8")
