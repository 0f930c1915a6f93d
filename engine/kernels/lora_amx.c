/*
 * lora.c's bfloat16 products on AMX tiles, for a full tile of 16 rows of one adapter (hosts
 * with AMX; lora_sgmv_bf16 hands over the tiles they fit, the rest stays on vdpbf16ps):
 *   shrink  tt [16][R] = x [16][in] . A^T: A's rank rows are the tile product's A operand as
 *           they lie ([R][in]), x is transposed into k pairs once; C^T [16 ranks][16 rows]
 *           transposed into tt;
 *   expand  acc [16][cn] = bfloat16(tt[:, r0:r1]) . Bt[r0:r1, cs:cs + cn]: the shrunk ranks
 *           rounded to bfloat16 (as the vector kernel and vLLM's punica kernels round them) are
 *           the A operand, B's rank rows interleaved in pairs into the B layout.
 * Needs in a multiple of 32 up to 4096 and R a multiple of 16 up to 128 (lora_amx_fits: the
 * staging buffers live on the stack); float32 sums.
 */
#include "amx.h"

/* Whether a tile of m rows with these shapes runs here. */
int lora_amx_fits(int m, int in, int R) {
#if HAVE_AMX
    return quant_amx_min_rows() && m == 16 && in % 32 == 0 && in <= 4096 && R % 16 == 0 &&
           R <= 128;
#else
    (void)m, (void)in, (void)R;
    return 0;
#endif
}

#if HAVE_AMX
/* tt [16][R] float32 = xt [16][in] bfloat16 . As [R][in]^T. */
void lora_amx_shrink(const uint16_t *As, int R, int in, const uint16_t *xt, float *tt) {
    uint32_t xp[in / 2 * 16];                 /* x in k pairs: [in / 2][16 rows] */
    float c[16 * 16] __attribute__((aligned(64)));
    for (int k0 = 0; k0 < in / 2; k0 += 16)
        transpose_tile((const float *)xt + k0, in / 2, (float *)(xp + k0 * 16), 16);
    amx_tiles_configure();
    for (int j0 = 0; j0 < R; j0 += 16) {
        _tile_zero(0);
        for (int k = 0; k < in; k += 32) {
            TILE_LOADD(4, As + (int64_t)j0 * in + k, in * 2);
            TILE_LOADD(6, xp + (k / 2) * 16, 64);
            _tile_dpbf16ps(0, 4, 6);
        }
        _tile_stored(0, c, 64);
        transpose_tile(c, 16, tt + j0, R);
    }
    _tile_release();
}

/* acc [16][LORA_CB = 256] float32 (columns < cn) = bfloat16(tt[:, r0:r1]) . B[r0:r1][0:cn]
 * (B's rows out_cols apart). */
void lora_amx_expand(const uint16_t *B, int out_cols, int r0, int r1, int cn, const float *tt,
                     int R, float *acc) {
    const int rp = (r1 - r0 + 31) / 32 * 32, cp = (cn + 15) / 16 * 16;
    uint16_t ta[16 * rp];                     /* the ranks, bfloat16, zero past r1 */
    uint32_t bv[rp / 2 * cp];                 /* B's rows in pairs: [rp / 2][cp] */
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < rp; j++)
            ta[i * rp + j] = r0 + j < r1 ? store_bf16(tt[i * R + r0 + j]) : 0;
    for (int p = 0; p < rp / 2; p++) {
        const int j = r0 + 2 * p;
        for (int c = 0; c < cp; c += 32) {
            const int w = cn - c < 32 ? (cn - c > 0 ? cn - c : 0) : 32;
            const __mmask32 mask = (__mmask32)(w == 32 ? 0xffffffffu : (1u << w) - 1u);
            const __m512i a = j < r1 ? _mm512_maskz_loadu_epi16(mask, B + (int64_t)j * out_cols + c)
                                     : _mm512_setzero_si512();
            const __m512i b = j + 1 < r1 ? _mm512_maskz_loadu_epi16(
                                               mask, B + (int64_t)(j + 1) * out_cols + c)
                                         : _mm512_setzero_si512();
            store_pairs(a, b, bv + p * cp + c, c + 16 < cp);
        }
    }
    amx_tiles_configure();
    tiles_times_pairs(ta, rp, bv, cp, rp, cp, acc, 256);
    _tile_release();
}
#else
void lora_amx_shrink(const uint16_t *As, int R, int in, const uint16_t *xt, float *tt) {
    (void)As, (void)R, (void)in, (void)xt, (void)tt;
}
void lora_amx_expand(const uint16_t *B, int out_cols, int r0, int r1, int cn, const float *tt,
                     int R, float *acc) {
    (void)B, (void)out_cols, (void)r0, (void)r1, (void)cn, (void)tt, (void)R, (void)acc;
}
#endif
