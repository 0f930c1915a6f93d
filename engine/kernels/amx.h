/*
 * AMX tiles for the kernels that use them (quant_amx.c, attention_amx.c): HAVE_AMX (an AMX build
 * for bfloat16: AMX-TILE, AMX-BF16 and AVX512-BF16), the one tile configuration every kernel
 * loads (amx_tiles_configure: palette 1, all eight tiles 16 rows of 64 bytes), and tile loads
 * the compiler orders correctly.
 *
 * GCC 12's <amxtileintrin.h> declares that ldtilecfg reads 8 bytes of its configuration and that
 * tileloadd reads no memory at all, so stores to either may be dropped or sunk past them (here a
 * non-inlined configure lost its rows and column widths: #GP, a SIGSEGV). TILE_LOADD and
 * tile_loadconfig say what they read; _tile_stored already clobbers memory.
 */
#ifndef CONTINUUM_KERNELS_AMX_H
#define CONTINUUM_KERNELS_AMX_H

#include "quant_blocks.h"

#if HAVE_BF16_DOT
/* Two rows a, b of 32 bfloat16 as 32 pairs (a[i], b[i]), the B operand's layout: pairs 0-15
 * at dst, 16-31 at dst + 16 (only the first 16 unless `whole`). */
INLINE void store_pairs(__m512i a, __m512i b, uint32_t *dst, int whole) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                        40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                        32, 0);
    _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, lo, b));
    if (whole)
        _mm512_storeu_si512(dst + 16, _mm512_permutex2var_epi16(
                                          a, _mm512_add_epi16(lo, _mm512_set1_epi16(16)), b));
}
#endif

#if HAVE_BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1

/* tileloadd into tile T (a constant) of 16 rows from base, `stride` bytes apart. */
#define TILE_LOADD(T, base, stride)                                                           \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #T                                        \
                     :: "r"((const void *)(base)), "r"((long)(stride)) : "memory")

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

INLINE void tile_loadconfig(const tile_config *c) {
    __asm__ volatile("ldtilecfg %0" :: "m"(*c));
}

/* c [16][cols] float32 (rows ldc floats apart) = a [16][k] bfloat16 (rows lda elements
 * apart) . b, b in k pairs [k / 2][ldb] 32-bit units (columns 0 .. cols - 1): k a multiple of
 * 32, cols of 16. Two C tiles at a time; tiles 0-1 C, 4 A, 6-7 B (the configuration loaded). */
INLINE void tiles_times_pairs(const uint16_t *a, int lda, const uint32_t *b, int ldb, int k,
                              int cols, float *c, int ldc) {
    for (int c0 = 0; c0 < cols; c0 += 32) {
        const int two = c0 + 16 < cols;
        _tile_zero(0);
        if (two) _tile_zero(1);
        for (int k0 = 0; k0 < k; k0 += 32) {
            TILE_LOADD(4, a + k0, lda * 2);
            TILE_LOADD(6, b + (k0 / 2) * ldb + c0, ldb * 4);
            _tile_dpbf16ps(0, 4, 6);
            if (two) {
                TILE_LOADD(7, b + (k0 / 2) * ldb + c0 + 16, ldb * 4);
                _tile_dpbf16ps(1, 4, 7);
            }
        }
        _tile_stored(0, c + c0, ldc * 4);
        if (two) _tile_stored(1, c + c0 + 16, ldc * 4);
    }
}
#else
#define HAVE_AMX 0
#endif

/* quant_amx.c: every tile 16 rows of 64 bytes (palette 1), on the calling thread. */
void amx_tiles_configure(void);

#endif
