/*
 * quant_q8_wide.c's nest for AVX2 hosts (x86-64-v3: AVX2, FMA, F16C; no VNNI) — AMD EPYC Rome
 * and Milan, Intel Haswell / Broadwell. The same packed W and the same quantized x; the
 * integer dot without vpdpbusd, as llama.cpp's AVX2 q4_0 / q8_0 dots (ggml-cpu/arch/x86/
 * quants.c, mul_sum_i8_pairs): vpmaddubsw (u8 x s8, adjacent pairs summed to int16), then
 * vpmaddwd by ones (pairs of int16 to int32). A 16-row group is two 256-bit halves.
 *
 *   Q4_0 / Q4_1: W's nibbles (0..15) are the unsigned operand, x the signed one: a pair's sum
 *     is at most 2 * 15 * 127 = 3810, so a block's 8 vpmaddubsw (4 chunks, low and high
 *     nibbles) sum in int16 (30480 < 32767) before one vpmaddwd.
 *   Q8_0 / I8: W is packed as q + 128; its sign is restored (xor 0x80) and carried onto x
 *     (vpsignb), |q| the unsigned operand: a pair's sum is at most 2 * 128 * 127 = 32512, so
 *     each chunk goes to int32 at once. No -128 sum(q_x) term: the dot is sum(q_w q_x).
 * The integer dots are exact, and the float32 steps after them the AVX-512 nest's, lane for
 * lane: the two builds give the same y bits. x's quantization is q8_round_block's (multiply
 * by 1/d, round to nearest even), with 8-lane vectors.
 */

/* Bytes ahead of the (group, block) being read that a tile prefetches W, line by line: a
 * thread's groups are one sequential stream, yet the hardware prefetchers alone left it short.
 * Zen 3 (AVX2) under KVM, the embedded model's 121 products in huge pages, benchmarks/
 * kernel_ab.py --int8-x --huge-pages, per-round time against no prefetch (median of 20-30
 * rounds): 1 row 0.950 / 0.954 / 0.967 at 1 / 2 / 4 KiB, 4 rows 0.947 / 0.897 (1 / 2 KiB),
 * 16 rows 0.981 / 0.966; in 4 KiB pages, 1 row 0.910 / 0.895 / 0.911. */
#ifndef WIDE_PF
#define WIDE_PF 2048
#endif

/* 8 values of x from element i of a row (bfloat16 or float32): vec.h's AVX2 vload_bf16 /
 * vload_f32, which an AVX-512 build (a Skylake, no VNNI, also runs this file) defines 16 wide. */
INLINE __m256 load8(const void *x, int x_bf16, int64_t i) {
    if (x_bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)x + i);
}

/* One block of x (v: 32 values, 4 vectors) into q [32], *d_out, *s_out, *c_out. */
INLINE void quantize_block_avx2(const __m256 v[4], int8_t *q, float *d_out, float *s_out,
                                int32_t *c_out) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 mx = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
    mx = _mm256_max_ps(mx, _mm256_max_ps(_mm256_andnot_ps(sign, v[2]),
                                         _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    const __m256 inv = _mm256_set1_ps(id);
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256i qi[4];
    for (int j = 0; j < 4; j++)
        qi[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], inv), rn));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                   _mm256_add_epi32(qi[2], qi[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    const int32_t total = _mm_cvtsi128_si32(s4);
    /* int32 -> int8 in order: the packs interleave 128-bit lanes, the permute undoes it */
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                         _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(
                            p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *d_out = d;
    *s_out = d * (float)total;
    *c_out = -128 * total;
}

/* The block of x at element i of `row` (its first `cnt` values; the rest 0) quantized. */
INLINE void quantize_block_at(const char *row, int x_bf16, int64_t i, int cnt, int8_t *q,
                              float *d, float *s, int32_t *c) {
    __m256 v[4];
    if (cnt == QK) {
        for (int j = 0; j < 4; j++) v[j] = load8(row, x_bf16, i + 8 * j);
    } else {              /* the last block of a K that is not a multiple of 32, or padding */
        float tail[QK] = {0};
        for (int j = 0; j < cnt; j++)
            tail[j] = x_bf16 ? load_bf16(((const uint16_t *)row)[i + j])
                             : ((const float *)row)[i + j];
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(tail + 8 * j);
    }
    quantize_block_avx2(v, q, d, s, c);
}

INLINE __m256i bcast4_256(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The 8 lanes' d of half h as float32 (exact, as the blocks' float16; I8: float32 scales). */
INLINE __m256 lane_d8(int type, const uint8_t *sc, int h) {
    return type == T_I8 ? _mm256_loadu_ps((const float *)sc + 8 * h)
                        : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 16 * h)));
}

/* The Q4 types' 8 lanes' m of half h: Q4_1's own, Q4_0's -8 d. */
INLINE __m256 lane_m8(int type, const uint8_t *sc, int h, __m256 d) {
    return type == T_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 32 + 16 * h)))
                          : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
}

/* The int32 dots of one (group, block) at `p` against x rows r (< mr) at xq (row stride rs
 * bytes): dot[h][r] for the group's halves h. */
INLINE void block_dots(int type, const uint8_t *p, const int8_t *xq, int64_t rs, const int mr,
                       __m256i dot[2][XT]) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (is_nibble(type)) {
        const __m256i lo4 = _mm256_set1_epi8(0x0f);
        __m256i acc[2][XT];
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < mr; r++) acc[h][r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++)
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(p + c * 64 + 32 * h));
                const __m256i lo = _mm256_and_si256(v, lo4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
                for (int r = 0; r < mr; r++) {
                    const __m256i xl = bcast4_256(xq + r * rs + 4 * c);
                    const __m256i xh = bcast4_256(xq + r * rs + 16 + 4 * c);
                    acc[h][r] = _mm256_add_epi16(acc[h][r], _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
                }
            }
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < mr; r++) dot[h][r] = _mm256_madd_epi16(acc[h][r], ones);
        return;
    }
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < mr; r++) dot[h][r] = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++)
        for (int h = 0; h < 2; h++) {
            const __m256i w = _mm256_xor_si256(
                _mm256_loadu_si256((const __m256i *)(p + c * 64 + 32 * h)), flip);
            const __m256i aw = _mm256_sign_epi8(w, w);
            for (int r = 0; r < mr; r++) {
                const __m256i xs = _mm256_sign_epi8(bcast4_256(xq + r * rs + 4 * c), w);
                dot[h][r] = _mm256_add_epi32(
                    dot[h][r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));
            }
        }
}

/* acc[h][r] (the 16 W rows of the group at pk, as two halves, against x row r0 + r, r < mr)
 * over all nb blocks. */
INLINE void wide_tile(int type, const uint8_t *pk, int64_t nb, const xwide *x, int64_t r0,
                      const int mr, __m256 acc[2][XT]) {
    const int64_t gbb = gb_bytes(type), qb = q_bytes(type);
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < mr; r++) acc[h][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = pk + b * gbb;
        for (int64_t o = 0; o < gbb; o += 64)           /* see WIDE_PF */
            _mm_prefetch((const char *)p + WIDE_PF + o, _MM_HINT_T0);
        __m256i dot[2][XT];
        block_dots(type, p, x->q + (r0 * nb + b) * QK, nb * QK, mr, dot);
        for (int r = 0; r < mr; r++) {
            const int64_t at = (r0 + r) * nb + b;
            const __m256 dx = _mm256_set1_ps(x->d[at]), sx = _mm256_set1_ps(x->s[at]);
            for (int h = 0; h < 2; h++) {
                const __m256 dw = lane_d8(type, p + qb, h);
                acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][r]),
                                            _mm256_mul_ps(dw, dx), acc[h][r]);
                if (is_nibble(type))
                    acc[h][r] = _mm256_fmadd_ps(lane_m8(type, p + qb, h, dw), sx, acc[h][r]);
            }
        }
    }
}

/* y rows [r0, r0 + mr), columns of tile t (16 W rows from n0 = 16 t), for a constant type. */
INLINE void wide_tile_store(int type, const uint8_t *packed, int64_t t, int64_t nb,
                            const xwide *x, int64_t r0, int mr, int64_t n, void *y, int64_t ldy,
                            int y_f32, const float *bias) {
    __m256 acc[2][XT];
    const uint8_t *pk = packed + t * nb * gb_bytes(type);
    switch (mr) {      /* constant row counts: the accumulators stay in registers */
    case 1: wide_tile(type, pk, nb, x, r0, 1, acc); break;
#if XT > 2
    case 2: wide_tile(type, pk, nb, x, r0, 2, acc); break;
    case 3: wide_tile(type, pk, nb, x, r0, 3, acc); break;
#endif
    default: wide_tile(type, pk, nb, x, r0, XT, acc); break;
    }
    const int64_t n0 = t * GR;
    const int count = n - n0 < GR ? (int)(n - n0) : GR;
    for (int r = 0; r < mr && count > 0; r++) {
        float v[GR];
        _mm256_storeu_ps(v, acc[0][r]);
        _mm256_storeu_ps(v + 8, acc[1][r]);
        store_row(v, count, y, ldy, y_f32, r0 + r, n0, NULL, bias);
    }
}
