"""cffi build script for kvdb's native core (run by setup.py's ``cffi_modules``)."""

from pathlib import Path

from cffi import FFI

CDEF = """
uint32_t kvdb_crc32c(uint32_t crc, const uint8_t *p, size_t n);
void kvdb_sha256_chain(const uint8_t *seed, const uint32_t *tokens, size_t n_blocks,
                       size_t block_tokens, uint8_t *keys_out);
void kvdb_copy_pages(uint8_t *dst, const int64_t *dst_frames, const uint8_t *src,
                     const int64_t *src_frames, size_t page_bytes, size_t n);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
_here = Path(__file__).resolve().parent
ffibuilder.set_source(
    "kvdb._native",
    (_here / "kvdb_native.c").read_text(),
    libraries=["crypto"],
    extra_compile_args=["-O3", "-std=c11", "-Wall"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
