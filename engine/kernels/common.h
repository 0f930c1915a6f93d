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

/* A scratch buffer of at least `bytes` for the calling thread, kept for its next call in the
 * same `slot` (grown, never shrunk or freed): large per-call buffers would otherwise come and go
 * through glibc's heap, which keeps a few hundred MiB of them resident once its mmap threshold
 * has risen. NULL if out of memory. */
#define SCRATCH_SLOTS 2
static void *scratch(int slot, size_t bytes) {
    static __thread void *buf[SCRATCH_SLOTS];
    static __thread size_t cap[SCRATCH_SLOTS];
    if (cap[slot] < bytes) {
        free(buf[slot]);
        buf[slot] = malloc(bytes > 0 ? bytes : 1);
        cap[slot] = buf[slot] ? bytes : 0;
    }
    return buf[slot];
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

#endif
