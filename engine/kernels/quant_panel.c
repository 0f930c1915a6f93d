/*
 * The M > MR nest of quant.c (prefill, large decode batches): a panel of NP W rows dequantized
 * once per call, block column by block column, and transposed to [kp][NP] float32 — or, for a
 * bfloat16 x on an AVX512-BF16 host, rounded to bfloat16 and laid out [kp / 2][NP][2] (pairs of
 * k, vdpbf16ps's operand) — then register tiles of up to ML rows of x by the NP columns: per k
 * one load of the panel's NP / VL vectors, one broadcast of x per row, and ML * NPV FMAs (Goto
 * and van de Geijn, "Anatomy of High-Performance Matrix Multiplication", ACM TOMS 2008: the
 * micro-kernel shape of gemm.c). Each weight is dequantized once per call, whatever M.
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
    /* the next panel's rows, spread over the first tile's k steps (prefetch_step) */
    const int64_t pf_step = prefetch_stride((n1 - n0) * row_bytes, kp / 2);
    float acc[ML * NP] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < m; r0 += ML) {
        const int mr = m - r0 < ML ? (int)(m - r0) : ML;
        if (r0 == 0)      /* the prefetching tile; the others compiled without the branch */
            TILE_ROWS(panel_tile_bf16, xb, kp, kp, panel, w + n1 * row_bytes, pf_step)
        else
            TILE_ROWS(panel_tile_bf16, xb + r0 * kp, kp, kp, panel, NULL, 0)
        store_tile(acc, mr, r0, n0, (int)(n1 - n0), y, ldy, y_f32, row_scale, bias);
    }
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
