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

#include "_msgpack.h"

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

/* chain_keys over token ids packed as little-endian int32s (core/_kv_decode.c's): the hashing
 * alone, the tokens read already. */
static PyObject *chain_keys_packed(PyObject *self, PyObject *args) {
    Py_buffer packed, first;
    Py_ssize_t block_size, limit;
    if (!PyArg_ParseTuple(args, "y*ny*n", &packed, &block_size, &first, &limit)) return NULL;
    PyObject *out = NULL;
    unsigned char *buf = NULL;
    if (block_size <= 0 || packed.len % 4) {
        PyErr_SetString(PyExc_ValueError, "not packed int32s, or block_size <= 0");
        goto done;
    }
    Py_ssize_t n_blocks = packed.len / 4 / block_size;
    if (limit >= 0 && limit < n_blocks) n_blocks = limit;
    Py_ssize_t head = first.len > 8 ? first.len : 8, bytes = 4 * block_size;
    buf = PyMem_Malloc((size_t)(head + bytes));
    out = PyList_New(n_blocks);
    if (buf == NULL || out == NULL) {
        Py_CLEAR(out);
        goto done;
    }
    const unsigned char *src = packed.buf;
    uint64_t prev = 0;
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        Py_ssize_t off = 8;
        if (b == 0) {
            memcpy(buf, first.buf, (size_t)first.len);
            off = first.len;
        } else {
            put_le64(buf, prev);
        }
        memcpy(buf + off, src + b * bytes, (size_t)bytes);
        prev = XXH3_64bits(buf, (size_t)(off + bytes));
        PyObject *key = PyLong_FromUnsignedLongLong(prev);
        if (key == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, b, key);
    }
done:
    PyMem_Free(buf);
    PyBuffer_Release(&packed);
    PyBuffer_Release(&first);
    return out;
}

static PyMethodDef methods[] = {
    {"chain_keys", chain_keys, METH_VARARGS,
     "chain_keys(tokens, block_size, first) -> list[int]: chained xxh3_64 keys of full blocks."},
    {"chain_keys_msgpack", chain_keys_msgpack, METH_VARARGS,
     "chain_keys_msgpack(raw, block_size, first, limit) -> list[int]: the keys of the first "
     "`limit` (-1: all) full blocks of a msgpack array of token ids."},
    {"chain_keys_packed", chain_keys_packed, METH_VARARGS,
     "chain_keys_packed(packed, block_size, first, limit) -> list[int]: chain_keys of int32s "
     "packed little-endian."},
    {"msgpack_len", msgpack_len, METH_O, "msgpack_len(raw) -> int: a msgpack array's length; -1: not an array."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockkeys", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockkeys(void) { return PyModule_Create(&module); }
