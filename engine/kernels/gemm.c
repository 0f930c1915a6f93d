/*
 * Linear layers with bfloat16 weights and float32 arithmetic, for hosts where oneDNN has no
 * bfloat16 matmul (AVX2 + FMA without AVX-512 BW/VL/DQ or AVX-NE-CONVERT), where torch's own
 * bfloat16 GEMM is 6-8x slower than float32 from 16 rows up (measured, see engine/linear.py).
 *
 *   y [M, N] = x [M, K] @ W[N, K]^T (+ bias [N])
 *
 * W is packed once at load (`gemm_pack_bf16`) into panels of NR = 16 output columns:
 * packed [ceil(N/16)][K][16] bfloat16, zero-padded past N. Within a panel row the 16 columns are
 * stored in the order PANEL_ORDER, chosen so that one 32-byte load and two unpacks with zero give
 * two float32 vectors of columns 0-7 and 8-15 (bfloat16 is the high half of a float32, and
 * _mm256_unpack{lo,hi}_epi16 work within 128-bit lanes).
 *
 * The product is the classic register-tiled GEMM (Goto and van de Geijn, "Anatomy of
 * High-Performance Matrix Multiplication", ACM TOMS 2008; BLIS's micro-kernel): an MR = 6 by
 * NR = 16 tile of y stays in 12 AVX2 registers while K streams through, the weight panel
 * (K x 16, at most 8 KiB per 256 k) staying in L1/L2 across all row tiles. Threads split the
 * panels. x is first converted to one contiguous float32 copy (M x K, cheap beside M x K x N).
 * Where AVX2 + FMA are not compiled in, a generic C loop over the same layout runs.
 */
#include "common.h"

#define NR 16
#define MR 6
#define GEMV_PREFETCH 32
#ifndef L2_BLOCK_BYTES
#define L2_BLOCK_BYTES (192 * 1024)
#endif

/* Column stored at position i of a packed panel row (see the file comment). */
static const int PANEL_ORDER[NR] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

/* Pack W [n, k] bfloat16 (row-major) into `packed` [ceil(n/16) * k * 16] bfloat16. */
void gemm_pack_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed, int num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
    _Pragma("omp parallel for num_threads(num_threads)")
    for (int64_t p = 0; p < panels; p++) {
        uint16_t *dst = packed + p * k * NR;
        for (int i = 0; i < NR; i++) {
            const int64_t col = p * NR + PANEL_ORDER[i];
            for (int64_t kk = 0; kk < k; kk++)
                dst[kk * NR + i] = col < n ? w[col * k + kk] : 0;
        }
    }
}

/* Store a tile's rows: acc [mr][16] float32 in column order, into y (row stride ldy) for the
 * columns col0 .. col0 + ncols - 1, adding bias; y float32 or bfloat16. */
INLINE void store_tile(const float *acc, int mr, int ncols, int64_t col0, const uint16_t *bias,
                       void *y, int64_t ldy, int y_f32) {
    for (int r = 0; r < mr; r++) {
        for (int c = 0; c < ncols; c++) {
            float v = acc[r * NR + c] + (bias ? load_bf16(bias[col0 + c]) : 0.f);
            if (y_f32) ((float *)y)[r * ldy + col0 + c] = v;
            else ((uint16_t *)y)[r * ldy + col0 + c] = store_bf16(v);
        }
    }
}

#if HAVE_AVX2
/* acc [mr][16] = a [mr rows, lda] . panel [k][16]; mr a constant after inlining (1..6). */
INLINE void tile_avx2(const float *a, int64_t lda, const uint16_t *panel, int64_t k,
                      const int mr, float *acc) {
    __m256 c0[MR], c1[MR];
    const __m256i zero = _mm256_setzero_si256();
    for (int r = 0; r < mr; r++) c0[r] = c1[r] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(panel + kk * NR));
        const __m256 b0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
        const __m256 b1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
        for (int r = 0; r < mr; r++) {
            const __m256 av = _mm256_broadcast_ss(a + r * lda + kk);
            c0[r] = _mm256_fmadd_ps(av, b0, c0[r]);
            c1[r] = _mm256_fmadd_ps(av, b1, c1[r]);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(acc + r * NR, c0[r]);
        _mm256_storeu_ps(acc + r * NR + 8, c1[r]);
    }
}

/* One row (decode at batch 1): k in pairs with two sets of accumulators, so that 4 FMA chains
 * run instead of 2 waiting on each FMA's latency; the weights are streamed once, so they are
 * prefetched GEMV_PREFETCH rows (1 KiB) ahead: 30 layers at batch 1, AVX2, 18.0 -> 19.8 GB/s
 * (median of 7; 16 and 64 rows ahead measured 18.6 and 19.4). */
INLINE void row_avx2(const float *a, const uint16_t *panel, int64_t k, float *acc) {
    __m256 c[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
    const __m256i zero = _mm256_setzero_si256();
    int64_t kk = 0;
    for (; kk + 1 < k; kk += 2) {
        __builtin_prefetch(panel + (kk + GEMV_PREFETCH) * NR, 0, 0);
        const __m256i r0 = _mm256_loadu_si256((const __m256i *)(panel + kk * NR));
        const __m256i r1 = _mm256_loadu_si256((const __m256i *)(panel + (kk + 1) * NR));
        const __m256 a0 = _mm256_broadcast_ss(a + kk), a1 = _mm256_broadcast_ss(a + kk + 1);
        c[0] = _mm256_fmadd_ps(a0, _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, r0)), c[0]);
        c[1] = _mm256_fmadd_ps(a0, _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, r0)), c[1]);
        c[2] = _mm256_fmadd_ps(a1, _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, r1)), c[2]);
        c[3] = _mm256_fmadd_ps(a1, _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, r1)), c[3]);
    }
    if (kk < k) {
        const __m256i r0 = _mm256_loadu_si256((const __m256i *)(panel + kk * NR));
        const __m256 a0 = _mm256_broadcast_ss(a + kk);
        c[0] = _mm256_fmadd_ps(a0, _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, r0)), c[0]);
        c[1] = _mm256_fmadd_ps(a0, _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, r0)), c[1]);
    }
    _mm256_storeu_ps(acc, _mm256_add_ps(c[0], c[2]));
    _mm256_storeu_ps(acc + 8, _mm256_add_ps(c[1], c[3]));
}
#endif

/* Generic tile: the same product in plain C over the packed layout. */
#if !HAVE_AVX2
static void tile_generic(const float *a, int64_t lda, const uint16_t *panel, int64_t k, int mr,
                         float *acc) {
    for (int r = 0; r < mr; r++) {
        float sum[NR] = {0};
        for (int64_t kk = 0; kk < k; kk++) {
            const float av = a[r * lda + kk];
            for (int i = 0; i < NR; i++) sum[i] += av * load_bf16(panel[kk * NR + i]);
        }
        for (int i = 0; i < NR; i++) acc[r * NR + PANEL_ORDER[i]] = sum[i];
    }
}
#endif

INLINE void tile(const float *a, int64_t lda, const uint16_t *panel, int64_t k, int mr,
                 float *acc) {
#if HAVE_AVX2
    switch (mr) {                  /* constant row counts, so each case is fully unrolled */
    case 6: tile_avx2(a, lda, panel, k, 6, acc); return;
    case 5: tile_avx2(a, lda, panel, k, 5, acc); return;
    case 4: tile_avx2(a, lda, panel, k, 4, acc); return;
    case 3: tile_avx2(a, lda, panel, k, 3, acc); return;
    case 2: tile_avx2(a, lda, panel, k, 2, acc); return;
    default: row_avx2(a, panel, k, acc); return;
    }
#else
    tile_generic(a, lda, panel, k, mr, acc);
#endif
}

/* y [m, n] (row stride ldy; float32 if y_f32 else bfloat16) = x [m, k] @ W^T + bias.
 * x: row stride x_stride elements, bfloat16 if x_bf16 else float32; packed: from
 * gemm_pack_bf16; bias: [n] bfloat16 or NULL. Returns 0, or -1 if out of memory. */
int gemm_bf16w(const void *x, int64_t x_stride, int x_bf16, const uint16_t *packed,
               const uint16_t *bias, void *y, int64_t ldy, int y_f32, int64_t m, int64_t n,
               int64_t k, int num_threads) {
    float *a = malloc(sizeof(float) * (size_t)(m * k > 0 ? m * k : 1));
    if (!a) return -1;
    _Pragma("omp parallel for num_threads(num_threads) if(m * k >= 65536)")
    for (int64_t r = 0; r < m; r++) {
        if (x_bf16) {
            const uint16_t *src = (const uint16_t *)x + r * x_stride;
            for (int64_t i = 0; i < k; i++) a[r * k + i] = load_bf16(src[i]);
        } else {
            memcpy(a + r * k, (const float *)x + r * x_stride, sizeof(float) * (size_t)k);
        }
    }
    /* Row blocks of about L2_BLOCK_BYTES of x, so that x stays in L2 while the panels pass. */
    const int64_t panels = (n + NR - 1) / NR;
    int64_t mb = L2_BLOCK_BYTES / ((int64_t)sizeof(float) * k) / MR * MR;
    mb = mb < MR ? MR : mb;
    const int64_t blocks = (m + mb - 1) / mb;
    _Pragma("omp parallel for collapse(2) num_threads(num_threads) schedule(static)")
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t p = 0; p < panels; p++) {
            float acc[MR * NR];
            const uint16_t *panel = packed + p * k * NR;
            const int ncols = n - p * NR < NR ? (int)(n - p * NR) : NR;
            const int64_t end = (b + 1) * mb < m ? (b + 1) * mb : m;
            for (int64_t r0 = b * mb; r0 < end; r0 += MR) {
                const int mr = end - r0 < MR ? (int)(end - r0) : MR;
                tile(a + r0 * k, k, panel, k, mr, acc);
                store_tile(acc, mr, ncols, p * NR, bias,
                           y_f32 ? (void *)((float *)y + r0 * ldy)
                                 : (void *)((uint16_t *)y + r0 * ldy), ldy, y_f32);
            }
        }
    }
    free(a);
    return 0;
}
