/*
 * Multi-LoRA delta of one fused projection for a whole step, in one call (engine/lora/slots.py):
 * for every row r whose adapter slot s = row_slot[r] is >= 0 and holds weights for this
 * projection (present[s]),
 *     t = A[s] @ x[r]                      (shrink: R dot products of length `in`)
 *     out[r, c0:c1] += t[r0:r1] @ Bt[s, r0:r1, c0:c1]   for each band (r0, r1, c0, c1)
 * A [slots, R, in] and Bt [slots, R, out] (B transposed, its LoRA scaling folded in), x and out
 * (the step's rows, row strides in elements) are all of the suffix's type: float32, or bfloat16
 * stored as uint16 (the weights then take half the bytes; every sum is float32). A band is one
 * module of a fused projection (q, k, v of qkv; gate, up of gate_up): its rank rows and its own
 * output columns, so the block-diagonal zeros of the stacked B are never read.
 *
 * The segmented gather matrix-vector product of punica (Chen et al., "Punica: Multi-Tenant LoRA
 * Serving", arXiv:2310.18547; vLLM's punica_cpu does it in torch), tiled: rows are grouped by
 * slot (a counting sort) into tiles of up to LORA_RB rows of one slot, so each row of A and of
 * Bt is read once per tile rather than once per row. The shrink keeps one accumulator chain per
 * row of the tile in registers; the expand works in 16-column strips with the tile's sums in
 * registers. Shrink tasks (tile x 16 rank rows) and expand tasks (tile x 256 columns) are split
 * over OpenMP threads; each row's delta is added to `out` once (a bfloat16 element is rounded
 * once, to nearest even).
 *
 * bfloat16 on AMX hosts: a full tile of 16 rows runs both products on AMX tiles (lora_amx.c).
 * bfloat16 on AVX512-BF16 hosts: both products run as vdpbf16ps (two bfloat16 products summed
 * into a float32 lane per instruction, so half the instructions and no widening of the
 * weights). The tile's rows are staged in bfloat16 as they are; the shrunk ranks, summed in
 * float32, are rounded to bfloat16 before the expand, as vLLM's punica kernels do (they cast the
 * shrink's float32 output to the LoRA weights' dtype).
 */
#include "common.h"

#define LORA_RB 16         /* rows per tile */
#define LORA_CB 256        /* output columns per expand task */
#define LORA_JB 8          /* rank rows per shrink task */

#if HAVE_AVX512 && defined(__AVX512BF16__)
#define LORA_DOT 1         /* the bfloat16 kernels use vdpbf16ps */
#else
#define LORA_DOT 0
#endif
/* What the tile's rows are staged as: float32, or bfloat16 as they are for vdpbf16ps. */
#define XT_f32 float
#if LORA_DOT
#define XT_bf16 uint16_t
INLINE uint16_t stage_bf16(uint16_t v) { return v; }
#else
#define XT_bf16 float
INLINE float stage_bf16(uint16_t v) { return load_bf16(v); }
#endif
INLINE float stage_f32(float v) { return v; }

#if HAVE_AVX512
/* 16 weights as float32: all of them, or the first `mask` lanes (others zero). */
INLINE __m512 w16_f32(const float *p) { return _mm512_loadu_ps(p); }
INLINE __m512 w16m_f32(__mmask16 m, const float *p) { return _mm512_maskz_loadu_ps(m, p); }
INLINE __m512 w16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
INLINE __m512 w16m_bf16(__mmask16 m, const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* tt[i * R + j] = A_j . x_i for rank rows [j0, j1) and the tile's rows (xt [NR][in] float32,
 * zero past the tile's m rows): a row of A is loaded once per vector and feeds NR independent
 * accumulators. */
#define DEFINE_SHRINK(NR, SUFFIX, W)                                                         \
static __attribute__((noinline)) void shrink_##NR##_##SUFFIX(const W *As, int R, int j0,      \
                                                             int j1, int in, const float *xt, \
                                                             float *tt) {                     \
    const __mmask16 tail = (__mmask16)((1u << (in % 16)) - 1u);                              \
    for (int j = j0; j < j1; j++) {                                                          \
        const W *a = As + (int64_t)j * in;                                                   \
        __m512 acc[NR];                                                                      \
        _Pragma("GCC unroll 16")                                                             \
        for (int i = 0; i < NR; i++) acc[i] = _mm512_setzero_ps();                           \
        int k = 0;                                                                           \
        for (; k + 16 <= in; k += 16) {                                                      \
            const __m512 av = w16_##SUFFIX(a + k);                                           \
            _Pragma("GCC unroll 16")                                                         \
            for (int i = 0; i < NR; i++)                                                     \
                acc[i] = _mm512_fmadd_ps(av, _mm512_loadu_ps(xt + i * in + k), acc[i]);      \
        }                                                                                    \
        if (k < in) {                                                                        \
            const __m512 av = w16m_##SUFFIX(tail, a + k);                                    \
            _Pragma("GCC unroll 16")                                                         \
            for (int i = 0; i < NR; i++)                                                     \
                acc[i] = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(tail, xt + i * in + k),   \
                                         acc[i]);                                            \
        }                                                                                    \
        _Pragma("GCC unroll 16")                                                             \
        for (int i = 0; i < NR; i++) tt[i * R + j] = _mm512_reduce_add_ps(acc[i]);           \
    }                                                                                        \
}

/* acc[i * LORA_CB + c] = sum over live rank rows j in [r0, r1) of tt[i * R + j] * B[j][c] for
 * c < cn (B rows `out_cols` apart), 16 columns at a time, NR row sums in registers. */
#define DEFINE_EXPAND(NR, SUFFIX, W)                                                         \
static __attribute__((noinline)) void expand_##NR##_##SUFFIX(const W *B, int out_cols, int r0, \
                                                             int r1, int cn, const float *tt, \
                                                             int R, const uint8_t *live,      \
                                                             float *acc) {                    \
    float tl[(r1 - r0) * NR];             /* tt's band, rank-major: constant offsets */      \
    for (int j = r0; j < r1; j++)                                                            \
        for (int i = 0; i < NR; i++) tl[(j - r0) * NR + i] = tt[i * R + j];                  \
    for (int c = 0; c < cn; c += 16) {                                                       \
        const int w = cn - c < 16 ? cn - c : 16;                                             \
        const __mmask16 mask = (__mmask16)(w == 16 ? 0xffffu : (1u << w) - 1u);              \
        __m512 v[NR];                                                                        \
        _Pragma("GCC unroll 16")                                                             \
        for (int i = 0; i < NR; i++) v[i] = _mm512_setzero_ps();                             \
        for (int j = r0; j < r1; j++) {                                                      \
            if (!live[j]) continue;                                                          \
            const __m512 b = w16m_##SUFFIX(mask, B + (int64_t)j * out_cols + c);             \
            const float *t = tl + (j - r0) * NR;                                             \
            _Pragma("GCC unroll 16")                                                         \
            for (int i = 0; i < NR; i++)                                                     \
                v[i] = _mm512_fmadd_ps(_mm512_set1_ps(t[i]), b, v[i]);                       \
        }                                                                                    \
        _Pragma("GCC unroll 16")                                                             \
        for (int i = 0; i < NR; i++) _mm512_storeu_ps(acc + i * LORA_CB + c, v[i]);          \
    }                                                                                        \
}

#if LORA_DOT
/* tt[i * R + j] = A_j . x_i as vdpbf16ps pairs (xt [NR][in] bfloat16, zero past m rows). */
#define DEFINE_SHRINK_DOT(NR)                                                                \
static __attribute__((noinline)) void shrink_##NR##_bf16(const uint16_t *As, int R, int j0,   \
                                                         int j1, int in, const uint16_t *xt, \
                                                         float *tt) {                        \
    const __mmask32 tail = (__mmask32)((1ull << (in % 32)) - 1u);                            \
    for (int j = j0; j < j1; j++) {                                                          \
        const uint16_t *a = As + (int64_t)j * in;                                            \
        __m512 acc[NR];                                                                      \
        _Pragma("GCC unroll 16")                                                             \
        for (int i = 0; i < NR; i++) acc[i] = _mm512_setzero_ps();                           \
        int k = 0;                                                                           \
        for (; k + 32 <= in; k += 32) {                                                      \
            const __m512bh av = (__m512bh)_mm512_loadu_si512(a + k);                         \
            _Pragma("GCC unroll 16")                                                         \
            for (int i = 0; i < NR; i++)                                                     \
                acc[i] = _mm512_dpbf16_ps(acc[i], av,                                        \
                                          (__m512bh)_mm512_loadu_si512(xt + i * in + k));    \
        }                                                                                    \
        if (k < in) {                                                                        \
            const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(tail, a + k);             \
            _Pragma("GCC unroll 16")                                                         \
            for (int i = 0; i < NR; i++)                                                     \
                acc[i] = _mm512_dpbf16_ps(acc[i], av, (__m512bh)_mm512_maskz_loadu_epi16(    \
                                                          tail, xt + i * in + k));           \
        }                                                                                    \
        _Pragma("GCC unroll 16")                                                             \
        for (int i = 0; i < NR; i++) tt[i * R + j] = _mm512_reduce_add_ps(acc[i]);           \
    }                                                                                        \
}

/* The expand as vdpbf16ps over pairs of rank rows (j, j + 1): the tile's sums rounded to
 * bfloat16 pairs, B's two rows interleaved into 16 column pairs per vector. */
#define DEFINE_EXPAND_DOT(NR)                                                                \
static __attribute__((noinline)) void expand_##NR##_bf16(const uint16_t *B, int out_cols,     \
                                                         int r0, int r1, int cn,             \
                                                         const float *tt, int R,             \
                                                         const uint8_t *live, float *acc) {  \
    const int np = (r1 - r0 + 1) / 2;                                                        \
    uint32_t tp[np * NR];                 /* (t[j], t[j + 1]) per pair and row */            \
    uint8_t lp[np];                                                                          \
    for (int p = 0; p < np; p++) {                                                           \
        const int j = r0 + 2 * p, j2 = j + 1 < r1;                                           \
        lp[p] = live[j] | (j2 && live[j + 1]);                                               \
        for (int i = 0; i < NR; i++)                                                         \
            tp[p * NR + i] = store_bf16(tt[i * R + j])                                       \
                | (uint32_t)(j2 ? store_bf16(tt[i * R + j + 1]) : 0) << 16;                  \
    }                                                                                        \
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,    \
                                         25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,    \
                                         18, 2, 17, 1, 16, 0);                               \
    for (int c = 0; c < cn; c += 16) {                                                       \
        const int w = cn - c < 16 ? cn - c : 16;                                             \
        const __mmask16 mask = (__mmask16)(w == 16 ? 0xffffu : (1u << w) - 1u);              \
        __m512 v[NR];                                                                        \
        _Pragma("GCC unroll 16")                                                             \
        for (int i = 0; i < NR; i++) v[i] = _mm512_setzero_ps();                             \
        for (int p = 0; p < np; p++) {                                                       \
            if (!lp[p]) continue;                                                            \
            const int j = r0 + 2 * p;                                                        \
            /* B's rows come from memory, 2j streams at once: ask for the next line early */ \
            _mm_prefetch((const char *)(B + (int64_t)j * out_cols + c + 64), _MM_HINT_T0);   \
            if (j + 1 < r1)                                                                  \
                _mm_prefetch((const char *)(B + (int64_t)(j + 1) * out_cols + c + 64),       \
                             _MM_HINT_T0);                                                   \
            const __m256i b0 = _mm256_maskz_loadu_epi16(mask, B + (int64_t)j * out_cols + c); \
            const __m256i b1 = j + 1 < r1 ? _mm256_maskz_loadu_epi16(                        \
                mask, B + (int64_t)(j + 1) * out_cols + c) : _mm256_setzero_si256();          \
            const __m512bh b = (__m512bh)_mm512_permutexvar_epi16(                           \
                idx, _mm512_inserti64x4(_mm512_castsi256_si512(b0), b1, 1));                  \
            const uint32_t *t = tp + p * NR;                                                 \
            _Pragma("GCC unroll 16")                                                         \
            for (int i = 0; i < NR; i++)                                                     \
                v[i] = _mm512_dpbf16_ps(v[i], (__m512bh)_mm512_set1_epi32((int)t[i]), b);    \
        }                                                                                    \
        _Pragma("GCC unroll 16")                                                             \
        for (int i = 0; i < NR; i++) _mm512_storeu_ps(acc + i * LORA_CB + c, v[i]);          \
    }                                                                                        \
}
DEFINE_SHRINK_DOT(1) DEFINE_SHRINK_DOT(4) DEFINE_SHRINK_DOT(8) DEFINE_SHRINK_DOT(16)
DEFINE_EXPAND_DOT(1) DEFINE_EXPAND_DOT(4) DEFINE_EXPAND_DOT(8) DEFINE_EXPAND_DOT(16)
#endif

/* shrink_SUFFIX / expand_SUFFIX: the register tile of 1, 4, 8 or 16 rows for a tile of m. */
#define DEFINE_TILE_DISPATCH(SUFFIX, W)                                                      \
INLINE void shrink_##SUFFIX(const W *As, int R, int j0, int j1, int in,                      \
                            const XT_##SUFFIX *xt, int m, float *tt) {                       \
    if (m == 1) shrink_1_##SUFFIX(As, R, j0, j1, in, xt, tt);                                \
    else if (m <= 4) shrink_4_##SUFFIX(As, R, j0, j1, in, xt, tt);                           \
    else if (m <= 8) shrink_8_##SUFFIX(As, R, j0, j1, in, xt, tt);                           \
    else shrink_16_##SUFFIX(As, R, j0, j1, in, xt, tt);                                      \
}                                                                                            \
INLINE void expand_##SUFFIX(const W *B, int out_cols, int r0, int r1, int cn,                \
                            const float *tt, int R, int m, const uint8_t *live, float *acc) { \
    if (m == 1) expand_1_##SUFFIX(B, out_cols, r0, r1, cn, tt, R, live, acc);                \
    else if (m <= 4) expand_4_##SUFFIX(B, out_cols, r0, r1, cn, tt, R, live, acc);           \
    else if (m <= 8) expand_8_##SUFFIX(B, out_cols, r0, r1, cn, tt, R, live, acc);           \
    else expand_16_##SUFFIX(B, out_cols, r0, r1, cn, tt, R, live, acc);                      \
}
#define DEFINE_TILE_OPS(SUFFIX, W)                                                           \
DEFINE_SHRINK(1, SUFFIX, W) DEFINE_SHRINK(4, SUFFIX, W)                                      \
DEFINE_SHRINK(8, SUFFIX, W) DEFINE_SHRINK(16, SUFFIX, W)                                     \
DEFINE_EXPAND(1, SUFFIX, W) DEFINE_EXPAND(4, SUFFIX, W)                                      \
DEFINE_EXPAND(8, SUFFIX, W) DEFINE_EXPAND(16, SUFFIX, W)                                     \
DEFINE_TILE_DISPATCH(SUFFIX, W)
#else
/* The generic loops (any target): the same sums, auto-vectorized where the target allows. */
#define DEFINE_TILE_OPS(SUFFIX, W)                                                           \
INLINE void shrink_##SUFFIX(const W *As, int R, int j0, int j1, int in, const float *xt,     \
                            int m, float *tt) {                                              \
    for (int j = j0; j < j1; j++) {                                                          \
        const W *a = As + (int64_t)j * in;                                                   \
        for (int i = 0; i < m; i++) {                                                        \
            const float *xi = xt + i * in;                                                   \
            float d = 0.f;                                                                   \
            _Pragma("omp simd reduction(+:d)")                                               \
            for (int k = 0; k < in; k++) d += load_##SUFFIX(a[k]) * xi[k];                   \
            tt[i * R + j] = d;                                                               \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
INLINE void expand_##SUFFIX(const W *B, int out_cols, int r0, int r1, int cn,                \
                            const float *tt, int R, int m, const uint8_t *live, float *acc) { \
    for (int i = 0; i < m; i++) memset(acc + i * LORA_CB, 0, sizeof(float) * cn);           \
    for (int j = r0; j < r1; j++) {                                                          \
        if (!live[j]) continue;                                                              \
        const W *bj = B + (int64_t)j * out_cols;                                             \
        for (int i = 0; i < m; i++) {                                                        \
            const float tij = tt[i * R + j];                                                 \
            float *ai = acc + i * LORA_CB;                                                   \
            _Pragma("omp simd")                                                              \
            for (int c = 0; c < cn; c++) ai[c] += tij * load_##SUFFIX(bj[c]);                \
        }                                                                                    \
    }                                                                                        \
}
#endif

/* lora_amx.c: a full tile's shrink and expand on AMX tiles (bfloat16; see there). */
int lora_amx_fits(int m, int in, int R);
void lora_amx_shrink(const uint16_t *As, int R, int in, const uint16_t *xt, float *tt);
void lora_amx_expand(const uint16_t *B, int out_cols, int r0, int r1, int cn, const float *tt,
                     int R, float *acc);
#define LORA_AMX_FITS_bf16(m, in, R) lora_amx_fits(m, in, R)
#define LORA_AMX_FITS_f32(m, in, R) 0
#define LORA_AMX_SHRINK_bf16(As, R, in, xt, tt) \
    lora_amx_shrink(As, R, in, (const uint16_t *)(const void *)(xt), tt)
#define LORA_AMX_SHRINK_f32(As, R, in, xt, tt) (void)0
#define LORA_AMX_EXPAND_bf16(...) lora_amx_expand(__VA_ARGS__)
#define LORA_AMX_EXPAND_f32(...) (void)0

#define DEFINE_LORA(SUFFIX, T)                                                               \
void lora_sgmv_##SUFFIX(const T *x, int64_t x_stride, T *out, int64_t out_stride, int n,     \
                        const int32_t *row_slot, const int32_t *present, int n_slots,        \
                        const T *A, const T *Bt, int in, int out_cols, int R, int n_bands,   \
                        const int32_t *bands, int num_threads) {                             \
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
    /* the rows in tile order as float32 (each tile padded with zero rows to LORA_RB), then  \
     * their shrunk ranks tt [row][R] */                                                     \
    const size_t padded = (size_t)ntiles * LORA_RB;                                          \
    float *tt = scratch(1, sizeof(float) * padded * ((size_t)in + R));                       \
    if (!tt) return;                                                                         \
    XT_##SUFFIX *xt = (XT_##SUFFIX *)(tt + padded * R);                                      \
    int nchunk = 0;                                                                          \
    for (int b = 0; b < n_bands; b++)                                                        \
        nchunk += (bands[4 * b + 3] - bands[4 * b + 2] + LORA_CB - 1) / LORA_CB;             \
    const int njb = (R + LORA_JB - 1) / LORA_JB;                                             \
    _Pragma("omp parallel num_threads(num_threads) if(nrow * R * in >= 65536)")             \
    {                                                                                        \
        _Pragma("omp for schedule(static)")                                                  \
        for (int q = 0; q < ntiles * LORA_RB; q++) {                                         \
            const int tile = q / LORA_RB, i = q % LORA_RB;                                   \
            XT_##SUFFIX *dst = xt + ((size_t)tile * LORA_RB + i) * in;                       \
            if (i >= tile_len[tile]) { memset(dst, 0, sizeof(*dst) * in); continue; }       \
            const T *xs = x + (int64_t)order[tile_first[tile] + i] * x_stride;               \
            for (int k = 0; k < in; k++) dst[k] = stage_##SUFFIX(xs[k]);                     \
        }                                                                                    \
        _Pragma("omp for schedule(static)")                                                  \
        for (int task = 0; task < ntiles * njb; task++) {                                    \
            const int tile = task / njb, jb = task % njb;                                    \
            const int s = row_slot[order[tile_first[tile]]];                                 \
            if (LORA_AMX_FITS_##SUFFIX(tile_len[tile], in, R)) {  /* all ranks, one task */ \
                if (!jb) LORA_AMX_SHRINK_##SUFFIX(A + (int64_t)s * R * in, R, in,            \
                                                  xt + (size_t)tile * LORA_RB * in,          \
                                                  tt + (size_t)tile * LORA_RB * R);          \
                continue;                                                                    \
            }                                                                                \
            const int j1 = (jb + 1) * LORA_JB < R ? (jb + 1) * LORA_JB : R;                  \
            shrink_##SUFFIX(A + (int64_t)s * R * in, R, jb * LORA_JB, j1, in,                \
                            xt + (size_t)tile * LORA_RB * in, tile_len[tile],                \
                            tt + (size_t)tile * LORA_RB * R);                                \
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
            const T *bs = Bt + (int64_t)row_slot[rows[0]] * R * out_cols + cs;              \
            if (LORA_AMX_FITS_##SUFFIX(m, in, R)) {                                          \
                LORA_AMX_EXPAND_##SUFFIX(bs, out_cols, r0, r1, cn, ttt, R, acc);            \
            } else {                                                                         \
                uint8_t *live = (uint8_t *)(acc + LORA_RB * LORA_CB);                        \
                for (int j = r0; j < r1; j++) {     /* a zero-padded rank row: skipped */    \
                    live[j] = 0;                                                             \
                    for (int i = 0; i < m; i++) live[j] |= ttt[i * R + j] != 0.f;            \
                }                                                                            \
                expand_##SUFFIX(bs, out_cols, r0, r1, cn, ttt, R, m, live, acc);             \
            }                                                                                \
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

DEFINE_TILE_OPS(f32, float)
DEFINE_LORA(f32, float)
#if LORA_DOT          /* the vdpbf16ps tiles are defined above */
DEFINE_TILE_DISPATCH(bf16, uint16_t)
#else
DEFINE_TILE_OPS(bf16, uint16_t)
#endif
DEFINE_LORA(bf16, uint16_t)
