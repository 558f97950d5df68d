/* kvdb native core: the hot loops that Python and torch do not do well.
 *
 * - crc32c (Castagnoli): SSE4.2 instruction on x86-64 when the CPU has it, slicing-by-8
 *   table otherwise. Used by every log record and index entry.
 * - sha256 prefix chains: key_i = H(key_{i-1} || tokens_i), truncated to 16 bytes,
 *   for a whole prompt in one call (no Python loop per block). SHA-256 comes from OpenSSL's
 *   libcrypto (SHA-NI where the CPU has it).
 * - page gather / scatter: memcpy of whole pages between an arena and a batch buffer.
 *
 * Every function has a pure-Python twin in kvdb/native.py; tests/test_native.py checks that
 * they agree.
 */
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
#endif

uint32_t kvdb_crc32c(uint32_t crc, const uint8_t *p, size_t n) {
    crc = ~crc;
#if defined(__x86_64__)
    if (have_sse42 < 0) have_sse42 = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    if (have_sse42) return ~crc_hw(crc, p, n);
#endif
    return ~crc_sw(crc, p, n);
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
