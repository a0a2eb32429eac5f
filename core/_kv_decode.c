/* vLLM's KV-event batch as the gateway ingests it, in one pass: the C twin of the fast path of
 * core/kv_events.py `decode_for_ingest` (docs/kv-events.md).
 *
 * A positional batch [ts, [events...], dp_rank?] whose events are tagged maps, each BlockStored
 * made a BlockStoredPacked: its token ids read once, as int32s, into bytes (msgspec leaves them
 * raw only by skipping them, an int at a time, and the keys read them again). Whatever this does not know exactly (another field, a field twice, a value of
 * another kind, an event type it lacks) returns None: msgspec decodes that payload as before,
 * so both paths give equal events.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_msgpack.h"
#include "_slots.h"

static PyObject *Stored, *Removed, *Cleared; /* the classes, from set_types() */
static PyTypeObject *Batch;                 /* EventBatch, made as its __init__ would */
static const char *const BATCH_FIELDS[4] = {"ts", "events", "dp_rank", "unknown_events"};
static Py_ssize_t batch_at[4];

typedef struct {
    const unsigned char *p, *end;
} Reader;

/* The length of the array (0x90) or map (0x80) at r->p, moving past its header; -1: not one. */
static Py_ssize_t header(Reader *r, unsigned char fix) {
    if (r->p >= r->end) return -1;
    unsigned char c = *r->p;
    if ((c & 0xf0) == fix) {
        r->p++;
        return c & 0x0f;
    }
    /* array16/32: 0xdc/0xdd, map16/32: 0xde/0xdf */
    int n = fix == 0x90 ? (c == 0xdc ? 2 : c == 0xdd ? 4 : 0) : (c == 0xde ? 2 : c == 0xdf ? 4 : 0);
    if (n == 0 || r->end - r->p < 1 + n) return -1;
    Py_ssize_t count = (Py_ssize_t)be(r->p + 1, n);
    r->p += 1 + n;
    return count;
}

/* A str at r->p, or a bin (0xc4-0xc6) where `bin`: its bytes in *s, *n; -1: not one. */
static int span(Reader *r, int bin, const char **s, Py_ssize_t *n) {
    if (r->p >= r->end) return -1;
    unsigned char c = *r->p;
    int size = 0;
    Py_ssize_t len;
    if (!bin && (c & 0xe0) == 0xa0) {
        len = c & 0x1f;
    } else {
        unsigned char first = bin ? 0xc4 : 0xd9; /* 8, 16, 32-bit lengths */
        if (c < first || c > first + 2) return -1;
        size = 1 << (c - first);
        if (r->end - r->p < 1 + size) return -1;
        len = (Py_ssize_t)be(r->p + 1, size);
    }
    if (r->end - r->p - 1 - size < len) return -1;
    *s = (const char *)r->p + 1 + size;
    *n = len;
    r->p += 1 + size + len;
    return 0;
}

static int is_nil(Reader *r) {
    if (r->p < r->end && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    return 0;
}

/* The length in bytes of the int at p (fixints, 0xcc-0xd3); 0: not an int. */
static int int_size(unsigned char c) {
    if (c <= 0x7f || c >= 0xe0) return 1;
    if (c >= 0xcc && c <= 0xcf) return 1 + (1 << (c - 0xcc));
    if (c >= 0xd0 && c <= 0xd3) return 1 + (1 << (c - 0xd0));
    return 0;
}

/* A new int from the int at r->p; NULL: not an int (or no memory). */
static PyObject *read_int(Reader *r) {
    if (r->p >= r->end) return NULL;
    unsigned char c = *r->p;
    int n = int_size(c);
    if (n == 0 || r->end - r->p < n) return NULL;
    const unsigned char *q = r->p + 1;
    r->p += n;
    if (c <= 0x7f) return PyLong_FromLong(c);
    if (c >= 0xe0) return PyLong_FromLong((int8_t)c);
    if (c <= 0xcf) return PyLong_FromUnsignedLongLong(be(q, n - 1));
    uint64_t u = be(q, n - 1); /* signed: sign-extend from n - 1 bytes */
    int shift = 64 - 8 * (n - 1);
    return PyLong_FromLongLong(shift ? (int64_t)(u << shift) >> shift : (int64_t)u);
}

static PyObject *opt_int(Reader *r) { return is_nil(r) ? Py_NewRef(Py_None) : read_int(r); }

static PyObject *gpu; /* "GPU", the medium of nearly every event: made once */

static PyObject *opt_str(Reader *r) {
    const char *s;
    Py_ssize_t n;
    if (is_nil(r)) return Py_NewRef(Py_None);
    if (span(r, 0, &s, &n) < 0) return NULL;
    if (n == 3 && memcmp(s, "GPU", 3) == 0) return Py_NewRef(gpu);
    return PyUnicode_DecodeUTF8(s, n, NULL);
}

/* An engine hash: an int, or bytes (a bin). */
static PyObject *read_hash(Reader *r) {
    const char *s;
    Py_ssize_t n;
    if (r->p < r->end && *r->p >= 0xc4 && *r->p <= 0xc6)
        return span(r, 1, &s, &n) < 0 ? NULL : PyBytes_FromStringAndSize(s, n);
    return read_int(r);
}

static PyObject *hashes(Reader *r) {
    Py_ssize_t n = header(r, 0x90);
    if (n < 0 || n > r->end - r->p) return NULL;
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *h = read_hash(r);
        if (h == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, h);
    }
    return out;
}

/* The token ids as int32s, little-endian, 4 bytes each (a BlockStoredPacked's): read once
 * here, so that keying them is hashing alone; NULL where one is not an int32. */
static PyObject *packed_ints(Reader *r) {
    Py_ssize_t n = header(r, 0x90);
    if (n < 0 || n > r->end - r->p) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, 4 * n);
    if (out == NULL) return NULL;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t v;
        if (read_token(&r->p, r->end, &v) < 0) {
            Py_DECREF(out);
            return NULL;
        }
        uint32_t u = (uint32_t)v;
        dst[4 * i] = (unsigned char)u, dst[4 * i + 1] = (unsigned char)(u >> 8);
        dst[4 * i + 2] = (unsigned char)(u >> 16), dst[4 * i + 3] = (unsigned char)(u >> 24);
    }
    return out;
}

/* The fields of each event type in its class's order, and how each is read. */
enum { HASHES, HASH, TOKENS, INT, OPT_INT, OPT_STR, NIL };
typedef struct {
    const char *name;
    size_t len;
    int kind, required;
} Field;
#define FIELD(name, kind, required) {name, sizeof(name) - 1, kind, required}
static const Field STORED[] = {FIELD("block_hashes", HASHES, 1),
    FIELD("parent_block_hash", HASH, 1), FIELD("token_ids", TOKENS, 1),
    FIELD("block_size", INT, 1), FIELD("lora_id", OPT_INT, 0), FIELD("medium", OPT_STR, 0),
    FIELD("lora_name", OPT_STR, 0), FIELD("extra_keys", NIL, 0), FIELD("group_idx", OPT_INT, 0)};
static const Field REMOVED[] = {FIELD("block_hashes", HASHES, 1), FIELD("medium", OPT_STR, 0),
    FIELD("group_idx", OPT_INT, 0)};

static PyObject *read_value(Reader *r, int kind) {
    switch (kind) {
    case HASHES: return hashes(r);
    case HASH: return is_nil(r) ? Py_NewRef(Py_None) : read_hash(r);
    case TOKENS: return packed_ints(r);
    case INT: return read_int(r);
    case OPT_INT: return opt_int(r);
    case OPT_STR: return opt_str(r);
    default: return is_nil(r) ? Py_NewRef(Py_None) : NULL; /* extra keys: msgspec's path */
    }
}

#define MAX_FIELDS 9

static PyObject *read_event(Reader *r) {
    Py_ssize_t n = header(r, 0x80);
    const char *s;
    Py_ssize_t len;
    if (n < 1 || span(r, 0, &s, &len) < 0 || len != 4 || memcmp(s, "type", 4) != 0 ||
        span(r, 0, &s, &len) < 0)
        return NULL; /* the tag first, as msgspec writes it */
    const Field *fields = NULL;
    int count = 0;
    PyObject *cls = NULL;
    if (len == 11 && memcmp(s, "BlockStored", 11) == 0) fields = STORED, count = 9, cls = Stored;
    else if (len == 12 && memcmp(s, "BlockRemoved", 12) == 0)
        fields = REMOVED, count = 3, cls = Removed;
    else if (len == 16 && memcmp(s, "AllBlocksCleared", 16) == 0) cls = Cleared;
    else return NULL;
    PyObject *values[MAX_FIELDS] = {NULL};
    PyObject *event = NULL;
    int next = 0; /* the field expected next: vLLM writes them in the class's order */
    for (Py_ssize_t i = 1; i < n; i++) {
        if (span(r, 0, &s, &len) < 0) goto done;
        int f = next, tried = 0;
        for (; tried < count; tried++, f = (f + 1) % count)
            if (fields[f].len == (size_t)len && memcmp(fields[f].name, s, (size_t)len) == 0) break;
        if (tried == count || values[f] != NULL) goto done; /* unknown, or twice */
        next = (f + 1) % count;
        if ((values[f] = read_value(r, fields[f].kind)) == NULL) goto done;
    }
    for (int f = 0; f < count; f++) {
        if (values[f] == NULL) {
            if (fields[f].required) goto done;
            values[f] = Py_NewRef(Py_None);
        }
    }
    event = PyObject_Vectorcall(cls, values, (size_t)count, NULL);
done:
    for (int f = 0; f < count; f++) Py_XDECREF(values[f]);
    return event;
}

static PyObject *decode(Reader *r) {
    Py_ssize_t n = header(r, 0x90);
    if ((n != 2 && n != 3) || r->end - r->p < 9 || *r->p != 0xcb) return NULL;
    union {
        uint64_t u;
        double d;
    } ts = {be(r->p + 1, 8)};
    r->p += 9;
    Py_ssize_t n_events = header(r, 0x90);
    if (n_events < 0 || n_events > r->end - r->p) return NULL;
    PyObject *events = PyList_New(n_events);
    for (Py_ssize_t i = 0; events != NULL && i < n_events; i++) {
        PyObject *ev = read_event(r);
        if (ev == NULL) Py_CLEAR(events);
        else PyList_SET_ITEM(events, i, ev);
    }
    PyObject *rank = events == NULL ? NULL : n == 3 ? opt_int(r) : Py_NewRef(Py_None);
    PyObject *out = rank == NULL || r->p != r->end ? NULL : Batch->tp_alloc(Batch, 0);
    PyObject *values[4] = {out == NULL ? NULL : PyFloat_FromDouble(ts.d), events, rank,
                           PyLong_FromLong(0)};
    if (out != NULL && values[0] != NULL && values[3] != NULL) {
        for (int i = 0; i < 4; i++) slot_init(out, batch_at[i], values[i]); /* stolen */
        return out;
    }
    Py_XDECREF(out);
    for (int i = 0; i < 4; i++) Py_XDECREF(values[i]);
    return NULL;
}

static PyObject *decode_batch(PyObject *self, PyObject *arg) {
    Py_buffer buf;
    if (Stored == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "set_types() first");
        return NULL;
    }
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0) return NULL;
    Reader r = {buf.buf, (const unsigned char *)buf.buf + buf.len};
    PyObject *out = decode(&r);
    PyBuffer_Release(&buf);
    if (out == NULL) { /* not exactly the shape this knows: msgspec's turn */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return out;
}

static PyObject *set_types(PyObject *self, PyObject *args) {
    PyObject *s, *rm, *c;
    PyTypeObject *batch;
    if (!PyArg_ParseTuple(args, "OOOO!", &s, &rm, &c, &PyType_Type, &batch) ||
        slot_offsets(batch, BATCH_FIELDS, 4, batch_at) < 0)
        return NULL;
    Py_XSETREF(Batch, (PyTypeObject *)Py_NewRef(batch));
    Py_XSETREF(Stored, Py_NewRef(s));
    Py_XSETREF(Removed, Py_NewRef(rm));
    Py_XSETREF(Cleared, Py_NewRef(c));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode_batch", decode_batch, METH_O,
     "decode_batch(payload) -> EventBatch | None: None where msgspec must decode it."},
    {"set_types", set_types, METH_VARARGS,
     "set_types(BlockStoredPacked, BlockRemoved, AllBlocksCleared, EventBatch): the classes "
     "made (EventBatch as its __init__ would: its four slots set)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kv_decode", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kv_decode(void) {
    if (gpu == NULL && (gpu = PyUnicode_InternFromString("GPU")) == NULL) return NULL;
    return PyModule_Create(&module);
}
