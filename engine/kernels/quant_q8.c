/*
 * The int8-activation path for quantized linears (`--activation-quantization int8`): at decode
 * batch sizes (M <= Q8_MR rows) x is quantized per block of 32 to int8 with one float32 scale,
 * as llama.cpp's q8_0 / q8_1 activations (ggml-quants.c, quantize_row_q8_1: d = max|x| / 127,
 * q = round(x / d) to nearest even, s = d * sum(q)), and each weight block is multiplied in integers with
 * AVX-512 VNNI's vpdpbusd (u8 x s8 -> s32), two blocks per 512-bit vector:
 *
 *   Q4_0:  d_w d_x sum(q_w q_x) - 8 d_w s_x        (w = d_w (q_w - 8))
 *   Q4_1:  d_w d_x sum(q_w q_x) + m_w s_x          (w = d_w q_w + m_w)
 *   Q8_0:  d_w d_x sum(q_w q_x)                    (x offset by 128 to be the u8 operand; the
 *   I8:    d_x sum(q_w q_x) * row_scale             offset's 128 sum(q_w) taken off exactly)
 *
 * The integer dot is exact; the result differs from the float path by x's rounding to int8
 * (relative error about 1/254 of a block's largest |x|). A weight with a packed copy goes to
 * quant_q8_wide.c at every row count (the same arithmetic, W rows across the lanes; it also has
 * an AVX2 build, quant_q8_wide_avx2.h). Other types (Q4_K, Q6_K), builds without AVX-512 VNNI
 * for a weight without the packed copy, and larger M without it go to quant_linear (quant.c)
 * unchanged.
 */
#include "quant_blocks.h"


#if HAVE_AVX512 && defined(__AVX512VNNI__) && defined(__F16C__)
#define HAVE_Q8_DOT 1
#define Q8_MR 8       /* rows of x up to which the int8 path runs */
#define Q8_NC 16      /* rows of W a thread takes at a time */

/* x quantized, for one weight family: per row r and block pair p (blocks 2p, 2p + 1, the last
 * padded with a zero block): 64 int8 (nibble types: [b lo16, b+1 lo16, b hi16, b+1 hi16],
 * matching how a pair's nibbles unpack; 8-bit types: [b 32, b+1 32] plus 128, as u8), the scale
 * pattern of the dot's 16 int32 lanes, and {0, s_b, 0, s_b+1} for the Q4 corrections. */
typedef struct {
    int64_t pairs;
    int8_t *q;        /* [rows][pairs][64] */
    float *dl;        /* [rows][pairs][16] d_x per lane */
    float *s;         /* [rows][pairs][4] */
} q8x;

/* One block of 32 float32 into the q8x layout (`half`: its place in the pair). Rounds to
 * nearest even, as llama.cpp's AVX quantize_row_q8_0 / q8_1 do. */
static void quantize_block(const float *v, int nibble_layout, int half, int8_t *q, float *dl,
                           float *s) {
    __m512i qa, qb;
    const float d = q8_round_block(_mm512_loadu_ps(v), _mm512_loadu_ps(v + 16), &qa, &qb);
    __m128i ba = _mm512_cvtsepi32_epi8(qa), bb = _mm512_cvtsepi32_epi8(qb);
    if (nibble_layout) {          /* values 0..15 then 16..31 of the block, a half apart */
        _mm_storeu_si128((__m128i *)(q + half * 16), ba);
        _mm_storeu_si128((__m128i *)(q + 32 + half * 16), bb);
    } else {                      /* contiguous, offset by 128 to be the u8 operand */
        const __m128i flip = _mm_set1_epi8((char)0x80);
        _mm_storeu_si128((__m128i *)(q + half * 32), _mm_xor_si128(ba, flip));
        _mm_storeu_si128((__m128i *)(q + half * 32 + 16), _mm_xor_si128(bb, flip));
    }
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    for (int l = 0; l < 16; l++)
        if (nibble_layout ? ((l >> 2) & 1) == half : (l >> 3) == half) dl[l] = d;
    s[2 * half + 1] = d * (float)sum;
}

static int quantize_x(const void *x, int64_t x_stride, int x_bf16, int64_t m, int64_t k,
                      int nibble_layout, q8x *out) {
    const int64_t nb = (k + QK - 1) / QK, pairs = (nb + 1) / 2;
    out->pairs = pairs;
    /* one zeroed buffer on a cache line, this thread's scratch (kept from call to call, not
     * a heap block a call): q, dl (64 bytes a pair each: every load whole lines), then s */
    const size_t bytes = (size_t)(m * pairs) * (64 + 16 * sizeof(float) + 4 * sizeof(float));
    int8_t *buf = scratch(0, bytes);
    if (buf) memset(buf, 0, bytes);
    out->q = buf;
    out->dl = buf ? (float *)(buf + m * pairs * 64) : NULL;
    out->s = buf ? out->dl + m * pairs * 16 : NULL;
    /* x as float32 rows zero-padded to whole blocks: quant.c's copy, in this thread's scratch */
    const float *xf = buf ? quant_copy_x(x, x_stride, x_bf16, m, m, k, nb * QK, 0, 0) : NULL;
    if (!xf) return -1;
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t p = r * pairs + b / 2;
            quantize_block(xf + (r * nb + b) * QK, nibble_layout, (int)(b & 1), out->q + p * 64,
                           out->dl + p * 16, out->s + p * 4);
        }
    if (!nibble_layout && (nb & 1))          /* the pad block's x is 0: u8 128, not 0 */
        for (int64_t r = 0; r < m; r++)
            memset(out->q + (r * pairs + pairs - 1) * 64 + 32, 128, 32);
    return 0;
}

/* A pair's weights as 64 bytes in the lane order above (nibble types: u8 0..15). */
INLINE __m512i pair_nibbles(const uint8_t *qs0, const uint8_t *qs1) {
    const __m256i t = _mm256_loadu2_m128i((const __m128i *)qs1, (const __m128i *)qs0);
    const __m256i lo4 = _mm256_set1_epi8(0x0f);
    const __m256i lo = _mm256_and_si256(t, lo4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(t, 4), lo4);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
INLINE __m512i pair_int8(const uint8_t *qs0, const uint8_t *qs1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)qs0)),
                              _mm256_loadu_si256((const __m256i *)qs1), 1);
}
/* {d0, m0, d1, m1} of a pair from two 4-byte fp16 headers (m ignored where there is none). */
INLINE __m128 pair_header(const uint8_t *b0, const uint8_t *b1) {
    uint32_t h0, h1;
    memcpy(&h0, b0, 4);
    memcpy(&h1, b1, 4);
    return _mm_cvtph_ps(_mm_set_epi32(0, 0, (int)h1, (int)h0));
}

/* out[r] (r < mr) = dot of one W row with x's rows; TYPE selects the block layout. */
INLINE void q8_row(int type, const uint8_t *wrow, int64_t nb, const q8x *xq, int mr,
                   float *out) {
    const int nib = type == T_Q4_0 || type == T_Q4_1;
    const int bytes = block_bytes(type);
    const __m512i dpat = nib ? _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2)
                             : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m128 mmask = type == T_Q4_1 ? _mm_castsi128_ps(_mm_setr_epi32(0, -1, 0, -1))
                                        : _mm_setzero_ps();
    __m512 acc[Q8_MR];
    __m128 cor[Q8_MR];
    for (int r = 0; r < mr; r++) { acc[r] = _mm512_setzero_ps(); cor[r] = _mm_setzero_ps(); }
    const __m512i off = _mm512_set1_epi8((char)0x80);
    for (int64_t p = 0; p < xq->pairs; p++) {
        const uint8_t *b0 = wrow + 2 * p * bytes;
        const int has1 = 2 * p + 1 < nb;
        const uint8_t *b1 = has1 ? b0 + bytes : b0;       /* a lone last block pairs with itself */
        __builtin_prefetch(b0 + PF, 0, 3);
        __m512i wv;
        __m512 dv;
        __m128 hdr = _mm_setzero_ps();
        if (type == T_I8) {
            wv = pair_int8(b0, b1);
            dv = _mm512_set1_ps(1.f);
        } else {
            hdr = pair_header(b0, b1);
            if (type == T_Q4_0) hdr = _mm_blend_ps(hdr, _mm_setzero_ps(), 0xa);
            wv = nib ? pair_nibbles(b0 + (type == T_Q4_1 ? 4 : 2), b1 + (type == T_Q4_1 ? 4 : 2))
                     : pair_int8(b0 + 2, b1 + 2);
            dv = _mm512_permutexvar_ps(dpat, _mm512_castps128_ps512(hdr));
        }
        /* Q8 types: start each row's dot at -128 sum(q_w) per lane (x is offset by 128) */
        const __m512i init = nib ? _mm512_setzero_si512()
                                 : _mm512_sub_epi32(_mm512_setzero_si512(),
                                                    _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                                        off, wv));
        /* Q4 corrections: {d0, m0, d1, m1} times {0, s0, 0, s1}: Q4_1 m s, Q4_0 -8 d s */
        const __m128 cw = type == T_Q4_0
            ? _mm_mul_ps(_mm_set1_ps(-8.f), _mm_moveldup_ps(hdr))
            : _mm_and_ps(hdr, mmask);
        for (int r = 0; r < mr; r++) {
            const int64_t at = r * xq->pairs + p;
            const __m512i xv = _mm512_loadu_si512(xq->q + at * 64);
            const __m512i dot = nib ? _mm512_dpbusd_epi32(init, wv, xv)
                                    : _mm512_dpbusd_epi32(init, xv, wv);
            const __m512 scale = _mm512_mul_ps(dv, _mm512_loadu_ps(xq->dl + at * 16));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
            if (nib) cor[r] = _mm_fmadd_ps(cw, _mm_loadu_ps(xq->s + at * 4), cor[r]);
        }
        if (!has1) break;
    }
    for (int r = 0; r < mr; r++) {
        const __m128 c = _mm_add_ps(cor[r], _mm_movehl_ps(cor[r], cor[r]));
        out[r] = _mm512_reduce_add_ps(acc[r]) + _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
    }
}

static void q8_chunk(int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1,
                     int64_t nb, const q8x *xq, int64_t m, void *y, int64_t ldy, int y_f32,
                     const float *row_scale, const float *bias) {
    float out[Q8_MR];
    for (int64_t j = n0; j < n1; j++) {
        const uint8_t *wrow = w + j * row_bytes;
        switch (type) {     /* constant type and row count once inlined */
#define Q8_CASE(T)                                                                            \
        case T:                                                                               \
            switch (m) {                                                                      \
            case 1: q8_row(T, wrow, nb, xq, 1, out); break;                                   \
            case 2: q8_row(T, wrow, nb, xq, 2, out); break;                                   \
            case 3: q8_row(T, wrow, nb, xq, 3, out); break;                                   \
            case 4: q8_row(T, wrow, nb, xq, 4, out); break;                                   \
            case 5: q8_row(T, wrow, nb, xq, 5, out); break;                                   \
            case 6: q8_row(T, wrow, nb, xq, 6, out); break;                                   \
            case 7: q8_row(T, wrow, nb, xq, 7, out); break;                                   \
            default: q8_row(T, wrow, nb, xq, 8, out); break;                                  \
            }                                                                                 \
            break;
        Q8_CASE(T_Q4_0) Q8_CASE(T_Q4_1) Q8_CASE(T_Q8_0) Q8_CASE(T_I8)
#undef Q8_CASE
        }
        for (int64_t r = 0; r < m; r++)
            store_out(y, ldy, y_f32, r, j, out[r], row_scale, bias);
    }
}
#else
#define HAVE_Q8_DOT 0
#define Q8_MR 0
#endif

/* The int8-activation kernels this build has: 1 both nests (AVX-512 VNNI), 2 only
 * quant_q8_wide.c's over packed weights (AVX2: quant_q8_wide_avx2.h), 0 none. */
int quant_q8_available(void) {
    return HAVE_Q8_DOT ? 1 : quant_q8_packed_bytes(T_Q4_0, 16, QK) > 0 ? 2 : 0;
}

/* quant_linear's contract with x quantized to int8 per block of 32 (see the file comment) where
 * the type is Q4_0, Q4_1, Q8_0 or I8: quant_q8_wide.c's nest (AVX-512 VNNI or AVX2) over
 * `packed` (W as quant_q8_pack wrote it; NULL: none) at every row count — on an AMX host
 * too, where bfloat16 x without int8 activations takes the tiles — else at m <= Q8_MR this
 * file's; otherwise exactly quant_linear. Returns 0; -1 out of memory; -2 unknown type.
 *
 * Every row count, not only where the wide nest is faster (this file's nest was, at 1-2 rows
 * over float32 scales): a row's sums must not depend on the rows beside it. With int8 x a
 * different float32 summation order rounds the next layer's x to a neighbouring integer and
 * moves logits by up to ~0.1, so seeded sampling alone would differ from the same request in a
 * batch, and speculative verification from the plain decode. */
int quant_linear_q8(int type, const uint8_t *w, int64_t row_bytes, const float *row_scale,
                    const float *bias, const void *x, int64_t x_stride, int x_bf16, void *y,
                    int64_t ldy, int y_f32, int64_t m, int64_t n, int64_t k, int num_threads,
                    const uint8_t *packed) {
    const int supported = type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0 || type == T_I8;
    if (supported && packed && m >= 1)     /* packed: only where the wide nest is */
        return quant_q8_wide(type, packed, bias, x, x_stride, x_bf16, y, ldy, y_f32, m, n, k,
                             num_threads);
    if (!HAVE_Q8_DOT || !supported || m > Q8_MR || m < 1)
        return quant_linear(type, w, row_bytes, row_scale, bias, x, x_stride, x_bf16, y, ldy,
                            y_f32, m, n, k, num_threads);
#if HAVE_Q8_DOT
    q8x xq;
    int rc = quantize_x(x, x_stride, x_bf16, m, k, type == T_Q4_0 || type == T_Q4_1, &xq);
    if (rc == 0) {
        const int64_t nb = (k + QK - 1) / QK, chunks = (n + Q8_NC - 1) / Q8_NC;
        _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n0 = c * Q8_NC, n1 = n0 + Q8_NC < n ? n0 + Q8_NC : n;
            q8_chunk(type, w, row_bytes, n0, n1, nb, &xq, m, y, ldy, y_f32, row_scale, bias);
        }
    }
    return rc;
#else
    return 0;
#endif
}
