/* msgpack's int and array formats (big-endian), as vLLM's encoder writes token ids: the reads
 * core/_blockkeys.c and core/_kv_decode.c share. */
#ifndef URC_MSGPACK_H
#define URC_MSGPACK_H
#include <stdint.h>
#include <string.h>

static inline uint64_t be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = v << 8 | p[i];
    return v;
}

/* The element count of the array at *p, moving *p past its header; -1: not an array. */
static inline Py_ssize_t array_header(const unsigned char **p, const unsigned char *end) {
    if (*p >= end) return -1;
    unsigned char c = *(*p)++;
    if (c >= 0x90 && c <= 0x9f) return c & 0x0f;
    int n = c == 0xdc ? 2 : c == 0xdd ? 4 : 0;
    if (n == 0 || end - *p < n) return -1;
    Py_ssize_t count = (Py_ssize_t)be(*p, n);
    *p += n;
    return count;
}

/* One int at *p as an int32 token id, moving *p past it; -1: not an int, or out of range.
 * The caller has checked that 9 bytes (the longest int) are left, or uses read_token. */
static inline int read_token_fast(const unsigned char **p, int32_t *out) {
    const unsigned char *q = *p;
    unsigned char c = q[0];
    int64_t v;
    if (c <= 0x7f) {  /* positive fixint */
        *out = c;
        *p = q + 1;
        return 0;
    }
    switch (c) {
    case 0xcd: v = (int64_t)q[1] << 8 | q[2]; *p = q + 3; break;
    case 0xce: v = (int64_t)be(q + 1, 4); *p = q + 5; break;
    case 0xcc: v = q[1]; *p = q + 2; break;
    case 0xcf: {
        uint64_t u = be(q + 1, 8);
        if (u > INT32_MAX) return -1;
        v = (int64_t)u;
        *p = q + 9;
        break;
    }
    case 0xd0: v = (int8_t)q[1]; *p = q + 2; break;
    case 0xd1: v = (int16_t)(uint16_t)be(q + 1, 2); *p = q + 3; break;
    case 0xd2: v = (int32_t)(uint32_t)be(q + 1, 4); *p = q + 5; break;
    case 0xd3: v = (int64_t)be(q + 1, 8); *p = q + 9; break;
    default:
        if (c < 0xe0) return -1;
        v = (int8_t)c;  /* negative fixint */
        *p = q + 1;
    }
    if (v < INT32_MIN || v > INT32_MAX) return -1;
    *out = (int32_t)v;
    return 0;
}

static inline int read_token(const unsigned char **p, const unsigned char *end, int32_t *out) {
    unsigned char tmp[9] = {0};
    const unsigned char *q = *p;
    if (end - q >= 9) return read_token_fast(p, out);
    if (q >= end) return -1;
    memcpy(tmp, q, (size_t)(end - q));  /* near the end: a zero-padded copy, then a length check */
    const unsigned char *t = tmp;
    if (read_token_fast(&t, out) < 0 || t - tmp > end - q) return -1;
    *p = q + (t - tmp);
    return 0;
}

#endif
