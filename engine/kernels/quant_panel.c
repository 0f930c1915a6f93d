/*
 * The M > MR nest of quant.c (prefill, large decode batches): a panel of NP W rows dequantized
 * once per call, block column by block column, and transposed to [kp][NP] float32 — or, for a
 * bfloat16 x on an AVX512-BF16 host, rounded to bfloat16 and laid out [kp / 2][NP][2] (pairs of
 * k, vdpbf16ps's operand) — then register tiles of up to ML rows of x by the NP columns: per k
 * one load of the panel's NP / VL vectors, one broadcast of x per row, and ML * NPV FMAs (Goto
 * and van de Geijn, "Anatomy of High-Performance Matrix Multiplication", ACM TOMS 2008: the
 * micro-kernel shape of gemm.c). Each weight is dequantized once per call, whatever M.
 *
 * Repacked panels (AVX512-BF16 hosts; Q4_0, Q4_1, Q8_0, I8): quant_panel_pack, once at load,
 * writes a copy of W in which a bfloat16 x's panel is one vector conversion away, so that the
 * block-column dequantization and the [NP][qk] -> [qk / 2][NP] transposition above (a quarter of
 * a 16-row decode step between them, the blocks read 48 strided rows at a time) become one
 * contiguous stream. Layout: W rows in groups of PG = 16 (N padded with zero rows), group-major,
 * then block by block; one (group, block) is
 *   d [16] float16 (row r's block scale; 1.0 for I8, whose row scale stays row_scale),
 *   m [16] float16 (Q4_1 only: the block minimum),
 *   16 k pairs p: Q4_0 / Q4_1 16 bytes, byte j = row j / 2's value k (low nibble) and row
 *   8 + j / 2's (high nibble), k = 2p + j % 2; Q8_0 / I8 32 bytes, rows 0-7 then rows 8-15,
 *   byte j the same value as an int8.
 * Widened to 32-bit lanes the low nibbles (or first 16 bytes) are rows 0-7's (k, k + 1) pairs
 * and the high nibbles rows 8-15's, so after the scale (d, m permuted to lane pairs) one
 * vcvtne2ps2bf16 of the two halves is the panel's vector of 16 (k, k + 1) pairs. The same
 * arithmetic as the blocks' dequantization (d * q (+ m) in float32, rounded to nearest even):
 * the products equal the strided path's bit for bit. Bytes: the blocks' own (20 a Q4_1 block
 * of a row, 34 a Q8_0 block, 18 Q4_0; I8 34), a second copy kept beside them.
 */
#include "quant_blocks.h"

#if HAVE_AVX512      /* 8 x 48: 24 accumulators; same-run A/B against 12 x 32, the model's
                        linears at 12 / 16 / 64 rows: 11 / 11 / 5 % faster, 2048 rows equal */
#define NPV 3
#define ML 8
#elif HAVE_AVX2
#define NPV 2
#define ML 6
#else
#define NPV 4
#define ML 4
#endif
#define NP (NPV * VL)

/* Store a tile acc [mr][NP] (columns n0 .. n0 + ncols - 1 of y) for rows r0 .. r0 + mr - 1;
 * acc is overwritten. */
static void store_tile(float *acc, int mr, int64_t r0, int64_t n0, int ncols, void *y,
                       int64_t ldy, int y_f32, const float *row_scale, const float *bias) {
    for (int r = 0; r < mr; r++)
        store_row(acc + r * NP, ncols, y, ldy, y_f32, r0 + r, n0, row_scale, bias);
}

/* acc [mr][NP] = x [mr rows, stride kp] . panel [kp][NP]; mr a constant once inlined. */
INLINE void panel_tile(const float *x, int64_t kp, const float *panel, const uint8_t *pf,
                       int64_t pf_step, const int mr, float *acc) {
    V a[ML][NPV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NPV; v++) a[r][v] = vzero();
    for (int64_t k = 0; k < kp; k++) {
        if (pf) prefetch_step(pf, pf_step, k);          /* the next panel's W */
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

/* Rows r0 .. r0 + mr - 1 (mr <= ML) of a tile through FN in sub-tiles of constant height:
 * ML, then 8, 4, 2 and 1 for what is left (each a fully unrolled instance). */
#define TILE_ROWS(FN, X, XSTRIDE, ...)                                                        \
    for (int done = 0; done < mr;) {                                                          \
        const int left = mr - done;                                                           \
        const int h = left >= ML ? ML : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;   \
        if (h == ML) FN(X + done * XSTRIDE, __VA_ARGS__, ML, acc + done * NP);               \
        else if (h == 8) FN(X + done * XSTRIDE, __VA_ARGS__, ML > 8 ? 8 : 1, acc + done * NP); \
        else if (h == 4) FN(X + done * XSTRIDE, __VA_ARGS__, ML > 4 ? 4 : 1, acc + done * NP); \
        else if (h == 2) FN(X + done * XSTRIDE, __VA_ARGS__, 2, acc + done * NP);            \
        else FN(X + done * XSTRIDE, __VA_ARGS__, 1, acc + done * NP);                        \
        done += h;                                                                            \
    }

/* One panel of W rows [n0, n1) against all m rows of xf [m][kp]. */
static void panel_large_m(dq_rows_fn dq, const uint8_t *w, int64_t row_bytes, int64_t n0,
                          int64_t n1, int64_t nb, int qk, int bytes, const float *xf,
                          int64_t m, float *tmp, float *panel, void *y, int64_t ldy, int y_f32,
                          const float *row_scale, const float *bias) {
    const int64_t kp = nb * qk;
    pack_panel(dq, w, row_bytes, n0, n1, nb, qk, bytes, tmp, panel);
    /* the next panel's rows, spread over the first tile's k steps (prefetch_step) */
    const int64_t pf_step = prefetch_stride((n1 - n0) * row_bytes, kp);
    float acc[ML * NP] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < m; r0 += ML) {
        const int mr = m - r0 < ML ? (int)(m - r0) : ML;
        if (r0 == 0)      /* the prefetching tile; the others compiled without the branch */
            TILE_ROWS(panel_tile, xf, kp, kp, panel, w + n1 * row_bytes, pf_step)
        else
            TILE_ROWS(panel_tile, xf + r0 * kp, kp, kp, panel, NULL, 0)
        store_tile(acc, mr, r0, n0, (int)(n1 - n0), y, ldy, y_f32, row_scale, bias);
    }
}

#if HAVE_BF16_DOT
#define PG 16         /* W rows to a group of the repacked layout (see the file comment) */
#endif

#if HAVE_BF16_DOT
/* panel_tile in bfloat16 pairs with float32 accumulation (AVX512-BF16's vdpbf16ps: two k a
 * lane, twice the float32 FMA's products): x [mr rows, stride kp] bfloat16, panel
 * [kp / 2][NP][2] bfloat16. */
INLINE void panel_tile_bf16(const uint16_t *x, int64_t kp, const uint16_t *panel,
                            const uint8_t *pf, int64_t pf_step, const int mr, float *acc) {
    __m512 a[ML][NPV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NPV; v++) a[r][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kp; k += 2) {
        if (pf) prefetch_step(pf, pf_step, k / 2);      /* the next panel's W */
        __m512bh wv[NPV];
        for (int v = 0; v < NPV; v++)
            wv[v] = (__m512bh)_mm512_loadu_si512(panel + k * NP + v * 32);
        for (int r = 0; r < mr; r++) {
            int32_t pair;
            memcpy(&pair, x + r * kp + k, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);     /* an embedded {1to16} */
            for (int v = 0; v < NPV; v++) a[r][v] = _mm512_dpbf16_ps(a[r][v], wv[v], xv);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NPV; v++) _mm512_storeu_ps(acc + r * NP + v * 16, a[r][v]);
}

/* y rows 0 .. m - 1, columns [n0, n1) = xb [m][kp] . a filled bfloat16 panel [kp / 2][NP][2],
 * in tiles of ML rows; the first tile asks for the next panel's pf_bytes at pf, spread over its
 * k steps (prefetch_step; pf NULL or pf_bytes 0: none). */
static void panel_tiles_bf16(const uint16_t *xb, int64_t m, int64_t kp, const uint16_t *panel,
                             const uint8_t *pf, int64_t pf_bytes, int64_t n0, int64_t n1,
                             void *y, int64_t ldy, int y_f32, const float *row_scale,
                             const float *bias) {
    const int64_t pf_step = prefetch_stride(pf_bytes, kp / 2);
    float acc[ML * NP] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < m; r0 += ML) {
        const int mr = m - r0 < ML ? (int)(m - r0) : ML;
        if (r0 == 0 && pf && pf_bytes > 0)   /* the prefetching tile; the others compiled */
            TILE_ROWS(panel_tile_bf16, xb, kp, kp, panel, pf, pf_step)   /* without it */
        else
            TILE_ROWS(panel_tile_bf16, xb + r0 * kp, kp, kp, panel, NULL, 0)
        store_tile(acc, mr, r0, n0, (int)(n1 - n0), y, ldy, y_f32, row_scale, bias);
    }
}

/* panel_large_m for a bfloat16 x: the panel rounded to bfloat16 (nearest even, as the
 * bfloat16 model's weights are), in k pairs. */
static void panel_large_m_bf16(dq_rows_fn dq, dqb_rows_fn dqb, const uint8_t *w,
                               int64_t row_bytes, int64_t n0, int64_t n1, int64_t nb, int qk,
                               int bytes, const uint16_t *xb, int64_t m, float *tmp,
                               uint16_t *panel, void *y, int64_t ldy, int y_f32,
                               const float *row_scale, const float *bias) {
    const int64_t kp = nb * qk;
    const int nr = (int)(n1 - n0);
    uint16_t *half = (uint16_t *)(tmp + NP * qk);        /* tmp rounded: [NP][qk] bfloat16 */
    memset(half + nr * qk, 0, 2 * (size_t)((NP - nr) * qk));
    for (int64_t b = 0; b < nb; b++) {
        if (dqb) {                                /* 32-value blocks: straight to bfloat16 */
            dqb(w + b * bytes, row_bytes, n0, n1, half);
        } else {
            dq(w + b * bytes, row_bytes, n0, n1, 1, tmp, qk);
            for (int i = 0; i < nr * qk; i += 32)  /* round to nearest even, 32 at a time */
                _mm512_storeu_si512(half + i, (__m512i)_mm512_cvtne2ps_pbh(
                    _mm512_loadu_ps(tmp + i + 16), _mm512_loadu_ps(tmp + i)));
        }
        /* a pair of bfloat16 (k, k + 1) is one 32-bit unit: [NP][qk / 2] -> [qk / 2][NP] */
        transpose_panel((const float *)half, qk / 2, qk / 2, (float *)(panel + b * qk * NP));
    }
    panel_tiles_bf16(xb, m, kp, panel, w + n1 * row_bytes, (n1 - n0) * row_bytes, n0, n1, y,
                     ldy, y_f32, row_scale, bias);
}
#endif


int quant_panel_rows(void) { return NP; }

/* A block column of the panel (float32 and its bfloat16 rounding) and the panel itself. */
size_t quant_panel_scratch(int64_t kp, int qk) { return (size_t)(2 * NP * qk + kp * NP); }

void quant_panel(dq_rows_fn dq, dqb_rows_fn dqb, int bf16, const uint8_t *w,
                 int64_t row_bytes, int64_t n0, int64_t n1, int64_t nb, int qk, int bytes,
                 const void *xc, int64_t m, float *tmp, void *y, int64_t ldy, int y_f32,
                 const float *row_scale, const float *bias) {
    float *panel = tmp + 2 * NP * qk;
#if HAVE_BF16_DOT
    if (bf16) {
        panel_large_m_bf16(dq, dqb, w, row_bytes, n0, n1, nb, qk, bytes, xc, m, tmp,
                           (uint16_t *)panel, y, ldy, y_f32, row_scale, bias);
        return;
    }
#endif
    (void)bf16, (void)dqb;
    panel_large_m(dq, w, row_bytes, n0, n1, nb, qk, bytes, xc, m, tmp, panel, y, ldy, y_f32,
                  row_scale, bias);
}

#if HAVE_BF16_DOT
/* Bytes of one (group, block) of the repacked layout; 0 for a type without it. */
static int64_t group_bytes(int type) {
    switch (type) {
    case T_Q4_0: return 32 + 256;
    case T_Q4_1: return 64 + 256;
    case T_Q8_0: case T_I8: return 32 + 512;
    default: return 0;
    }
}

/* Value i (0-31) of the block at blk, as its integer code (Q4_0 unbiased by the kernel). */
static int block_code(int type, const uint8_t *blk, int i) {
    if (type == T_Q8_0) return (int8_t)blk[2 + i];
    if (type == T_I8) return (int8_t)blk[i];
    const uint8_t *qs = blk + (type == T_Q4_1 ? 4 : 2);
    return i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
}

/* One (group, block) of the repacked layout from rows r0 .. r0 + 15 (those < n) of W. */
static void pack_group_block(int type, const uint8_t *w, int64_t row_bytes, int64_t n,
                             int64_t r0, int64_t b, uint8_t *o) {
    const int bytes = block_bytes(type), nibbles = is_nibble(type);
    const int pad = type == T_Q4_0 ? 8 : 0;             /* a zero row's code */
    memset(o, 0, (size_t)group_bytes(type));
    const uint8_t *blk[PG];
    for (int r = 0; r < PG; r++) {
        blk[r] = r0 + r < n ? w + (r0 + r) * row_bytes + b * bytes : NULL;
        if (!blk[r]) continue;
        if (type == T_I8) { const uint16_t one = 0x3c00; memcpy(o + 2 * r, &one, 2); }
        else memcpy(o + 2 * r, blk[r], 2);                        /* d */
        if (type == T_Q4_1) memcpy(o + 32 + 2 * r, blk[r] + 2, 2); /* m */
    }
    uint8_t *q = o + (type == T_Q4_1 ? 64 : 32);
    for (int p = 0; p < QK / 2; p++)
        for (int j = 0; j < 16; j++) {
            const int k = 2 * p + (j & 1), lo = j / 2, hi = 8 + j / 2;
            const int a = blk[lo] ? block_code(type, blk[lo], k) : pad;
            const int c = blk[hi] ? block_code(type, blk[hi], k) : pad;
            if (nibbles) q[16 * p + j] = (uint8_t)(a | c << 4);
            else q[32 * p + j] = (uint8_t)a, q[32 * p + 16 + j] = (uint8_t)c;
        }
}

/* The panel [kp / 2][NP][2] bfloat16 of groups g0 .. g0 + NP / PG - 1 (zero past ngroups) of the
 * repacked W pk (nb blocks a row). */
static void fill_panel(int type, const uint8_t *pk, int64_t nb, int64_t g0, int64_t ngroups,
                       uint16_t *panel) {
    const int64_t gb = group_bytes(type);
    const __m512i pair_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i pair_hi = _mm512_add_epi32(pair_lo, _mm512_set1_epi32(8));
    const __m512i low4 = _mm512_set1_epi32(15);
    const int q41 = type == T_Q4_1, nibbles = is_nibble(type);
    const V bias = vset1(type == T_Q4_0 ? -8.f : 0.f);
    for (int gi = 0; gi < NP / PG; gi++) {
        uint16_t *dst = panel + 2 * gi * PG;
        if (g0 + gi >= ngroups) {
            for (int64_t p = 0; p < nb * QK / 2; p++)
                _mm512_storeu_si512(dst + 2 * p * NP, _mm512_setzero_si512());
            continue;
        }
        const uint8_t *src = pk + (g0 + gi) * nb * gb;
        for (int64_t b = 0; b < nb; b++, src += gb, dst += QK * NP) {
            const V d = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)src));
            const V dl = _mm512_permutexvar_ps(pair_lo, d), dh = _mm512_permutexvar_ps(pair_hi, d);
            if (!nibbles) {
                for (int p = 0; p < QK / 2; p++) {
                    const uint8_t *q = src + 32 + 32 * p;
                    const V l = vmul(dl, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                        _mm_loadu_si128((const void *)q))));
                    const V h = vmul(dh, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                        _mm_loadu_si128((const void *)(q + 16)))));
                    _mm512_storeu_si512(dst + 2 * p * NP, (__m512i)_mm512_cvtne2ps_pbh(h, l));
                }
                continue;
            }
            const V m = q41 ? _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(src + 32)))
                            : vzero();
            const V ml = _mm512_permutexvar_ps(pair_lo, m), mh = _mm512_permutexvar_ps(pair_hi, m);
            const uint8_t *q = src + (q41 ? 64 : 32);
            for (int p = 0; p < QK / 2; p++) {
                const __m512i by = _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(q + 16 * p)));
                const V cl = vadd(_mm512_cvtepi32_ps(_mm512_and_si512(by, low4)), bias);
                const V ch = vadd(_mm512_cvtepi32_ps(_mm512_srli_epi32(by, 4)), bias);
                /* as lut_q4_0 / lut_q4_1: d * q, then + m (the same contraction) */
                const V l = q41 ? vadd(vmul(dl, cl), ml) : vmul(dl, cl);
                const V h = q41 ? vadd(vmul(dh, ch), mh) : vmul(dh, ch);
                _mm512_storeu_si512(dst + 2 * p * NP, (__m512i)_mm512_cvtne2ps_pbh(h, l));
            }
        }
    }
}
#endif

/* Bytes quant_panel_pack writes for an [n, k] weight of `type`; 0 where this build has no
 * repacked panels (no AVX512-BF16) or the type has none (K-quants). */
int64_t quant_panel_packed_bytes(int type, int64_t n, int64_t k) {
#if HAVE_BF16_DOT
    return (n + PG - 1) / PG * ((k + QK - 1) / QK) * group_bytes(type);
#else
    (void)type, (void)n, (void)k;
    return 0;
#endif
}

/* W [n, k] of `type` (rows of row_bytes) repacked into out (quant_panel_packed_bytes bytes; see
 * the file comment). Returns 0, or -2 where quant_panel_packed_bytes is 0. */
int quant_panel_pack(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                     uint8_t *out) {
    if (!quant_panel_packed_bytes(type, n, k)) return -2;
#if !HAVE_BF16_DOT
    (void)w, (void)row_bytes, (void)out;
#else
    const int64_t nb = (k + QK - 1) / QK, gb = group_bytes(type);
    for (int64_t g = 0; g * PG < n; g++)
        for (int64_t b = 0; b < nb; b++)
            pack_group_block(type, w, row_bytes, n, g * PG, b, out + (g * nb + b) * gb);
#endif
    return 0;
}

#if HAVE_BF16_DOT
/* quant_panel's bfloat16 nest over the repacked W pk: W rows [n0, n1) (n0 a multiple of NP) of
 * n, against all m rows of xb [m][kp]. */
void quant_panel_repacked(int type, const uint8_t *pk, int64_t n, int64_t n0, int64_t n1,
                          int64_t nb, const uint16_t *xb, int64_t m, float *tmp, void *y,
                          int64_t ldy, int y_f32, const float *row_scale, const float *bias) {
    uint16_t *panel = (uint16_t *)(tmp + 2 * NP * QK);
    const int64_t kp = nb * QK, ngroups = (n + PG - 1) / PG, gb = group_bytes(type);
    fill_panel(type, pk, nb, n0 / PG, ngroups, panel);
    /* the next panel's groups (without their prefetch a 16-row decode step ran 15.4-16.0 ms
     * against 12.3-12.6, EPYC) */
    const int64_t next = n1 / PG, left = ngroups - next;
    panel_tiles_bf16(xb, m, kp, panel, pk + next * nb * gb,
                     (left < NP / PG ? left : NP / PG) * nb * gb, n0, n1, y, ldy, y_f32,
                     row_scale, bias);
}
#endif
