/* Chained block keys (docs/block-keys.md) in one pass: the C twin of core/blocks.py.
 *
 * The chaining itself (what a key hashes) is core/_chain.h's, shared with core/_kv_ingest.c.
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

#include "_chain.h"
#include "_msgpack.h"

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
    Chain chain = {0};
    PyObject *out = PyList_New(n_blocks);
    if (out == NULL || chain_open(&chain, first.buf, first.len, block_size) < 0) goto fail;
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        unsigned char *dst = chain_tokens(&chain, b);
        if (octets != NULL) {
            const unsigned char *src = octets + b * block_size;
            for (Py_ssize_t t = 0; t < block_size; t++) put_le32(dst + 4 * t, src[t]);
        } else {
            PyObject **src = items + b * block_size;
            for (Py_ssize_t t = 0; t < block_size; t++) {
                int32_t v = 0;
                if (token_of(src[t], &v) < 0) goto fail;
                put_le32(dst + 4 * t, (uint32_t)v);
            }
        }
        PyObject *key = PyLong_FromUnsignedLongLong(chain_next(&chain, b));
        if (key == NULL) goto fail;
        PyList_SET_ITEM(out, b, key);
    }
    chain_close(&chain);
    Py_DECREF(seq);
    PyBuffer_Release(&first);
    return out;

fail:
    chain_close(&chain);
    Py_XDECREF(out);
    Py_DECREF(seq);
    PyBuffer_Release(&first);
    return NULL;
}

static PyObject *msgpack_len(PyObject *self, PyObject *arg) {
    Py_buffer raw;
    if (PyObject_GetBuffer(arg, &raw, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *p = raw.buf;
    Py_ssize_t count = array_header(&p, p + raw.len);
    PyBuffer_Release(&raw);
    return PyLong_FromSsize_t(count);
}

/* The tokens of `blocks` blocks from the wire into the chain, each block's key into `out`:
 * from a msgpack array of ints at *p (`packed` 0), or from int32s packed little-endian (1).
 * 0, or -1 with ValueError set (a token id that is not an int32). */
static int wire_blocks(Chain *chain, const unsigned char *p, const unsigned char *end, int packed,
                       Py_ssize_t block_size, Py_ssize_t blocks, PyObject *out) {
    Py_ssize_t bytes = 4 * block_size;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        unsigned char *dst = chain_tokens(chain, b);
        int bad = 0;
        if (packed) {
            memcpy(dst, p + b * bytes, (size_t)bytes);
        } else if (end - p >= 9 * block_size) { /* room for the longest ints: no bounds checks */
            for (Py_ssize_t t = 0; t < block_size; t++) {
                int32_t v = 0;
                bad |= read_token_fast(&p, &v);
                put_le32(dst + 4 * t, (uint32_t)v);
            }
        } else {
            for (Py_ssize_t t = 0; t < block_size && !bad; t++) {
                int32_t v = 0;
                bad |= read_token(&p, end, &v);
                put_le32(dst + 4 * t, (uint32_t)v);
            }
        }
        if (bad) {
            PyErr_SetString(PyExc_ValueError, "a token id is not an int32");
            return -1;
        }
        PyObject *key = PyLong_FromUnsignedLongLong(chain_next(chain, b));
        if (key == NULL) return -1;
        PyList_SET_ITEM(out, b, key);
    }
    return 0;
}

/* chain_keys_msgpack (`packed` 0) and chain_keys_packed (1): (tokens, block_size, first, limit). */
static PyObject *wire_keys(PyObject *args, int packed) {
    Py_buffer raw, first;
    Py_ssize_t block_size, limit;
    if (!PyArg_ParseTuple(args, "y*ny*n", &raw, &block_size, &first, &limit)) return NULL;
    PyObject *out = NULL;
    Chain chain = {0};
    const unsigned char *p = raw.buf, *end = p + raw.len;
    Py_ssize_t n_tokens = packed ? (raw.len % 4 ? -1 : raw.len / 4) : array_header(&p, end);
    if (block_size <= 0 || n_tokens < 0) {
        PyErr_SetString(PyExc_ValueError, packed ? "not packed int32s, or block_size <= 0"
                                                 : "not a msgpack array, or block_size <= 0");
        goto done;
    }
    Py_ssize_t n_blocks = n_tokens / block_size;
    if (limit >= 0 && limit < n_blocks) n_blocks = limit;
    out = PyList_New(n_blocks);
    if (out == NULL || chain_open(&chain, first.buf, first.len, block_size) < 0 ||
        wire_blocks(&chain, p, end, packed, block_size, n_blocks, out) < 0)
        Py_CLEAR(out);
done:
    chain_close(&chain);
    PyBuffer_Release(&raw);
    PyBuffer_Release(&first);
    return out;
}

static PyObject *chain_keys_msgpack(PyObject *self, PyObject *args) { return wire_keys(args, 0); }

/* chain_keys over token ids packed as little-endian int32s (core/_kv_decode.c's): the hashing
 * alone, the tokens read already. */
static PyObject *chain_keys_packed(PyObject *self, PyObject *args) { return wire_keys(args, 1); }

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
