/* Chained block keys (docs/block-keys.md) in one pass: the C twin of core/blocks.py.
 *
 * key_0 = xxh3_64(first ‖ tokens_0), key_i = xxh3_64(le64(key_{i-1}) ‖ tokens_i),
 * tokens as little-endian int32. `first` is the length-prefixed namespace, or the
 * 8-byte key of the parent block when a chain continues an existing one.
 *
 * `tokens` is a sequence of ints, or `bytes` whose every byte is a token id (the byte
 * tokenizer's ids of text without special tokens): the same keys, no int objects read.
 * `chain_keys_msgpack` reads the tokens from a msgpack array of ints as it came on the wire
 * (a KV event's token_ids, docs/kv-events.md): no int objects made at all.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

static void put_le32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

static void put_le64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* A token id from an int object: compact ints (|v| < 2**30, every vocabulary) read in
 * place on CPython 3.11 (PyLong_AsLong is a call with checks per token); the rest by the API. */
static int token_of(PyObject *item, int32_t *out) {
#if PY_VERSION_HEX < 0x030C0000
    if (PyLong_CheckExact(item)) {
        Py_ssize_t size = Py_SIZE(item);
        if (size == 0 || size == 1 || size == -1) {
            *out = (int32_t)(size * (long)((PyLongObject *)item)->ob_digit[0]);
            return 0;
        }
    }
#endif
    long v = PyLong_AsLong(item);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < INT32_MIN || v > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "token id does not fit in int32");
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

static PyObject *chain_keys(PyObject *self, PyObject *args) {
    PyObject *tokens;
    Py_ssize_t block_size;
    Py_buffer first;
    if (!PyArg_ParseTuple(args, "Ony*", &tokens, &block_size, &first)) return NULL;
    if (block_size <= 0) {
        PyBuffer_Release(&first);
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    const unsigned char *octets = NULL;  /* bytes: one token id per byte */
    PyObject *seq;
    Py_ssize_t n_tokens;
    if (PyBytes_CheckExact(tokens)) {
        seq = Py_NewRef(tokens);
        octets = (const unsigned char *)PyBytes_AS_STRING(tokens);
        n_tokens = PyBytes_GET_SIZE(tokens);
    } else {
        seq = PySequence_Fast(tokens, "tokens must be a sequence of ints");
        if (seq == NULL) {
            PyBuffer_Release(&first);
            return NULL;
        }
        n_tokens = PySequence_Fast_GET_SIZE(seq);
    }
    Py_ssize_t n_blocks = n_tokens / block_size;
    PyObject **items = octets == NULL ? PySequence_Fast_ITEMS(seq) : NULL;
    Py_ssize_t head = first.len > 8 ? first.len : 8;
    unsigned char *buf = PyMem_Malloc((size_t)(head + 4 * block_size));
    PyObject *out = PyList_New(n_blocks);
    if (buf == NULL || out == NULL) goto fail;

    uint64_t prev = 0;
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        Py_ssize_t off;
        if (b == 0) {
            memcpy(buf, first.buf, (size_t)first.len);
            off = first.len;
        } else {
            put_le64(buf, prev);
            off = 8;
        }
        if (octets != NULL) {
            const unsigned char *src = octets + b * block_size;
            for (Py_ssize_t t = 0; t < block_size; t++) put_le32(buf + off + 4 * t, src[t]);
        } else {
            PyObject **src = items + b * block_size;
            for (Py_ssize_t t = 0; t < block_size; t++) {
                int32_t v = 0;
                if (token_of(src[t], &v) < 0) goto fail;
                put_le32(buf + off + 4 * t, (uint32_t)v);
            }
        }
        prev = XXH3_64bits(buf, (size_t)(off + 4 * block_size));
        PyObject *key = PyLong_FromUnsignedLongLong(prev);
        if (key == NULL) goto fail;
        PyList_SET_ITEM(out, b, key);
    }
    PyMem_Free(buf);
    Py_DECREF(seq);
    PyBuffer_Release(&first);
    return out;

fail:
    PyMem_Free(buf);
    Py_XDECREF(out);
    Py_DECREF(seq);
    PyBuffer_Release(&first);
    return NULL;
}

/* -- msgpack: its int and array formats (big-endian), as vLLM's encoder writes token ids -- */

static uint64_t be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = v << 8 | p[i];
    return v;
}

/* The element count of the array at *p, moving *p past its header; -1: not an array. */
static Py_ssize_t array_header(const unsigned char **p, const unsigned char *end) {
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

static int read_token(const unsigned char **p, const unsigned char *end, int32_t *out) {
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

static PyObject *msgpack_len(PyObject *self, PyObject *arg) {
    Py_buffer raw;
    if (PyObject_GetBuffer(arg, &raw, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *p = raw.buf;
    Py_ssize_t count = array_header(&p, p + raw.len);
    PyBuffer_Release(&raw);
    return PyLong_FromSsize_t(count);
}

static PyObject *chain_keys_msgpack(PyObject *self, PyObject *args) {
    Py_buffer raw, first;
    Py_ssize_t block_size, limit;
    if (!PyArg_ParseTuple(args, "y*ny*n", &raw, &block_size, &first, &limit)) return NULL;
    PyObject *out = NULL;
    unsigned char *buf = NULL;
    const unsigned char *p = raw.buf, *end = p + raw.len;
    Py_ssize_t n_tokens = array_header(&p, end);
    if (block_size <= 0 || n_tokens < 0) {
        PyErr_SetString(PyExc_ValueError, "not a msgpack array, or block_size <= 0");
        goto done;
    }
    Py_ssize_t n_blocks = n_tokens / block_size;
    if (limit >= 0 && limit < n_blocks) n_blocks = limit;
    Py_ssize_t head = first.len > 8 ? first.len : 8;
    buf = PyMem_Malloc((size_t)(head + 4 * block_size));
    out = PyList_New(n_blocks);
    if (buf == NULL || out == NULL) goto fail;
    uint64_t prev = 0;
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        Py_ssize_t off = 8;
        if (b == 0) {
            memcpy(buf, first.buf, (size_t)first.len);
            off = first.len;
        } else {
            put_le64(buf, prev);
        }
        int bad = 0;
        if (end - p >= 9 * block_size) {  /* room for the longest ints: no bounds checks */
            for (Py_ssize_t t = 0; t < block_size; t++) {
                int32_t v = 0;
                bad |= read_token_fast(&p, &v);
                put_le32(buf + off + 4 * t, (uint32_t)v);
            }
        } else {
            for (Py_ssize_t t = 0; t < block_size && !bad; t++) {
                int32_t v = 0;
                bad |= read_token(&p, end, &v);
                put_le32(buf + off + 4 * t, (uint32_t)v);
            }
        }
        if (bad) {
            PyErr_SetString(PyExc_ValueError, "a token id is not an int32");
            goto fail;
        }
        prev = XXH3_64bits(buf, (size_t)(off + 4 * block_size));
        PyObject *key = PyLong_FromUnsignedLongLong(prev);
        if (key == NULL) goto fail;
        PyList_SET_ITEM(out, b, key);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyMem_Free(buf);
    PyBuffer_Release(&raw);
    PyBuffer_Release(&first);
    return out;
}

static PyMethodDef methods[] = {
    {"chain_keys", chain_keys, METH_VARARGS,
     "chain_keys(tokens, block_size, first) -> list[int]: chained xxh3_64 keys of full blocks."},
    {"chain_keys_msgpack", chain_keys_msgpack, METH_VARARGS,
     "chain_keys_msgpack(raw, block_size, first, limit) -> list[int]: the keys of the first "
     "`limit` (-1: all) full blocks of a msgpack array of token ids."},
    {"msgpack_len", msgpack_len, METH_O, "msgpack_len(raw) -> int: a msgpack array's length; -1: not an array."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockkeys", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockkeys(void) { return PyModule_Create(&module); }
