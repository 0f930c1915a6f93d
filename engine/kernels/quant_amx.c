/*
 * quant.c's nest for bfloat16 x on hosts with AMX tiles (Intel Sapphire / Emerald / Granite
 * Rapids): W's blocks dequantized to bfloat16 and multiplied with tdpbf16ps,
 *
 *   y^T [N, M] = bfloat16(dequant(W)) [N, K] . x^T [K, M]     (float32 accumulation)
 *
 * W is the A operand: a tile is 16 W rows by one step of 32 k, which is what dqb_T gives one
 * block of one W row in a register, so the weights need no transpose (quant_panel.c transposes
 * every block column); only the small x is transposed, once per call, into AMX's B layout:
 * k pairs, stored tile by tile — xt [kp / 32][mp / 16][16 k pairs][16 rows of x][2] bfloat16 —
 * so that each B tile is 1 KiB in one piece (a tile load of 16 rows 64 bytes apart; with the
 * rows of a tile mp * 4 bytes apart the loads missed L1: the layer linears took 1.2x as long
 * at 64 and 256 rows of x on a 2-core Emerald Rapids) (Intel SDM vol. 1 ch. 18 "Intel AMX",
 * TDPBF16PS; the weights-as-A roles of llama.cpp's ggml-cpu/amx/mmq.cpp).
 *
 * Threads split W into units of NW = 32 rows, dequantized to bfloat16 (rounded to nearest
 * even, as the bfloat16 model rounds its weights) once per call:
 *   up to 32 rows of x (decode batches): block column by block column into two L1 buffers,
 *     one column ahead of its tiles, the C tiles held in their registers over all of K;
 *   more rows: the whole unit, row by row, into an A scratch [kp / 32][32][32] (36 KiB at
 *     K = 576, 96 KiB at 1536: L2), then 2 x 2 tiles (32 W rows by 32 rows of x) over every
 *     k step for each 32 rows of x in turn — a last 16 rows of x alone — while the rows of
 *     the thread's next unit are asked for.
 * C tiles are stored, transposed to [m][n] and written with the row scale, bias and output
 * dtype. Tiles (palette 1, all 16 rows of 64 bytes): 0-3 C, 4-5 A, 6-7 B.
 *
 * The tile data state needs Linux's permission (arch_prctl(ARCH_REQ_XCOMP_PERM,
 * XFEATURE_XTILEDATA), Documentation/arch/x86/xstate.rst; without it a tile instruction is
 * SIGILL): quant_amx_config asks once per process and leaves the nest off where it is refused,
 * so quant.c runs its AVX-512 nests. Each call loads the tile configuration on every thread it
 * uses (oneDNN shares those threads and configures its own) and releases it after.
 */
#include "amx.h"

#if HAVE_AMX
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#endif

#define NW 32         /* W rows a unit: two A tiles */
#define TK 32         /* k a step (a tile row: 32 bfloat16) */
#ifndef M_CHUNK
#define M_CHUNK 256   /* rows of x a call takes at once (more: in chunks), so that x's k pairs
                         (K / 2 x 256 x 4 bytes: 768 KiB at K = 1536) stay in L2 while every
                         unit of W streams past them; W is dequantized once per chunk */
#endif

static int amx_min_rows;      /* 0: the nest is off; else the fewest rows of x it takes */

/* Turn the nest on for calls of at least `min_rows` rows of bfloat16 x (0: off). The first
 * time it is turned on in a process, asks Linux for the tile data state. Returns 0; -1 when
 * this build has no AMX; else the errno of the refusal (the nest stays off). */
int quant_amx_config(int min_rows) {
#if HAVE_AMX
    static int permitted;
    if (min_rows > 0 && !permitted) {
        unsigned long bits = 0;
        if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA))
            return errno ? errno : EPERM;
        if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bits) ||
            !(bits & (1ul << XFEATURE_XTILEDATA)))
            return EPERM;
        permitted = 1;
    }
    amx_min_rows = min_rows > 0 ? min_rows : 0;
    return 0;
#else
    (void)min_rows;
    return -1;
#endif
}

/* The fewest rows of bfloat16 x the nest takes; 0 when it is off. */
int quant_amx_min_rows(void) { return amx_min_rows; }

#if HAVE_AMX
void amx_tiles_configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    tile_loadconfig(&c);
}

/* The k pair i of x row r (one 32-bit unit: x[r][2i] low, x[r][2i + 1] high), zero past k. */
INLINE uint32_t x_pair(const uint16_t *x, int64_t x_stride, int64_t r, int64_t i, int64_t k) {
    const uint16_t *p = x + r * x_stride + 2 * i;
    uint32_t u = 0;
    if (2 * i + 1 < k) memcpy(&u, p, 4);
    else if (2 * i < k) u = p[0];
    return u;
}

/* The k pairs [i0, i0 + 16) of xt (the tiles xt + i0 * mp: [mp / 16][16 k pairs][16 rows];
 * zero past m and past k) from x [m, k] bfloat16 (row stride x_stride): whole 16 x 16 tiles
 * by transpose_tile, edges pair by pair. */
static void pack_x(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, int64_t i0,
                   int64_t mp, uint32_t *xt) {
    for (int64_t r0 = 0; r0 < mp; r0 += 16) {
        if (r0 + 16 <= m && 2 * (i0 + 16) <= k && x_stride % 2 == 0) {
            transpose_tile((const float *)(x + r0 * x_stride) + i0, x_stride / 2,
                           (float *)(xt + i0 * mp + r0 * 16), 16);
            continue;
        }
        for (int64_t i = i0; i < i0 + 16; i++)
            for (int64_t r = r0; r < r0 + 16; r++)
                xt[i0 * mp + r0 * 16 + (i - i0) * 16 + (r - r0)] =
                    r < m ? x_pair(x, x_stride, r, i, k) : 0;
    }
}

/* Blocks [b0, b1) of W rows [0, nr) from w (rows of row_bytes; nr <= NW) of one block type
 * as A tiles a [(b1 - b0) * qk / TK][NW][TK] bfloat16, row by row. The 32-value types straight
 * to bfloat16 (dqb_T), the 256-value ones through float32 (dq_T). */
typedef void (*pack_fn)(const uint8_t *, int64_t, int, int64_t, int64_t, uint16_t *);
#define DEFINE_PACK(T, ID, QKT, BYTES)                                                        \
static void pack_##T(const uint8_t *w, int64_t row_bytes, int nr, int64_t b0, int64_t b1,    \
                     uint16_t *a) {                                                           \
    for (int r = 0; r < nr; r++) {                                                            \
        const uint8_t *row = w + r * row_bytes;                                               \
        for (int64_t b = b0; b < b1; b++) {                                                   \
            __builtin_prefetch(row + b * BYTES + PF, 0, 3);                                   \
            PACK_BLOCK_##QKT(T, row + b * BYTES, a + (b - b0) * (QKT / TK) * NW * TK + r * TK); \
        }                                                                                     \
    }                                                                                         \
}
#define PACK_BLOCK_QK(T, src, dst) _mm512_storeu_si512(dst, dqb_##T(src))
#define PACK_BLOCK_QK_K(T, src, dst)                                                           \
    do {                                                                                      \
        float v_[QK_K] __attribute__((aligned(64)));                                          \
        dq_##T(src, v_);                                                                      \
        for (int j = 0; j < QK_K / TK; j++)                                                   \
            _mm512_storeu_si512((dst) + j * NW * TK, (__m512i)_mm512_cvtne2ps_pbh(           \
                _mm512_load_ps(v_ + j * TK + 16), _mm512_load_ps(v_ + j * TK)));            \
    } while (0)
QUANT_TYPES(DEFINE_PACK)

#define PACK_CASE(T, ID, QKT, BYTES) case ID: *qk = QKT; *bytes = BYTES; return pack_##T;
static pack_fn packer(int type, int *qk, int *bytes) {
    switch (type) { QUANT_TYPES(PACK_CASE) default: return NULL; }
}

/* One C tile [16 W rows][16 rows of x] (c) into y: rows r0 .. of x (those < m), columns n0 ..
 * n0 + count - 1, times row_scale, plus bias. */
static void store_c(const float *c, int64_t r0, int64_t m, int64_t n0, int count, void *y,
                    int64_t ldy, int y_f32, const float *row_scale, const float *bias) {
    float t[16 * 16] __attribute__((aligned(64)));
    transpose_tile(c, 16, t, 16);
    const __mmask16 mask = count >= 16 ? 0xffff : (__mmask16)((1u << count) - 1);
    const __m512 sc = row_scale ? _mm512_maskz_loadu_ps(mask, row_scale + n0) : _mm512_set1_ps(1);
    const __m512 bi = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < 16 && r0 + i < m; i++) {
        __m512 v = _mm512_load_ps(t + i * 16);
        if (row_scale) v = _mm512_mul_ps(v, sc);
        if (bias) v = _mm512_add_ps(v, bi);
        if (y_f32) _mm512_mask_storeu_ps((float *)y + (r0 + i) * ldy + n0, mask, v);
        else _mm256_mask_storeu_epi16((uint16_t *)y + (r0 + i) * ldy + n0, mask,
                                      (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* The C tiles of one 32-row block of x (rows mb ..) into y: tiles 0 / 2 (x rows mb .. mb + 15,
 * W rows n0 .. n0 + 15 / n0 + 16 ..), and 1 / 3 (x rows mb + 16 ..) where `two`. */
static void store_tiles(int two, int nr, int64_t mb, int64_t m, int64_t n0, void *y,
                        int64_t ldy, int y_f32, const float *row_scale, const float *bias) {
    float c[4][16 * 16] __attribute__((aligned(64)));
    _tile_stored(0, c[0], 64);
    _tile_stored(2, c[2], 64);
    if (two) {
        _tile_stored(1, c[1], 64);
        _tile_stored(3, c[3], 64);
    }
    const int count0 = nr < 16 ? nr : 16, count1 = nr - count0;
    for (int j = 0; j < 1 + two; j++) {
        store_c(c[j], mb + 16 * j, m, n0, count0, y, ldy, y_f32, row_scale, bias);
        if (count1 > 0)
            store_c(c[2 + j], mb + 16 * j, m, n0 + 16, count1, y, ldy, y_f32, row_scale, bias);
    }
}

/* One k step s of the tiles: A from a (the step's [NW][TK]), B from xt at x rows mb ..;
 * C tiles 0 / 2, and 1 / 3 where `two`. */
INLINE void tile_step(const uint16_t *a, const uint32_t *xt, int64_t s, int64_t mp, int64_t mb,
                      int two) {
    const uint32_t *b = xt + s * 16 * mp + mb * 16;
    TILE_LOADD(4, a, TK * 2);
    TILE_LOADD(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two) {
        TILE_LOADD(7, b + 16 * 16, 64);
        _tile_dpbf16ps(1, 4, 7);
    }
    TILE_LOADD(5, a + 16 * TK, TK * 2);
    _tile_dpbf16ps(2, 5, 6);
    if (two) _tile_dpbf16ps(3, 5, 7);
}

INLINE void tiles_zero(int two) {
    _tile_zero(0);
    _tile_zero(2);
    if (two) {
        _tile_zero(1);
        _tile_zero(3);
    }
}

/* A unit against at most 32 rows of x (mp <= 32: decode batches), streamed: each block
 * column of the unit's rows packed (into one of two buffers of [qk / TK][NW][TK], in L1) one
 * column ahead of its tiles, the C tiles held in their registers over all of K — the A tiles
 * never leave L1 and packing interleaves with the tiles. */
static void unit_streamed(pack_fn pack, const uint8_t *w, int64_t row_bytes, int nr,
                          int64_t nb, int qk, const uint32_t *xt, int64_t mp, int64_t m,
                          int64_t n0, uint16_t *a, const uint8_t *pf, int64_t pf_step,
                          void *y, int64_t ldy, int y_f32, const float *row_scale,
                          const float *bias) {
    const int two = mp == 32, sub = qk / TK;
    const int64_t chunk = (int64_t)sub * NW * TK;
    tiles_zero(two);
    pack(w, row_bytes, nr, 0, 1, a);
    for (int64_t b = 0; b < nb; b++) {
        /* the next column first: a tile load right after the vector stores of its data
         * waited for them to drain (store forwarding does not reach the tiles) */
        if (b + 1 < nb) pack(w, row_bytes, nr, b + 1, b + 2, a + ((b + 1) & 1) * chunk);
        const uint16_t *buf = a + (b & 1) * chunk;
        for (int j = 0; j < sub; j++) {
            prefetch_step(pf, pf_step, b * sub + j);
            tile_step(buf + j * NW * TK, xt, b * sub + j, mp, 0, two);
        }
    }
    store_tiles(two, nr, 0, m, n0, y, ldy, y_f32, row_scale, bias);
}

/* A unit against more rows of x: its A tiles (a, packed whole: [kp / TK][NW][TK]) against
 * every 32 rows of xt in turn. pf: the rows of the thread's next unit, pf_step bytes of them
 * asked for a k step of the first pass. */
static void unit_tiles(const uint16_t *a, int nr, const uint32_t *xt, int64_t steps,
                       int64_t mp, int64_t m, int64_t n0, const uint8_t *pf, int64_t pf_step,
                       void *y, int64_t ldy, int y_f32, const float *row_scale,
                       const float *bias) {
    for (int64_t mb = 0; mb < mp; mb += 32) {
        const int two = mp - mb >= 32;
        tiles_zero(two);
        for (int64_t s = 0; s < steps; s++) {
            if (!mb) prefetch_step(pf, pf_step, s);
            tile_step(a + s * NW * TK, xt, s, mp, mb, two);
        }
        store_tiles(two, nr, mb, m, n0, y, ldy, y_f32, row_scale, bias);
    }
}

/* quant_linear's contract (quant.c) for bfloat16 x through the tiles. Returns 0; -1 out of
 * memory; -2 unknown type. */
int quant_amx_linear(int type, const uint8_t *w, int64_t row_bytes, const float *row_scale,
                     const float *bias, const uint16_t *x, int64_t x_stride, void *y,
                     int64_t ldy, int y_f32, int64_t m, int64_t n, int64_t k, int num_threads) {
    int qk, bytes;
    const pack_fn pack = packer(type, &qk, &bytes);
    if (!pack) return -2;
    if (m > M_CHUNK) {              /* one chunk of x at a time: its k pairs stay in L2 */
        const size_t y_elem = y_f32 ? 4 : 2;
        for (int64_t r0 = 0; r0 < m; r0 += M_CHUNK) {
            const int rc = quant_amx_linear(type, w, row_bytes, row_scale, bias,
                                            x + r0 * x_stride, x_stride,
                                            (char *)y + (size_t)(r0 * ldy) * y_elem, ldy, y_f32,
                                            m - r0 < M_CHUNK ? m - r0 : M_CHUNK, n, k,
                                            num_threads);
            if (rc) return rc;
        }
        return 0;
    }
    const int64_t nb = (k + qk - 1) / qk, kp = nb * qk, mp = (m + 15) / 16 * 16;
    const int64_t steps = kp / TK, units = (n + NW - 1) / NW;
    const int64_t pf_step = prefetch_stride(NW * row_bytes, steps);
    uint32_t *xt = scratch(0, sizeof(uint32_t) * (size_t)(kp / 2 * mp));
    if (!xt) return -1;
    int failed = 0;
    int64_t claim = 0;                 /* the next unit not yet taken (more than 32 rows) */
    _Pragma("omp parallel num_threads(num_threads)")
    {
        _Pragma("omp for schedule(static)")
        for (int64_t i0 = 0; i0 < kp / 2; i0 += 16) pack_x(x, x_stride, m, k, i0, mp, xt);
        /* the unit's A tiles: two block columns (mp <= 32), or all of K */
        const size_t a_bytes = sizeof(uint16_t) * (size_t)(mp <= 32 ? 2 * qk : kp) * NW;
        uint16_t *a = scratch(1, a_bytes);
        if (!a) {
            _Pragma("omp atomic write")
            failed = 1;
        } else {
            amx_tiles_configure();
        }
        if (mp <= 32) {
            _Pragma("omp for schedule(static)")
            for (int64_t u = 0; u < units; u++) {
                if (!a) continue;
                const int64_t n0 = u * NW, nr = n0 + NW < n ? NW : n - n0;
                if (nr < NW) memset(a, 0, a_bytes);
                unit_streamed(pack, w + n0 * row_bytes, row_bytes, (int)nr, nb, qk, xt, mp, m,
                              n0, a, w + (n0 + NW) * row_bytes, pf_step, y, ldy, y_f32,
                              row_scale, bias);
            }
        } else if (a) {
            /* units claimed one at a time from a shared counter: a thread that runs slower
             * — held back by the hypervisor, another process, or its core's tiles — no
             * longer holds a fixed half of W while the other waits at the barrier. Emerald
             * Rapids (2 vCPUs, KVM), the model's 121 products, median of 30 (ms), alternating
             * pairs of processes, static halves -> claims: 128 rows 56-71 -> 37-68 (lower in
             * 12 of 13 pairs), 256 rows 109-130 -> 78-121 (3 of 3), 64 rows 35.4 -> 33.4 (not
             * separable). Each unit is packed whole, row by row, right before its tiles, and
             * the thread's next unit (claimed one ahead) is asked for during them. Packing
             * the next unit's block columns between the tile steps instead did not overlap
             * the two on this host (the nest without its tiles took 13.7 ms, the tiles alone
             * ~11, both 25-26) and read W column-wise across 32 rows; 30 distinct layers'
             * 120 linears (74 MB of Q4_1), in-process A/B of builds, 2 threads: 64 rows
             * 37.7 / 35.2 -> 34.9 / 32.3 ms, 128 rows 60.1 / 60.3 -> 56.3 / 56.6 ms; and the
             * earlier prefetch of "the unit two past this one" had become, with claims, the
             * unit being packed (fixing that alone: 64 rows 24.4 / 31.4 -> 20.9 / 26.9) */
            int64_t u = __atomic_fetch_add(&claim, 1, __ATOMIC_RELAXED);
            while (u < units) {
                const int64_t n0 = u * NW, nr = n0 + NW < n ? NW : n - n0;
                const int64_t v = __atomic_fetch_add(&claim, 1, __ATOMIC_RELAXED);
                if (nr < NW) memset(a, 0, a_bytes);
                pack(w + n0 * row_bytes, row_bytes, (int)nr, 0, nb, a);
                unit_tiles(a, (int)nr, xt, steps, mp, m, n0,
                           w + (v < units ? v : u) * NW * row_bytes, pf_step, y, ldy, y_f32,
                           row_scale, bias);
                u = v;
            }
        }
        if (a) _tile_release();
    }
    return failed ? -1 : 0;
}
#else
int quant_amx_linear(int type, const uint8_t *w, int64_t row_bytes, const float *row_scale,
                     const float *bias, const uint16_t *x, int64_t x_stride, void *y,
                     int64_t ldy, int y_f32, int64_t m, int64_t n, int64_t k, int num_threads) {
    (void)type, (void)w, (void)row_bytes, (void)row_scale;
    (void)bias, (void)x, (void)x_stride, (void)y, (void)ldy, (void)y_f32, (void)m, (void)n;
    (void)k, (void)num_threads;
    return -2;
}
#endif
