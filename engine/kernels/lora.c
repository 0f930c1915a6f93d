/*
 * Multi-LoRA delta of one fused projection for a whole step, in one call (engine/lora/slots.py):
 * for every row r whose adapter slot s = row_slot[r] is >= 0 and holds weights for this
 * projection (present[s]),
 *     t = A[s] @ x[r]                      (shrink: R dot products of length `in`)
 *     out[r, c0:c1] += t[r0:r1] @ Bt[s, r0:r1, c0:c1]   for each band (r0, r1, c0, c1)
 * A [slots, R, in] and Bt [slots, R, out] are float32 (B transposed, its LoRA scaling folded in);
 * x and out are the step's rows (float32, or bfloat16 stored as uint16), row strides in elements.
 * A band is one module of a fused projection (q, k, v of qkv; gate, up of gate_up): its rank
 * rows and its own output columns, so the block-diagonal zeros of the stacked B are never read.
 *
 * The segmented gather matrix-vector product of punica (Chen et al., "Punica: Multi-Tenant LoRA
 * Serving", arXiv:2310.18547; vLLM's punica_cpu does it in torch), tiled: the rows are grouped
 * by slot (a counting sort) into tiles of up to LORA_RB rows of one slot, so each row of A and
 * of Bt is read once per tile rather than once per row (the weights, not the rows, are the
 * traffic). Tiles are split over OpenMP threads; each row's delta is summed in float32 and added
 * to `out` once (a bfloat16 element is rounded once, to nearest even).
 */
#include "common.h"

#define LORA_RB 16         /* rows per tile */
#define LORA_CB 256        /* output columns per expand task */

/* tt[i * R + j] = A_j . x_i for the tile's m rows (x rows xt[i * in], float32), NR >= m rows
 * computed (rows m..NR-1 of xt are zero): the row of A is loaded once per vector and feeds NR
 * independent accumulators (one dependency chain per row keeps the FMA units busy). */
#if HAVE_AVX512
#define DEFINE_SHRINK(NR)                                                                    \
INLINE void lora_shrink_##NR(const float *As, int R, int j0, int j1, int in,               \
                             const float *xt, int m, float *tt) {                            \
    const __mmask16 tail = (__mmask16)((1u << (in % 16)) - 1u);                              \
    for (int j = j0; j < j1; j++) {                                                          \
        const float *a = As + (int64_t)j * in;                                               \
        __m512 acc[NR];                                                                      \
        for (int i = 0; i < NR; i++) acc[i] = _mm512_setzero_ps();                           \
        int k = 0;                                                                           \
        for (; k + 16 <= in; k += 16) {                                                      \
            const __m512 av = _mm512_loadu_ps(a + k);                                        \
            for (int i = 0; i < NR; i++)                                                     \
                acc[i] = _mm512_fmadd_ps(av, _mm512_loadu_ps(xt + i * in + k), acc[i]);      \
        }                                                                                    \
        if (k < in) {                                                                        \
            const __m512 av = _mm512_maskz_loadu_ps(tail, a + k);                            \
            for (int i = 0; i < NR; i++)                                                     \
                acc[i] = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(tail, xt + i * in + k),   \
                                         acc[i]);                                            \
        }                                                                                    \
        for (int i = 0; i < m; i++) tt[i * R + j] = _mm512_reduce_add_ps(acc[i]);            \
    }                                                                                        \
}
DEFINE_SHRINK(1)
DEFINE_SHRINK(4)
DEFINE_SHRINK(8)
DEFINE_SHRINK(16)
#endif

/* The rank rows [j0, j1) of tt for the tile's m rows (xt: its rows, float32, zero past m up to
 * the NR chosen). */
INLINE void lora_shrink(const float *As, int R, int j0, int j1, int in, const float *xt, int m,
                        float *tt) {
#if HAVE_AVX512
    if (m == 1) lora_shrink_1(As, R, j0, j1, in, xt, m, tt);
    else if (m <= 4) lora_shrink_4(As, R, j0, j1, in, xt, m, tt);
    else if (m <= 8) lora_shrink_8(As, R, j0, j1, in, xt, m, tt);
    else lora_shrink_16(As, R, j0, j1, in, xt, m, tt);
#else
    for (int j = j0; j < j1; j++) {
        const float *a = As + (int64_t)j * in;
        for (int i = 0; i < m; i++) {
            const float *xi = xt + i * in;
            float d = 0.f;
#pragma omp simd reduction(+:d)
            for (int k = 0; k < in; k++) d += a[k] * xi[k];
            tt[i * R + j] = d;
        }
    }
#endif
}

/* acc[i * LORA_CB + c] = sum over live rank rows j in [r0, r1) of tt[i * R + j] * B[j][c]
 * for c < cn (B rows `out_cols` apart), 16 columns at a time with the tile's rows' sums in
 * registers (NR >= m accumulators: one load of B feeds NR FMAs); the chunk of B it walks is
 * (r1 - r0) x cn floats, L1-sized. */
#if HAVE_AVX512
#define DEFINE_EXPAND(NR)                                                                    \
INLINE void lora_expand_##NR(const float *B, int out_cols, int r0, int r1, int cn,           \
                             const float *tt, int R, int m, const uint8_t *live,             \
                             float *acc) {                                                   \
    for (int c = 0; c < cn; c += 16) {                                                       \
        const int w = cn - c < 16 ? cn - c : 16;                                             \
        const __mmask16 mask = (__mmask16)(w == 16 ? 0xffffu : (1u << w) - 1u);              \
        __m512 v[NR];                                                                        \
        for (int i = 0; i < NR; i++) v[i] = _mm512_setzero_ps();                             \
        for (int j = r0; j < r1; j++) {                                                      \
            if (!live[j]) continue;                                                          \
            const __m512 b = _mm512_maskz_loadu_ps(mask, B + (int64_t)j * out_cols + c);     \
            for (int i = 0; i < NR; i++)                                                     \
                v[i] = _mm512_fmadd_ps(_mm512_set1_ps(tt[i * R + j]), b, v[i]);              \
        }                                                                                    \
        for (int i = 0; i < m; i++) _mm512_storeu_ps(acc + i * LORA_CB + c, v[i]);           \
    }                                                                                        \
}
DEFINE_EXPAND(1)
DEFINE_EXPAND(4)
DEFINE_EXPAND(8)
DEFINE_EXPAND(16)
#endif

INLINE void lora_expand(const float *B, int out_cols, int r0, int r1, int cn, const float *tt,
                        int R, int m, const uint8_t *live, float *acc) {
#if HAVE_AVX512
    if (m == 1) lora_expand_1(B, out_cols, r0, r1, cn, tt, R, m, live, acc);
    else if (m <= 4) lora_expand_4(B, out_cols, r0, r1, cn, tt, R, m, live, acc);
    else if (m <= 8) lora_expand_8(B, out_cols, r0, r1, cn, tt, R, m, live, acc);
    else lora_expand_16(B, out_cols, r0, r1, cn, tt, R, m, live, acc);
#else
    for (int i = 0; i < m; i++) memset(acc + i * LORA_CB, 0, sizeof(float) * cn);
    for (int j = r0; j < r1; j++) {
        if (!live[j]) continue;
        const float *bj = B + (int64_t)j * out_cols;
        for (int i = 0; i < m; i++) {
            const float tij = tt[i * R + j];
            float *ai = acc + i * LORA_CB;
#pragma omp simd
            for (int c = 0; c < cn; c++) ai[c] += tij * bj[c];
        }
    }
#endif
}

#define LORA_JB 16         /* rank rows per shrink task */

#define DEFINE_LORA(SUFFIX, T)                                                               \
void lora_sgmv_##SUFFIX(const T *x, int64_t x_stride, T *out, int64_t out_stride, int n,     \
                        const int32_t *row_slot, const int32_t *present, int n_slots,        \
                        const float *A, const float *Bt, int in, int out_cols, int R,        \
                        int n_bands, const int32_t *bands, int num_threads) {                \
    if (n <= 0) return;                                                                      \
    int order[n], tile_first[n], tile_len[n];                                                \
    int count[n_slots + 1], start[n_slots + 1];                                              \
    for (int s = 0; s <= n_slots; s++) count[s] = 0;                                         \
    for (int r = 0; r < n; r++) {                                                            \
        const int s = row_slot[r];                                                           \
        if (s >= 0 && s < n_slots && present[s]) count[s]++;                                 \
    }                                                                                        \
    int ntiles = 0, nrow = 0;                                                                \
    for (int s = 0; s < n_slots; s++) {                                                      \
        start[s] = nrow;                                                                     \
        for (int k = 0; k < count[s]; k += LORA_RB) {                                        \
            tile_first[ntiles] = nrow + k;                                                   \
            tile_len[ntiles++] = count[s] - k < LORA_RB ? count[s] - k : LORA_RB;            \
        }                                                                                    \
        nrow += count[s];                                                                    \
    }                                                                                        \
    if (!ntiles) return;                                                                     \
    for (int r = 0; r < n; r++) {                                                            \
        const int s = row_slot[r];                                                           \
        if (s >= 0 && s < n_slots && present[s]) order[start[s]++] = r;                      \
    }                                                                                        \
    /* rows in tile order as float32 (a tile padded with zero rows up to LORA_RB), then    \
     * their shrunk ranks tt [row][R] */                                                     \
    const size_t padded = (size_t)(ntiles + 1) * LORA_RB;                                    \
    float *xt = scratch(1, sizeof(float) * padded * ((size_t)in + R));                       \
    if (!xt) return;                                                                         \
    float *tt = xt + padded * in;                                                            \
    int nchunk = 0;                                                                          \
    for (int b = 0; b < n_bands; b++)                                                        \
        nchunk += (bands[4 * b + 3] - bands[4 * b + 2] + LORA_CB - 1) / LORA_CB;             \
    const int njb = (R + LORA_JB - 1) / LORA_JB;                                             \
    _Pragma("omp parallel num_threads(num_threads) if(nrow * R * in >= 65536)")             \
    {                                                                                        \
        _Pragma("omp for schedule(static)")                                                  \
        for (int q = 0; q < ntiles * LORA_RB; q++) {                                         \
            const int tile = q / LORA_RB, i = q % LORA_RB;                                   \
            float *dst = xt + ((size_t)tile * LORA_RB + i) * in;                             \
            if (i >= tile_len[tile]) { memset(dst, 0, sizeof(float) * in); continue; }      \
            const T *xs = x + (int64_t)order[tile_first[tile] + i] * x_stride;               \
            for (int k = 0; k < in; k++) dst[k] = load_##SUFFIX(xs[k]);                      \
        }                                                                                    \
        _Pragma("omp for schedule(static)")                                                  \
        for (int task = 0; task < ntiles * njb; task++) {                                    \
            const int tile = task / njb, jb = task % njb;                                    \
            const int s = row_slot[order[tile_first[tile]]];                                 \
            const int j1 = (jb + 1) * LORA_JB < R ? (jb + 1) * LORA_JB : R;                  \
            lora_shrink(A + (int64_t)s * R * in, R, jb * LORA_JB, j1, in,                    \
                        xt + (size_t)tile * LORA_RB * in, tile_len[tile],                    \
                        tt + (size_t)tile * LORA_RB * R);                                    \
        }                                                                                    \
        _Pragma("omp for schedule(dynamic, 1)")                                              \
        for (int task = 0; task < ntiles * nchunk; task++) {                                 \
            const int tile = task / nchunk;                                                  \
            int chunk = task % nchunk, b = 0;                                                \
            for (;; b++) {                                                                   \
                const int k = (bands[4 * b + 3] - bands[4 * b + 2] + LORA_CB - 1) / LORA_CB;  \
                if (chunk < k) break;                                                        \
                chunk -= k;                                                                  \
            }                                                                                \
            const int r0 = bands[4 * b], r1 = bands[4 * b + 1];                              \
            const int cs = bands[4 * b + 2] + chunk * LORA_CB, c1 = bands[4 * b + 3];        \
            const int cn = c1 - cs < LORA_CB ? c1 - cs : LORA_CB;                            \
            const int m = tile_len[tile], *rows = order + tile_first[tile];                  \
            const float *ttt = tt + (size_t)tile * LORA_RB * R;                              \
            float *acc = scratch(0, sizeof(float) * LORA_RB * LORA_CB + R);                  \
            if (!acc) continue;                                                              \
            uint8_t *live = (uint8_t *)(acc + LORA_RB * LORA_CB);                            \
            for (int j = r0; j < r1; j++) {     /* a zero-padded rank row: skipped */        \
                live[j] = 0;                                                                 \
                for (int i = 0; i < m; i++) live[j] |= ttt[i * R + j] != 0.f;                \
            }                                                                                \
            lora_expand(Bt + (int64_t)row_slot[rows[0]] * R * out_cols + cs, out_cols, r0,  \
                        r1, cn, ttt, R, m, live, acc);                                       \
            for (int i = 0; i < m; i++) {                                                    \
                T *o = out + (int64_t)rows[i] * out_stride + cs;                             \
                const float *ai = acc + i * LORA_CB;                                         \
                _Pragma("omp simd")                                                          \
                for (int c = 0; c < cn; c++)                                                 \
                    o[c] = store_##SUFFIX(load_##SUFFIX(o[c]) + ai[c]);                      \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
}

DEFINE_LORA(f32, float)
DEFINE_LORA(bf16, uint16_t)
