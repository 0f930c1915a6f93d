/*
 * The small float32 vector vocabulary the CPU kernels are written against, instantiated per ISA:
 * V a vector of VL lanes, vload_f32 / vload_bf16 (VL elements, to float32), vfma, vmul, vadd,
 * vset1, vzero, vstore and vsum (horizontal add). AVX-512: 16 lanes; AVX2 + FMA: 8; elsewhere
 * HAVE_VEC is 0 and VEC_ISA "generic" (the callers keep plain C loops for that case).
 */
#ifndef CONTINUUM_KERNELS_VEC_H
#define CONTINUUM_KERNELS_VEC_H

#include "common.h"

#if HAVE_AVX512
typedef __m512 V;
#define VL 16
INLINE V vload_f32(const float *p) { return _mm512_loadu_ps(p); }
INLINE V vload_bf16(const uint16_t *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
INLINE V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
INLINE V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
INLINE V vadd(V a, V b) { return _mm512_add_ps(a, b); }
INLINE V vset1(float x) { return _mm512_set1_ps(x); }
INLINE V vzero(void) { return _mm512_setzero_ps(); }
INLINE void vstore(float *p, V a) { _mm512_storeu_ps(p, a); }
INLINE float vsum(V a) { return _mm512_reduce_add_ps(a); }
#define HAVE_VEC 1
#define VEC_ISA "avx512"
#elif HAVE_AVX2
typedef __m256 V;
#define VL 8
INLINE V vload_f32(const float *p) { return _mm256_loadu_ps(p); }
INLINE V vload_bf16(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
INLINE V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
INLINE V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
INLINE V vadd(V a, V b) { return _mm256_add_ps(a, b); }
INLINE V vset1(float x) { return _mm256_set1_ps(x); }
INLINE V vzero(void) { return _mm256_setzero_ps(); }
INLINE void vstore(float *p, V a) { _mm256_storeu_ps(p, a); }
INLINE float vsum(V a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define HAVE_VEC 1
#define VEC_ISA "avx2"
#else
#define HAVE_VEC 0
#define VEC_ISA "generic"
#endif

#endif
