"""CPU kernels in C (`cpu_kernels.c`, `elementwise.c`, `gemm.c`, `quant*.c`, ...), compiled on
first use and called via ctypes.

Owns: building the shared library with the system C compiler (`cc -O3 -march=... -fopenmp`,
one object per unit on every core, then linked: ~12 s on two cores, ~24 s on one; `-march`
from `isa.cpu_isa()`: the host's own, or `x86-64-v3` under
`CONTINUUM_CPU_ISA=avx2`) into `$CONTINUUM_CACHE/kernels/` under a key of the sources, the flags
and this CPU's feature flags, so an edit or another machine rebuilds; loading it after torch so
that its OpenMP runtime is torch's; and the typed Python entry points: `cache_write` and
`paged_decode` (attention), `add_rms_norm`, `silu_and_mul` and `rotary` (fused elementwise ops,
vLLM's), `pack_linear` and `linear` (bfloat16-weight GEMM for hosts without oneDNN bfloat16),
`quant_linear` (optionally with int8 activations, `q8_available`; on AMX tiles from
`AMX_MIN_ROWS` rows of bfloat16 x where the host has them, `quant_amx.c`) and `quant_embed` (GGUF
blocks and int8 read in place; `engine.quant`), `lora_sgmv` (a step's multi-LoRA deltas of one
projection, `engine.lora`), and `layer_stack_forward` (every decoder layer of a quantized model
in one call; `engine.kernels.stack`).

`load()` returns None — and the engine keeps its pure-torch attention — when there is no
compiler, the build fails (logged once), `CONTINUUM_CPU_KERNELS=0` is set, or the dtype is
neither float32 nor bfloat16. Only `engine.device` decides whether a device uses these.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

from engine.halt_poll import find_compiler  # noqa: F401 -- one definition, without torch

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = [HERE / name for name in (
    "cpu_kernels.c", "gemm.c", "quant.c", "quant_panel.c", "quant_q8.c", "quant_q8_wide.c",
    "quant_amx.c", "attention_amx.c", "lora.c", "lora_amx.c", "layer_stack.c", "kv_cache.c",
    "sample.c", "elementwise.c")]
HEADERS = [HERE / "common.h", HERE / "vec.h", HERE / "quant_blocks.h", HERE / "amx.h",
           HERE / "quant_q8_wide_avx2.h"]
# Compile units, longest first: (source, its extra flags). cpu_kernels.c's attention instances
# are most of the compile (~17 of ~24 s on one core), so it is built as two halves.
UNITS = [(HERE / "cpu_kernels.c", ["-DCPU_KERNELS_PART=0"]),
         (HERE / "cpu_kernels.c", ["-DCPU_KERNELS_PART=1"]),
         *((path, []) for path in SOURCES if path.name != "cpu_kernels.c")]
BASE_CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=gnu11"]


def cflags(isa: str | None = None) -> list[str]:
    """Compiler flags for a build at `isa` (default: `isa.cpu_isa()`, the engine's level)."""
    from engine.kernels.isa import cpu_isa, march_flags
    return BASE_CFLAGS + march_flags(isa or cpu_isa())

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# C entry points (each as <name>_f32 and <name>_bf16): argument types and return type.
_SIGNATURES = {
    "cache_write": ([_P, _P, _P, _P, _P, _I, _I, _I, _I64, _I64, _I64], None),
    "paged_decode": ([_P, _I64, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I64, _F, _I], _I),
    "cache_write8": ([_P, _P, _P, _P, _P, _I, _I, _I, _I64, _I64, _I64, _I, _F, _F, _I], _I),
    "paged_decode8": ([_P, _I64, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I64, _F, _F, _I,
                       _I], _I),
    "add_rms_norm": ([_P, _P, _P, _P, _I, _I, _F, _I], None),
    "silu_and_mul": ([_P, _P, _I, _I, _I], None),
    "rotary": ([_P, _I64, _P, _P, _P, _I, _I, _I, _I], None),
    "lora_sgmv": ([_P, _I64, _P, _I64, _I, _P, _P, _I, _P, _P, _I, _I, _I, _I, _P, _I],
                  None),
}
# dtype-independent entry points.
_PLAIN = {
    "gemm_pack_bf16": ([_P, _I64, _I64, _P, _I], None),
    "gemm_bf16w": ([_P, _I64, _I, _P, _P, _P, _I64, _I, _I64, _I64, _I64, _I], _I),
    "kernels_isa": ([], ctypes.c_char_p),
    "argmax_rows_f32": ([_P, _I64, _I64, _I64, _P, _I], None),
    "quant_linear": ([_I, _P, _I64, _P, _P, _P, _I64, _I, _P, _I64, _I, _I64, _I64, _I64, _I], _I),
    "quant_linear_q8": ([_I, _P, _I64, _P, _P, _P, _I64, _I, _P, _I64, _I, _I64, _I64, _I64,
                         _I, _P], _I),
    "quant_linear_packed": ([_I, _P, _I64, _P, _P, _P, _I64, _I, _P, _I64, _I, _I64, _I64,
                             _I64, _I, _P], _I),
    "quant_panel_packed_bytes": ([_I, _I64, _I64], _I64),
    "quant_panel_pack": ([_I, _P, _I64, _I64, _I64, _P], _I),
    "quant_q8_packed_bytes": ([_I, _I64, _I64], _I64),
    "quant_q8_pack": ([_I, _P, _I64, _P, _I64, _I64, _P], _I),
    "quant_q8_available": ([], _I),
    "quant_amx_config": ([_I], _I),
    "quant_amx_min_rows": ([], _I),
    "attention_amx_rows": ([], _I64),
    "attention_vector_pairs": ([_I], None),
    "quant_pair_panel_rows": ([_I64], None),
    "paged_decode_parts": ([_I, _I, _P, _I], _I),
    "quant_embed": ([_I, _P, _I64, _P, _P, _I64, _I64, _I64, _P, _I], _I),
    "layer_stack_forward": ([_P, _P, _P, _P, _I, _P, _P, _P, _I, _P, _P, _P, _P, _P, _P, _P,
                             _P, _I], _I),
}
NR = 16    # output columns per packed weight panel (gemm.c)
# The most rows of bfloat16 x whose quantized products take vdpbf16ps panels where that
# instruction runs at half float32 FMAs' rate (Intel without AMX; quant.c's measurements)
SLOW_PAIR_PANEL_ROWS = 15
# The fewest rows of bfloat16 x the quantized linears take on AMX tiles (quant_amx.c), below
# them the AVX-512 nests: measured by benchmarks/amx_bench.py (docs/cpu.md).
AMX_MIN_ROWS = 5
# A compile or link step that takes longer (s) fails the build (the engine then runs without
# these kernels, logged). cpu_kernels.c's halves take ~40 s each on one free core of a 2-core
# AMD EPYC; a loaded host (a test run, a benchmark's client) may take several times that.
COMPILE_TIMEOUT_S = 600


def build(compiler: str, flags: list[str] | None = None, out_dir: Path | None = None) -> Path:
    """Compile UNITS with `flags` (default `cflags()`) into `out_dir` (default
    `$CONTINUUM_CACHE/kernels`) unless a build for the same sources, flags and CPU is there;
    returns the library's path. Processes building the same library at once (an API server
    and its engine core, tensor-parallel workers, servers started together) take turns on a
    lock file beside it: one compiles, the others wait and load its result. Compiling side by
    side instead, a server started while another process built the same library on two cores
    failed its build (each step then had a 120 s limit) and served from the pure-torch path at
    a quarter of the speed.

    Raises: subprocess.CalledProcessError (compile error, with the compiler's stderr),
    subprocess.TimeoutExpired, OSError."""
    from engine.loader import cache_root

    flags = cflags() if flags is None else flags
    src = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    from engine.kernels.isa import cpu_flags
    host = " ".join(sorted(cpu_flags())).encode()
    units = repr([(path.name, extra) for path, extra in UNITS]).encode()
    key = hashlib.sha256(src + units + " ".join(flags).encode() + host).hexdigest()
    target = (out_dir or cache_root() / "kernels") / f"cpu_kernels-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)     # released on close, or when the process dies
        if not target.exists():              # else another process built it meanwhile
            _compile(compiler, flags, target)
    return target


def _compile(compiler: str, flags: list[str], target: Path) -> None:
    """Compile and link the library into `target` (atomically). Raises as `build`."""
    logger.info("compiling the CPU kernels for this host into %s (once per host and kernel "
                "source)", target.parent)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        objects = _compile_units(compiler, flags, Path(tmp))
        libs = ["-lmvec", "-lm"] if platform.machine() == "x86_64" else ["-lm"]
        _run_compiler([compiler, *flags, *map(str, objects), "-o", str(out), *libs])
        os.replace(out, target)            # atomic: a reader sees all or nothing
    logger.info("compiled %s in %.1f s", target.name, time.perf_counter() - t0)


def _compile_units(compiler: str, flags: list[str], tmp: Path) -> list[Path]:
    """Compile every UNITS entry to an object in `tmp`, as many at once as this process has
    CPUs; returns the objects' paths. Raises as `build`."""
    from concurrent.futures import ThreadPoolExecutor

    def compile_one(i: int) -> Path:
        source, extra = UNITS[i]
        obj = tmp / f"{i:02d}-{source.stem}.o"
        _run_compiler([compiler, *flags, *extra, "-c", str(source), "-o", str(obj)])
        return obj

    from engine.kernels.isa import usable_cpus
    with ThreadPoolExecutor(max_workers=usable_cpus()) as pool:
        return list(pool.map(compile_one, range(len(UNITS))))


def _run_compiler(cmd: list[str], timeout_s: float | None = None) -> None:
    """Run one compiler command in its own process group; on a timeout (default
    COMPILE_TIMEOUT_S) or an interruption the whole group is killed — the driver's `cc1` and
    `as` children too, which `subprocess.run`'s timeout leaves running on a busy host.
    Raises subprocess.CalledProcessError (its stderr attached) or subprocess.TimeoutExpired."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=COMPILE_TIMEOUT_S if timeout_s is None
                                    else timeout_s)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd, out, err)


class CpuKernels:
    """The loaded library. Tensors must be on the CPU, float32 or bfloat16 (see `supports`)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._fn: dict = {}            # (name, dtype) -> typed C function, bound once
        for name, (argtypes, restype) in _SIGNATURES.items():
            for dtype, sfx in _SUFFIX.items():
                fn = getattr(lib, f"{name}_{sfx}")
                fn.argtypes, fn.restype = argtypes, restype
                self._fn[name, dtype] = fn
        for name, (argtypes, restype) in _PLAIN.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
            self._fn[name] = fn
        self.isa = self._fn["kernels_isa"]().decode()     # "avx512", "avx2" or "generic"
        self.amx_rows = self._enable_amx()
        from engine.kernels.isa import slow_bf16_dot
        # Intel without AMX (vdpbf16ps at half the FMAs' rate): prefill attention on the
        # float32 loops, the quantized linears' float32 panels from 16 rows of bfloat16 x;
        # process-wide switches of this library's copy
        self.set_vector_pairs(not slow_bf16_dot())

    def set_vector_pairs(self, on: bool) -> None:
        """Whether bfloat16 x takes AVX512-BF16's vdpbf16ps where it is the faster choice
        everywhere (on: prefill attention where the tiles are off, the quantized linears'
        panels at any rows) or only where it still beats float32 FMAs at their half rate on an
        Intel core (off: attention on the float32 loops, the linears' pairs up to
        SLOW_PAIR_PANEL_ROWS rows, float32 panels above; quant.c), for every user of this
        library copy (`vector_pairs`). Set at load, before any call."""
        self.vector_pairs = bool(on)
        self._fn["attention_vector_pairs"](int(on))
        self._fn["quant_pair_panel_rows"](2 ** 62 if on else SLOW_PAIR_PANEL_ROWS)

    def _enable_amx(self) -> int:
        """Turn the quantized linears' AMX tile nest on where the engine's level is `amx` and
        this build has it: asks Linux for the tile state once per process (refused: one
        warning line, and the AVX-512 nests run). Returns the fewest rows of x it takes (0:
        off)."""
        from engine.kernels.isa import cpu_isa
        if cpu_isa() != "amx":
            return 0
        rc = self._fn["quant_amx_config"](AMX_MIN_ROWS)
        if rc == -1:                                # a build for a lower level
            return 0
        if rc:
            logger.warning("AMX tiles refused by Linux (arch_prctl ARCH_REQ_XCOMP_PERM: %s): "
                           "the quantized linears run on AVX-512", os.strerror(rc))
            return 0
        return AMX_MIN_ROWS

    @property
    def quant_label(self) -> str:
        """The quantized linears' kernels as the ready log names them: `avx512`, or `amx tiles
        from 8 rows, avx512` where the tile nest is on."""
        return f"amx tiles from {self.amx_rows} rows, {self.isa}" if self.amx_rows else self.isa

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        """Whether the kernels exist for `dtype` (float32 and bfloat16)."""
        return dtype in _SUFFIX

    def cache_write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write `k, v [T, num_kv_heads, head_dim]` (rows may be strided, heads contiguous) into
        `k_cache, v_cache [num_kv_heads, num_blocks, block_size, head_dim]` (contiguous) at
        `slot_mapping [T] int64` (slot = block * block_size + offset)."""
        kvh, nb, bs, d = k_cache.shape
        self._fn["cache_write", k.dtype](
            k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            slot_mapping.data_ptr(), k.shape[0], kvh, d, k.stride(0), v.stride(0), nb * bs)

    def cache_write8(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor, kv) -> None:
        """`cache_write` into 8-bit caches `[num_kv_heads, num_blocks, block_size, row bytes]`
        uint8 (`kv`: the cache's `engine.kv_quant.KVQuant`): each row quantized (kv_cache.c)."""
        kvh, nb, bs, _ = k_cache.shape
        rc = self._fn["cache_write8", k.dtype](
            k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            slot_mapping.data_ptr(), k.shape[0], kvh, k.shape[-1], k.stride(0), v.stride(0),
            nb * bs, kv.kind, 1.0 / kv.k_scale, 1.0 / kv.v_scale, torch.get_num_threads())
        if rc:
            raise ValueError(f"cache_write8: head_dim {k.shape[-1]} over 256")

    def paged_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, ctx_lens: torch.Tensor, scale: float,
                     out: torch.Tensor, kv=None) -> None:
        """Paged attention (Kwon et al., SOSP 2023) of one query token per row — a decode, or
        one token of a prefill chunk — over the first `ctx_lens[b]` cached tokens of its
        block table, into `out [B, num_heads, head_dim]`. `kv`: an 8-bit cache's
        `engine.kv_quant.KVQuant` (its rows read and dequantized in registers), or None.
        Too few (sequence, KV head) pairs for the threads (a single long decode): each
        context is cut into parts attended in parallel and merged (`paged_decode_parts`).

        `q [B, num_heads, head_dim]` (rows may be strided), caches as in `cache_write`,
        `block_tables [B, max_blocks] int32`, `ctx_lens [B] int32` (tokens, ≥ 1).
        Raises ValueError for a head_dim over 256 or more than 32 query heads per KV head."""
        b, h, d = q.shape
        kvh, nb, bs, _ = k_cache.shape
        if kv is not None:
            rc = self._fn["paged_decode8", q.dtype](
                q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                block_tables.data_ptr(), block_tables.shape[1], ctx_lens.data_ptr(),
                out.data_ptr(), b, h, kvh, d, bs, nb, scale * kv.k_read_scale,
                kv.v_read_scale, kv.kind, torch.get_num_threads())
        else:
            rc = self._fn["paged_decode", q.dtype](
                q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                block_tables.data_ptr(), block_tables.shape[1], ctx_lens.data_ptr(),
                out.data_ptr(), b, h, kvh, d, bs, nb, scale, torch.get_num_threads())
        if rc:
            raise ValueError(f"paged_decode: head_dim {d} or group {h // kvh} too large")

    def paged_decode_parts(self, ctx_lens: torch.Tensor, num_kv_heads: int) -> int:
        """How many parts `paged_decode` cuts each (sequence, KV head)'s context into for
        `ctx_lens [B] int32` on this many threads: 1 (each pair whole) unless the pairs are
        fewer than two a thread; then enough for four (pair, part) items a thread, as many as
        give each part 256 tokens of the longest context (split-KV decode, cpu_kernels.c)."""
        return self._fn["paged_decode_parts"](ctx_lens.shape[0], num_kv_heads,
                                              ctx_lens.data_ptr(), torch.get_num_threads())

    def pack_linear(self, weight: torch.Tensor) -> torch.Tensor:
        """Pack `weight [N, K]` bfloat16 (out, in) for `linear`: a new bfloat16 tensor
        `[ceil(N/16), K, 16]` of 16-column panels (gemm.c). Raises ValueError for another dtype."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError(f"pack_linear takes a 2-d bfloat16 weight, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        w = weight.contiguous()
        n, k = w.shape
        packed = torch.empty((-(-n // NR), k, NR), dtype=torch.bfloat16)
        self._fn["gemm_pack_bf16"](w.data_ptr(), n, k, packed.data_ptr(), torch.get_num_threads())
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16
               ) -> torch.Tensor:
        """`x [M, K]` (float32 or bfloat16; rows may be strided, columns contiguous) times the
        packed weight's transpose, plus `bias [N]` bfloat16: a new `[M, n]` of `out_dtype`
        (bfloat16, or float32 for logits). float32 accumulation. Raises MemoryError."""
        m, k = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty((m, n), dtype=out_dtype)
        rc = self._fn["gemm_bf16w"](
            x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16), packed.data_ptr(),
            None if bias is None else bias.data_ptr(), out.data_ptr(), n,
            int(out_dtype == torch.float32), m, n, k, torch.get_num_threads())
        if rc:
            raise MemoryError(f"linear: cannot allocate {m} x {k} float32 for the input")
        return out

    def quant_linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None, int8_x: bool = False,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """`x [M, K]` (float32 or bfloat16; rows may be strided, columns contiguous) times the
        transpose of `weight` (an `engine.quant.QuantWeight` `[N, K]` read in its block format),
        plus `bias [N]` float32: a new `[M, N]` of `out_dtype` (default x's: float32 or
        bfloat16). float32 arithmetic (quant.c); with `int8_x`, x is quantized to int8 per block
        of 32 where quant_q8.c has a kernel (`q8_available`; Q4_0 / Q4_1 / Q8_0 / I8: up to 8
        rows, and any number where `q8_pack` gave the weight its copy). Without it, a weight
        `panel_pack` gave its copy is read from that copy by the bfloat16 panels (same result).
        `out`: a contiguous `[M, N]` of `out_dtype` to write into and return (else a new one).
        Raises MemoryError, ValueError (no kernel for the weight's type; an `out` of another
        shape or dtype)."""
        m, k = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        x_bf16 = x.dtype == torch.bfloat16
        out_dtype = out_dtype or x.dtype
        n = weight.shape[0]
        if out is None:
            out = torch.empty((m, n), dtype=out_dtype)
        elif out.shape != (m, n) or out.dtype != out_dtype or not out.is_contiguous():
            raise ValueError(f"quant_linear: out must be a contiguous [{m}, {n}] {out_dtype}")
        qtype, w_ptr, row_bytes, scale_ptr = weight.kernel_args
        args = (qtype, w_ptr, row_bytes, scale_ptr, None if bias is None else bias.data_ptr(),
                x.data_ptr(), x.stride(0), x_bf16, out.data_ptr(), n,
                out_dtype == torch.float32, m, n, k, torch.get_num_threads())
        if int8_x:
            packed = weight.q8_packed
            rc = self._fn["quant_linear_q8"](*args, None if packed is None else packed.data_ptr())
        else:
            packed = weight.panel_packed
            rc = self._fn["quant_linear_packed"](*args,
                                                 None if packed is None else packed.data_ptr())
        if rc == -2:
            raise ValueError(f"quant_linear: no kernel for {weight.type_name}")
        if rc:
            raise MemoryError(f"quant_linear: cannot allocate {m} x {k} float32 for the input")
        return out

    def q8_pack(self, weight) -> None:
        """Give `weight` (an `engine.quant.QuantWeight`) the repacked copy the int8-activation
        nest reads at every row count (quant_q8_wide.c: 16 W rows to a vector's int32 lanes), as
        `weight.q8_packed` (uint8; the blocks' own bytes for Q4_0, Q4_1 and Q8_0, 1.13x
        I8, kept beside the blocks); left None where this build has no such nest for the type
        (no AVX-512 VNNI, K-quants)."""
        _, w_ptr, row_bytes, scale_ptr = weight.kernel_args
        weight.q8_packed = self._repack(weight, "quant_q8", w_ptr, row_bytes, scale_ptr)

    def panel_pack(self, weight) -> None:
        """Give `weight` (an `engine.quant.QuantWeight`) the repacked copy the bfloat16 panels
        read from 5 rows of a bfloat16 x on (quant_panel.c: 16 W rows interleaved by k pairs,
        no transposition at run time; quant.c's PACKED_PANEL_ROWS: on an AVX512-BF16 EPYC
        16-row decode steps ~10 % faster, 5-8 rows' products 1.5-1.7x), as
        `weight.panel_packed` (uint8; the blocks' own bytes again: 1.0x Q4_0 / Q4_1 / Q8_0,
        1.06x I8, kept beside them); left None where this build has no such panels for the type
        (no AVX512-BF16, K-quants) and where AMX tiles take bfloat16 x (from fewer rows)."""
        if not self.amx_rows:               # tiles take bfloat16 x before the panels would
            _, w_ptr, row_bytes, _ = weight.kernel_args
            weight.panel_packed = self._repack(weight, "quant_panel", w_ptr, row_bytes)

    def _repack(self, weight, prefix: str, *args) -> torch.Tensor | None:
        """`{prefix}_pack(type, *args, n, k, out)` into a new uint8 tensor of
        `{prefix}_packed_bytes(type, n, k)` bytes; None where that is 0 (no such layout here)."""
        n, k = weight.shape
        size = self._fn[f"{prefix}_packed_bytes"](weight.qtype, n, k)
        if size <= 0:
            return None
        packed = torch.empty(size, dtype=torch.uint8)
        rc = self._fn[f"{prefix}_pack"](weight.qtype, *args, n, k, packed.data_ptr())
        return packed if rc == 0 else None

    @property
    def q8_available(self) -> bool:
        """Whether this build has int8-activation kernels: AVX-512 VNNI (quant_q8.c up to 8
        rows and the wide nest over `q8_pack`'s copy), or AVX2 (the wide nest only,
        quant_q8_wide_avx2.h)."""
        return bool(self._fn["quant_q8_available"]())

    @property
    def q8_narrow(self) -> bool:
        """Whether quant_q8.c's nest (int8 x over the blocks themselves, up to 8 rows) is in
        this build (AVX-512 VNNI); elsewhere a weight without `q8_pack`'s copy keeps float32
        products."""
        return self._fn["quant_q8_available"]() == 1

    @property
    def q8_label(self) -> str:
        """The int8 products' instructions as the ready log names them: `vnni` (vpdpbusd) or
        `avx2` (vpmaddubsw: an AVX2 build, or an AVX-512 one without VNNI)."""
        return "vnni" if self.q8_narrow else "avx2"

    def quant_embed(self, weight, ids: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids [T] int64` of the quantized table `weight` (`engine.quant.QuantWeight`
        `[N, K]`), dequantized: a new `[T, K]` of `out_dtype` (float32 or bfloat16). Raises
        IndexError for an id outside [0, N), ValueError (no kernel for the type)."""
        ids = ids.contiguous()
        n, k = weight.shape
        out = torch.empty((ids.shape[0], k), dtype=out_dtype)
        scale = weight.scale
        rc = self._fn["quant_embed"](
            weight.qtype, weight.data.data_ptr(), weight.data.shape[1],
            None if scale is None else scale.data_ptr(), ids.data_ptr(), ids.shape[0], n, k,
            out.data_ptr(), int(out_dtype == torch.float32))
        if rc == -3:
            raise IndexError(f"quant_embed: a token id is outside [0, {n})")
        if rc:
            raise ValueError(f"quant_embed: no kernel for {weight.type_name}")
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`x [n, hidden]` (contiguous) → new `rms_norm(x) * weight`, float32 math."""
        out = torch.empty_like(x)
        self._fn["add_rms_norm", x.dtype](
            x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
            torch.get_num_threads())
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """In place, both `[n, hidden]` contiguous: `residual += x`, then
        `x = rms_norm(residual) * weight`; returns `x`."""
        self._fn["add_rms_norm", x.dtype](
            x.data_ptr(), residual.data_ptr(), weight.data_ptr(), None, x.shape[0], x.shape[1],
            eps, torch.get_num_threads())
        return x

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits [n, vocab]` float32 (rows contiguous) → int64 `[n]`, the first index of each
        row's maximum (a NaN counts as the largest), exactly `logits.argmax(dim=-1)`.
        Raises ValueError for another dtype or layout."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
            raise ValueError("argmax: float32 [n, vocab] rows with unit stride only")
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._fn["argmax_rows_f32"](logits.data_ptr(), logits.shape[0], logits.shape[1],
                                    logits.stride(0), out.data_ptr(), torch.get_num_threads())
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """`x [n, 2 * inter]` (contiguous, gate then up) → new `silu(gate) * up [n, inter]`."""
        n, two_inter = x.shape
        out = x.new_empty((n, two_inter // 2))
        self._fn["silu_and_mul", x.dtype](
            x.data_ptr(), out.data_ptr(), n, two_inter // 2, torch.get_num_threads())
        return out

    def lora_sgmv(self, x: torch.Tensor, out: torch.Tensor, row_slot: torch.Tensor,
                  present: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                  bands: torch.Tensor) -> None:
        """`out [n, out_cols] += ` each row's LoRA delta, in place (lora.c): `x [n, in]` and
        `out` of one dtype with unit column stride; `row_slot [n] int32` (-1: no adapter),
        `present [slots] int32` (the slot has this projection), `a [slots, R, in]` and
        `bt [slots, R, out_cols]` contiguous, of x's dtype, `bands [n_bands, 4] int32` (rank
        rows r0:r1 feed output columns c0:c1)."""
        self.lora_sgmv_bound(present, a, bt, bands)(x, out, row_slot.data_ptr(),
                                                     torch.get_num_threads())

    def lora_sgmv_bound(self, present: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                        bands: torch.Tensor) -> Callable:
        """`lora_sgmv` with one projection's weights bound once (the tensors must outlive it
        and stay where they are): `f(x, out, row_slot_ptr, num_threads)`, the per-step call of
        the LoRA hot path, which passes only the step's rows."""
        fn = self._fn["lora_sgmv", a.dtype]
        fixed = (present.data_ptr(), present.shape[0], a.data_ptr(), bt.data_ptr(), a.shape[2],
                 bt.shape[2], a.shape[1], bands.shape[0], bands.data_ptr())

        def call(x: torch.Tensor, out: torch.Tensor, row_slot_ptr: int, num_threads: int):
            fn(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), x.shape[0],
               row_slot_ptr, *fixed, num_threads)
        return call

    def rotary(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin_signed: torch.Tensor) -> None:
        """Rotate-half RoPE in place on `x [n, heads, head_dim]` (rows may be strided, heads
        contiguous) at `positions [n] int64`; `cos`, `sin_signed [max_pos, head_dim]` with the
        first half of sin negated."""
        n, heads, d = x.shape
        self._fn["rotary", x.dtype](
            x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(),
            sin_signed.data_ptr(), n, heads, d, torch.get_num_threads())


@lru_cache(maxsize=1)
def load() -> CpuKernels | None:
    """Build (if needed) and load the kernels; None where they cannot be used (logged)."""
    if os.environ.get("CONTINUUM_CPU_KERNELS", "1") == "0":
        return None
    compiler = find_compiler()
    if compiler is None:
        logger.warning("no C compiler found: CPU attention uses the pure-torch path")
        return None
    try:
        return CpuKernels(ctypes.CDLL(str(build(compiler))))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("CPU attention kernels unavailable, using the pure-torch path: %s", detail)
        return None
