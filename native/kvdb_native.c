/* kvdb native core: the hot loops that Python and torch do not do well.
 *
 * - crc32c (Castagnoli): SSE4.2 instruction on x86-64 when the CPU has it (three interleaved
 *   streams from 768 bytes up), slicing-by-8 table otherwise. Used by every log record and
 *   index entry; one call checks a whole read slice (kvdb_crc32c_heads_pages).
 * - sha256 prefix chains: key_i = H(key_{i-1} || tokens_i), truncated to 16 bytes,
 *   for a whole prompt in one call (no Python loop per block). SHA-256 comes from OpenSSL's
 *   libcrypto (SHA-NI where the CPU has it).
 * - page gather / scatter: memcpy of whole pages between an arena and a batch buffer.
 * - the group-commit committer: a pthread that fsyncs the log for waiting writers.
 *
 * Every function has a pure-Python twin in kvdb/native.py; tests/test_native.py checks that
 * they agree. The committer's twin is the pure-Python leader/follower group commit of
 * kvdb/wal/writer.py; tests/cold/test_group_commit.py runs both.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#define OPENSSL_API_COMPAT 0x10100000L
#include <openssl/sha.h>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

/* ---------- crc32c ---------- */

static uint32_t crc_table[8][256];
static int crc_ready = 0;

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = crc_table[0][i];
        for (int t = 1; t < 8; t++) {
            c = crc_table[0][c & 0xff] ^ (c >> 8);
            crc_table[t][i] = c;
        }
    }
    crc_ready = 1;
}

static uint32_t crc_sw(uint32_t crc, const uint8_t *p, size_t n) {
    if (!crc_ready) crc_init();
    while (n && ((uintptr_t)p & 7)) { crc = crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8); n--; }
    while (n >= 8) {
        uint64_t w; memcpy(&w, p, 8);
        w ^= crc;
        crc = crc_table[7][w & 0xff] ^ crc_table[6][(w >> 8) & 0xff] ^
              crc_table[5][(w >> 16) & 0xff] ^ crc_table[4][(w >> 24) & 0xff] ^
              crc_table[3][(w >> 32) & 0xff] ^ crc_table[2][(w >> 40) & 0xff] ^
              crc_table[1][(w >> 48) & 0xff] ^ crc_table[0][w >> 56];
        p += 8; n -= 8;
    }
    while (n--) crc = crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2")))
static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c = crc;
    while (n && ((uintptr_t)p & 7)) { c = _mm_crc32_u8((uint32_t)c, *p++); n--; }
    while (n >= 8) { uint64_t w; memcpy(&w, p, 8); c = _mm_crc32_u64(c, w); p += 8; n -= 8; }
    while (n--) c = _mm_crc32_u8((uint32_t)c, *p++);
    return (uint32_t)c;
}
static int have_sse42 = -1;

/* Three streams. One crc32 instruction has a latency of three cycles and a throughput of one a
 * cycle, so a single dependent chain (crc_hw) uses a third of the unit. crc_hw3 cuts a block of
 * 3 x S bytes into thirds, runs three independent chains over them in one loop, the second and
 * third from a zero register, then joins them: for the raw register (no inversions), the CRC
 * of A || B from r is shift_|B|(crc(A, r)) ^ crc(B, 0), where shift_L(x) is the register after L
 * zero bytes from x, a linear map of x. shift_S is applied as four 256-entry tables (one per
 * byte of x: the map of that byte alone), built once from the instruction itself. Two block
 * sizes: LONG for pages, SHORT for the rest and for 4 KiB records. */
#include <pthread.h>
#define CRC3_LONG 8192
#define CRC3_SHORT 256
static uint32_t crc3_long[4][256], crc3_short[4][256];
static pthread_once_t crc3_once = PTHREAD_ONCE_INIT;

__attribute__((target("sse4.2")))
static uint32_t crc_zeros(uint32_t x, size_t n) {  /* n a multiple of 8 */
    uint64_t c = x;
    for (size_t i = 0; i < n; i += 8) c = _mm_crc32_u64(c, 0);
    return (uint32_t)c;
}

static void crc3_init(void) {
    for (int k = 0; k < 4; k++)
        for (uint32_t v = 0; v < 256; v++) {
            crc3_long[k][v] = crc_zeros(v << (8 * k), CRC3_LONG);
            crc3_short[k][v] = crc_zeros(v << (8 * k), CRC3_SHORT);
        }
}

static inline uint32_t crc3_shift(uint32_t t[4][256], uint32_t x) {
    return t[0][x & 0xff] ^ t[1][(x >> 8) & 0xff] ^ t[2][(x >> 16) & 0xff] ^ t[3][x >> 24];
}

__attribute__((target("sse4.2")))
static uint32_t crc_hw3(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c = crc;
    while (n && ((uintptr_t)p & 7)) { c = _mm_crc32_u8((uint32_t)c, *p++); n--; }
    for (int pass = 0; pass < 2; pass++) {
        size_t s = pass == 0 ? CRC3_LONG : CRC3_SHORT;
        uint32_t (*t)[256] = pass == 0 ? crc3_long : crc3_short;
        while (n >= 3 * s) {
            uint64_t c1 = 0, c2 = 0;
            const uint8_t *q = p + s, *r = p + 2 * s;
            for (size_t i = 0; i < s; i += 8) {
                uint64_t a, b, d;
                memcpy(&a, p + i, 8); memcpy(&b, q + i, 8); memcpy(&d, r + i, 8);
                c = _mm_crc32_u64(c, a); c1 = _mm_crc32_u64(c1, b); c2 = _mm_crc32_u64(c2, d);
            }
            c = crc3_shift(t, (uint32_t)c) ^ (uint32_t)c1;
            c = crc3_shift(t, (uint32_t)c) ^ (uint32_t)c2;
            p += 3 * s; n -= 3 * s;
        }
    }
    return crc_hw((uint32_t)c, p, n);
}
#endif

/* below this many bytes one chain is as fast as three (the joins cost more than they save) */
#define CRC3_MIN (3 * CRC3_SHORT)

uint32_t kvdb_crc32c(uint32_t crc, const uint8_t *p, size_t n) {
    crc = ~crc;
#if defined(__x86_64__)
    if (have_sse42 < 0) have_sse42 = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    if (have_sse42) {
        if (n < CRC3_MIN) return ~crc_hw(crc, p, n);
        pthread_once(&crc3_once, crc3_init);
        return ~crc_hw3(crc, p, n);
    }
#endif
    return ~crc_sw(crc, p, n);
}

/* For i < n: the CRC-32C of heads[i][start .. width), then of page frames[i] of `pages` (pages of
 * page_bytes, back to back): a record's checksummed bytes when its head and its page were read
 * into different buffers (kvdb/cold/read.py check_fields). One call a slice, the GIL
 * released around it; the caller has checked every frame against the buffer. */
void kvdb_crc32c_heads_pages(const uint8_t *heads, size_t width, size_t start, const uint8_t *pages,
                             const int64_t *frames, size_t page_bytes, size_t n, uint32_t *out) {
    for (size_t i = 0; i < n; i++) {
        uint32_t c = kvdb_crc32c(0, heads + i * width + start, width - start);
        out[i] = kvdb_crc32c(c, pages + (size_t)frames[i] * page_bytes, page_bytes);
    }
}

/* CRC-32C of rows[i][start .. start + nbytes) for i < n (rows of `width` bytes, back to back),
 * each continuing from seeds[i] (NULL: 0), then over then[i] (then_width bytes a row; NULL:
 * nothing more): a batch of records' checksums in one call, no Python object per row. */
void kvdb_crc32c_rows(const uint8_t *rows, size_t width, size_t start, size_t nbytes,
                      const uint8_t *then, size_t then_width, const uint32_t *seeds, size_t n,
                      uint32_t *out) {
    for (size_t i = 0; i < n; i++) {
        uint32_t c = kvdb_crc32c(seeds ? seeds[i] : 0, rows + i * width + start, nbytes);
        if (then) c = kvdb_crc32c(c, then + i * then_width, then_width);
        out[i] = c;
    }
}

/* ---------- the log's batched append ---------- */

#include <errno.h>
#include <sys/uio.h>
#include <unistd.h>

#define KVDB_ROWS_PER_CALL 512

/* iov[2j] and iov[2j + 1] := the head of record i + j (heads[(i+j)*hb .. +hb)), then its page
 * (pays[r*pb .. +pb), r = rows[i + j], or i + j when rows is NULL), for j < k. */
static void rows_iov(struct iovec *iov, const uint8_t *heads, size_t hb, const uint8_t *pays, size_t pb,
                     const int64_t *rows, size_t i, size_t k) {
    for (size_t j = 0; j < k; j++) {
        size_t r = rows ? (size_t)rows[i + j] : i + j;
        iov[2 * j].iov_base = (void *)(heads + (i + j) * hb);
        iov[2 * j].iov_len = hb;
        iov[2 * j + 1].iov_base = (void *)(pays + r * pb);
        iov[2 * j + 1].iov_len = pb;
    }
}

/* Step the *cnt iovecs at *v past the first `done` bytes (a short transfer resumes there). */
static void iov_advance(struct iovec **v, int *cnt, size_t done) {
    while (*cnt > 0 && done >= (*v)->iov_len) {
        done -= (*v)->iov_len;
        (*v)++;
        (*cnt)--;
    }
    if (*cnt > 0 && done > 0) {
        (*v)->iov_base = (uint8_t *)(*v)->iov_base + done;
        (*v)->iov_len -= done;
    }
}

/* Move n records between fd and memory, record j being the head heads[j*hb .. +hb) then the
 * page pages[r*pb .. +pb) (r = rows[j], or j when rows is NULL): one writev (reading == 0: an
 * append, `offset` unused) or preadv from `offset` (reading == 1, the records back to back
 * there) per KVDB_ROWS_PER_CALL records, two iovecs each (within IOV_MAX), a short transfer
 * resumed where it stopped, EINTR retried. Returns the bytes moved -- a read stops early at end
 * of file, a write that makes no progress is EIO -- or -errno of the failed call (nothing after
 * it is moved). The iovecs are built here: no Python object per record. */
static int64_t rows_transfer(int fd, int reading, int64_t offset, const uint8_t *heads, size_t hb,
                             const uint8_t *pages, size_t pb, const int64_t *rows, size_t n) {
    struct iovec iov[2 * KVDB_ROWS_PER_CALL];
    int64_t done = 0;
    for (size_t i = 0; i < n; i += KVDB_ROWS_PER_CALL) {
        size_t k = n - i < KVDB_ROWS_PER_CALL ? n - i : KVDB_ROWS_PER_CALL;
        rows_iov(iov, heads, hb, pages, pb, rows, i, k);
        struct iovec *v = iov;
        int cnt = (int)(2 * k);
        while (cnt > 0) {
            ssize_t r = reading ? preadv(fd, v, cnt, (off_t)(offset + done)) : writev(fd, v, cnt);
            if (r < 0) {
                if (errno == EINTR) continue;
                return -(int64_t)errno;
            }
            if (r == 0) return reading ? done : -(int64_t)EIO; /* end of file / no progress */
            done += r;
            iov_advance(&v, &cnt, (size_t)r);
        }
    }
    return done;
}

/* Append n records to fd, record i being heads[i*hb .. +hb) then pays[i*pb .. +pb)
 * (rows_transfer). Returns 0, or the errno of the failed call (nothing after it is written).
 * kvdb/fs.py OsFs.writev_rows; its twin is OsFs.writev over kvdb/native.py row_bufs. */
int kvdb_writev_rows(int fd, const uint8_t *heads, size_t hb, const uint8_t *pays, size_t pb, size_t n) {
    int64_t r = rows_transfer(fd, 0, 0, heads, hb, pays, pb, NULL, n);
    return r < 0 ? (int)-r : 0;
}

/* The read's twin of kvdb_writev_rows: n records lying back to back in fd from `offset`, read
 * straight into heads[j*hb .. +hb) and pages[rows[j]*pb .. +pb) (rows_transfer). Returns the
 * bytes read (fewer than n * (hb + pb) at end of file), or -errno of the failed call.
 * kvdb/fs.py OsFs.preadv_rows; its twin is OsFs.preadv over kvdb/native.py row_bufs. */
int64_t kvdb_preadv_rows(int fd, int64_t offset, uint8_t *heads, size_t hb, uint8_t *pages, size_t pb,
                         const int64_t *rows, size_t n) {
    return rows_transfer(fd, 1, offset, heads, hb, pages, pb, rows, n);
}

/* ---------- prefix hash chains ---------- */

/* keys_out: n_blocks * 16 bytes. seed: 16 bytes (the namespace digest, or the previous key).
 * tokens: n_blocks * block_tokens uint32 values, little-endian on the wire (x86/arm hosts are
 * little-endian; the build refuses big-endian). */
void kvdb_sha256_chain(const uint8_t *seed, const uint32_t *tokens, size_t n_blocks,
                       size_t block_tokens, uint8_t *keys_out) {
    uint8_t digest[32];
    const uint8_t *prev = seed;
    size_t tok_bytes = block_tokens * 4;
    for (size_t i = 0; i < n_blocks; i++) {
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, prev, 16);
        SHA256_Update(&ctx, (const uint8_t *)(tokens + i * block_tokens), tok_bytes);
        SHA256_Final(digest, &ctx);
        memcpy(keys_out + i * 16, digest, 16);
        prev = keys_out + i * 16;
    }
}

/* ---------- page gather / scatter ---------- */

/* dst[dst_frames[i]] = src[src_frames[i]] for whole pages; a frame index of -1 means "the
 * i-th page of a dense batch" (dense side). */
void kvdb_copy_pages(uint8_t *dst, const int64_t *dst_frames, const uint8_t *src,
                     const int64_t *src_frames, size_t page_bytes, size_t n) {
    for (size_t i = 0; i < n; i++) {
        size_t d = dst_frames ? (size_t)dst_frames[i] : i;
        size_t s = src_frames ? (size_t)src_frames[i] : i;
        memcpy(dst + d * page_bytes, src + s * page_bytes, page_bytes);
    }
}

/* ---------- group commit: the committer ----------
 *
 * A few pthreads per log ("workers") fsync the active segment for every writer waiting on a
 * ``group`` commit and wake exactly the writers each fsync covered: no Python runs between the
 * end of one fsync and the start of the next, and a waiter blocks in kvdb_committer_wait with
 * the GIL released (cffi releases it around every call). Writers append their records themselves
 * (kvdb/wal/writer.py, under its lock, in lsn order) and then wait for their lsn; a wait is
 * what tells the committer that every record up to that lsn is in the file.
 *
 * Batches: a worker takes every waiter not yet covered and fsyncs once for all of them. After
 * a batch of k waiters, with m more arrived meanwhile, the next one starts once k + m waiters
 * are there (the writers just woken are on their way back) or gather_ns after the fsync ended
 * (or after the first arrival, if later), whichever comes first; a lone writer is never held
 * (k = 1 starts at once). kvdb/wal/writer.py passes gather_ns = 0: the cold store gathers its
 * group puts in its own queue and only the queue's leader waits here.
 *
 * With num_workers > 1 a batch may also start while another fsync is in flight. ext4 (jbd2)
 * runs one journal commit at a time, but concurrent fsyncs of a file share the next one: 4 KiB
 * append + fdatasync on the development VM ran 1.5-2.8k/s from one thread, 5.5-9.4k/s in total
 * from four. kvdb/wal/writer.py still uses one worker: with eight writers a second fsync in
 * flight splits them into two cohorts of four, each waiting a full commit (docs/durability.md).
 *
 * Invariants (kvdb/wal/writer.py cites them):
 *   K1 durable only grows, and every lsn <= durable was in the file before an fsync of its
 *      segment returned 0 (here, or the writer's own fsync that it published).
 *   K2 after a failed fsync the committer is failed for good: every wait returns -errno, and
 *      nothing becomes durable any more, not even by an fsync that returns 0 later (after an
 *      error the kernel may have dropped the dirty pages). Each worker fsyncs through its own
 *      open file (not a dup): the kernel reports a writeback error once per open file, so a
 *      shared one could hand the error to one worker and a clean 0 to another.
 *   K3 workers open the active segment by path themselves and reopen it when the writer moves
 *      to a new segment (kvdb_committer_set_path); the writer fsyncs and publishes the old
 *      segment before it moves, so a worker never needs an old segment again. (An idle worker
 *      keeps its file of the old segment open until its next fsync: a segment deleted
 *      meanwhile frees its disk space only then.)
 *   K4 stop drains: records of every waiter that arrived before it are fsynced before the
 *      workers exit; a wait after that returns KVDB_COMMIT_CLOSED unless already durable.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define KVDB_COMMIT_CLOSED (-1000000)
#define KVDB_COMMIT_MAX_WORKERS 8

typedef struct commit_waiter {  /* one blocked kvdb_committer_wait, on its caller's stack */
    int64_t lsn;
    pthread_cond_t cv;
    int woken;                    /* set (and the waiter unlinked) by whoever wakes it */
    struct commit_waiter *next;
} commit_waiter;

typedef struct kvdb_committer {
    pthread_mutex_t mu;       /* guards every field below */
    pthread_cond_t work;      /* idle workers sleep here */
    commit_waiter *head;      /* blocked waiters, in arrival order */
    pthread_t threads[KVDB_COMMIT_MAX_WORKERS];
    int num_workers;
    int running;              /* workers not yet exited */
    char *path;               /* the active segment (K3) */
    uint64_t generation;      /* bumped by each kvdb_committer_set_path */
    int stop;                 /* stop asked */
    int stopped;              /* every worker has drained and exited (K4) */
    int joined;
    int error;                /* errno of the first failed fsync, 0 while healthy (K2) */
    int debug_fail_errno;     /* tests: the next fsync fails with this errno */
    int debug_hold;           /* tests: workers start no fsync while set (stop overrides it) */
    int sleeping;             /* workers asleep without a deadline (nothing to do, or held) */
    uint64_t naps;            /* times a worker went to sleep so (tests observe it) */
    int64_t durable;          /* highest durable lsn */
    int64_t wanted;           /* highest lsn a waiter asked for (all <= it are in the file) */
    int64_t started;          /* highest lsn an fsync in flight or done covers */
    int64_t arrived;          /* waiters beyond ``started`` */
    int64_t expect;           /* waiters the last batch held */
    int64_t first_arrival_ns; /* CLOCK_MONOTONIC time of the first of ``arrived`` */
    int64_t gather_ns;        /* longest wait for ``expect`` arrivals */
    uint64_t fsyncs;          /* fsyncs that succeeded */
} kvdb_committer;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Wake the waiters that lsn <= durable covers (every waiter after a failure or stop), each on
 * its own condition variable: a waiter that the fsync did not cover sleeps on. Caller holds mu.
 * Tried and rejected: waking one covered waiter at a time, each passing the wake-up on when it
 * comes back to wait (so that only one competes for the GIL): 9k against 20k group puts/s. */
static void wake_waiters(kvdb_committer *c) {
    int all = c->error || c->stopped;
    commit_waiter **pp = &c->head;
    while (*pp) {
        commit_waiter *w = *pp;
        if (all || w->lsn <= c->durable) {
            *pp = w->next;
            w->woken = 1;
            pthread_cond_signal(&w->cv);
        } else {
            pp = &w->next;
        }
    }
}

static void timed_wait(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t left_ns) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t t = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec + left_ns;
    ts.tv_sec = t / 1000000000;
    ts.tv_nsec = t % 1000000000;
    pthread_cond_timedwait(cv, mu, &ts);
}

static void *committer_main(void *arg) {
    kvdb_committer *c = (kvdb_committer *)arg;
    int fd = -1;           /* this worker's own open file of the segment (K3) */
    uint64_t fd_gen = 0;   /* the generation fd belongs to */
    pthread_mutex_lock(&c->mu);
    for (;;) {
        if (c->error || c->wanted <= c->started || (c->debug_hold && !c->stop)) {
            if (c->stop) break;
            c->sleeping++;
            c->naps++;
            pthread_cond_wait(&c->work, &c->mu);
            c->sleeping--;
            continue;
        }
        /* gather: enough waiters, or the deadline, or stop */
        int64_t left = c->first_arrival_ns + c->gather_ns - now_ns();
        if (!c->stop && c->arrived < c->expect && left > 0) {
            timed_wait(&c->work, &c->mu, left);
            continue;
        }
        int64_t target = c->wanted;
        int64_t batch = c->arrived;
        c->arrived = 0;
        c->started = target;
        int err = c->debug_fail_errno;
        c->debug_fail_errno = 0;
        char *path = NULL;
        if (fd_gen != c->generation) {
            path = strdup(c->path);
            fd_gen = c->generation;
            if (!path) err = ENOMEM;
        }
        pthread_mutex_unlock(&c->mu);
        if (path) {
            if (fd >= 0) close(fd);
            fd = open(path, O_WRONLY | O_CLOEXEC);
            if (fd < 0 && !err) err = errno ? errno : EIO;
            free(path);
        }
        if (!err && fdatasync(fd) != 0) err = errno ? errno : EIO;
        pthread_mutex_lock(&c->mu);
        if (err) {
            if (!c->error) c->error = err;
        } else if (!c->error) {  /* K2: nothing becomes durable after a failure */
            c->fsyncs++;
            if (target > c->durable) c->durable = target;
            /* the writers just woken plus those that arrived meanwhile make the next batch,
             * and its gathering starts now: a batch split by one slow writer merges again */
            c->expect = batch + c->arrived > 0 ? batch + c->arrived : 1;
            if (c->arrived) c->first_arrival_ns = now_ns();
        }
        wake_waiters(c);
    }
    if (--c->running == 0) {
        c->stopped = 1;
        wake_waiters(c);
    }
    pthread_cond_broadcast(&c->work);  /* the other workers see stop too */
    pthread_mutex_unlock(&c->mu);
    if (fd >= 0) close(fd);
    return NULL;
}

static void committer_destroy(kvdb_committer *c) {
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->work);
    free(c->path);
    free(c);
}

/* Start a committer with num_workers (1..8) fsync threads for the segment at path, durable up
 * to durable_lsn. NULL on failure (errno set). */
kvdb_committer *kvdb_committer_open(const char *path, int64_t durable_lsn, int64_t gather_ns, int num_workers) {
    if (num_workers < 1 || num_workers > KVDB_COMMIT_MAX_WORKERS) {
        errno = EINVAL;
        return NULL;
    }
    kvdb_committer *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->path = strdup(path);
    if (!c->path) {
        free(c);
        errno = ENOMEM;
        return NULL;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->work, &ca);
    pthread_condattr_destroy(&ca);
    c->durable = c->wanted = c->started = durable_lsn;
    c->expect = 1;
    c->gather_ns = gather_ns;
    c->generation = 1;
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < num_workers; i++) {
        int rc = pthread_create(&c->threads[i], NULL, committer_main, c);
        if (rc != 0) {
            c->stop = 1;  /* the ones started exit at once: nothing is wanted yet */
            pthread_cond_broadcast(&c->work);
            pthread_mutex_unlock(&c->mu);
            for (int k = 0; k < i; k++) pthread_join(c->threads[k], NULL);
            committer_destroy(c);
            errno = rc;
            return NULL;
        }
        c->num_workers++;
        c->running++;
    }
    pthread_mutex_unlock(&c->mu);
    return c;
}

/* The writer moved to a new segment (K3); records of the old one are durable already (the
 * writer fsynced it and published). Returns 0, or -ENOMEM. */
int kvdb_committer_set_path(kvdb_committer *c, const char *path) {
    char *p = strdup(path);
    if (!p) return -ENOMEM;
    pthread_mutex_lock(&c->mu);
    free(c->path);
    c->path = p;
    c->generation++;
    pthread_mutex_unlock(&c->mu);
    return 0;
}

/* Block until lsn is durable. Returns the durable lsn (>= lsn), -errno after a failed fsync,
 * or KVDB_COMMIT_CLOSED when the committer stopped first. Every record up to lsn must be in
 * the file already. */
int64_t kvdb_committer_wait(kvdb_committer *c, int64_t lsn) {
    pthread_mutex_lock(&c->mu);
    if (lsn > c->durable && !c->error && !c->stopped) {
        if (lsn > c->wanted) c->wanted = lsn;
        if (lsn > c->started) {  /* not covered by an fsync in flight: one for the next */
            if (c->arrived++ == 0) c->first_arrival_ns = now_ns();
            if (c->arrived == 1 || c->arrived >= c->expect) pthread_cond_signal(&c->work);
        }
        commit_waiter me = {.lsn = lsn, .woken = 0, .next = NULL};
        pthread_cond_init(&me.cv, NULL);
        commit_waiter **pp = &c->head;
        while (*pp) pp = &(*pp)->next;
        *pp = &me;
        while (!me.woken) pthread_cond_wait(&me.cv, &c->mu);
        pthread_cond_destroy(&me.cv);
    }
    int64_t r = lsn <= c->durable ? c->durable : c->error ? -(int64_t)c->error : KVDB_COMMIT_CLOSED;
    pthread_mutex_unlock(&c->mu);
    return r;
}

/* An fsync done by the writer itself (the ``sync`` mode, a segment rotation) covered lsn. */
void kvdb_committer_publish(kvdb_committer *c, int64_t lsn) {
    pthread_mutex_lock(&c->mu);
    if (!c->error && lsn > c->durable) {
        c->durable = lsn;
        if (lsn > c->started) c->started = lsn;
        if (lsn > c->wanted) c->wanted = lsn;
        wake_waiters(c);
        /* ``arrived`` counts waiters beyond ``started``, which just moved: count them again, or
         * a stale count keeps the next arrival from signalling a worker asleep without a
         * deadline (it would wait for a batch that never comes) */
        int64_t beyond = 0;
        for (commit_waiter *w = c->head; w; w = w->next)
            if (w->lsn > c->started) beyond++;
        c->arrived = beyond;
        if (beyond) pthread_cond_signal(&c->work);
    }
    pthread_mutex_unlock(&c->mu);
}

/* The writer failed (a write error, an fsync error of its own): every waiter gets -err. */
void kvdb_committer_fail(kvdb_committer *c, int err) {
    pthread_mutex_lock(&c->mu);
    if (!c->error) c->error = err > 0 ? err : EIO;
    wake_waiters(c);
    pthread_cond_broadcast(&c->work);
    pthread_mutex_unlock(&c->mu);
}

int64_t kvdb_committer_durable(kvdb_committer *c) {
    pthread_mutex_lock(&c->mu);
    int64_t d = c->durable;
    pthread_mutex_unlock(&c->mu);
    return d;
}

uint64_t kvdb_committer_fsyncs(kvdb_committer *c) {
    pthread_mutex_lock(&c->mu);
    uint64_t n = c->fsyncs;
    pthread_mutex_unlock(&c->mu);
    return n;
}

int kvdb_committer_error(kvdb_committer *c) {
    pthread_mutex_lock(&c->mu);
    int e = c->error;
    pthread_mutex_unlock(&c->mu);
    return e;
}

/* Tests: the next fsync fails with err, as EIO or ENOSPC from the device would (K2). */
void kvdb_committer_debug_fail_next(kvdb_committer *c, int err) {
    pthread_mutex_lock(&c->mu);
    c->debug_fail_errno = err;
    pthread_mutex_unlock(&c->mu);
}

/* Tests: while held, the workers start no fsync, as if the one before were still running:
 * waiters queue up and count as arrived, so a test can build a batch of known size. Releasing
 * wakes the workers. A stop overrides a hold (K4). */
void kvdb_committer_debug_hold(kvdb_committer *c, int hold) {
    pthread_mutex_lock(&c->mu);
    c->debug_hold = hold;
    if (!hold) pthread_cond_broadcast(&c->work);
    pthread_mutex_unlock(&c->mu);
}

/* Tests: what the committer has seen, so that a test orders its threads by the committer's
 * state rather than by sleeps: out[0] waiters blocked in kvdb_committer_wait, out[1] arrived,
 * out[2] expect, out[3] workers asleep without a deadline (nothing to do, or held), out[4] times
 * a worker went to sleep so. */
void kvdb_committer_debug_state(kvdb_committer *c, int64_t *out) {
    pthread_mutex_lock(&c->mu);
    int64_t waiters = 0;
    for (commit_waiter *w = c->head; w; w = w->next) waiters++;
    out[0] = waiters;
    out[1] = c->arrived;
    out[2] = c->expect;
    out[3] = c->sleeping;
    out[4] = (int64_t)c->naps;
    pthread_mutex_unlock(&c->mu);
}

/* Drain (K4), stop and join the thread, wake every waiter. Idempotent. Waits that come later
 * return at once; the struct lives until kvdb_committer_free (kvdb/native.py frees it when
 * no Python reference, hence no call, is left). */
void kvdb_committer_stop(kvdb_committer *c) {
    pthread_mutex_lock(&c->mu);
    if (c->joined) {
        pthread_mutex_unlock(&c->mu);
        return;
    }
    c->joined = 1;
    c->stop = 1;
    pthread_cond_broadcast(&c->work);
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < c->num_workers; i++) pthread_join(c->threads[i], NULL);
    pthread_mutex_lock(&c->mu);
    c->stopped = 1;
    wake_waiters(c);
    pthread_mutex_unlock(&c->mu);
}

void kvdb_committer_free(kvdb_committer *c) {
    kvdb_committer_stop(c);
    committer_destroy(c);
}

/* ---------- the commit ceiling (kvdb bench cold) ----------
 *
 * The best a group commit can do on this filesystem, with no Python in the way: ``threads``
 * pthreads each append ``n_per_thread`` records of ``record_bytes`` to one file (O_APPEND, one
 * write each, under a mutex) and return only once an fdatasync covers their record. A writer
 * that finds no fsync running leads: it gathers (waits until every writer still running has
 * appended, at most 1 ms) and fsyncs once for all of them; the others sleep until covered.
 * threads = 1 is the ``sync`` baseline: write + fdatasync per record. The bench prints both
 * next to the store's own figures, so "group >= 5 x sync" can be read against what the disk and
 * the scheduler allow. Returns 0, or -errno; a file it created is removed, an existing one is
 * never touched (O_EXCL). */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t covered;   /* writers waiting for an fsync */
    pthread_cond_t arrived;   /* the gathering leader */
    int fd, n_per_thread, active, syncing, error;
    size_t record_bytes;
    const uint8_t *record;
    int64_t next, durable, fsyncs;
} ceiling_state;

static void *ceiling_writer(void *arg) {
    ceiling_state *s = arg;
    for (int i = 0; i < s->n_per_thread; i++) {
        pthread_mutex_lock(&s->mu);
        if (s->error) { s->active--; pthread_cond_signal(&s->arrived); pthread_mutex_unlock(&s->mu); return NULL; }
        int64_t lsn = s->next++;
        if (write(s->fd, s->record, s->record_bytes) != (ssize_t)s->record_bytes) s->error = errno ? errno : EIO;
        pthread_cond_signal(&s->arrived);
        while (s->durable < lsn && !s->error) {
            if (s->syncing) { pthread_cond_wait(&s->covered, &s->mu); continue; }
            s->syncing = 1;
            struct timespec dl;
            clock_gettime(CLOCK_REALTIME, &dl);
            dl.tv_nsec += 1000000;
            if (dl.tv_nsec >= 1000000000) { dl.tv_sec++; dl.tv_nsec -= 1000000000; }
            while (s->next - 1 - s->durable < s->active && !s->error)
                if (pthread_cond_timedwait(&s->arrived, &s->mu, &dl)) break;
            int64_t target = s->next - 1;
            pthread_mutex_unlock(&s->mu);
            int r = fdatasync(s->fd);
            int e = r ? errno : 0;
            pthread_mutex_lock(&s->mu);
            if (e) s->error = e; else { s->durable = target; s->fsyncs++; }
            s->syncing = 0;
            pthread_cond_broadcast(&s->covered);
        }
        if (i == s->n_per_thread - 1 || s->error) s->active--;
        int stop = s->error != 0;
        pthread_cond_signal(&s->arrived);
        pthread_mutex_unlock(&s->mu);
        if (stop) return NULL;
    }
    return NULL;
}

int kvdb_commit_ceiling(const char *path, int threads, int n_per_thread, size_t record_bytes,
                        double *seconds, int64_t *fsyncs) {
    if (threads < 1 || threads > 256 || n_per_thread < 1 || record_bytes < 1) return -EINVAL;
    uint8_t *record = malloc(record_bytes);
    pthread_t *tids = calloc((size_t)threads, sizeof(pthread_t));
    if (!record || !tids) { free(record); free(tids); return -ENOMEM; }
    for (size_t i = 0; i < record_bytes; i++) record[i] = (uint8_t)(i * 131 + 7);
    ceiling_state s;
    memset(&s, 0, sizeof s);
    pthread_mutex_init(&s.mu, NULL);
    pthread_cond_init(&s.covered, NULL);
    pthread_cond_init(&s.arrived, NULL);
    s.n_per_thread = n_per_thread;
    s.record_bytes = record_bytes;
    s.record = record;
    s.durable = -1;
    s.fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
    int rc = 0;
    if (s.fd < 0) rc = -errno;
    int started = 0;
    int64_t t0 = now_ns();
    if (!rc) {
        pthread_mutex_lock(&s.mu);
        s.active = threads;
        pthread_mutex_unlock(&s.mu);
        for (; started < threads; started++)
            if (pthread_create(&tids[started], NULL, ceiling_writer, &s)) break;
        if (started < threads) {
            pthread_mutex_lock(&s.mu);
            s.error = EAGAIN;
            s.active -= threads - started;
            pthread_cond_broadcast(&s.covered);
            pthread_mutex_unlock(&s.mu);
        }
        for (int i = 0; i < started; i++) pthread_join(tids[i], NULL);
        *seconds = (double)(now_ns() - t0) * 1e-9;
        *fsyncs = s.fsyncs;
        if (s.error) rc = -s.error;
        close(s.fd);
        unlink(path);
    }
    pthread_cond_destroy(&s.arrived);
    pthread_cond_destroy(&s.covered);
    pthread_mutex_destroy(&s.mu);
    free(record);
    free(tids);
    return rc;
}
