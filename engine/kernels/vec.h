/*
 * The small float32 vector vocabulary the CPU kernels are written against, instantiated per ISA:
 * V a vector of VL lanes, vload_f32 / vload_bf16 / vload_i8 / vload_e4m3 / vload_e5m2 (VL
 * elements of float32, bfloat16 or an 8-bit KV cache's bytes, to float32), vfma, vmul, vadd,
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
INLINE V vload_i8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
INLINE V vload_e5m2(const uint8_t *p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
}
INLINE V vload_e4m3(const uint8_t *p) {     /* the value / 256, as load_e4m3 */
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_or_si256(
        _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
        _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
    return _mm512_cvtph_ps(h);
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
INLINE V vload_i8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
INLINE V vload_e5m2(const uint8_t *p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
}
INLINE V vload_e4m3(const uint8_t *p) {     /* the value / 256, as load_e4m3 */
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
    return _mm256_cvtph_ps(h);
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
