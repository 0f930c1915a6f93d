/*
 * CPU kernels of the model runner: the KV-cache write through a slot mapping, decode attention
 * that reads each sequence's K/V in place through its block table, and fused elementwise ops
 * (residual add + RMSNorm, SiLU-and-mul, RoPE) at the end of this file.
 *
 * The same algorithm as vLLM's CPU paged attention (csrc/cpu/attention.cpp, "PagedAttention",
 * Kwon et al., SOSP 2023): per (sequence, KV head), scores of the GQA group's query heads against
 * every cached key, a float32 softmax, and the probability-weighted sum of the cached values.
 * No gather copy and no padding to the batch's longest context, which the pure-torch path needs.
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

/* Ask for the next block's cache lines while this one is being used: blocks are scattered in
 * the pool, so the hardware prefetcher cannot guess them. */
INLINE void prefetch_block(const void *p, int bytes) {
    for (int off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 3);
}

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

/* One (sequence, KV head) of decode attention. Inlined with a constant head_dim D where the
 * caller can give one, so the per-row loops unroll and vectorize; blocks are walked in order, a
 * block's rows are contiguous. q_scaled [group][D] float32 (query already times scale). */
#define DEFINE_DECODE_ONE(SUFFIX, T)                                                         \
INLINE void decode_one_##SUFFIX(const float *q_scaled, const T *kbase, const T *vbase,      \
                                const int32_t *table, int ctx, int block_size, int group,   \
                                const int D, float *scores, T *out) {                        \
    const int nblocks = (ctx + block_size - 1) / block_size;                                 \
    for (int g = 0; g < group; g++) {                                                        \
        const float *qg = q_scaled + g * D;                                                  \
        float *sg = scores + (int64_t)g * ctx;                                               \
        for (int j = 0; j < nblocks; j++) {                                                  \
            const T *kb = kbase + (int64_t)table[j] * block_size * D;                        \
            const int n = j == nblocks - 1 ? ctx - j * block_size : block_size;              \
            for (int t = 0; t < n; t++) {                                                    \
                const T *kr = kb + t * D;                                                    \
                float s = 0.f;                                                               \
                _Pragma("omp simd reduction(+:s)")                                           \
                for (int d = 0; d < D; d++) s += qg[d] * load_##SUFFIX(kr[d]);               \
                sg[j * block_size + t] = s;                                                  \
            }                                                                                \
        }                                                                                    \
        float m = -INFINITY;                                                                 \
        for (int t = 0; t < ctx; t++) m = sg[t] > m ? sg[t] : m;                             \
        const float sum = exp_and_sum(sg, ctx, m);                                           \
        float acc[D];                                                                        \
        for (int d = 0; d < D; d++) acc[d] = 0.f;                                            \
        for (int j = 0; j < nblocks; j++) {                                                  \
            const T *vb = vbase + (int64_t)table[j] * block_size * D;                        \
            const int n = j == nblocks - 1 ? ctx - j * block_size : block_size;              \
            for (int t = 0; t < n; t++) {                                                    \
                const float p = sg[j * block_size + t];                                      \
                const T *vr = vb + t * D;                                                    \
                _Pragma("omp simd")                                                          \
                for (int d = 0; d < D; d++) acc[d] += p * load_##SUFFIX(vr[d]);              \
            }                                                                                \
        }                                                                                    \
        const float inv = sum > 0.f ? 1.f / sum : 0.f;                                       \
        T *o = out + g * D;                                                                  \
        for (int d = 0; d < D; d++) o[d] = store_##SUFFIX(acc[d] * inv);                     \
    }                                                                                        \
}

DEFINE_DECODE_ONE(f32, float)
DEFINE_DECODE_ONE(bf16, uint16_t)

/* The vector decode loop, written once against the vector vocabulary of vec.h and
 * instantiated per ISA. */
#include "vec.h"

/* The ISA the vector loops were built for: "avx512", "avx2" or "generic". */
const char *kernels_isa(void) { return VEC_ISA; }

#if HAVE_VEC
/* decode_one with vectors, head_dim D = VL * NV (D <= 256). The query heads of a GQA group share
 * each K / V row: heads go in tiles of up to GT, and each row is loaded and widened to float32
 * once per tile (not once per head). Scores: per row, one vector accumulator per head, then one
 * horizontal add per (row, head). Values: one vector column of the output at a time, so the
 * tile's accumulators stay in registers while the rows stream (from L1 / L2 after the first
 * column). Rows go in pairs with an accumulator each, so twice as many FMA chains are in flight
 * (one chain per head would wait on FMA latency). AVX2, 64 decodes x 160 tokens, 9 heads over 3
 * KV heads, 30 layers, ms per step (median of 5), per-head loop -> this: 34.4 -> 28.4 with each
 * sequence's blocks consecutive, 27.7 -> 23.1 (best) with blocks scattered. */
#define GT 4
#define DEFINE_DECODE_ONE_VEC(SUFFIX, T)                                                     \
INLINE void decode_tile_vec_##SUFFIX(const float *q_scaled, const T *kbase, const T *vbase, \
                                     const int32_t *table, int ctx, int block_size,          \
                                     const int gt, const int D, int prefetch, float *scores, \
                                     T *out) {                                               \
    const int NV = D / VL;                                                                   \
    const int nblocks = (ctx + block_size - 1) / block_size;                                 \
    float m[GT];                                                                             \
    for (int g = 0; g < gt; g++) m[g] = -INFINITY;                                           \
    for (int j = 0; j < nblocks; j++) {                                                      \
        const T *kb = kbase + (int64_t)table[j] * block_size * D;                            \
        const int n = j == nblocks - 1 ? ctx - j * block_size : block_size;                  \
        if (prefetch) {                    /* the values are read next: fetch them too */   \
            if (j + 1 < nblocks)                                                             \
                prefetch_block(kbase + (int64_t)table[j + 1] * block_size * D,               \
                               block_size * D * (int)sizeof(T));                             \
            prefetch_block(vbase + (int64_t)table[j] * block_size * D,                       \
                           block_size * D * (int)sizeof(T));                                 \
        }                                                                                    \
        for (int t = 0; t < n; t += 2) {   /* row pairs: twice the independent FMA chains; */ \
            const int two = t + 1 < n;     /* an odd last row is paired with itself         */ \
            const T *k0r = kb + t * D, *k1r = k0r + two * D;                                 \
            V s0[GT], s1[GT];                                                                \
            for (int g = 0; g < gt; g++) s0[g] = s1[g] = vzero();                            \
            for (int i = 0; i < NV; i++) {                                                   \
                const V k0 = vload_##SUFFIX(k0r + VL * i), k1 = vload_##SUFFIX(k1r + VL * i);\
                for (int g = 0; g < gt; g++) {                                               \
                    const V q = vload_f32(q_scaled + g * D + VL * i);                        \
                    s0[g] = vfma(q, k0, s0[g]);                                              \
                    s1[g] = vfma(q, k1, s1[g]);                                              \
                }                                                                            \
            }                                                                                \
            for (int g = 0; g < gt; g++) {                                                   \
                float *sg = scores + (int64_t)g * ctx + j * block_size + t;                  \
                sg[0] = vsum(s0[g]);                                                         \
                m[g] = sg[0] > m[g] ? sg[0] : m[g];                                          \
                if (two) {                                                                   \
                    sg[1] = vsum(s1[g]);                                                     \
                    m[g] = sg[1] > m[g] ? sg[1] : m[g];                                      \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    V inv[GT];                                                                               \
    for (int g = 0; g < gt; g++) {                                                           \
        const float sum = exp_and_sum(scores + (int64_t)g * ctx, ctx, m[g]);                 \
        inv[g] = vset1(sum > 0.f ? 1.f / sum : 0.f);                                         \
    }                                                                                        \
    for (int i = 0; i < NV; i++) {                                                           \
        V acc[GT], acc1[GT];                                                                 \
        for (int g = 0; g < gt; g++) acc[g] = acc1[g] = vzero();                             \
        for (int j = 0; j < nblocks; j++) {                                                  \
            const T *vb = vbase + (int64_t)table[j] * block_size * D + VL * i;               \
            const int n = j == nblocks - 1 ? ctx - j * block_size : block_size;              \
            if (prefetch && i == 0 && j + 1 < nblocks)                                       \
                prefetch_block(vbase + (int64_t)table[j + 1] * block_size * D,               \
                               block_size * D * (int)sizeof(T));                             \
            const float *sj = scores + j * block_size;                                       \
            int t = 0;                                                                       \
            for (; t + 1 < n; t += 2) {    /* row pairs: two accumulators per head */        \
                const V v0 = vload_##SUFFIX(vb + t * D), v1 = vload_##SUFFIX(vb + (t + 1) * D);\
                for (int g = 0; g < gt; g++) {                                               \
                    acc[g] = vfma(vset1(sj[(int64_t)g * ctx + t]), v0, acc[g]);              \
                    acc1[g] = vfma(vset1(sj[(int64_t)g * ctx + t + 1]), v1, acc1[g]);        \
                }                                                                            \
            }                                                                                \
            if (t < n) {                                                                     \
                const V v = vload_##SUFFIX(vb + t * D);                                      \
                for (int g = 0; g < gt; g++)                                                 \
                    acc[g] = vfma(vset1(sj[(int64_t)g * ctx + t]), v, acc[g]);               \
            }                                                                                \
        }                                                                                    \
        for (int g = 0; g < gt; g++) {                                                       \
            float res[VL];                                                                   \
            vstore(res, vmul(vadd(acc[g], acc1[g]), inv[g]));                               \
            T *o = out + g * D + VL * i;                                                     \
            for (int d = 0; d < VL; d++) o[d] = store_##SUFFIX(res[d]);                      \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
INLINE void decode_one_vec_##SUFFIX(const float *q_scaled, const T *kbase, const T *vbase,  \
                                    const int32_t *table, int ctx, int block_size,           \
                                    int group, const int D, float *scores, T *out) {         \
    for (int g0 = 0; g0 < group; g0 += GT) {    /* constant tile sizes: unrolled, in regs */ \
        const float *q = q_scaled + g0 * D;                                                  \
        float *s = scores + (int64_t)g0 * ctx;                                               \
        T *o = out + g0 * D;                                                                 \
        switch (group - g0 < GT ? group - g0 : GT) {                                         \
        case 1: decode_tile_vec_##SUFFIX(q, kbase, vbase, table, ctx, block_size, 1, D,     \
                                         g0 == 0, s, o); break;                              \
        case 2: decode_tile_vec_##SUFFIX(q, kbase, vbase, table, ctx, block_size, 2, D,     \
                                         g0 == 0, s, o); break;                              \
        case 3: decode_tile_vec_##SUFFIX(q, kbase, vbase, table, ctx, block_size, 3, D,     \
                                         g0 == 0, s, o); break;                              \
        default: decode_tile_vec_##SUFFIX(q, kbase, vbase, table, ctx, block_size, 4, D,    \
                                          g0 == 0, s, o); break;                             \
        }                                                                                    \
    }                                                                                        \
}

DEFINE_DECODE_ONE_VEC(f32, float)
DEFINE_DECODE_ONE_VEC(bf16, uint16_t)
#define DECODE_VEC(SUFFIX, ...) decode_one_vec_##SUFFIX(__VA_ARGS__)
#else
#define VL 1           /* unused: HAVE_VEC is 0, so the vector branches are never taken */
#define DECODE_VEC(SUFFIX, ...) decode_one_##SUFFIX(__VA_ARGS__)
#endif

/* attention_amx.c: the rows of prefill runs attended on AMX tiles (bfloat16; a mask of the rows
 * done, to be freed, or NULL). */
uint8_t *attention_amx_prefill(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                               const uint16_t *v_cache, const int32_t *tables, int max_blocks,
                               const int32_t *ctx_lens, uint16_t *out, int num_seqs,
                               int num_heads, int num_kv_heads, int D, int bs,
                               int64_t num_blocks, float scale, int num_threads);
#define AMX_PREFILL_bf16(...) attention_amx_prefill(__VA_ARGS__)
#define AMX_PREFILL_f32(...) NULL

/* Returns 0, or -1 when head_dim or the GQA group is larger than the kernel's buffers. */
#define DEFINE_KERNELS(SUFFIX, T)                                                            \
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
    const int group = num_heads / num_kv_heads;                                              \
    if (head_dim > 256 || group > MAX_GROUP) return -1;                                      \
    const int64_t head_elems = num_blocks * block_size * head_dim;                           \
    uint8_t *done = AMX_PREFILL_##SUFFIX(q, q_stride, k_cache, v_cache, block_tables,        \
                                         max_blocks, ctx_lens, out, num_seqs, num_heads,     \
                                         num_kv_heads, head_dim, block_size, num_blocks,     \
                                         scale, num_threads);                                \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")   \
    for (int b = 0; b < num_seqs; b++) {                                                     \
        for (int kh = 0; kh < num_kv_heads; kh++) {                                          \
            if (done && done[b]) continue;              /* a prefill run's: on AMX tiles */ \
            const int ctx = ctx_lens[b];                                                     \
            float qf[MAX_GROUP * 256];                                                       \
            for (int g = 0; g < group; g++) {                                                \
                const T *qh = q + b * q_stride + (int64_t)(kh * group + g) * head_dim;       \
                for (int d = 0; d < head_dim; d++)                                           \
                    qf[g * head_dim + d] = load_##SUFFIX(qh[d]) * scale;                     \
            }                                                                                \
            float *scores = malloc(sizeof(float) * (size_t)group * (ctx > 0 ? ctx : 1));     \
            const int32_t *table = block_tables + (int64_t)b * max_blocks;                   \
            const T *kb = k_cache + kh * head_elems, *vb = v_cache + kh * head_elems;        \
            T *o = out + ((int64_t)b * num_heads + kh * group) * head_dim;                   \
            if (HAVE_VEC && head_dim == 64)                                                  \
                DECODE_VEC(SUFFIX, qf, kb, vb, table, ctx, block_size, group, 64, scores, o);\
            else if (HAVE_VEC && head_dim == 128)                                            \
                DECODE_VEC(SUFFIX, qf, kb, vb, table, ctx, block_size, group, 128, scores, o);\
            else if (HAVE_VEC && head_dim % VL == 0)                                         \
                DECODE_VEC(SUFFIX, qf, kb, vb, table, ctx, block_size, group, head_dim,      \
                           scores, o);                                                       \
            else                                                                             \
                decode_one_##SUFFIX(qf, kb, vb, table, ctx, block_size, group, head_dim,     \
                                    scores, o);                                              \
            free(scores);                                                                    \
        }                                                                                    \
    }                                                                                        \
    free(done);                                                                              \
    return 0;                                                                                \
}

DEFINE_KERNELS(f32, float)
DEFINE_KERNELS(bf16, uint16_t)

/* ------------------------------------------------------------------ fused elementwise ops
 * vLLM's fused_add_rms_norm, silu_and_mul and rotary_embedding (csrc/layernorm_kernels.cu,
 * activation_kernels.cu, pos_encoding_kernels.cu), float32 math, one pass over each row.
 * Rows are parallel over OpenMP threads from PARALLEL_ROWS rows up (below, a parallel region
 * costs more than the work). */
#define PARALLEL_ROWS 16

#define DEFINE_ELEMENTWISE(SUFFIX, T)                                                        \
/* residual == NULL: out = rms_norm(x) * weight.  Else: residual += x (rounded to T), then     \
 * x = rms_norm(residual) * weight, in place (out is ignored). Rows [n, hidden] contiguous. */ \
void add_rms_norm_##SUFFIX(T *x, T *residual, const T *weight, T *out, int n, int hidden,   \
                           float eps, int num_threads) {                                     \
    _Pragma("omp parallel for num_threads(num_threads) if(n >= PARALLEL_ROWS)")             \
    for (int r = 0; r < n; r++) {                                                            \
        T *xr = x + (int64_t)r * hidden;                                                     \
        const T *src = xr;                                                                   \
        T *dst = out + (int64_t)r * hidden;                                                  \
        if (residual) {                                                                      \
            T *rr = residual + (int64_t)r * hidden;                                          \
            for (int i = 0; i < hidden; i++)                                                 \
                rr[i] = store_##SUFFIX(load_##SUFFIX(xr[i]) + load_##SUFFIX(rr[i]));         \
            src = rr;                                                                        \
            dst = xr;                                                                        \
        }                                                                                    \
        float ss = 0.f;                                                                      \
        _Pragma("omp simd reduction(+:ss)")                                                  \
        for (int i = 0; i < hidden; i++) {                                                   \
            const float v = load_##SUFFIX(src[i]);                                           \
            ss += v * v;                                                                     \
        }                                                                                    \
        const float inv = 1.f / sqrtf(ss / hidden + eps);                                    \
        for (int i = 0; i < hidden; i++)                                                     \
            dst[i] = store_##SUFFIX(load_##SUFFIX(src[i]) * inv * load_##SUFFIX(weight[i])); \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* out [n, inter] = silu(x[:, :inter]) * x[:, inter:], x [n, 2 * inter] contiguous. */      \
void silu_and_mul_##SUFFIX(const T *x, T *out, int n, int inter, int num_threads) {         \
    _Pragma("omp parallel for num_threads(num_threads) if(n >= PARALLEL_ROWS)")             \
    for (int r = 0; r < n; r++) {                                                            \
        const T *g = x + (int64_t)r * 2 * inter, *u = g + inter;                             \
        T *o = out + (int64_t)r * inter;                                                     \
        _Pragma("omp simd")                                                                  \
        for (int i = 0; i < inter; i++) {                                                    \
            const float a = load_##SUFFIX(g[i]);                                             \
            o[i] = store_##SUFFIX(a / (1.f + expf(-a)) * load_##SUFFIX(u[i]));               \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* Rotate-half RoPE in place on x [n, heads, D] (row stride x_stride, heads contiguous):      \
 * x = x * cos + rotate_half(x) * sin, with cos / sin [max_pos, D] tables and sin's first     \
 * half negated (so rotate_half(x) * sin = roll(x, D/2) * sin_signed). */                     \
void rotary_##SUFFIX(T *x, int64_t x_stride, const int64_t *positions, const T *cos,        \
                     const T *sin, int n, int heads, int D, int num_threads) {               \
    const int half = D / 2;                                                                  \
    _Pragma("omp parallel for num_threads(num_threads) if(n >= PARALLEL_ROWS)")             \
    for (int r = 0; r < n; r++) {                                                            \
        const T *c = cos + positions[r] * D, *s = sin + positions[r] * D;                    \
        for (int h = 0; h < heads; h++) {                                                    \
            T *v = x + r * x_stride + (int64_t)h * D;                                        \
            _Pragma("omp simd")                                                              \
            for (int i = 0; i < half; i++) {                                                 \
                const float a = load_##SUFFIX(v[i]), b = load_##SUFFIX(v[i + half]);         \
                v[i] = store_##SUFFIX(a * load_##SUFFIX(c[i]) + b * load_##SUFFIX(s[i]));    \
                v[i + half] = store_##SUFFIX(b * load_##SUFFIX(c[i + half])                  \
                                             + a * load_##SUFFIX(s[i + half]));              \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
}

DEFINE_ELEMENTWISE(f32, float)
DEFINE_ELEMENTWISE(bf16, uint16_t)
