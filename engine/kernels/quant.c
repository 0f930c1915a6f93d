/*
 * Linear layers and embedding lookups over quantized weights read in their block format:
 * GGUF's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K blocks (as llama.cpp lays them out, ggml-common.h and
 * ggml-quants.c's dequantize_row_*), and Continuum's int8 weight-only format ("I8": 32 int8 per
 * block, one float32 scale per output row).
 *
 *   y [M, N] = x [M, K] @ dequant(W)[N, K]^T (* row_scale [N]) (+ bias [N])
 *
 * W is N rows of K / QK blocks each (`row_bytes` bytes a row, rows contiguous). A block is
 * dequantized to float32 exactly as ggml does (d * q, d * q + m, d * sc * q ...), so the result
 * is the dequantized model's up to the order of the float32 sums.
 *
 * Two loop nests, chosen by M:
 * - M <= MR (decode at small batch): per W row, each block is dequantized into a QK-float buffer
 *   that stays in registers / L1 and multiplied at once with the M rows of x (vector
 *   accumulators per row, one horizontal add per output). W streams from memory once.
 * - M > MR (prefill, large decode batches): a chunk of NC W rows is dequantized once into a
 *   per-thread float32 scratch (L2), then a register tile of MR rows of x by NW rows of W runs
 *   over it (dot-product form, as in gemm.c's micro-kernel but with K innermost), so each weight
 *   is dequantized once per call instead of once per row of x.
 * Threads split the W rows in chunks of NC. x is first copied to float32, zero-padded to whole
 * blocks (the int8 format pads K with zero weights). For a bfloat16 x (a bfloat16 model) on a
 * host with AVX512-BF16, the M > MR nest dequantizes to bfloat16 instead and multiplies with
 * vdpbf16ps: the bfloat16 model's weights and products, at twice the float32 FMA's rate.
 */
#include "vec.h"

#if HAVE_AVX512
/* The block loops vectorize at the vector width of V (16 lanes): at GCC's default 256-bit
 * preference a block went to the stack as two 8-lane stores and came back as one 16-lane load,
 * which store forwarding cannot serve (Q8_0 ran at a seventh of Q4_1's rate). */
#pragma GCC target("prefer-vector-width=512")
#endif

#define QK 32
#define QK_K 256
#define MR 4          /* rows of x up to which the M <= MR nest runs */
#define NC 16         /* rows of W a thread takes at a time in it */

/* GGML type ids (ggml.h's enum ggml_type); I8 is ggml's id for plain int8. */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14, T_I8 = 24 };

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

INLINE float f16(const uint8_t *p) {          /* IEEE half, little-endian, to float32 */
    uint16_t h;
    memcpy(&h, p, 2);
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
 * arithmetic as dq_*: d * q, d * q + m as a product then a sum, never fused). */
#define NV (QK / VL)
#if HAVE_AVX512
INLINE __m512i lo_nibbles(__m128i raw) {
    return _mm512_cvtepu8_epi32(_mm_and_si128(raw, _mm_set1_epi8(15)));
}
INLINE __m512i hi_nibbles(__m128i raw) {
    return _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15)));
}
INLINE void dqv_q8_0(const uint8_t *b, V *out) {
    const V d = vset1(f16(b));
    out[0] = vmul(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(b + 2)))));
    out[1] = vmul(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(b + 18)))));
}
INLINE void dqv_i8(const uint8_t *b, V *out) {
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)b)));
    out[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(b + 16))));
}
INLINE void dqv_q4_0(const uint8_t *b, V *out) {
    const V d = vset1(f16(b));
    const __m128i raw = _mm_loadu_si128((const void *)(b + 2));
    const __m512i eight = _mm512_set1_epi32(8);
    out[0] = vmul(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo_nibbles(raw), eight)));
    out[1] = vmul(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi_nibbles(raw), eight)));
}
INLINE void dqv_q4_1(const uint8_t *b, V *out) {
    const V d = vset1(f16(b)), m = vset1(f16(b + 2));
    const __m128i raw = _mm_loadu_si128((const void *)(b + 4));
    out[0] = vadd(vmul(d, _mm512_cvtepi32_ps(lo_nibbles(raw))), m);
    out[1] = vadd(vmul(d, _mm512_cvtepi32_ps(hi_nibbles(raw))), m);
}
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
#else
#define DEFINE_DQV(T)                                                                         \
INLINE void dqv_##T(const uint8_t *b, V *out) {                                              \
    float buf[QK];                                                                            \
    dq_##T(b, buf);                                                                           \
    memcpy(out, buf, sizeof buf);                                                             \
}
DEFINE_DQV(q8_0)
DEFINE_DQV(i8)
DEFINE_DQV(q4_0)
DEFINE_DQV(q4_1)
#endif

/* Block size in values and bytes of a type; 0 for a type with no kernel. */
int quant_block_info(int type, int *values, int *bytes) {
    switch (type) {
    case T_Q8_0: *values = QK; *bytes = 34; return 1;
    case T_Q4_0: *values = QK; *bytes = 18; return 1;
    case T_Q4_1: *values = QK; *bytes = 20; return 1;
    case T_I8: *values = QK; *bytes = QK; return 1;
    case T_Q4_K: *values = QK_K; *bytes = 144; return 1;
    case T_Q6_K: *values = QK_K; *bytes = 210; return 1;
    default: return 0;
    }
}

/* Dequantize W rows [r0, r1) (nb blocks each) into dst [(r1 - r0)][ld] float32. Each block
 * goes through a local buffer: dst may alias w as far as the compiler knows (uint8_t aliases
 * everything), which would keep the block's loop from vectorizing. */
#define DEFINE_DQ_ROWS(T, QKT, BYTES)                                                         \
static void dq_rows_##T(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,         \
                        int64_t nb, float *dst, int64_t ld) {                                 \
    float buf[QKT] __attribute__((aligned(64)));                                              \
    for (int64_t n = r0; n < r1; n++)                                                         \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            dq_##T(w + n * row_bytes + b * BYTES, buf);                                       \
            memcpy(dst + (n - r0) * ld + b * QKT, buf, sizeof buf);                           \
        }                                                                                     \
}

/* out[r] = dot(dequant(W row), x row r) for r < mr (mr <= MR, a constant once inlined): each
 * block dequantized into buf (registers / L1) and used at once by every row of x. */
#define DEFINE_ROW_TILE(T, QKT, BYTES)                                                        \
INLINE void row_tile_##T(const uint8_t *wrow, int64_t nb, const float *x, int64_t ldx,        \
                         const int mr, float *out) {                                          \
    V acc[MR][2];                                                                             \
    float buf[QKT] __attribute__((aligned(64)));                                              \
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = vzero();                             \
    for (int64_t b = 0; b < nb; b++) {                                                        \
        __builtin_prefetch(wrow + (b + 8) * BYTES, 0, 0);                                     \
        dq_##T(wrow + b * BYTES, buf);                                                        \
        const float *xb = x + b * QKT;                                                        \
        for (int i = 0; i < QKT; i += 2 * VL) {                                               \
            const V w0 = vload_f32(buf + i), w1 = vload_f32(buf + i + VL);                    \
            for (int r = 0; r < mr; r++) {                                                    \
                acc[r][0] = vfma(w0, vload_f32(xb + r * ldx + i), acc[r][0]);                 \
                acc[r][1] = vfma(w1, vload_f32(xb + r * ldx + i + VL), acc[r][1]);            \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int r = 0; r < mr; r++) out[r] = vsum(vadd(acc[r][0], acc[r][1]));                   \
}                                                                                             \
DEFINE_SMALL_M(T)

/* The M <= MR nest over n W rows: out [n][MR]. */
#define DEFINE_SMALL_M(T)                                                                     \
static void small_m_##T(const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nb,          \
                        const float *x, int64_t ldx, int mr, float *out /* [n][MR] */) {      \
    for (int64_t j = 0; j < n; j++) {                                                         \
        const uint8_t *wrow = w + j * row_bytes;                                              \
        switch (mr) {                                                                         \
        case 4: row_tile_##T(wrow, nb, x, ldx, 4, out + j * MR); break;                       \
        case 3: row_tile_##T(wrow, nb, x, ldx, 3, out + j * MR); break;                       \
        case 2: row_tile_##T(wrow, nb, x, ldx, 2, out + j * MR); break;                       \
        default: row_tile_##T(wrow, nb, x, ldx, 1, out + j * MR); break;                      \
        }                                                                                     \
    }                                                                                         \
}

/* The 32-value types: each block dequantized into NV vectors by dqv_*. */
#define DEFINE_DQ_ROWS32(T, BYTES)                                                            \
static void dq_rows_##T(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,         \
                        int64_t nb, float *dst, int64_t ld) {                                 \
    for (int64_t n = r0; n < r1; n++)                                                         \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            V v[NV];                                                                          \
            dqv_##T(w + n * row_bytes + b * BYTES, v);                                        \
            for (int j = 0; j < NV; j++) vstore(dst + (n - r0) * ld + b * QK + j * VL, v[j]); \
        }                                                                                     \
}
#define DEFINE_ROW_TILE32(T, BYTES)                                                           \
INLINE void row_tile_##T(const uint8_t *wrow, int64_t nb, const float *x, int64_t ldx,        \
                         const int mr, float *out) {                                          \
    V acc[MR][2];                                                                             \
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = vzero();                             \
    for (int64_t b = 0; b < nb; b++) {                                                        \
        __builtin_prefetch(wrow + (b + 8) * BYTES, 0, 0);                                     \
        V v[NV];                                                                              \
        dqv_##T(wrow + b * BYTES, v);                                                         \
        const float *xb = x + b * QK;                                                         \
        for (int j = 0; j < NV; j++)                                                          \
            for (int r = 0; r < mr; r++)                                                      \
                acc[r][j & 1] = vfma(v[j], vload_f32(xb + r * ldx + j * VL), acc[r][j & 1]);  \
    }                                                                                         \
    for (int r = 0; r < mr; r++) out[r] = vsum(vadd(acc[r][0], acc[r][1]));                   \
}                                                                                             \
DEFINE_SMALL_M(T)

DEFINE_DQ_ROWS32(q8_0, 34)
DEFINE_DQ_ROWS32(q4_0, 18)
DEFINE_DQ_ROWS32(q4_1, 20)
DEFINE_DQ_ROWS32(i8, QK)
DEFINE_DQ_ROWS(q4_k, QK_K, 144)
DEFINE_DQ_ROWS(q6_k, QK_K, 210)
DEFINE_ROW_TILE32(q8_0, 34)
DEFINE_ROW_TILE32(q4_0, 18)
DEFINE_ROW_TILE32(q4_1, 20)
DEFINE_ROW_TILE32(i8, QK)
DEFINE_ROW_TILE(q4_k, QK_K, 144)
DEFINE_ROW_TILE(q6_k, QK_K, 210)

typedef void (*dq_rows_fn)(const uint8_t *, int64_t, int64_t, int64_t, int64_t, float *,
                           int64_t);
typedef void (*small_m_fn)(const uint8_t *, int64_t, int64_t, int64_t, const float *, int64_t,
                           int, float *);

static int kernels_for(int type, dq_rows_fn *dq, small_m_fn *sm) {
    switch (type) {
    case T_Q8_0: *dq = dq_rows_q8_0; *sm = small_m_q8_0; return 1;
    case T_Q4_0: *dq = dq_rows_q4_0; *sm = small_m_q4_0; return 1;
    case T_Q4_1: *dq = dq_rows_q4_1; *sm = small_m_q4_1; return 1;
    case T_I8: *dq = dq_rows_i8; *sm = small_m_i8; return 1;
    case T_Q4_K: *dq = dq_rows_q4_k; *sm = small_m_q4_k; return 1;
    case T_Q6_K: *dq = dq_rows_q6_k; *sm = small_m_q6_k; return 1;
    default: return 0;
    }
}

/* ---- The M > MR nest: a panel of NP W rows dequantized once, transposed to [kp][NP] (float32)
 * or [kp / 2][NP][2] (bfloat16 pairs), then register tiles of up to ML rows of x by NP columns:
 * per k one load of the panel's NP / VL vectors, one broadcast of x per row, and ML * NPV FMAs
 * (Goto and van de Geijn's micro-kernel shape, as gemm.c). Accumulators: ML * NPV vectors. */
#if HAVE_AVX512
#define NPV 2
#define ML 8
#elif HAVE_AVX2
#define NPV 2
#define ML 6
#else
#define NPV 4
#define ML 4
#endif
#define NP (NPV * VL)

INLINE void store_out(void *y, int64_t ldy, int y_f32, int64_t r, int64_t n, float v,
                      const float *row_scale, const float *bias) {
    if (row_scale) v *= row_scale[n];
    if (bias) v += bias[n];
    if (y_f32) ((float *)y)[r * ldy + n] = v;
    else ((uint16_t *)y)[r * ldy + n] = store_bf16(v);
}

/* Store a tile acc [mr][NP] (columns n0 .. n0 + ncols - 1 of y) for rows r0 .. r0 + mr - 1. */
static void store_tile(const float *acc, int mr, int64_t r0, int64_t n0, int ncols, void *y,
                       int64_t ldy, int y_f32, const float *row_scale, const float *bias) {
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < ncols; c++)
            store_out(y, ldy, y_f32, r0 + r, n0 + c, acc[r * NP + c], row_scale, bias);
}

/* acc [mr][NP] = x [mr rows, stride kp] . panel [kp][NP]; mr a constant once inlined. */
INLINE void panel_tile(const float *x, int64_t kp, const float *panel, const int mr,
                       float *acc) {
    V a[ML][NPV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NPV; v++) a[r][v] = vzero();
    for (int64_t k = 0; k < kp; k++) {
        V wv[NPV];
        for (int v = 0; v < NPV; v++) wv[v] = vload_f32(panel + k * NP + v * VL);
        for (int r = 0; r < mr; r++) {
            const V xv = vset1(x[r * kp + k]);
            for (int v = 0; v < NPV; v++) a[r][v] = vfma(xv, wv[v], a[r][v]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NPV; v++) vstore(acc + r * NP + v * VL, a[r][v]);
}

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

/* panel [cols][NP] = rows [NP][lds]^T over `cols` columns (a multiple of VL), in tiles. */
static void transpose_panel(const float *rows, int64_t lds, int64_t cols, float *panel) {
    for (int64_t k = 0; k < cols; k += VL)
        for (int g = 0; g < NP; g += VL)
            transpose_tile(rows + g * lds + k, lds, panel + k * NP + g, NP);
}

/* The panel of W rows [n0, n1) (zero past n1) as float32 [kp][NP], one block column at a
 * time: block b of the panel's rows dequantized into tmp [NP][qk] (L1), then transposed into
 * panel rows b * qk ... The rows never make a round trip through L2. */
static void pack_panel(dq_rows_fn dq, const uint8_t *w, int64_t row_bytes, int64_t n0,
                       int64_t n1, int64_t nb, int qk, int bytes, float *tmp, float *panel) {
    const int nr = (int)(n1 - n0);
    memset(tmp + nr * qk, 0, sizeof(float) * (size_t)((NP - nr) * qk));
    for (int64_t b = 0; b < nb; b++) {
        dq(w + b * bytes, row_bytes, n0, n1, 1, tmp, qk);
        transpose_panel(tmp, qk, qk, panel + b * qk * NP);
    }
}

#define TILE_CASES(FN, ...)                                                                   \
    switch (mr) {                                                                             \
    case 1: FN(__VA_ARGS__, 1, acc); break;                                                   \
    case 2: FN(__VA_ARGS__, 2, acc); break;                                                   \
    case 3: FN(__VA_ARGS__, 3, acc); break;                                                   \
    case 4: FN(__VA_ARGS__, 4, acc); break;                                                   \
    case 5: FN(__VA_ARGS__ , ML > 4 ? 5 : 1, acc); break;                                     \
    case 6: FN(__VA_ARGS__, ML > 5 ? 6 : 1, acc); break;                                      \
    case 7: FN(__VA_ARGS__, ML > 6 ? 7 : 1, acc); break;                                      \
    default: FN(__VA_ARGS__, ML, acc); break;                                                 \
    }

/* One panel of W rows [n0, n1) against all m rows of xf [m][kp]. */
static void panel_large_m(dq_rows_fn dq, const uint8_t *w, int64_t row_bytes, int64_t n0,
                          int64_t n1, int64_t nb, int qk, int bytes, const float *xf,
                          int64_t m, float *tmp, float *panel, void *y, int64_t ldy, int y_f32,
                          const float *row_scale, const float *bias) {
    const int64_t kp = nb * qk;
    pack_panel(dq, w, row_bytes, n0, n1, nb, qk, bytes, tmp, panel);
    float acc[ML * NP] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < m; r0 += ML) {
        const int mr = m - r0 < ML ? (int)(m - r0) : ML;
        TILE_CASES(panel_tile, xf + r0 * kp, kp, panel)
        store_tile(acc, mr, r0, n0, (int)(n1 - n0), y, ldy, y_f32, row_scale, bias);
    }
}

#if defined(__AVX512BF16__) && HAVE_AVX512
#define HAVE_BF16_DOT 1
/* panel_tile in bfloat16 pairs with float32 accumulation (AVX512-BF16's vdpbf16ps: two k a
 * lane, twice the float32 FMA's products): x [mr rows, stride kp] bfloat16, panel
 * [kp / 2][NP][2] bfloat16. */
INLINE void panel_tile_bf16(const uint16_t *x, int64_t kp, const uint16_t *panel, const int mr,
                            float *acc) {
    __m512 a[ML][NPV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NPV; v++) a[r][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kp; k += 2) {
        __m512bh wv[NPV];
        for (int v = 0; v < NPV; v++)
            wv[v] = (__m512bh)_mm512_loadu_si512(panel + k * NP + v * 32);
        for (int r = 0; r < mr; r++) {
            int32_t pair;
            memcpy(&pair, x + r * kp + k, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < NPV; v++) a[r][v] = _mm512_dpbf16_ps(a[r][v], xv, wv[v]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NPV; v++) _mm512_storeu_ps(acc + r * NP + v * 16, a[r][v]);
}

/* panel_large_m for a bfloat16 x: the panel rounded to bfloat16 (nearest even, as the
 * bfloat16 model's weights are), in k pairs. */
static void panel_large_m_bf16(dq_rows_fn dq, const uint8_t *w, int64_t row_bytes, int64_t n0,
                               int64_t n1, int64_t nb, int qk, int bytes, const uint16_t *xb,
                               int64_t m, float *tmp, uint16_t *panel, void *y, int64_t ldy,
                               int y_f32, const float *row_scale, const float *bias) {
    const int64_t kp = nb * qk;
    const int nr = (int)(n1 - n0);
    uint16_t *half = (uint16_t *)(tmp + NP * qk);        /* tmp rounded: [NP][qk] bfloat16 */
    memset(half + nr * qk, 0, 2 * (size_t)((NP - nr) * qk));
    for (int64_t b = 0; b < nb; b++) {
        dq(w + b * bytes, row_bytes, n0, n1, 1, tmp, qk);
        for (int i = 0; i < nr * qk; i++) half[i] = store_bf16(tmp[i]);
        /* a pair of bfloat16 (k, k + 1) is one 32-bit unit: [NP][qk / 2] -> [qk / 2][NP] */
        transpose_panel((const float *)half, qk / 2, qk / 2, (float *)(panel + b * qk * NP));
    }
    float acc[ML * NP] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < m; r0 += ML) {
        const int mr = m - r0 < ML ? (int)(m - r0) : ML;
        TILE_CASES(panel_tile_bf16, xb + r0 * kp, kp, panel)
        store_tile(acc, mr, r0, n0, (int)(n1 - n0), y, ldy, y_f32, row_scale, bias);
    }
}
#else
#define HAVE_BF16_DOT 0
#endif

/* x [m, k] (row stride x_stride; bfloat16 if x_bf16) as a contiguous copy zero-padded to kp:
 * bfloat16 if as_bf16, else float32. NULL if out of memory. */
static void *copy_x(const void *x, int64_t x_stride, int x_bf16, int64_t m, int64_t k,
                    int64_t kp, int as_bf16) {
    const size_t elem = as_bf16 ? 2 : 4;
    void *xc = calloc((size_t)(m > 0 ? m : 1) * (size_t)kp, elem);
    if (!xc) return NULL;
    for (int64_t r = 0; r < m; r++) {
        if (as_bf16) {
            memcpy((uint16_t *)xc + r * kp, (const uint16_t *)x + r * x_stride, 2 * (size_t)k);
        } else if (x_bf16) {
            const uint16_t *src = (const uint16_t *)x + r * x_stride;
            for (int64_t i = 0; i < k; i++) ((float *)xc)[r * kp + i] = load_bf16(src[i]);
        } else {
            memcpy((float *)xc + r * kp, (const float *)x + r * x_stride, 4 * (size_t)k);
        }
    }
    return xc;
}

/* y [m, n] (row stride ldy; float32 if y_f32 else bfloat16) = x [m, k] @ dequant(W)^T, times
 * row_scale [n] if given, plus bias [n] float32 if given. x: row stride x_stride elements,
 * bfloat16 if x_bf16 else float32. W: n rows of row_bytes bytes holding ceil(k / QK) blocks.
 * Returns 0; -1 out of memory; -2 unknown type. */
int quant_linear(int type, const uint8_t *w, int64_t row_bytes, const float *row_scale,
                 const float *bias, const void *x, int64_t x_stride, int x_bf16, void *y,
                 int64_t ldy, int y_f32, int64_t m, int64_t n, int64_t k, int num_threads) {
    dq_rows_fn dq;
    small_m_fn sm;
    int qk, bytes;
    if (!kernels_for(type, &dq, &sm) || !quant_block_info(type, &qk, &bytes)) return -2;
    const int64_t nb = (k + qk - 1) / qk, kp = nb * qk;
    const int large = m > MR;
    /* bfloat16 products only for a bfloat16 x (a bfloat16 model) in the M > MR nest */
    const int bf16_dot = HAVE_BF16_DOT && x_bf16 && large;
    void *xc = copy_x(x, x_stride, x_bf16, m, k, kp, bf16_dot);
    if (!xc) return -1;
    const int64_t unit = large ? NP : NC;       /* W rows a thread takes at a time */
    const int64_t chunks = (n + unit - 1) / unit;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        /* per thread, M > MR: a block column of the panel (float32 and bfloat16), and the
         * panel (float32 [kp][NP], or bfloat16) */
        float *tmp = large ? malloc(sizeof(float) * (size_t)(2 * NP * qk + kp * NP)) : NULL;
        if (large && !tmp) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n0 = c * unit, n1 = n0 + unit < n ? n0 + unit : n;
            if (large) {
                float *panel = tmp + 2 * NP * qk;
                if (!tmp) continue;
#if HAVE_BF16_DOT
                if (bf16_dot) {
                    panel_large_m_bf16(dq, w, row_bytes, n0, n1, nb, qk, bytes, xc, m, tmp,
                                       (uint16_t *)panel, y, ldy, y_f32, row_scale, bias);
                    continue;
                }
#endif
                panel_large_m(dq, w, row_bytes, n0, n1, nb, qk, bytes, xc, m, tmp, panel, y,
                              ldy, y_f32, row_scale, bias);
                continue;
            }
            float out[NC * MR];
            sm(w + n0 * row_bytes, row_bytes, n1 - n0, nb, xc, kp, (int)m, out);
            for (int64_t j = 0; j < n1 - n0; j++)
                for (int64_t r = 0; r < m; r++)
                    store_out(y, ldy, y_f32, r, n0 + j, out[j * MR + r], row_scale, bias);
        }
        free(tmp);
    }
    free(xc);
    return failed ? -1 : 0;
}

/* out [t, k] (float32 if out_f32 else bfloat16) = dequant(W)[ids[i]] (times row_scale): an
 * embedding lookup over a quantized table of n rows. Returns 0; -2 unknown type; -3 id out of
 * range (nothing written past the bad one's row). */
int quant_embed(int type, const uint8_t *w, int64_t row_bytes, const float *row_scale,
                const int64_t *ids, int64_t t, int64_t n, int64_t k, void *out, int out_f32) {
    dq_rows_fn dq;
    small_m_fn sm;
    int qk, bytes;
    if (!kernels_for(type, &dq, &sm) || !quant_block_info(type, &qk, &bytes)) return -2;
    const int64_t nb = (k + qk - 1) / qk;
    float *row = malloc(sizeof(float) * (size_t)(nb * qk));
    if (!row) return -1;
    int rc = 0;
    for (int64_t i = 0; i < t; i++) {
        const int64_t id = ids[i];
        if (id < 0 || id >= n) { rc = -3; break; }
        dq(w, row_bytes, id, id + 1, nb, row, nb * qk);
        const float s = row_scale ? row_scale[id] : 1.f;
        for (int64_t j = 0; j < k; j++) {
            if (out_f32) ((float *)out)[i * k + j] = row[j] * s;
            else ((uint16_t *)out)[i * k + j] = store_bf16(row[j] * s);
        }
    }
    free(row);
    return rc;
}
