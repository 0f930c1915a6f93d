/*
 * Prefill attention in bfloat16 pair products: on AMX tiles where the host has AMX (and the
 * process its permission), else in AVX512-BF16's vdpbf16ps (an AMD EPYC; not on an Intel core
 * without tiles, see attention_vector_pairs), the same layouts and steps with vector register
 * tiles for the two products (cpu_kernels.c's paged_decode_bf16 and paged_decode8_bf16 hand
 * it the rows it can take and run the rest on their vector loops; an 8-bit cache's rows are
 * dequantized to bfloat16 as they are gathered, 16 at a time).
 *
 * A run is a maximal group of consecutive rows that attend to one sequence's cached prefix
 * with lengths one apart — a prefill chunk's tokens (row b + 1 continues row b's run when its
 * context is one token longer and its block table is the same over that context; rows with
 * equal tables read the same K / V, so the grouping is exact whatever their requests). Runs
 * of MIN_RUN rows or more take the tiles, per KV head:
 *   prep   K^T in k pairs, kt [D / 2][cp] 32-bit units, and V in key pairs, vv [cp / 2][D]
 *          (AMX's B layout, TDPBF16PS), from the paged cache, once per run and KV head
 *          (cp: the run's longest context rounded up to 32; zero past it);
 *   blocks of 16 rows of one query head: S [16][cp] = Q K^T (tiles, float32), then per row the
 *          scaled, causally masked softmax (float32, two passes: max, then exp and sum) into P
 *          [16][cp] bfloat16, then O = P V (tiles) divided by the row's sum.
 * The same product as the vector loops with P rounded to bfloat16 before P V (as
 * FlashAttention's bfloat16 kernels do; Dao et al., 2022). Tile configuration: quant_amx.c's
 * (every tile 16 rows of 64 bytes), loaded on each thread and released after.
 */
#include "amx.h"

#define MIN_RUN 16    /* rows of a run from which its attention takes the tiles */

#if defined(__x86_64__)
#pragma omp declare simd notinbranch
float expf(float);
#endif

static int64_t amx_attention_rows;       /* rows attended here so far (tests read it) */
static int vector_pairs = 1;             /* runs in vdpbf16ps where the tiles are off */

/* Whether prefill runs take AVX512-BF16's vdpbf16ps where AMX is off (1, the default) or stay
 * on the float32 vector loops (0): on an Intel core (engine.kernels.isa.slow_bf16_dot) the
 * instruction runs at half float32 FMAs' rate, and there the quantized linears take int8
 * activations, which turn the pairs' rounding of P into a changed token — the runs of a
 * prompt read from the prefix cache, too short for the pairs, would not give its uncached
 * tokens. AMX tiles are not affected. */
void attention_vector_pairs(int on) { vector_pairs = on; }

/* Rows of prefill attention run here (tiles or vdpbf16ps) since the library loaded. */
int64_t attention_amx_rows(void) { return amx_attention_rows; }

#if HAVE_BF16_DOT
typedef struct { int row, len; } run_t;

/* The runs of MIN_RUN rows or more among num_seqs rows (see the file comment) into runs;
 * returns how many. */
static int find_runs(const int32_t *tables, int max_blocks, const int32_t *ctx_lens,
                     int num_seqs, int block_size, run_t *runs) {
    int n = 0;
    for (int b = 0; b < num_seqs;) {
        int e = b + 1;
        const int32_t *first = tables + (int64_t)b * max_blocks;
        while (e < num_seqs && ctx_lens[e] == ctx_lens[e - 1] + 1 &&
               !memcmp(tables + (int64_t)e * max_blocks, first,
                       sizeof(int32_t) * (size_t)((ctx_lens[e] + block_size - 1) / block_size)))
            e++;
        if (e - b >= MIN_RUN) runs[n++] = (run_t){b, e - b};
        b = e;
    }
    return n;
}

/* Key t's row of one KV head's cache (through the block table; rows of rb bytes). */
INLINE const uint8_t *key_row(const uint8_t *base, const int32_t *table, int t, int bs,
                              int64_t rb) {
    return base + ((int64_t)table[t / bs] * bs + t % bs) * rb;
}

/* The cache's element type: 0 bfloat16, else an 8-bit cache (common.h's KV_*) whose rows
 * are dequantized to bfloat16 here (times an int8 row's own scale; V's also times v_factor,
 * its per-tensor read scale — K's is in the softmax scale). */
typedef struct { int kind; float v_factor; } cache_kind;

/* Rows [t0, t0 + n) of one KV head's cache as n x D bfloat16: in place for a bfloat16 cache
 * (a block's rows are consecutive), else dequantized into buf. */
static const uint16_t *rows16(const uint8_t *base, const int32_t *table, int t0, int n, int bs,
                              int D, int kind, float factor, uint16_t *buf) {
    if (!kind) return (const uint16_t *)key_row(base, table, t0, bs, 2 * (int64_t)D);
    const int64_t rb = kv_row_bytes(kind, D);
    for (int j = 0; j < n; j++) {
        const uint8_t *r = key_row(base, table, t0 + j, bs, rb);
        uint16_t *o = buf + j * D;
        if (kind == KV_INT8) {
            const float f = factor * f16_at(r + D);
            for (int d = 0; d < D; d++) o[d] = store_bf16(load_i8(r[d]) * f);
        } else if (kind == KV_E4M3) {
            for (int d = 0; d < D; d++) o[d] = store_bf16(load_e4m3(r[d]) * factor);
        } else {
            for (int d = 0; d < D; d++) o[d] = store_bf16(load_e5m2(r[d]) * factor);
        }
    }
    return buf;
}

/* kt [D / 2][cp] (dword = keys t's d pair) and vv [cp / 2][D] (dword = keys 2j, 2j + 1 at d)
 * for keys [0, ctx) of one KV head, zero past ctx. */
static void prep_kv(const uint8_t *kbase, const uint8_t *vbase, const int32_t *table,
                    int ctx, int cp, int bs, int D, cache_kind ck, uint32_t *kt, uint32_t *vv) {
    uint16_t kbuf[16 * 256], vbuf[16 * 256];       /* 16 dequantized rows (8-bit caches) */
    for (int dp = 0; dp < D / 2; dp++)                 /* the padding only: keys [ctx, cp) */
        memset(kt + (int64_t)dp * cp + ctx, 0, sizeof(uint32_t) * (size_t)(cp - ctx));
    memset(vv + (int64_t)(ctx + 1) / 2 * D, 0, sizeof(uint32_t) * (size_t)(cp / 2 - (ctx + 1) / 2)
                                             * (size_t)D);
    for (int t0 = 0; t0 < ctx; t0 += 16) {               /* 16 keys: one block's (bs % 16 == 0) */
        const int n = ctx - t0 < 16 ? ctx - t0 : 16;
        const uint16_t *k = rows16(kbase, table, t0, n, bs, D, ck.kind, 1.f, kbuf);
        if (t0 + 16 <= ctx)
            for (int d0 = 0; d0 < D / 2; d0 += 16)
                transpose_tile((const float *)k + d0, D / 2, (float *)(kt + d0 * cp + t0), cp);
        else
            for (int t = t0; t < ctx; t++)
                for (int dp = 0; dp < D / 2; dp++)
                    memcpy(kt + dp * cp + t, k + (t - t0) * D + 2 * dp, 4);
        const uint16_t *v = rows16(vbase, table, t0, n, bs, D, ck.kind, ck.v_factor, vbuf);
        for (int t = t0; t < t0 + 16 && t < ctx; t += 2) {
            const uint16_t *v0 = v + (t - t0) * D;
            for (int d = 0; d < D; d += 32) {
                const __m512i a = _mm512_loadu_si512(v0 + d);
                const __m512i b = t + 1 < ctx ? _mm512_loadu_si512(v0 + D + d)
                                              : _mm512_setzero_si512();
                store_pairs(a, b, vv + (t / 2) * D + d, 1);
            }
        }
    }
}

/* The largest of s [n] (-inf for n = 0; NaNs skipped, as `s[t] > m ? s[t] : m` would): two
 * vector chains, where the scalar loop's one vmaxss chain (4 cycles an element) took 60 % of
 * this file's time in a 2k-token prefill. */
static float row_max(const float *s, int n) {
    __m512 a = _mm512_set1_ps(-INFINITY), b = a;
    int t = 0;
    for (; t + 32 <= n; t += 32) {          /* max_ps(x, m): m where x is NaN */
        a = _mm512_max_ps(_mm512_loadu_ps(s + t), a);
        b = _mm512_max_ps(_mm512_loadu_ps(s + t + 16), b);
    }
    for (; t < n; t += 16) {
        const __mmask16 k = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
        a = _mm512_max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, s + t), a);
    }
    return _mm512_reduce_max_ps(_mm512_max_ps(a, b));
}

/* Row i of S (length[i] keys seen): p [cp] bfloat16 = exp(scale * s - max), zero from
 * length[i] up to `keys`; returns the sum of the unrounded terms. */
static float softmax_row(const float *s, int length, int keys, float scale, uint16_t *p,
                         float *tmp) {
    const float m = row_max(s, length);
    float sum = 0.f;
    const float ms = m * scale;
#pragma omp simd reduction(+:sum)
    for (int t = 0; t < length; t++) {
        const float e = expf(s[t] * scale - ms);
        tmp[t] = e;
        sum += e;
    }
    int t = 0;
    for (; t + 16 <= length; t += 16)
        _mm256_storeu_si256((__m256i *)(p + t),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(tmp + t)));
    for (; t < length; t++) p[t] = store_bf16(tmp[t]);
    memset(p + length, 0, sizeof(uint16_t) * (size_t)(keys - length));
    return sum;
}

/* c [mr][16 * nv] (rows ldc floats apart, from column c0) = a [mr][k] bfloat16 (rows lda
 * elements apart) . b in k pairs [k / 2][ldb] 32-bit units (from column c0): mr <= 8 rows by
 * nv <= 4 vectors of 16 float32 sums, vdpbf16ps; mr and nv constants once inlined. */
INLINE void pairs_tile(const uint16_t *a, int64_t lda, const uint32_t *b, int64_t ldb, int k,
                       int c0, const int mr, const int nv, float *c, int64_t ldc) {
    __m512 acc[8][4];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = _mm512_setzero_ps();
    for (int kp = 0; kp < k / 2; kp++) {
        __m512bh bv[4];
        for (int v = 0; v < nv; v++)
            bv[v] = (__m512bh)_mm512_loadu_si512(b + kp * ldb + c0 + 16 * v);
        for (int r = 0; r < mr; r++) {
            int32_t pair;
            memcpy(&pair, a + r * lda + 2 * kp, 4);
            const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], bv[v], x);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(c + r * ldc + c0 + 16 * v, acc[r][v]);
}

/* tiles_times_pairs (amx.h) in vdpbf16ps, for the first `rows` rows of a (rounded up to 8):
 * Q K^T in register tiles of 8 rows by 32 keys. */
static void vec_times_pairs(const uint16_t *a, int lda, const uint32_t *b, int ldb, int k,
                            int cols, int rows, float *c, int ldc) {
    for (int r0 = 0; r0 < rows; r0 += 8)
        for (int c0 = 0; c0 < cols; c0 += 32) {
            const uint16_t *ar = a + r0 * lda;
            if (c0 + 16 < cols) pairs_tile(ar, lda, b, ldb, k, c0, 8, 2, c + r0 * ldc, ldc);
            else pairs_tile(ar, lda, b, ldb, k, c0, 8, 1, c + r0 * ldc, ldc);
        }
}

/* values_tiles in vdpbf16ps for the first `rows` rows (rounded up to 4; P's rows past them
 * are zero): O = P V in register tiles of 4 rows by 64 d (D a multiple of 32). */
static void values_vec(const uint16_t *p, int cp, int keys, const uint32_t *vv, int D, int rows,
                       float *o) {
    for (int r0 = 0; r0 < rows; r0 += 4)
        for (int d0 = 0; d0 < D; d0 += 64) {
            const uint16_t *pr = p + (int64_t)r0 * cp;
            if (D - d0 >= 64) pairs_tile(pr, cp, vv, D, keys, d0, 4, 4, o + r0 * D, D);
            else pairs_tile(pr, cp, vv, D, keys, d0, 4, 2, o + r0 * D, D);
        }
}

#if HAVE_AMX
/* O [16][D] float32 = P [16][keys] . V (keys a multiple of 32), up to 4 tiles of d at a time. */
static void values_tiles(const uint16_t *p, int cp, int keys, const uint32_t *vv, int D,
                         float *o) {
    for (int d0 = 0; d0 < D; d0 += 64) {
        const int nt = (D - d0) / 16 < 4 ? (D - d0) / 16 : 4;
        _tile_zero(0);
        if (nt > 1) _tile_zero(1);
        if (nt > 2) _tile_zero(2);
        if (nt > 3) _tile_zero(3);
        for (int t0 = 0; t0 < keys; t0 += 32) {
            const uint32_t *b = vv + (t0 / 2) * D + d0;
            TILE_LOADD(4, p + t0, cp * 2);
            TILE_LOADD(6, b, D * 4);
            _tile_dpbf16ps(0, 4, 6);
            if (nt > 1) { TILE_LOADD(7, b + 16, D * 4); _tile_dpbf16ps(1, 4, 7); }
            if (nt > 2) { TILE_LOADD(6, b + 32, D * 4); _tile_dpbf16ps(2, 4, 6); }
            if (nt > 3) { TILE_LOADD(7, b + 48, D * 4); _tile_dpbf16ps(3, 4, 7); }
        }
        _tile_stored(0, o + d0, D * 4);
        if (nt > 1) _tile_stored(1, o + d0 + 16, D * 4);
        if (nt > 2) _tile_stored(2, o + d0 + 32, D * 4);
        if (nt > 3) _tile_stored(3, o + d0 + 48, D * 4);
    }
}
#endif

/* Scratch of one thread: q16 [16][D] bf16, s [16][cp] float32, p [16][cp] bf16, o [16][D]
 * float32, tmp [cp] float32. */
typedef struct { uint16_t *q16, *p; float *s, *o, *tmp; } block_scratch;

/* One block of up to 16 rows (tokens i0 .. of run r) of query head h (KV head kh). */
static void attend_block(const uint16_t *q, int64_t q_stride, const int32_t *ctx_lens, run_t r,
                         int i0, int h, const uint32_t *kt, const uint32_t *vv, int cp, int D,
                         float scale, const block_scratch *w, uint16_t *out, int num_heads,
                         int tiles) {
    const int rows = r.len - i0 < 16 ? r.len - i0 : 16;
    const int longest = ctx_lens[r.row + i0 + rows - 1];
    const int keys = (longest + 31) / 32 * 32;
    memset(w->q16, 0, sizeof(uint16_t) * 16 * (size_t)D);
    for (int i = 0; i < rows; i++)
        memcpy(w->q16 + i * D, q + (int64_t)(r.row + i0 + i) * q_stride + (int64_t)h * D,
               sizeof(uint16_t) * (size_t)D);
#if HAVE_AMX
    if (tiles) tiles_times_pairs(w->q16, D, kt, cp, D, (longest + 15) / 16 * 16, w->s, cp);
    else
#endif
        vec_times_pairs(w->q16, D, kt, cp, D, (longest + 15) / 16 * 16, rows, w->s, cp);
    float inv[16];
    for (int i = 0; i < 16; i++) {
        uint16_t *p = w->p + (int64_t)i * cp;
        if (i >= rows) {
            memset(p, 0, sizeof(uint16_t) * (size_t)keys);
            continue;
        }
        const float sum = softmax_row(w->s + (int64_t)i * cp, ctx_lens[r.row + i0 + i], keys,
                                      scale, p, w->tmp);
        inv[i] = sum > 0.f ? 1.f / sum : 0.f;
    }
#if HAVE_AMX
    if (tiles) values_tiles(w->p, cp, keys, vv, D, w->o);
    else
#endif
        values_vec(w->p, cp, keys, vv, D, rows, w->o);
    for (int i = 0; i < rows; i++) {
        uint16_t *dst = out + ((int64_t)(r.row + i0 + i) * num_heads + h) * D;
        for (int d = 0; d < D; d++) dst[d] = store_bf16(w->o[i * D + d] * inv[i]);
    }
}

/* See attention_amx_prefill. */
static void run_tiles(const uint16_t *q, int64_t q_stride, const uint8_t *k_cache,
                      const uint8_t *v_cache, const int32_t *tables, int max_blocks,
                      const int32_t *ctx_lens, uint16_t *out, const run_t *runs, int nruns,
                      int num_heads, int num_kv_heads, int D, int bs, int64_t num_blocks,
                      float scale, cache_kind ck, int num_threads, uint32_t *kv,
                      const int64_t *kv_off, int cp_max, int tiles, int *failed) {
    const int group = num_heads / num_kv_heads;
    const int64_t head_bytes = num_blocks * bs * (ck.kind ? kv_row_bytes(ck.kind, D) : 2 * D);
    int64_t tasks = 0;                         /* (run, query head, block of 16 rows) */
    int64_t first[nruns + 1];
    for (int r = 0; r < nruns; r++) {
        first[r] = tasks;
        tasks += (int64_t)num_heads * ((runs[r].len + 15) / 16);
    }
    first[nruns] = tasks;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        _Pragma("omp for collapse(2) schedule(static)")
        for (int r = 0; r < nruns; r++)
            for (int kh = 0; kh < num_kv_heads; kh++) {
                const int ctx = ctx_lens[runs[r].row + runs[r].len - 1];
                const int cp = (ctx + 31) / 32 * 32;
                uint32_t *kt = kv + kv_off[r * num_kv_heads + kh];
                prep_kv(k_cache + kh * head_bytes, v_cache + kh * head_bytes,
                        tables + (int64_t)runs[r].row * max_blocks, ctx, cp, bs, D, ck, kt,
                        kt + (int64_t)(D / 2) * cp);
            }
        block_scratch w;
        w.q16 = malloc(sizeof(uint16_t) * 16 * ((size_t)D + (size_t)cp_max));
        w.s = malloc(sizeof(float) * ((size_t)16 * cp_max + 16 * (size_t)D + cp_max));
        if (!w.q16 || !w.s) {
            _Pragma("omp atomic write")
            *failed = 1;
        } else {
            w.p = w.q16 + 16 * D;
            w.o = w.s + (size_t)16 * cp_max;
            w.tmp = w.o + 16 * D;
#if HAVE_AMX
            if (tiles) amx_tiles_configure();
#endif
        }
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t t = 0; t < tasks; t++) {
            if (!w.q16 || !w.s) continue;
            int r = 0;
            while (first[r + 1] <= t) r++;
            const int64_t local = t - first[r], blocks = (runs[r].len + 15) / 16;
            const int h = (int)(local / blocks), i0 = (int)(local % blocks) * 16, kh = h / group;
            const int ctx = ctx_lens[runs[r].row + runs[r].len - 1];
            const int cp = (ctx + 31) / 32 * 32;
            const uint32_t *kt = kv + kv_off[r * num_kv_heads + kh];
            attend_block(q, q_stride, ctx_lens, runs[r], i0, h, kt, kt + (int64_t)(D / 2) * cp,
                         cp, D, scale, &w, out, num_heads, tiles);
        }
#if HAVE_AMX
        if (tiles && w.q16 && w.s) _tile_release();
#endif
        free(w.q16);
        free(w.s);
    }
}

/* paged_decode_bf16's (or paged_decode8_bf16's) arguments (cpu_kernels.c): kind 0 for a
 * bfloat16 cache, else an 8-bit one (common.h's KV_*) whose K rows are dequantized as they
 * are (the per-tensor read scale is in `scale`) and V rows times v_factor (its per-tensor
 * read scale). Attends the rows of its runs (on tiles where AMX is on, else in vdpbf16ps) and
 * returns a mask [num_seqs] (1: done here; the caller frees it), or NULL when no row was taken
 * (no run, no AVX512-BF16 in the build, head_dim not a multiple of 32 or over 256, block_size
 * not a multiple of 16, out of memory). */
uint8_t *attention_amx_prefill(const uint16_t *q, int64_t q_stride, const void *k_cache,
                               const void *v_cache, const int32_t *tables, int max_blocks,
                               const int32_t *ctx_lens, uint16_t *out, int num_seqs,
                               int num_heads, int num_kv_heads, int D, int bs,
                               int64_t num_blocks, float scale, int kind, float v_factor,
                               int num_threads) {
    const cache_kind ck = {kind, v_factor};
    const int tiles = HAVE_AMX && quant_amx_min_rows() > 0;
    if (!tiles && !vector_pairs) return NULL;
    if (D % 32 || D > 256 || bs % 16 || num_seqs < MIN_RUN) return NULL;
    run_t *runs = malloc(sizeof(run_t) * (size_t)num_seqs);
    int64_t *kv_off = NULL;
    uint32_t *kv = NULL;
    uint8_t *done = NULL;
    const int nruns = runs ? find_runs(tables, max_blocks, ctx_lens, num_seqs, bs, runs) : 0;
    if (nruns) {
        kv_off = malloc(sizeof(int64_t) * (size_t)nruns * (size_t)num_kv_heads);
        done = calloc((size_t)num_seqs, 1);
    }
    int64_t total = 0;
    int cp_max = 0, failed = 0;
    for (int r = 0; kv_off && r < nruns; r++) {
        const int cp = (ctx_lens[runs[r].row + runs[r].len - 1] + 31) / 32 * 32;
        cp_max = cp > cp_max ? cp : cp_max;
        for (int kh = 0; kh < num_kv_heads; kh++) {
            kv_off[r * num_kv_heads + kh] = total;
            total += (int64_t)D * cp;                  /* kt and vv: D / 2 * cp each */
        }
    }
    /* the calling thread's scratch, kept between calls: a step's K and V in pairs are
     * megabytes (64 chunks of 130 tokens: 8 MB a layer), which malloc would map and unmap —
     * and the kernel zero — on every call */
    if (kv_off && done && (kv = scratch(0, sizeof(uint32_t) * (size_t)(total ? total : 1)))) {
        run_tiles(q, q_stride, k_cache, v_cache, tables, max_blocks, ctx_lens, out, runs,
                  nruns, num_heads, num_kv_heads, D, bs, num_blocks, scale, ck, num_threads,
                  kv, kv_off, cp_max, tiles, &failed);
        for (int r = 0; !failed && r < nruns; r++) {
            memset(done + runs[r].row, 1, (size_t)runs[r].len);
            amx_attention_rows += runs[r].len;
        }
    }
    if (!kv || failed) {
        free(done);
        done = NULL;
    }
    free(kv_off);
    free(runs);
    return done;
}
#else
uint8_t *attention_amx_prefill(const uint16_t *q, int64_t q_stride, const void *k_cache,
                               const void *v_cache, const int32_t *tables, int max_blocks,
                               const int32_t *ctx_lens, uint16_t *out, int num_seqs,
                               int num_heads, int num_kv_heads, int D, int bs,
                               int64_t num_blocks, float scale, int kind, float v_factor,
                               int num_threads) {
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)tables, (void)max_blocks;
    (void)ctx_lens, (void)out, (void)num_seqs, (void)num_heads, (void)num_kv_heads, (void)D;
    (void)bs, (void)num_blocks, (void)scale, (void)kind, (void)v_factor, (void)num_threads;
    return NULL;
}
#endif
