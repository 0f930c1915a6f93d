/*
 * Writes into an 8-bit KV cache (`--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2`,
 * engine/kv_quant.py): each (token, KV head) row of the step's new K / V, float32 or bfloat16,
 * quantized into its slot of the cache's uint8 rows. cpu_kernels.c's paged_decode8 reads them.
 *
 *   int8   head_dim int8 values, then the row's scale as float16 (max |x| / 127, the values
 *          round(x / scale) in [-127, 127]): a scale per token and head, as llama.cpp's q8_0
 *          keeps one per 32 values and OpenVINO's u8 cache one per group;
 *   fp8    head_dim float8 values of x * inv_scale (one scale per tensor, vLLM's
 *          `--kv-cache-dtype fp8`), e4m3fn or e5m2, rounded to nearest even and saturated
 *          (common.h: f32_to_fp8), the bytes torch's float8 casts give.
 *
 * Layouts as cpu_kernels.c's cache_write, with rows of kv_row_bytes(kind, head_dim) bytes.
 */
#include "common.h"

/* One row of D float32 values into dst (kind: common.h's KV_*). */
static void quant_row(const float *x, int D, int kind, float inv_scale, uint8_t *dst) {
    if (kind == KV_INT8) {
        float amax = 0.f;
        for (int d = 0; d < D; d++) amax = fmaxf(amax, fabsf(x[d]));
        const uint16_t h = f32_to_f16(amax / 127.f);
        const float s = f16_to_f32(h), inv = s > 0.f ? 1.f / s : 0.f;
        for (int d = 0; d < D; d++) {
            const float r = rintf(x[d] * inv);
            dst[d] = (uint8_t)(int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
        }
        memcpy(dst + D, &h, sizeof h);
    } else if (kind == KV_E4M3) {
        for (int d = 0; d < D; d++) dst[d] = f32_to_e4m3(x[d] * inv_scale);
    } else {
        for (int d = 0; d < D; d++) dst[d] = f32_to_e5m2(x[d] * inv_scale);
    }
}

/* cache_write into an 8-bit cache: k, v [num_tokens, num_kv_heads, head_dim] (token strides
 * k_stride, v_stride), caches [num_kv_heads, num_blocks * block_size (= slots_per_head)] rows.
 * Returns 0; -1 for a head_dim over 256 or an unknown kind. */
#define DEFINE_CACHE_WRITE8(SUFFIX, T)                                                       \
int cache_write8_##SUFFIX(const T *k, const T *v, uint8_t *k_cache, uint8_t *v_cache,       \
                          const int64_t *slots, int num_tokens, int num_kv_heads,            \
                          int head_dim, int64_t k_stride, int64_t v_stride,                  \
                          int64_t slots_per_head, int kind, float k_inv_scale,               \
                          float v_inv_scale, int num_threads) {                              \
    if (head_dim > 256 || kind < KV_INT8 || kind > KV_E5M2) return -1;                       \
    const int64_t rb = kv_row_bytes(kind, head_dim);                                         \
    _Pragma("omp parallel for num_threads(num_threads) if(num_tokens >= 16)")               \
    for (int t = 0; t < num_tokens; t++) {                                                   \
        float x[256];                                                                        \
        for (int h = 0; h < num_kv_heads; h++) {                                             \
            const int64_t row = (h * slots_per_head + slots[t]) * rb;                        \
            const T *kr = k + t * k_stride + (int64_t)h * head_dim;                          \
            for (int d = 0; d < head_dim; d++) x[d] = load_##SUFFIX(kr[d]);                  \
            quant_row(x, head_dim, kind, k_inv_scale, k_cache + row);                        \
            const T *vr = v + t * v_stride + (int64_t)h * head_dim;                          \
            for (int d = 0; d < head_dim; d++) x[d] = load_##SUFFIX(vr[d]);                  \
            quant_row(x, head_dim, kind, v_inv_scale, v_cache + row);                        \
        }                                                                                    \
    }                                                                                        \
    return 0;                                                                                \
}
DEFINE_CACHE_WRITE8(f32, float)
DEFINE_CACHE_WRITE8(bf16, uint16_t)
