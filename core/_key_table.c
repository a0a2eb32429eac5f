/* A map of uint64 block keys to uint64 values, the C twin of core/key_table.py (docs/compiled.md).
 *
 * The slots and their probes are core/_key_table.h's (a miss, the common case on ingest, probes
 * ~2.5 slots); keys that are not ints in [0, 2**64) (a negative int, bytes) go to a plain dict,
 * so the table answers as a dict would for any key. The batch calls (`claim`, `assign`,
 * `discard`, `add_new`) take a whole chain in one call: one probe per key and no Python in
 * between.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_key_table.h"

static PyObject *other_dict(KeyTable *t) {
    if (t->other == NULL) t->other = PyDict_New();
    return t->other;
}

/* -- the mapping: get, [], in, len, pop, clear ------------------------------------------ */

/* A new reference to the value of `key`, or NULL: absent (no error set) or an error. */
static PyObject *lookup(KeyTable *t, PyObject *key) {
    uint64_t k = 0, v = 0;
    int kind = key_of(key, &k);
    if (kind < 0) return NULL;
    if (kind == 0) {
        if (t->other == NULL) {
            PyObject_Hash(key); /* absent; a TypeError where it is unhashable, as a dict's */
            return NULL;
        }
        return Py_XNewRef(PyDict_GetItemWithError(t->other, key));
    }
    return find(t, k, &v) ? PyLong_FromUnsignedLongLong(v) : NULL;
}

static PyObject *KeyTable_get(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    PyObject *found = lookup(t, args[0]);
    if (found != NULL || PyErr_Occurred()) return found;
    return Py_NewRef(nargs == 2 ? args[1] : Py_None);
}

static PyObject *KeyTable_pop(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
        return NULL;
    }
    PyObject *found = lookup(t, args[0]);
    if (found == NULL) {
        if (PyErr_Occurred()) return NULL;
        if (nargs == 2) return Py_NewRef(args[1]);
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    uint64_t k = 0;
    if (key_of(args[0], &k) == 1) {
        erase(t, k);
    } else if (PyDict_DelItem(t->other, args[0]) < 0) {
        Py_DECREF(found);
        return NULL;
    }
    return found;
}

static PyObject *KeyTable_clear(KeyTable *t, PyObject *unused) {
    PyMem_Free(t->slots);
    Py_CLEAR(t->other);
    t->slots = NULL, t->mask = 0, t->used = 0, t->has_zero = 0;
    Py_RETURN_NONE;
}

static Py_ssize_t KeyTable_len(KeyTable *t) {
    return t->used + t->has_zero + (t->other == NULL ? 0 : PyDict_GET_SIZE(t->other));
}

static PyObject *KeyTable_subscript(KeyTable *t, PyObject *key) {
    PyObject *found = lookup(t, key);
    if (found == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
    return found;
}

static int KeyTable_ass_subscript(KeyTable *t, PyObject *key, PyObject *value) {
    uint64_t k = 0, v = 0;
    int kind = key_of(key, &k);
    if (kind < 0 || (value != NULL && value_of(value, &v) < 0)) return -1;
    if (kind == 0) {
        PyObject *other = other_dict(t);
        if (other == NULL) return -1;
        return value == NULL ? PyDict_DelItem(other, key) : PyDict_SetItem(other, key, value);
    }
    if (value == NULL) {
        if (erase(t, k)) return 0;
        PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    if (reserve(t, 1) < 0) return -1;
    put(t, k, v, 1);
    return 0;
}

static int KeyTable_contains(KeyTable *t, PyObject *key) {
    PyObject *found = lookup(t, key);
    if (found == NULL) return PyErr_Occurred() ? -1 : 0;
    Py_DECREF(found);
    return 1;
}

/* -- the batch calls over a chain of keys ----------------------------------------------- */

/* Set one key of a chain, with room reserved: put() for a uint64 int, else the dict. Returns
 * as put(), or -1: an error. */
static int put_object(KeyTable *t, PyObject *key, uint64_t value, PyObject *boxed, int replace) {
    uint64_t k = 0;
    int kind = key_of(key, &k);
    if (kind != 0) return kind < 0 ? -1 : put(t, k, value, replace);
    PyObject *other = other_dict(t);
    if (other == NULL) return -1;
    if (!replace) {
        int had = PyDict_Contains(other, key);
        if (had != 0) return had < 0 ? -1 : 0;
    }
    return PyDict_SetItem(other, key, boxed) < 0 ? -1 : 1;
}

/* What a walk does to one key: 1 go on, 0 stop there, -1 an error. */
typedef int (*KeyOp)(KeyTable *t, PyObject *key, void *arg);

typedef struct {
    uint64_t value;
    PyObject *boxed;
    int replace; /* 0: claim, which stops at a key held already */
} PutArg;

static int op_put(KeyTable *t, PyObject *key, void *arg) {
    PutArg *a = arg;
    int added = put_object(t, key, a->value, a->boxed, a->replace);
    return added < 0 ? -1 : (a->replace || added);
}

static int op_erase(KeyTable *t, PyObject *key, void *arg) {
    return KeyTable_ass_subscript(t, key, NULL) == 0 ? 1 : -1; /* KeyError where absent */
}

static int op_absent(KeyTable *t, PyObject *key, void *arg) {
    int held = KeyTable_contains(t, key);
    return held < 0 ? -1 : !held;
}

/* `op` on items[i:n] in order, with the home slots of the keys AHEAD fetched. Returns where
 * it stopped (n: at the end), or -1: an error. Inlined, so each op is a direct call. */
static inline Py_ssize_t walk(KeyTable *t, PyObject *const *items, Py_ssize_t i, Py_ssize_t n,
                              KeyOp op, void *arg) {
    for (Py_ssize_t j = i; j < i + AHEAD; j++) fetch_home(t, items, j, n);
    for (; i < n; i++) {
        fetch_home(t, items, i + AHEAD, n);
        int go = op(t, items[i], arg);
        if (go <= 0) return go < 0 ? -1 : i;
    }
    return i;
}

/* `op` over the sequence `keys` from `start`, with room for `room` keys reserved first. */
static Py_ssize_t walk_seq(KeyTable *t, PyObject *keys, Py_ssize_t start, Py_ssize_t room,
                           KeyOp op, void *arg) {
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i = start < 0 ? 0 : start;
    if (room && n > i && reserve(t, n - i) < 0)
        i = -1;
    else
        i = walk(t, PySequence_Fast_ITEMS(seq), i, n, op, arg);
    Py_DECREF(seq);
    return i;
}

static PyObject *KeyTable_claim(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t start;
    PutArg put_arg = {0, NULL, 0};
    if (nargs != 3 || ((start = PyLong_AsSsize_t(args[1])) == -1 && PyErr_Occurred()) ||
        value_of(args[2], &put_arg.value) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "claim(keys, start, value)");
        return NULL;
    }
    put_arg.boxed = args[2];
    Py_ssize_t stop = walk_seq(t, args[0], start, 1, op_put, &put_arg);
    return stop < 0 ? NULL : PyLong_FromSsize_t(stop);
}

static PyObject *KeyTable_assign(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    PutArg put_arg = {0, NULL, 1};
    if (nargs != 2 || value_of(args[1], &put_arg.value) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "assign(keys, value)");
        return NULL;
    }
    put_arg.boxed = args[1];
    if (walk_seq(t, args[0], 0, 1, op_put, &put_arg) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *KeyTable_discard(KeyTable *t, PyObject *keys) {
    if (walk_seq(t, keys, 0, 0, op_erase, NULL) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *KeyTable_add_new(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "add_new(keys, values)");
        return NULL;
    }
    PyObject *ks = PySequence_Fast(args[0], "keys must be a sequence");
    PyObject *vs = ks == NULL ? NULL : PySequence_Fast(args[1], "values must be a sequence");
    PyObject *result = NULL;
    if (vs == NULL) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ks);
    PyObject **keys = PySequence_Fast_ITEMS(ks), **values = PySequence_Fast_ITEMS(vs);
    if (PySequence_Fast_GET_SIZE(vs) != n) {
        PyErr_SetString(PyExc_ValueError, "keys and values differ in length");
        goto done;
    }
    if (reserve(t, n) < 0) goto done; /* first: room, so that the slots fetched stay put */
    Py_ssize_t absent = walk(t, keys, 0, n, op_absent, NULL); /* then: is any held? */
    if (absent < n) { /* then nothing changes */
        result = absent < 0 ? NULL : Py_NewRef(Py_False);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v;
        if (value_of(values[i], &v) < 0 || put_object(t, keys[i], v, values[i], 1) < 0) goto done;
    }
    result = Py_NewRef(Py_True);
done:
    Py_XDECREF(ks);
    Py_XDECREF(vs);
    return result;
}

/* -- the type --------------------------------------------------------------------------- */

static void KeyTable_dealloc(KeyTable *t) {
    PyMem_Free(t->slots);
    Py_XDECREF(t->other);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef KeyTable_methods[] = {
    /* the contracts: core/key_table.py's KeyMap */
    {"get", (PyCFunction)(void (*)(void))KeyTable_get, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))KeyTable_pop, METH_FASTCALL, "pop(key[, default])"},
    {"clear", (PyCFunction)KeyTable_clear, METH_NOARGS, "clear()"},
    {"claim", (PyCFunction)(void (*)(void))KeyTable_claim, METH_FASTCALL,
     "claim(keys, start, value) -> int"},
    {"assign", (PyCFunction)(void (*)(void))KeyTable_assign, METH_FASTCALL, "assign(keys, value)"},
    {"discard", (PyCFunction)KeyTable_discard, METH_O, "discard(keys)"},
    {"add_new", (PyCFunction)(void (*)(void))KeyTable_add_new, METH_FASTCALL,
     "add_new(keys, values) -> bool"},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods KeyTable_mapping = {
    (lenfunc)KeyTable_len, (binaryfunc)KeyTable_subscript, (objobjargproc)KeyTable_ass_subscript};

static PySequenceMethods KeyTable_sequence = {.sq_contains = (objobjproc)KeyTable_contains};

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "core._key_table.KeyTable",
    .tp_basicsize = sizeof(KeyTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A map of uint64 block keys to uint64 values (core/key_table.py).",
    .tp_new = PyType_GenericNew, /* zeroed: empty */
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_methods = KeyTable_methods,
    .tp_as_mapping = &KeyTable_mapping,
    .tp_as_sequence = &KeyTable_sequence,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_key_table", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__key_table(void) {
    if (PyType_Ready(&KeyTableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "KeyTable", (PyObject *)&KeyTableType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
