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
#else
#define HAVE_AMX 0
#endif

/* quant_amx.c: every tile 16 rows of 64 bytes (palette 1), on the calling thread. */
void amx_tiles_configure(void);

#endif
