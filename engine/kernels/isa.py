"""Which x86 instruction-set level the CPU kernels and the linear layers target.

Owns: reading the host's CPU flags, the project switch `CONTINUUM_CPU_ISA` (`avx512`, `avx2` or
`generic`) that caps the level below what the host has — so an AVX-512 machine can test the
AVX2 paths, together with oneDNN's `ONEDNN_MAX_CPU_ISA=AVX2` and ATen's
`ATEN_CPU_CAPABILITY=avx2` —, and the C compiler's `-march` for each level.

Levels: `avx512` needs AVX-512 F, BW, VL and DQ; `avx2` needs AVX2 and FMA (x86-64-v3);
`generic` is anything else, non-x86 hosts included. In: /proc/cpuinfo and the environment.
Out: `cpu_isa()`, `host_isa()`, `march_flags(isa)`, `bf16_matmul()` (whether `--dtype auto`
is bfloat16 here) and `isa_label()` (the ready log's `cpu isa: ...`).
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path

LEVELS = ("generic", "avx2", "avx512")
_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx2": {"avx2", "fma"}}
ENV = "CONTINUUM_CPU_ISA"


def cpu_flags() -> set[str]:
    """The host's CPU feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def host_isa(flags: set[str] | None = None) -> str:
    """The highest level in LEVELS that `flags` (default: this host's) support."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "generic"
    flags = cpu_flags() if flags is None else flags
    for level in ("avx512", "avx2"):
        if _NEEDS[level] <= flags:
            return level
    return "generic"


@lru_cache(maxsize=None)
def cpu_isa() -> str:
    """The level the engine targets: the host's, or `CONTINUUM_CPU_ISA` where that is lower.

    Raises ValueError (one line) for an unknown value or a level the host does not have."""
    host = host_isa()
    want = os.environ.get(ENV, "").strip().lower()
    if not want:
        return host
    if want not in LEVELS:
        raise ValueError(f"{ENV}={want!r}: must be one of {', '.join(LEVELS)}")
    if LEVELS.index(want) > LEVELS.index(host):
        raise ValueError(f"{ENV}={want}: this CPU supports only {host} "
                         f"(flags {' '.join(sorted(_NEEDS.get(want, ())))} are needed)")
    return want


def is_capped() -> bool:
    """Whether `CONTINUUM_CPU_ISA` lowers the level below the host's."""
    return cpu_isa() != host_isa()


BF16_MATMUL_FLAGS = ("amx_bf16", "avx512_bf16")     # bfloat16 dot products in hardware


def _flags_and_level(flags: set[str] | None) -> tuple[set[str], str]:
    """(flags, level): this host's flags at the engine's level (`cpu_isa`, capped), or the
    given flags at the level they support."""
    return (cpu_flags(), cpu_isa()) if flags is None else (flags, host_isa(flags))


def bf16_matmul(flags: set[str] | None = None) -> bool:
    """Whether the engine's level has bfloat16 matmul units: AMX-BF16 tiles or AVX512-BF16's
    `vdpbf16ps`, at level avx512 (a cap to avx2 takes them away). `flags` default: this
    host's. `--dtype auto` is bfloat16 where this holds (vLLM takes the checkpoint's bfloat16
    on such CPUs), float32 elsewhere, where bfloat16 would be converted to float32 for every
    product."""
    flags, level = _flags_and_level(flags)
    return level == "avx512" and any(f in flags for f in BF16_MATMUL_FLAGS)


def isa_label(flags: set[str] | None = None) -> str:
    """The level as the ready log names it, with the matmul extensions the kernels and oneDNN
    use: e.g. "avx512 (vnni)", "avx512 (vnni, bf16)", "avx512 (amx, vnni, bf16)", "avx2"."""
    flags, level = _flags_and_level(flags)
    if level != "avx512":
        return level
    extras = [name for name, flag in (("amx", "amx_tile"), ("vnni", "avx512_vnni"),
                                      ("bf16", "avx512_bf16")) if flag in flags]
    return f"avx512 ({', '.join(extras)})" if extras else level


def march_flags(isa: str) -> list[str]:
    """`-march` for a kernel build at `isa`: the host's own (`native`) when `isa` is the host's
    level, else the level's baseline (`x86-64-v3` for avx2, `x86-64-v2` for generic on x86)."""
    if isa == host_isa():
        return ["-march=native"] if platform.machine() in ("x86_64", "AMD64") else []
    return {"avx512": ["-march=x86-64-v4"], "avx2": ["-march=x86-64-v3"],
            "generic": ["-march=x86-64-v2"]}[isa]
