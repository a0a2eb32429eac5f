/* Chained block keys (docs/block-keys.md) in one pass: the C twin of core/blocks.py.
 *
 * key_0 = xxh3_64(first ‖ tokens_0), key_i = xxh3_64(le64(key_{i-1}) ‖ tokens_i),
 * tokens as little-endian int32. `first` is the length-prefixed namespace, or the
 * 8-byte key of the parent block when a chain continues an existing one.
 *
 * `tokens` is a sequence of ints, or `bytes` whose every byte is a token id (the byte
 * tokenizer's ids of text without special tokens): the same keys, no int objects read.
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
            for (Py_ssize_t t = 0; t < block_size; t++) {
                long v = PyLong_AsLong(items[b * block_size + t]);
                if (v == -1 && PyErr_Occurred()) goto fail;
                if (v < INT32_MIN || v > INT32_MAX) {
                    PyErr_SetString(PyExc_OverflowError, "token id does not fit in int32");
                    goto fail;
                }
                put_le32(buf + off + 4 * t, (uint32_t)(int32_t)v);
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

static PyMethodDef methods[] = {
    {"chain_keys", chain_keys, METH_VARARGS,
     "chain_keys(tokens, block_size, first) -> list[int]: chained xxh3_64 keys of full blocks."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockkeys", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockkeys(void) { return PyModule_Create(&module); }
