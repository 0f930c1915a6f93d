"""Which x86 instruction-set level the CPU kernels and the linear layers target.

Owns: reading the host's CPU flags, the project switch `CONTINUUM_CPU_ISA` (`amx`, `avx512`,
`avx2` or `generic`) that caps the level below what the host has — so an AMX machine can test
the AVX-512 paths, and an AVX-512 one the AVX2 paths (together with oneDNN's
`ONEDNN_MAX_CPU_ISA=AVX2` and ATen's `ATEN_CPU_CAPABILITY=avx2`) —, the switch
`CONTINUUM_CPU_HIDE` (e.g. `avx512_bf16`) that hides an extension from the engine and its
kernel build — so an AMD EPYC runs as an Ice Lake Xeon would (with oneDNN's
`ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI`) —, and the C compiler's `-march` for each level.

Levels: `amx` is `avx512` with AMX tiles for bfloat16 (`amx_tile`, `amx_bf16`) and AVX512-BF16
(Intel Sapphire, Emerald and Granite Rapids Xeons); `avx512` needs AVX-512 F, BW, VL and DQ;
`avx2` needs AVX2 and FMA (x86-64-v3); `generic` is anything else, non-x86 hosts included.
In: /proc/cpuinfo and the environment. Out: `cpu_isa()`, `host_isa()`, `at_least(floor)`,
`march_flags(isa)`, `flags_and_level()`, `bf16_matmul()` (whether `--dtype auto` is bfloat16
here), `slow_bf16_dot()` (bfloat16 units slower than int8 ones: Intel without AMX),
`isa_label()` (the ready log's `cpu isa: ...`) and `usable_cpus()`.
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path

LEVELS = ("generic", "avx2", "avx512", "amx")
_AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
_NEEDS = {"amx": _AVX512 | {"amx_tile", "amx_bf16", "avx512_bf16"}, "avx512": _AVX512,
          "avx2": {"avx2", "fma"}}
# The compiler's names of the AMX extensions, turned off in an `avx512` build on an AMX host.
_NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
ENV = "CONTINUUM_CPU_ISA"


HIDE_ENV = "CONTINUUM_CPU_HIDE"
# What CONTINUUM_CPU_HIDE may take away, with the compiler's switch that keeps it out of a
# `-march=native` build: so that a host runs as one of a class it is not (an Ice Lake or
# Cascade Lake Xeon has AVX-512 VNNI without BF16; a Skylake Xeon has neither).
HIDEABLE = {"avx512_bf16": ["-mno-avx512bf16"], "avx512_vnni": ["-mno-avx512vnni"]}


@lru_cache(maxsize=None)
def hidden_flags() -> frozenset[str]:
    """`CONTINUUM_CPU_HIDE` (comma list of HIDEABLE's names): the host's CPU flags the engine
    and its kernels act as if absent. Raises ValueError (one line) for another name."""
    names = {n.strip().lower() for n in os.environ.get(HIDE_ENV, "").split(",") if n.strip()}
    unknown = names - HIDEABLE.keys()
    if unknown:
        raise ValueError(f"{HIDE_ENV}={','.join(sorted(unknown))}: can hide only "
                         f"{', '.join(HIDEABLE)}")
    return frozenset(names)


def _cpuinfo_field(name: str) -> str | None:
    """The first value of `name` ("flags", "vendor_id") in /proc/cpuinfo, or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _proc_flags() -> set[str]:
    return set((_cpuinfo_field("flags") or "").split())


# What hiding a flag hides with it: an Ice Lake has no AMX either, and the tile kernels need
# AVX512-BF16 (amx.h), so a host with AVX512-BF16 hidden has no bfloat16 matmul units at all.
HIDES_ALSO = {"avx512_bf16": {"amx_bf16", "amx_tile", "amx_int8"}}


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one, else the
    machine's count; at least 1): the kernel build's parallel compiles, the tensor-parallel
    ranks' share of the cores."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def cpu_flags() -> set[str]:
    """The host's CPU feature flags from /proc/cpuinfo (empty where there is none), less those
    `CONTINUUM_CPU_HIDE` hides (and HIDES_ALSO's)."""
    names = hidden_flags()
    return _proc_flags() - names.union(*(HIDES_ALSO.get(n, ()) for n in names))


def host_isa(flags: set[str] | None = None) -> str:
    """The highest level in LEVELS that `flags` (default: this host's) support."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "generic"
    flags = cpu_flags() if flags is None else flags
    for level in ("amx", "avx512", "avx2"):
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


def at_least(floor: str, level: str | None = None) -> bool:
    """Whether `level` (default: the engine's, `cpu_isa()`) is `floor` or above it in LEVELS:
    `at_least("avx512")` holds on AMX hosts too."""
    return LEVELS.index(level or cpu_isa()) >= LEVELS.index(floor)


BF16_MATMUL_FLAGS = ("amx_bf16", "avx512_bf16")     # bfloat16 dot products in hardware


def flags_and_level(flags: set[str] | None = None) -> tuple[set[str], str]:
    """(flags, level): this host's flags at the engine's level (`cpu_isa`, capped), or the
    given flags at the level they support."""
    return (cpu_flags(), cpu_isa()) if flags is None else (flags, host_isa(flags))


def bf16_matmul(flags: set[str] | None = None) -> bool:
    """Whether the engine's level has bfloat16 matmul units: AMX-BF16 tiles or AVX512-BF16's
    `vdpbf16ps`, at level avx512 or amx (a cap to avx2 takes them away). `flags` default: this
    host's. `--dtype auto` is bfloat16 where this holds (vLLM takes the checkpoint's bfloat16
    on such CPUs), float32 elsewhere, where bfloat16 would be converted to float32 for every
    product."""
    flags, level = flags_and_level(flags)
    return at_least("avx512", level) and any(f in flags for f in BF16_MATMUL_FLAGS)


@lru_cache(maxsize=None)
def cpu_vendor() -> str:
    """The host's `vendor_id` from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"; "" where
    there is none)."""
    return _cpuinfo_field("vendor_id") or ""


def slow_bf16_dot(flags: set[str] | None = None, vendor: str | None = None) -> bool:
    """Whether the level's bfloat16 products are AVX512-BF16's `vdpbf16ps` on an Intel core —
    AVX512-BF16 without AMX tiles at the engine's level: a Cooper Lake, or a Sapphire / Emerald
    Rapids whose hypervisor hides AMX (or capped at avx512). Intel cores issue a 512-bit
    `vdpbf16ps` once per two cycles: on an Emerald Rapids with AMX hidden (2026-12-02,
    `benchmarks/dot_peak.c`) 40-42 G multiply-adds a second a core, half float32 FMAs' 83-85 and
    a fifth of VNNI's `vpdpbusd` (190-236); AMD Zen 4 / 5 run it on both FMA pipes. `flags` /
    `vendor` default: this host's (`cpu_vendor()`)."""
    flags, level = flags_and_level(flags)
    vendor = cpu_vendor() if vendor is None else vendor
    return (vendor == "GenuineIntel" and level == "avx512" and "avx512_bf16" in flags)


def isa_label(flags: set[str] | None = None) -> str:
    """The level as the ready log names it, with the vector extensions the kernels and oneDNN
    use: e.g. "amx (avx512, vnni, bf16)", "avx512 (vnni, bf16)", "avx512 (vnni)", "avx2"."""
    flags, level = flags_and_level(flags)
    if not at_least("avx512", level):
        return level
    extras = ["avx512"] if level == "amx" else []
    extras += [name for name, flag in (("vnni", "avx512_vnni"), ("bf16", "avx512_bf16"))
               if flag in flags]
    return f"{level} ({', '.join(extras)})" if extras else level


def march_flags(isa: str) -> list[str]:
    """`-march` for a kernel build at `isa`: the host's own (`native`) when `isa` is the host's
    level; `native` without the AMX extensions for avx512 on an AMX host (its AVX512-BF16 and
    VNNI loops stay); `native` less what `CONTINUUM_CPU_HIDE` hides; else the level's baseline
    (`x86-64-v3` for avx2, `x86-64-v2` for generic on x86)."""
    host = host_isa()
    hide = [switch for name in sorted(hidden_flags()) for switch in HIDEABLE[name]]
    if "amx_tile" in _proc_flags() and isa != "amx":
        hide += _NO_AMX              # an AMX host capped at avx512, or with BF16 hidden
    if isa == host or (isa == "avx512" and host == "amx"):
        return ["-march=native", *hide] if platform.machine() in ("x86_64", "AMD64") else []
    return {"avx512": ["-march=x86-64-v4"], "avx2": ["-march=x86-64-v3"],
            "generic": ["-march=x86-64-v2"]}[isa]
