/*
 * The decoder's layers in one call, for models whose projections are all quantized (the GGUF
 * default on the CPU): the same kernels the Python forward pass calls one by one (quant.c's
 * quant_linear, elementwise.c's fused ops, cpu_kernels.c's K/V write and paged attention), in
 * the same order with the same arguments, so the result is bit-identical to it; what goes is
 * the Python between them — ~10 calls a layer through ctypes, their argument conversions,
 * views and allocations: about 40 us a layer, a sixth of a single-stream decode step on 2
 * cores.
 *
 * Per layer (llama.py's fused path):
 *   qkv  = h @ Wqkv^T (+ bias)           [n, (H + 2 KVH) D]
 *   rotary on q and k heads; K/V written through the slot mapping
 *   attn = paged attention of q          [n, H D]
 *   o    = attn @ Wo^T;  x += o;  o = rms_norm(x) * ln2
 *   act  = silu(gate) * up of (o @ Wgu^T)
 *   h    = act @ Wdown^T;  x += h;  h = rms_norm(x) * next norm (the next layer's ln1, or the
 *          final norm after the last layer)
 * In: token ids [n], looked up in the struct's embedding table into x, or x [n, hidden] filled
 * by the caller; then h = rms_norm(x) * ln1 of layer 0, x the residual stream (updated in
 * place); out: h after the final norm. Scratch buffers from the caller.
 * Element type T: float32 or bfloat16 (stack->bf16), as the model's.
 * With a `logits` buffer (and the model's quantized LM head in the struct), every row's float32
 * logits [n, vocab] = h @ Wlm^T too, by the call compute_logits makes (the same bits): the
 * Python between the layers and the LM head ran after 66 MB of weights had streamed through
 * the caches, which costs it several times its warm time (docs/cpu.md, "Single stream on an
 * AVX2 host"). With a `greedy` buffer too, each row's argmax over its logits (sample.c's, the
 * same index torch.argmax gives), taken while the logits are still in the cores' caches; the
 * embedding lookup and the first norm are in the call for the same reason.
 */
#include "quant_blocks.h"

/* One quantized projection as quant_linear takes it. */
typedef struct {
    int type;                  /* GGML type id */
    const uint8_t *w;          /* n rows of row_bytes */
    int64_t row_bytes;
    const float *scale;        /* per-row scale (int8) or NULL */
    const float *bias;         /* float32 [n] or NULL */
    int64_t n, k;
    const uint8_t *q8_packed;  /* quant_q8_pack's copy (int8 x, every row count) or NULL */
    const uint8_t *panel_packed; /* quant_panel_pack's copy (bfloat16 panels) or NULL */
} qproj;

typedef struct {
    const void *ln1, *ln2;     /* [hidden] T */
    qproj qkv, o, gate_up, down;
    void *k_cache, *v_cache;   /* [kv_heads, num_blocks, block_size, head_dim] T */
} layer_ptrs;

typedef struct {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, block_size, bf16;
    int int8_x;                /* x quantized to int8 in the products (quant_linear_q8) */
    int64_t num_blocks;
    float eps, scale;
    const void *cos, *sin;     /* [max_pos, head_dim] T, sin's first half negated */
    const void *final_norm;
    const layer_ptrs *layers;
    int kv_kind;               /* 0: caches of T; else an 8-bit cache (common.h's KV_*) */
    float k_write, v_write;    /* 8-bit: 1 / the fp8 scales (cache_write8's inv scales) */
    float k_read, v_read;      /* 8-bit: the read scales (paged_decode8's, e4m3's unit in) */
    qproj head;                /* the LM head (w NULL: none), float32 logits */
    int head_int8_x;           /* its x quantized to int8 (its own setting) */
    qproj embed;               /* the quantized embedding table [n, k] (w NULL: none, the
                                  caller fills x) */
} layer_stack;

int quant_embed(int, const uint8_t *, int64_t, const float *, const int64_t *, int64_t, int64_t,
                int64_t, void *, int);
void argmax_rows_f32(const float *, int64_t, int64_t, int64_t, int64_t *, int);

/* cpu_kernels.c's and elementwise.c's entry points, as they define them. */
#define DECLARE_T(SUFFIX, T)                                                                  \
void cache_write_##SUFFIX(const T *, const T *, T *, T *, const int64_t *, int, int, int,    \
                          int64_t, int64_t, int64_t);                                         \
int paged_decode_##SUFFIX(const T *, int64_t, const T *, const T *, const int32_t *, int,    \
                          const int32_t *, T *, int, int, int, int, int, int64_t, float, int);\
void add_rms_norm_##SUFFIX(T *, T *, const T *, T *, int, int, float, int);                  \
void silu_and_mul_##SUFFIX(const T *, T *, int, int, int);                                    \
void rotary_##SUFFIX(T *, int64_t, const int64_t *, const T *, const T *, int, int, int, int);
DECLARE_T(f32, float)
DECLARE_T(bf16, uint16_t)
#define DECLARE_8(SUFFIX, T)                                                                  \
int cache_write8_##SUFFIX(const T *, const T *, uint8_t *, uint8_t *, const int64_t *, int,  \
                          int, int, int64_t, int64_t, int64_t, int, float, float, int);      \
int paged_decode8_##SUFFIX(const T *, int64_t, const uint8_t *, const uint8_t *,             \
                           const int32_t *, int, const int32_t *, T *, int, int, int, int,    \
                           int, int64_t, float, float, int, int);
DECLARE_8(f32, float)
DECLARE_8(bf16, uint16_t)

/* The layer's K / V write and paged attention over its cache (8-bit or of T); -3 when
 * paged attention cannot take head_dim or the GQA group. */
#define ATTEND(SUFFIX)                                                                        \
    do {                                                                                      \
        const int64_t slots_per_head = s->num_blocks * s->block_size;                         \
        if (s->kv_kind) {                                                                     \
            if (cache_write8_##SUFFIX(qkv + qs, qkv + qs + kvs, l->k_cache, l->v_cache, slots,\
                                      n, KVH, D, row, row, slots_per_head, s->kv_kind,       \
                                      s->k_write, s->v_write, threads) ||                    \
                paged_decode8_##SUFFIX(qkv, row, l->k_cache, l->v_cache, tables, max_blocks, \
                                       ctx_lens, attn, n, H, KVH, D, s->block_size,          \
                                       s->num_blocks, s->scale * s->k_read, s->v_read,       \
                                       s->kv_kind, threads))                                 \
                return -3;                                                                    \
        } else {                                                                              \
            cache_write_##SUFFIX(qkv + qs, qkv + qs + kvs, l->k_cache, l->v_cache, slots, n,  \
                                 KVH, D, row, row, slots_per_head);                           \
            if (paged_decode_##SUFFIX(qkv, row, l->k_cache, l->v_cache, tables, max_blocks,   \
                                      ctx_lens, attn, n, H, KVH, D, s->block_size,            \
                                      s->num_blocks, s->scale, threads))                      \
                return -3;                                                                    \
        }                                                                                     \
    } while (0)

/* y [n, p->n] = x p^T as quant_linear makes it: y float32 (y_f32) or of T, x quantized to
 * int8 where int8_x. */
static int product(const layer_stack *s, const qproj *p, int int8_x, const void *x,
                   int64_t x_stride, void *y, int y_f32, int n, int threads) {
    if (int8_x)
        return quant_linear_q8(p->type, p->w, p->row_bytes, p->scale, p->bias, x, x_stride,
                               s->bf16, y, p->n, y_f32, n, p->n, p->k, threads, p->q8_packed);
    return quant_linear_packed(p->type, p->w, p->row_bytes, p->scale, p->bias, x, x_stride,
                               s->bf16, y, p->n, y_f32, n, p->n, p->k, threads,
                               p->panel_packed);
}

/* A layer's projection: y of T. */
static int project(const layer_stack *s, const qproj *p, const void *x, int64_t x_stride,
                   void *y, int n, int threads) {
    return product(s, p, s->int8_x, x, x_stride, y, !s->bf16, n, threads);
}

/* Every layer of `s` over n tokens (see the file comment): x [n, hidden] in, h = rms_norm(x) *
 * ln1 of layer 0 first, h after the final norm out. positions [n] int64, slots [n] int64,
 * block_tables [n, max_blocks] int32 and ctx_lens [n] int32 as paged_decode takes them.
 * Scratch (T): qkv [n, (H + 2 KVH) D], attn [n, H D], o [n, hidden], gu [n, 2 inter],
 * act [n, inter]. Returns 0; -1 out of memory; -2 a weight without kernels; -3 head_dim or the
 * GQA group too large for paged attention. */
#define DEFINE_STACK(SUFFIX, T)                                                               \
static int stack_##SUFFIX(const layer_stack *s, T *x, T *h, int n, const int64_t *positions,  \
                          const int64_t *slots, const int32_t *tables, int max_blocks,        \
                          const int32_t *ctx_lens, T *qkv, T *attn, T *o, T *gu, T *act,      \
                          int threads) {                                                      \
    const int D = s->head_dim, H = s->num_heads, KVH = s->num_kv_heads;                       \
    const int64_t qs = (int64_t)H * D, kvs = (int64_t)KVH * D, row = qs + 2 * kvs;            \
    add_rms_norm_##SUFFIX(x, NULL, s->layers[0].ln1, h, n, s->hidden, s->eps, threads);        \
    for (int i = 0; i < s->num_layers; i++) {                                                 \
        const layer_ptrs *l = &s->layers[i];                                                  \
        int rc = project(s, &l->qkv, h, s->hidden, qkv, n, threads);                     \
        if (rc) return rc;                                                                    \
        rotary_##SUFFIX(qkv, row, positions, s->cos, s->sin, n, H + KVH, D, threads);          \
        ATTEND(SUFFIX);                                                                       \
        if ((rc = project(s, &l->o, attn, qs, o, n, threads))) return rc;                \
        add_rms_norm_##SUFFIX(o, x, l->ln2, NULL, n, s->hidden, s->eps, threads);              \
        if ((rc = project(s, &l->gate_up, o, s->hidden, gu, n, threads))) return rc;     \
        silu_and_mul_##SUFFIX(gu, act, n, s->inter, threads);                                  \
        if ((rc = project(s, &l->down, act, s->inter, h, n, threads))) return rc;        \
        const T *next = i + 1 < s->num_layers ? s->layers[i + 1].ln1 : s->final_norm;         \
        add_rms_norm_##SUFFIX(h, x, next, NULL, n, s->hidden, s->eps, threads);                \
    }                                                                                         \
    return 0;                                                                                 \
}
DEFINE_STACK(f32, float)
DEFINE_STACK(bf16, uint16_t)

/* x [n, hidden] (T) = the embedding rows of ids [n]. Returns 0; -2 a table type without
 * kernels; -5 an id outside the table. */
static int embed(const layer_stack *s, const int64_t *ids, void *x, int n) {
    const qproj *e = &s->embed;
    const int rc = quant_embed(e->type, e->w, e->row_bytes, e->scale, ids, n, e->n, e->k, x,
                               !s->bf16);
    return rc == -3 ? -5 : rc;
}

/* Returns 0; -1 out of memory; -2 a weight without kernels; -3 head_dim or the GQA group too
 * large for paged attention; -4 logits or greedy asked of a stack without an LM head (or
 * greedy without logits), or ids of a stack without an embedding table; -5 a token id outside
 * the embedding table. */
int layer_stack_forward(const layer_stack *s, const int64_t *ids, void *x, void *h, int n,
                        const int64_t *positions, const int64_t *slots, const int32_t *tables,
                        int max_blocks, const int32_t *ctx_lens, void *qkv, void *attn, void *o,
                        void *gu, void *act, float *logits, int64_t *greedy, int threads) {
    if ((logits && !s->head.w) || (greedy && !logits) || (ids && !s->embed.w)) return -4;
    int rc = ids ? embed(s, ids, x, n) : 0;
    if (rc) return rc;
    rc = s->bf16
        ? stack_bf16(s, x, h, n, positions, slots, tables, max_blocks, ctx_lens, qkv, attn, o,
                     gu, act, threads)
        : stack_f32(s, x, h, n, positions, slots, tables, max_blocks, ctx_lens, qkv, attn, o,
                    gu, act, threads);
    if (rc || !logits) return rc;
    rc = product(s, &s->head, s->head_int8_x, h, s->hidden, logits, 1, n, threads);
    if (rc || !greedy) return rc;
    argmax_rows_f32(logits, n, s->head.n, s->head.n, greedy, threads);
    return 0;
}
