/*
 * Quantized weight blocks, as the CPU kernels read them (quant.c, quant_panel.c): GGUF's Q8_0,
 * Q4_0, Q4_1, Q4_K and Q6_K (llama.cpp's layouts, ggml-common.h, and its dequantize_row_*
 * formulas, ggml-quants.c) and Continuum's int8 weight-only "I8" (32 int8 a block, one float32
 * scale per output row). A block is dequantized to float32 with ggml's formulas (d * q,
 * d * q + m, d * sc * q ...; GCC may fuse a product and its sum into one FMA, as in ggml's own
 * build, so a weight can differ from gguf-py's twice-rounded value by one rounding), by
 *   dq_T   (plain C the compiler vectorizes) into a float buffer, any type;
 *   dqv_T  into QK / VL vectors (the 32-value types straight from registers, per ISA);
 *   dqb_T  straight into 32 bfloat16, rounded to nearest even (AVX512-BF16 hosts).
 */
#ifndef CONTINUUM_KERNELS_QUANT_BLOCKS_H
#define CONTINUUM_KERNELS_QUANT_BLOCKS_H

#include "vec.h"

#if HAVE_AVX512
/* The block loops vectorize at the vector width of V (16 lanes): at GCC's default 256-bit
 * preference a block went to the stack as two 8-lane stores and came back as one 16-lane load,
 * which store forwarding cannot serve (Q8_0 ran at a seventh of Q4_1's rate). */
#pragma GCC target("prefer-vector-width=512")
#endif

#define QK 32
#define QK_K 256
/* GGML type ids (ggml.h's enum ggml_type); I8 is ggml's id for plain int8. */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14, T_I8 = 24 };
/* Every type with kernels, once: X(name, GGML id, values a block, bytes a block). */
#define QUANT_TYPES(X)                                                                        \
    X(q8_0, T_Q8_0, QK, 34) X(q4_0, T_Q4_0, QK, 18) X(q4_1, T_Q4_1, QK, 20)                   \
    X(i8, T_I8, QK, QK) X(q4_k, T_Q4_K, QK_K, 144) X(q6_k, T_Q6_K, QK_K, 210)
#define BLOCK_BYTES_CASE(T, ID, QKT, BYTES) case ID: return BYTES;
/* Whether `type`'s values are 4-bit codes, two to a byte (Q4_0, Q4_1). */
INLINE int is_nibble(int type) { return type == T_Q4_0 || type == T_Q4_1; }
/* Bytes a block of GGML type `type` holds; 0 for a type without kernels. */
INLINE int block_bytes(int type) {
    switch (type) { QUANT_TYPES(BLOCK_BYTES_CASE) default: return 0; }
}

#if !HAVE_VEC   /* the same loops in GCC's portable vectors */
typedef float V __attribute__((vector_size(16)));
#define VL 4
INLINE V vload_f32(const float *p) { V v; memcpy(&v, p, sizeof v); return v; }
INLINE V vfma(V a, V b, V c) { return a * b + c; }
INLINE V vadd(V a, V b) { return a + b; }
INLINE V vmul(V a, V b) { return a * b; }
INLINE V vset1(float x) { return (V){x, x, x, x}; }
INLINE void vstore(float *p, V a) { memcpy(p, &a, sizeof a); }
INLINE V vzero(void) { return (V){0}; }
INLINE float vsum(V a) { float s = 0.f; for (int i = 0; i < VL; i++) s += a[i]; return s; }
#endif

/* IEEE half to float32, exactly (the table's filling; F16C where the build has it). */
INLINE float f16_convert(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t u;
    if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);                /* inf / NaN */
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);           /* normal */
    else if (!man) u = sign;                                              /* zero */
    else {                                                                 /* subnormal */
        float f = (float)man * (1.f / 16777216.f);
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* Every half's float32 value (256 KiB, filled when the library loads; quant.c), as ggml's
 * ggml_table_f32_f16. A block's scales are read through it: a table load broadcast to a
 * vector is a load-port operation, where F16C's vcvtph2ps and a word broadcast each take a
 * shuffle-port slot, which on Intel cores (one 512-bit shuffle port) bounded the 4-bit
 * kernels at about a third of their rate (benchmarks/quant_bench.py, docs/cpu.md). */
extern float quant_f16_table[1 << 16];

INLINE float f16(const uint8_t *p) {          /* the IEEE half at p (little-endian) */
    uint16_t h;
    memcpy(&h, p, 2);
    return quant_f16_table[h];
}

/* Dequantize one block into y[QK or QK_K] float32 (ggml's dequantize_row_* for one block). The
 * loops are written so the compiler vectorizes them at the build's -march. */
INLINE void dq_q8_0(const uint8_t *b, float *y) {       /* {f16 d; int8 q[32]} 34 B */
    const float d = f16(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int i = 0; i < QK; i++) y[i] = d * q[i];
}
INLINE void dq_q4_0(const uint8_t *b, float *y) {       /* {f16 d; u8 q[16]} 18 B */
    const float d = f16(b);
    const uint8_t *q = b + 2;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = d * (float)((q[j] & 15) - 8);
        y[j + QK / 2] = d * (float)((q[j] >> 4) - 8);
    }
}
INLINE void dq_q4_1(const uint8_t *b, float *y) {       /* {f16 d, m; u8 q[16]} 20 B */
    const float d = f16(b), m = f16(b + 2);
    const uint8_t *q = b + 4;
    for (int j = 0; j < QK / 2; j++) {
        const float lo = d * (float)(q[j] & 15), hi = d * (float)(q[j] >> 4);
        y[j] = lo + m;
        y[j + QK / 2] = hi + m;
    }
}
INLINE void dq_i8(const uint8_t *b, float *y) {         /* {int8 q[32]} 32 B; row scale after */
    const int8_t *q = (const int8_t *)b;
    for (int i = 0; i < QK; i++) y[i] = (float)q[i];
}
/* Q4_K: {f16 d, dmin; u8 scales[12] (8 pairs of 6-bit scale / min); u8 q[128]} 144 B; eight
 * sub-blocks of 32, value = d * sc * q - dmin * m. */
INLINE void dq_q4_k(const uint8_t *b, float *y) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *s = b + 4, *q = b + 16;
    for (int j = 0; j < 4; j++) {                      /* 64 values: two sub-blocks */
        uint8_t sc[2], mn[2];
        for (int h = 0; h < 2; h++) {
            const int i = 2 * j + h;
            if (i < 4) { sc[h] = s[i] & 63; mn[h] = s[i + 4] & 63; }
            else {
                sc[h] = (s[i + 4] & 0xF) | ((s[i - 4] >> 6) << 4);
                mn[h] = (s[i + 4] >> 4) | ((s[i] >> 6) << 4);
            }
        }
        const float d1 = d * sc[0], m1 = dmin * mn[0], d2 = d * sc[1], m2 = dmin * mn[1];
        for (int l = 0; l < 32; l++) {
            const float lo = d1 * (float)(q[l] & 15), hi = d2 * (float)(q[l] >> 4);
            y[64 * j + l] = lo - m1;
            y[64 * j + 32 + l] = hi - m2;
        }
        q += 32;
    }
}
/* Q6_K: {u8 ql[128] (low 4 bits); u8 qh[64] (high 2 bits); int8 scales[16]; f16 d} 210 B;
 * sixteen sub-blocks of 16, value = d * sc * (q - 32). */
INLINE void dq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16(b + 208);
    for (int n = 0; n < 2; n++) {                      /* 128 values per half */
        float ds[8];
        for (int i = 0; i < 8; i++) ds[i] = d * sc[i];
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = ((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = ds[is] * (float)q1;
            y[l + 32] = ds[is + 2] * (float)q2;
            y[l + 64] = ds[is + 4] * (float)q3;
            y[l + 96] = ds[is + 6] * (float)q4;
        }
        y += 128; ql += 64; qh += 32; sc += 8;
    }
}

/* The 32-value blocks straight into QK / VL vectors, no trip through memory (the same
 * arithmetic as dq_*). */
#define NV (QK / VL)
#if HAVE_AVX512
INLINE V f16_bcast(const uint8_t *p) {          /* the IEEE half at p, in every lane */
    return _mm512_set1_ps(f16(p));              /* vbroadcastss from the table: no shuffle */
}
/* The 16 values a 4-bit block can hold, lane q: d * (q - 8) (Q4_0), d * q + m (Q4_1). */
INLINE V lut_q4_0(const uint8_t *b) {
    return vmul(f16_bcast(b), _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1,
                                             0, 1, 2, 3, 4, 5, 6, 7));
}
INLINE V lut_q4_1(const uint8_t *b) {
    return vadd(vmul(f16_bcast(b), _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7,
                                                   8, 9, 10, 11, 12, 13, 14, 15)),
                f16_bcast(b + 2));
}
INLINE void dqv_q8_0(const uint8_t *b, V *out) {
    const V d = f16_bcast(b);
    for (int j = 0; j < 2; j++)
        out[j] = vmul(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const void *)(b + 2 + 16 * j)))));
}
INLINE void dqv_i8(const uint8_t *b, V *out) {
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)b)));
    out[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(b + 16))));
}
/* The 4-bit types through a table: the 16 values a block can hold (d * (q - 8), or d * q + m),
 * computed once in one vector, then looked up by nibble (vpermps): the same products and sums
 * as dq_*, on one vector instead of two, and no int-to-float conversions. */
INLINE void dqv_lut(V lut, const uint8_t *nibbles, V *out) {
    /* one widening for both halves: vpermps reads only bits 3:0 of a lane's index, so the
     * low nibbles need no mask and the high ones are a shift away */
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)nibbles));
    out[0] = _mm512_permutexvar_ps(q, lut);
    out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);
}
INLINE void dqv_q4_0(const uint8_t *b, V *out) { dqv_lut(lut_q4_0(b), b + 2, out); }
INLINE void dqv_q4_1(const uint8_t *b, V *out) { dqv_lut(lut_q4_1(b), b + 4, out); }
#elif HAVE_AVX2
INLINE void nibbles(const uint8_t *p, __m256i q[4]) {  /* 32 values: low then high nibbles */
    const __m128i raw = _mm_loadu_si128((const void *)p), mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    q[0] = _mm256_cvtepu8_epi32(lo);
    q[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
    q[2] = _mm256_cvtepu8_epi32(hi);
    q[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
}
INLINE __m256i int8x8(const uint8_t *p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)p));
}
INLINE void dqv_q8_0(const uint8_t *b, V *out) {
    const V d = vset1(f16(b));
    for (int j = 0; j < 4; j++) out[j] = vmul(d, _mm256_cvtepi32_ps(int8x8(b + 2 + 8 * j)));
}
INLINE void dqv_i8(const uint8_t *b, V *out) {
    for (int j = 0; j < 4; j++) out[j] = _mm256_cvtepi32_ps(int8x8(b + 8 * j));
}
INLINE void dqv_q4_0(const uint8_t *b, V *out) {
    const V d = vset1(f16(b));
    __m256i q[4];
    nibbles(b + 2, q);
    for (int j = 0; j < 4; j++)
        out[j] = vmul(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[j], _mm256_set1_epi32(8))));
}
INLINE void dqv_q4_1(const uint8_t *b, V *out) {
    const V d = vset1(f16(b)), m = vset1(f16(b + 2));
    __m256i q[4];
    nibbles(b + 4, q);
    for (int j = 0; j < 4; j++) out[j] = vadd(vmul(d, _mm256_cvtepi32_ps(q[j])), m);
}
#endif
/* dqv_T through dq_T and a buffer: the 256-value types everywhere (16 / 32 vectors, which the
 * compiler keeps in L1 as it kept the buffer), and every type in the generic build. */
#define DEFINE_DQV(T, QKT)                                                                    \
INLINE void dqv_##T(const uint8_t *b, V *out) {                                              \
    float buf[QKT] __attribute__((aligned(64)));                                              \
    dq_##T(b, buf);                                                                           \
    memcpy(out, buf, sizeof buf);                                                             \
}
#if !HAVE_AVX512 && !HAVE_AVX2
DEFINE_DQV(q8_0, QK)
DEFINE_DQV(i8, QK)
DEFINE_DQV(q4_0, QK)
DEFINE_DQV(q4_1, QK)
#endif
DEFINE_DQV(q4_k, QK_K)
DEFINE_DQV(q6_k, QK_K)

#if defined(__AVX512BF16__) && HAVE_AVX512
#define HAVE_BF16_DOT 1
/* A 32-value block straight to 32 bfloat16 (lane i = value i), rounded to nearest even. */
#define DEFINE_DQB_VIA_FLOAT(T)                                                               \
INLINE __m512i dqb_##T(const uint8_t *b) {                                                    \
    V v[NV];                                                                                  \
    dqv_##T(b, v);                                                                            \
    return (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]);                                          \
}
DEFINE_DQB_VIA_FLOAT(q8_0)
DEFINE_DQB_VIA_FLOAT(i8)
/* The 4-bit types: their 16-value table rounded to bfloat16 once, then looked up by nibble
 * (vpermw), 32 values at a time: no int-to-float conversion, one rounding per table entry.
 * The table is held twice (words 0-15 and 16-31): vpermw reads bits 4:0 of a word's index,
 * so a whole byte finds its low nibble's entry in one copy or the other, and the 16 bytes,
 * broadcast to both halves by the load and widened to words, need only a shift by 4 in the
 * upper half — three shuffle-port operations a block, where a mask, an insert and a second
 * conversion made it five (the tile nest's pack is bound by that port, quant_amx.c). */
INLINE __m512i dqb_lut(V lut, const uint8_t *nibbles) {
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(lut, lut);
    const __m512i bytes = _mm512_cvtepu8_epi16(
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const void *)nibbles)));
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    return _mm512_permutexvar_epi16(_mm512_srlv_epi16(bytes, shift), table);
}
INLINE __m512i dqb_q4_0(const uint8_t *b) {
    return dqb_lut(lut_q4_0(b), b + 2);
}
INLINE __m512i dqb_q4_1(const uint8_t *b) {
    return dqb_lut(lut_q4_1(b), b + 4);
}

#else
#define HAVE_BF16_DOT 0
#endif

/* dst [VL][ldd] = src [VL][lds]^T for one VL x VL tile of 32-bit values (floats, or pairs of
 * bfloat16 taken as one unit). AVX-512: the usual 4-stage unpack / shuffle transpose. */
#if HAVE_AVX512
INLINE void transpose_tile(const float *src, int64_t lds, float *dst, int64_t ldd) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * lds);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xDD);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + i * ldd, r[i]);
}
#elif HAVE_AVX2
INLINE void transpose_tile(const float *src, int64_t lds, float *dst, int64_t ldd) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
        t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
    }
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + i * ldd, t[i]);
}
#else
INLINE void transpose_tile(const float *src, int64_t lds, float *dst, int64_t ldd) {
    for (int i = 0; i < VL; i++)
        for (int j = 0; j < VL; j++) dst[j * ldd + i] = src[i * lds + j];
}
#endif

#if HAVE_AVX512
/* A block of 32 float32 (a: values 0..15, b: 16..31) rounded as llama.cpp's q8_0 / q8_1
 * activations are (ggml-quants.c quantize_row_q8_1: d = max|x| / 127, q = round(x / d) to
 * nearest even): returns d, the 32 q as int32 in *qa, *qb (quant_q8.c, quant_q8_wide.c). */
INLINE float q8_round_block(__m512 a, __m512 b, __m512i *qa, __m512i *qb) {
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512 inv = _mm512_set1_ps(id);
    *qa = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(a, inv), rn));
    *qb = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(b, inv), rn));
    return d;
}
#endif

/* Ask for the bytes [s * step, (s + 1) * step) of the next panel's rows (pf, contiguous): the
 * panel nests (quant_panel.c, quant_amx.c) walk many rows at once, a pattern the hardware
 * prefetcher does not follow, so each panel's tiles ask for the next one's rows (its thread's
 * next, under the static schedule; past the tensor's end is harmless) a few lines a k step while
 * they compute. All at once before the tiles, the prefetches stalled on full fill buffers
 * (EPYC, 16-row decode steps: 16.1-17.8 ms against 14.6-15.3 spread). */
INLINE void prefetch_step(const uint8_t *pf, int64_t step, int64_t s) {
    prefetch_range(pf, s * step, (s + 1) * step);
}

/* The step (bytes, a multiple of 64) that spreads `bytes` over `steps` prefetch_step calls. */
INLINE int64_t prefetch_stride(int64_t bytes, int64_t steps) {
    return ((bytes + 63) / 64 + steps - 1) / steps * 64;
}

/* Dequantize W rows [r0, r1) (nb blocks each, from w) into dst [(r1 - r0)][ld] float32. */
typedef void (*dq_rows_fn)(const uint8_t *, int64_t, int64_t, int64_t, int64_t, float *,
                           int64_t);
/* One 32-value block (at w) of W rows [r0, r1) into dst [(r1 - r0)][32] bfloat16 (dqb_T). */
typedef void (*dqb_rows_fn)(const uint8_t *, int64_t, int64_t, int64_t, uint16_t *);

/* y[r, n] = v (* row_scale[n]) (+ bias[n]), stored as float32 or bfloat16. */
INLINE void store_out(void *y, int64_t ldy, int y_f32, int64_t r, int64_t n, float v,
                      const float *row_scale, const float *bias) {
    if (row_scale) v *= row_scale[n];
    if (bias) v += bias[n];
    if (y_f32) ((float *)y)[r * ldy + n] = v;
    else ((uint16_t *)y)[r * ldy + n] = store_bf16(v);
}

/* y[r, n0 .. n0 + count) = v[0 .. count) (* row_scale[n]) (+ bias[n]), as store_out for a run
 * of outputs (v is overwritten): each step a loop the compiler vectorizes, where one store_out
 * an output cost a panel of 16 rows about a third of its products' time. */
INLINE void store_row(float *v, int count, void *y, int64_t ldy, int y_f32, int64_t r,
                      int64_t n0, const float *row_scale, const float *bias) {
    if (row_scale)
        for (int c = 0; c < count; c++) v[c] *= row_scale[n0 + c];
    if (bias)
        for (int c = 0; c < count; c++) v[c] += bias[n0 + c];
    if (y_f32) {
        memcpy((float *)y + r * ldy + n0, v, sizeof(float) * (size_t)count);
    } else {
        uint16_t *dst = (uint16_t *)y + r * ldy + n0;
        for (int c = 0; c < count; c++) dst[c] = store_bf16(v[c]);
    }
}

/* Bytes ahead W is prefetched in the fused single-row nests (quant.c, quant_q8.c): rows are
 * contiguous, so past a row's end is the next row's start. prefetcht0: prefetchnta ran at a
 * third of this rate on an Intel host (docs/cpu.md). */
#ifndef PF
#define PF 2048
#endif

/* quant.c / quant_q8.c's entry points (see there); layer_stack.c calls them too. */
int quant_linear(int type, const uint8_t *w, int64_t row_bytes, const float *row_scale,
                 const float *bias, const void *x, int64_t x_stride, int x_bf16, void *y,
                 int64_t ldy, int y_f32, int64_t m, int64_t n, int64_t k, int num_threads);
int quant_linear_packed(int type, const uint8_t *w, int64_t row_bytes, const float *row_scale,
                        const float *bias, const void *x, int64_t x_stride, int x_bf16, void *y,
                        int64_t ldy, int y_f32, int64_t m, int64_t n, int64_t k,
                        int num_threads, const uint8_t *packed);
int quant_linear_q8(int type, const uint8_t *w, int64_t row_bytes, const float *row_scale,
                    const float *bias, const void *x, int64_t x_stride, int x_bf16, void *y,
                    int64_t ldy, int y_f32, int64_t m, int64_t n, int64_t k, int num_threads,
                    const uint8_t *packed);
/* quant_q8_wide.c: W repacked for the int8-activation nest (see there). */
int64_t quant_q8_packed_bytes(int type, int64_t n, int64_t k);
int quant_q8_pack(int type, const uint8_t *w, int64_t row_bytes, const float *row_scale,
                  int64_t n, int64_t k, uint8_t *out);
int quant_q8_wide(int type, const uint8_t *packed, const float *bias, const void *x,
                  int64_t x_stride, int x_bf16, void *y, int64_t ldy, int y_f32, int64_t m,
                  int64_t n, int64_t k, int num_threads);

/* quant_amx.c: the nest of bfloat16 x on AMX tiles (see there). quant_amx_config(min_rows) turns
 * it on for calls of at least min_rows rows (0: off) after asking Linux for the tile state:
 * 0, -1 (no AMX in this build) or the refusal's errno. */
int quant_amx_config(int min_rows);
int quant_amx_min_rows(void);
int quant_amx_linear(int type, const uint8_t *w, int64_t row_bytes, const float *row_scale,
                     const float *bias, const uint16_t *x, int64_t x_stride, void *y,
                     int64_t ldy, int y_f32, int64_t m, int64_t n, int64_t k, int num_threads);

/* quant.c: x [m, k] as a contiguous, zero-padded copy in the calling thread's scratch (see
 * there); NULL if out of memory. */
void *quant_copy_x(const void *x, int64_t x_stride, int x_bf16, int64_t m, int64_t rows,
                   int64_t k, int64_t kp, int as_bf16, int qk_major);

/* quant_panel.c: the M > MR nest over W rows [n0, n1), at most quant_panel_rows() of them;
 * tmp: quant_panel_scratch(kp, qk) floats per thread. */
int quant_panel_rows(void);
size_t quant_panel_scratch(int64_t kp, int qk);
void quant_panel(dq_rows_fn dq, dqb_rows_fn dqb, int bf16, const uint8_t *w,
                 int64_t row_bytes, int64_t n0, int64_t n1, int64_t nb, int qk, int bytes,
                 const void *xc, int64_t m, float *tmp, void *y, int64_t ldy, int y_f32,
                 const float *row_scale, const float *bias);
/* quant_panel.c: W repacked for the bfloat16 panels (AVX512-BF16 builds; see there). */
int64_t quant_panel_packed_bytes(int type, int64_t n, int64_t k);
int quant_panel_pack(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                     uint8_t *out);
void quant_panel_repacked(int type, const uint8_t *pk, int64_t n, int64_t n0, int64_t n1,
                          int64_t nb, const uint16_t *xb, int64_t m, float *tmp, void *y,
                          int64_t ldy, int y_f32, const float *row_scale, const float *bias);

#endif
