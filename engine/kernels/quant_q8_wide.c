/*
 * The int8-activation products at every row count (quant_linear_q8 says why; int8 activations:
 * decode, batched decode and prefill), over weights repacked once at load so that each int32
 * lane of a 512-bit vector is one W row. quant_q8.c's nest keeps a W row's blocks across the lanes and
 * pays a conversion, a scale product and an FMA for every 64 products; here one block (32
 * values along K) of 16 W rows against one row of x is 8 vpdpbusd into int32 lanes, then one
 * conversion, one product and one or two FMAs: the scales amortize over 512 products. The
 * layout of llama.cpp's AVX512-VNNI / AMX repacks (ggml-cpu/repack.cpp, amx/mmq.cpp), written
 * here for ggml's 32-value blocks.
 *
 * Packed layout (quant_q8_pack): W rows in groups of 16 (N padded to 32 with zero rows), each
 * group all of K's blocks in order; one (group, block) is
 *   Q4_0 / Q4_1: 4 chunks of [16 lanes][4 bytes] (lane i: row i's q[4c .. 4c + 3] — low
 *                nibbles are values 4c..4c+3, high nibbles 16+4c..19+4c), the blocks' float16
 *                d[16] and (Q4_1) m[16] (Q4_0's m = -8 d is made in registers);
 *                                                              256 + 32 (Q4_0) / 64 bytes
 *   Q8_0 / I8:   8 chunks of [16 lanes][4 bytes] (values 4c..4c+3 as u8 = q + 128), float16
 *                d[16] (I8: the rows' float32 scales);         512 + 32 (Q8_0) / 64 bytes
 * The blocks' own bytes for Q4_0, Q4_1 and Q8_0 (1.13 times I8's), kept beside them (the
 * embedding and quant_q8.c, for a weight without the copy, read the blocks). The scales were
 * float32 until session 17 (1.2 times a Q4_1 weight's bytes): float16 converted per (group,
 * block) measured faster where one row's decode reads W (Zen 5, the model's 121 products,
 * three alternating builds: one row 2.74-2.81 -> 2.35-2.69 ms, four rows 3.73-4.06 -> 3.28-3.72).
 *
 * x is quantized per block of 32 exactly as quant_q8.c does (d = max|x| / 127, q = round to
 * nearest even, s = d sum(q)), in K order; a 4-value chunk of it is broadcast to the 16 lanes
 * as vpdpbusd's signed operand (W is the unsigned one; the broadcast folds into the
 * instruction — with x as the unsigned operand Q8_0 ran 25 % slower):
 *   Q4_0 / Q4_1:  y += d_w d_x sum(q_w q_x) + m_w s_x
 *   Q8_0 / I8:    y += d_w d_x (sum((q_w + 128) q_x) - 128 sum(q_x))
 * The integer dots are exact, so the result is quant_q8.c's up to float32 summation order.
 * Zen 5, 64 rows, GMAC/s against the bfloat16 panels' (quant_panel.c): Q4_1 gate / up
 * (3072 x 576) 608 vs 409, down (576 x 1536) 576 vs 418, Q8_0 head (49152 x 576) 573 vs 414.
 *
 * On AVX2 (no VNNI) the same layout and quantized x go through quant_q8_wide_avx2.h
 * (vpmaddubsw; 16 lanes as two 256-bit halves, one group a tile), with the same y bits. Zen 5
 * at the AVX2 level, the model's 121 products, against the float32 nests (quant.c,
 * quant_panel.c): 1 row 2.6-2.8 vs 4.4 ms, 4 rows 3.9 vs 7.0, 16 rows 14.6 vs 23.8, 64 rows
 * 48.6 vs 74.3.
 */
#include "quant_blocks.h"

#if HAVE_AVX512 && defined(__AVX512VNNI__)
#define HAVE_WIDE 1
#define WT 2          /* groups a tile takes */
#define XT 4          /* rows of x a tile takes */
#elif HAVE_AVX2 && defined(__F16C__)
#define HAVE_WIDE 2   /* quant_q8_wide_avx2.h */
#define WT 1
#define XT 4          /* 2: 4-row products 15 % slower (Zen 5 at the AVX2 level) */
#else
#define HAVE_WIDE 0
#endif

#if HAVE_WIDE
#define GR 16         /* W rows a group holds: one int32 lane each */
#define XB 64         /* rows of x a pass over W takes (their int8 copy stays in L2) */

/* Bytes of one (group, block): the quantized chunks, then the 16 lanes' scales — the blocks'
 * own float16 d (and Q4_1's m), or I8's float32 row scales. */
INLINE int64_t q_bytes(int type) { return is_nibble(type) ? 256 : 512; }
INLINE int64_t sc_bytes(int type) { return type == T_Q4_1 || type == T_I8 ? 64 : 32; }
INLINE int64_t gb_bytes(int type) { return q_bytes(type) + sc_bytes(type); }

/* x quantized: q [rows][nb][32] int8; d, s = d sum(q) and c = -128 sum(q) (int32) [rows][nb]
 * (rows: m rounded up to XT; the extra rows are zero). */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *c;
} xwide;
#endif

#if HAVE_WIDE == 1
/* The 16 lanes' d as float32 (exact, as the blocks' float16) from the scales at `sc`. */
INLINE __m512 lane_d(int type, const uint8_t *sc) {
    return type == T_I8 ? _mm512_loadu_ps((const float *)sc)
                        : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
}
/* The Q4 types' 16 lanes' m: Q4_1's own, Q4_0's -8 d (exact in float32). */
INLINE __m512 lane_m(int type, const uint8_t *sc, __m512 d) {
    return type == T_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32)))
                          : _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
}

/* One block of 32 values (a, b: values 0..15 and 16..31) into q [32], *d_out, *s_out, *c_out. */
INLINE void quantize_block_wide(__m512 a, __m512 b, int8_t *q, float *d_out, float *s_out,
                                int32_t *c_out) {
    __m512i qa, qb;
    const float d = q8_round_block(a, b, &qa, &qb);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(qb));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    *d_out = d;
    *s_out = d * (float)sum;
    *c_out = -128 * sum;
}

/* 16 values of x from element i, the first `cnt` of them (the rest 0), as float32. */
INLINE __m512 load16(const void *x, int x_bf16, int64_t i, int cnt) {
    const __mmask16 mask = cnt >= 16 ? (__mmask16)0xffff
                                     : (__mmask16)((cnt > 0 ? 1u << cnt : 1u) - 1u);
    if (x_bf16) {
        const __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(mask, (const float *)x + i);
}

/* The block of x at element i of `row` (its first `cnt` values; the rest 0) quantized. */
INLINE void quantize_block_at(const char *row, int x_bf16, int64_t i, int cnt, int8_t *q,
                              float *d, float *s, int32_t *c) {
    quantize_block_wide(load16(row, x_bf16, i, cnt), load16(row, x_bf16, i + 16, cnt - 16), q,
                        d, s, c);
}

INLINE __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* acc[w][r] (16 W rows of group w against x row r0 + r, r < mr) over all nb blocks; pk[w]: the
 * group's first (group, block). */
INLINE void wide_tile(int type, const uint8_t *const pk[WT], int64_t nb, const xwide *x,
                      int64_t r0, const int mr, __m512 acc[WT][XT]) {
    const int nib = is_nibble(type);
    const int64_t gbb = gb_bytes(type), qb = q_bytes(type);
    const __m512i lo4 = _mm512_set1_epi8(0x0f);
    for (int w = 0; w < WT; w++)
        for (int r = 0; r < mr; r++) acc[w][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p[WT];
        __m512i ia[WT][XT], ib[WT][XT];   /* two chains per output: vpdpbusd's latency */
        for (int w = 0; w < WT; w++) p[w] = pk[w] + b * gbb;
        for (int r = 0; r < mr; r++) {    /* 8-bit W is q + 128: start at -128 sum(q_x) */
            const __m512i init = nib ? _mm512_setzero_si512()
                                     : _mm512_set1_epi32(x->c[(r0 + r) * nb + b]);
            for (int w = 0; w < WT; w++) {
                ia[w][r] = init;
                ib[w][r] = _mm512_setzero_si512();
            }
        }
        const int8_t *xq = x->q + (r0 * nb + b) * QK;
        if (nib) {
            for (int c = 0; c < 4; c++) {
                __m512i lo[WT], hi[WT];
                for (int w = 0; w < WT; w++) {
                    const __m512i v = _mm512_loadu_si512(p[w] + c * 64);
                    lo[w] = _mm512_and_si512(v, lo4);
                    hi[w] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                }
                for (int r = 0; r < mr; r++) {
                    const __m512i xl = bcast4(xq + r * nb * QK + 4 * c);
                    const __m512i xh = bcast4(xq + r * nb * QK + 16 + 4 * c);
                    for (int w = 0; w < WT; w++) {
                        ia[w][r] = _mm512_dpbusd_epi32(ia[w][r], lo[w], xl);
                        ib[w][r] = _mm512_dpbusd_epi32(ib[w][r], hi[w], xh);
                    }
                }
            }
        } else {
            for (int c = 0; c < 8; c += 2) {
                __m512i wv[WT], wu[WT];
                for (int w = 0; w < WT; w++) {
                    wv[w] = _mm512_loadu_si512(p[w] + c * 64);
                    wu[w] = _mm512_loadu_si512(p[w] + c * 64 + 64);
                }
                for (int r = 0; r < mr; r++) {
                    const __m512i xv = bcast4(xq + r * nb * QK + 4 * c);
                    const __m512i xu = bcast4(xq + r * nb * QK + 4 * c + 4);
                    for (int w = 0; w < WT; w++) {
                        ia[w][r] = _mm512_dpbusd_epi32(ia[w][r], wv[w], xv);
                        ib[w][r] = _mm512_dpbusd_epi32(ib[w][r], wu[w], xu);
                    }
                }
            }
        }
        for (int w = 0; w < WT; w++)
            for (int r = 0; r < mr; r++) ia[w][r] = _mm512_add_epi32(ia[w][r], ib[w][r]);
        for (int r = 0; r < mr; r++) {
            const int64_t at = (r0 + r) * nb + b;
            const __m512 dx = _mm512_set1_ps(x->d[at]), sx = _mm512_set1_ps(x->s[at]);
            for (int w = 0; w < WT; w++) {
                const __m512 dw = lane_d(type, p[w] + qb);
                acc[w][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[w][r]),
                                            _mm512_mul_ps(dw, dx), acc[w][r]);
                if (nib)
                    acc[w][r] = _mm512_fmadd_ps(lane_m(type, p[w] + qb, dw), sx, acc[w][r]);
            }
        }
    }
}

/* y rows [r0, r0 + mr), columns of tile t (32 W rows from n0 = 32 t), for a constant type. */
INLINE void wide_tile_store(int type, const uint8_t *packed, int64_t t, int64_t nb,
                            const xwide *x, int64_t r0, int mr, int64_t n, void *y, int64_t ldy,
                            int y_f32, const float *bias) {
    const uint8_t *pk[WT];
    for (int w = 0; w < WT; w++) pk[w] = packed + (t * WT + w) * nb * gb_bytes(type);
    __m512 acc[WT][XT];
    switch (mr) {      /* constant row counts: the accumulators stay in registers */
    case 1: wide_tile(type, pk, nb, x, r0, 1, acc); break;
    case 2: wide_tile(type, pk, nb, x, r0, 2, acc); break;
    case 3: wide_tile(type, pk, nb, x, r0, 3, acc); break;
    default: wide_tile(type, pk, nb, x, r0, XT, acc); break;
    }
    for (int w = 0; w < WT; w++) {
        const int64_t n0 = (t * WT + w) * GR;
        const int count = n - n0 < GR ? (int)(n - n0) : GR;
        for (int r = 0; r < mr && count > 0; r++) {
            float v[GR];
            _mm512_storeu_ps(v, acc[w][r]);
            store_row(v, count, y, ldy, y_f32, r0 + r, n0, NULL, bias);
        }
    }
}

#elif HAVE_WIDE == 2
#include "quant_q8_wide_avx2.h"
#endif

#if HAVE_WIDE
/* Row r of x [m, k] (r >= m: zeros) quantized into xq's row r (nb blocks). */
static void quantize_row_wide(const void *x, int64_t x_stride, int x_bf16, int64_t m,
                              int64_t k, int64_t nb, const xwide *xq, int64_t r) {
    const char *row = (const char *)x + r * x_stride * (x_bf16 ? 2 : 4);
    for (int64_t b = 0; b < nb; b++) {
        const int64_t i = b * QK;
        const int cnt = r >= m ? 0 : (k - i < QK ? (int)(k - i) : QK);
        quantize_block_at(row, x_bf16, i, cnt, xq->q + (r * nb + b) * QK, xq->d + r * nb + b,
                          xq->s + r * nb + b, xq->c + r * nb + b);
    }
}

/* x quantized into `x` (rows rounded up to XT), then y = x W^T: one parallel region. */
static void wide_product(int type, const uint8_t *packed, int64_t nb, const void *xin,
                         int64_t x_stride, int x_bf16, int64_t k, const xwide *x, int64_t m,
                         int64_t n, void *y, int64_t ldy, int y_f32, const float *bias,
                         int num_threads) {
    const int64_t tiles = (n + WT * GR - 1) / (WT * GR), rows = (m + XT - 1) / XT * XT;
    _Pragma("omp parallel num_threads(num_threads)")
    {
    _Pragma("omp for schedule(static)")
    for (int64_t r = 0; r < rows; r++)
        quantize_row_wide(xin, x_stride, x_bf16, m, k, nb, x, r);
    for (int64_t m0 = 0; m0 < m; m0 += XB) {
        const int64_t m1 = m0 + XB < m ? m0 + XB : m;
        _Pragma("omp for schedule(static)")
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t r0 = m0; r0 < m1; r0 += XT) {
                const int mr = m1 - r0 < XT ? (int)(m1 - r0) : XT;
                switch (type) {      /* a constant type once inlined */
                case T_Q4_0: wide_tile_store(T_Q4_0, packed, t, nb, x, r0, mr, n, y, ldy, y_f32,
                                             bias); break;
                case T_Q4_1: wide_tile_store(T_Q4_1, packed, t, nb, x, r0, mr, n, y, ldy, y_f32,
                                             bias); break;
                case T_Q8_0: wide_tile_store(T_Q8_0, packed, t, nb, x, r0, mr, n, y, ldy, y_f32,
                                             bias); break;
                default: wide_tile_store(T_I8, packed, t, nb, x, r0, mr, n, y, ldy, y_f32, bias);
                }
            }
    }
    }
}

/* One W row's block into lane i of its (group, block) of the packed layout. */
static void pack_block(int type, const uint8_t *blk, float row_scale, int i, uint8_t *dst) {
    uint8_t *sc = dst + q_bytes(type);
    if (is_nibble(type)) {
        const uint8_t *qs = blk + (type == T_Q4_1 ? 4 : 2);
        for (int c = 0; c < 4; c++) memcpy(dst + (c * GR + i) * 4, qs + 4 * c, 4);
        memcpy(sc + 2 * i, blk, 2);
        if (type == T_Q4_1) memcpy(sc + 32 + 2 * i, blk + 2, 2);
    } else {
        const uint8_t *q = type == T_I8 ? blk : blk + 2;
        for (int c = 0; c < 8; c++)
            for (int j = 0; j < 4; j++) dst[(c * GR + i) * 4 + j] = q[4 * c + j] ^ 0x80;
        if (type == T_I8) memcpy(sc + 4 * i, &row_scale, 4);
        else memcpy(sc + 2 * i, blk, 2);
    }
}
#endif

/* Bytes quant_q8_pack writes for an [n, k] weight of `type`; 0 where this build has no wide
 * nest for it (neither AVX-512 VNNI nor AVX2 + F16C, or a type other than Q4_0, Q4_1, Q8_0,
 * I8). */
int64_t quant_q8_packed_bytes(int type, int64_t n, int64_t k) {
#if HAVE_WIDE
    if (type != T_Q4_0 && type != T_Q4_1 && type != T_Q8_0 && type != T_I8) return 0;
    const int64_t groups = (n + WT * GR - 1) / (WT * GR) * WT;
    return groups * ((k + QK - 1) / QK) * gb_bytes(type);
#else
    (void)type; (void)n; (void)k;
    return 0;
#endif
}

/* W (n rows of row_bytes, GGUF blocks; row_scale [n] for I8, else NULL) into `out`
 * (quant_q8_packed_bytes bytes; see the file comment). Returns 0, or -2 for a type the wide
 * nest does not take. */
int quant_q8_pack(int type, const uint8_t *w, int64_t row_bytes, const float *row_scale,
                  int64_t n, int64_t k, uint8_t *out) {
    const int64_t total = quant_q8_packed_bytes(type, n, k);
    if (!total) return -2;
#if HAVE_WIDE
    const int64_t nb = (k + QK - 1) / QK, gbb = gb_bytes(type);
    const int bytes = block_bytes(type);
    memset(out, 0, (size_t)total);
    for (int64_t row = 0; row < n; row++)
        for (int64_t b = 0; b < nb; b++)
            pack_block(type, w + row * row_bytes + b * bytes, row_scale ? row_scale[row] : 1.f,
                       (int)(row % GR), out + (row / GR * nb + b) * gbb);
#else
    (void)w; (void)row_bytes; (void)row_scale; (void)out;
#endif
    return 0;
}

/* y [m, n] = x [m, k] W^T (+ bias) through the packed W (see the file comment); x float32 or
 * bfloat16 (x_bf16), y float32 (y_f32) or bfloat16 with row stride ldy. Returns 0, -1 out of
 * memory, -2 where this build has no wide nest for the type. */
int quant_q8_wide(int type, const uint8_t *packed, const float *bias, const void *x,
                  int64_t x_stride, int x_bf16, void *y, int64_t ldy, int y_f32, int64_t m,
                  int64_t n, int64_t k, int num_threads) {
    if (!quant_q8_packed_bytes(type, n, k)) return -2;
#if HAVE_WIDE
    const int64_t nb = (k + QK - 1) / QK, rows = (m + XT - 1) / XT * XT;
    /* the calling thread's scratch: a prefill's copy is megabytes, kept out of the heap */
    float *buf = scratch(0, (size_t)(rows * nb) * (3 * sizeof(float) + QK));
    if (!buf) return -1;
    const xwide xq = {(int8_t *)(buf + 3 * rows * nb), buf, buf + rows * nb,
                      (int32_t *)(buf + 2 * rows * nb)};
    wide_product(type, packed, nb, x, x_stride, x_bf16, k, &xq, m, n, y, ldy, y_f32, bias,
                 num_threads);
    return 0;
#else
    (void)packed; (void)bias; (void)x; (void)x_stride; (void)x_bf16; (void)y; (void)ldy;
    (void)y_f32; (void)m; (void)num_threads;
    return -2;
#endif
}
