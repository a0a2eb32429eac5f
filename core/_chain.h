/* Chained block keys (docs/block-keys.md), the one hashing loop of core/_blockkeys.c's calls and
 * core/_kv_ingest.c:
 *
 *   key_0 = xxh3_64(first ‖ tokens_0), key_i = xxh3_64(le64(key_{i-1}) ‖ tokens_i)
 *
 * tokens as little-endian int32s; `first` is the length-prefixed namespace, or the 8-byte key
 * of the parent block when a chain continues an existing one. A caller writes block b's tokens
 * where chain_tokens(c, b) says, then chain_next(c, b) gives its key.
 */
#ifndef URC_CHAIN_H
#define URC_CHAIN_H
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

static inline void put_le32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

static inline void put_le64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

#define CHAIN_LOCAL 256 /* bytes hashed per block that need no allocation (16-token blocks: 72) */

typedef struct {
    unsigned char *buf; /* what a block's key hashes: its head (first, or le64(prev)), tokens */
    const unsigned char *first;
    Py_ssize_t first_len, block_bytes;
    uint64_t prev; /* the key chain_next() made last */
    unsigned char local[CHAIN_LOCAL];
} Chain;

/* 0, or -1 with MemoryError set. `first` must outlive the chain. */
static inline int chain_open(Chain *c, const void *first, Py_ssize_t first_len,
                             Py_ssize_t block_size) {
    Py_ssize_t size = (first_len > 8 ? first_len : 8) + 4 * block_size;
    c->first = first;
    c->first_len = first_len;
    c->block_bytes = 4 * block_size;
    c->prev = 0;
    c->buf = size <= CHAIN_LOCAL ? c->local : PyMem_Malloc((size_t)size);
    if (c->buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static inline void chain_close(Chain *c) {
    if (c->buf != c->local) PyMem_Free(c->buf);
    c->buf = NULL;
}

/* Where block b's tokens go (block_bytes of them), its head written before them. */
static inline unsigned char *chain_tokens(Chain *c, Py_ssize_t b) {
    if (b == 0) {
        memcpy(c->buf, c->first, (size_t)c->first_len);
        return c->buf + c->first_len;
    }
    put_le64(c->buf, c->prev);
    return c->buf + 8;
}

/* The key of block b, its tokens written. */
static inline uint64_t chain_next(Chain *c, Py_ssize_t b) {
    Py_ssize_t head = b == 0 ? c->first_len : 8;
    c->prev = XXH3_64bits(c->buf, (size_t)(head + c->block_bytes));
    return c->prev;
}

#endif
