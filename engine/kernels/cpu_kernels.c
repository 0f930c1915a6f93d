/*
 * CPU kernels of the model runner: the KV-cache write through a slot mapping, decode attention
 * that reads each sequence's K/V in place through its block table (the fused elementwise ops
 * the layers run between them are in elementwise.c).
 *
 * The same algorithm as vLLM's CPU paged attention (csrc/cpu/attention.cpp, "PagedAttention",
 * Kwon et al., SOSP 2023): per (sequence, KV head), scores of the GQA group's query heads against
 * every cached key, a float32 softmax, and the probability-weighted sum of the cached values.
 * No gather copy and no padding to the batch's longest context, which the pure-torch path needs.
 * With fewer pairs than the threads can share evenly (one long decode), each pair's context is
 * split into parts attended in parallel and merged (DECODE_SPLIT: flash-decoding, vLLM's v2).
 *
 * Layouts (elements, row-major), as in engine/attention.py:
 *   k_cache, v_cache  [num_kv_heads, num_blocks, block_size, head_dim]   (head-major)
 *   q                 [num_seqs, num_heads, head_dim], token stride q_stride
 *   k, v (new)        [num_tokens, num_kv_heads, head_dim], token strides k_stride, v_stride
 *   block_tables      [num_seqs, max_blocks] int32;  ctx_lens [num_seqs] int32 (tokens)
 *   out               [num_seqs, num_heads, head_dim] contiguous
 * Element types: float32 (suffix _f32) and bfloat16 stored as uint16 (suffix _bf16); all
 * arithmetic is float32, bfloat16 results are rounded to nearest even.
 *
 * Built by engine/kernels/__init__.py with the system C compiler and -fopenmp; loaded after
 * torch, so the OpenMP runtime is torch's own (same soname) and shares its thread pool.
 */
#include "common.h"

/* glibc's vector expf (libmvec), as <math.h> declares it under -ffast-math: lets the softmax
 * loop vectorize without fast-math's other effects. */
#if defined(__x86_64__)
#pragma omp declare simd notinbranch
float expf(float);
#endif

#define MAX_GROUP 32


/* s[t] = exp(s[t] - max) for t < n (vectorized expf); returns their sum: a softmax's
 * numerators and denominator. */
INLINE float exp_and_sum(float *s, int n, float max) {
    float sum = 0.f;
#pragma omp simd reduction(+:sum)
    for (int t = 0; t < n; t++) {
        const float e = expf(s[t] - max);
        s[t] = e;
        sum += e;
    }
    return sum;
}

/* Cache rows. A cache row is one (token, KV head): head_dim elements of the cache's type, and
 * for the int8 cache a float16 scale after them (engine/kv_quant.py). The element loaders
 * (load_<C>, vload_<C>), the row width in elements (ROW_<C>: head_dim plus the scale's bytes)
 * and the row's scale (SCALE_<C>, 1 where the cache has no per-row scale; a per-tensor fp8
 * scale is folded into the caller's `scale` and `out_scale`) per cache type C. */
#define ROW_f32(D) (D)
#define ROW_bf16(D) (D)
#define ROW_i8(D) ((D) + 2)
#define ROW_e4m3(D) (D)
#define ROW_e5m2(D) (D)
#define SCALE_f32(r, D) 1.f
#define SCALE_bf16(r, D) 1.f
#define SCALE_i8(r, D) f16_at((r) + (D))
#define SCALE_e4m3(r, D) 1.f
#define SCALE_e5m2(r, D) 1.f

/* One (sequence, KV head) of decode attention. Inlined with a constant head_dim D where the
 * caller can give one, so the per-row loops unroll and vectorize; blocks are walked in order, a
 * block's rows are contiguous. q_scaled [group][D] float32 (query already times scale). NAME:
 * the instance; C: the cache's element suffix (type CT); O: the output's (type OT). The
 * values' sum is multiplied by out_scale / (sum of the softmax numerators). */
#define DEFINE_DECODE_ONE(NAME, C, CT, O, OT)                                                \
INLINE void decode_one_##NAME(const float *q_scaled, const CT *kbase, const CT *vbase,      \
                              const int32_t *table, int ctx, int block_size, int group,     \
                              const int D, float out_scale, float *scores, OT *out,         \
                              float *stats) {                                                \
    const int R = ROW_##C(D);                                                                \
    const int nblocks = (ctx + block_size - 1) / block_size;                                 \
    for (int g = 0; g < group; g++) {                                                        \
        const float *qg = q_scaled + g * D;                                                  \
        float *sg = scores + (int64_t)g * ctx;                                               \
        for (int j = 0; j < nblocks; j++) {                                                  \
            const CT *kb = kbase + (int64_t)table[j] * block_size * R;                       \
            const int n = j == nblocks - 1 ? ctx - j * block_size : block_size;              \
            for (int t = 0; t < n; t++) {                                                    \
                const CT *kr = kb + t * R;                                                   \
                float s = 0.f;                                                               \
                _Pragma("omp simd reduction(+:s)")                                           \
                for (int d = 0; d < D; d++) s += qg[d] * load_##C(kr[d]);                    \
                sg[j * block_size + t] = s * SCALE_##C(kr, D);                               \
            }                                                                                \
        }                                                                                    \
        float m = -INFINITY;                                                                 \
        for (int t = 0; t < ctx; t++) m = sg[t] > m ? sg[t] : m;                             \
        const float sum = exp_and_sum(sg, ctx, m);                                           \
        if (stats) {                                                                         \
            stats[2 * g] = m;                                                                \
            stats[2 * g + 1] = sum;                                                          \
        }                                                                                    \
        float acc[D];                                                                        \
        for (int d = 0; d < D; d++) acc[d] = 0.f;                                            \
        for (int j = 0; j < nblocks; j++) {                                                  \
            const CT *vb = vbase + (int64_t)table[j] * block_size * R;                       \
            const int n = j == nblocks - 1 ? ctx - j * block_size : block_size;              \
            for (int t = 0; t < n; t++) {                                                    \
                const CT *vr = vb + t * R;                                                   \
                const float p = sg[j * block_size + t] * SCALE_##C(vr, D);                   \
                _Pragma("omp simd")                                                          \
                for (int d = 0; d < D; d++) acc[d] += p * load_##C(vr[d]);                   \
            }                                                                                \
        }                                                                                    \
        const float inv = sum > 0.f ? out_scale / sum : 0.f;                                 \
        OT *o = out + g * D;                                                                 \
        for (int d = 0; d < D; d++) o[d] = store_##O(acc[d] * inv);                          \
    }                                                                                        \
}

/* Every (cache type, output type) instance: NAME, C, CT, O, OT. */
#define DECODE_INSTANCES(X)                                                                  \
    X(f32, f32, float, f32, float) X(bf16, bf16, uint16_t, bf16, uint16_t)                   \
    X(bf16_f32, bf16, uint16_t, f32, float)                                                  \
    X(i8_f32, i8, uint8_t, f32, float) X(i8_bf16, i8, uint8_t, bf16, uint16_t)               \
    X(e4m3_f32, e4m3, uint8_t, f32, float) X(e4m3_bf16, e4m3, uint8_t, bf16, uint16_t)       \
    X(e5m2_f32, e5m2, uint8_t, f32, float) X(e5m2_bf16, e5m2, uint8_t, bf16, uint16_t)
DECODE_INSTANCES(DEFINE_DECODE_ONE)

/* The vector decode loop, written once against the vector vocabulary of vec.h and
 * instantiated per ISA. */
#include "vec.h"

/* This file is compiled twice (engine/kernels/__init__.py: UNITS), as two halves of one long
 * compile that run on two cores: CPU_KERNELS_PART 0 defines the float32 kernels and
 * kernels_isa, 1 the bfloat16 kernels. */
#ifndef CPU_KERNELS_PART
#error "build cpu_kernels.c with -DCPU_KERNELS_PART=0 and again with -DCPU_KERNELS_PART=1"
#endif

#if CPU_KERNELS_PART == 0
/* The ISA the vector loops were built for: "avx512", "avx2" or "generic". */
const char *kernels_isa(void) { return VEC_ISA; }
#endif

#if HAVE_VEC
/* decode_one with vectors, head_dim D = VL * NV (D <= 256). The query heads of a GQA group share
 * each K / V row: heads go in tiles of up to GT, and each row is loaded and widened to float32
 * once per tile (not once per head). Scores: per row, one vector accumulator per head, then one
 * horizontal add per (row, head). Values: one vector column of the output at a time, so the
 * tile's accumulators stay in registers while the rows stream (from L1 / L2 after the first
 * column). Rows go in pairs with an accumulator each, so twice as many FMA chains are in flight
 * (one chain per head would wait on FMA latency). AVX2, 64 decodes x 160 tokens, 9 heads over 3
 * KV heads, 30 layers, ms per step (median of 5), per-head loop -> this: 34.4 -> 28.4 with each
 * sequence's blocks consecutive, 27.7 -> 23.1 (best) with blocks scattered. A cache with row
 * scales (int8) has them applied to each row's scores, and to each row's weight in the
 * values' loop (from the row's own cache line). The next block's K rows and this block's V rows
 * are prefetched two rows per row pair, not a block at a time: bursts of 64 prefetches stalled
 * on full fill buffers (perf: half the kernel's samples on them). AMD EPYC Zen 5, scattered
 * blocks, bfloat16 cache, ms per step (30 layers): 64 x 150-300 tokens 16.7 -> 14.1, 16 x ~2,000
 * 37.8 -> 30.8; under CONTINUUM_CPU_ISA=avx2 16.9 -> 14.6 and 36.4 -> 31.2; int8 cache 11.4 ->
 * 11.2 and 25.2 -> 23.5. */
#define GT 4
#define DEFINE_DECODE_ONE_VEC(NAME, C, CT, O, OT)                                    \
INLINE void decode_tile_vec_##NAME(const float *q_scaled, const CT *kbase, const CT *vbase, \
                                   const int32_t *table, int ctx, int block_size,            \
                                   const int gt, const int D, int prefetch, float out_scale, \
                                   float *scores, OT *out, float *stats) {                   \
    const int NV = D / VL, R = ROW_##C(D);                                                   \
    const int nblocks = (ctx + block_size - 1) / block_size;                                 \
    const int block_bytes = block_size * R * (int)sizeof(CT);                                \
    const int64_t row_bytes = (int64_t)R * (int64_t)sizeof(CT);                              \
    float m[GT];                                                                             \
    for (int g = 0; g < gt; g++) m[g] = -INFINITY;                                           \
    for (int j = 0; j < nblocks; j++) {                                                      \
        const CT *kb = kbase + (int64_t)table[j] * block_size * R;                           \
        const int n = j == nblocks - 1 ? ctx - j * block_size : block_size;                  \
        const CT *kn = j + 1 < nblocks                                                       \
            ? kbase + (int64_t)table[j + 1] * block_size * R : NULL;                         \
        const CT *vc = vbase + (int64_t)table[j] * block_size * R;                           \
        for (int t = 0; t < n; t += 2) {   /* row pairs: twice the independent FMA chains; */ \
            const int two = t + 1 < n;     /* an odd last row is paired with itself         */ \
            if (prefetch) {                /* these rows of the next block, and of this     */ \
                const int64_t lo = (int64_t)t * row_bytes;   /* block's values (read next) */ \
                if (kn) prefetch_range(kn, lo, lo + 2 * row_bytes);                          \
                prefetch_range(vc, lo, lo + 2 * row_bytes);                                  \
            }                                                                                \
            const CT *k0r = kb + t * R, *k1r = k0r + two * R;                                \
            V s0[GT], s1[GT];                                                                \
            for (int g = 0; g < gt; g++) s0[g] = s1[g] = vzero();                            \
            for (int i = 0; i < NV; i++) {                                                   \
                const V k0 = vload_##C(k0r + VL * i), k1 = vload_##C(k1r + VL * i);          \
                for (int g = 0; g < gt; g++) {                                               \
                    const V q = vload_f32(q_scaled + g * D + VL * i);                        \
                    s0[g] = vfma(q, k0, s0[g]);                                              \
                    s1[g] = vfma(q, k1, s1[g]);                                              \
                }                                                                            \
            }                                                                                \
            const float r0 = SCALE_##C(k0r, D), r1 = SCALE_##C(k1r, D);                      \
            for (int g = 0; g < gt; g++) {                                                   \
                float *sg = scores + (int64_t)g * ctx + j * block_size + t;                  \
                sg[0] = vsum(s0[g]) * r0;                                                    \
                m[g] = sg[0] > m[g] ? sg[0] : m[g];                                          \
                if (two) {                                                                   \
                    sg[1] = vsum(s1[g]) * r1;                                                \
                    m[g] = sg[1] > m[g] ? sg[1] : m[g];                                      \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    V inv[GT];                                                                               \
    for (int g = 0; g < gt; g++) {                                                           \
        const float sum = exp_and_sum(scores + (int64_t)g * ctx, ctx, m[g]);                 \
        inv[g] = vset1(sum > 0.f ? out_scale / sum : 0.f);                                   \
        if (stats) {                                                                         \
            stats[2 * g] = m[g];                                                             \
            stats[2 * g + 1] = sum;                                                          \
        }                                                                                    \
    }                                                                                        \
    for (int i = 0; i < NV; i++) {                                                           \
        V acc[GT], acc1[GT];                                                                 \
        for (int g = 0; g < gt; g++) acc[g] = acc1[g] = vzero();                             \
        for (int j = 0; j < nblocks; j++) {                                                  \
            const CT *vrow = vbase + (int64_t)table[j] * block_size * R, *vb = vrow + VL * i;\
            const int n = j == nblocks - 1 ? ctx - j * block_size : block_size;              \
            if (prefetch && i == 0 && j + 1 < nblocks)                                       \
                prefetch_range(vbase + (int64_t)table[j + 1] * block_size * R, 0, block_bytes);\
            const float *sj = scores + j * block_size;                                       \
            int t = 0;                                                                       \
            for (; t + 1 < n; t += 2) {    /* row pairs: two accumulators per head */        \
                const V v0 = vload_##C(vb + t * R), v1 = vload_##C(vb + (t + 1) * R);        \
                const float r0 = SCALE_##C(vrow + t * R, D), r1 = SCALE_##C(vrow + (t + 1) * R, D);\
                for (int g = 0; g < gt; g++) {                                               \
                    acc[g] = vfma(vset1(sj[(int64_t)g * ctx + t] * r0), v0, acc[g]);         \
                    acc1[g] = vfma(vset1(sj[(int64_t)g * ctx + t + 1] * r1), v1, acc1[g]);   \
                }                                                                            \
            }                                                                                \
            if (t < n) {                                                                     \
                const V v = vload_##C(vb + t * R);                                           \
                const float r0 = SCALE_##C(vrow + t * R, D);                                 \
                for (int g = 0; g < gt; g++)                                                 \
                    acc[g] = vfma(vset1(sj[(int64_t)g * ctx + t] * r0), v, acc[g]);          \
            }                                                                                \
        }                                                                                    \
        for (int g = 0; g < gt; g++) {                                                       \
            float res[VL];                                                                   \
            vstore(res, vmul(vadd(acc[g], acc1[g]), inv[g]));                               \
            OT *o = out + g * D + VL * i;                                                    \
            for (int d = 0; d < VL; d++) o[d] = store_##O(res[d]);                           \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
INLINE void decode_one_vec_##NAME(const float *q_scaled, const CT *kbase, const CT *vbase,  \
                                  const int32_t *table, int ctx, int block_size, int group,  \
                                  const int D, float out_scale, float *scores, OT *out,      \
                                  float *stats) {                                            \
    for (int g0 = 0; g0 < group; g0 += GT) {    /* constant tile sizes: unrolled, in regs */ \
        const float *q = q_scaled + g0 * D;                                                  \
        float *s = scores + (int64_t)g0 * ctx;                                               \
        OT *o = out + g0 * D;                                                                \
        float *st = stats ? stats + 2 * g0 : NULL;                                           \
        switch (group - g0 < GT ? group - g0 : GT) {                                         \
        case 1: decode_tile_vec_##NAME(q, kbase, vbase, table, ctx, block_size, 1, D,       \
                                       g0 == 0, out_scale, s, o, st); break;                 \
        case 2: decode_tile_vec_##NAME(q, kbase, vbase, table, ctx, block_size, 2, D,       \
                                       g0 == 0, out_scale, s, o, st); break;                 \
        case 3: decode_tile_vec_##NAME(q, kbase, vbase, table, ctx, block_size, 3, D,       \
                                       g0 == 0, out_scale, s, o, st); break;                 \
        default: decode_tile_vec_##NAME(q, kbase, vbase, table, ctx, block_size, 4, D,      \
                                        g0 == 0, out_scale, s, o, st); break;                \
        }                                                                                    \
    }                                                                                        \
}

DECODE_INSTANCES(DEFINE_DECODE_ONE_VEC)
#define DECODE_VEC(NAME, ...) decode_one_vec_##NAME(__VA_ARGS__)
#else
#define VL 1           /* unused: HAVE_VEC is 0, so the vector branches are never taken */
#define DECODE_VEC(NAME, ...) decode_one_##NAME(__VA_ARGS__)
#endif

/* attention_amx.c: the rows of prefill runs attended on AMX tiles (bfloat16; a mask of the rows
 * done, to be freed, or NULL). */
uint8_t *attention_amx_prefill(const uint16_t *q, int64_t q_stride, const void *k_cache,
                               const void *v_cache, const int32_t *tables, int max_blocks,
                               const int32_t *ctx_lens, uint16_t *out, int num_seqs,
                               int num_heads, int num_kv_heads, int D, int bs,
                               int64_t num_blocks, float scale, int kind, float v_factor,
                               int num_threads);

/* One (sequence b, KV head kh) of paged_decode over the first CTX tokens of block table TABLE,
 * into OUT (the group's heads, of the instance's output type): the group's scaled queries,
 * then decode_one of the cache type NAME (the vector loop at head_dim 64, 128 or a multiple of
 * VL); STATS: NULL, or float [group][2] for each head's score max and softmax sum. */
#define DECODE_HEAD(NAME, T, SUFFIX, CTX, TABLE, OUT, STATS)                                 \
    do {                                                                                     \
        const int ctx = (CTX);                                                               \
        float qf[MAX_GROUP * 256];                                                           \
        for (int g = 0; g < group; g++) {                                                    \
            const T *qh = q + b * q_stride + (int64_t)(kh * group + g) * head_dim;           \
            for (int d = 0; d < head_dim; d++)                                               \
                qf[g * head_dim + d] = load_##SUFFIX(qh[d]) * scale;                         \
        }                                                                                    \
        float *scores = scratch(0, sizeof(float) * (size_t)group * (ctx > 0 ? ctx : 1));    \
        const int32_t *table = (TABLE);                                                      \
        const CT *kb = k_cache + kh * head_elems, *vb = v_cache + kh * head_elems;           \
        if (HAVE_VEC && head_dim == 64)                                                      \
            DECODE_VEC(NAME, qf, kb, vb, table, ctx, block_size, group, 64, out_scale,       \
                       scores, OUT, STATS);                                                  \
        else if (HAVE_VEC && head_dim == 128)                                                \
            DECODE_VEC(NAME, qf, kb, vb, table, ctx, block_size, group, 128, out_scale,      \
                       scores, OUT, STATS);                                                  \
        else if (HAVE_VEC && head_dim % VL == 0)                                             \
            DECODE_VEC(NAME, qf, kb, vb, table, ctx, block_size, group, head_dim, out_scale, \
                       scores, OUT, STATS);                                                  \
        else                                                                                 \
            decode_one_##NAME(qf, kb, vb, table, ctx, block_size, group, head_dim,           \
                              out_scale, scores, OUT, STATS);                                \
    } while (0)

/* A whole (sequence, KV head) of paged_decode into `out`. */
#define DECODE_PAIR(NAME, T, SUFFIX)                                                         \
    DECODE_HEAD(NAME, T, SUFFIX, ctx_lens[b], block_tables + (int64_t)b * max_blocks,        \
                out + ((int64_t)b * num_heads + kh * group) * head_dim, NULL)

/* The loop over (sequence, KV head) of paged_decode, `body` per pair not in `done`. */
#define FOR_HEADS(body)                                                                      \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")   \
    for (int b = 0; b < num_seqs; b++)                                                       \
        for (int kh = 0; kh < num_kv_heads; kh++) {                                          \
            if (done && done[b]) continue;   /* a prefill run's: attention_amx.c took it */ \
            body;                                                                            \
        }

/* Split-KV decode (flash-decoding: Dao, Haziza, Massa, Sizov 2023; vLLM's paged_attention_v2):
 * when the (sequence, KV head) pairs are too few to share the threads out evenly — one
 * sequence of a 3-KV-head model on 2 threads ran 2 pairs on one thread and 1 on the other —
 * each pair's context is cut into `parts` runs of whole blocks, attended in parallel into
 * float32 partial outputs with each head's score max m_p and softmax sum l_p (DECODE_HEAD with
 * the instance PART, float32 out), then merged per head:
 *   out = sum_p w_p o_p / sum_p w_p,  w_p = l_p exp(m_p - max_p m_p)
 * (o_p is already normalized by l_p and scaled by out_scale). */
#define SPLIT_MIN_TOKENS 256   /* context a part takes at least: below, the merge costs more */

/* The parts paged_decode cuts each pair's context into: 1 (no split) unless the pairs are
 * fewer than two a thread; then enough for four (pair, part) items a thread, as many as the
 * longest context gives SPLIT_MIN_TOKENS each (at most MAX_PARTS). */
int paged_decode_parts(int num_seqs, int num_kv_heads, const int32_t *ctx_lens,
                       int num_threads);

#define MAX_PARTS 64

/* paged_decode's loop: every pair whole (FOR_HEADS) with the instance NAME, or split into
 * paged_decode_parts parts with the float32-output instance PART and merged. */
#define DECODE_ALL(NAME, PART, T, SUFFIX)                                                    \
    do {                                                                                     \
        const int parts = done ? 1 : paged_decode_parts(num_seqs, num_kv_heads, ctx_lens,    \
                                                        num_threads);                        \
        const int64_t pairs = (int64_t)num_seqs * num_kv_heads, gd = (int64_t)group * head_dim;\
        float *po = parts > 1                   /* no memory for the parts: unsplit */      \
            ? malloc(sizeof(float) * (size_t)(pairs * parts * (gd + 2 * group))) : NULL;     \
        if (po) {                                                                            \
            DECODE_SPLIT(PART, T, SUFFIX);                                                   \
            free(po);                                                                        \
        } else {                                                                             \
            FOR_HEADS(DECODE_PAIR(NAME, T, SUFFIX));                                         \
        }                                                                                    \
    } while (0)

/* The split's two steps (DECODE_ALL's locals: parts, pairs, gd, po). */
#define DECODE_SPLIT(PART, T, SUFFIX)                                                        \
    do {                                                                                     \
        float *ps = po + pairs * parts * gd;   /* [pair][part][group][2]: m_p, l_p */       \
        _Pragma("omp parallel num_threads(num_threads)")                                     \
        {                                                                                    \
        _Pragma("omp for schedule(dynamic, 1)")                                              \
        for (int64_t it = 0; it < pairs * parts; it++) {                                     \
            const int b = (int)(it / (num_kv_heads * parts));                               \
            const int kh = (int)(it / parts % num_kv_heads), p = (int)(it % parts);          \
            const int nblocks = (ctx_lens[b] + block_size - 1) / block_size;                 \
            const int per = (nblocks + parts - 1) / parts, j0 = p * per;                     \
            const int j1 = j0 + per < nblocks ? j0 + per : nblocks;                          \
            float *st = ps + it * 2 * group;                                                 \
            if (j0 >= j1) {                     /* a short context: nothing in this part */ \
                for (int g = 0; g < group; g++) st[2 * g] = -INFINITY, st[2 * g + 1] = 0.f;  \
                continue;                                                                    \
            }                                                                                \
            const int end = j1 * block_size < ctx_lens[b] ? j1 * block_size : ctx_lens[b];   \
            DECODE_HEAD(PART, T, SUFFIX, end - j0 * block_size,                              \
                        block_tables + (int64_t)b * max_blocks + j0, po + it * gd, st);      \
        }                                                                                    \
        _Pragma("omp for schedule(static)")                                                  \
        for (int64_t ph = 0; ph < pairs * group; ph++) {   /* the merge, per (pair, head) */ \
            const int64_t pair = ph / group;                                                 \
            const int g = (int)(ph % group);                                                 \
            const float *st = ps + pair * parts * 2 * group + 2 * g;                         \
            float mx = -INFINITY, w[MAX_PARTS], total = 0.f;                                 \
            for (int p = 0; p < parts; p++)                                                  \
                mx = st[p * 2 * group] > mx ? st[p * 2 * group] : mx;                        \
            for (int p = 0; p < parts; p++) {                                                \
                const float l = st[p * 2 * group + 1];                                       \
                w[p] = l > 0.f ? l * expf(st[p * 2 * group] - mx) : 0.f;                     \
                total += w[p];                                                               \
            }                                                                                \
            const float inv = total > 0.f ? 1.f / total : 0.f;                               \
            const float *o = po + pair * parts * gd + (int64_t)g * head_dim;                 \
            T *dst = out + (pair / num_kv_heads * num_heads                                  \
                            + pair % num_kv_heads * group + g) * (int64_t)head_dim;          \
            float acc[256];                                                                  \
            for (int d = 0; d < head_dim; d++) acc[d] = 0.f;                                 \
            for (int p = 0; p < parts; p++) {  /* an empty part's output was never written */\
                if (w[p] == 0.f) continue;                                                   \
                for (int d = 0; d < head_dim; d++) acc[d] += w[p] * o[p * gd + d];           \
            }                                                                                \
            for (int d = 0; d < head_dim; d++) dst[d] = store_##SUFFIX(acc[d] * inv);        \
        }                                                                                    \
        }                                                                                    \
    } while (0)

/* Returns 0, or -1 when head_dim or the GQA group is larger than the kernel's buffers. */
/* AMX_PREFILL: the prefill runs taken in bfloat16 pair products (attention_amx_prefill, over
 * `kind`'s cache with `out_scale`), or NULL. */
#define DEFINE_KERNELS(SUFFIX, T, PART, AMX_PREFILL)                                         \
void cache_write_##SUFFIX(const T *k, const T *v, T *k_cache, T *v_cache,                   \
                          const int64_t *slots, int num_tokens, int num_kv_heads,            \
                          int head_dim, int64_t k_stride, int64_t v_stride,                  \
                          int64_t slots_per_head) {                                          \
    for (int t = 0; t < num_tokens; t++) {                                                   \
        int64_t s = slots[t];                                                                \
        for (int h = 0; h < num_kv_heads; h++) {                                             \
            memcpy(k_cache + (h * slots_per_head + s) * head_dim,                            \
                   k + t * k_stride + (int64_t)h * head_dim, head_dim * sizeof(T));          \
            memcpy(v_cache + (h * slots_per_head + s) * head_dim,                            \
                   v + t * v_stride + (int64_t)h * head_dim, head_dim * sizeof(T));          \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
int paged_decode_##SUFFIX(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, \
                          const int32_t *block_tables, int max_blocks,                       \
                          const int32_t *ctx_lens, T *out, int num_seqs, int num_heads,      \
                          int num_kv_heads, int head_dim, int block_size, int64_t num_blocks,\
                          float scale, int num_threads) {                                    \
    typedef T CT;                                                                            \
    const int kind = 0;                             /* a cache of T */                       \
    const float out_scale = 1.f;                                                             \
    const int group = num_heads / num_kv_heads;                                              \
    if (head_dim > 256 || group > MAX_GROUP) return -1;                                      \
    const int64_t head_elems = num_blocks * block_size * head_dim;                           \
    uint8_t *done = AMX_PREFILL;                                                             \
    DECODE_ALL(SUFFIX, PART, T, SUFFIX);                                                     \
    free(done);                                                                              \
    return 0;                                                                                \
}                                                                                            \
                                                                                             \
/* paged_decode over an 8-bit cache (common.h: kind KV_INT8, KV_E4M3 or KV_E5M2; rows as      \
 * kv_cache.c writes them); `scale` and `out_scale` carry a per-tensor fp8 scale              \
 * (engine/kv_quant.py). Returns as paged_decode; -2 for an unknown kind. */                  \
int paged_decode8_##SUFFIX(const T *q, int64_t q_stride, const uint8_t *k_cache,            \
                           const uint8_t *v_cache, const int32_t *block_tables,              \
                           int max_blocks, const int32_t *ctx_lens, T *out, int num_seqs,    \
                           int num_heads, int num_kv_heads, int head_dim, int block_size,    \
                           int64_t num_blocks, float scale, float out_scale, int kind,       \
                           int num_threads) {                                                \
    typedef uint8_t CT;                                                                      \
    const int group = num_heads / num_kv_heads;                                              \
    if (head_dim > 256 || group > MAX_GROUP) return -1;                                      \
    if (kind < KV_INT8 || kind > KV_E5M2) return -2;                                         \
    const int64_t head_elems = num_blocks * block_size * kv_row_bytes(kind, head_dim);       \
    uint8_t *done = AMX_PREFILL;                                                             \
    if (kind == KV_INT8) {                                                                   \
        DECODE_ALL(i8_##SUFFIX, i8_f32, T, SUFFIX);                                          \
    } else if (kind == KV_E4M3) {                                                            \
        DECODE_ALL(e4m3_##SUFFIX, e4m3_f32, T, SUFFIX);                                      \
    } else {                                                                                 \
        DECODE_ALL(e5m2_##SUFFIX, e5m2_f32, T, SUFFIX);                                      \
    }                                                                                        \
    free(done);                                                                              \
    return 0;                                                                                \
}

#if CPU_KERNELS_PART == 0
int paged_decode_parts(int num_seqs, int num_kv_heads, const int32_t *ctx_lens,
                       int num_threads) {
    const int64_t pairs = (int64_t)num_seqs * num_kv_heads;
    if (num_threads < 2 || pairs <= 0 || pairs >= 2 * (int64_t)num_threads) return 1;
    int longest = 0;
    for (int b = 0; b < num_seqs; b++) longest = ctx_lens[b] > longest ? ctx_lens[b] : longest;
    /* four items a thread: a thread that a virtual machine's host slows takes fewer (9 heads
     * over 3 KV heads, one sequence at 1-4 k tokens, 2 threads, AMD EPYC Zen 3, alternating
     * pairs against the unsplit loop: 2 a thread 0.86-1.36x, 4 a thread 0.97-1.26x) */
    int parts = (int)((4 * (int64_t)num_threads + pairs - 1) / pairs);
    if (parts > longest / SPLIT_MIN_TOKENS) parts = longest / SPLIT_MIN_TOKENS;
    if (parts > MAX_PARTS) parts = MAX_PARTS;
    return parts > 1 ? parts : 1;
}

DEFINE_KERNELS(f32, float, f32, NULL)
#else
DEFINE_KERNELS(bf16, uint16_t, bf16_f32,
               attention_amx_prefill(q, q_stride, k_cache, v_cache, block_tables, max_blocks,
                                     ctx_lens, out, num_seqs, num_heads, num_kv_heads,
                                     head_dim, block_size, num_blocks, scale, kind, out_scale,
                                     num_threads))
#endif
