"""Compile every Triton kernel of engine/accel for a CUDA target (sm_90, an H100 / H200)
ahead of time, with no GPU: Triton's compiler and the `ptxas` its wheel ships turn each kernel
into a cubin here. The interpreter (`TRITON_INTERPRET=1`), which the other kernel tests use,
runs the kernels as numpy and lets through what only the compiler rejects (types, shapes of
`tl.dot`, constexpr use), so this catches that before a GPU session spends device time on it.

Run as a script (tests/test_triton_compile.py does, without `TRITON_INTERPRET`, which would
make `@triton.jit` build interpreted functions): prints one line per kernel variant, `OK` or
`FAIL` with the compiler's message, and exits 1 if any failed. In: nothing. Out: stdout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FLOATS = {"scale", "eps", "k_scale", "v_scale", "k_inv_scale", "v_inv_scale"}
TARGET = ("cuda", 90, 32)                 # backend, compute capability, warp size


def signature(fn, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Triton's signature of `fn` by argument name: `pointers` gives each `*_ptr` argument's
    type ("*bf16", "*i32", ...), constexprs are "constexpr", the float scalars (`FLOATS`)
    "fp32", every other scalar "i32". Raises KeyError for a pointer with no type given."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointers[name]
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    return sig


def variants():
    """(label, kernel, pointer types, constexprs) for every kernel: the attention kernels for
    each cache kind (0 the model dtype, 1 int8, 2 fp8) in bfloat16 (the model dtype's also in
    float32), with and without a window; the fused ops in bfloat16 and float16."""
    from engine.accel import triton_attention as ta
    from engine.accel import triton_fused as tf

    for kind in (0, 1, 2):
        for dt in ("bf16", "fp32") if kind == 0 else ("bf16",):
            cache = f"*{dt}" if kind == 0 else "*u8"
            io = dict(q_ptr=f"*{dt}", k_cache_ptr=cache, v_cache_ptr=cache,
                      block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_ptr="*i32")
            yield (f"cache write kind {kind} {dt}", ta._cache_write_kernel,
                   dict(k_ptr=f"*{dt}", v_ptr=f"*{dt}", k_cache_ptr=cache, v_cache_ptr=cache,
                        slot_ptr="*i64"), dict(HEAD_D=64, KV_KIND=kind))
            for window in (True, False):
                yield (f"paged attention kind {kind} {dt} window {window}",
                       ta._paged_attention_kernel, dict(io, out_ptr=f"*{dt}"),
                       dict(GROUP=4, BLOCK_Q=16, BLOCK_M=64, TILE_N=32, HEAD_D=64,
                            USE_WINDOW=window, KV_KIND=kind))
                yield (f"split-KV decode kind {kind} {dt} window {window}",
                       ta._split_decode_kernel,
                       dict(io, part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32"),
                       dict(GROUP=4, BLOCK_M=16, TILE_N=32, HEAD_D=64, NUM_SPLITS=16,
                            USE_WINDOW=window, KV_KIND=kind))
    parts = dict(part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32",
                 query_start_ptr="*i32")
    for dt in ("bf16", "fp16"):
        yield (f"split-KV reduce {dt}", ta._split_reduce_kernel, dict(parts, out_ptr=f"*{dt}"),
               dict(HEAD_D=64, NUM_SPLITS=16))
        rows = dict(x_ptr=f"*{dt}", res_ptr=f"*{dt}", w_ptr=f"*{dt}", out_ptr=f"*{dt}")
        for has_res in (True, False):
            yield (f"add_rms_norm {dt} residual {has_res}", tf._add_rms_norm_kernel, rows,
                   dict(HAS_RES=has_res, BLOCK=2048))
        yield (f"silu_and_mul {dt}", tf._silu_and_mul_kernel,
               dict(x_ptr=f"*{dt}", out_ptr=f"*{dt}"), dict(BLOCK=1024))
        yield (f"rotary {dt}", tf._rotary_kernel,
               dict(x_ptr=f"*{dt}", pos_ptr="*i64", cos_ptr=f"*{dt}", sin_ptr=f"*{dt}"),
               dict(BLOCK_H=16, HEAD_D=64))


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("FAIL run without TRITON_INTERPRET=1 (it makes @triton.jit interpreted)")
        return 1
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target, failed = GPUTarget(*TARGET), 0
    for label, fn, pointers, constexprs in variants():
        try:
            src = ASTSource(fn=fn, signature=signature(fn, pointers, constexprs),
                            constexprs=constexprs)
            cubin = triton.compile(src, target=target).asm["cubin"]
            print(f"OK {label}: {len(cubin)} bytes of sm_{TARGET[1]} cubin")
        except Exception as e:            # noqa: BLE001 - every failure is reported
            failed += 1
            print(f"FAIL {label}: {type(e).__name__}: {str(e)[:2000]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
