"""cffi build script for kvdb's native core (run by setup.py's ``cffi_modules``)."""

from pathlib import Path

from cffi import FFI

CDEF = """
uint32_t kvdb_crc32c(uint32_t crc, const uint8_t *p, size_t n);
void kvdb_crc32c_rows(const uint8_t *rows, size_t width, size_t start, size_t nbytes,
                      const uint8_t *then, size_t then_width, const uint32_t *seeds, size_t n,
                      uint32_t *out);
void kvdb_crc32c_heads_pages(const uint8_t *heads, size_t width, size_t start, const uint8_t *pages,
                             const int64_t *frames, size_t page_bytes, size_t n, uint32_t *out);
void kvdb_sha256_chain(const uint8_t *seed, const uint32_t *tokens, size_t n_blocks,
                       size_t block_tokens, uint8_t *keys_out);
void kvdb_copy_pages(uint8_t *dst, const int64_t *dst_frames, const uint8_t *src,
                     const int64_t *src_frames, size_t page_bytes, size_t n);
int kvdb_writev_rows(int fd, const uint8_t *heads, size_t hb, const uint8_t *pays, size_t pb, size_t n);
int64_t kvdb_preadv_rows(int fd, int64_t offset, uint8_t *heads, size_t hb, uint8_t *pages, size_t pb,
                         const int64_t *rows, size_t n);

typedef struct kvdb_committer kvdb_committer;
#define KVDB_COMMIT_CLOSED ...
kvdb_committer *kvdb_committer_open(const char *path, int64_t durable_lsn, int64_t gather_ns, int num_workers);
int kvdb_committer_set_path(kvdb_committer *c, const char *path);
int64_t kvdb_committer_wait(kvdb_committer *c, int64_t lsn);
void kvdb_committer_publish(kvdb_committer *c, int64_t lsn);
void kvdb_committer_fail(kvdb_committer *c, int err);
int64_t kvdb_committer_durable(kvdb_committer *c);
uint64_t kvdb_committer_fsyncs(kvdb_committer *c);
int kvdb_committer_error(kvdb_committer *c);
void kvdb_committer_debug_fail_next(kvdb_committer *c, int err);
void kvdb_committer_debug_hold(kvdb_committer *c, int hold);
void kvdb_committer_debug_state(kvdb_committer *c, int64_t *out);
void kvdb_committer_stop(kvdb_committer *c);
void kvdb_committer_free(kvdb_committer *c);
int kvdb_commit_ceiling(const char *path, int threads, int n_per_thread, size_t record_bytes,
                        double *seconds, int64_t *fsyncs);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
_here = Path(__file__).resolve().parent
ffibuilder.set_source(
    "kvdb._native",
    (_here / "kvdb_native.c").read_text(),
    libraries=["crypto", "pthread"],
    extra_compile_args=["-O3", "-std=c11", "-Wall"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
