/*
 * Linear layers and embedding lookups over quantized weights read in their block format
 * (quant_blocks.h: GGUF's Q8_0, Q4_0, Q4_1, Q4_K, Q6_K and int8 "I8"):
 *
 *   y [M, N] = x [M, K] @ dequant(W)[N, K]^T (* row_scale [N]) (+ bias [N])
 *
 * W is N rows of ceil(K / QK) blocks (`row_bytes` bytes a row, rows contiguous); the result is
 * the dequantized model's up to the order of the float32 sums (bfloat16 models: the bfloat16
 * model's, its weights rounded as it rounds them). Three loop nests, chosen by M:
 * - M <= MR (decode at small batch; MR 8 on AVX-512, 4 on AVX2 and elsewhere, and 4 for
 *   bfloat16 x on an AVX512-BF16 host): per W row, each block dequantized in registers (dqv) and
 *   multiplied at once with the M rows of x in float32 (vector accumulators per row, one
 *   horizontal add per output). W streams from memory once.
 * - MR < M <= MB, bfloat16 x on an AVX512-BF16 host: the same with the block rounded to
 *   bfloat16 (dqb) and vdpbf16ps products, x block-major.
 * - otherwise (prefill, large decode batches): quant_panel.c — a panel of W rows dequantized
 *   once into a transposed scratch, then register tiles over all of x (in vdpbf16ps pairs for
 *   a bfloat16 x on an AVX512-BF16 host, up to quant_pair_panel_rows' rows). A
 *   bfloat16 x over W's repacked copy (quant_linear_packed's `packed`) takes the pairs'
 *   panels from PACKED_PANEL_ROWS (5) rows: filled from the copy they beat the fused bfloat16
 *   nest there.
 * Threads split W's rows. x is first copied (float32, or bfloat16 for the bfloat16 nests),
 * zero-padded to whole blocks (the int8 format pads K with zero weights).
 */
#include "quant_blocks.h"

float quant_f16_table[1 << 16];

__attribute__((constructor)) static void fill_f16_table(void) {
    for (uint32_t h = 0; h < (1u << 16); h++) quant_f16_table[h] = f16_convert((uint16_t)h);
}

#if HAVE_AVX512
#define MR 8          /* rows of x up to which the M <= MR nest runs: 16 accumulators of 32
                         registers (5-8 rows: 1.7x the panels' rate, Emerald Rapids) */
#else
#define MR 4          /* AVX2's 16 registers hold 4 rows' accumulators */
#endif
#define NC 16         /* rows of W a thread takes at a time in it */

/* Dequantize W rows [r0, r1) (nb blocks each) into dst [(r1 - r0)][ld] float32, a block at a
 * time through dqv_T's vectors. */
#define DEFINE_DQ_ROWS(T, QKT, BYTES)                                                         \
static void dq_rows_##T(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,         \
                        int64_t nb, float *dst, int64_t ld) {                                 \
    for (int64_t n = r0; n < r1; n++)                                                         \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            V v[QKT / VL];                                                                    \
            dqv_##T(w + n * row_bytes + b * BYTES, v);                                        \
            for (int j = 0; j < QKT / VL; j++)                                                \
                vstore(dst + (n - r0) * ld + b * QKT + j * VL, v[j]);                         \
        }                                                                                     \
}

/* small_m's cases past 4 rows (AVX-512's MR). */
#if MR == 8
#define ROW_TILE_WIDE_CASES(T)                                                                \
        case 8: row_tile_##T(wrow, nb, x, ldx, 8, out + j * MR); break;                       \
        case 7: row_tile_##T(wrow, nb, x, ldx, 7, out + j * MR); break;                       \
        case 6: row_tile_##T(wrow, nb, x, ldx, 6, out + j * MR); break;                       \
        case 5: row_tile_##T(wrow, nb, x, ldx, 5, out + j * MR); break;
#else
#define ROW_TILE_WIDE_CASES(T)
#endif

/* out[r] = dot(dequant(W row), x row r) for r < mr (mr <= MR, a constant once inlined): each
 * block dequantized into vectors (dqv_T) and used at once by every row of x; two accumulators
 * a row, so two FMA chains run. */
#define DEFINE_ROW_TILE(T, QKT, BYTES)                                                        \
INLINE void row_tile_##T(const uint8_t *wrow, int64_t nb, const float *x, int64_t ldx,        \
                         const int mr, float *out) {                                          \
    V acc[MR][2];                                                                             \
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = vzero();                             \
    for (int64_t b = 0; b < nb; b++) {                                                        \
        __builtin_prefetch(wrow + b * BYTES + PF, 0, 3);                                    \
        V v[QKT / VL];                                                                        \
        dqv_##T(wrow + b * BYTES, v);                                                         \
        const float *xb = x + b * QKT;                                                        \
        for (int j = 0; j < QKT / VL; j++)                                                    \
            for (int r = 0; r < mr; r++)                                                      \
                acc[r][j & 1] = vfma(v[j], vload_f32(xb + r * ldx + j * VL), acc[r][j & 1]);  \
    }                                                                                         \
    for (int r = 0; r < mr; r++) out[r] = vsum(vadd(acc[r][0], acc[r][1]));                   \
}                                                                                             \
/* The M <= MR nest over n W rows: out [n][MR]. */                                            \
static void small_m_##T(const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nb,          \
                        const float *x, int64_t ldx, int mr, float *out /* [n][MR] */) {      \
    for (int64_t j = 0; j < n; j++) {                                                         \
        const uint8_t *wrow = w + j * row_bytes;                                              \
        switch (mr) {                                                                         \
        ROW_TILE_WIDE_CASES(T)                                                                \
        case 4: row_tile_##T(wrow, nb, x, ldx, 4, out + j * MR); break;                       \
        case 3: row_tile_##T(wrow, nb, x, ldx, 3, out + j * MR); break;                       \
        case 2: row_tile_##T(wrow, nb, x, ldx, 2, out + j * MR); break;                       \
        default: row_tile_##T(wrow, nb, x, ldx, 1, out + j * MR); break;                      \
        }                                                                                     \
    }                                                                                         \
}

#define DEFINE_FUSED(T, ID, QKT, BYTES)                                                       \
    DEFINE_DQ_ROWS(T, QKT, BYTES) DEFINE_ROW_TILE(T, QKT, BYTES)
QUANT_TYPES(DEFINE_FUSED)

#if HAVE_BF16_DOT
#define MB 8          /* rows of x up to which a bfloat16 x takes the fused bfloat16 nest
                         (at 9 to 16 rows it measured no faster than the panels) */
/* out[r] = dot(bfloat16(dequant(W row)), x row r) for r < MB: each block dequantized into
 * vectors (dqv_T), rounded to bfloat16 32 values at a time (as the bfloat16 model's weights
 * are) and multiplied with vdpbf16ps. x bfloat16 block-major [nb][MB][QKT] (rows past m zero):
 * a block's rows are at constant offsets from one pointer. */
#define DEFINE_MID(T, QKT, BYTES)                                                             \
INLINE void row_tile_bf16_##T(const uint8_t *wrow, int64_t nb, const uint16_t *x,             \
                              float *out) {                                                   \
    __m512 acc[MB];                                                                           \
    for (int r = 0; r < MB; r++) acc[r] = _mm512_setzero_ps();                                \
    for (int64_t b = 0; b < nb; b++) {                                                        \
        __builtin_prefetch(wrow + b * BYTES + PF, 0, 3);                                    \
        V v[QKT / VL];                                                                        \
        dqv_##T(wrow + b * BYTES, v);                                                         \
        for (int j = 0; j < QKT / VL; j += 2) {                                               \
            const __m512bh wv = _mm512_cvtne2ps_pbh(v[j + 1], v[j]);                          \
            const uint16_t *xb = x + (b * MB) * QKT + j * VL;                                 \
            for (int r = 0; r < MB; r++)                                                      \
                acc[r] = _mm512_dpbf16_ps(acc[r], wv,   /* x last: a memory operand */        \
                                          (__m512bh)_mm512_loadu_si512(xb + r * QKT));        \
        }                                                                                     \
    }                                                                                         \
    for (int r = 0; r < MB; r++) out[r] = _mm512_reduce_add_ps(acc[r]);                       \
}                                                                                             \
static void mid_m_##T(const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nb,            \
                      const uint16_t *x, float *out /* [n][MB] */) {                          \
    for (int64_t j = 0; j < n; j++) row_tile_bf16_##T(w + j * row_bytes, nb, x, out + j * MB); \
}
#define DEFINE_MID_OF(T, ID, QKT, BYTES) DEFINE_MID(T, QKT, BYTES)
QUANT_TYPES(DEFINE_MID_OF)
#define MID(T) mid_m_##T
/* dqb_rows_fn of the 32-value types: the panels' bfloat16 pack */
#define DEFINE_DQB_ROWS(T, BYTES)                                                             \
static void dqb_rows_##T(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,        \
                         uint16_t *dst) {                                                     \
    for (int64_t n = r0; n < r1; n++)                                                         \
        _mm512_storeu_si512(dst + (n - r0) * QK, dqb_##T(w + n * row_bytes));                 \
}
DEFINE_DQB_ROWS(q8_0, 34)
DEFINE_DQB_ROWS(q4_0, 18)
DEFINE_DQB_ROWS(q4_1, 20)
DEFINE_DQB_ROWS(i8, QK)
#define DQB(T) dqb_rows_##T
#else
#define MB 0
#define MID(T) NULL
#define DQB(T) NULL
#endif

typedef void (*small_m_fn)(const uint8_t *, int64_t, int64_t, int64_t, const float *, int64_t,
                           int, float *);
typedef void (*mid_m_fn)(const uint8_t *, int64_t, int64_t, int64_t, const uint16_t *,
                         float *);
/* A block type: its size, and its loop nests. */
typedef struct {
    int qk, bytes;        /* values and bytes a block */
    dq_rows_fn dq;        /* rows dequantized to float32 */
    small_m_fn small;     /* M <= MR, float32 x */
    mid_m_fn mid;         /* MR < M <= MB, bfloat16 x (NULL without AVX512-BF16) */
    dqb_rows_fn dqb;      /* a block column to bfloat16 (NULL: 256-value types, no BF16) */
} qkernels;

#define QKERNELS(T, QKT, BYTES, DQB_FN)                                                       \
    (qkernels){QKT, BYTES, dq_rows_##T, small_m_##T, MID(T), DQB_FN}

/* The table entry of a GGML type id; 0 for a type with no kernel. */
static int kernels_for(int type, qkernels *k) {
    switch (type) {
    case T_Q8_0: *k = QKERNELS(q8_0, QK, 34, DQB(q8_0)); return 1;
    case T_Q4_0: *k = QKERNELS(q4_0, QK, 18, DQB(q4_0)); return 1;
    case T_Q4_1: *k = QKERNELS(q4_1, QK, 20, DQB(q4_1)); return 1;
    case T_I8: *k = QKERNELS(i8, QK, QK, DQB(i8)); return 1;
    case T_Q4_K: *k = QKERNELS(q4_k, QK_K, 144, NULL); return 1;
    case T_Q6_K: *k = QKERNELS(q6_k, QK_K, 210, NULL); return 1;
    default: return 0;
    }
}

/* x [m, k] (row stride x_stride; bfloat16 if x_bf16) as a contiguous copy [rows][kp], zero
 * past k and past m (rows >= m): bfloat16 if as_bf16, else float32; with qk_major (a block
 * size) bfloat16 in blocks [kp / qk_major][rows][qk_major]. In the calling thread's scratch
 * (not to be freed; read only); x itself where it is already that (a prefill's x is
 * megabytes, copied by one thread); NULL if out of memory. */
void *quant_copy_x(const void *x, int64_t x_stride, int x_bf16, int64_t m, int64_t rows,
                   int64_t k, int64_t kp, int as_bf16, int qk_major) {
    if (!qk_major && rows == m && kp == k && x_stride == k && as_bf16 == x_bf16)
        return (void *)x;
    const size_t elem = as_bf16 ? 2 : 4;
    void *xc = scratch(0, (size_t)(rows > 0 ? rows : 1) * (size_t)kp * elem);
    if (!xc) return NULL;
    if (qk_major || rows > m)     /* zero the padding rows (and, block-major, everything) */
        memset(xc, 0, (size_t)(rows > 0 ? rows : 1) * (size_t)kp * elem);
    if (kp > k)                   /* zero each row's padding columns */
        for (int64_t r = 0; r < m; r++)
            memset((char *)xc + ((size_t)r * kp + k) * elem, 0, (size_t)(kp - k) * elem);
    if (qk_major) {               /* bfloat16, block-major [kp / qk][rows][qk] (the mid nest) */
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < k; i++)
                ((uint16_t *)xc)[(i / qk_major * rows + r) * qk_major + i % qk_major] =
                    ((const uint16_t *)x)[r * x_stride + i];
        return xc;
    }
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

/* Which nest runs a call (see the file comment). */
enum { NEST_SMALL, NEST_MID_BF16, NEST_PANEL, NEST_PANEL_BF16 };

/* Rows of bfloat16 x from which a weight with the panels' repacked copy takes the panels. The
 * model's 121 products streamed from memory (2-core Zen 5 EPYC, ms, alternating runs): at 5-8
 * rows 5.4-6.5 against the fused bfloat16 nest's 9.1-9.7 (over the blocks the panels ran 6.2-7.7:
 * the fused nests' per-row reductions and block-by-block rounding lose to one panel per call).
 * At 4 rows the panels also win (5.0-5.3 against the M <= 4 nest's 7.2-7.4) but the M <= 4 nest
 * stays: it multiplies float32 weights, each row exactly as at one row, so a decode step of up
 * to 4 rows (a speculative verification of 3 drafts) gives the single-row step's logits; the
 * panels round weights to bfloat16 as the fused bfloat16 nest did from 5 rows. */
#define PACKED_PANEL_ROWS 5

/* The most rows of bfloat16 x that take the panels in vdpbf16ps pairs (from PACKED_PANEL_ROWS
 * over a repacked copy, else above MB); more take the float32 panels, x widened once in
 * quant_copy_x. Unlimited unless quant_pair_panel_rows lowers it: on an Intel core without AMX
 * (engine.kernels.isa.slow_bf16_dot) vdpbf16ps runs at half float32 FMAs' rate, and there
 * (benchmarks/kernel_ab.py `--variant pairs=pairs=1 --variant slow=pairs=0`, Emerald Rapids
 * with AMX hidden, 2 threads) the embedded model's repacked products took 0.95x the pairs'
 * time in float32 at 16 rows and 0.64-0.68x at 64, but 1.04x at 12 and 1.43x at 6 (against
 * the fused pairs nest); random Q4_K blocks in a 1B model's shapes (no repacked copy)
 * 0.92x at 16 and 0.79-0.80x at 64 (Q6_K 0.88x), and the fused pairs nest 0.75x the float32
 * nest's time at 8. A process-wide setting, made once by CpuKernels before any call. */
static int64_t pair_panel_rows = INT64_MAX;

void quant_pair_panel_rows(int64_t rows) { pair_panel_rows = rows; }

static int choose_nest(int64_t m, int x_bf16, int packed) {
    const int dot = HAVE_BF16_DOT && x_bf16, panel_pairs = dot && m <= pair_panel_rows;
    if (panel_pairs && packed && m >= PACKED_PANEL_ROWS) return NEST_PANEL_BF16;
    /* 5 to 8 rows of bfloat16 x on an AVX512-BF16 host: the vdpbf16ps nest (measured there) */
    if (m <= 4 || (m <= MR && !dot)) return NEST_SMALL;
    if (dot && m <= MB) return NEST_MID_BF16;
    return panel_pairs ? NEST_PANEL_BF16 : NEST_PANEL;
}

/* The W rows [n0, n1) of one thread's chunk through the fused nests (small, mid). */
static void fused_chunk(const qkernels *kn, int nest, const uint8_t *w, int64_t row_bytes,
                        int64_t n0, int64_t n1, int64_t nb, const void *xc, int64_t kp,
                        int64_t m, void *y, int64_t ldy, int y_f32, const float *row_scale,
                        const float *bias) {
    const int width = nest == NEST_SMALL ? MR : MB;
    float out[NC * (MB > MR ? MB : MR)];
    if (nest == NEST_SMALL) kn->small(w + n0 * row_bytes, row_bytes, n1 - n0, nb, xc, kp,
                                      (int)m, out);
    else kn->mid(w + n0 * row_bytes, row_bytes, n1 - n0, nb, xc, out);
    float row[NC];
    for (int64_t r = 0; r < m; r++) {
        for (int64_t j = 0; j < n1 - n0; j++) row[j] = out[j * width + r];
        store_row(row, (int)(n1 - n0), y, ldy, y_f32, r, n0, row_scale, bias);
    }
}

/* y [m, n] (row stride ldy; float32 if y_f32 else bfloat16) = x [m, k] @ dequant(W)^T, times
 * row_scale [n] if given, plus bias [n] float32 if given. x: row stride x_stride elements,
 * bfloat16 if x_bf16 else float32. W: n rows of row_bytes bytes holding ceil(k / QK) blocks.
 * Returns 0; -1 out of memory; -2 unknown type. */
int quant_linear(int type, const uint8_t *w, int64_t row_bytes, const float *row_scale,
                 const float *bias, const void *x, int64_t x_stride, int x_bf16, void *y,
                 int64_t ldy, int y_f32, int64_t m, int64_t n, int64_t k, int num_threads) {
    return quant_linear_packed(type, w, row_bytes, row_scale, bias, x, x_stride, x_bf16, y, ldy,
                               y_f32, m, n, k, num_threads, NULL);
}

/* quant_linear with W's repacked copy `packed` (quant_panel_pack's, or NULL): the panels of a
 * bfloat16 x read it (quant_panel.c), the same products bit for bit. */
int quant_linear_packed(int type, const uint8_t *w, int64_t row_bytes, const float *row_scale,
                        const float *bias, const void *x, int64_t x_stride, int x_bf16, void *y,
                        int64_t ldy, int y_f32, int64_t m, int64_t n, int64_t k,
                        int num_threads, const uint8_t *packed) {
    qkernels kn;
    if (!kernels_for(type, &kn)) return -2;
    const int amx_rows = quant_amx_min_rows();
    if (x_bf16 && amx_rows && m >= amx_rows)
        return quant_amx_linear(type, w, row_bytes, row_scale, bias, x, x_stride, y, ldy, y_f32,
                                m, n, k, num_threads);
    const int qk = kn.qk, bytes = kn.bytes;
    const int64_t nb = (k + qk - 1) / qk, kp = nb * qk;
    const int nest = choose_nest(m, x_bf16, packed != NULL);
    const int as_bf16 = nest == NEST_MID_BF16 || nest == NEST_PANEL_BF16;
    const int64_t rows = nest == NEST_MID_BF16 ? MB : m;
    void *xc = quant_copy_x(x, x_stride, x_bf16, m, rows, k, kp, as_bf16,
                            nest == NEST_MID_BF16 ? qk : 0);
    if (!xc) return -1;
    const int panels = nest == NEST_PANEL || nest == NEST_PANEL_BF16;
    const int64_t unit = panels ? quant_panel_rows() : NC;   /* W rows a thread takes at once */
    const int64_t chunks = (n + unit - 1) / unit;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        float *tmp = panels ? scratch(1, sizeof(float) * quant_panel_scratch(kp, qk)) : NULL;
        if (panels && !tmp) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n0 = c * unit, n1 = n0 + unit < n ? n0 + unit : n;
            if (!panels)
                fused_chunk(&kn, nest, w, row_bytes, n0, n1, nb, xc, kp, m, y, ldy, y_f32,
                            row_scale, bias);
#if HAVE_BF16_DOT
            else if (tmp && packed && nest == NEST_PANEL_BF16)
                quant_panel_repacked(type, packed, n, n0, n1, nb, xc, m, tmp, y, ldy, y_f32,
                                     row_scale, bias);
#endif
            else if (tmp)
                quant_panel(kn.dq, kn.dqb, nest == NEST_PANEL_BF16, w, row_bytes, n0, n1, nb, qk,
                            bytes, xc, m, tmp, y, ldy, y_f32, row_scale, bias);
        }
    }
    return failed ? -1 : 0;
}

/* out [t, k] (float32 if out_f32 else bfloat16) = dequant(W)[ids[i]] (times row_scale): an
 * embedding lookup over a quantized table of n rows. Returns 0; -2 unknown type; -3 id out of
 * range (nothing written past the bad one's row). */
int quant_embed(int type, const uint8_t *w, int64_t row_bytes, const float *row_scale,
                const int64_t *ids, int64_t t, int64_t n, int64_t k, void *out, int out_f32) {
    qkernels kn;
    if (!kernels_for(type, &kn)) return -2;
    const int qk = kn.qk;
    const int64_t nb = (k + qk - 1) / qk;
    float *row = malloc(sizeof(float) * (size_t)(nb * qk));
    if (!row) return -1;
    int rc = 0;
    for (int64_t i = 0; i < t; i++) {
        const int64_t id = ids[i];
        if (id < 0 || id >= n) { rc = -3; break; }
        kn.dq(w, row_bytes, id, id + 1, nb, row, nb * qk);
        const float s = row_scale ? row_scale[id] : 1.f;
        for (int64_t j = 0; j < k; j++) {
            if (out_f32) ((float *)out)[i * k + j] = row[j] * s;
            else ((uint16_t *)out)[i * k + j] = store_bf16(row[j] * s);
        }
    }
    free(row);
    return rc;
}
