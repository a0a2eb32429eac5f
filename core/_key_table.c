/* A map of uint64 block keys to uint64 values, the C twin of core/key_table.py (docs/compiled.md).
 *
 * Open addressing with linear probing and backward-shift deletion (no tombstones): one 16-byte
 * slot per key, at most half full (a miss, the common case on ingest, probes ~2.5 slots). Key 0
 * marks an empty slot; the key 0 itself lives beside the slots. Keys that are not ints in [0, 2**64) (a negative int, bytes) go to a plain dict, so the
 * table answers as a dict would for any key. The batch calls (`claim`, `assign`, `discard`,
 * `add_new`) take a whole chain in one call: one probe per key and no Python in between.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    uint64_t key;
    uint64_t value;
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    uint64_t mask;      /* capacity - 1; capacity a power of two */
    Py_ssize_t used;    /* keys in the slots */
    int has_zero;       /* the key 0 is held: its value in zero_value */
    uint64_t zero_value;
    PyObject *other;    /* dict of keys that are not uint64 ints; NULL until one comes */
} KeyTable;

#define MIN_CAPACITY 16

static inline uint64_t mix(uint64_t x) { /* keys may be small and sequential (tests) */
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return x;
}

/* 1: `o` is an int in [0, 2**64), in *out, read in place (3.11's layout:
 * PyLong_AsUnsignedLongLong goes through a byte array); 0: it is not, or not read so. */
static inline int read_uint64(PyObject *o, uint64_t *out) {
#if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
    if (PyLong_CheckExact(o)) {
        Py_ssize_t size = Py_SIZE(o);
        const digit *d = ((PyLongObject *)o)->ob_digit;
        if (size >= 0 && size <= 2) {
            *out = size == 0 ? 0 : size == 1 ? d[0] : (uint64_t)d[1] << 30 | d[0];
            return 1;
        }
        if (size == 3 && d[2] < 16) { /* 4 + 2 * 30 bits */
            *out = (uint64_t)d[2] << 60 | (uint64_t)d[1] << 30 | d[0];
            return 1;
        }
    }
#endif
    return 0;
}

/* 1: `o` is a uint64 int, in *out; 0: another key (the dict's); -1: an error. */
static inline int key_of(PyObject *o, uint64_t *out) {
    if (read_uint64(o, out)) return 1;
    if (!PyLong_Check(o)) return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear(); /* negative, or past 64 bits */
        return 0;
    }
    *out = v;
    return 1;
}

/* 0: `o` is a value (a uint64 int), in *out; -1: an error, set. */
static inline int value_of(PyObject *o, uint64_t *out) {
    int kind = key_of(o, out);
    if (kind == 0) PyLong_AsUnsignedLongLong(o); /* raises: OverflowError, or TypeError */
    return kind == 1 ? 0 : -1;
}

/* A chain's keys miss the cache (they are hashes); the batch calls fetch the home slots of the
 * keys AHEAD of the one they probe, so that the misses overlap. */
#define AHEAD 16

static inline void fetch_home(const KeyTable *t, PyObject *const *items, Py_ssize_t i,
                              Py_ssize_t n) {
#if defined(__GNUC__)
    uint64_t k;
    if (i < n && t->slots != NULL && read_uint64(items[i], &k))
        __builtin_prefetch(&t->slots[mix(k) & t->mask]);
#endif
}

/* The slot holding `key` (nonzero), or the empty slot where it would go. */
static inline Slot *probe(const KeyTable *t, uint64_t key) {
    uint64_t i = mix(key) & t->mask;
    for (;;) {
        Slot *s = &t->slots[i];
        if (s->key == key || s->key == 0) return s;
        i = (i + 1) & t->mask;
    }
}

static int resize(KeyTable *t, uint64_t capacity) {
    Slot *old = t->slots;
    uint64_t old_capacity = old == NULL ? 0 : t->mask + 1;
    Slot *slots = PyMem_Calloc((size_t)capacity, sizeof(Slot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->slots = slots;
    t->mask = capacity - 1;
    for (uint64_t i = 0; i < old_capacity; i++) {
        if (old[i].key != 0) *probe(t, old[i].key) = old[i];
    }
    PyMem_Free(old);
    return 0;
}

/* Room for `more` keys beyond those held. */
static int reserve(KeyTable *t, Py_ssize_t more) {
    uint64_t need = (uint64_t)(t->used + more);
    uint64_t capacity = t->slots == NULL ? MIN_CAPACITY : t->mask + 1;
    while (need * 2 > capacity) capacity *= 2;
    if (t->slots != NULL && capacity == t->mask + 1) return 0;
    return resize(t, capacity);
}

/* 1: found, its value in *value; 0: absent. */
static inline int find(const KeyTable *t, uint64_t key, uint64_t *value) {
    if (key == 0) {
        *value = t->zero_value;
        return t->has_zero;
    }
    if (t->slots == NULL) return 0;
    Slot *s = probe(t, key);
    *value = s->value;
    return s->key != 0;
}

/* Set key -> value, with room reserved; `replace` 0: keep a value already there. 1: added,
 * 0: was there. */
static inline int put(KeyTable *t, uint64_t key, uint64_t value, int replace) {
    if (key == 0) {
        int added = !t->has_zero;
        if (added || replace) t->zero_value = value;
        t->has_zero = 1;
        return added;
    }
    Slot *s = probe(t, key);
    if (s->key != 0) {
        if (replace) s->value = value;
        return 0;
    }
    s->key = key;
    s->value = value;
    t->used++;
    return 1;
}

/* 1: removed, 0: absent. Later keys of the cluster shift back into the hole. */
static int erase(KeyTable *t, uint64_t key) {
    if (key == 0) {
        int had = t->has_zero;
        t->has_zero = 0;
        return had;
    }
    if (t->slots == NULL) return 0;
    Slot *hole = probe(t, key);
    if (hole->key == 0) return 0;
    uint64_t i = (uint64_t)(hole - t->slots), j = i;
    for (;;) {
        j = (j + 1) & t->mask;
        Slot *s = &t->slots[j];
        if (s->key == 0) break;
        uint64_t home = mix(s->key) & t->mask;
        /* s may move to i only if its home is not within (i, j] (cyclically) */
        if ((j > i) ? (home <= i || home > j) : (home <= i && home > j)) {
            t->slots[i] = *s;
            i = j;
        }
    }
    t->slots[i].key = 0;
    t->slots[i].value = 0;
    t->used--;
    return 1;
}

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
