/* Shared-memory all-reduce and all-gather for tensor-parallel ranks on one host
 * (engine/distributed/shm.py builds this with the system compiler and calls it via ctypes).
 *
 * Layout of the shared mapping: a 4 KiB header, then two buffers of `world` slots of
 * `slot_bytes` each. A collective moves its tensor in chunks of at most `slot_bytes`; chunk
 * number s (counted alike on every rank) uses buffer s % 2:
 *   1. each rank copies its chunk into its slot of that buffer;
 *   2. it arrives: one atomic increment of `arrived`, the counter of all arrivals; chunk s is
 *      complete when `arrived` reaches (s + 1) * world;
 *   3. it waits for that, then reads every rank's slot (summing in rank order 0..world-1, so
 *      that every rank computes the same bits; bfloat16 summed in float32, rounded once).
 * One barrier per chunk is enough with two buffers: a rank writes buffer b again at chunk
 * s + 2 only after chunk s + 1 completed, and every rank arrives at s + 1 only after reading
 * chunk s.
 * Waiting: spin (`pause`) up to `spin_ns`, then sleep on the `arrived` futex word, waking every
 * 20 ms to look for a dead peer (its pid gone or a zombie) or an abort. The last arriver wakes
 * sleepers only when there are any (`sleepers`, a Dekker pair with `arrived`: sequentially
 * consistent atomics, so that a sleeper either sees the last arrival or is woken by it).
 * The same mechanism as vLLM's CPU shared-memory communicator (csrc/cpu/shm.cpp), which spins
 * without bound; the futex sleep keeps ranks that share cores (more ranks than CPUs) from
 * spinning on the CPU that the late rank needs.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SHM_MAX_RANKS 256
#define SHM_HEADER_BYTES 4096

typedef struct {
    _Atomic uint32_t arrived;   /* futex word: arrivals over every chunk so far */
    _Atomic uint32_t sleepers;  /* ranks asleep (or about to sleep) on `arrived` */
    _Atomic uint32_t aborted;   /* 1 + the rank of a dead peer, set by whoever saw it first */
    uint32_t world;
    int32_t pids[SHM_MAX_RANKS];
} shm_header;

_Static_assert(sizeof(shm_header) <= SHM_HEADER_BYTES, "header too large");

/* One rank's view (private memory; shm.py's ctypes structure mirrors it). */
typedef struct {
    char *base;           /* the shared mapping */
    int64_t slot_bytes;
    int32_t rank, world;
    uint64_t seq;         /* chunks this rank has completed */
    int64_t spin_ns;      /* spin this long before sleeping */
    int64_t timeout_ns;   /* give up (-2) after waiting this long for one chunk */
} shm_comm;

enum { SHM_OK = 0, SHM_TIMEOUT = -2, SHM_ROW_TOO_LONG = -3 };

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static shm_header *header(const shm_comm *c) { return (shm_header *)c->base; }

/* Rank `rank`'s slot in buffer `buf` (0 or 1). */
static char *slot(const shm_comm *c, int buf, int rank) {
    return c->base + SHM_HEADER_BYTES + ((int64_t)buf * c->world + rank) * c->slot_bytes;
}

/* Whether process `pid` still runs: not gone, and not a zombie waiting to be reaped. */
static int alive(int32_t pid) {
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 0;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return errno != ENOENT;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 1;
    buf[n] = 0;
    char *end = strrchr(buf, ')');          /* "pid (comm) S ..." */
    return !(end && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X'));
}

/* 0 while every peer runs, else 1 + the rank of a dead one (and every rank is told). */
static int dead_peer(shm_comm *c) {
    shm_header *h = header(c);
    for (int r = 0; r < c->world; r++)
        if (r != c->rank && !alive(h->pids[r])) {
            atomic_store(&h->aborted, (uint32_t)(1 + r));
            syscall(SYS_futex, &h->arrived, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
            return 1 + r;
        }
    return 0;
}

/* Arrive at the current chunk and wait until every rank has; then seq advances. Returns
   SHM_OK, 1 + the rank of a dead peer (seen here or by another rank), or SHM_TIMEOUT. */
static int arrive_and_wait(shm_comm *c) {
    shm_header *h = header(c);
    uint32_t target = (uint32_t)((c->seq + 1) * (uint64_t)c->world);
    uint32_t before = atomic_fetch_add(&h->arrived, 1);
    if (before + 1 == target) {              /* the last one in wakes the sleepers */
        if (atomic_load(&h->sleepers))
            syscall(SYS_futex, &h->arrived, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
        c->seq++;
        return SHM_OK;
    }
    int64_t start = now_ns();
    for (int64_t i = 0;; i++) {
        uint32_t seen = atomic_load(&h->arrived);
        if ((int32_t)(seen - target) >= 0)
            break;
        uint32_t dead = atomic_load(&h->aborted);
        if (dead)
            return (int)dead;
        if ((i & 63) || now_ns() - start < c->spin_ns) {
            relax();
            continue;
        }
        atomic_fetch_add(&h->sleepers, 1);
        seen = atomic_load(&h->arrived);
        if ((int32_t)(seen - target) < 0) {
            struct timespec wait = {0, 20 * 1000 * 1000};
            long r = syscall(SYS_futex, &h->arrived, FUTEX_WAIT, seen, &wait, NULL, 0);
            if (r != 0 && errno == ETIMEDOUT) {
                int dead = dead_peer(c);
                if (dead) {
                    atomic_fetch_sub(&h->sleepers, 1);
                    return dead;
                }
                if (now_ns() - start > c->timeout_ns) {
                    atomic_fetch_sub(&h->sleepers, 1);
                    return SHM_TIMEOUT;
                }
            }
        }
        atomic_fetch_sub(&h->sleepers, 1);
    }
    c->seq++;
    return SHM_OK;
}

static float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t f32_to_bf16(float f) {      /* round to nearest even; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

/* Sum `n` elements of every rank's slot of buffer `buf` into `out` (rank order). */
static void sum_slots(const shm_comm *c, int buf, void *out, int64_t n, int is_bf16) {
    if (!is_bf16) {
        float *o = out;
        const float *s0 = (const float *)slot(c, buf, 0);
        for (int64_t i = 0; i < n; i++)
            o[i] = s0[i];
        for (int r = 1; r < c->world; r++) {
            const float *s = (const float *)slot(c, buf, r);
            for (int64_t i = 0; i < n; i++)
                o[i] += s[i];
        }
        return;
    }
    uint16_t *o = out;
    enum { STRIP = 512 };
    float acc[STRIP];
    for (int64_t i0 = 0; i0 < n; i0 += STRIP) {
        int64_t m = n - i0 < STRIP ? n - i0 : STRIP;
        const uint16_t *s0 = (const uint16_t *)slot(c, buf, 0) + i0;
        for (int64_t i = 0; i < m; i++)
            acc[i] = bf16_to_f32(s0[i]);
        for (int r = 1; r < c->world; r++) {
            const uint16_t *s = (const uint16_t *)slot(c, buf, r) + i0;
            for (int64_t i = 0; i < m; i++)
                acc[i] += bf16_to_f32(s[i]);
        }
        for (int64_t i = 0; i < m; i++)
            o[i0 + i] = f32_to_bf16(acc[i]);
    }
}

/* In-place sum of `n` elements (float32, or bfloat16 when `is_bf16`) at `x` over the ranks. */
int continuum_shm_all_reduce(shm_comm *c, void *x, int64_t n, int is_bf16) {
    int64_t size = is_bf16 ? 2 : 4, per = c->slot_bytes / size;
    for (int64_t i = 0; i < n; i += per) {
        int64_t m = n - i < per ? n - i : per;
        char *chunk = (char *)x + i * size;
        int buf = (int)(c->seq & 1);
        memcpy(slot(c, buf, c->rank), chunk, m * size);
        int rc = arrive_and_wait(c);
        if (rc)
            return rc;
        sum_slots(c, buf, chunk, m, is_bf16);
    }
    return SHM_OK;
}

/* `rows` x `row_bytes` at `x` from every rank into `out` (`rows` x world * `row_bytes`):
   rank r's row i at out + i * world * row_bytes + r * row_bytes. */
int continuum_shm_all_gather_rows(shm_comm *c, const void *x, void *out, int64_t rows,
                                  int64_t row_bytes) {
    int64_t per = c->slot_bytes / row_bytes;
    if (per < 1)
        return SHM_ROW_TOO_LONG;
    for (int64_t i = 0; i < rows; i += per) {
        int64_t m = rows - i < per ? rows - i : per;
        int buf = (int)(c->seq & 1);
        memcpy(slot(c, buf, c->rank), (const char *)x + i * row_bytes, m * row_bytes);
        int rc = arrive_and_wait(c);
        if (rc)
            return rc;
        for (int r = 0; r < c->world; r++) {
            const char *s = slot(c, buf, r);
            char *o = (char *)out + (i * c->world + r) * row_bytes;
            for (int64_t j = 0; j < m; j++)
                memcpy(o + j * c->world * row_bytes, s + j * row_bytes, row_bytes);
        }
    }
    return SHM_OK;
}

/* Record this rank's pid (before the group's first collective). */
void continuum_shm_attach(shm_comm *c) {
    header(c)->pids[c->rank] = (int32_t)getpid();
}

int continuum_shm_max_ranks(void) { return SHM_MAX_RANKS; }
int continuum_shm_header_bytes(void) { return SHM_HEADER_BYTES; }
