/*
 * Greedy sampling's argmax over float32 logits, one row per thread: torch's CPU argmax walks a
 * [64, 49152] batch element by element (~4 ms on a 2-core AMX Xeon, 5 % of a 64-row decode
 * step); this one takes a vectorized max, then looks for its first occurrence 64 values at a
 * time (a 196 KiB row is still in L2 for the second pass). A single row (single-stream
 * decode, where layer_stack.c calls it right after the LM head) is split over the threads.
 *
 * torch.argmax's semantics, kept exactly: the first index of the maximum; a NaN counts as
 * larger than everything (the first NaN's index); a row of -inf answers 0.
 */
#include "common.h"

#define CHUNK 64

/* The first index in x[0, n) equal to m (m not NaN), or of the first NaN when m is NaN. */
static int64_t first_of(const float *x, int64_t n, float m) {
    const int nan = m != m;
    int64_t i = 0;
    for (; i + CHUNK <= n; i += CHUNK) {
        int hit = 0;
        for (int j = 0; j < CHUNK; j++)       /* vectorized: an OR of compares */
            hit |= nan ? x[i + j] != x[i + j] : x[i + j] == m;
        if (hit) break;
    }
    for (; i < n; i++)
        if (nan ? x[i] != x[i] : x[i] == m) return i;
    return 0;
}

/* The maximum of x[0, n) (n >= 1), NaN when any value is NaN. */
static float row_max(const float *x, int64_t n) {
    float lanes[CHUNK];
    int nan = 0;
    for (int j = 0; j < CHUNK; j++) lanes[j] = -INFINITY;
    int64_t i = 0;
    for (; i + CHUNK <= n; i += CHUNK)
        for (int j = 0; j < CHUNK; j++) {     /* vectorized: maxps and an OR of NaN tests */
            const float v = x[i + j];
            lanes[j] = v > lanes[j] ? v : lanes[j];
            nan |= v != v;
        }
    float m = -INFINITY;
    for (int j = 0; j < CHUNK; j++) m = lanes[j] > m ? lanes[j] : m;
    for (; i < n; i++) {
        m = x[i] > m ? x[i] : m;
        nan |= x[i] != x[i];
    }
    return nan ? NAN : m;
}

/* The argmax of x[0, n) as cut into `parts` slices, each slice's (max, first index) found
 * by its own thread and merged in slice order: a NaN wins, else a larger max, and a tie
 * keeps the earlier slice — the first index of the maximum, as over the whole row. For a
 * single row the LM head's product has just written: half of it sits in each core's cache. */
static int64_t split_argmax(const float *x, int64_t n, int parts) {
    float maxes[64];
    int64_t where[64];
    if (parts > 64) parts = 64;
    #pragma omp parallel for schedule(static) num_threads(parts)
    for (int p = 0; p < parts; p++) {
        const int64_t a = n * p / parts, b = n * (p + 1) / parts;
        maxes[p] = b > a ? row_max(x + a, b - a) : -INFINITY;
        where[p] = b > a ? a + first_of(x + a, b - a, maxes[p]) : a;
    }
    int best = 0;
    for (int p = 1; p < parts; p++) {
        if (maxes[best] != maxes[best]) break;
        if (maxes[p] != maxes[p] || maxes[p] > maxes[best]) best = p;
    }
    return where[best];
}

/* out[r] = argmax of row r of x [rows, n] float32 (row stride `stride` floats), int64: a row a
 * thread, or one row split over the threads. */
void argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out,
                     int num_threads) {
    if (rows == 1 && num_threads > 1 && n >= 4096) {
        out[0] = split_argmax(x, n, num_threads);
        return;
    }
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        out[r] = n > 0 ? first_of(row, n, row_max(row, n)) : 0;
    }
}
