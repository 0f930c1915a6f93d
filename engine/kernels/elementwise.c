/*
 * Fused elementwise ops of the decoder layers: vLLM's fused_add_rms_norm, silu_and_mul and
 * rotary_embedding (csrc/layernorm_kernels.cu, activation_kernels.cu, pos_encoding_kernels.cu),
 * float32 math, one pass over each row.
 * Rows are parallel over OpenMP threads from PARALLEL_ROWS rows up (below, a parallel region
 * costs more than the work).
 *
 * In / out: row-major [n, hidden] (or [n, 2 * inter], [n, heads, D]) float32 (suffix _f32) or
 * bfloat16 stored as uint16 (suffix _bf16), as each function's comment says; called through
 * ctypes (engine/kernels/__init__.py) and by layer_stack.c.
 */
#include "common.h"

/* glibc's vector expf (libmvec), as cpu_kernels.c declares it: SiLU's loop vectorizes. */
#if defined(__x86_64__)
#pragma omp declare simd notinbranch
float expf(float);
#endif

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
