/*
 * Helpers shared by the CPU kernel sources (cpu_kernels.c, gemm.c): bfloat16 <-> float32 and
 * the ISA guards. bfloat16 is stored as uint16_t; all arithmetic is float32 and bfloat16
 * results are rounded to nearest even (NaN stays NaN).
 *
 * ISA: the build chooses -march per host (engine/kernels/isa.py): AVX-512 inner loops where
 * __AVX512F__ is defined, AVX2 + FMA ones where __AVX2__ and __FMA__ are, and the generic C
 * loops (auto-vectorized for whatever the target has) everywhere, non-x86 hosts included.
 */
#ifndef CONTINUUM_KERNELS_COMMON_H
#define CONTINUUM_KERNELS_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

#if defined(__x86_64__) && defined(__AVX512F__)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif
#if HAVE_AVX512 || HAVE_AVX2
#include <immintrin.h>
#endif

/* At least `bytes` of heap starting on a cache line (64 bytes), to be freed with free(); NULL
 * if out of memory. The kernels' vectors are 64 bytes: from glibc's malloc (16-byte aligned;
 * a large block at 16 bytes past a page) three of every four straddle two lines, and each such
 * load costs two. Measured (Zen 5, the model's 121 products of 4 rows of bfloat16 x, whose
 * float32 copy the 1-4-row nest reads): 7.1-7.7 ms in the processes where the copy was not
 * 64-byte aligned, 5.2-5.6 where it was (docs/cpu.md: a slow mode with another cause remains
 * in the engine's 4-sequence steps). */
static inline void *alloc_lines(size_t bytes) {
    return aligned_alloc(64, bytes > 0 ? (bytes + 63) / 64 * 64 : 64);
}

/* A scratch buffer of at least `bytes` for the calling thread, kept for its next call in the
 * same `slot` (grown, never shrunk or freed; on a cache line: alloc_lines). The buffers are
 * per source file as well (a `static` function in a header): quant_q8.c's slot 0 is not
 * quant.c's, so quantize_x's buffer survives quant_copy_x's. Large per-call
 * buffers would otherwise come and go through glibc's heap, which keeps a few hundred MiB of
 * them resident once its mmap threshold has risen. NULL if out of memory. */
#define SCRATCH_SLOTS 2
static void *scratch(int slot, size_t bytes) {
    static __thread void *buf[SCRATCH_SLOTS];
    static __thread size_t cap[SCRATCH_SLOTS];
    if (cap[slot] < bytes) {
        free(buf[slot]);
        buf[slot] = alloc_lines(bytes);
        cap[slot] = buf[slot] ? bytes : 0;
    }
    return buf[slot];
}

/* Ask for the cache lines holding bytes [lo, hi) of p ahead of their use (into L1): the paged
 * KV blocks and the panels' next W rows are patterns the hardware prefetcher does not follow.
 * Callers ask a few rows' worth at a time, spread over the loop that uses the data: in one
 * burst the requests stalled on full fill buffers. Never faults, past an allocation too.
 * Always inlined: as a call (plain `static inline` left it one) the decode step took twice
 * as long. */
INLINE void prefetch_range(const void *p, int64_t lo, int64_t hi) {
    for (int64_t off = lo & ~(int64_t)63; off < hi; off += 64)
        __builtin_prefetch((const char *)p + off, 0, 3);
}

static inline float load_f32(float x) { return x; }
static inline float load_bf16(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline float store_f32(float x) { return x; }
static inline uint16_t store_bf16(float f) {       /* branch-free, so loops vectorize */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? quiet_nan : rounded);
}

/* 8-bit KV caches (engine/kv_quant.py): the kinds, a row's bytes, and float16 <-> float32
 * (C's _Float16: F16C instructions where the target has them). */
#define KV_INT8 1              /* int8 values and a float16 scale per row (after the values) */
#define KV_E4M3 2              /* float8 e4m3fn, a per-tensor scale */
#define KV_E5M2 3              /* float8 e5m2, a per-tensor scale */
static inline int64_t kv_row_bytes(int kind, int head_dim) {
    return head_dim + (kind == KV_INT8 ? 2 : 0);
}
static inline float f16_to_f32(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, sizeof h);
    return (float)x;
}
static inline uint16_t f32_to_f16(float f) {
    const _Float16 x = (_Float16)f;
    uint16_t h;
    memcpy(&h, &x, sizeof h);
    return h;
}
static inline float f16_at(const uint8_t *p) {      /* an unaligned float16 */
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return f16_to_f32(h);
}
/* Elements of the 8-bit caches to float32. e5m2 is float16's upper byte; e4m3's bits shifted
 * into float16's give the value / 256 (subnormals included): callers fold the 256 into the
 * tensor's scale (engine/kv_quant.py: E4M3_UNIT). */
static inline float load_i8(uint8_t x) { return (float)(int8_t)x; }
static inline float load_e5m2(uint8_t x) { return f16_to_f32((uint16_t)(x << 8)); }
static inline float load_e4m3(uint8_t x) {
    return f16_to_f32((uint16_t)(((x & 0x7f) << 7) | ((x & 0x80) << 8)));
}
/* float32 to an fp8 format of M mantissa bits and exponent bias B (e4m3fn: 3, 7; e5m2: 2, 15),
 * rounded to nearest even straight from float32's bits (subnormals included), saturated at the
 * largest finite code `maxcode` (448: 0x7e; 57344: 0x7b); NaN stays NaN. */
static inline uint8_t f32_to_fp8(float f, int M, int B, uint32_t maxcode) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t sign = (u >> 24) & 0x80u;
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return (uint8_t)(sign | 0x7fu);
    if ((u >> 23) == 0) return (uint8_t)sign;        /* float32 subnormal: rounds to 0 */
    int e = (int)(u >> 23) - 127 + B;                   /* the fp8 exponent field */
    const uint32_t mant = (u & 0x7fffffu) | 0x800000u;  /* the significand, hidden bit on */
    int shift = 23 - M;
    if (e < 1) {                                        /* an fp8 subnormal: fewer bits */
        shift += 1 - e;
        e = 0;
    }
    if (shift > 24) return (uint8_t)sign;
    const uint32_t r = (mant + (1u << (shift - 1)) - 1 + ((mant >> shift) & 1u)) >> shift;
    uint32_t code = e == 0 ? r : ((uint32_t)e << M) + r - (1u << M);   /* a carry bumps e */
    if (code > maxcode) code = maxcode;
    return (uint8_t)(sign | code);
}
static inline uint8_t f32_to_e4m3(float x) { return f32_to_fp8(x, 3, 7, 0x7e); }
static inline uint8_t f32_to_e5m2(float x) { return f32_to_fp8(x, 2, 15, 0x7b); }

#endif
