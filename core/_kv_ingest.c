/* The KV mirror's common case in C, a batch's events in one call (router/kv_mirror.py,
 * docs/kv-events.md "The mirror: re-keying").
 *
 * `keyed(events, start, table, block_size, ops)` walks events[start:] as decoded for ingest
 * (core/_kv_decode.c) and, for each one the mirror's Python would handle without a choice,
 * does its work on the engine-hash -> key table (core/_key_table.h) and says what the index
 * must do, as an op of three items appended to the list `ops` (emptied first: one list the
 * mirror keeps, no tuple per event for the garbage collector to count):
 *
 *   (STORED, keys, parent key | None)   a BlockStored of the base group keyed from its tokens,
 *                                       its parent known (in the table) or none, its engine
 *                                       hashes mapped to its keys when they are not the keys
 *   (LOOKUP, keys, parent hash)         one whose parent is not in the table and whose hashes
 *                                       are its keys (our hashing, the table empty): the
 *                                       mirror asks the index whether it holds the parent
 *   (REMOVED, keys, None)               a BlockRemoved, its hashes popped from the table
 *
 * It stops at the first event that needs anything else (another medium, a LoRA, extra keys,
 * a block size or token count off, a hash that is not a uint64, a parent it cannot place, a
 * hash mapped already, AllBlocksCleared, a record of another type) and returns where: the
 * mirror's Python handles that one and calls again after it. An event stopped at is left
 * untouched, so the two paths make the same table and the same index. The caller checks what
 * makes the rest of the mirror's state irrelevant (no LoRA or host-tier hashes, not own_keys,
 * GPU and None media, cache groups None and 0).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_chain.h"
#include "_key_table.h"
#include "_slots.h"

enum { STORED, LOOKUP, REMOVED };

/* The records' classes and where their fields lie (msgspec Structs: slots, member
 * descriptors), from set_types(). */
static PyTypeObject *Packed, *Removed, *Table;
enum { HASHES, PARENT, TOKENS, BLOCK_SIZE, LORA_ID, MEDIUM, LORA_NAME, EXTRA, GROUP, N_STORED };
static const char *const STORED_FIELDS[N_STORED] = {"block_hashes", "parent_block_hash",
    "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx"};
static Py_ssize_t stored_at[N_STORED], removed_at[3]; /* BlockRemoved: hashes, medium, group */

/* The medium and cache group the fast path takes: GPU or unset, group 0 or unset. */
static int plain_place(PyObject *medium, PyObject *group) {
    if (medium == NULL || group == NULL) return 0;
    if (medium != Py_None &&
        !(PyUnicode_CheckExact(medium) && PyUnicode_CompareWithASCIIString(medium, "GPU") == 0))
        return 0;
    return group == Py_None || (PyLong_CheckExact(group) && Py_SIZE(group) == 0);
}

/* The engine hashes as uint64s into out[0:n]; 0 where one is not a uint64 int (exactly: the
 * mirror's Python treats a bool or a subclass as a key of its own). */
static int read_hashes(PyObject *list, uint64_t *out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyList_GET_ITEM(list, i);
        if (!PyLong_CheckExact(h) || key_of(h, &out[i]) != 1) {
            PyErr_Clear(); /* an error reading it is a reason to stop, not a failure */
            return 0;
        }
    }
    return 1;
}

/* ops += [kind, keys, parent], the references stolen (NULL: an error, set). 0, or -1. */
static int append_op(PyObject *ops, int kind, PyObject *keys, PyObject *parent) {
    PyObject *items[3] = {PyLong_FromLong(kind), keys, parent};
    int failed = items[0] == NULL || keys == NULL || parent == NULL;
    for (int i = 0; i < 3; i++) {
        failed = failed || PyList_Append(ops, items[i]) < 0;
        Py_XDECREF(items[i]);
    }
    return failed ? -1 : 0;
}

/* A list of `n` ints. */
static PyObject *int_list(const uint64_t *values, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(values[i]);
        if (v == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static Py_ssize_t table_len(const KeyTable *t) {
    return t->used + t->has_zero + (t->other == NULL ? 0 : PyDict_GET_SIZE(t->other));
}

#define LOCAL_BLOCKS 64 /* blocks per event keyed without an allocation */

/* One BlockStored (a BlockStoredPacked). 1: done, its op appended; 0: not the common case,
 * nothing changed; -1: an error (no memory). `block_size` < 0: trust the event's. */
static int stored(KeyTable *t, PyObject *ev, Py_ssize_t block_size, PyObject *ops) {
    PyObject *f[N_STORED];
    for (int i = 0; i < N_STORED; i++)
        if ((f[i] = slot_get(ev, stored_at[i])) == NULL) return 0;
    if (!plain_place(f[MEDIUM], f[GROUP]) || f[LORA_ID] != Py_None || f[LORA_NAME] != Py_None ||
        f[EXTRA] != Py_None || !PyList_CheckExact(f[HASHES]) || !PyBytes_CheckExact(f[TOKENS]) ||
        !PyLong_CheckExact(f[BLOCK_SIZE]))
        return 0;
    Py_ssize_t n = PyList_GET_SIZE(f[HASHES]), bs = PyLong_AsSsize_t(f[BLOCK_SIZE]);
    Py_ssize_t tokens = PyBytes_GET_SIZE(f[TOKENS]) >> 2;
    if (bs == -1 && PyErr_Occurred()) PyErr_Clear();
    if (n == 0 || bs <= 0 || (block_size >= 0 && bs != block_size) || tokens % n != 0 ||
        tokens / n != bs) /* tokens == n * bs, without overflow */
        return 0;         /* the mirror counts it unkeyable */

    uint64_t local[2 * LOCAL_BLOCKS], *hashes = local;
    if (n > LOCAL_BLOCKS && (hashes = PyMem_Malloc(2 * (size_t)n * sizeof(uint64_t))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    uint64_t *keys = hashes + n, parent = 0;
    int kind = STORED, done = 0;
    unsigned char head[8];
    const unsigned char *first = (const unsigned char *)"\0\0\0\0"; /* namespace(None) */
    Py_ssize_t first_len = 4;
    if (!read_hashes(f[HASHES], hashes, n)) goto out;
    if (reserve(t, n) < 0) { /* room first (the contents stay), so the slots fetched stay put */
        done = -1;
        goto out;
    }
#if defined(__GNUC__)
    /* the hashes miss the cache (the table is large): fetch their slots while keying */
    for (Py_ssize_t i = 0; i < n; i++) __builtin_prefetch(&t->slots[mix(hashes[i]) & t->mask]);
#endif
    if (f[PARENT] != Py_None) {
        if (!PyLong_CheckExact(f[PARENT]) || key_of(f[PARENT], &parent) != 1) {
            PyErr_Clear();
            goto out;
        }
        uint64_t mapped;
        if (find(t, parent, &mapped)) parent = mapped; /* the parent's key */
        else kind = LOOKUP;                            /* ours? the parent hash is its key */
        put_le64(head, parent);                        /* parent_prefix(parent key) */
        first = head, first_len = 8;
    }
    Chain chain;
    if (chain_open(&chain, first, first_len, bs) < 0) {
        done = -1;
        goto out;
    }
    const unsigned char *packed = (const unsigned char *)PyBytes_AS_STRING(f[TOKENS]);
    for (Py_ssize_t b = 0; b < n; b++) {
        memcpy(chain_tokens(&chain, b), packed + 4 * bs * b, (size_t)(4 * bs));
        keys[b] = chain_next(&chain, b);
    }
    chain_close(&chain);

    /* the mirror's _remember: our own hashing needs no entry while the table is empty */
    int identity = table_len(t) == 0 && memcmp(hashes, keys, (size_t)n * sizeof(uint64_t)) == 0;
    if (!identity) {
        if (kind == LOOKUP) goto out; /* a parent only the mirror's Python can place */
        uint64_t held;
        for (Py_ssize_t i = 0; i < n; i++)
            if (find(t, hashes[i], &held)) goto out; /* a conflict: the Python sorts it out */
        for (Py_ssize_t i = 0; i < n; i++) put(t, hashes[i], keys[i], 1);
    }
    PyObject *parent_obj = kind == LOOKUP ? Py_NewRef(f[PARENT])
                           : f[PARENT] == Py_None ? Py_NewRef(Py_None)
                                                  : PyLong_FromUnsignedLongLong(parent);
    done = append_op(ops, kind, int_list(keys, n), parent_obj) < 0 ? -1 : 1;
out:
    if (hashes != local) PyMem_Free(hashes);
    return done;
}

/* One BlockRemoved, as stored(): its hashes popped from the table; a hash not there is its own
 * key (ours, or never seen: then the index holds nothing to remove). No op for no hashes. */
static int removed(KeyTable *t, PyObject *ev, PyObject *ops) {
    PyObject *list = slot_get(ev, removed_at[0]);
    if (list == NULL || !PyList_CheckExact(list) ||
        !plain_place(slot_get(ev, removed_at[1]), slot_get(ev, removed_at[2])))
        return 0;
    Py_ssize_t n = PyList_GET_SIZE(list);
    uint64_t local[LOCAL_BLOCKS], *keys = local;
    if (n > LOCAL_BLOCKS && (keys = PyMem_Malloc((size_t)n * sizeof(uint64_t))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int done = 0;
    if (read_hashes(list, keys, n)) {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t key;
            if (find(t, keys[i], &key)) {
                erase(t, keys[i]);
                keys[i] = key;
            }
        }
        done = n > 0 && append_op(ops, REMOVED, int_list(keys, n), Py_NewRef(Py_None)) < 0 ? -1 : 1;
    }
    if (keys != local) PyMem_Free(keys);
    return done;
}

static PyObject *keyed(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t start, block_size;
    if (Packed == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "set_types() first");
        return NULL;
    }
    if (nargs != 5 || !PyList_CheckExact(args[0]) || Py_TYPE(args[2]) != Table ||
        !PyList_CheckExact(args[4]) ||
        ((start = PyLong_AsSsize_t(args[1])) == -1 && PyErr_Occurred()) ||
        ((block_size = PyLong_AsSsize_t(args[3])) == -1 && PyErr_Occurred())) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError,
                            "keyed(events: list, start, table: KeyTable, block_size, ops: list)");
        return NULL;
    }
    PyObject *events = args[0], *ops = args[4];
    KeyTable *t = (KeyTable *)args[2];
    if (PyList_SetSlice(ops, 0, PyList_GET_SIZE(ops), NULL) < 0) return NULL;
    Py_ssize_t i = start < 0 ? 0 : start;
    for (; i < PyList_GET_SIZE(events); i++) {
        PyObject *ev = PyList_GET_ITEM(events, i);
        int r = Py_TYPE(ev) == Packed    ? stored(t, ev, block_size, ops)
                : Py_TYPE(ev) == Removed ? removed(t, ev, ops)
                                         : 0;
        if (r < 0) return NULL;
        if (r == 0) break;
    }
    return PyLong_FromSsize_t(i);
}

static PyObject *set_types(PyObject *self, PyObject *args) {
    static const char *const REMOVED_FIELDS[3] = {"block_hashes", "medium", "group_idx"};
    PyTypeObject *packed, *removed_cls, *table;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyType_Type, &packed, &PyType_Type, &removed_cls,
                          &PyType_Type, &table))
        return NULL;
    if (strcmp(table->tp_name, "core._key_table.KeyTable") != 0 ||
        table->tp_basicsize != sizeof(KeyTable)) {
        PyErr_SetString(PyExc_TypeError, "the table must be core._key_table.KeyTable");
        return NULL;
    }
    if (slot_offsets(packed, STORED_FIELDS, N_STORED, stored_at) < 0 ||
        slot_offsets(removed_cls, REMOVED_FIELDS, 3, removed_at) < 0)
        return NULL;
    Py_XSETREF(Packed, (PyTypeObject *)Py_NewRef(packed));
    Py_XSETREF(Removed, (PyTypeObject *)Py_NewRef(removed_cls));
    Py_XSETREF(Table, (PyTypeObject *)Py_NewRef(table));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"keyed", (PyCFunction)(void (*)(void))keyed, METH_FASTCALL,
     "keyed(events, start, table, block_size, ops) -> stop: the mirror's common case."},
    {"set_types", set_types, METH_VARARGS,
     "set_types(BlockStoredPacked, BlockRemoved, KeyTable): the classes it reads and writes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kv_ingest", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kv_ingest(void) { return PyModule_Create(&module); }
