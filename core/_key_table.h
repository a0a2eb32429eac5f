/* The uint64 key table's layout and its probes (docs/compiled.md): shared by core/_key_table.c,
 * which makes it a Python type, and core/_kv_ingest.c, which maps a KV event's engine hashes
 * in it directly. Open addressing with linear probing and backward-shift deletion (no
 * tombstones): one 16-byte slot per key, at most half full. Key 0 marks an empty slot; the key
 * 0 itself lives beside the slots; keys that are not uint64 ints go to a plain dict. */
#ifndef URC_KEY_TABLE_H
#define URC_KEY_TABLE_H
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

static inline int resize(KeyTable *t, uint64_t capacity) {
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
static inline int reserve(KeyTable *t, Py_ssize_t more) {
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
static inline int erase(KeyTable *t, uint64_t key) {
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

#endif
