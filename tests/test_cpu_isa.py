"""The CPU ISA level (engine/kernels/isa.py), the project switch CONTINUUM_CPU_ISA, and the
linear path each dtype gets (engine/linear.py): what a user on an AVX2-only host, an AVX-512 host
or a capped test run relies on."""

import platform
import subprocess
import sys

import pytest
import torch

from engine.kernels import isa
from engine.linear import Linear, linear_path

X86 = platform.machine() == "x86_64"


@pytest.fixture
def capped(monkeypatch):
    """Set CONTINUUM_CPU_ISA for one test (the level is cached per process)."""
    def set_level(level: str) -> None:
        monkeypatch.setenv(isa.ENV, level)
        isa.cpu_isa.cache_clear()
    yield set_level
    monkeypatch.delenv(isa.ENV, raising=False)
    isa.cpu_isa.cache_clear()


@pytest.mark.skipif(not X86, reason="x86 levels")
def test_host_level_from_flags():
    assert isa.host_isa({"avx2", "fma", "sse4_2"}) == "avx2"
    assert isa.host_isa({"avx2"}) == "generic"              # AVX2 without FMA is not v3
    full = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert isa.host_isa(full) == "avx512"
    assert isa.host_isa(full - {"avx512bw"}) == "avx2"
    tiles = full | {"amx_tile", "amx_bf16", "amx_int8", "avx512_bf16"}
    assert isa.host_isa(tiles) == "amx"
    assert isa.host_isa(tiles - {"avx512_bf16"}) == "avx512"     # tiles need its conversions
    assert isa.at_least("avx512", "amx") and not isa.at_least("amx", "avx512")


@pytest.mark.skipif(not X86, reason="x86 levels")
def test_auto_dtype_follows_the_hosts_matmul_units():
    """`--dtype auto` is bfloat16 where AMX-BF16 or AVX512-BF16 multiply bfloat16 (an Intel
    Xeon with AMX, an AMD EPYC Zen 4 / 5), float32 on AVX-512 without them (an Intel host whose
    hypervisor hides them), on AVX2 and elsewhere; the ready log names the extensions."""
    avx512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
    amx = avx512 | {"amx_tile", "amx_bf16", "amx_int8", "avx512_bf16"}
    assert isa.bf16_matmul(amx) and isa.bf16_matmul(avx512 | {"avx512_bf16"})
    assert not isa.bf16_matmul(avx512)
    assert not isa.bf16_matmul({"avx2", "fma", "avx512_bf16"})      # below avx512: not used
    assert isa.isa_label(amx) == "amx (avx512, vnni, bf16)"
    assert isa.isa_label(avx512) == "avx512 (vnni)"
    assert isa.isa_label({"avx2", "fma"}) == "avx2"


def test_auto_dtype_on_this_host(capped):
    """What `--dtype auto` resolves to here: bfloat16 with bfloat16 units, and for quantized
    weights on any AVX-512 or AVX2 host (the block kernels multiply in float32 or int8 either
    way); a cap to avx2 makes dense weights float32, and the generic level both."""
    from engine.device import resolve_device, resolve_dtype
    cpu = resolve_device("cpu")
    units = isa.bf16_matmul()
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if units else torch.float32)
    quantized = units or isa.at_least("avx2")
    assert resolve_dtype("auto", cpu, quantized=True) == (torch.bfloat16 if quantized
                                                          else torch.float32)
    assert resolve_dtype("float32", cpu, quantized=True) == torch.float32
    if X86 and isa.host_isa() != "generic":
        capped("avx2")
        assert resolve_dtype("auto", cpu) == torch.float32
        assert resolve_dtype("auto", cpu, quantized=True) == torch.bfloat16
        capped("generic")
        assert resolve_dtype("auto", cpu, quantized=True) == torch.float32


def test_switch_caps_the_level_and_the_build_flags(capped):
    capped("generic")
    assert isa.cpu_isa() == "generic"
    assert isa.is_capped() == (isa.host_isa() != "generic")
    if X86 and isa.host_isa() != "generic":
        capped("avx2")
        assert isa.cpu_isa() == "avx2"
        assert isa.march_flags("avx2") == (["-march=native"] if isa.host_isa() == "avx2"
                                           else ["-march=x86-64-v3"])


def test_switch_refuses_unknown_or_missing_levels(capped):
    capped("avx3")
    with pytest.raises(ValueError, match="CONTINUUM_CPU_ISA='avx3': must be one of"):
        isa.cpu_isa()
    if not isa.at_least("avx512", isa.host_isa()):
        capped("avx512")
        with pytest.raises(ValueError, match="this CPU supports only"):
            isa.cpu_isa()
    if isa.host_isa() != "amx":
        capped("amx")
        with pytest.raises(ValueError, match="this CPU supports only"):
            isa.cpu_isa()


@pytest.mark.skipif(isa.host_isa() != "amx", reason="needs an AMX host (amx_tile, amx_bf16)")
def test_avx512_cap_on_an_amx_host_keeps_its_vector_extensions(capped):
    """`CONTINUUM_CPU_ISA=avx512` on an AMX host: the host's own -march without the AMX
    extensions (its AVX512-BF16 and VNNI loops stay), no tiles, bfloat16 by default."""
    capped("avx512")
    assert isa.cpu_isa() == "avx512" and isa.is_capped()
    assert isa.march_flags("avx512") == ["-march=native", "-mno-amx-tile", "-mno-amx-bf16",
                                         "-mno-amx-int8"]
    assert isa.isa_label() == "avx512 (vnni, bf16)" and isa.bf16_matmul()


@pytest.fixture
def hidden(monkeypatch):
    """Set CONTINUUM_CPU_HIDE for one test, with no CONTINUUM_CPU_ISA cap (the AVX2 pass sets
    one; the flags and the level are cached per process)."""
    def hide(names: str) -> None:
        monkeypatch.delenv(isa.ENV, raising=False)
        monkeypatch.setenv(isa.HIDE_ENV, names)
        isa.hidden_flags.cache_clear()
        isa.cpu_isa.cache_clear()
    yield hide
    monkeypatch.delenv(isa.HIDE_ENV, raising=False)
    isa.hidden_flags.cache_clear()
    isa.cpu_isa.cache_clear()


@pytest.mark.skipif(not X86 or not {"avx512_bf16", "avx512_vnni"} <= isa.cpu_flags(),
                    reason="needs AVX512-BF16 and VNNI to hide (an EPYC Zen 4 / 5, an AMX Xeon)")
def test_hiding_bf16_runs_the_host_as_an_ice_lake(hidden):
    """CONTINUUM_CPU_HIDE=avx512_bf16: the engine sees AVX-512 with VNNI and no bfloat16 units
    (the ready log, `--dtype auto`'s rule) and its kernels build without AVX512-BF16 (or AMX)."""
    hidden("avx512_bf16")
    assert "avx512_bf16" not in isa.cpu_flags() and not isa.bf16_matmul()
    assert isa.cpu_isa() == "avx512" and isa.isa_label() == "avx512 (vnni)"
    flags = isa.march_flags(isa.cpu_isa())
    assert flags[0] == "-march=native" and "-mno-avx512bf16" in flags
    assert ("-mno-amx-tile" in flags) == ("amx_tile" in isa._proc_flags())


def test_hiding_an_unknown_extension_is_refused(hidden):
    hidden("avx512_fp16")
    with pytest.raises(ValueError, match="CONTINUUM_CPU_HIDE=avx512_fp16: can hide only "
                                         "avx512_bf16, avx512_vnni"):
        isa.cpu_flags()


class _FakeKernels:
    """Stands in for a loaded library in the path decision only (no call is made on it)."""


def test_linear_path_per_dtype(capped):
    assert linear_path("cuda", torch.bfloat16, None) == "torch"
    if torch.backends.mkldnn.is_available():
        assert linear_path("cpu", torch.float32, None) == "onednn"
    if isa.host_isa() != "generic":
        capped("avx2")                 # as on an AVX2-only host: no oneDNN bfloat16
        assert linear_path("cpu", torch.bfloat16, _FakeKernels()) == "kernel"
        assert linear_path("cpu", torch.bfloat16, None) == "torch"      # no compiler: slow path
        with pytest.raises(ValueError, match="use --dtype bfloat16"):
            linear_path("cpu", torch.float16, None)


@pytest.mark.parametrize("path", ["onednn", "kernel", "torch"])
def test_linear_layer_on_each_path(path):
    """Every path computes the same layer: y = x W^T + b, in the model dtype or float32."""
    from engine import kernels

    lib = kernels.load()
    if path == "kernel" and lib is None:
        pytest.skip("no C compiler: no kernel path")
    if path == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    torch.manual_seed(0)
    w, b, x = torch.randn(40, 24), torch.randn(40), torch.randn(5, 24)
    dtype = torch.bfloat16 if path == "kernel" else torch.float32
    layer = Linear(w.to(dtype), b.to(dtype), path, lib)
    ref = x.to(dtype).double() @ w.to(dtype).double().T + b.to(dtype).double()
    y = layer(x.to(dtype), torch.float32)
    assert y.dtype == torch.float32 and (y.double() - ref).abs().max().item() < 1e-4
    assert layer(x.to(dtype)).dtype == dtype
    with pytest.raises(ValueError, match="linear path"):
        Linear(w, b, "kernel", None)


def _serve(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "api", "serve", "--port", "1", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_serve_refuses_a_dtype_or_isa_it_cannot_run_with_one_line():
    """A dtype this CPU cannot run, or a bad CONTINUUM_CPU_ISA, fails at start: exit 2 and one
    line saying what to use instead, never a kernel's stack trace."""
    import os

    env = {k: v for k, v in os.environ.items() if k != isa.ENV}
    if not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        r = _serve(["--dtype", "float16"], env)
        assert r.returncode == 2
        assert r.stderr.strip().splitlines() == [
            "continuum: error: --dtype float16: this CPU has no float16 matmul (oneDNN needs "
            "AVX512-FP16 or AVX-NE-CONVERT); use --dtype bfloat16 (same memory) or "
            "--dtype float32"]
    r = _serve([], {**env, isa.ENV: "sse9"})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "continuum: error: CONTINUUM_CPU_ISA='sse9': must be one of generic, avx2, avx512, amx"]
